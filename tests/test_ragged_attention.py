"""The ragged attention kernel (`kernels.ragged_attention`) against the XLA attention it replaces.

On the CPU the kernel runs in Pallas' interpreter; on a GPU host (``DSPARK_TEST_GPU=1``) the same
tests run the compiled Triton kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels import attention
from dspark_jax.kernels import ragged_attention as ra

INTERPRET = jax.default_backend() != "gpu"
BF16_ULP = 2.0 ** -8
_attend_xla = jax.jit(attention.attend_xla)


def attend_xla(q, k, v, mask):
  """The XLA form with float32 products in full precision (a GPU would use TF32 by default)."""
  with jax.default_matmul_precision("highest"):
    return _attend_xla(q, k, v, mask)


def _mask(limits, slots):
  return jnp.arange(slots)[None, None, :] < jnp.asarray(limits)[:, :, None]


def _inputs(seed, b, t, n, heads, d, slots, dtype):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
             for shape in ((b, t, n, d), (b, heads, slots, d), (b, heads, slots, d)))
  return rng, q, k, v


def _mixed_limits(rng, b, t, slots):
  """Rows of: nothing, one slot, the whole cache, a causal verify block (start + t + 1), and
  random per-query limits."""
  rows = [np.zeros(t), np.ones(t), np.full(t, slots)]
  start = rng.integers(0, slots - t + 1)
  rows.append(start + np.arange(t) + 1)
  while len(rows) < b:
    rows.append(rng.integers(0, slots + 1, t))
  return jnp.asarray(np.stack(rows[:b]), jnp.int32)


def _with_garbage(x, limits, value):
  """`x` [B, K, S, D] with every slot at or past its row's longest limit set to `value`."""
  length = jnp.max(limits, axis=1)
  past = jnp.arange(x.shape[2])[None, None, :, None] >= length[:, None, None, None]
  return jnp.where(past, jnp.asarray(value, x.dtype), x)


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)


def _tolerance(dtype):
  return 1e-5 if dtype == jnp.float32 else 4 * BF16_ULP


def _check_against_xla(q, k, v, limits, **kwargs):
  out, lse = ra.ragged_attention(q, k, v, limits, interpret=INTERPRET, **kwargs)
  ref = attend_xla(q, k, v, _mask(limits, k.shape[2]))
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert _rel_err(out, ref) <= _tolerance(q.dtype), _rel_err(out, ref)
  empty = np.asarray(jnp.max(limits, axis=1)) == 0
  assert np.all(np.asarray(out, np.float32)[empty] == 0)
  assert np.all(np.asarray(lse)[np.asarray(limits) == 0] == -np.inf)
  return out, lse


@pytest.mark.kernel
@pytest.mark.parametrize("groups,t,d,dtype,block_kv,splits", [
    (1, 1, 64, jnp.float32, 16, 1),
    (8, 1, 16, jnp.bfloat16, 16, 3),
    (2, 7, 64, jnp.float32, 16, 3),
    (4, 7, 128, jnp.bfloat16, 16, 1),
    (4, 8, 32, jnp.float32, 16, 2),
    (8, 8, 64, jnp.bfloat16, 32, 2),
])  # every G in 1..8 and T in {1, 7, 8}, both dtypes, 1-3 splits, D 16..128
def test_matches_xla_for_every_group_size_and_query_count(groups, t, d, dtype, block_kv, splits):
  heads, slots = 2, 64
  rng, q, k, v = _inputs(groups * 100 + t, 5, t, heads * groups, heads, d, slots, dtype)
  limits = _mixed_limits(rng, 5, t, slots)
  _check_against_xla(q, k, v, limits, block_kv=block_kv, splits=splits)


@pytest.mark.kernel
@pytest.mark.parametrize("largest", [0, 10 ** 6])
def test_both_ways_of_joining_the_splits_match_xla(monkeypatch, largest):
  # largest = 0: every split set joined by XLA (`_combine`); else by the kernel (`_combine_rows`),
  # here with 3 splits (padded to 4 in the kernel), T = 7 and G = 4 (tile rows past T·G).
  monkeypatch.setattr(ra, "COMBINE_KERNEL_MAX_ROWS", largest)
  jax.clear_caches()
  for dtype in (jnp.float32, jnp.bfloat16):
    rng, q, k, v = _inputs(13, 5, 7, 8, 2, 32, 64, dtype)
    _check_against_xla(q, k, v, _mixed_limits(rng, 5, 7, 64), block_kv=16, splits=3)
  jax.clear_caches()


@pytest.mark.kernel
@pytest.mark.parametrize("paged,splits,largest", [(False, 1, 32), (False, 2, 0), (False, 2, 32),
                                                  (True, 1, 32), (True, 3, 32)])
def test_packed_queries_equal_the_same_queries_laid_out_per_row(monkeypatch, paged, splits,
                                                                 largest):
  """Queries packed token after token (each row's first few slots, a padding token at the end),
  read and written in place through `tokens`: the dense call's rows for every named token."""
  monkeypatch.setattr(ra, "COMBINE_KERNEL_MAX_ROWS", largest)
  jax.clear_caches()
  b, t, n, heads, d, slots = 4, 4, 8, 2, 32, 64
  rng, q, k, v = _inputs(17, b, t, n, heads, d, slots, jnp.bfloat16)
  counts = np.array([2, 0, 4, 1])
  rows = np.concatenate([np.repeat(np.arange(b), counts), [b]])          # the last: padding
  cols = np.concatenate([np.concatenate([np.arange(c) for c in counts]), [0]])
  start = rng.integers(0, slots - t, b)
  limits = np.where(np.arange(t)[None] < counts[:, None], start[:, None] + np.arange(t) + 1, 0)
  limits = jnp.asarray(limits, jnp.int32)
  tokens = np.full((b, t), len(rows), np.int32)
  tokens[rows[:-1], cols[:-1]] = np.arange(len(rows) - 1)
  packed_q = q[rows.clip(0, b - 1), cols]                                  # [N', N, D]
  kw = dict(block_kv=16, splits=splits, interpret=INTERPRET)
  if paged:   # row r's logical page j is pool page perm[r * 4 + j]; pages of 16 slots
    perm = rng.permutation(b * slots // 16)
    pool = lambda x: x.reshape(b, heads, slots // 16, 16, d).transpose(0, 2, 1, 3, 4).reshape(
        -1, heads, 16, d)[np.argsort(perm)]
    k, v = pool(k), pool(v)
    kw["block_table"] = jnp.asarray(perm.reshape(b, -1), jnp.int32)
  want_out, want_lse = ra.ragged_attention(q, k, v, limits, **kw)
  out, lse = ra.ragged_attention(packed_q, k, v, limits, tokens=jnp.asarray(tokens), **kw)
  assert out.shape == (len(rows), n, d) and lse.shape == (len(rows), n)
  named = slice(0, len(rows) - 1)
  np.testing.assert_array_equal(np.asarray(out[named]), np.asarray(want_out[rows[named],
                                                                           cols[named]]))
  np.testing.assert_array_equal(np.asarray(lse[named]), np.asarray(want_lse[rows[named],
                                                                           cols[named]]))
  jax.clear_caches()


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_blocks_and_splits_match_xla(dtype):
  rng, q, k, v = _inputs(7, 4, 8, 8, 2, 32, 128, dtype)
  limits = _mixed_limits(rng, 4, 8, 128)
  _check_against_xla(q, k, v, limits)


@pytest.mark.kernel
@pytest.mark.parametrize("value", [np.nan, 1e30])
def test_slots_past_each_rows_length_are_never_read(value):
  rng, q, k, v = _inputs(3, 5, 7, 8, 2, 32, 64, jnp.float32)
  limits = _mixed_limits(rng, 5, 7, 64)
  run = lambda k, v: ra.ragged_attention(q, k, v, limits, block_kv=16, splits=2,
                                         interpret=INTERPRET)
  clean = run(k, v)
  dirty = run(_with_garbage(k, limits, value), _with_garbage(v, limits, value))
  for a, b in zip(clean, dirty):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.kernel
def test_output_and_lse_match_a_float64_reference():
  """lse is the log-sum-exp of the masked scaled scores; rows of 0, 3, 4, 9, 17 and S slots."""
  b, t, n, heads, d, slots = 3, 2, 4, 2, 16, 32
  rng, q, k, v = _inputs(11, b, t, n, heads, d, slots, jnp.float32)
  limits = jnp.asarray([[3, 4], [0, 32], [17, 9]], jnp.int32)
  out, lse = ra.ragged_attention(q, k, v, limits, block_kv=16, splits=2, interpret=INTERPRET)
  qn, kn, vn, ln = (np.asarray(x, np.float64) for x in (q, k, v, limits))
  ref_out = np.zeros((b, t, n, d))
  ref_lse = np.full((b, t, n), -np.inf)
  for bi in range(b):
    for ti in range(t):
      seen = int(ln[bi, ti])
      for h in range(n):
        kv = h // (n // heads)
        if seen == 0:
          continue
        scores = kn[bi, kv, :seen] @ qn[bi, ti, h] / np.sqrt(d)
        top = scores.max()
        w = np.exp(scores - top)
        ref_lse[bi, ti, h] = top + np.log(w.sum())
        ref_out[bi, ti, h] = (w / w.sum()) @ vn[bi, kv, :seen]
  np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(slots=72), "not a multiple of block_kv"),
    (dict(d=24), "not a power of two in 16..256"),
    (dict(d=512), "not a power of two in 16..256"),
    (dict(n=5), "not a multiple of kv heads"),
    (dict(k_dtype=jnp.float16), "dtypes differ"),
    (dict(dtype=jnp.int32), "is not bfloat16, float16 or float32"),
    (dict(n=258, heads=2), "exceed the query tile's 128 rows"),
    (dict(block_kv=24), "block_kv=24 is not a power of two"),
])
def test_failed_preconditions_are_named(change, message):
  shape = dict(b=2, t=2, n=4, heads=2, d=16, slots=64, dtype=jnp.float32, k_dtype=None,
               block_kv=16)
  shape.update(change)
  q = jnp.zeros((shape["b"], shape["t"], shape["n"], shape["d"]), shape["dtype"])
  k = jnp.zeros((shape["b"], shape["heads"], shape["slots"], shape["d"]),
                shape["k_dtype"] or shape["dtype"])
  limits = jnp.ones((shape["b"], shape["t"]), jnp.int32)
  assert message in ra.precondition(q, k, k, block_kv=shape["block_kv"])
  with pytest.raises(ValueError, match="precondition failed: .*" + message):
    ra.ragged_attention(q, k, k, limits, block_kv=shape["block_kv"], interpret=True)


@pytest.mark.kernel
@pytest.mark.parametrize("groups,t,dtype", [(4, 40, jnp.float32), (3, 50, jnp.bfloat16)])
def test_query_tiles_equal_the_xla_form_on_a_causal_prefill_and_any_limits(groups, t, dtype):
  """More queries than one tile holds (T·G > 128): tiles of 128 // G queries, the last one short;
  rows of a causal chunk at two starts, nothing, the whole cache and random limits; garbage past
  each row's longest limit."""
  assert ra.query_tiling(t, groups)[1] == 2
  slots = 96
  rng, q, k, v = _inputs(12, 5, t, 2 * groups, 2, 16, slots, dtype)
  limits = np.stack([np.arange(t) + 1, 40 + np.arange(t) + 1, np.zeros(t), np.full(t, slots),
                     rng.integers(0, slots + 1, t)])
  limits = jnp.asarray(limits, jnp.int32)
  out, lse = _check_against_xla(q, k, v, limits, block_kv=16)
  dirty = ra.ragged_attention(q, _with_garbage(k, limits, np.nan), _with_garbage(v, limits, np.inf),
                              limits, block_kv=16, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(dirty[0], np.float32), np.asarray(out, np.float32))
  np.testing.assert_array_equal(np.asarray(dirty[1]), np.asarray(lse))
  with pytest.raises(ValueError, match="tiles take one split"):
    ra.ragged_attention(q, k, v, limits, block_kv=16, splits=2, interpret=True)


def test_preconditions_hold_for_the_model_shapes():
  for t in (1, 7, 8):
    q = jax.ShapeDtypeStruct((64, t, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((64, 8, 8256, 128), jnp.bfloat16)
    assert ra.precondition(q, k, k, block_kv=64) is None
  assert ra.query_rows(1, 4) == 16 and ra.query_rows(7, 4) == 32 and ra.query_rows(8, 8) == 64
  assert ra.query_tiling(8, 4) == (8, 1) and ra.query_tiling(4096, 4) == (32, 128)
  assert ra.query_tiling(100, 5) == (25, 4)
  prefill = jax.ShapeDtypeStruct((64, 4096, 32, 128), jnp.bfloat16)
  assert ra.precondition(prefill, k, k, block_kv=64) is None
  assert ra.default_splits(1, 8, 8320, 64) == 17 and ra.default_splits(64, 8, 8320, 64) == 1
  assert ra.default_splits(1, 1, 64, 16) == 4   # at most one split per KV block


@pytest.mark.kernel
def test_runs_under_jit_without_recompiling_for_new_limits():
  rng, q, k, v = _inputs(9, 3, 2, 4, 2, 16, 64, jnp.float32)
  traces = []

  @jax.jit
  def call(q, k, v, limits):
    traces.append(1)
    return ra.ragged_attention(q, k, v, limits, block_kv=16, splits=2, interpret=INTERPRET)

  for seed in range(3):
    limits = jnp.asarray(np.random.default_rng(seed).integers(0, 65, (3, 2)), jnp.int32)
    out, _ = call(q, k, v, limits)
    ref = attend_xla(q, k, v, _mask(limits, 64))
    assert _rel_err(out, ref) <= 1e-5
  assert len(traces) == 1 and call._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("block_kv", [64, 128])
def test_compiled_kernel_matches_xla_at_a_model_shape(block_kv):
  b, t, n, heads, d, slots = 4, 8, 32, 8, 128, 1024
  rng, q, k, v = _inputs(13, b, t, n, heads, d, slots, jnp.bfloat16)
  start = jnp.asarray([0, 100, 500, slots - t])[:, None]
  limits = (start + jnp.arange(t)[None] + 1).astype(jnp.int32)
  k, v = _with_garbage(k, limits, np.nan), _with_garbage(v, limits, np.nan)
  out, lse = ra.ragged_attention(q, k, v, limits, block_kv=block_kv)
  mask = _mask(limits, slots)
  ref = attend_xla(q, jnp.nan_to_num(k), jnp.nan_to_num(v), mask)
  assert _rel_err(out, ref) <= 4 * BF16_ULP
  assert np.all(np.isfinite(np.asarray(lse)))
