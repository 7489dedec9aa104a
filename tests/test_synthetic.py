"""The benchmarks' synthetic acceptance (`benchmarks.synthetic`): the law it plants is the law a decode
measures, through the dense verify and through a schedule's packed one.

Law test: 16 greedy rows of the tiny random pair (γ = 4), 256 new tokens each, seeds fixed. For
each draft position k, the accepted drafts among those reached are tested against Binomial(reached,
c_k) (chi-square on [accepted, rejected], p >= 1e-3, `tests.stats`; about 500 to 1,700 reached per
position), and the same counts must reject a planted law c_k - 0.15 (p < 1e-6).
"""

import jax
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
