"""Training's context attention on a GPU: the ragged kernel's forward and a backward of its own.

This module owns `limited_part_kernel`, the differentiable counterpart of
`attention.limited_part` that `attention.shared_limited_part` takes where `attention.choose_shared`
says so: [B, T, N, D] queries over head-major [B, K, S, D] keys/values, query (b, t) seeing slots
``s < limits[b, t]``, returned in the kernel's layout (out [B, T, N, D], lse [B, T, N], float32),
which `attention.kernel_part` turns into a softmax part for `attention.join_block` to join with
the blocks' own part.

* **Forward:** `ragged_attention.ragged_attention` in query tiles: scores live in on-chip tiles,
  never in memory, and a tile reads the key/value blocks up to its own queries' longest limit.
  Kept for the backward pass: q, k, v, the limits, the output (in q's dtype) and the lse; no
  scores.
* **Backward** (`backward_kernels`): two Pallas kernels over the ragged kernel's query tiles
  (one kv head's G query heads at once, so GQA needs no reduction). One per
  (row, kv head, query tile) walks the KV blocks up to the tile's longest limit for dQ; one per
  (row, kv head, KV block) walks the query tiles that see any of the block, skipping the others,
  for dK and dV. Each recomputes a tile's probabilities from the kept lse
  (``p = exp(s - lse)``, no second softmax) and forms ``dS = p ⊙ (dP - Δ)`` with
  ``Δ = rowsum(dO ⊙ O) - dlse`` (dlse the lse's cotangent), then ``dQ = dS·K``, ``dK = dSᵀ·Q``,
  ``dV = pᵀ·dO``, with dS and p rounded to the value dtype as the forward rounds p. With anchors
  in ascending order (`trainer.masked_draft_batches`) a query tile's limits are close together,
  so the blocks past them are skipped in all three kernels.

The result equals `attention.limited_part` and its gradients within bf16 rounding (the output
is rounded to q's dtype once, as the kernel writes it). A query with limit 0 gets lse = -inf,
zeros and zero gradients.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.kernels import ragged_attention


def _forward(q, k, v, limits, interpret):
  out, lse = ragged_attention.ragged_attention(q, k, v, limits, interpret=interpret)
  return (out.astype(jnp.float32), lse), (out, lse)


def _tile_rows(b, h, tile, rows: int, groups: int, per_tile: int, t_count: int, d: int):
  """Query tile `tile` of kv head `h`, as the ragged kernel lays it out: row p is query
  ``t = tile·per_tile + p // G`` of head ``h·G + p % G``; rows past per_tile·G and queries past T
  repeat a real row and are not `valid`. Returns (t, head, valid, gather index of a [P, D] load)."""
  p = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  source = p % (per_tile * groups)
  wanted = tile * per_tile + source // groups
  valid = (p < per_tile * groups) & (wanted < t_count)
  t = jnp.minimum(wanted, t_count - 1)
  head = h * groups + source % groups
  wide = lambda x: jnp.broadcast_to(x[:, None], (rows, d))
  return t, head, valid, (b, wide(t), wide(head), jax.lax.broadcasted_iota(jnp.int32, (rows, d), 1))


def _tile_grads(q, do, keys, values, lse, delta, limits, slots, scale, precision):
  """One [P, D] query tile against one [block, D] key/value block: (p, ds), float32 [P, block]."""
  dot = lambda a, b, dims: jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                                               preferred_element_type=jnp.float32)
  scores = dot(q, keys, ((1,), (1,))) * scale
  visible = slots[None, :] < limits[:, None]
  p = jnp.where(visible, jnp.exp(scores - jnp.where(visible, lse[:, None], 0.0)), 0.0)
  dp = dot(do, values, ((1,), (1,)))
  return p, p * (dp - delta[:, None])


def _dq_kernel(limits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, rows: int,
               groups: int, per_tile: int, block_kv: int, scale: float):
  """One (row b, kv head h, query tile) instance: the tile's dQ over the KV blocks up to its
  queries' longest limit."""
  b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_count, d = q_ref.shape[1], q_ref.shape[3]
  t, head, _, gather = _tile_rows(b, h, tile, rows, groups, per_tile, t_count, d)
  limits = jnp.clip(limits_ref[b, t], 0, k_ref.shape[2])
  q, do = q_ref[gather], do_ref[gather]
  lse, delta = lse_ref[b, t, head], delta_ref[b, t, head]
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  lanes = jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)

  def body(j, dq):
    window = (b, h, pl.ds(j * block_kv, block_kv), slice(None))
    keys, values = k_ref[window], v_ref[window]
    _, ds = _tile_grads(q, do, keys, values, lse, delta, limits, j * block_kv + lanes, scale,
                        precision)
    return dq + jax.lax.dot_general(ds.astype(keys.dtype), keys, (((1,), (0,)), ((), ())),
                                    precision=precision, preferred_element_type=jnp.float32)

  blocks = (jnp.max(limits) + block_kv - 1) // block_kv
  dq = jax.lax.fori_loop(0, blocks, body, jnp.zeros((rows, d), jnp.float32))
  plgpu.store(dq_ref.at[gather], (dq * scale).astype(dq_ref.dtype))  # padding rows: same values


def _dkdv_kernel(limits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 rows: int, groups: int, per_tile: int, tiles: int, block_kv: int,
                 scale: float):
  """One (row b, kv head h, KV block j) instance: the block's dK and dV summed over the query
  tiles that see any of its slots (every query head of the group at once)."""
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_count, d = q_ref.shape[1], q_ref.shape[3]
  window = (b, h, pl.ds(j * block_kv, block_kv), slice(None))
  keys, values = k_ref[window], v_ref[window]
  slots = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
  precision = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else None
  dot = lambda a, b_, dims: jax.lax.dot_general(a, b_, (dims, ((), ())), precision=precision,
                                                preferred_element_type=jnp.float32)

  def body(i, carry):
    t, head, valid, gather = _tile_rows(b, h, i, rows, groups, per_tile, t_count, d)
    limits = jnp.where(valid, jnp.clip(limits_ref[b, t], 0, k_ref.shape[2]), 0)

    def add(carry):
      dk, dv = carry
      q, do = q_ref[gather], do_ref[gather]
      p, ds = _tile_grads(q, do, keys, values, lse_ref[b, t, head], delta_ref[b, t, head],
                          limits, slots, scale, precision)
      return (dk + dot(ds.astype(q.dtype), q, ((0,), (0,))),
              dv + dot(p.astype(do.dtype), do, ((0,), (0,))))
    return jax.lax.cond(jnp.max(limits) > j * block_kv, add, lambda c: c, carry)

  zeros = jnp.zeros((block_kv, d), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, tiles, body, (zeros, zeros))
  dk_ref[window] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[window] = dv.astype(dv_ref.dtype)


def backward_kernels(q, k, v, limits, do, lse, delta, *, block_kv: int | None = None,
                     interpret: bool = False):
  """dQ, dK, dV of the limited attention (module docstring) by two Pallas kernels: one per (row,
  kv head, query tile) for dQ, one per (row, kv head, KV block) for dK and dV; neither holds more
  than one [P, block_kv] tile of scores.

  Args:
    q: [B, T, N, D]. k, v: head-major [B, K, S, D] in q's dtype. limits: [B, T] int.
    do: [B, T, N, D] the output's cotangent, in q's dtype. lse: [B, T, N] float32, the
      forward's. delta: [B, T, N] float32, ``rowsum(do ⊙ out) - dlse``.
    block_kv: slots per KV block (default: the ragged kernel's for these shapes).
    interpret: run in Pallas' interpreter (the CPU).

  Returns:
    (dq [B, T, N, D], dk, dv [B, K, S, D]) in q's, k's and v's dtypes.
  """
  b, t, n, d = q.shape
  heads, slots = k.shape[1], k.shape[2]
  groups = n // heads
  block_kv = block_kv or ragged_attention.default_block(q, k, False)
  per_tile, tiles = ragged_attention.query_tiling(t, groups)
  rows = ragged_attention.query_rows(per_tile, groups)
  common = dict(rows=rows, groups=groups, per_tile=per_tile, block_kv=block_kv,
                scale=1.0 / math.sqrt(d))
  args = (limits.astype(jnp.int32), q, k, v, do.astype(q.dtype), lse.astype(jnp.float32),
          delta.astype(jnp.float32))
  spec = [pl.no_block_spec] * len(args)
  params = plgpu.CompilerParams(num_warps=ragged_attention.TILED_WARPS, num_stages=2)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **common), grid=(b, heads, tiles), in_specs=spec,
      out_specs=[pl.no_block_spec], out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
      compiler_params=params, interpret=interpret)(*args)[0]
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, tiles=tiles, **common),
      grid=(b, heads, slots // block_kv), in_specs=spec, out_specs=[pl.no_block_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=interpret)(*args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _limited(q, k, v, limits, interpret):
  return _forward(q, k, v, limits, interpret)[0]


def _limited_fwd(q, k, v, limits, interpret):
  part, (out, lse) = _forward(q, k, v, limits, interpret)
  return part, (q, k, v, limits, out, lse)


def _limited_bwd(interpret, residuals, cotangents):
  q, k, v, limits, out, lse = residuals
  d_out, d_lse = cotangents                                 # [B, T, N, D], [B, T, N]
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1) - d_lse
  dq, dk, dv = backward_kernels(q, k, v, limits, d_out.astype(q.dtype), lse, delta,
                                interpret=interpret)
  return dq, dk, dv, None


_limited.defvjp(_limited_fwd, _limited_bwd)


def limited_part_kernel(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array, *,
                        interpret: bool = False):
  """The ragged kernel's attention, differentiable (module docstring).

  Args:
    q: [B, T, N, D]. k, v: head-major [B, K, S, D] in q's dtype (`ragged_attention.precondition`
      lists the rest). limits: [B, T] int, each in 0..S.
    interpret: run the kernels in Pallas' interpreter (the CPU).

  Returns:
    (out [B, T, N, D] float32, the kernel's q-dtype values; lse [B, T, N] float32), zeros and
    -inf where a query sees no slot: the kernel's own layout (`attention.kernel_part` turns it
    into `attention.limited_part`'s).
  """
  return _limited(q, k, v, limits.astype(jnp.int32), bool(interpret))
