"""Verify-length schedules inside the compiled loop (`generate(..., schedule=...)`, `decode`):
every schedule decodes greedy rows exactly and its in-loop decisions are the schedule's own on the
traced confidences; ``fixed()`` equals ``schedule=None`` token for token; bad schedules are named;
and sampled 3-token decodes under a non-fixed schedule follow the target's exact law (chi-square).
Tiny f32 models on the CPU."""

import json
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax import decoding
from dspark_jax.models import draft as dm
from dspark_jax.scheduling import schedules
from dspark_jax.testing import compiling
from dspark_jax.testing import law_checks
from tests import stats
from tests.test_decoding import PROMPTS, _exact_first_three, make_draft, make_target

GAMMA = 3
ROWS = 4
# Throughput tables indexed by verify batch tokens (entry 0 unused): smooth, and jagged with its
# best point past a dip (where a search without Algorithm 1's early stop would anticipate).
SMOOTH = np.concatenate([[0.0], 100.0 / (1.0 + 0.12 * np.arange(1, 4 * ROWS + 2))])
JAGGED = np.array([0.0, 10.0, 9.9, 9.8, 5.0, 9.0, 8.0, 7.9, 2.0, 7.0, 6.5, 6.4, 6.3, 1.0, 6.0, 5.9,
                   5.8, 5.7])
FIXED = schedules.fixed()  # one object: calls with it reuse one compiled program
SCHEDULES = {"fixed": FIXED, "threshold": schedules.threshold(0.5),
             "prefix": schedules.prefix(SMOOTH), "top_k": schedules.top_k(SMOOTH, lag=2)}


def with_token_confidence(draft, spread=2.5):
  """The draft's confidence made a function of the previous token only: c_k = σ(w[x_{k-1}]), w
  from -spread to spread over the vocabulary (the heads' W1 is the identity, `make_draft`)."""
  vocab = draft.head.vocab_size
  w = np.zeros(draft.confidence.w.shape, np.float32)
  w[-vocab:] = np.linspace(-spread, spread, vocab)
  draft.confidence.w[...] = jnp.asarray(w)
  draft.confidence.b[...] = jnp.zeros(())
  return draft


@pytest.fixture(scope="module")
def pair():
  target = make_target(sharpness=1.0)
  return target, with_token_confidence(make_draft(target, GAMMA, "vanilla", copy_bias=3.0))


MIXED = dj.SamplingParams(temperature=[0.0, 1.0, 0.0, 0.8], seed=[5, 6, 7, 8])


@pytest.fixture(scope="module")
def unscheduled(pair):
  """The decode without a schedule (its greedy rows are the target's greedy tokens: test_decoding)."""
  target, draft = pair
  return dj.generate(target, draft, PROMPTS[:ROWS], MIXED, jax.random.key(1), max_new_tokens=12,
                     trace=True)


def _replayed(schedule, trace, scale=1.0):
  """The schedule's verify lengths on the traced confidences, round by round (host, eager)."""
  rounds, batch, gamma = trace.confidence.shape
  state = schedule.init(batch, gamma)
  lens = []
  for r in range(rounds):
    conf = np.clip(np.nan_to_num(trace.confidence[r]) * scale, 0, 1).astype(np.float32)
    out, state = schedule.update(jnp.asarray(conf), jnp.asarray(trace.active[r]), state)
    lens.append(np.asarray(out))
  return np.stack(lens)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fixed", "threshold", "top_k"])  # prefix: the law test below
def test_schedules_decode_greedy_rows_exactly_and_decide_as_the_schedule(pair, unscheduled, name):
  # Greedy rows: the target's greedy tokens whatever the verify lengths. The trace: verify lengths
  # in 1..γ+1, runs capped by them, sums equal to row_verified, and the decisions equal the
  # schedule replayed on the traced confidence and activity (rounds whose decision is robust to a
  # 1e-6 relative change of the confidences; float sums inside and outside the program may round
  # differently at exact ties only).
  target, draft = pair
  schedule = SCHEDULES[name]
  result = dj.generate(target, draft, PROMPTS[:ROWS], MIXED, jax.random.key(1), max_new_tokens=12,
                       schedule=schedule, trace=True)
  greedy = np.asarray(MIXED.greedy_mask)
  np.testing.assert_array_equal(result.tokens[greedy], unscheduled.tokens[greedy])
  trace = result.trace
  rounds = result.rounds
  assert trace.confidence.shape == (rounds, ROWS, GAMMA) and trace.active.shape == (rounds, ROWS)
  active = trace.active
  np.testing.assert_array_equal(active.sum(0), result.row_rounds)
  lens = trace.verify_lens
  assert np.all((lens[active] >= 1) & (lens[active] <= GAMMA + 1))
  assert np.all(trace.accept_len[active] <= lens[active] - 1)
  np.testing.assert_array_equal(np.where(active, lens, 0).sum(0), result.row_verified)
  assert result.verify_tokens == pytest.approx(lens[active].mean())
  replay = [_replayed(schedule, trace, s) for s in (1.0, 1 - 1e-6, 1 + 1e-6)]
  robust = np.all(replay[1] == replay[2], axis=1) & np.all(replay[0] == replay[1], axis=1)
  assert robust.mean() > 0.9
  np.testing.assert_array_equal(np.where(active, replay[0], 0)[robust], lens[robust])
  assert np.all(lens[~active] == 0) and np.all(trace.accept_len[~active] == 0)
  if name == "fixed":
    assert result.verify_tokens == GAMMA + 1
  else:
    assert 1 <= result.verify_tokens < GAMMA + 1


@pytest.mark.slow
def test_fixed_equals_no_schedule(pair, unscheduled):
  # The same program shapes and draws: fixed() decides γ + 1 everywhere, as schedule=None does.
  target, draft = pair
  runs = [unscheduled, dj.generate(target, draft, PROMPTS[:ROWS], MIXED, jax.random.key(1),
                                   max_new_tokens=12, schedule=FIXED, trace=True)]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  for name in ("reached", "accepted", "row_rounds", "row_accepted", "row_verified"):
    np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))
  assert runs[0].verify_tokens == runs[1].verify_tokens == GAMMA + 1
  for name in ("accept_len", "verify_lens", "active"):
    np.testing.assert_array_equal(getattr(runs[0].trace, name), getattr(runs[1].trace, name))
  assert 0 < runs[0].acceptance[0] < 1


def test_schedules_that_cannot_run_are_named(pair):
  target, draft = pair
  plain = dm.DSparkDraft(dm.DraftConfig(gamma=GAMMA, target_layer_ids=(-1, 1),
                                        mask_token_id=target.config.vocab_size - 1,
                                        confidence=False), target.config, rngs=nnx.Rngs(0))
  decoding.check_schedule(FIXED, plain, True)  # fixed() never reads the confidence
  decoding.check_schedule(None, plain, True)
  params = dj.SamplingParams(temperature=0.0, batch_size=2)
  for name in ("threshold", "prefix", "top_k"):
    with pytest.raises(ValueError, match="^schedule: reads the draft's confidence, but the draft "
                                         "has no confidence head"):
      dj.generate(target, plain, [[1], [2]], params, jax.random.key(0), schedule=SCHEDULES[name])
  with pytest.raises(ValueError, match="^schedule: only speculative decoding"):
    dj.generate(target, None, [[1], [2]], params, jax.random.key(0), spec=False, schedule=FIXED)
  with pytest.raises(ValueError, match="^schedule: expected a Schedule"):
    dj.generate(target, draft, [[1], [2]], params, jax.random.key(0), schedule=lambda c: c)
  with pytest.raises(ValueError, match="^trace: only speculative decoding"):
    dj.generate(target, None, [[1], [2]], params, jax.random.key(0), spec=False, trace=True)
  with pytest.raises(ValueError, match="^schedule: reads the draft's confidence"):
    dj.decode(target, plain, np.ones((2, 1), np.int32), np.ones(2, np.int32), params,
              jax.random.key(0), max_new_tokens=2, schedule=SCHEDULES["threshold"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefix", "top_k"])
def test_scheduled_decodes_follow_the_target_law(name, monkeypatch):
  # N = 40,960 sampled 3-token decodes (T = 1): `decode` of 4 rows per batch (same prompt, own
  # seeds) vmapped over 10,240 keys, under Algorithm 1 (`prefix`) or the lagged `top_k` (lag 2:
  # its state carried across rounds, fresh draft noise per round) with the jagged throughput
  # table; V = 8, γ = 3, the draft's confidence a function of the previous token, so each round's
  # verify lengths depend on the drafts and on the other rows. Statistic: Pearson chi-square of the
  # three tokens over all 512 outcomes (small cells pooled) against the target's exact law;
  # threshold p >= 1e-4. Power: the same counts against the law at T = 0.6 must give p < 1e-6. The
  # schedule must have verified fewer than γ + 1 tokens per round on average. The verify packs
  # into the buckets (4, 8, 12, 16) (16: the dense forward), so both forms decide tokens here.
  monkeypatch.setattr(decoding.packing, "MIN_PACKED", 8)
  assert decoding.packing.token_buckets(ROWS, GAMMA + 1) == (4, 8, 12, 16)
  vocab, keys = 8, 10_240
  target = make_target(vocab=vocab, sharpness=2.5, seed=3)
  draft = with_token_confidence(make_draft(target, GAMMA, "vanilla", copy_bias=2.0, seed=4))
  prompt = [1, 5, 2]
  tokens = np.tile(np.array([prompt], np.int32), (ROWS, 1))
  lens = np.full((ROWS,), len(prompt), np.int32)
  params = dj.SamplingParams(temperature=1.0, batch_size=ROWS, seed=np.arange(ROWS))
  schedule = {"prefix": schedules.prefix, "top_k": schedules.top_k}[name](JAGGED)
  run = compiling.compute_bound_jit(jax.vmap(lambda k: dj.decode(
      target, draft, tokens, lens, params, k, max_new_tokens=3, schedule=schedule)))
  out = run(jax.random.split(jax.random.key(7), keys))
  samples = np.asarray(out.tokens).reshape(-1, 3)
  assert samples.shape == (ROWS * keys, 3) and np.all(samples >= 0)
  verify_tokens = np.asarray(out.row_verified).sum() / np.asarray(out.row_rounds).sum()
  assert 1.0 < verify_tokens < GAMMA + 1
  counts = law_checks.outcome_counts(samples, vocab)[:vocab, :vocab, :vocab]
  stats.assert_law(counts, _exact_first_three(target, prompt, 1.0), threshold=1e-4,
                   what=f"{name} schedule through decode, first three tokens")
  stats.assert_rejects(counts, _exact_first_three(target, prompt, 0.6), what="wrong temperature")


def test_profile_samples_cancel_what_every_call_pays_once():
  """`profile_sps`'s samples: a call of steps + 1 forwards less a call of one. On a fake clock
  where a call of n forwards takes 5 + 2n units, each sample of 8 forwards is 16 whatever the 5;
  where noise makes the short call the longer, the long call's share of the 8."""
  from dspark_jax.scheduling import profile

  now = [0.0]

  def call(n):
    now[0] += 5.0 + 2.0 * n

  assert profile._samples(call, 8, repeats=3, warmup=1, clock=lambda: now[0]) == [16.0] * 3
  costs = iter([40.0, 30.0] * 2)   # (one forward, nine forwards) of each sample

  def noisy(n):
    now[0] += next(costs)

  assert profile._samples(noisy, 8, repeats=2, warmup=0, clock=lambda: now[0]) == pytest.approx(
      [30.0 * 8 / 9] * 2)


def test_profile_sps_measures_saves_and_names_bad_arguments(pair, tmp_path):
  # Tiny shapes, one repeat: the table's structure, not its speed. Each size is a packed verify of
  # that many tokens; the saved JSON reads back through schedules.load_sps; `dense` is the step
  # table of the buckets.
  target, draft = pair
  path = tmp_path / "sps.json"
  profile = dj.profile_sps(target, draft, batch_tokens=[6, 1, 4, 5], context=8, repeats=1,
                           steps=2, path=path, draft_cost=False)   # the verify forwards alone
  np.testing.assert_array_equal(profile.batch_tokens, [1, 4, 5, 6])
  np.testing.assert_array_equal(profile.rows, [1, 1, 2, 2])  # ceil(n / (γ + 1))
  assert profile.seconds.shape == (4, 1) and profile.gamma == GAMMA and profile.context == 8
  assert np.all(np.isfinite(profile.steps_per_second) & (profile.steps_per_second > 0))
  assert set(profile.table()) == {1, 4, 5, 6}
  dense = schedules.load_sps(path)
  np.testing.assert_allclose(dense[[1, 4, 5, 6]], profile.steps_per_second, rtol=1e-12)
  step = profile.dense()   # n tokens at the best rate of any size that holds them
  best = np.maximum.accumulate(profile.steps_per_second[::-1])[::-1]
  np.testing.assert_array_equal(step[1:], best[[0, 1, 1, 1, 2, 3]])
  assert profile.buckets() is None   # explicit sizes: not one batch's buckets
  buckets = dj.profile_sps(target, draft, batch_size=ROWS, context=8, repeats=1, steps=1)
  np.testing.assert_array_equal(buckets.batch_tokens, decoding.packing.token_buckets(
      ROWS, GAMMA + 1))
  assert np.all(buckets.rows == ROWS) and len(buckets.dense()) == ROWS * (GAMMA + 1) + 1
  # By default, given the draft, each rate is of whole decoding rounds (saved as such); without a
  # draft, of the verify alone.
  rounds = dj.profile_sps(target, draft, batch_tokens=[6], context=8, repeats=1, steps=2,
                          path=tmp_path / "rounds.json")
  assert rounds.kind == "round" and rounds.seconds.shape == (1, 1)
  np.testing.assert_allclose(rounds.steps_per_second, 2 / rounds.seconds[:, 0], rtol=1e-12)
  assert json.load(open(tmp_path / "rounds.json"))["kind"] == "round"
  assert profile.kind == "verify"
  assert dj.profile_sps(target, gamma=GAMMA, batch_tokens=[6], context=8, repeats=1,
                        steps=1).kind == "verify"
  for bad, match in ((dict(batch_tokens=[4, 0]), "^batch_tokens: entry 1 is 0"),
                     (dict(batch_tokens=[4], batch_size=2), "^batch_size, batch_tokens: give one"),
                     (dict(batch_tokens=[]), "^batch_tokens: expected a non-empty"),
                     (dict(gamma=GAMMA + 1), "^gamma: 4, but the draft drafts"),
                     (dict(repeats=0), "^repeats")):
    with pytest.raises(ValueError, match=match):
      dj.profile_sps(target, draft, **bad)
  with pytest.raises(ValueError, match="^gamma: required without a draft"):
    dj.profile_sps(target)
  for bad in (-1.0, float("nan"), "hot", True):
    with pytest.raises(ValueError, match="^temperature: expected a finite float"):
      dj.profile_sps(target, draft, temperature=bad)
  with pytest.raises(ValueError, match="^draft_cost: needs the draft"):
    dj.profile_sps(target, gamma=GAMMA, draft_cost=True)
  with pytest.raises(ValueError, match="^draft_cost: expected a bool"):
    dj.profile_sps(target, draft, draft_cost="yes")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_profile_rounds_run_the_loops_rounds_at_the_counts_given(pair, temperature):
  # The timed program is the decoding loop's own iteration with every row active at the context:
  # n calls' rounds, each verifying exactly the counts given (row_verified), every row's anchor
  # restarting at the context, so each round commits 1..γ + 1 tokens from there.
  from dspark_jax.scheduling import profile
  target, draft = pair
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = nnx.split(draft)
  width = GAMMA + 1
  buckets = decoding.packing.token_buckets(ROWS, width)
  call = profile._timed_rounds(target_def, target_state, draft_def, draft_state, ROWS, buckets,
                               context=8, temperature=temperature)
  counts = np.array([1, 4, 2, 3], np.int32)
  state = call(3, counts)
  rounds, verified = int(state["rounds"]), np.asarray(state["row_verified"])
  np.testing.assert_array_equal(verified, 3 * counts)
  state = call(2, np.full(ROWS, width, np.int32))
  assert int(state["rounds"]) == rounds + 2
  np.testing.assert_array_equal(state["row_verified"], verified + 2 * width)
  committed = np.asarray(state["anchor_pos"]) - 8
  assert np.all((committed >= 1) & (committed <= width)) and not np.asarray(state["done"]).any()
  np.testing.assert_array_equal(state["count"], committed)
