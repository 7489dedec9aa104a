"""The benchmarks' synthetic acceptance (`benchmarks.synthetic`): the law it plants is the law a decode
measures, through the dense verify and through a schedule's packed one.

Law test: 16 greedy rows of the tiny random pair (γ = 4), 256 new tokens each, seeds fixed. For
each draft position k, the accepted drafts among those reached are tested against Binomial(reached,
c_k) (chi-square on [accepted, rejected], p >= 1e-3, `tests.stats`; about 500 to 1,700 reached per
position), and the same counts must reject a planted law c_k - 0.15 (p < 1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from benchmarks import bench_decode
from benchmarks import synthetic
from tests import stats

RATES = (0.8, 0.7, 0.6, 0.5)


@pytest.fixture(scope="module")
def pair():
  return bench_decode.build_models(True, len(RATES))


def _decode(target, draft, schedule=None):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, target.config.vocab_size - 1, 8).tolist() for _ in range(16)]
  params = dj.SamplingParams(temperature=np.zeros(16), seed=np.arange(16))
  return dj.generate(synthetic.synthetic_target(target, RATES), draft, prompts, params,
                     jax.random.key(0), max_new_tokens=256, schedule=schedule)


def _assert_law(out, positions):
  reached, accepted = np.asarray(out.reached), np.asarray(out.accepted)
  for k in positions:
    counts = [accepted[k], reached[k] - accepted[k]]
    c = RATES[k]
    stats.assert_law(counts, [c, 1 - c], what=f"draft {k + 1}")
    stats.assert_rejects(counts, [c - 0.15, 1.15 - c], what=f"draft {k + 1}, planted law")


def test_the_dense_verify_accepts_by_the_planted_law(pair):
  out = _decode(*pair)
  _assert_law(out, range(len(RATES)))
  assert abs(out.tau - synthetic.expected_tau(RATES)) < 0.1


@pytest.mark.slow
def test_a_schedule_verifies_its_tokens_packed_and_accepts_by_the_law(pair):
  # threshold(0.65) on confidences c_k: drafts 1 and 2 pass (0.8, 0.7), draft 3 (0.6) does not.
  schedule = synthetic.law_confidence(dj.schedules.threshold(0.65), RATES)
  out = _decode(*pair, schedule=schedule)
  assert out.verify_tokens == 3.0
  assert list(np.asarray(out.reached)[2:]) == [0, 0]
  _assert_law(out, range(2))
  assert abs(out.tau - synthetic.expected_tau(RATES, 2)) < 0.1


def _cells_statistic(results, law):
  """Pooled chi-square of every (row, draft) cell's accepted count against Binomial(reached,
  law[row, k]), over cells reached at least 5 times: (statistic, cells, p-value)."""
  from scipy import stats as scipy_stats
  total, cells = 0.0, 0
  for row, r in enumerate(results):
    for k, (n, a) in enumerate(zip(np.asarray(r.reached), np.asarray(r.accepted))):
      p = float(law[row, k])
      if n >= 5 and 0 < p < 1:
        total += (a - n * p) ** 2 / (n * p * (1 - p))
        cells += 1
  return total, cells, float(scipy_stats.chi2.sf(total, cells))


def test_rows_spread_accept_by_their_own_rates(pair):
  # σ = 1.5: 16 slots of one engine, one prompt each (prompt i decodes in slot i), 256 tokens.
  # Statistic: the pooled chi-square of the (row, draft) cells reached >= 5 times (about 50
  # cells) against each row's own rates c_{r,k} (`synthetic.row_rates`): p >= 1e-3. Power: the
  # same counts against the unspread law c_k are rejected (p < 1e-6).
  target, draft = pair
  spread = 1.5
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, target.config.vocab_size - 1, 8).tolist() for _ in range(16)]
  params = dj.SamplingParams(temperature=np.zeros(16), seed=np.arange(16))
  engine = dj.Engine(synthetic.synthetic_target(target, RATES, spread), draft, 16)
  out = engine.generate(prompts, params, jax.random.key(0), max_new_tokens=256)
  gamma = len(RATES)
  grid = (np.arange(16)[:, None], np.arange(gamma)[None, :])
  law = np.asarray(synthetic.row_rates(RATES, spread, *grid))
  assert law.std() > 0.1   # the rows do differ
  statistic, cells, p = _cells_statistic(out.results, law)
  assert cells >= 30 and p >= 1e-3, (statistic, cells, p)
  plain = np.asarray(synthetic.row_rates(RATES, 0.0, *grid))
  statistic, cells, p = _cells_statistic(out.results, np.broadcast_to(plain, law.shape))
  assert p < 1e-6, (statistic, cells, p)
  # The schedules read the same rates (a perfectly calibrated head).
  seen = synthetic.law_confidence(dj.schedules.fixed(), RATES, spread)
  captured = []
  probe = dj.schedules.Schedule(init=lambda b, g: dj.schedules.fixed().init(b, g),
                                update=lambda c, a, s: (captured.append(c), (jnp.full(
                                    (c.shape[0],), gamma + 1, jnp.int32), s))[1])
  synthetic.law_confidence(probe, RATES, spread).update(
      np.zeros((16, gamma), np.float32), np.ones(16, bool), seen.init(16, gamma))
  np.testing.assert_array_equal(np.asarray(captured[0]), law)
  assert abs(synthetic.mean_tau(RATES, spread, 16)
             - np.mean(1 + np.cumprod(law, axis=1).sum(axis=1))) < 1e-6


def test_the_synthetic_target_shares_the_parameters_and_leaves_the_target_alone(pair):
  target, _ = pair
  syn = synthetic.synthetic_target(target, RATES)
  assert type(target) is dj.TargetModel and isinstance(syn, dj.TargetModel)
  assert syn.embed.embedding[...] is target.embed.embedding[...]
  assert syn.rates == RATES and not hasattr(type(target), "rates")


def test_bad_rates_are_named():
  with pytest.raises(ValueError, match=r"^rates: c_2 = 1.5 is not in \[0, 1\]"):
    synthetic.check_rates([0.5, 1.5])
  with pytest.raises(ValueError, match="^rates: expected at least one"):
    synthetic.check_rates([])
  schedule = synthetic.law_confidence(dj.schedules.fixed(), RATES)
  with pytest.raises(ValueError, match=r"^rates: 4 rates for a block of γ = 3"):
    schedule.update(np.zeros((2, 3), np.float32), np.ones(2, bool), schedule.init(2, 3))


def test_bench_serving_takes_a_synthetic_law_for_greedy_random_pairs_only(capsys):
  from benchmarks import bench_serving
  args = bench_serving.parse_args(["--synthetic"])
  assert args.synthetic == synthetic.DEFAULT_RATES and args.gamma == len(synthetic.DEFAULT_RATES)
  assert bench_serving.parse_args(["--synthetic", "0.5,0.25"]).gamma == 2
  for argv, message in ((["--synthetic", "0.5,2"], "--synthetic: rates: c_2 = 2.0"),
                        (["--synthetic", "--shipped"], "--synthetic: the synthetic law"),
                        (["--synthetic", "--temperature", "1"], "--synthetic: only greedy rows"),
                        (["--synthetic", "0.5", "--gamma", "3"], "--gamma: 3, but --synthetic"),
                        (["--gamma", "0"], "--gamma: must be >= 1")):
    with pytest.raises(SystemExit):
      bench_serving.parse_args(argv)
    assert message in capsys.readouterr().err
