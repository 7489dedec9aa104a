"""The paged KV cache on the device: page pools, the block table, writes and reads through it.

This module owns `PagedKV` and the pure functions over it. Layout (docs/paged_kv.md):

* **Pools.** Per layer, keys and values each in a pool [num_pages, K, page_size, D]: a page holds
  `page_size` consecutive positions of one row for every kv head, head-major inside the page (a
  page of one head is a contiguous [page_size, D] tile, the block the attention kernel loads).
  A contiguous cache [B, K, S, D] is the same thing with B pages of S slots.
* **Block table.** [slots, max_pages] int32, one row per decoding slot: position p of slot b lives
  in page ``table[b, p // page_size]`` at offset ``p mod page_size``. An entry outside
  ``0 .. num_pages - 1`` (`UNALLOCATED`, -1, by convention) means "no page": a write there is
  dropped and a read past the row's length never looks at it. Every slot's capacity is
  ``max_pages · page_size`` positions.
* The target's `PagedKV` and the draft's context `PagedKV` use one block table (the draft's
  context positions are the target's), each with its own pools; the host's
  `allocator.PageAllocator` owns the table, and the device programs only read it.

Validity stays positional, as in the contiguous caches: attention limits come from the queries'
positions, so rejected tokens need no rollback. The per-slot lengths are the host's
(`PageAllocator.lengths`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import validation

UNALLOCATED = -1
PAGE_MULTIPLE = 16
"""A page size must be a multiple of this, the attention kernel's smallest KV block (a block never
straddles two pages)."""
DEFAULT_PAGE_SIZE = 64
"""Pages of 64 positions: the kernel's default block (`ragged_attention.DEFAULT_BLOCK_KV`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
  """A paged KV cache: per layer a key pool and a value pool [num_pages, K, page_size, D], and the
  block table [slots, max_pages] int32 shared by all layers.

  A pytree (every field is data), so it passes through `jit`, `lax.while_loop` carries and
  donation like the contiguous ``{"k": (...), "v": (...)}`` caches.
  """

  k: tuple
  v: tuple
  table: jax.Array

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[0]

  @property
  def page_size(self) -> int:
    return self.k[0].shape[2]

  @property
  def slots(self) -> int:
    return self.table.shape[0]

  @property
  def capacity(self) -> int:
    """Positions one slot can hold: ``max_pages · page_size``."""
    return self.table.shape[1] * self.page_size

  def with_table(self, table) -> "PagedKV":
    """The same pools with another block table ([slots, max_pages], e.g. the allocator's)."""
    table = jnp.asarray(table, jnp.int32)
    if table.shape != self.table.shape:
      raise ValueError(f"table: shape {table.shape} differs from the cache's {self.table.shape}")
    if not validation.is_traced(table):
      check_table(table, self.num_pages)
    return dataclasses.replace(self, table=table)


def check_page_size(page_size) -> int:
  """`page_size` as an int, or ValueError unless it is a positive multiple of `PAGE_MULTIPLE`."""
  page_size = validation.check_positive_int("page_size", page_size)
  if page_size % PAGE_MULTIPLE:
    raise ValueError(f"page_size: {page_size} is not a multiple of {PAGE_MULTIPLE}, the attention "
                     f"kernel's smallest KV block")
  return page_size


def init_pools(num_layers: int, *, slots: int, num_pages: int, max_pages: int, page_size: int,
               kv_heads: int, head_dim: int, dtype) -> PagedKV:
  """Zeroed pools for `num_layers` layers and an all-`UNALLOCATED` table [slots, max_pages].

  Raises:
    ValueError: a size that is not a positive integer, a `page_size` that is not a multiple of
      `PAGE_MULTIPLE`, or a pool too small for one row (``num_pages < max_pages``).
  """
  validation.check_nonnegative_int("num_layers", num_layers)
  for name, value in (("slots", slots), ("num_pages", num_pages), ("max_pages", max_pages),
                      ("kv_heads", kv_heads), ("head_dim", head_dim)):
    validation.check_positive_int(name, value)
  page_size = check_page_size(page_size)
  if num_pages < max_pages:
    raise ValueError(f"num_pages: a pool of {num_pages} pages cannot hold one row of max_pages="
                     f"{max_pages} pages ({max_pages * page_size} positions)")
  shape = (num_pages, kv_heads, page_size, head_dim)
  pools = {name: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)) for name in "kv"}
  return PagedKV(pools["k"], pools["v"], jnp.full((slots, max_pages), UNALLOCATED, jnp.int32))


def paged_cache(config, *, slots: int, num_pages: int, max_pages: int,
                page_size: int = DEFAULT_PAGE_SIZE) -> PagedKV:
  """The target's paged cache (`models.target.TargetConfig` `config`): `init_pools` with its
  layers, kv heads, head size and compute dtype."""
  return init_pools(config.num_layers, slots=slots, num_pages=num_pages, max_pages=max_pages,
                    page_size=page_size, kv_heads=config.layer.num_kv_heads,
                    head_dim=config.layer.head_dim, dtype=config.dtype)


def paged_context(draft, cache: PagedKV) -> PagedKV:
  """The draft's paged context cache (`models.draft.DSparkDraft` `draft`): pools of `cache`'s
  page count and size for the draft's layers, sharing `cache`'s block table."""
  pools = init_pools(len(draft.layers), slots=cache.slots, num_pages=cache.num_pages,
                     max_pages=cache.table.shape[1], page_size=cache.page_size,
                     kv_heads=draft.shape.num_kv_heads, head_dim=draft.shape.head_dim,
                     dtype=draft.config.dtype)
  return dataclasses.replace(pools, table=cache.table)


def check_table(table, num_pages: int, lengths=None, page_size: int | None = None, *,
                name: str = "block_table") -> None:
  """Raises ValueError naming the first entry of a concrete [slots, max_pages] `table` that a
  read or write would follow outside the pool ``0 .. num_pages - 1``, or a page two entries hold.

  With `lengths` ([slots] int) and `page_size`, the entries of the pages holding positions
  ``0 .. lengths[b] - 1`` must lie in the pool and later ones are free; without, every entry must
  lie in the pool or be `UNALLOCATED`. A traced table is not checked.
  """
  if validation.is_traced(table) or validation.is_traced(lengths):
    return
  table = np.asarray(table)
  if table.ndim != 2:
    raise ValueError(f"{name}: expected [slots, max_pages], got shape {table.shape}")
  if not np.issubdtype(table.dtype, np.integer):
    raise ValueError(f"{name}: expected integers, got dtype {table.dtype}")
  inside = (table >= 0) & (table < num_pages)
  if lengths is None:
    bad = ~inside & (table != UNALLOCATED)
  else:
    needed = -(-np.asarray(lengths, np.int64) // page_size)       # pages holding the positions
    bad = ~inside & (np.arange(table.shape[1])[None, :] < needed[:, None])
  if bad.any():
    row, page = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name}: entry [{row}, {page}] = {int(table[row, page])} points outside the "
                     f"pool of {num_pages} pages")
  held = table[inside]
  pages, counts = np.unique(held, return_counts=True)
  if (counts > 1).any():
    twice = int(pages[counts > 1][0])
    row, page = (int(i) for i in np.argwhere(table == twice)[1])
    raise ValueError(f"{name}: entry [{row}, {page}] = {twice} is a page another entry holds")


def physical(table: jax.Array, rows: jax.Array, positions: jax.Array, num_pages: int,
             page_size: int) -> tuple[jax.Array, jax.Array]:
  """(page, offset) of position ``positions[i]`` of slot ``rows[i]`` (any equal shapes); page is
  `num_pages` (out of the pool) where the slot, the position or its table entry is."""
  slots, max_pages = table.shape
  logical = positions // page_size
  inside = (rows >= 0) & (rows < slots) & (positions >= 0) & (logical < max_pages)
  page = table[jnp.clip(rows, 0, slots - 1), jnp.clip(logical, 0, max_pages - 1)]
  ok = inside & (page >= 0) & (page < num_pages)
  return jnp.where(ok, page, num_pages), positions % page_size


def write(pool: jax.Array, table: jax.Array, rows: jax.Array, positions: jax.Array,
          values: jax.Array) -> jax.Array:
  """`pool` [num_pages, K, page_size, D] with ``values[i]`` ([..., K, D]) written at position
  ``positions[i]`` of slot ``rows[i]`` ([...] int, the same shape) through `table`.

  A write whose slot, position or page is out of range is dropped (an idle slot with an
  unallocated table writes nothing). The dense calls pass ``rows = arange(B)[:, None]`` and
  [B, T] positions (a verify's γ + 1 tokens, the step's 1, a prefill chunk); the packed verify
  passes its [N] rows and positions.
  """
  page, offset = physical(table, rows, positions, pool.shape[0], pool.shape[2])
  return pool.at[page, :, offset].set(values.astype(pool.dtype), mode="drop")


def gather(pool: jax.Array, table: jax.Array, pages: int, lengths: jax.Array | None = None
           ) -> jax.Array:
  """The first `pages` (static) pages of every slot as a contiguous head-major cache
  [slots, K, pages·page_size, D]; with `lengths` ([slots] int), positions at or past a slot's
  length are zeros (whatever its pages or unallocated entries hold)."""
  index = jnp.clip(table[:, :pages], 0, pool.shape[0] - 1)
  rows = pool[index]                                           # [B, pages, K, page_size, D]
  b, _, heads, size, d = rows.shape
  rows = jnp.swapaxes(rows, 1, 2).reshape(b, heads, pages * size, d)
  if lengths is None:
    return rows
  live = jnp.arange(pages * size, dtype=jnp.int32)[None, :] < lengths[:, None]
  return jnp.where(live[:, None, :, None], rows, jnp.zeros((), rows.dtype))
