"""Statistics helpers for the distribution tests: chi-square goodness of fit against an exact law."""

from __future__ import annotations

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0
P_THRESHOLD = 1e-3
"""A test fails when the goodness-of-fit p-value is below this (seeds are fixed, so CI is
deterministic; at this level a correct sampler fails one fixed seed in a thousand)."""


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = MIN_EXPECTED):
  """Pearson chi-square of observed `counts` against the exact law `probs` (same shape, any rank).

  Outcomes whose expected count is below `min_expected` are pooled into one bin (dropped if the pool
  itself is still below it) so the chi-square approximation holds. An outcome observed where the law
  puts zero mass returns p = 0.

  Returns:
    (statistic, degrees of freedom, p-value).
  """
  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  n = counts.sum()
  if np.any(counts[probs == 0] > 0):
    return np.inf, 0, 0.0
  expected = n * probs
  big = expected >= min_expected
  obs = list(counts[big])
  exp = list(expected[big])
  small_exp = expected[~big].sum()
  if small_exp >= min_expected:
    obs.append(counts[~big].sum())
    exp.append(small_exp)
  obs, exp = np.array(obs), np.array(exp)
  exp = exp * obs.sum() / exp.sum()  # condition on the pooled total
  statistic = float(((obs - exp) ** 2 / exp).sum())
  dof = len(obs) - 1
  return statistic, dof, float(stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0


def assert_law(counts, probs, *, what: str, threshold: float = P_THRESHOLD):
  statistic, dof, p_value = chi_square(counts, probs)
  assert p_value >= threshold, (
      f"{what}: chi-square {statistic:.1f} on {dof} dof, p = {p_value:.2e} < {threshold} "
      f"(N = {int(np.sum(counts))})")
  return p_value


def assert_rejects(counts, probs, *, what: str, threshold: float = 1e-6):
  """The power check: the same samples must be rejected against a wrong law."""
  statistic, dof, p_value = chi_square(counts, probs)
  assert p_value < threshold, (
      f"{what}: a wrong law was not rejected (chi-square {statistic:.1f}, {dof} dof, p = {p_value:.2e})")
