"""The host side of a paged queue: the pool, admission by free pages, growth and preemption.

This module owns `_Pages`, the policy of `decoding.queue.Engine` with ``kv="paged"``
(docs/serving.md): the target's and the draft's context pools share one block table, owned by the
host's `paging.allocator.PageAllocator` and passed in at each boundary. Finished rows' pages are
released; every running row grows to its length + `allocator.lookahead(rounds_per_call, γ)`,
preempting the newest rows when the pool is short (their row state kept on the host, re-queued at
the head); queued rows are admitted first come first served while pages allow. A preempted row's
refill recomputes its caches from its prompt and committed tokens and restores its saved state, so
it continues with the tokens it would have decoded (same keys, same positions).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.slots import CACHE_KEYS
from dspark_jax.paging import allocator as page_alloc
from dspark_jax.paging import cache as paging

class _Pages:
  """The host side of a paged queue: the pool's `PageAllocator`, admission by free pages, growth
  before each chunk with preemption of the newest rows, and the pages-in-use statistics."""

  def __init__(self, engine, slots_n: int, cache_len: int, gamma: int, lens):
    """`engine`: the `decoding.queue.Engine` (its page size, pool and rounds per call)."""
    self.page_size = engine.page_size
    self.max_pages = int(page_alloc.pages_for(cache_len, self.page_size))
    self.capacity = self.max_pages * self.page_size
    self.num_pages = engine._pool(slots_n, self.max_pages)
    self.lookahead = page_alloc.lookahead(engine.rounds_per_call, gamma)
    pool = self.num_pages * self.page_size
    long = np.flatnonzero(lens > pool)
    if long.size:
      i = int(long[0])
      raise ValueError(f"prompts: prompt {i} has {lens[i]} tokens, more than the pool of "
                       f"num_pages={self.num_pages} pages of {self.page_size} ({pool} positions) "
                       f"holds")
    if self.num_pages < self.max_pages:
      raise ValueError(f"num_pages: a pool of {self.num_pages} pages of {self.page_size} "
                       f"({pool} positions) cannot hold one row of a slot's capacity, "
                       f"{self.capacity} positions (prompt + max_new_tokens + 2(γ + 1), or "
                       f"max_seq_len + 2(γ + 1)); raise num_pages or lower max_seq_len or "
                       f"max_new_tokens")
    self.allocator = page_alloc.PageAllocator(self.num_pages, self.page_size, slots_n,
                                              self.max_pages)
    self.preemptions = 0

  @property
  def in_use(self) -> int:
    return self.num_pages - self.allocator.free_pages

  def want(self, positions):
    """Positions to hold for rows of `positions` tokens before the next chunk (capped at a
    slot's capacity, which bounds every write)."""
    return np.minimum(np.asarray(positions, np.int64) + self.lookahead, self.capacity)

  def empty_caches(self, target, draft):
    cache = paging.paged_cache(target.config, slots=self.allocator.table.shape[0],
                               num_pages=self.num_pages, max_pages=self.max_pages,
                               page_size=self.page_size)
    caches = {"cache": cache}
    if draft is not None:
      caches["context"] = paging.paged_context(draft, cache)
    return caches

  def table(self):
    return jnp.asarray(self.allocator.table)

  def with_table(self, state):
    """The state's caches with the allocator's current block table (a buffer of its own each:
    the programs donate the state)."""
    return {name: dataclasses.replace(state[name], table=self.table())
            for name in CACHE_KEYS if name in state}

  def grow(self, owner, light):
    """Extends every running row by the lookahead past its length; yields the (slot, prompt) of
    the rows preempted for it, newest first (their pages freed)."""
    running = owner >= 0
    wants = np.where(running, self.want(light["anchor_pos"]), 0)
    for slot in self.allocator.grow(wants):
      self.preemptions += 1
      yield int(slot), int(owner[slot])

  def admit(self, free, heads, lens, saved) -> int:
    """How many of the queue's head prompts `heads` start now in the free slots `free`, first
    come first served; each gets pages for its tokens (a resumed row's: up to its anchor) and the
    lookahead."""
    positions = [int(saved[i]["anchor_pos"]) if i in saved else int(lens[i]) for i in heads]
    needs = self.want(positions)
    n = self.allocator.admit(needs)
    for slot, need in zip(free[:n], needs[:n]):
      assert self.allocator.start(int(slot), int(need))
    return n

  def release(self, slot: int):
    self.allocator.release(slot)
