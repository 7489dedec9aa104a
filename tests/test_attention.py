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


def fake_cudnn(calls=None):
  """An XLA stand-in for JAX's head-major cuDNN entry point as `kernels.attention` describes it
  (the note above `cudnn_part`): ``BNTH``, ``PADDING`` (per-row q/kv lengths) or ``CAUSAL``
  (top-left), stats [B, N, T] the natural-log log-sum-exp of the scaled scores. A query that sees
  no key gets NaN in both, as the worst case of what cuDNN may do there. `calls` collects the
  mask types."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  def call(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, *, scale,
           mask_type, qkv_layout, return_residual=False):
    assert qkv_layout == "BNTH" and bias is None and mask is None
    if calls is not None:
      calls.append(mask_type)
    b, n, t, d = query.shape
    heads, s = key.shape[1], key.shape[2]
    slots = jnp.arange(s)[None, None, :]
    if mask_type == fa.MaskType.CAUSAL:
      see = jnp.broadcast_to(slots <= jnp.arange(t)[None, :, None], (b, t, s))
    else:
      assert mask_type == fa.MaskType.PADDING and q_seqlen.dtype == kv_seqlen.dtype == jnp.int32
      see = ((slots < kv_seqlen[:, None, None])
             & (jnp.arange(t)[None, :, None] < q_seqlen[:, None, None]))
      value = jnp.where((slots[0] < kv_seqlen[:, None])[:, None, :, None], value, 0)
    scores = jnp.einsum("bkgtd,bksd->bkgts", query.reshape(b, heads, n // heads, t, d), key,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(see[:, None, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.exp(scores - lse[..., None])                  # NaN where no key is seen
    out = jnp.einsum("bkgts,bksd->bkgtd", p.astype(value.dtype), value,
                     preferred_element_type=jnp.float32).astype(query.dtype).reshape(b, n, t, d)
    return (out, lse.reshape(b, n, t)) if return_residual else out
  return call


def _chunk_case(dtype, t=64, s=320):
  """A chunk of `t` queries per row at starts 0, mid-cache, a 128-slot tile edge and the cache's
  end: (q, own k/v token-major, start, the clean cache with the chunk written in, the same cache
  with NaN at and past each row's start)."""
  rng = np.random.default_rng(7)
  b, n, k, d = 4, 4, 2, 16
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), dtype)
  own_k, own_v = (jnp.asarray(rng.normal(size=(b, t, k, d)), dtype) for _ in range(2))
  start = jnp.asarray([0, 77, 128, s - t], jnp.int32)
  past = jnp.arange(s)[None, None, :, None] >= start[:, None, None, None]
  clean, dirty = [], []
  for own in (own_k, own_v):
    cache = layers.write_heads(jnp.asarray(rng.normal(size=(b, k, s, d)), dtype), own, start)
    clean.append(cache)
    dirty.append(jnp.where(past, jnp.nan, cache).astype(dtype))
  return q, own_k, own_v, start, clean, dirty


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_form_joins_its_two_parts_into_the_cache_form(monkeypatch, dtype):
  # `attend_chunk` (the cache before the chunk and the chunk's own causal keys, joined by
  # log-sum-exp) against the cache form over the whole cache (`attend_xla` with limits = start +
  # t + 1): once with XLA parts (`_part` under each part's mask), once through the cuDNN parts'
  # own code with an XLA stand-in for cuDNN (`fake_cudnn`: layouts, sequence lengths, the
  # statistics' conversion, the guard of a row with nothing before it). The cache handed to
  # `attend_chunk` holds NaN at and past each row's start: neither part may read it there.
  from jax._src.cudnn import fused_attention_stablehlo as fa
  q, own_k, own_v, start, (keys, values), (dirty_k, dirty_v) = _chunk_case(dtype)
  b, t, n, d = q.shape
  s = keys.shape[2]
  limits = start[:, None] + jnp.arange(1, t + 1, dtype=jnp.int32)[None]
  with jax.default_matmul_precision("highest"):
    mask = jnp.arange(s)[None, None] < limits[:, :, None]
    ref = np.asarray(attention.attend_xla(q, keys, values, mask), np.float32)
  causal = jnp.broadcast_to(jnp.arange(t)[None, :] <= jnp.arange(t)[:, None], (b, t, t))

  def xla_prior(q, cache_k, cache_v, start):   # cuDNN's padding mask: slots < start, nothing else
    before = jnp.arange(s)[None, :] < start[:, None]
    return attention._part(q, cache_k, jnp.where(before[:, None, :, None], cache_v, 0),
                           jnp.broadcast_to(before[:, None, :], (b, t, s)))

  xla_self = lambda q, k, v: attention._part(q, k, v, causal)
  heads_k, heads_v = layers.heads_first(own_k), layers.heads_first(own_v)
  calls = []
  with jax.default_matmul_precision("highest"):
    outs = {"xla parts": attention.attend_chunk(q, heads_k, heads_v, dirty_k, dirty_v, start,
                                                prior_part=xla_prior, self_part=xla_self)}
    monkeypatch.setattr(fa, "dot_product_attention", fake_cudnn(calls))
    outs["cudnn parts, XLA stand-in"] = attention.attend_chunk(q, heads_k, heads_v, dirty_k,
                                                               dirty_v, start)
    empty = (jnp.full((b, 2, n // 2, t), -jnp.inf), jnp.zeros((b, 2, n // 2, t, d)))
    alone = attention._join(empty, xla_self(q, heads_k, heads_v), dtype)
  assert calls == [fa.MaskType.PADDING, fa.MaskType.CAUSAL]
  # float32: sums of up to ~300 terms; bf16: each part rounded to bf16 before the join, a few ulps.
  tol = 1e-5 if dtype == jnp.float32 else 4 * 2.0**-8 * np.abs(ref).max()
  for name, out in outs.items():
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), name
    np.testing.assert_allclose(out, ref, atol=tol, rtol=1e-5, err_msg=name)
  # A row with nothing before its chunk (start 0) is exactly its causal part.
  np.testing.assert_array_equal(np.asarray(outs["xla parts"][0]), np.asarray(alone[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 512, 1024])
def test_chunk_through_cudnn_equals_the_cache_form_on_the_gpu(t):
  """cuDNN's two parts of a prefill chunk (`attend_chunk`) against our kernel over the cache
  (`attend_limited` with limits = start + t + 1), rows starting at 0, 512, 3072 and 1000, the
  chunk's keys written in the cache and NaN past them (never read), within bf16 rounding.

  The claim about cuDNN this checks (kernels/attention.py, the note above `cudnn_part`): with
  ``return_residual=True`` JAX's head-major entry point returns stats [B, N, T] float32, the
  natural-log log-sum-exp of the scaled scores over the keys its mask admits; ``MaskType.PADDING``
  with int32 [B] ``q_seqlen`` / ``kv_seqlen`` admits slots < kv_seqlen of each row and reads
  nothing at or past it into the result (large finite values there are checked part by part
  below; NaN past the chunk here, beyond every tile the prior part reads)."""
  from dspark_jax.kernels import ragged_attention
  rng = np.random.default_rng(t)
  b, n, k, d = 4, 8, 2, 128
  start = jnp.asarray([0, 512, 3072, 1000], jnp.int32)
  s = -(-(3072 + t + 64) // 128) * 128
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
  own_k, own_v = (jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.bfloat16) for _ in range(2))
  past = jnp.arange(s)[None, None, :, None] >= (start + t)[:, None, None, None]
  keys, values = (jnp.where(past, jnp.nan, layers.write_heads(
      jnp.asarray(rng.normal(size=(b, k, s, d)), jnp.bfloat16), own, start)).astype(jnp.bfloat16)
      for own in (own_k, own_v))
  assert attention.choose_causal(q) == "cudnn"
  assert ragged_attention.precondition(q, keys) is None
  out = np.asarray(jax.jit(attention.attend_chunk)(
      q, layers.heads_first(own_k), layers.heads_first(own_v), keys, values, start), np.float32)
  limits = start[:, None] + jnp.arange(1, t + 1, dtype=jnp.int32)[None]
  ref = np.asarray(jax.jit(attention.attend_limited)(q, keys, values, limits), np.float32)
  assert np.isfinite(out).all()
  # bf16 outputs of averages of unit normals: within a few bf16 ulps (2^-8 relative); each part
  # is rounded to bf16 before the join, so one or two more than a single pass.
  np.testing.assert_allclose(out, ref, atol=6 * 2.0**-8 * np.abs(ref).max())


@pytest.mark.gpu
def test_cudnn_parts_statistics_are_the_log_sum_exp_of_the_scaled_scores_on_the_gpu():
  """Each cuDNN part's (lse, out) against `_part` (float32 scores of the same bf16 inputs) under
  its mask: the prior part over slots < start with large finite garbage at and past start (keys
  ×64, values ×1024: any leak would dominate the result, so ``kv_seqlen`` bounds what reaches
  it), a row with start 0 giving (-inf, zeros); the self part causal, top-left. (Not NaN: cuDNN
  multiplies the masked probabilities of a tile by its values, and 0 · NaN is NaN; see
  `cudnn_prior_part`'s precondition.)
  This is the claim of the note above `kernels.attention.cudnn_part`: [B, N, T] float32
  statistics, natural log, of the scaled scores."""
  rng = np.random.default_rng(11)
  b, t, n, k, d, s = 4, 128, 8, 2, 128, 1024
  start = jnp.asarray([0, 1, 300, 896], jnp.int32)
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
  keys, values = (jnp.asarray(rng.normal(size=(b, k, s, d)), jnp.bfloat16) for _ in range(2))
  own_k, own_v = keys[:, :, :t], values[:, :, :t]
  before = jnp.arange(s)[None, :] < start[:, None]
  dirty_k, dirty_v = (jnp.where(before[:, None, :, None], x, scale * x).astype(jnp.bfloat16)
                      for x, scale in ((keys, 64.0), (values, 1024.0)))
  with jax.default_matmul_precision("highest"):
    refs = {"prior": attention._part(q, keys, values, jnp.broadcast_to(before[:, None], (b, t, s))),
            "self": attention._part(q, own_k, own_v, jnp.broadcast_to(
                jnp.arange(t)[None, :] <= jnp.arange(t)[:, None], (b, t, t)))}
  parts = {"prior": jax.jit(attention.cudnn_prior_part)(q, dirty_k, dirty_v, start),
           "self": jax.jit(attention.cudnn_self_part)(q, own_k, own_v)}
  for name in parts:
    (lse, out), (ref_lse, ref_out) = (jax.tree.map(lambda x: np.asarray(x, np.float32), p)
                                      for p in (parts[name], refs[name]))
    assert lse.shape == ref_lse.shape and out.shape == ref_out.shape, name
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), name
    # Scores from the same bf16 inputs in float32: the log-sum-exps agree to float32 rounding of
    # the accumulation order (a log2 or unscaled statistic would be off by far more).
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(out, ref_out, atol=4 * 2.0**-8 * np.abs(ref_out).max(), err_msg=name)
  assert np.all(np.asarray(parts["prior"][1])[0] == 0)
