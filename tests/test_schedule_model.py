"""`benchmarks.schedule_model`: the oracle bound against exact cases, and no schedule above it."""

import numpy as np

from benchmarks import schedule_model as sm


def test_the_oracle_verifies_exactly_each_accepted_run():
  # Certain acceptance: every row keeps its γ drafts, so the oracle verifies what `fixed` does.
  # Certain rejection: one token per row. Both against the table's rate at those tokens.
  sps = sm.dense_table({4: 10.0, 8: 8.0, 16: 5.0})
  ones, zeros = [np.ones((4, 3), np.float32)], [np.zeros((4, 3), np.float32)]
  assert sm.oracle(ones, sps, seed=0) == 16 * 5.0
  assert sm.oracle(zeros, sps, seed=0) == 4 * 10.0
  # A half-way law: a row's accepted run has mean Σ_k 0.5^k = 0.875 and variance
  # Σ_k (2k − 1)·0.5^k − 0.875² = 1.109 (γ = 3); the oracle's mean tokens per round follow it
  # (4 rows, 2000 rounds, seed 1: within 5 standard errors of 4 · 1.875).
  flat = sm.dense_table({64: 1.0})
  half = [np.full((4, 3), 0.5, np.float32)] * 2000
  assert abs(sm.oracle(half, flat, seed=1) - 4 * 1.875) < 5 * np.sqrt(4 * 1.109 / 2000)


def test_no_schedule_models_above_the_oracle():
  # The H100 table at c = 128 with rows spread (σ = 2): fixed, prefix, top_k and the best uniform
  # length all model at most the clairvoyant bound (40 rounds, fixed seed).
  r = sm.study(128, sm.H100_TABLES[128], (0.82, 0.78, 0.74, 0.7, 0.65, 0.6, 0.55), 2.0, 40, 0)
  for name in ("fixed", "prefix", "top_k", "uniform"):
    assert r[name] <= r["oracle"], name
  assert r["oracle"] > 1.1 * r["fixed"]
