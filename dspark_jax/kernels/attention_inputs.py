"""A layer's attention inputs in one kernel: per-head RMSNorm and rotary embedding of the queries
and keys, and the keys and values written into the KV cache.

After the fused QKV product (`models.layers.Attention.qkv_proj`), a decode step or a verify needs
the queries normalised per head (``q_norm``) and rotated (RoPE, rotate-half form), the keys the
same (``k_norm``), and the keys and values stored at each token's (row, position) of the cache.
Written in XLA that is about seven small kernels a layer (two norm reductions, two rotations, a
select, two cache writes), each a few kilobytes of work at a launch's cost. `attention_inputs` does
all of it in one Pallas kernel (Triton lowering on GPUs, Pallas' interpreter on the CPU), one
instance per (token, key/value head):

* it reads the token's G = N / K query heads of that kv head, its key and its value from the
  product's output [M, (N + 2K)·D] (M tokens, any layout flattened: [B, T] rows of a step or a
  verify, or packed tokens);
* normalises the G queries and the key in float32 (``x · rsqrt(mean(x²) + eps) · scale``, rounded
  to the dtype, as `flax.nnx.RMSNorm`), then rotates them in float32 at the token's position
  (``inv_freq`` of `models.layers.rope_frequencies`, cos/sin times its attention factor) and
  rounds again, as `models.layers.rope`;
* stores the queries [M, N, D] and writes the key and value into the cache buffers in place (the
  kernel's outputs alias them): a contiguous cache [B, K, S, D] at (row, head, position), or a
  page pool [num_pages, K, page_size, D] through a block table [B, P] as
  `paging.cache.physical` addresses it. A token whose row, position or page is out of range writes
  nothing.

Wherever `precondition` fails, the model computes the same in XLA (`models.layers.Attention.project`
and its cache writes, `models.layers.WriteKV`). Values equal XLA's within bf16 rounding: the mean
of squares is summed in another order, and cos/sin are the GPU's own.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.kernels import dispatch

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
NUM_WARPS = 1


def precondition(qkv, cache_k, *, heads: int, kv_heads: int, head_dim: int,
                 table=None) -> str | None:
  """The first failed precondition of `attention_inputs`, in words, or None.

  qkv [M, (N + 2K)·D]; cache_k [B, K, S, D], or with `table` [B, P] (integer) a page pool
  [num_pages, K, page_size, D]. Requires: those ranks and sizes; N a multiple of K with G = N / K
  a power of two; D a power of two in 8..256; qkv and the cache of one dtype among bfloat16,
  float16, float32; a cache of fewer than 2^31 elements (int32 offsets).
  """
  if qkv.ndim != 2 or cache_k.ndim != 4:
    return f"qkv must be [M, C] and the cache rank 4, got shapes {qkv.shape} and {cache_k.shape}"
  if kv_heads < 1 or heads % kv_heads:
    return f"query heads N={heads} are not a multiple of kv heads K={kv_heads}"
  groups = heads // kv_heads
  if groups & (groups - 1):
    return f"G={groups} query heads per kv head is not a power of two"
  d = head_dim
  if d < 8 or d > 256 or d & (d - 1):
    return f"head size D={d} is not a power of two in 8..256"
  if qkv.shape[1] != (heads + 2 * kv_heads) * d:
    return (f"qkv has {qkv.shape[1]} columns, not (N + 2K)·D = {(heads + 2 * kv_heads) * d} "
            f"(N={heads}, K={kv_heads}, D={d})")
  if cache_k.shape[1] != kv_heads or cache_k.shape[3] != d:
    return f"the cache {cache_k.shape} is not [., K={kv_heads}, ., D={d}]"
  if table is not None and (len(table.shape) != 2
                            or not jnp.issubdtype(table.dtype, jnp.integer)):
    return f"block_table {tuple(table.shape)} ({table.dtype}) is not an integer [B, pages] array"
  dtypes = {jnp.dtype(qkv.dtype), jnp.dtype(cache_k.dtype)}
  if len(dtypes) > 1:
    return f"qkv ({jnp.dtype(qkv.dtype).name}) and the cache ({jnp.dtype(cache_k.dtype).name}) differ"
  if jnp.dtype(qkv.dtype) not in [jnp.dtype(x) for x in DTYPES]:
    return f"dtype {jnp.dtype(qkv.dtype).name} is not bfloat16, float16 or float32"
  if math.prod(cache_k.shape) >= 2 ** 31:
    return f"the cache {cache_k.shape} has 2^31 elements or more (int32 offsets)"
  return None


def _address(row, position, table_ref, batch: int, slots: int, page_size: int, num_pages: int):
  """(first index, slot, ok) of a token's cache entry: (row, position) in a contiguous cache, or
  the position's page and offset through the table; ok False where the row, the position or the
  page is out of range (the indices are then clipped into range, never used)."""
  inside = (row >= 0) & (row < batch) & (position >= 0) & (position < slots)
  row = jnp.clip(row, 0, batch - 1)
  position = jnp.clip(position, 0, slots - 1)
  if table_ref is None:
    return row, position, inside
  page = table_ref[row, position // page_size]
  ok = inside & (page >= 0) & (page < num_pages)
  return jnp.clip(page, 0, num_pages - 1), position % page_size, ok


def _kernel(*refs, groups: int, heads: int, kv_heads: int, eps: float, factor: float,
            paged: bool):
  """One (token m, kv head h) instance: the token's G query heads of kv head h, its key and its
  value. Inputs (whole, indexed here): positions_ref, rows_ref [M] int32, with `paged` table_ref
  [B, P] int32, then qkv_ref [M, (N + 2K)·D], q_scale_ref, k_scale_ref [D] (any float), freq_ref
  [D/2] float32, and the caches (aliased to the outputs, never read). Outputs: q_ref [M, N, D],
  k_out_ref, v_out_ref (the caches, written at the token's entry only)."""
  positions_ref, rows_ref, *refs = refs
  table_ref = refs.pop(0) if paged else None
  qkv_ref, q_scale_ref, k_scale_ref, freq_ref, _, _, q_ref, k_out_ref, v_out_ref = refs
  m, h = pl.program_id(0), pl.program_id(1)
  d = q_ref.shape[2]
  half = d // 2
  position = positions_ref[m]
  cols = jax.lax.broadcasted_iota(jnp.int32, (d,), 0)
  partner = (cols + half) % d                    # rotate-half: column d pairs with d ± D/2
  sign = jnp.where(cols < half, jnp.float32(-1.0), jnp.float32(1.0))
  angles = position.astype(jnp.float32) * freq_ref[cols % half]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if factor != 1.0:
    cos, sin = cos * factor, sin * factor

  def rows(first_column, count):
    """The `count` heads of D columns from `first_column` of token m's row, natural and paired
    column order, float32 [count, D]."""
    r = jax.lax.broadcasted_iota(jnp.int32, (count, d), 0)
    token = jnp.full((count, d), m, jnp.int32)
    natural = qkv_ref[token, first_column + r * d + cols[None, :]]
    paired = qkv_ref[token, first_column + r * d + partner[None, :]]
    return natural.astype(jnp.float32), paired.astype(jnp.float32)

  def norm_rope(natural, paired, scale_ref, dtype):
    mul = jax.lax.rsqrt(jnp.mean(natural * natural, axis=1) + eps)[:, None]
    scale = scale_ref[cols].astype(jnp.float32)[None, :]
    scale_pair = scale_ref[partner].astype(jnp.float32)[None, :]
    normed = (natural * (mul * scale)).astype(dtype).astype(jnp.float32)
    normed_pair = (paired * (mul * scale_pair)).astype(dtype).astype(jnp.float32)
    return (normed * cos[None, :] + sign[None, :] * normed_pair * sin[None, :]).astype(dtype)

  q = norm_rope(*rows(h * groups * d, groups), q_scale_ref, q_ref.dtype)       # [G, D]
  g = jax.lax.broadcasted_iota(jnp.int32, (groups, d), 0)
  plgpu.store(q_ref.at[(jnp.full((groups, d), m, jnp.int32), h * groups + g,
                        jnp.broadcast_to(cols[None, :], (groups, d)))], q)
  key = norm_rope(*rows((heads + h) * d, 1), k_scale_ref, k_out_ref.dtype)      # [1, D]
  value = qkv_ref[(jnp.full((1, d), m, jnp.int32), (heads + kv_heads + h) * d + cols[None, :])]
  first, slot, ok = _address(rows_ref[m], position, table_ref,
                             table_ref.shape[0] if paged else k_out_ref.shape[0],
                             table_ref.shape[1] * k_out_ref.shape[2] if paged
                             else k_out_ref.shape[2],
                             k_out_ref.shape[2], k_out_ref.shape[0])

  @pl.when(ok)
  def _write():
    k_out_ref[first, h, slot, :] = key.reshape(d)
    v_out_ref[first, h, slot, :] = value.reshape(d).astype(v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "eps", "factor", "interpret"))
def attention_inputs(qkv, positions, rows, q_scale, k_scale, inv_freq, cache_k, cache_v, *,
                     heads: int, kv_heads: int, eps: float, factor: float = 1.0, table=None,
                     interpret: bool = False):
  """Queries ready for attention, and the keys and values written into the cache.

  Args:
    qkv: [M, (N + 2K)·D], the fused product's output for M tokens (queries, keys, values).
    positions, rows: [M] int, token m's absolute position and its row of the cache (row B or more:
      a padding token, nothing written).
    q_scale, k_scale: [D], the ``q_norm`` and ``k_norm`` scales. inv_freq: [D/2] float32
      (`models.layers.rope_frequencies`); factor: its attention factor (cos/sin are scaled by it).
    cache_k, cache_v: [B, K, S, D] in qkv's dtype, or with `table` ([B, P] int) page pools
      [num_pages, K, page_size, D]. heads, kv_heads: N and K. eps: the norms' epsilon.
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    ``(q, cache_k, cache_v)``: q [M, N, D] normalised and rotated; the caches with token m's key
    (normalised, rotated) and value at (rows[m], positions[m]) where in range, unchanged
    elsewhere. Under `jax.jit` the caches are updated in place where XLA can donate them.

  Raises:
    ValueError: naming the failed precondition (`precondition`).
  """
  d = cache_k.shape[3]
  failed = precondition(qkv, cache_k, heads=heads, kv_heads=kv_heads, head_dim=d, table=table)
  if failed:
    raise ValueError(f"attention_inputs: precondition failed: {failed}")
  if cache_v.shape != cache_k.shape or cache_v.dtype != cache_k.dtype:
    raise ValueError(f"attention_inputs: cache_v {cache_v.shape} {cache_v.dtype} differs from "
                     f"cache_k {cache_k.shape} {cache_k.dtype}")
  m = qkv.shape[0]
  if positions.shape != (m,) or rows.shape != (m,):
    raise ValueError(f"attention_inputs: positions {positions.shape} and rows {rows.shape} must "
                     f"be [M] = ({m},)")
  paged = table is not None
  kernel = functools.partial(_kernel, groups=heads // kv_heads, heads=heads, kv_heads=kv_heads,
                             eps=float(eps), factor=float(factor), paged=paged)
  inputs = [positions.astype(jnp.int32), rows.astype(jnp.int32)]
  if paged:
    inputs.append(table.astype(jnp.int32))
  first_cache = len(inputs) + 4
  inputs += [qkv, q_scale, k_scale, inv_freq.astype(jnp.float32), cache_k, cache_v]
  return pl.pallas_call(
      kernel,
      grid=(m, kv_heads),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((m, heads, d), qkv.dtype),
                 jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                 jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)],
      input_output_aliases={first_cache: 1, first_cache + 1: 2},
      name="attention_inputs",
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
  )(*inputs)


ENV_VAR = "DSPARK_JAX_ATTENTION_INPUTS"


def choose(qkv, cache_k, *, heads: int, kv_heads: int, head_dim: int, table=None,
           implementation: str | None = None, platform: str | None = None) -> str:
  """``"pallas"`` (the kernel, compiled), ``"interpret"`` (the kernel in Pallas' interpreter) or
  ``"xla"`` for these arrays (shapes and dtypes only: `jax.ShapeDtypeStruct` will do).

  ``auto`` (the default; ``$DSPARK_JAX_ATTENTION_INPUTS`` or `implementation` overrides it) takes
  the compiled kernel on a GPU wherever `precondition` holds, else ``xla``. An explicit ``pallas``
  runs the kernel where its precondition holds, in the interpreter off the GPU (slowly: for
  tests), and raises where it fails.

  Raises:
    ValueError: an unknown implementation, or ``pallas`` where the precondition fails.
  """
  return dispatch.choose_layer_kernel(
      "attention inputs", ENV_VAR, implementation,
      lambda: precondition(qkv, cache_k, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           table=table), platform=platform)
