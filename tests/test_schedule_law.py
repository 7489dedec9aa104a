"""The lossless proof of confidence-scheduled verification: scheduled decodes keep the target's law.

Setup (fixed seeds): a Markov target over V = 5 tokens and a real DSpark draft (`sample_block`: base
logits per anchor, a vanilla sequential head, and a confidence head that reads the Markov embedding
of the previous token, so c_k is a function of x_{k−1}: 0.97, 0.9, 0.85, 0.6, 0.05 after tokens 0..4),
γ = 3. N = 40,000 rows decode L = 3 tokens each from START = 1 by rounds of `sample_block` ->
`schedule.update` -> `verify(..., verify_lens=...)`. Rows are split into groups of R rows (R = 1, 4,
16, 64) that one schedule instance serves together (`vmap` over groups). Each group's state first sees
two rounds of random confidences (rows that were decoding before), so a lagged budget has history
from the first round. Each round draws fresh randomness (the base key folded with the round index;
see the last test for why). Every round commits at least one token per active row.

Statistic: Pearson chi-square of the 5^3 = 125 outcome counts of all N rows against the target's exact
law (`law_checks.chain_law`, float64 enumeration), cells expected below 5 pooled; a test fails at
p < α = 1e-4. The throughput profiles (R rows, n = 0..R·(γ + 1)):

* smooth: sps[n] = 1 / (R + n) (a step costs R + n time units);
* jagged: for R = 1, sps = [·, 1, 0.54, 0.33, 0.3] (with high survivals Θ rises, dips at the second
  admission, and peaks at the third); for R > 1 the smooth profile with sps[R + max(2, R // 2)]
  halved, a dip after the first admissions;
* cliff (R = 1): sps = [·, 1, 0.5, 0.34, 0.3]: only the third admission can beat none;
* capped: the smooth profile cut at 2R + 1 entries (at most R drafts verified per round in all);
* buckets: a step table (token counts rounded up to buckets of max(2, R); for R = 1,
  [·, 1, 1, 0.8, 0.8]), where `prefix` admits freely inside a plateau and enters the next one on
  the Θ it guarantees (the entry's survival and the other rows' frontiers).

What a decision may read. ``verify_lens = 1 + ℓ`` feeds the anchor and ℓ drafts to the target, whose
ℓ + 1 rows check drafts 1..ℓ + 1 (draft ℓ + 1, when accepted, is the bonus). So x_j is checked iff
ℓ ≥ j − 1, and losslessness needs that event not to depend on x_j. Algorithm 1's event ℓ ≥ j − 1 reads
survivals up to a_{j−1} (x_{<j−1}), one step of margin; a search without early stop reads every
survival, a_{j+1} = f(x_{≤j}) included.

Power: a planted anticipating scheduler, Algorithm 1 without its early stop on *current* survivals
(``top_k(sps, lag=0)``), one row, cliff profile, must be rejected at p < 1e-6. From START the draft
proposes x_1 from the target's own law (always accepted, mostly token 0), then over-proposes tokens 3
and 4 as x_2, after which the confidence is low: that scheduler checks x_2 only when c_3(x_2) is high.
Each test also checks that its schedule made more than one kind of decision (it is not vacuous).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import compiling
from dspark_jax.testing import law_checks
from dspark_jax.testing import toy_markov
from tests import stats

VOCAB, LENGTH, START = 5, 3, 1
N = 40_000
ALPHA = 1e-4
CONFIDENCE = np.array([0.97, 0.9, 0.85, 0.6, 0.05])  # c_k as a function of x_{k-1}


@dataclasses.dataclass(frozen=True)
class Toy:
  table: np.ndarray  # [V, V] target logits after each token
  head: object  # the draft's vanilla Markov head (w1 = I)
  base: np.ndarray  # [V, γ, V] the draft's base logits per anchor
  conf: object  # the confidence head

  @property
  def gamma(self):
    return self.base.shape[1]


def confidence_head():
  # hidden is [.., 1] of zeros; w = [0; logit(c)] reads the one-hot embedding w1[x_{k-1}].
  logits = np.log(CONFIDENCE) - np.log1p(-CONFIDENCE)
  return dj.confidence_head_from_arrays({"w": np.concatenate([[0.0], logits]).astype(np.float32),
                                         "b": np.float32(0)})


def make_toy(gamma=3):
  rng = np.random.default_rng(28)
  table = toy_markov.random_pair(VOCAB, gamma, seed=28).target_table.copy()
  w2 = rng.normal(0, 1.0, (VOCAB, VOCAB)).astype(np.float32)
  head = dj.markov_head_from_arrays("vanilla", {"w1": np.eye(VOCAB, dtype=np.float32), "w2": w2})
  base = rng.normal(0, 1.0, (VOCAB, gamma, VOCAB)).astype(np.float32)
  p_start = np.array([0.6, 0.1, 0.1, 0.1, 0.1])  # the target after START, and the draft's x_1
  table[START] = np.log(p_start)
  base[START, 0] = np.log(p_start) - w2[START]
  table[0] = np.log([0.3, 0.25, 0.2, 0.15, 0.1])  # the target after token 0
  base[START, 1] = np.log([0.1, 0.1, 0.15, 0.15, 0.5]) - w2[0]  # the draft's x_2 after START, 0
  return Toy(table, head, base, confidence_head())


TOY = make_toy()
LAW = law_checks.chain_law(TOY.table, START, LENGTH)


def smooth(rows, gamma=3):
  return 1.0 / (rows + np.arange(rows * (gamma + 1) + 1))


def jagged(rows):
  if rows == 1:
    return np.array([0.0, 1.0, 0.54, 0.33, 0.3])
  sps = smooth(rows)
  sps[rows + max(2, rows // 2)] *= 0.5
  return sps


def cliff(rows):
  assert rows == 1
  return np.array([0.0, 1.0, 0.5, 0.34, 0.3])


def buckets(rows):
  # A packed verify's step table: token counts rounded up to buckets of max(2, rows) tokens, each
  # costing as the smooth profile's bucket end; plateaus of equal values (`prefix`'s plateau test).
  # One row: buckets of 2 tokens, the second 1.25× as costly (so entering it pays on some draws).
  if rows == 1:
    return np.array([0.0, 1.0, 1.0, 0.8, 0.8])
  step = max(2, rows)
  n = np.arange(rows * 4 + 1)
  return 1.0 / (rows + step * np.ceil(n / step))


def capped(rows):
  return smooth(rows)[:2 * rows + 1]


PROFILES = {"smooth": smooth, "jagged": jagged, "capped": capped, "cliff": cliff,
            "buckets": buckets}


# A round's draft and verification over all N rows, each one program (compute-bound: see
# `compiling`), shared by every schedule.
_sample_block = compiling.compute_bound_jit(
    lambda head, base, anchor, hidden, params, key, position, conf: dj.sample_block(
        head, base, anchor, hidden, params, key, position, confidence_head=conf))
_verify = compiling.compute_bound_jit(dj.verify)


def scheduled_decode(toy, schedule, rows, seed, *, n=N, warm=2, fresh_keys=True):
  """`n` rows in groups of `rows`, one schedule instance per group (vmap over groups).

  Returns (tokens [n, L], verify lengths of the active rows of every round, concatenated). With
  ``fresh_keys=False`` every round uses the same base key, so the draft's noise is a function of the
  absolute position only and is met again by a later round that drafts the same position.
  """
  groups, gamma = n // rows, toy.gamma
  params = dj.SamplingParams(temperature=np.ones(n), seed=np.arange(n))
  key = jax.random.key(seed)
  table, base = jnp.asarray(toy.table), jnp.asarray(toy.base)
  hidden = jnp.zeros((n, gamma, 1), jnp.float32)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (groups,) + x.shape), schedule.init(rows, gamma))
  update = compiling.compute_bound_jit(jax.vmap(schedule.update))
  rng = np.random.default_rng(seed)
  for _ in range(warm):
    _, state = update(jnp.asarray(rng.random((groups, rows, gamma)), jnp.float32),
                      jnp.ones((groups, rows), bool), state)
  tokens = np.full((n, LENGTH), VOCAB, np.int64)
  count = np.zeros(n, np.int64)
  anchor = np.full(n, START, np.int32)
  position = 7 + np.arange(n, dtype=np.int32) % 5
  used = []
  for round_index in range(LENGTH):  # each round commits >= 1 token per active row
    active = count < LENGTH
    if not active.any():
      break
    round_key = jax.random.fold_in(key, round_index) if fresh_keys else key
    block = _sample_block(toy.head, base[anchor], anchor, hidden, params, round_key, position,
                          toy.conf)
    lens, state = update(block.confidence.reshape(groups, rows, gamma),
                         jnp.asarray(active).reshape(groups, rows), state)
    lens = np.asarray(lens).reshape(n)
    used.append(lens[active])
    verify_inputs = jnp.concatenate([jnp.asarray(anchor)[:, None], block.tokens], axis=1)
    result = _verify(table[verify_inputs], block, params, round_key, position, lens)
    committed, num = np.asarray(result.committed), np.asarray(result.num_committed)
    for slot in range(gamma + 1):
      take = active & (slot < num) & (count < LENGTH)
      tokens[take, count[take]] = committed[take, slot]
      count += take
    anchor = committed[np.arange(n), num - 1].astype(np.int32)
    position = position + num.astype(np.int32)
  assert np.all(count == LENGTH)
  return tokens, np.concatenate(used)


@pytest.fixture(scope="module", autouse=True)
def compiled():
  """Compiles the block and verification programs for N rows once, outside the tests' timings."""
  scheduled_decode(TOY, dj.schedules.fixed(), 1, seed=0, warm=0)


CASES = [  # (schedule, rows per group, profile)
    ("prefix", 1, "smooth"), ("prefix", 1, "jagged"), ("prefix", 4, "smooth"),
    ("prefix", 4, "jagged"), ("prefix", 64, "smooth"), ("prefix", 64, "jagged"),
    ("prefix", 16, "capped"), ("prefix", 1, "buckets"), ("prefix", 4, "buckets"),
    ("top_k", 1, "smooth"), ("top_k", 1, "jagged"), ("top_k", 1, "cliff"), ("top_k", 4, "jagged"),
    ("top_k", 64, "smooth"), ("top_k", 64, "jagged"), ("top_k", 16, "capped"),
    ("top_k_lag1", 1, "jagged"), ("top_k_lag1", 4, "jagged"), ("threshold", 4, None),
]


@pytest.mark.parametrize("name,rows,profile", CASES, ids=[f"{n}-R{r}-{p}" for n, r, p in CASES])
def test_scheduled_decodes_keep_the_target_law(name, rows, profile):
  sps = PROFILES[profile](rows) if profile else None
  schedule = {"prefix": lambda: dj.schedules.prefix(sps),
              "top_k": lambda: dj.schedules.top_k(sps, lag=2),
              "top_k_lag1": lambda: dj.schedules.top_k(sps, lag=1),
              "threshold": lambda: dj.schedules.threshold(0.5)}[name]()
  seed = 1000 + 10 * rows + len(name) + (len(profile) if profile else 0)
  tokens, lens = scheduled_decode(TOY, schedule, rows, seed)
  what = f"{name}, R = {rows}, {profile}"
  assert len(np.unique(lens)) > 1, f"{what}: the schedule made one decision only ({lens[0]})"
  stats.assert_law(law_checks.outcome_counts(tokens, VOCAB), LAW, what=what, threshold=ALPHA)


def test_an_anticipating_scheduler_is_rejected():
  # Algorithm 1 without its early stop, on the current survivals: one row, cliff profile.
  tokens, lens = scheduled_decode(TOY, dj.schedules.top_k(cliff(1), lag=0), 1, seed=7)
  assert len(np.unique(lens)) > 1
  stats.assert_rejects(law_checks.outcome_counts(tokens, VOCAB), LAW,
                       what="the anticipating scheduler")


@pytest.mark.slow
def test_draft_noise_reused_across_rounds_breaks_a_lagged_budget():
  # Why the harness folds the round into the key. With one key for the whole decode, a draft's
  # noise depends on (seed, absolute position) only, so a round drafts position P with the same
  # noise an earlier round used for its (unverified) draft at P. The lagged budget read that earlier
  # draft's survival, so the decision to check the new draft at P depends on its own noise.
  # Target: the same law after every token; draft: that law for x_1, another law after; γ = 4, one
  # row, top_k(lag=1), cliff-like profile; N = 262,144 (a power of two: no padded rows). Fresh keys
  # keep the law (p >= α; 0.35 here); reused keys are rejected (p < 1e-6; 4e-24 here).
  p = np.log([0.3, 0.25, 0.2, 0.15, 0.1])
  q = np.log([0.1, 0.1, 0.15, 0.15, 0.5])
  base = np.broadcast_to(q, (VOCAB, 4, VOCAB)).astype(np.float32).copy()
  base[:, 0] = p
  toy = Toy(np.broadcast_to(p, (VOCAB, VOCAB)).astype(np.float32).copy(),
            dj.markov_head_from_arrays("vanilla", {"w1": np.eye(VOCAB, dtype=np.float32),
                                                   "w2": np.zeros((VOCAB, VOCAB), np.float32)}),
            base, confidence_head())
  law = law_checks.chain_law(toy.table, START, LENGTH)
  schedule = dj.schedules.top_k(np.array([0.0, 1.0, 0.5, 0.34, 0.3, 0.28]), lag=1)
  tokens, _ = scheduled_decode(toy, schedule, 1, seed=3, n=262_144, fresh_keys=True)
  stats.assert_law(law_checks.outcome_counts(tokens, VOCAB), law, what="fresh keys", threshold=ALPHA)
  tokens, _ = scheduled_decode(toy, schedule, 1, seed=3, n=262_144, fresh_keys=False)
  stats.assert_rejects(law_checks.outcome_counts(tokens, VOCAB), law, what="reused draft noise")
