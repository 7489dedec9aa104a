"""Sequential Temperature Scaling and the calibration measures (`dspark_jax.calibration`).

STS must recover known per-position temperatures: raw logits z, true temperatures T* on the search
grid, labels drawn (fixed seed, N = 100,000 rounds) from the calibrated cumulative law
P(accept_len ≥ k | z) = Π_{i≤k} σ(z_i / T*_i); the fit sees only the raw confidences σ(z). Measures are
checked against hand computations on tiny examples and against brute force.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.draft import heads

C = dj.calibration
GRID = np.logspace(-1, 1, 41)
STEP = np.log(GRID[1] / GRID[0])


def synthetic(n, true_t, seed):
  """Raw confidences σ(z) and accept lengths drawn from the law calibrated by `true_t`."""
  rng = np.random.default_rng(seed)
  gamma = len(true_t)
  z = rng.normal(1.0, 2.0, (n, gamma))
  calibrated = 1 / (1 + np.exp(-z / np.asarray(true_t)))
  survived = np.cumprod(rng.random((n, gamma)) < calibrated, axis=1)
  return 1 / (1 + np.exp(-z)), survived.sum(axis=1)


def test_sts_recovers_known_temperatures_and_lowers_ece():
  true_t = GRID[[24, 16, 28, 20, 12]]  # 1.58, 0.63, 2.51, 1.0, 0.40
  confidence, accept_len = synthetic(100_000, true_t, seed=11)
  fitted = C.fit_sts(confidence, accept_len)
  assert fitted.shape == (5,)
  assert np.all(np.abs(np.log(fitted / true_t)) <= STEP * 1.001), (fitted, true_t)
  before = C.ece(confidence, accept_len)
  after = C.ece(confidence, accept_len, temperatures=fitted)
  assert np.all(after < 0.01), after
  assert before.max() > 0.03, before  # the raw confidences were miscalibrated: the fit had work
  assert np.all(after < before)
  # Temperature scaling preserves each position's order: position 1's AUC is unchanged.
  np.testing.assert_allclose(C.auc(confidence, accept_len)[0],
                             C.auc(confidence, accept_len, fitted)[0], rtol=1e-12)


def test_sts_picks_the_grid_minimum_sequentially():
  # The fit equals a brute-force search: position by position, ECE of the product over the grid.
  confidence, accept_len = synthetic(3_000, [0.5, 2.0, 1.0], seed=12)
  grid = np.array([0.25, 0.5, 1.0, 2.0, 4.0])
  fitted = C.fit_sts(confidence, accept_len, grid=grid, bins=7)
  chosen = []
  for k in range(3):
    errors = []
    for t in grid:
      temps = np.array(chosen + [t] + [1.0] * (2 - k))
      errors.append(C.ece(confidence, accept_len, temps, bins=7)[k])
    chosen.append(grid[int(np.argmin(errors))])
  np.testing.assert_array_equal(fitted, chosen)


def test_ece_by_hand():
  confidence = np.array([[0.9, 0.5], [0.2, 0.5], [0.6, 1.0], [1.0, 1.0]])
  accept_len = np.array([2, 0, 1, 2])
  # Position 1: a = .9 .2 .6 1.0 (1.0 in the last bin), labels 1 0 1 1; bins [0, .5), [.5, 1]:
  #   bin 0 {.2}: |0 − .2|·1/4 = .05; bin 1 {.9, .6, 1}: |1 − 2.5/3|·3/4 = .125.
  # Position 2: a = .45 .1 .6 1.0, labels 1 0 0 1: bin 0: |.5 − .275|·2/4 = .1125; bin 1: |.5 − .8|·2/4.
  np.testing.assert_allclose(C.ece(confidence, accept_len, bins=2), [0.175, 0.2625], rtol=1e-12)
  diagram = C.reliability(confidence, accept_len, bins=2)
  np.testing.assert_array_equal(diagram.counts, [[1, 3], [2, 2]])
  np.testing.assert_allclose(diagram.accuracy, [[0, 1], [0.5, 0.5]])
  np.testing.assert_allclose(diagram.confidence, [[0.2, 2.5 / 3], [0.275, 0.8]])
  np.testing.assert_allclose(diagram.centres, [0.25, 0.75])
  empty = C.reliability(confidence, accept_len, bins=20)
  assert np.isnan(empty.accuracy[0, 0]) and empty.counts.sum() == 8


def test_temperatures_are_what_the_confidence_head_applies():
  # ece(c, T) measures σ(logit(c) / T): the head with stored temperatures emits exactly that.
  rng = np.random.default_rng(13)
  hidden = rng.normal(size=(50, 3)).astype(np.float32)
  arrays = {"w": rng.normal(size=3).astype(np.float32), "b": np.float32(0.3)}
  temps = np.array([0.5, 2.0], np.float32)
  raw = np.stack([np.asarray(heads.confidence_step(arrays, jnp.asarray(hidden), None, k))
                  for k in range(2)], axis=1)
  cooked = np.stack([np.asarray(heads.confidence_step(dict(arrays, temperatures=temps),
                                                      jnp.asarray(hidden), None, k))
                     for k in range(2)], axis=1)
  np.testing.assert_allclose(C.apply_temperatures(raw, temps), cooked, rtol=2e-6, atol=1e-7)
  accept_len = rng.integers(0, 3, 50)
  np.testing.assert_allclose(C.ece(raw, accept_len, temps), C.ece(cooked, accept_len), atol=1e-6)


def test_auc_against_brute_force_with_ties():
  rng = np.random.default_rng(14)
  confidence = rng.integers(0, 5, (120, 3)) / 4  # many ties, zeros and ones
  accept_len = rng.integers(0, 4, 120)
  temps = np.array([1.0, 0.5, 3.0])
  a = np.cumprod(C.apply_temperatures(confidence, temps), axis=1)
  got = C.auc(confidence, accept_len, temps)
  for k in range(3):
    label = accept_len >= k + 1
    pos, neg = a[label, k], a[~label, k]
    wins = sum((p > q) + 0.5 * (p == q) for p, q in itertools.product(pos, neg))
    np.testing.assert_allclose(got[k], wins / (len(pos) * len(neg)), rtol=1e-12)
  assert np.isnan(C.auc(confidence, np.full(120, 3))[0])  # one class only


def test_confidences_of_zero_and_one():
  confidence = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.5, 0.5]])
  accept_len = np.array([0, 1, 2, 1])
  with np.errstate(all="raise"):
    scaled = C.apply_temperatures(confidence, [0.1, 10.0])
    fitted = C.fit_sts(confidence, accept_len)
    errors = C.ece(confidence, accept_len, fitted)
  assert np.all(np.isfinite(scaled)) and np.all((scaled >= 0) & (scaled <= 1))
  assert np.all(np.isfinite(fitted)) and np.all(np.isfinite(errors))


@pytest.mark.parametrize("call,match", [
    (lambda: C.ece(np.ones(3), np.ones(3, int)), "confidence: expected shape"),
    (lambda: C.ece(np.array([[0.5, 1.5]]), [1]), r"confidence: element \[0, 1\] is 1.5"),
    (lambda: C.ece(np.array([[0.5, np.nan]]), [1]), r"confidence: element \[0, 1\] is nan"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1]), r"accept_len: expected shape \(2,\)"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1, 3]), "accept_len: row 1 is 3"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1.0, 1.0]), "accept_len: expected integers"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1, 1], [1.0, 0.0]), "temperatures: entry 1 is 0.0"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1, 1], [1.0]), "temperatures: expected shape"),
    (lambda: C.ece(np.full((2, 2), 0.5), [1, 1], bins=0), "bins"),
    (lambda: C.reliability(np.full((2, 2), 0.5), [1, 1], bins=2.5), "bins"),
    (lambda: C.fit_sts(np.full((2, 2), 0.5), [1, 1], grid=[1.0, -2.0]), "grid: entry 1 is -2.0"),
    (lambda: C.fit_sts(np.full((2, 2), 0.5), [1, 1], grid=[[1.0]]), "grid"),
    (lambda: C.auc(np.full((2, 2), 0.5), [-1, 1]), "accept_len: row 0 is -1"),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_inputs_are_not_mutated():
  confidence, accept_len = synthetic(500, [1.0, 2.0], seed=15)
  c0, l0 = confidence.copy(), accept_len.copy()
  C.fit_sts(confidence, accept_len)
  C.reliability(confidence, accept_len, [1.0, 2.0])
  np.testing.assert_array_equal(confidence, c0)
  np.testing.assert_array_equal(accept_len, l0)
