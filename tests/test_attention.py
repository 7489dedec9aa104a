"""The attention decision (`kernels.attention`): preconditions, the override, and the XLA form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels import attention
from dspark_jax.models import layers


def test_choose_falls_back_to_xla_off_the_gpu_and_for_float32():
  assert attention.choose(jnp.bfloat16, 128, "auto", platform="cpu") == "xla"
  assert attention.choose(jnp.float32, 128, "auto", platform="gpu") == "xla"
  assert attention.choose(jnp.bfloat16, 256, "auto", platform="gpu") == "xla"
  assert attention.choose(jnp.bfloat16, 128, "auto", platform="gpu") == "cudnn"
  assert attention.choose(jnp.bfloat16, 128, "xla", platform="gpu") == "xla"
  # auto: cuDNN for one query per row only; an explicit request for any number of queries
  assert attention.choose(jnp.bfloat16, 128, "auto", platform="gpu", queries=8) == "xla"
  assert attention.choose(jnp.bfloat16, 128, "cudnn", platform="gpu", queries=8) == "cudnn"


def test_explicit_cudnn_names_the_failed_precondition(monkeypatch):
  with pytest.raises(ValueError, match="'cudnn': precondition failed: platform is 'cpu'"):
    attention.choose(jnp.bfloat16, 128, "cudnn", platform="cpu")
  monkeypatch.setenv(attention.ENV_VAR, "flash")
  with pytest.raises(ValueError, match="DSPARK_JAX_ATTENTION"):
    attention.choose(jnp.bfloat16, 128)


def test_xla_form_matches_a_float64_reference_and_zeroes_empty_rows():
  rng = np.random.default_rng(0)
  b, t, s, n, k, d = 2, 3, 5, 4, 2, 8
  q, keys, values = (rng.normal(size=shape).astype(np.float32)
                     for shape in ((b, t, n, d), (b, k, s, d), (b, k, s, d)))
  mask = rng.random((b, t, s)) < 0.6
  mask[1, 2] = False
  out = np.asarray(attention.attend_xla(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values),
                                        jnp.asarray(mask)))
  ref = np.zeros((b, t, n, d))
  for bi in range(b):
    for ti in range(t):
      for h in range(n):
        kv = h // (n // k)
        sc = keys[bi, kv].astype(np.float64) @ q[bi, ti, h] / np.sqrt(d)
        if mask[bi, ti].any():
          w = np.where(mask[bi, ti], np.exp(sc - sc[mask[bi, ti]].max()), 0.0)
          ref[bi, ti, h] = (w / w.sum()) @ values[bi, kv]
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)  # float32 rounding of 5-term sums
  assert np.all(out[1, 2] == 0)


@pytest.mark.gpu
def test_cudnn_form_matches_xla_form_on_the_gpu():
  rng = np.random.default_rng(1)
  b, t, s, n, k, d = 4, 8, 256, 8, 2, 128
  q, keys, values = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
                     for shape in ((b, t, n, d), (b, k, s, d), (b, k, s, d)))
  pos = jnp.asarray(rng.integers(t, s - t, b))[:, None] + jnp.arange(t)[None]
  mask = jnp.arange(s)[None, None] <= pos[:, :, None]
  mask = mask.at[0, 0].set(False)  # a query with nothing to attend to gets zeros
  # The verify pass's 8 queries, and the autoregressive step's one (its own reshape path).
  for queries in (q, q[:, -1:]):
    rows = mask[:, -queries.shape[1]:]
    ref = np.asarray(attention.attend_xla(queries, keys, values, rows), np.float32)
    out = np.asarray(attention.attend_cudnn(queries, keys, values, rows), np.float32)
    # bf16 outputs of averages of unit normals: within a few bf16 ulps (2^-8 relative) of each other.
    np.testing.assert_allclose(out, ref, atol=4 * 2.0**-8 * np.abs(ref).max())
    if queries.shape[1] == t:
      assert np.all(out[0, 0] == 0)


@pytest.mark.parametrize("slots", [24, 1100])   # 1100: the prefix part reads a cut cache
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cached_form_equals_the_whole_form_over_the_joined_keys(dtype, slots):
  # A cache prefix + a fresh block, with a causal block and with a block that sees itself whole
  # (the draft's), against `attend_xla` over the cache with the block written in.
  # Row 2 has no prefix; slots past the prefix hold garbage that must not be read.
  rng = np.random.default_rng(2)
  b, t, s, n, k, d = 3, 4, slots, 4, 2, 16
  q, cache_k, cache_v = (jnp.asarray(rng.normal(size=shape), dtype)
                         for shape in ((b, t, n, d), (b, k, s, d), (b, k, s, d)))
  block_k, block_v = (jnp.asarray(rng.normal(size=(b, t, k, d)), dtype) for _ in range(2))
  start = jnp.asarray([5, 17 if s < 600 else 700, 0])
  positions = start[:, None] + jnp.arange(t)[None]
  keys = layers.write_heads(cache_k, block_k, start)
  values = layers.write_heads(cache_v, block_v, start)
  slots = jnp.arange(s)[None, None, :]
  for causal in (True, False):
    block_mask = (positions[:, None, :] <= positions[:, :, None]) if causal else jnp.ones((b, t, t), bool)
    full_mask = (slots < start[:, None, None]) | (
        (slots >= start[:, None, None]) & (slots < start[:, None, None] + t) &
        ((slots <= positions[:, :, None]) if causal else True))
    ref = np.asarray(attention.attend_xla(q, keys, values, full_mask), np.float32)
    out = np.asarray(attention.attend_cached(q, keys, values, start, block_k, block_v, block_mask),
                     np.float32)
    # float32: 1e-5 (sums of ~20 terms); bf16: a few ulps (2^-8 relative) of the largest output.
    tol = 1e-5 if dtype == jnp.float32 else 4 * 2.0**-8 * np.abs(ref).max()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=1e-5)


def test_cut_lengths_cover_the_cache_in_steps_of_at_most_the_ratio():
  assert attention.cut_lengths(100) == (100,)
  assert attention.cut_lengths(1000) == (1000,)     # small caches are read whole
  cuts = attention.cut_lengths(8200)
  assert cuts[0] == 128 and cuts[-1] == 8200 and list(cuts) == sorted(set(cuts))
  assert all(c % 64 == 0 for c in cuts[:-1])
  assert all(b / a <= 2 ** 0.5 + 64 / a for a, b in zip(cuts, cuts[1:]))


@pytest.mark.parametrize("groups,dtype", [(1, jnp.float32), (2, jnp.bfloat16), (4, jnp.float32),
                                          (8, jnp.bfloat16)])
def test_limited_form_equals_the_masked_form_and_never_reads_past_a_limit(dtype, groups):
  # Rows of length 0, 1, at capacity, and in between; causal verify-like limits (start + t + 1);
  # slots at or past each query's limit hold large finite garbage that must not change anything.
  rng = np.random.default_rng(groups)
  b, t, s, k, d = 5, 3, 1100, 2, 8        # S = 1100: cut to 128, 192, ..., 1088 or 1100
  n = k * groups
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), dtype)
  keys, values = (rng.normal(size=(b, k, s, d)) for _ in range(2))
  for lengths in ([0, 1, s, 600, 900], [3, 7, 0, 1, 2], [s] * b):
    start = np.maximum(np.asarray(lengths) - t, 0)
    limits = np.minimum(start[:, None] + np.arange(1, t + 1)[None], np.asarray(lengths)[:, None])
    limits = jnp.asarray(limits, jnp.int32)
    mask = jnp.arange(s)[None, None] < limits[:, :, None]
    garbage = np.arange(s)[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
    dirty_k, dirty_v = (jnp.asarray(np.where(garbage, 1e3 * rng.normal(size=x.shape), x), dtype)
                        for x in (keys, values))
    clean_k, clean_v = (jnp.asarray(x, dtype) for x in (keys, values))
    ref = np.asarray(attention.attend_xla(q, clean_k, clean_v, mask), np.float32)
    out = np.asarray(attention.attend_limited(q, dirty_k, dirty_v, limits), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 4 * 2.0**-8 * np.abs(ref).max()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=1e-5)
    assert np.all(out[np.asarray(limits) == 0] == 0)


def test_limited_form_compiles_once_for_every_length():
  rng = np.random.default_rng(3)
  b, t, s, n, k, d = 2, 2, 1200, 4, 2, 8
  q, keys, values = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                     for shape in ((b, t, n, d), (b, k, s, d), (b, k, s, d)))
  traces = []

  @jax.jit
  def call(q, keys, values, limits):
    traces.append(1)
    return attention.attend_limited(q, keys, values, limits)

  for length in (1, 600, 800, 1200):
    limits = jnp.full((b, t), length, jnp.int32)
    ref = attention.attend_xla(q, keys, values, jnp.arange(s)[None, None] < limits[:, :, None])
    np.testing.assert_allclose(call(q, keys, values, limits), ref, rtol=1e-5, atol=1e-6)
  assert len(traces) == 1 and call._cache_size() == 1


def test_cache_attention_takes_the_ragged_kernel_on_gpus_where_it_applies():
  q = jax.ShapeDtypeStruct((4, 8, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((4, 8, 1088, 128), jnp.bfloat16)
  assert attention.choose_cached(q, k, "auto", platform="gpu") == "ragged"
  assert attention.choose_cached(q, k, "auto", platform="cpu") == "xla"
  assert attention.choose_cached(q, k, "xla", platform="gpu") == "xla"
  odd = jax.ShapeDtypeStruct((4, 8, 1040, 128), jnp.bfloat16)   # not a multiple of 64 slots
  assert attention.choose_cached(q, odd, "auto", platform="gpu") == "xla"
  one = jax.ShapeDtypeStruct((4, 1, 32, 128), jnp.bfloat16)
  assert attention.choose_cached(one, odd, "auto", platform="gpu") == "cudnn"
  with pytest.raises(ValueError, match="'ragged': precondition failed: platform is 'cpu'"):
    attention.choose_cached(q, k, "ragged", platform="cpu")
  # A whole-mask call (no cache) asked for "ragged" takes auto's choice.
  assert attention.choose(jnp.bfloat16, 128, "ragged", platform="gpu") == "cudnn"


@pytest.mark.kernel
def test_cache_attention_through_the_ragged_kernel_equals_the_xla_form(monkeypatch):
  # The dispatch's plumbing around the kernel (layouts, the draft's softmax join through the
  # kernel's log-sum-exp), with the kernel in Pallas' interpreter off the GPU.
  import functools
  from dspark_jax.kernels import ragged_attention
  rng = np.random.default_rng(4)
  b, t, s, n, k, d = 3, 4, 64, 4, 2, 16
  q, cache_k, cache_v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                         for shape in ((b, t, n, d), (b, k, s, d), (b, k, s, d)))
  block_k, block_v = (jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32) for _ in range(2))
  prefix = jnp.asarray([5, 40, 0])
  limits = prefix[:, None] + jnp.arange(1, t + 1)[None]
  block_mask = jnp.ones((b, t, t), bool)
  monkeypatch.setenv(attention.ENV_VAR, "xla")
  with jax.default_matmul_precision("highest"):  # a GPU's XLA form would use TF32 by default
    refs = (attention.attend_limited(q, cache_k, cache_v, limits),
            attention.attend_cached(q, cache_k, cache_v, prefix, block_k, block_v, block_mask))
  monkeypatch.delenv(attention.ENV_VAR)
  on_cpu = jax.default_backend() != "gpu"
  if on_cpu:
    monkeypatch.setattr(attention, "ragged_precondition", lambda q, k, platform=None: None)
    monkeypatch.setattr(ragged_attention, "ragged_attention", functools.partial(
        ragged_attention.ragged_attention, interpret=True))
  assert attention.choose_cached(q, cache_k) == "ragged"
  with jax.default_matmul_precision("highest"):  # the draft's block part is XLA's
    outs = (attention.attend_limited(q, cache_k, cache_v, limits),
            attention.attend_cached(q, cache_k, cache_v, prefix, block_k, block_v, block_mask))
  for out, ref in zip(outs, refs):
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("groups,dtype,slots", [(2, jnp.float32, 100), (4, jnp.bfloat16, 96)])
def test_flash_form_equals_the_masked_form_at_every_tile_edge(groups, dtype, slots):
  """`attend_flash` (tiles of 16 queries, steps of 32 slots; S = 100 makes the last step overlap
  the one before) against `attend_xla`: a causal prefill from 0, a chunk starting mid-cache, a
  row at a step edge, nothing, the whole cache and random limits; large garbage past each row's
  longest limit."""
  rng = np.random.default_rng(groups)
  b, t, k, d = 6, 40, 2, 16
  q = jnp.asarray(rng.normal(size=(b, t, k * groups, d)), dtype)
  keys, values = (rng.normal(size=(b, k, slots, d)) for _ in range(2))
  limits = np.stack([np.arange(t) + 1, 50 + np.arange(t) + 1, np.full(t, 32), np.zeros(t),
                     np.full(t, slots), rng.integers(0, slots + 1, t)])
  limits = jnp.asarray(np.minimum(limits, slots), jnp.int32)
  past = np.arange(slots)[None, None, :, None] >= np.asarray(limits).max(1)[:, None, None, None]
  dirty_k, dirty_v = (jnp.asarray(np.where(past, 1e4 * rng.normal(size=x.shape), x), dtype)
                      for x in (keys, values))
  clean_k, clean_v = (jnp.asarray(x, dtype) for x in (keys, values))
  with jax.default_matmul_precision("highest"):
    ref = np.asarray(attention.attend_xla(q, clean_k, clean_v, jnp.arange(slots)[None, None]
                                          < limits[:, :, None]), np.float32)
    out = np.asarray(attention.attend_flash(q, dirty_k, dirty_v, limits, query_tile=16,
                                            kv_chunk=32), np.float32)
  tol = 1e-5 if dtype == jnp.float32 else 4 * 2.0**-8 * np.abs(ref).max()
  np.testing.assert_allclose(out, ref, atol=tol, rtol=1e-5)
  assert np.all(out[np.asarray(limits) == 0] == 0)


def test_a_long_chunk_of_queries_holds_one_tile_of_scores_not_t_by_s():
  """Witness: XLA's `memory_analysis` of `attend_limited` with T = 512 queries over S = 4096
  slots (B = 1, N = 4, float32) on the einsum path. The [N, T, S] float32 scores alone are
  32 MiB; the flash form's scratch must stay within 4 tiles of [N, 128, 512] scores (4 MiB),
  while the cut-cache form (forced by raising the threshold) needs all of them."""
  b, t, s, n, k, d = 1, 512, 4096, 4, 2, 16
  args = (jax.ShapeDtypeStruct((b, t, n, d), jnp.float32),
          jax.ShapeDtypeStruct((b, k, s, d), jnp.float32),
          jax.ShapeDtypeStruct((b, k, s, d), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.int32))

  def scratch():
    compiled = jax.jit(lambda *a: attention.attend_limited(*a)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  tile_bytes = b * n * attention.FLASH_QUERY_TILE * attention.FLASH_KV_CHUNK * 4
  assert t > attention.FLASH_MIN_QUERIES
  assert scratch() <= 4 * tile_bytes
  scores_bytes = b * n * t * s * 4
  original = attention.FLASH_MIN_QUERIES
  try:
    attention.FLASH_MIN_QUERIES = t   # the cut-cache form: the power check of the witness
    assert scratch() >= scores_bytes
  finally:
    attention.FLASH_MIN_QUERIES = original


def test_choose_causal_takes_cudnn_for_a_long_fresh_prefill_on_the_gpu_only():
  q = lambda t, dtype=jnp.bfloat16, d=128: jax.ShapeDtypeStruct((2, t, 4, d), dtype)
  assert attention.choose_causal(q(128), "auto", platform="gpu") in ("cudnn", None)
  if attention.cudnn_precondition(jnp.bfloat16, 128, platform="gpu") is None:
    assert attention.choose_causal(q(128), "auto", platform="gpu") == "cudnn"
  assert attention.choose_causal(q(128), "auto", platform="cpu") is None
  assert attention.choose_causal(q(attention.FLASH_MIN_QUERIES - 1), "auto", platform="gpu") is None
  assert attention.choose_causal(q(200), "auto", platform="gpu") is None   # not a power of two
  assert attention.choose_causal(q(192), "auto", platform="gpu") is None
  assert attention.choose_causal(q(128, jnp.float32), "auto", platform="gpu") is None
  assert attention.choose_causal(q(128), "xla", platform="gpu") is None
  assert attention.choose_causal(q(128), "ragged", platform="gpu") is None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 256, 1024])
def test_causal_cudnn_prefill_equals_the_cache_form_on_the_gpu(t):
  rng = np.random.default_rng(3)
  b, n, k, d = 2, 8, 2, 128
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
  keys, values = (jnp.asarray(rng.normal(size=(b, k, t, d)), jnp.bfloat16) for _ in range(2))
  assert attention.choose_causal(q) == "cudnn"
  out = np.asarray(attention.attend_causal(q, keys, values), np.float32)
  # The cache form: the same keys in the first T slots of a longer cache, garbage after them.
  pad = jnp.full((b, k, 64, d), jnp.nan, jnp.bfloat16)
  limits = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), (b, t))
  ref = np.asarray(attention.attend_limited(q, jnp.concatenate([keys, pad], 2),
                                            jnp.concatenate([values, pad], 2), limits), np.float32)
  # bf16 outputs of averages of unit normals: within a few bf16 ulps (2^-8 relative).
  np.testing.assert_allclose(out, ref, atol=4 * 2.0**-8 * np.abs(ref).max())
