"""The paged cache on the host: which pages each slot holds, admission, and the pool's size.

This module owns `PageAllocator` (NumPy, never traced): the block table [slots, max_pages] of a
pool of `num_pages` pages (`paging.cache`), the free list, and per slot the positions its pages
cover (`lengths`). The decoding program only reads the table; the host changes it between
compiled calls (a refill boundary) and passes the new table in (`PagedKV.with_table`).

Two policies, both of which never let a row be written through a page it does not hold
(docs/paged_kv.md):

* **Reserve up front** (`row_positions`): a row is admitted only when the pool can give it at
  once the pages for its whole worst case, ``prompt + max_new_tokens + 2(γ + 1)`` positions (what
  `generate` sizes a contiguous row for), kept until it finishes and `release` returns them. No
  row ever waits mid-decode or is preempted. Memory follows each row's budget (not the batch's
  longest row), but a row that stops early (EOS, a stop string) held its whole budget.
* **Grow on demand, preempt the newest** (`grow`): a row is admitted with pages for its prompt and
  a lookahead (the positions the next compiled chunk of rounds can write: rounds · (γ + 1) + γ + 1).
  At every host boundary, before the next chunk runs, `grow` extends each running row to its
  current length plus that lookahead; when the free pages do not suffice, the most recently
  admitted rows are preempted (their pages freed, `grow` returns them) until the others fit, and
  the caller re-queues each preempted row at the queue's head to recompute its prompt and the
  tokens it had committed (its randomness is keyed by position, so it continues with the same
  tokens). Memory follows the rows' real lengths; the oldest row always progresses, so no
  deadlock. A row that cannot fit even alone (more than the pool or a slot's `max_pages`) is a
  `ValueError` at admission.

Admission (`admissible`) is first come, first served in both: a later, smaller row never overtakes
the queue's head, so the head cannot starve; `watermark` pages can be kept free for growth.

`pool_pages` sizes the pool from free device memory (`device_memory.probe_free_bytes`) less
what the caller still has to place and a headroom.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dspark_jax import device_memory
from dspark_jax import validation
from dspark_jax.paging import cache as paged_cache


def row_positions(prompt_len: int, max_new_tokens: int, gamma: int) -> int:
  """A row's worst-case positions: ``prompt_len + max_new_tokens + 2(γ + 1)`` (the verify block
  written past the last committed token, and its successor's)."""
  return prompt_len + max_new_tokens + 2 * (gamma + 1)


def lookahead(rounds: int, gamma: int) -> int:
  """Positions a row can write in `rounds` speculative rounds before the host sees it again:
  ``(rounds + 1)(γ + 1)`` (each round's verify block, and the last one written past the end)."""
  return (rounds + 1) * (gamma + 1)


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
    self._order = np.zeros(slots, np.int64)                # admission order (`start`)
    self._admissions = 0

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

  def admit(self, needs: Sequence[int], watermark: int = 0) -> int:
    """How many queued rows (positions each, in order) can start now with `watermark` pages left
    free (`admissible`)."""
    return admissible(max(self.free_pages - watermark, 0), needs, self.page_size, self.max_pages)

  def start(self, slot: int, positions: int) -> bool:
    """Admits a row into the empty slot `slot` with pages for `positions` positions (`reserve`),
    recording its admission order for `grow`'s preemption. False (nothing changed) when the pool
    cannot give them.

    Raises:
      ValueError: the slot holds pages (release it first), or `reserve`'s errors.
    """
    if self.held(slot):
      raise ValueError(f"slot: {slot} still holds {self.held(slot)} pages; release it first")
    if not self.reserve(slot, positions):
      return False
    self._order[slot] = self._admissions
    self._admissions += 1
    return True

  def grow(self, wants) -> list[int]:
    """Gives every slot pages for ``wants[slot]`` positions ([slots] int; 0 for an empty slot),
    preempting the most recently admitted rows while the free pages do not suffice. Returns the
    preempted slots, newest first (their pages are freed; the caller re-queues their rows to
    recompute); every other slot then holds the pages it wants.

    Raises:
      ValueError: `wants` is not [slots], or a slot wants more than its capacity.
    """
    wants = np.asarray(wants, np.int64)
    if wants.shape != self.lengths.shape:
      raise ValueError(f"wants: expected [{self.lengths.size}] positions, got shape {wants.shape}")
    if wants.size and wants.max() > self.max_pages * self.page_size:
      slot = int(np.argmax(wants > self.max_pages * self.page_size))
      raise ValueError(f"wants: slot {slot} wants {int(wants[slot])} positions, more than a "
                       f"slot's capacity of {self.max_pages * self.page_size}")
    held = pages_for(self.lengths, self.page_size)
    want = pages_for(wants, self.page_size)
    running = np.flatnonzero((held > 0) | (wants > 0))
    running = running[np.argsort(self._order[running], kind="stable")]  # oldest first
    deficit = np.maximum(want - held, 0)
    short = int(deficit[running].sum()) - self.free_pages  # pages missing, all rows kept
    preempted = []
    while running.size and short > 0:         # a victim returns its pages and wants none
      victim = int(running[-1])
      running = running[:-1]
      short -= int(deficit[victim] + held[victim])
      self.release(victim)
      preempted.append(victim)
    # The pages `reserve` would pop, row by row (oldest first), position by position.
    takers = running[deficit[running] > 0]
    total = int(deficit[takers].sum())
    pages = self._free[len(self._free) - total:][::-1]    # pop() order: the list's end first
    del self._free[len(self._free) - total:]
    start = 0
    for slot in takers:
      count = int(deficit[slot])
      self.table[slot, held[slot]:held[slot] + count] = pages[start:start + count]
      start += count
    self.lengths[running] = np.maximum(self.lengths[running], want[running] * self.page_size)
    return preempted


def token_bytes(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
  """Bytes of keys and values of one position in all layers: ``2 · layers · K · D · itemsize``."""
  return 2 * num_layers * kv_heads * head_dim * itemsize


def pool_pages(page_bytes: int, *, reserve_bytes: int = 0,
               headroom_bytes: int = device_memory.DEFAULT_HEADROOM_BYTES,
               memory_stats: Mapping[str, Any] | Callable[[], Any] | None = None,
               device=None) -> int:
  """How many pages of `page_bytes` (every layer's keys and values of one page, target and draft:
  ``page_size · token_bytes(...)`` summed) fit in free device memory less `reserve_bytes` (what is
  still to be placed, e.g. weights not loaded yet, the decoding program's buffers) and
  `headroom_bytes`. Free memory is `device_memory.probe_free_bytes` (`memory_stats`, `device` as
  there); weights already on the device are not free and need no reserve.

  Raises:
    ValueError: `page_bytes` not positive, or the free memory is unknown (naming `memory_stats`:
      pass a mapping, or size the pool by hand).
  """
  page_bytes = validation.check_positive_int("page_bytes", page_bytes)
  free, source = device_memory.probe_free_bytes(memory_stats, device)
  if free is None:
    raise ValueError(f"memory_stats: free device memory is unknown ({source}); pass a mapping "
                     f"with bytes_limit and bytes_in_use, or choose num_pages yourself")
  return max(0, (free - reserve_bytes - headroom_bytes) // page_bytes)
