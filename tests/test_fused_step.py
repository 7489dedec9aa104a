"""The experimental fused step kernel (Pallas, interpret mode on the CPU) and its shared noise."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from dspark_jax import fused_step as fs
from dspark_jax import law_checks, sampling
from tests import stats


def test_threefry_equals_jax():
  rng = np.random.default_rng(0)
  for _ in range(5):
    key = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
    count = jnp.asarray(rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32))
    want = np.asarray(jex.random.threefry_2x32(key, count))
    got = np.concatenate([np.asarray(w) for w in fs.threefry2x32(key[0], key[1], count[:32],
                                                                  count[32:])])
    np.testing.assert_array_equal(got, want)


def _inputs(batch, rank, vocab, seed=0):
  rng = np.random.default_rng(seed)
  e = jnp.asarray(rng.normal(0, 1, (batch, rank)), jnp.bfloat16)
  w2 = jnp.asarray(rng.normal(0, 1 / np.sqrt(rank), (rank, vocab)), jnp.bfloat16)
  base = jnp.asarray(rng.normal(0, 2, (batch, vocab)), jnp.bfloat16)
  keys = sampling.row_keys(jax.random.key(seed), jnp.arange(batch), jnp.arange(batch) + 9, 0)
  return e, w2, base, *fs.row_key_words(keys)


def test_kernel_equals_the_xla_reference_edge_cases_included():
  batch, rank, vocab = 6, 16, 1536  # 3 tiles of 512
  e, w2, base, k0, k1 = _inputs(batch, rank, vocab)
  base = base.at[3, 700].set(jnp.nan).at[4].set(-jnp.inf)
  base = base.at[5].set(0.0)  # with e row 5 = 0 below: all-equal logits, greedy -> index 0
  e = e.at[5].set(0.0)
  temperature = jnp.array([1e-5, 0.5, 1.0, 1.0, 2.0, 1.0], jnp.float32)
  greedy = jnp.array([True, False, False, True, False, True])
  kernel = fs.fused_step(e, w2, base, temperature, greedy, k0, k1, interpret=True)
  oracle = fs.reference_step(e, w2, base, temperature, greedy, k0, k1)
  np.testing.assert_array_equal(np.asarray(kernel[1], np.float32), np.asarray(oracle[1], np.float32))
  np.testing.assert_array_equal(kernel[0], oracle[0])
  tokens = np.asarray(kernel[0])
  assert tokens[3] == 700            # NaN wins for a greedy row
  assert tokens[4] == 0              # a row of -inf gives 0
  assert tokens[5] == 0              # ties go to the smallest index
  assert tokens[0] == int(np.argmax(np.asarray(kernel[1][0], np.float32)))


def test_kernel_samples_the_tempered_softmax_of_what_it_emits():
  # N = 30,000 identical sampled rows (V = 256, T = 0.7), one kernel call. Statistic: Pearson
  # chi-square against softmax(corrected / T) of the emitted corrected logits; p >= 1e-3. Power: the
  # law at T = 1 must be rejected (p < 1e-6).
  n, rank, vocab, temperature = 30_000, 8, 256, 0.7
  e, w2, base, _, _ = _inputs(1, rank, vocab, seed=3)
  keys = sampling.row_keys(jax.random.key(5), jnp.arange(n), jnp.full((n,), 4), 0)
  k0, k1 = fs.row_key_words(keys)
  tokens, corrected = fs.fused_step(jnp.broadcast_to(e, (n, rank)), w2,
                                    jnp.broadcast_to(base, (n, vocab)),
                                    jnp.full((n,), temperature, jnp.float32),
                                    jnp.zeros((n,), bool), k0, k1, interpret=True)
  logits = np.asarray(corrected[0], np.float64)
  counts = np.bincount(np.asarray(tokens), minlength=vocab)
  stats.assert_law(counts, law_checks.softmax(logits / temperature), what="fused step law")
  stats.assert_rejects(counts, law_checks.softmax(logits), what="fused step, wrong temperature")
