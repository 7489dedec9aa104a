"""The attention-inputs kernel (`kernels.attention_inputs`) against the model's own XLA path it
replaces (`layers.Attention.project` and the cache writes): the per-head norms, the rotary
embedding and the cache writes of a decode step, a verify and packed tokens, over contiguous and
paged caches.

On the CPU the kernel runs in Pallas' interpreter; on a GPU host (``DSPARK_TEST_GPU=1``) the same
tests run the compiled Triton kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.kernels import attention_inputs as ai
from dspark_jax.models import layers
from tests import helpers

pytestmark = pytest.mark.kernel
INTERPRET = jax.default_backend() != "gpu"
BF16_ULP = 2.0 ** -8


def _inputs(seed, m, heads, kv_heads, d, cache_shape, dtype):
  rng = np.random.default_rng(seed)
  qkv = jnp.asarray(rng.normal(size=(m, (heads + 2 * kv_heads) * d)), dtype)
  q_scale, k_scale = (jnp.asarray(rng.normal(size=d), dtype) for _ in range(2))
  cache_k, cache_v = (jnp.asarray(rng.normal(size=cache_shape), dtype) for _ in range(2))
  return rng, qkv, q_scale, k_scale, cache_k, cache_v


def _reference(qkv, positions, rows, q_scale, k_scale, cache_k, cache_v, *, heads, kv_heads,
               theta, scaling=None, table=None):
  """What the model computes without the kernel: `layers.Attention.project` (a layer whose fused
  product is the identity, so that its input is `qkv`), then the XLA writes of the target's
  paths (`paging.cache.write` through a table; else a scatter that drops out-of-range tokens)."""
  from dspark_jax.paging import cache as paging
  d, width = cache_k.shape[3], qkv.shape[1]
  shape = layers.LayerShape(hidden_size=width, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                            intermediate_size=8, rope_theta=theta,
                            rope_scaling=scaling or layers.RopeScaling())
  attn = layers.Attention(shape, dtype=qkv.dtype, param_dtype=qkv.dtype, rngs=nnx.Rngs(0))
  attn.qkv_proj.kernel.value = jnp.eye(width, dtype=qkv.dtype)
  attn.q_norm.scale.value = q_scale
  attn.k_norm.scale.value = k_scale
  with jax.default_matmul_precision("highest"):            # the identity product exactly
    q, k, v = (x[0] for x in attn.project(qkv[None], positions[None]))
  if table is not None:
    return q, paging.write(cache_k, table, rows, positions, k), paging.write(
        cache_v, table, rows, positions, v)
  ok = (rows < cache_k.shape[0]) & (positions < cache_k.shape[2])
  row = jnp.where(ok, rows, cache_k.shape[0])
  write = lambda cache, x: cache.at[row, :, positions].set(x.astype(cache.dtype), mode="drop")
  return q, write(cache_k, k), write(cache_v, v)


def _close(got, want, dtype):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  # bf16: one rounding of a value may land one unit apart (the sum of squares and cos/sin are
  # computed in another order); float32: a few units of float32 rounding.
  tol = 2 * BF16_ULP if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.max(np.abs(want)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 16), (32, 8, 128)])
def test_kernel_equals_xla_on_a_contiguous_cache_and_drops_what_is_out_of_range(
    dtype, heads, kv_heads, d):
  b, t, slots = 3, 4, 32
  rng, qkv, q_scale, k_scale, cache_k, cache_v = _inputs(
      0, b * t, heads, kv_heads, d, (b, kv_heads, slots, d), dtype)
  positions = (np.array([0, 5, 27])[:, None] + np.arange(t)).reshape(-1)
  rows = np.repeat(np.arange(b), t)
  rows[3] = b                       # a padding token: nothing written
  positions[5] = slots + 2          # past the cache: nothing written
  positions, rows = jnp.asarray(positions, jnp.int32), jnp.asarray(rows, jnp.int32)
  inv_freq, factor = layers.rope_frequencies(d, 10_000.0)
  kw = dict(heads=heads, kv_heads=kv_heads, eps=1e-6, factor=factor)
  args = (qkv, positions, rows, q_scale, k_scale, inv_freq, cache_k, cache_v)
  got = ai.attention_inputs(*args, interpret=INTERPRET, **kw)
  want = _reference(qkv, positions, rows, q_scale, k_scale, cache_k, cache_v, heads=heads,
                    kv_heads=kv_heads, theta=10_000.0)
  for g, w in zip(got, want):
    _close(g, w, dtype)
  # Only the in-range tokens' entries changed.
  changed = np.any(np.asarray(got[1]) != np.asarray(cache_k), axis=(1, 3))     # [B, S]
  expect = np.zeros_like(changed)
  for row, position in zip(np.asarray(rows), np.asarray(positions)):
    if row < b and position < slots:
      expect[row, position] = True
  np.testing.assert_array_equal(changed, expect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_xla_through_a_block_table(dtype):
  heads, kv_heads, d, page_size, pages = 8, 2, 16, 8, 12
  rng, qkv, q_scale, k_scale, cache_k, cache_v = _inputs(
      1, 10, heads, kv_heads, d, (pages, kv_heads, page_size, d), dtype)
  table = jnp.asarray([[3, 7, -1, -1], [0, 11, 5, 2], [9, -1, -1, -1]], jnp.int32)
  rows = jnp.asarray([0, 0, 0, 1, 1, 1, 1, 2, 2, 3], jnp.int32)    # row 3: out of the table
  positions = jnp.asarray([7, 8, 9, 0, 15, 16, 31, 6, 8, 0], jnp.int32)  # (2, 8): no page there
  inv_freq, factor = layers.rope_frequencies(d, 1_000_000.0)
  kw = dict(heads=heads, kv_heads=kv_heads, eps=1e-6, factor=factor)
  args = (qkv, positions, rows, q_scale, k_scale, inv_freq, cache_k, cache_v)
  got = ai.attention_inputs(*args, table=table, interpret=INTERPRET, **kw)
  want = _reference(qkv, positions, rows, q_scale, k_scale, cache_k, cache_v, heads=heads,
                    kv_heads=kv_heads, theta=1_000_000.0, table=table)
  for g, w in zip(got, want):
    _close(g, w, dtype)
  written = np.any(np.asarray(got[2]) != np.asarray(cache_v), axis=(1, 3)).sum()
  assert written == 8                          # 10 tokens: one without a page, one without a row


def test_kernel_equals_the_layers_own_projection_with_an_attention_factor():
  # A yarn variant: an attention factor other than 1 scales cos and sin.
  scaling = layers.RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64,
                               beta_fast=32.0, beta_slow=1.0, attention_factor=1.2)
  shape = layers.LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, rope_scaling=scaling)
  attn = layers.Attention(shape, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  attn.q_norm.scale.value = jnp.asarray(rng.normal(size=16), jnp.float32)
  attn.k_norm.scale.value = jnp.asarray(rng.normal(size=16), jnp.float32)
  b, t, slots = 2, 3, 16
  x = jnp.asarray(rng.normal(size=(b, t, 64)), jnp.float32)
  positions = jnp.asarray([[4, 5, 6], [10, 11, 12]], jnp.int32)
  with jax.default_matmul_precision("highest"):
    q, k, v = attn.project(x, positions)
    qkv = attn.qkv_proj(x).reshape(b * t, -1)
  cache = jnp.zeros((b, 2, slots, 16), jnp.float32)
  inv_freq, factor = layers.rope_frequencies(16, shape.rope_theta, scaling)
  assert factor != 1.0
  rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
  got_q, got_k, got_v = ai.attention_inputs(
      qkv, positions.reshape(-1), rows, attn.q_norm.scale[...], attn.k_norm.scale[...], inv_freq,
      cache, cache, heads=4, kv_heads=2, eps=shape.rms_eps, factor=factor, interpret=INTERPRET)
  np.testing.assert_allclose(got_q.reshape(q.shape), q, rtol=1e-5, atol=1e-5)
  start = positions[:, 0]
  np.testing.assert_allclose(got_k, layers.write_heads(cache, k, start), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_v, layers.write_heads(cache, v, start), rtol=1e-5, atol=1e-5)


def test_choose_takes_the_kernel_on_gpus_and_names_a_failed_precondition(monkeypatch):
  monkeypatch.delenv(ai.ENV_VAR, raising=False)
  qkv = jax.ShapeDtypeStruct((16, 48 * 128), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((16, 8, 1024, 128), jnp.bfloat16)
  kw = dict(heads=32, kv_heads=8, head_dim=128)
  assert ai.choose(qkv, cache, platform="gpu", **kw) == "pallas"
  assert ai.choose(qkv, cache, platform="cpu", **kw) == "xla"
  assert ai.choose(qkv, cache, implementation="pallas", platform="cpu", **kw) == "interpret"
  assert ai.choose(qkv, cache, implementation="xla", platform="gpu", **kw) == "xla"
  odd = jax.ShapeDtypeStruct((16, 8, 1024, 128), jnp.float32)      # the cache's dtype differs
  assert ai.choose(qkv, odd, platform="gpu", **kw) == "xla"
  with pytest.raises(ValueError, match="qkv .bfloat16. and the cache .float32. differ"):
    ai.choose(qkv, odd, implementation="pallas", platform="gpu", **kw)
  with pytest.raises(ValueError, match="G=3 query heads per kv head is not a power of two"):
    ai.choose(jax.ShapeDtypeStruct((16, 30 * 128), jnp.bfloat16), cache, implementation="pallas",
              platform="gpu", heads=24, kv_heads=8, head_dim=128)
  monkeypatch.setenv(ai.ENV_VAR, "fused")
  with pytest.raises(ValueError, match="DSPARK_JAX_ATTENTION_INPUTS"):
    ai.choose(qkv, cache, **kw)


@pytest.mark.parametrize("paged", [False, True])
def test_a_target_through_the_kernel_equals_the_xla_writes(monkeypatch, paged):
  """A decode step and a verify block of a tiny target over a cache of random context, through
  XLA and with the kernel forced: the same logits, features and caches."""
  target, cache, paged_cache, calls, _ = helpers.tiny_target_calls()
  cache = paged_cache if paged else cache
  outs = {}
  for implementation in ("xla", "pallas"):
    monkeypatch.setenv(ai.ENV_VAR, implementation)
    run = jax.jit(lambda tokens, positions, cache: target(tokens, positions, cache))
    with jax.default_matmul_precision("highest"):        # a GPU's TF32 would blur float32
      outs[implementation] = [run(tokens, positions, cache) for tokens, positions in calls]
  for got, want in zip(outs["pallas"], outs["xla"]):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
