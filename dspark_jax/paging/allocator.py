"""The paged cache on the host: which pages each slot holds, admission, and the pool's size.

This module owns `PageAllocator` (NumPy, never traced): the block table [slots, max_pages] of a
pool of `num_pages` pages (`paging.cache`), the free list, and per slot the positions its pages
cover (`lengths`). The decoding program only reads the table; the host changes it between
compiled calls (a refill boundary) and passes the new table in (`PagedKV.with_table`).

Policy (docs/paged_kv.md): **reserve up front**. A row is admitted only when the pool can give it,
at once, the pages for its whole worst case, ``prompt + max_new_tokens + 2(γ + 1)`` positions
(`row_positions`, what `generate` sizes a contiguous row for); it keeps them until it finishes
and `release` returns them. So a running row never needs a page it does not have: no row waits
mid-decode, none is preempted, none is ever written through an unallocated or shared entry. A row
that does not fit waits in the queue (first come, first served: `admissible` never lets a later,
smaller row overtake the head, so the head cannot starve). Memory then follows the rows' budgets,
not the longest row of the batch; rows that stop early return their pages early. Growing on
demand (`reserve` with a larger length later) is supported for callers that can wait per row, but
the policy above does not need it.

`pool_pages` sizes the pool from free device memory (`draft.memory_gate.probe_free_bytes`) less
what the caller still has to place and a headroom.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dspark_jax import validation
from dspark_jax.draft import memory_gate
from dspark_jax.paging import cache as paged_cache


def row_positions(prompt_len: int, max_new_tokens: int, gamma: int) -> int:
  """A row's worst-case positions: ``prompt_len + max_new_tokens + 2(γ + 1)`` (the verify block
  written past the last committed token, and its successor's)."""
  return prompt_len + max_new_tokens + 2 * (gamma + 1)


def pages_for(positions, page_size: int):
  """Pages that hold `positions` positions: ``ceil(positions / page_size)`` (elementwise)."""
  return -(-np.asarray(positions, np.int64) // page_size)


def admissible(free_pages: int, needs: Sequence[int], page_size: int, max_pages: int) -> int:
  """How many of the queued rows, in order, can start now: the longest prefix of `needs`
  (positions per row, e.g. `row_positions`) whose pages fit in `free_pages` together.

  Raises:
    ValueError: a row needs more than `max_pages` pages (no slot can ever hold it), naming it.
  """
  pages = pages_for(needs, page_size)
  if pages.size and pages.max() > max_pages:
    first = int(np.argmax(pages > max_pages))
    raise ValueError(f"needs: row {first} needs {int(needs[first])} positions ({int(pages[first])} "
                     f"pages of {page_size}), more than a slot's max_pages={max_pages}")
  return int(np.searchsorted(np.cumsum(pages), free_pages, side="right"))


class PageAllocator:
  """Pages of one pool handed to decoding slots (host side; see the module docstring's policy).

  Attributes:
    table: [slots, max_pages] int32, the block table (`paging.cache.UNALLOCATED` where no page).
    lengths: [slots] int64, the positions each slot's pages cover (a multiple of page_size).
  """

  def __init__(self, num_pages: int, page_size: int, slots: int, max_pages: int):
    for name, value in (("num_pages", num_pages), ("slots", slots), ("max_pages", max_pages)):
      validation.check_positive_int(name, value)
    self.page_size = paged_cache.check_page_size(page_size)
    if num_pages < max_pages:
      raise ValueError(f"num_pages: a pool of {num_pages} pages cannot hold one row of max_pages="
                       f"{max_pages} pages ({max_pages * page_size} positions)")
    self.num_pages, self.max_pages = int(num_pages), int(max_pages)
    self.table = np.full((slots, max_pages), paged_cache.UNALLOCATED, np.int32)
    self.lengths = np.zeros(slots, np.int64)
    self._free = list(range(num_pages - 1, -1, -1))        # pop() hands out the lowest page

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def held(self, slot: int) -> int:
    """Pages slot `slot` holds."""
    return int(pages_for(self.lengths[self._slot(slot)], self.page_size))

  def _slot(self, slot) -> int:
    slot = validation.check_nonnegative_int("slot", slot)
    if slot >= self.table.shape[0]:
      raise ValueError(f"slot: {slot} is not in 0..{self.table.shape[0] - 1}")
    return slot

  def reserve(self, slot: int, positions: int) -> bool:
    """Gives slot `slot` pages for positions ``0 .. positions - 1`` (keeping those it holds).
    Returns False, changing nothing, when the free pages do not suffice (the row waits).

    Raises:
      ValueError: a bad slot, or `positions` above a slot's capacity ``max_pages · page_size``.
    """
    slot = self._slot(slot)
    positions = validation.check_nonnegative_int("positions", positions)
    if positions > self.max_pages * self.page_size:
      raise ValueError(f"positions: {positions} exceed a slot's capacity of {self.max_pages} "
                       f"pages of {self.page_size} ({self.max_pages * self.page_size} positions)")
    have = self.held(slot)
    want = int(pages_for(positions, self.page_size))
    if want - have > len(self._free):
      return False
    for page in range(have, want):
      self.table[slot, page] = self._free.pop()
    self.lengths[slot] = max(self.lengths[slot], want * self.page_size)
    return True

  def release(self, slot: int) -> int:
    """Frees every page of slot `slot` (its row finished); returns how many."""
    slot = self._slot(slot)
    held = self.held(slot)
    self._free.extend(int(p) for p in self.table[slot, :held][::-1])
    self.table[slot] = paged_cache.UNALLOCATED
    self.lengths[slot] = 0
    return held

  def admit(self, needs: Sequence[int]) -> int:
    """How many queued rows (positions each, in order) can start now (`admissible`)."""
    return admissible(self.free_pages, needs, self.page_size, self.max_pages)


def token_bytes(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
  """Bytes of keys and values of one position in all layers: ``2 · layers · K · D · itemsize``."""
  return 2 * num_layers * kv_heads * head_dim * itemsize


def pool_pages(page_bytes: int, *, reserve_bytes: int = 0,
               headroom_bytes: int = memory_gate.DEFAULT_HEADROOM_BYTES,
               memory_stats: Mapping[str, Any] | Callable[[], Any] | None = None,
               device=None) -> int:
  """How many pages of `page_bytes` (every layer's keys and values of one page, target and draft:
  ``page_size · token_bytes(...)`` summed) fit in free device memory less `reserve_bytes` (what is
  still to be placed, e.g. weights not loaded yet, the decoding program's buffers) and
  `headroom_bytes`. Free memory is `memory_gate.probe_free_bytes` (`memory_stats`, `device` as
  there); weights already on the device are not free and need no reserve.

  Raises:
    ValueError: `page_bytes` not positive, or the free memory is unknown (naming `memory_stats`:
      pass a mapping, or size the pool by hand).
  """
  page_bytes = validation.check_positive_int("page_bytes", page_bytes)
  free, source = memory_gate.probe_free_bytes(memory_stats, device)
  if free is None:
    raise ValueError(f"memory_stats: free device memory is unknown ({source}); pass a mapping "
                     f"with bytes_limit and bytes_in_use, or choose num_pages yourself")
  return max(0, (free - reserve_bytes - headroom_bytes) // page_bytes)
