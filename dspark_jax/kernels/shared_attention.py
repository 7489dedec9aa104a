"""Training's context attention on a GPU: the ragged kernel's forward with a gradient of its own.

This module owns `limited_part_kernel`, the differentiable counterpart of
`attention.limited_part` that `attention.shared_limited_part` takes where the ragged kernel may run
(`attention.choose_cached`): [B, T, N, D] queries over head-major [B, K, S, D] keys/values, query
(b, t) seeing slots ``s < limits[b, t]``, returned as a softmax part (lse [B, K, G, T],
out [B, K, G, T, D], float32) for `attention.join_block` to join with the blocks' own part.

* **Forward:** `ragged_attention.ragged_attention` in query tiles: scores live in on-chip tiles,
  never in memory, and a tile reads the key/value blocks up to its own queries' longest limit.
  Kept for the backward pass: q, k, v, the limits, the output (in q's dtype) and the lse; no
  scores.
* **Backward:** in query tiles of `BACKWARD_QUERY_TILE` (`lax.scan`, the keys' and values'
  gradients carried in float32): a tile's probabilities are recomputed from the kept lse
  (``p = exp(s - lse)``, no second softmax), ``dS = p ⊙ (dP - Δ + dlse)`` with
  ``Δ = rowsum(dO ⊙ O)`` and dlse the cotangent of the lse, and the three products
  ``dQ = dS·K``, ``dK = dSᵀ·Q``, ``dV = pᵀ·dO``, with dS and p rounded to the value dtype as
  the forward rounds p. One tile of float32 scores is the scratch.

The result equals `attention.limited_part` and its gradients within bf16 rounding (the output
is rounded to q's dtype once, as the kernel writes it). A query with limit 0 gets lse = -inf,
zeros and zero gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax.kernels import ragged_attention

BACKWARD_QUERY_TILE = 512
"""Queries per tile of the backward pass: its scratch is one [B, N, tile, S] float32 tile."""


def _by_head(x: jax.Array, heads: int) -> jax.Array:
  """[B, T, N, ...] -> [B, K, G, T, ...] (query head h = k·G + g)."""
  b, t, n = x.shape[:3]
  return jnp.moveaxis(x.reshape(b, t, heads, n // heads, *x.shape[3:]), 1, 3)


def _forward(q, k, v, limits, interpret):
  out, lse = ragged_attention.ragged_attention(q, k, v, limits, interpret=interpret)
  heads = k.shape[1]
  return (_by_head(lse, heads), _by_head(out.astype(jnp.float32), heads)), (out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _limited(q, k, v, limits, tile, interpret):
  return _forward(q, k, v, limits, interpret)[0]


def _limited_fwd(q, k, v, limits, tile, interpret):
  part, (out, lse) = _forward(q, k, v, limits, interpret)
  return part, (q, k, v, limits, out, lse)


def _limited_bwd(tile, interpret, residuals, cotangents):
  del interpret
  q, k, v, limits, out, lse = residuals
  d_lse, d_out = cotangents                                 # [B, K, G, T], [B, K, G, T, D]
  b, t, n, d = q.shape
  heads, slots = k.shape[1], k.shape[2]
  groups = n // heads
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  d_out = d_out.astype(jnp.float32)
  delta = jnp.sum(d_out * _by_head(out.astype(jnp.float32), heads), axis=-1) - d_lse
  lse = _by_head(lse, heads)                                # [B, K, G, T]
  tile = max(1, min(tile, t))
  tiles = -(-t // tile)
  pad = tiles * tile - t

  def in_tiles(x, axis):                                    # [..T..] -> [tiles, ..tile..]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
    x = x.reshape(*x.shape[:axis], tiles, tile, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  xs = (in_tiles(q.reshape(b, t, heads, groups, d), 1), in_tiles(limits.astype(jnp.int32), 1),
        in_tiles(lse, 3), in_tiles(delta, 3), in_tiles(d_out, 3))
  slot = jnp.arange(slots, dtype=jnp.int32)

  def step(carry, x):
    dk, dv = carry
    qt, lim, lse_t, delta_t, dout_t = x     # [B,tile,K,G,D], [B,tile], [B,K,G,tile](,D)
    seen = (slot[None, None, :] < lim[:, :, None])[:, None, None]           # [B,1,1,tile,S]
    scores = jnp.einsum("btkgd,bksd->bkgts", qt, k, preferred_element_type=jnp.float32) * scale
    finite = jnp.where(jnp.isfinite(lse_t), lse_t, 0.0)
    p = jnp.where(seen, jnp.exp(scores - finite[..., None]), 0.0)
    dp = jnp.einsum("bkgtd,bksd->bkgts", dout_t.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    ds = (p * (dp - delta_t[..., None])).astype(q.dtype)
    dq = jnp.einsum("bkgts,bksd->btkgd", ds, k, preferred_element_type=jnp.float32) * scale
    dk = dk + jnp.einsum("bkgts,btkgd->bksd", ds, qt, preferred_element_type=jnp.float32) * scale
    dv = dv + jnp.einsum("bkgts,bkgtd->bksd", p.astype(v.dtype), dout_t.astype(v.dtype),
                         preferred_element_type=jnp.float32)
    return (dk, dv), dq.astype(q.dtype)

  zeros = jnp.zeros(k.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(step, (zeros, zeros), xs)
  dq = jnp.moveaxis(dq, 0, 1).reshape(b, tiles * tile, n, d)[:, :t]
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_limited.defvjp(_limited_fwd, _limited_bwd)


def limited_part_kernel(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array, *,
                        tile: int | None = None, interpret: bool = False):
  """`attention.limited_part` through the ragged kernel, differentiable (module docstring).

  Args:
    q: [B, T, N, D]. k, v: head-major [B, K, S, D] in q's dtype (`ragged_attention.precondition`
      lists the rest). limits: [B, T] int, each in 0..S.
    tile: queries per tile of the backward pass (default `BACKWARD_QUERY_TILE`, read at the call).
    interpret: run the kernel in Pallas' interpreter (the CPU).

  Returns:
    (lse [B, K, G, T], out [B, K, G, T, D]), float32; -inf and zeros where a query sees no slot.
  """
  return _limited(q, k, v, limits.astype(jnp.int32), int(tile or BACKWARD_QUERY_TILE),
                  bool(interpret))
