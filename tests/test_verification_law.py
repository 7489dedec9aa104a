"""Exact-law tests of speculative decoding: propose -> verify rounds reproduce the target's law.

Every test decodes L = 3 tokens for N = 200,000 sampled rows and 40,000 greedy rows in the same batches
(one row in six is greedy: half by temperature 0, half by top_k = 1) through repeated
`sample_block` -> `verify` rounds of a toy pair (`dspark_jax.testing.toy_markov`): a Markov target over V = 6
tokens and a real DSpark draft (vanilla sequential head) whose law differs from it. The sampled rows'
3-token sequences are compared with the target's exact autoregressive law (`law_checks.chain_law`,
float64 enumeration of all (V+1)^3 outcomes) by Pearson chi-square; the test fails at p < 1e-3.
Each test also checks its power: the same counts must reject a wrong law at p < 1e-6. Greedy rows must
equal greedy autoregressive decoding exactly. Seeds are fixed, so the suite is deterministic.
Tests marked "compact" run twice: with the stored corrected logits, and with blocks that keep a
`proposal.CompactLogits` instead (each token's log q; the verifier recomputes the rejected row).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import law_checks
from dspark_jax.testing import toy_markov
from tests import stats

VOCAB, LENGTH, START = 6, 3, 1
N_SAMPLED, GREEDY_EVERY = 200_000, 6
ROWS = N_SAMPLED * GREEDY_EVERY // (GREEDY_EVERY - 1)  # 240,000 rows, 40,000 of them greedy
KEY = jax.random.key(2026)
compact = pytest.mark.parametrize("store_logits", [True, False], ids=["stored", "compact"])


def mixed_params(temperature, top_k=0, top_p=1.0):
  """240,000 rows: sampled rows with the given parameters, every sixth row greedy."""
  row = np.arange(ROWS)
  greedy = row % GREEDY_EVERY == GREEDY_EVERY - 1
  by_top_k = greedy & (row // GREEDY_EVERY % 2 == 0)  # greedy through top_k = 1 at temperature 1
  temperature = np.where(greedy & ~by_top_k, 0.0, np.where(by_top_k, 1.0, temperature))
  top_k = np.where(by_top_k, 1, np.where(greedy, 0, top_k))
  params = dj.SamplingParams(temperature=temperature, top_k=top_k, top_p=np.where(greedy, 1.0, top_p),
                             seed=row)
  return params, greedy


def greedy_chain(table, start=START, length=LENGTH):
  out, prev = [], start
  for _ in range(length):
    prev = int(np.argmax(table[prev]))
    out.append(prev)
  return out


def check_decode(pair, *, temperature, top_k=0, top_p=1.0, wrong_law, stop_token_ids=(),
                 verify_lens=None, what, store_logits=True):
  params, greedy = mixed_params(temperature, top_k, top_p)
  trace = toy_markov.speculative_decode(pair, params, KEY, START, LENGTH,
                                        first_position=7 + np.arange(ROWS) % 5,
                                        verify_lens=verify_lens, stop_token_ids=stop_token_ids,
                                        store_logits=store_logits)
  # Greedy rows: exactly greedy autoregressive decoding, up to and including a stop token.
  expected = np.array(greedy_chain(pair.target_table))
  for i, token in enumerate(expected):
    if token in stop_token_ids:
      expected[i + 1:] = VOCAB
      break
  np.testing.assert_array_equal(trace.tokens[greedy], np.broadcast_to(expected, (greedy.sum(), LENGTH)))
  counts = law_checks.outcome_counts(trace.tokens[~greedy], VOCAB)
  law = law_checks.chain_law(pair.target_table, START, LENGTH, temperature=temperature, top_k=top_k,
                             top_p=top_p, stop_tokens=stop_token_ids)
  stats.assert_law(counts, law, what=what)
  stats.assert_rejects(counts, wrong_law, what=f"{what} (power)")
  return trace, greedy


@pytest.mark.slow
def test_identical_laws_accept_every_draft():
  # p = q: every sampled draft must be accepted (u·q < p holds for u < 1), and the law is the target's.
  table = toy_markov.random_pair(VOCAB, 3, seed=1).target_table
  pair = toy_markov.identical_pair(table, gamma=3)
  wrong = law_checks.chain_law(table, START, LENGTH, temperature=1.5)
  trace, greedy = check_decode(pair, temperature=1.0, wrong_law=wrong, what="p = q")
  first_round = trace.accept_lens[0][~greedy]
  assert np.mean(first_round == 3) > 0.9999


@pytest.mark.slow
@compact
def test_disjoint_supports_reject_every_draft(store_logits):
  # The draft only proposes tokens {0, 1, 2}; the target only emits {3, 4, 5}: every draft token is
  # rejected and every committed token comes from the residual (= the target law here).
  pair = toy_markov.random_pair(VOCAB, 2, seed=2)
  table = pair.target_table.copy()
  table[:, :3] = -np.inf
  base = pair.draft_base.copy()
  base[..., 3:] = -np.inf
  pair = toy_markov.ToyPair(table, base, pair.head)
  wrong = law_checks.chain_law(table, START, LENGTH, temperature=2.0)
  trace, greedy = check_decode(pair, temperature=1.0, wrong_law=wrong, what="disjoint supports",
                               store_logits=store_logits)
  assert np.all(trace.accept_lens[trace.active & ~greedy[None]] == 0)


@pytest.mark.slow
@compact
def test_draft_with_zero_mass_where_target_has_mass(store_logits):
  # q(x) = 0 for x in {4, 5} while p(x) > 0: those tokens can only come from the residual.
  pair = toy_markov.random_pair(VOCAB, 3, seed=3)
  base = pair.draft_base.copy()
  base[..., 4:] = -np.inf
  pair = toy_markov.ToyPair(pair.target_table, base, pair.head)
  wrong = law_checks.chain_law(pair.target_table, START, LENGTH, temperature=0.8)
  check_decode(pair, temperature=1.0, wrong_law=wrong, what="q = 0 where p > 0",
               store_logits=store_logits)


@pytest.mark.parametrize("temperature", [1e-5, 3e-5])
def test_temperatures_at_the_greedy_threshold(temperature):
  # T = 1e-5 is the smallest sampled temperature (below it a row is greedy). Every target row has two
  # tied maxima, so the exact law splits them evenly where greedy decoding would always take the
  # smaller id; the draft is near-greedy too, so p/q ratios are extreme (0, 1/2, 1, 2, inf).
  rng = np.random.default_rng(4)
  table = np.round(rng.normal(0, 2, (VOCAB, VOCAB)) * 2) / 2
  for row in range(VOCAB):
    top, second = rng.choice(VOCAB, 2, replace=False)
    table[row, [top, second]] = table[row].max() + 1.0
  pair = toy_markov.random_pair(VOCAB, 2, seed=5)
  pair = toy_markov.ToyPair(table.astype(np.float32), pair.draft_base, pair.head)
  wrong = law_checks.chain_law(table, START, LENGTH, greedy=True)
  check_decode(pair, temperature=temperature, wrong_law=wrong, what=f"T = {temperature}")


def _assert_top_p_margin(table, temperature, top_k, top_p):
  """The reference (float64) and the implementation (float32) agree on the kept set only if no
  cumulative mass lies within rounding of top_p: check the test's tables stay clear of that."""
  if top_p >= 1.0:
    return
  for row in table:
    probs = law_checks.target_probs(row, temperature, top_k)
    cumulative = np.cumsum(np.sort(probs)[::-1])
    assert np.min(np.abs(cumulative - top_p)) > 1e-3


@pytest.mark.parametrize("temperature,top_k,top_p,store_logits",
                         [(0.8, 2, 1.0, True), (1.2, 0, 0.6, True), (1.0, 4, 0.7, True),
                          (1.0, 4, 0.7, False)])
def test_truncated_targets(temperature, top_k, top_p, store_logits):
  # Top-k, top-p and both (top-p on the renormalised top-k law). The draft ignores truncation, so it
  # often proposes tokens the target has cut (p = 0): those must always be rejected.
  pair = toy_markov.random_pair(VOCAB, 3, seed=6)
  _assert_top_p_margin(pair.target_table, temperature, top_k, top_p)
  wrong = law_checks.chain_law(pair.target_table, START, LENGTH, temperature=temperature)
  check_decode(pair, temperature=temperature, top_k=top_k, top_p=top_p, wrong_law=wrong,
               what=f"top_k={top_k} top_p={top_p}", store_logits=store_logits)


@compact
def test_verify_length_caps(store_logits):
  # A fresh verify length in 1..γ+1 per row and round, drawn independently of the drafts.
  pair = toy_markov.random_pair(VOCAB, 3, seed=7)
  rng = np.random.default_rng(8)
  lens_by_round = [rng.integers(1, 5, ROWS) for _ in range(LENGTH)]
  wrong = law_checks.chain_law(pair.target_table, START, LENGTH, temperature=1.3)
  trace, _ = check_decode(pair, temperature=1.0, wrong_law=wrong, what="verify_lens caps",
                          verify_lens=lambda r: lens_by_round[r], store_logits=store_logits)
  assert np.all(trace.num_committed <= trace.verify_lens)
  assert np.all(trace.accept_lens <= trace.verify_lens - 1)


@pytest.mark.slow
def test_stop_tokens_end_the_sequence():
  pair = toy_markov.random_pair(VOCAB, 3, seed=9)
  wrong = law_checks.chain_law(pair.target_table, START, LENGTH, temperature=1.0)  # no stop
  trace, greedy = check_decode(pair, temperature=1.0, stop_token_ids=(2,), wrong_law=wrong,
                               what="stop token 2")
  sampled = trace.tokens[~greedy]
  stopped = (sampled[:, :-1] == 2).any(axis=1)
  assert stopped.mean() > 0.1  # the scenario exercises stopping


@pytest.mark.parametrize("mutation", ["backbone-only q", "uniform q"])
def test_law_check_catches_a_wrong_verifier(mutation):
  # The harness has power against realistic verifier bugs: verifying with the backbone's logits as
  # the draft law (forgetting the sequential head's correction, so q is not the law the tokens were
  # drawn from), or with a uniform q. Both must be rejected at p < 1e-6.
  pair = toy_markov.random_pair(VOCAB, 3, seed=10, head_scale=3.0)

  def hook(block, anchor):
    if mutation == "backbone-only q":
      corrected = jnp.asarray(pair.draft_base)[anchor]
    else:
      corrected = jnp.zeros_like(block.corrected_logits)
    return block.replace(corrected_logits=corrected.astype(block.corrected_logits.dtype))

  params, greedy = mixed_params(1.0)
  trace = toy_markov.speculative_decode(pair, params, KEY, START, LENGTH, block_hook=hook)
  counts = law_checks.outcome_counts(trace.tokens[~greedy], VOCAB)
  stats.assert_rejects(counts, law_checks.chain_law(pair.target_table, START, LENGTH),
                       what=mutation)


@pytest.mark.parametrize("mutation", ["backbone-only row", "backbone-only log q"])
def test_law_check_catches_a_wrong_compact_law(mutation):
  # With `CompactLogits` the verifier reads the draft law in two places: each token's log q, and the
  # row it recomputes at the first rejection. Getting either wrong (here: dropping the sequential
  # head's correction from it) must be rejected at p < 1e-6.
  pair = toy_markov.random_pair(VOCAB, 3, seed=10, head_scale=3.0)

  def hook(block, anchor):
    law = block.corrected_logits
    if mutation == "backbone-only row":  # v = 0: the recomputed row is U_j alone
      return block.replace(corrected_logits=law.replace(vectors=jnp.zeros_like(law.vectors)))
    base = jnp.asarray(pair.draft_base)[anchor].astype(jnp.float32)
    log_q = jax.nn.log_softmax(base / block.temperatures[:, None, None], axis=-1)
    log_q = jnp.take_along_axis(log_q, block.tokens[..., None], axis=2)[..., 0]
    return block.replace(corrected_logits=law.replace(token_log_q=log_q))

  params, greedy = mixed_params(1.0)
  trace = toy_markov.speculative_decode(pair, params, KEY, START, LENGTH, block_hook=hook,
                                        store_logits=False)
  counts = law_checks.outcome_counts(trace.tokens[~greedy], VOCAB)
  stats.assert_rejects(counts, law_checks.chain_law(pair.target_table, START, LENGTH),
                       what=mutation)


def test_greedy_only_path_equals_greedy_decoding():
  pair = toy_markov.random_pair(VOCAB, 3, seed=11)
  params = dj.SamplingParams(temperature=0.0, batch_size=8)
  trace = toy_markov.speculative_decode(pair, params, KEY, START, 6, greedy_only=True)
  expected = greedy_chain(pair.target_table, length=6)
  np.testing.assert_array_equal(trace.tokens, np.broadcast_to(expected, (8, 6)))
