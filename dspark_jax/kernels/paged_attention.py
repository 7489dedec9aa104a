"""Attention over a paged KV cache, read through its block table (`dspark_jax.paging.cache`).

This module owns the paged counterparts of `attention.attend_limited` and `attention.attend_cached`:
queries [B, T, N, D] over page pools [num_pages, K, page_size, D] whose slot b's logical position
p lives in page ``table[b, p // page_size]``. Two forms, one function:

* ``ragged``: the Pallas kernel (`ragged_attention.ragged_attention` with ``block_table``), which
  loads each KV block from its page; where `choose_paged` finds its preconditions hold (GPU).
* ``xla`` (the CPU, and wherever the kernel's preconditions fail): the pages a row needs are
  gathered into a contiguous head-major cache of the smallest of a few static page counts that
  covers the batch's longest row (`over_pages`: `attention.cut_lengths` in whole pages, one
  `lax.switch` branch per count, so no length recompiles), positions past each row's longest
  limit zeroed, then the contiguous einsums (or cuDNN) over it. The gather copies what it reads
  once; the kernel reads pages in place.

Both give `attention.attend_xla` over the contiguous cache the table describes, with the mask
``slot < limits[b, t]``, within rounding; nothing at or past a row's limit (stale pages of other
rows, NaN, unallocated entries) reaches a result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.kernels import attention
from dspark_jax.kernels import ragged_attention
from dspark_jax.paging import cache as paged_cache


def choose_paged(q, pool, table, implementation: str | None = None,
                 platform: str | None = None) -> str:
  """``"ragged"``, ``"cudnn"`` or ``"xla"`` for queries `q` [B, T, N, D] over a page pool
  [num_pages, K, page_size, D] with block table [B, M]: ``auto`` takes the kernel wherever its
  preconditions hold (GPU; `ragged_attention.precondition` with the table, at the page size's
  `ragged_attention.paged_block`), else `attention.choose`'s answer over the gathered cache.

  Raises:
    ValueError: an unknown implementation, or an explicit one whose precondition fails.
  """
  requested = attention._requested(implementation)
  if requested in ("auto", "ragged"):
    platform = platform or attention._platform()
    failed = (f"platform is {platform!r}, not 'gpu'" if platform != "gpu" else
              ragged_attention.precondition(q, pool, block_kv=ragged_attention.paged_block(
                  pool.shape[2]), block_table=table))
    if not failed:
      return "ragged"
    if requested == "ragged":
      raise ValueError(f"attention implementation 'ragged': precondition failed: {failed}")
  return attention.choose(q.dtype, q.shape[-1], "auto" if requested == "ragged" else requested,
                          platform, q.shape[1])


def page_counts(max_pages: int, page_size: int) -> tuple[int, ...]:
  """The static page counts the XLA form gathers, ascending: `attention.cut_lengths` of the
  capacity ``max_pages · page_size`` in whole pages (the last is `max_pages`)."""
  capacity = max_pages * page_size
  smallest = -(-128 // page_size) * page_size
  return tuple(n // page_size for n in attention.cut_lengths(capacity, smallest=smallest,
                                                             multiple=page_size))


def over_pages(fn, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
               limits: jax.Array):
  """``fn(q, k, v, limits)`` over the contiguous head-major cache [B, K, n·page_size, D] gathered
  through `table` for the smallest `page_counts` n covering ``max(limits)``, positions at or past
  each row's longest limit zeroed. `fn` must ignore slots at or past each query's limit."""
  counts = page_counts(table.shape[1], k_pool.shape[2])
  lengths = jnp.max(limits, axis=1)

  def branch(n):
    def run(q, k_pool, v_pool, table, limits):
      k = paged_cache.gather(k_pool, table, n, lengths)
      v = paged_cache.gather(v_pool, table, n, lengths)
      return fn(q, k, v, limits)
    return run

  if len(counts) == 1:
    return branch(counts[0])(q, k_pool, v_pool, table, limits)
  need = -(-jnp.max(limits) // k_pool.shape[2])
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(counts, jnp.int32), need), len(counts) - 1)
  return jax.lax.switch(index, [branch(n) for n in counts], q, k_pool, v_pool, table, limits)


def _kernel(q, k_pool, v_pool, table, limits):
  return ragged_attention.ragged_attention(q, k_pool.astype(q.dtype), v_pool.astype(q.dtype),
                                           limits, block_table=table)


def attend_paged(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                 limits: jax.Array, implementation: str | None = None) -> jax.Array:
  """[B, T, N, D] queries over page pools [num_pages, K, page_size, D] read through `table`
  [B, M], query (b, t) seeing logical positions ``p < limits[b, t]`` ([B, T] int) -> [B, T, N, D].

  Equal to `attention.attend_limited` over the contiguous cache the table describes, within
  rounding. Only the table entries of pages below a row's longest limit are followed; those must
  lie in the pool (the kernel and the gather clip, so neither reads outside it). A query with
  limit 0 gets zeros.

  Raises:
    ValueError: concrete `table` and `limits` where a followed entry points outside the pool
      (`paging.cache.check_table`, naming it); traced ones are not checked.
  """
  limits = limits.astype(jnp.int32)
  paged_cache.check_table(table, k_pool.shape[0], jnp.max(limits, axis=1), k_pool.shape[2])
  chosen = choose_paged(q, k_pool, table, implementation)
  if chosen == "ragged":
    return _kernel(q, k_pool, v_pool, table, limits)[0]
  return over_pages(attention.masked_form(chosen, q.shape[1]), q, k_pool, v_pool, table, limits)


def attend_packed_paged(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                        limits: jax.Array, tokens: jax.Array,
                        implementation: str | None = None) -> jax.Array | None:
  """`attention.attend_packed` over page pools read through `table`: packed queries [N', N, D],
  query (b, t) being token ``tokens[b, t]``, through the ``ragged`` kernel -> [N', N, D]; None
  where `choose_paged` does not take it."""
  dense = jax.ShapeDtypeStruct((*limits.shape, *q.shape[1:]), q.dtype)
  if choose_paged(dense, k_pool, table, implementation) != "ragged":
    return None
  limits = limits.astype(jnp.int32)
  paged_cache.check_table(table, k_pool.shape[0], jnp.max(limits, axis=1), k_pool.shape[2])
  return ragged_attention.ragged_attention(q, k_pool.astype(q.dtype), v_pool.astype(q.dtype),
                                           limits, block_table=table, tokens=tokens)[0]


def attend_cached_paged(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                        prefix_len: jax.Array, block_k: jax.Array, block_v: jax.Array,
                        block_mask: jax.Array) -> jax.Array:
  """`attention.attend_cached` with the cache prefix in page pools: every query sees positions
  ``0 .. prefix_len_b - 1`` of slot b (through `table`) and the block's token-major [B, T', K, D]
  `block_k` / `block_v` where `block_mask` [B, T, T'] holds (the draft block over its paged
  context)."""
  limits = jnp.broadcast_to(prefix_len.astype(jnp.int32)[:, None], q.shape[:2])
  if choose_paged(q, k_pool, table) == "ragged":
    out, lse = _kernel(q, k_pool, v_pool, table, limits)
    prefix = attention.kernel_part(out, lse, k_pool.shape[1])
  else:
    prefix = over_pages(attention.limited_part, q, k_pool, v_pool, table, limits)
  return attention.join_block(q, prefix, block_k, block_v, block_mask, k_pool.dtype)
