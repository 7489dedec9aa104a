"""Statistics helpers for the distribution tests: chi-square goodness of fit against an exact law."""

from __future__ import annotations

import numpy as np

from dspark_jax.testing.law_checks import chi_square

P_THRESHOLD = 1e-3
"""A test fails when the goodness-of-fit p-value is below this (seeds are fixed, so CI is
deterministic; at this level a correct sampler fails one fixed seed in a thousand)."""


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
