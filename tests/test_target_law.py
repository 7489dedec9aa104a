"""The target law (temperature, top-k, top-p) against the float64 reference, and exact sampling from it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import law_checks
from tests import stats

CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.55), (1.0, 4, 0.8), (2.0, 1, 1.0), (0.5, 100, 0.3),
    (1e-5, 0, 1.0),
]


def test_log_probs_match_the_reference_row_by_row():
  rng = np.random.default_rng(0)
  logits = np.round(rng.normal(0, 2, (len(CONFIGS), 3, 9)), 1).astype(np.float32)  # ties included
  temperature, top_k, top_p = (np.array(c) for c in zip(*CONFIGS))
  log_p = dj.target_log_probs(jnp.asarray(logits), jnp.asarray(temperature, jnp.float32),
                              jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
  for b, (t, k, p) in enumerate(CONFIGS):
    for j in range(3):
      expected = law_checks.target_probs(logits[b, j], t, k, p)
      np.testing.assert_allclose(np.exp(np.asarray(log_p[b, j])), expected, atol=1e-6,
                                 err_msg=f"config {CONFIGS[b]} row {j}")
      if t >= 0.5:  # (at T = 1e-5 tiny probabilities underflow: 0 without being truncated)
        np.testing.assert_array_equal(np.isneginf(np.asarray(log_p[b, j])), expected == 0)


def test_ties_at_the_truncation_boundary_keep_the_smaller_id():
  logits = np.array([[[0.0, 2.0, 1.0, 2.0, 1.0, 0.5]]], np.float32)
  one = lambda x, dtype: jnp.asarray([x], dtype)
  log_p = dj.target_log_probs(logits, one(1.0, jnp.float32), one(3, jnp.int32), one(1.0, jnp.float32))
  kept = np.flatnonzero(np.isfinite(np.asarray(log_p[0, 0])))
  np.testing.assert_array_equal(kept, [1, 2, 3])  # 2.0, 2.0 and the first of the two 1.0s


def test_without_truncation_it_is_the_tempered_softmax():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 3, (4, 2, 50)).astype(np.float32)
  temperature = np.array([0.5, 1.0, 2.0, 1e-5], np.float32)
  log_p = dj.target_log_probs(logits, temperature, np.zeros(4, np.int32), np.ones(4, np.float32))
  expected = jax.nn.log_softmax(logits / temperature[:, None, None], axis=-1)
  np.testing.assert_allclose(log_p, expected, rtol=1e-6, atol=1e-6)


def test_sample_target_law_in_a_mixed_batch():
  # N = 30,000 rows per configuration, all configurations interleaved in one batch with greedy rows
  # (temperature 0) in between. Statistic: Pearson chi-square against `law_checks.target_probs`,
  # threshold p >= 1e-3; power: each truncating configuration rejects the untruncated law (p < 1e-6).
  rng = np.random.default_rng(2)
  logits_row = rng.normal(0, 1.5, 7).astype(np.float32)
  configs = CONFIGS[:5]
  n = 30_000
  reps = len(configs) + 1
  temperature = np.tile([c[0] for c in configs] + [0.0], n)
  top_k = np.tile([c[1] for c in configs] + [0], n)
  top_p = np.tile([c[2] for c in configs] + [1.0], n)
  params = dj.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  tokens = np.asarray(dj.sample_target(jnp.broadcast_to(logits_row, (n * reps, 7)), params,
                                       jax.random.key(3), np.arange(n * reps) % 11))
  assert np.all(tokens[reps - 1::reps] == np.argmax(logits_row))
  for i, (t, k, p) in enumerate(configs):
    counts = np.bincount(tokens[i::reps], minlength=7)
    law = law_checks.target_probs(logits_row, t, k, p)
    stats.assert_law(counts, law, what=f"target law {configs[i]}")
    if k > 1 or p < 1:
      stats.assert_rejects(counts, law_checks.target_probs(logits_row, t), what=f"{configs[i]} power")


def test_sample_target_rejects_bad_input():
  params = dj.SamplingParams(temperature=1.0, batch_size=2)
  with pytest.raises(ValueError, match="logits: expected"):
    dj.sample_target(jnp.zeros((2, 3, 4)), params, jax.random.key(0), np.zeros(2, np.int32))
  with pytest.raises(ValueError, match="params: has 2 rows"):
    dj.sample_target(jnp.zeros((3, 4)), params, jax.random.key(0), np.zeros(3, np.int32))
