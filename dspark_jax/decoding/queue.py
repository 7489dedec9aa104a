"""The queue-driven decode (continuous batching): S slots that take the next prompt as rows finish.

This module owns `Engine` (and `dj.generate(..., max_batch_size=S)`, which calls it): any number
of prompts decoded through S static slots, results in prompt order (`QueueResult`, one
`PromptResult` per prompt).

**Programs** (`decoding.slots`): the *refill* prefills new prompts into the slots whose rows
finished; the *chunk* runs the usual iterations (`loop.iteration`) over the S slots until enough
of them are free. Both come from `decoding.compile_cache`.

The host loop: collect the rows that finished (one small transfer per boundary), refill the free
slots from the queue, run a chunk; until the queue is empty and every slot idle.

**Randomness and exactness.** Every draw is keyed by (key, seed, absolute position, stream), never by
the slot, the round or the other rows; the caches are indexed by absolute position and each row
reads only its own prefix (`kernels.attention`), so a refilled slot's stale entries past the new
row's length are never read (the refill overwrites the whole row of every cache anyway). Without a
schedule (or with `schedules.fixed()`), each prompt's tokens are those of decoding it alone with
`generate` (same key, same seed; bit-identical on the CPU). A batch-coupled schedule (`top_k`,
`prefix`) chooses a row's verify lengths from the other rows' confidences, so its tokens depend on
its neighbours: only the law is the same. A stateful schedule keeps its state across refills (a new
row inherits its slot's history, which only sets verify lengths) and drafts with the global round
folded into the key (`rounds.draft_key`), fresh noise every round.

**Caches** (``kv``). Contiguous (default): a row of [S, ...] per slot, written at admission by
`slots.SlotCaches.admit`. Paged (``kv="paged"``): pages of one pool per layer, shared by the target
and the draft's context through one block table; admission, growth and preemption are
`decoding.paged_slots` (docs/serving.md).

The results (`QueueResult`, `PromptResult`) and the run's bookkeeping are
`decoding.queue_results`; this module imports them, so ``decoding.queue.QueueResult`` still works.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import compile_cache
from dspark_jax.decoding import loop
from dspark_jax.decoding import packing
from dspark_jax.decoding.paged_slots import _Pages
from dspark_jax.decoding.queue_results import PromptResult, QueueResult, _Run
from dspark_jax.decoding.requests import (MIN_BUCKET, _choose_path, bucket, check_models,
                                          check_request, choose_block_backend)
from dspark_jax.decoding.rounds import PREFILL_CHUNK, _row_arrays
from dspark_jax.decoding.slots import (CACHE_KEYS, GLOBAL_KEYS, _chunk_program, _empty_state,
                                       _group_prompts, _pack_prompts, _refill_program,
                                       _saved_rows, _trace_buffers, refill_form, warm_up_groups)
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.paging import allocator as page_alloc
from dspark_jax.paging import cache as paging
from dspark_jax.sampling import params as sp

__all__ = ["Engine", "PromptResult", "QueueResult"]


def _check_positive(name: str, value) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
  return int(value)


def _is_out_of_memory(error: BaseException) -> bool:
  return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


LOGIT_BUFFERS = 4
"""float32 [S, γ + 1, V] buffers a paged pool sized from free memory leaves room for (the verify's
logits and probabilities, the draft's corrected logits and noise)."""
KV_FORMS = ("contiguous", "paged")
"""The slots' caches: one contiguous row per slot, or pages of a shared pool (`paging`)."""
REFILL_AUTO_SHARE = 32
"""``refill_at="auto"``: a chunk returns to the host once S // REFILL_AUTO_SHARE slots are free."""


def auto_refill_at(slots: int) -> int:
  """`Engine.refill_at` "auto" at S = `slots` slots: ``max(1, S // 32)``.

  A refill costs a fixed part (one read of the weights, one host round trip) plus a part per
  prompt; waiting for k free slots leaves about k / 2 of them idle until the refill. Refilling in
  groups of about S / 32 amortises the fixed part while the idle slots stay near 1.5 % of S.
  """
  return max(1, _check_positive("slots", slots) // REFILL_AUTO_SHARE)


@dataclasses.dataclass
class Engine:
  """A queue-driven decoder over S static slots (module docstring).

  Attributes:
    target, draft: the models (`draft` may be None when ``spec=False``).
    max_batch_size: S, the slots decoding at once.
    max_seq_len: tokens one slot holds (a prompt plus its budget); None sizes the slots for each
      call's longest prompt and largest budget (one chunk program per size: fix it to reuse them).
    spec: speculative decoding (default) or the autoregressive baseline.
    schedule: a verify-length `Schedule` (as in `generate`; part of the compile key by identity).
    rounds_per_call: R, iterations a chunk runs at most between two host boundaries.
    refill_at: a chunk returns to the host once this many slots are free (fewer while the queue
      holds fewer prompts); larger values refill in bigger groups, less often. "auto" (default):
      `auto_refill_at` (S // 32, at least 1); 1 refills each freed slot at the next boundary.
    refill_rows: None (default): the prompts admitted at a boundary are prefilled by one refill
      of their count's power-of-two bucket (one program per bucket met, up to S rows). An int
      (1..S): by refills of exactly this many rows each, the last padded: one refill program in
      all (per prompt-length bucket), at the cost of the padded rows' prefill.
    kv: the slots' caches: "contiguous" (default; every slot holds its whole capacity) or "paged"
      (pages of one pool per layer, shared by the target and the draft's context through one
      block table, handed out as rows grow: docs/serving.md, "Paged caches").
    num_pages: with ``kv="paged"``, the pool's pages; None: as many as fit in free device memory
      less `headroom_bytes` and four float32 [S, γ + 1, V] decoding buffers
      (`paging.allocator.pool_pages`), at most S slots' capacity (also the size when free memory
      is unknown, e.g. on the CPU).
    page_size: with ``kv="paged"``, positions per page (a multiple of 16).
    mode, memory_stats, headroom_bytes, store_logits, backend, config: as in `generate`.
    trace: record every iteration's `loop.RoundTrace` per slot (`QueueResult.trace`); speculative
      decoding with no schedule or a stateless one only.
    prefill_chunk: prompt positions per prefill pass (as in `generate`); a refill whose prompts'
      bucket is longer is padded to the most whole passes a slot holds (its passes stop after the
      longest row), so such refills share one program per K.
    pack_prompts: a refill prefills its K prompts packed one after another into one pass of N
      tokens (`slots._pack_prompts`; N one of a few sizes), each prompt attending to itself
      only, so its work follows the prompts' tokens rather than K times the longest; where the
      packed attention does not run (`kernels.attention.choose_segments`) or N would pass
      `packing.prompt_limit`, the refill pads its rows instead. False: always pad. The tokens
      are the same either way (up to rounding).
  """

  target: tm.TargetModel
  draft: dm.DSparkDraft | None
  max_batch_size: int
  max_seq_len: int | None = None
  spec: bool = True
  schedule: Any = None
  rounds_per_call: int = 16
  refill_at: int | str = "auto"
  refill_rows: int | None = None
  kv: str = "contiguous"
  num_pages: int | None = None
  page_size: int = paging.DEFAULT_PAGE_SIZE
  mode: Any = None
  memory_stats: Any = None
  headroom_bytes: int = memory_gate.DEFAULT_HEADROOM_BYTES
  store_logits: bool = True
  backend: str | None = None
  config: Any = None
  trace: bool = False
  prefill_chunk: int | None = PREFILL_CHUNK
  pack_prompts: bool = True
  _shapes: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  def __post_init__(self):
    self.max_batch_size = _check_positive("max_batch_size", self.max_batch_size)
    self.rounds_per_call = _check_positive("rounds_per_call", self.rounds_per_call)
    if isinstance(self.refill_at, str):
      if self.refill_at != "auto":
        raise ValueError(f"refill_at: must be an integer >= 1 or 'auto', got {self.refill_at!r}")
      self.refill_at = auto_refill_at(self.max_batch_size)
    self.refill_at = _check_positive("refill_at", self.refill_at)
    if self.refill_rows is not None:
      self.refill_rows = _check_positive("refill_rows", self.refill_rows)
      if self.refill_rows > self.max_batch_size:
        raise ValueError(f"refill_rows: {self.refill_rows} is more than the "
                         f"{self.max_batch_size} slots (max_batch_size)")
    self.prefill_chunk = loop.check_prefill_chunk(self.prefill_chunk)
    if self.max_seq_len is not None:
      self.max_seq_len = _check_positive("max_seq_len", self.max_seq_len)
    if self.kv not in KV_FORMS:
      raise ValueError(f"kv: expected one of {KV_FORMS}, got {self.kv!r}")
    self.page_size = paging.check_page_size(self.page_size)
    if self.num_pages is not None:
      if self.kv != "paged":
        raise ValueError("num_pages: only a paged cache has a pool (pass kv='paged')")
      self.num_pages = _check_positive("num_pages", self.num_pages)
    check_models(self.target, self.draft, self.spec)
    loop.check_schedule(self.schedule, self.draft, self.spec)
    if self.trace:
      if not self.spec:
        raise ValueError("trace: only speculative decoding has rounds to trace (got spec=False)")
      gamma = self.draft.config.gamma
      if self.schedule is not None and jax.tree.leaves(self.schedule.init(1, gamma)):
        raise ValueError("trace: the queue traces only stateless schedules (a stateful one keys "
                         "its draft noise by the round counter the trace reuses)")

  def _slot_lengths(self, gamma: int) -> tuple[int, int]:
    """(cache slots, output buffer length) of a slot of `max_seq_len` tokens."""
    return (tm.cache_slots(self.max_seq_len + 2 * (gamma + 1)),
            bucket(self.max_seq_len, MIN_BUCKET) + gamma + 1)

  def warm_up(self, prompt_lengths: tuple[int, int], *, sampled: bool = False,
              stop_token_ids: Sequence[int] | np.ndarray = (), stop_sequences=(),
              compile_workers: int | None = None) -> int:
    """Compiles and runs once every refill program that prompts of LO..HI tokens can meet, and
    the chunk program, on throwaway prompts of one new token each.

    A later `generate` of prompts in that range (with the same stop arguments, whose shapes are
    the programs', and sampled rows or none as `sampled` says) then compiles nothing, and no
    program runs for the first time inside its clock: a first run pays one-time costs its
    compilation time leaves out (on a GPU, loading the kernels and capturing command buffers),
    which would otherwise land in the refills' seconds. A row resumed after a preemption
    (``kv="paged"``) carries its committed tokens, so its refill may meet a program of longer
    prompts, compiled when first met.

    Args:
      prompt_lengths: (LO, HI), 1 <= LO <= HI < `max_seq_len`.
      sampled: whether the later calls have sampled rows (temperature > 0): with speculative
        decoding, a batch of greedy rows only runs a chunk program of its own.
      stop_token_ids, stop_sequences: as the later calls pass them.
      compile_workers: threads compiling the refill programs side by side
        (`compile_cache.compiling_ahead`): each refill is first run only until its program is
        queued, then all run in turn, each waiting for its own program (the chunk program
        compiles meanwhile). None: one a CPU core, at most one a program; 1: one at a time.

    Returns:
      The number of refills run: one per program (`slots.warm_up_groups`).

    Raises:
      ValueError: `max_seq_len` or `refill_rows` unset (the programs' shapes then follow each
        call, or the count of prompts each refill takes), or a bad `prompt_lengths`.
    """
    for name in ("max_seq_len", "refill_rows"):
      if getattr(self, name) is None:
        raise ValueError(f"warm_up: {name} is None; the refill programs' shapes follow it, so "
                         f"set it to warm them up")
    try:
      low, high = (int(x) for x in prompt_lengths)
    except (TypeError, ValueError):
      raise ValueError(f"prompt_lengths: expected (LO, HI), got {prompt_lengths!r}") from None
    if not 1 <= low <= high < self.max_seq_len:
      raise ValueError(f"prompt_lengths: need 1 <= LO <= HI < max_seq_len={self.max_seq_len}, "
                       f"got ({low}, {high})")
    gamma = self.draft.config.gamma if self.spec else 0
    cache_len, _ = self._slot_lengths(gamma)
    packs = functools.lru_cache(maxsize=None)(
        lambda size: packing.packs(self.target.config, size))
    form = functools.partial(refill_form, rows=self.refill_rows, pack=self.pack_prompts,
                             packs=packs, cache_len=cache_len, chunk=self.prefill_chunk)
    groups = warm_up_groups(low, high, self.refill_rows, form)
    workers = (min(len(groups), os.cpu_count() or 1) if compile_workers is None
               else _check_positive("compile_workers", compile_workers))

    def run(lengths):
      params = sp.SamplingParams(temperature=np.full(len(lengths), float(sampled)))
      self.generate([np.ones(n, np.int32) for n in lengths], params, jax.random.key(0),
                    max_new_tokens=1, stop_token_ids=stop_token_ids,
                    stop_sequences=stop_sequences)

    if workers > 1:
      with compile_cache.compiling_ahead(workers):
        for lengths in groups:
          try:
            run(lengths)
          except compile_cache.Deferred:
            pass
    for lengths in groups:
      run(lengths)
    return len(groups)

  def _packed(self, target, padded, lens, index, saved, real: int, cache_len: int):
    """A refill's packed prompts (`slots._pack_prompts`), or None where it pads them instead
    (`pack_prompts`)."""
    if not self.pack_prompts:
      return None
    limit = packing.prompt_limit(index.size, self.prefill_chunk, cache_len)
    packed = _pack_prompts(padded, lens, index, saved, real, limit)
    return packed if packed is not None and packing.packs(target.config, packed[0].size) else None

  def _pool(self, slots_n: int, max_pages: int) -> int:
    """The pool's pages: `num_pages`, or what fits in free device memory less `headroom_bytes` and
    the decoding buffers (`LOGIT_BUFFERS` float32 [S, γ + 1, V]), at most S full slots."""
    if self.num_pages is not None:
      return self.num_pages
    most = slots_n * max_pages
    target = self.target.config
    per_token = page_alloc.token_bytes(target.num_layers, target.layer.num_kv_heads,
                                       target.layer.head_dim, np.dtype(target.dtype).itemsize)
    if self.spec:
      draft = self.draft
      per_token += page_alloc.token_bytes(len(draft.layers), draft.shape.num_kv_heads,
                                          draft.shape.head_dim,
                                          np.dtype(draft.config.dtype).itemsize)
    gamma = self.draft.config.gamma if self.spec else 0
    buffers = LOGIT_BUFFERS * slots_n * (gamma + 1) * target.vocab_size * 4
    try:
      fits = page_alloc.pool_pages(self.page_size * per_token, reserve_bytes=buffers,
                                   memory_stats=self.memory_stats,
                                   headroom_bytes=self.headroom_bytes)
    except ValueError:  # free memory unknown (e.g. the CPU): the contiguous caches' memory
      return most
    return int(min(fits, most))

  def generate(self, prompts, params: sp.SamplingParams, key: jax.Array, *,
               max_new_tokens: int | Sequence[int] = 32,
               stop_token_ids: Sequence[int] | np.ndarray = (), stop_sequences=(),
               progress: bool = False,
               on_finish: Callable[[PromptResult], Any] | None = None,
               drain: bool = True) -> QueueResult:
    """Decodes N prompts (any N >= 1) through the engine's S slots.

    Args:
      prompts, params, key, max_new_tokens, stop_token_ids, stop_sequences: as in `generate`, one
        row per prompt (N rows); each prompt's parameters, budget and stops follow it into
        whichever slot it lands in.
      progress: a tqdm progress bar over prompts.
      on_finish: called with each `PromptResult` as its prompt finishes (in finishing order).
      drain: True (default) runs until every prompt is done. False ends the run at the first
        boundary after the queue has emptied where a slot is free, i.e. when the slots stop being
        saturated: the prompts still decoding then are returned as they stand, with
        ``finish_reason="unfinished"`` (their tokens a prefix of a drained run's). For steady-state
        throughput measurements (`benchmarks/bench_serving.py`), not for serving.

    Returns:
      A `QueueResult`, prompts in input order.

    Raises:
      ValueError: as `generate`'s, and naming ``prompts`` and the first prompt too long for a slot
        (``max_seq_len``) or for the pool, or ``num_pages`` when the pool cannot hold one slot's
        capacity; RuntimeError: the device ran out of memory (naming S, the cache or pool size
        and what to lower).
    """
    target, draft, spec, schedule = self.target, self.draft, self.spec, self.schedule
    vocab = target.config.vocab_size
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) and not prompts:
      raise ValueError("prompts: the queue is empty; pass at least one prompt")
    padded, lens, budgets, stop_ids, stop_seqs = check_request(
        prompts, params, key, max_new_tokens, stop_token_ids, stop_sequences, vocab)
    count = len(lens)
    budgets = budgets.astype(np.int32)
    stop_ids = np.asarray(stop_ids, np.int32)
    slots_n = self.max_batch_size
    gamma = draft.config.gamma if spec else 0
    out_len = bucket(int(budgets.max()), MIN_BUCKET) + gamma + 1
    if self.max_seq_len is None:
      cache_len = tm.cache_slots(padded.shape[1] + out_len + gamma + 1)
    else:
      total = lens.astype(np.int64) + budgets
      bad = np.flatnonzero(total > self.max_seq_len)
      if bad.size:
        i = int(bad[0])
        raise ValueError(f"prompts: prompt {i} has {lens[i]} tokens and max_new_tokens "
                         f"{budgets[i]}, {total[i]} in all; a slot holds max_seq_len="
                         f"{self.max_seq_len}")
      cache_len, out_len = self._slot_lengths(gamma)
    pages = None
    if self.kv == "paged":
      pages = _Pages(self, slots_n, cache_len, gamma, lens)
    path, _ = _choose_path(spec, params, draft, slots_n, vocab, self.mode, self.memory_stats,
                           self.headroom_bytes, self.store_logits)
    if path == proposal.PATH_EAGER:
      raise ValueError(f"max_batch_size: the memory gate disables folded sampling at "
                       f"{slots_n} slots (the queue has no eager fallback); lower max_batch_size "
                       f"or pass mode='force'")
    rows = _row_arrays(params)
    all_inputs = {"max_new": budgets, "rows": rows, "stop_ids": stop_ids, "stop_seqs": stop_seqs}
    choice = None
    if spec:
      choice = choose_block_backend(draft, path, slots_n, vocab, store_logits=self.store_logits,
                                    backend=self.backend, config=self.config)
    target_def, target_state = nnx.split(target)
    draft_def, draft_state = (None, None) if not spec else nnx.split(draft)
    weights, weights_tree = jax.tree.flatten((target_state, draft_state))   # `slots._models`
    refill_statics = dict(weights_tree=weights_tree, target_def=target_def, draft_def=draft_def,
                          cache_len=cache_len, out_len=out_len, prefill_chunk=self.prefill_chunk)
    chunk_statics = dict(weights_tree=weights_tree, target_def=target_def, draft_def=draft_def,
                         path=path, store_logits=self.store_logits, backend=choice,
                         schedule=schedule, rounds_per_call=self.rounds_per_call)
    state = _empty_state(target, draft, schedule, slots_n, cache_len, out_len, all_inputs,
                         caches=pages is None, memo=self._shapes)
    if pages is not None:
      state.update(pages.empty_caches(target, draft if spec else None))
    if self.trace:
      state["trace"] = _trace_buffers(self.rounds_per_call, slots_n, gamma)
    inputs = jax.tree.map(lambda x: jnp.zeros((slots_n,) + x.shape[1:], x.dtype), all_inputs)
    inputs["stop_ids"] = inputs["stop_ids"] - 1
    inputs["stop_seqs"] = inputs["stop_seqs"] - 1
    key = jax.device_put(key)
    run = _Run(count, slots_n, gamma, progress, on_finish)
    queue = collections.deque(range(count))
    saved: dict[int, dict] = {}  # preempted prompts' row state, until they resume
    owner = np.full(slots_n, -1)
    light_keys = [k for k in state if k not in CACHE_KEYS and k not in GLOBAL_KEYS]
    programs = {}

    def program_for(local, fn, args, statics, donate):
      """`compile_cache.compiled`'s program, looked up once per run for each `local` key: within
      a run the models, statics and every other argument's shape follow from `local`, and
      `compiled`'s own key hashes the models' graphs (milliseconds at a 4B shape, per call)."""
      if local in programs:
        return programs[local], 0.0
      program, seconds = compile_cache.compiled(fn, args, statics, donate=donate)
      run.compile(seconds)
      programs[local] = program
      return program, seconds

    light = None
    try:
      while queue or (owner >= 0).any():
        if not drain and not queue and light is not None:
          break                                 # saturation ended (see `drain`)
        if pages is not None and light is not None:
          for slot, index in pages.grow(owner, light):  # preempted, newest first
            saved[index] = {k: light[k][slot] for k in light_keys}
            run.preempted[index] += 1
            queue.appendleft(index)
            owner[slot] = -1
        free = np.flatnonzero(owner < 0)[:len(queue)]
        if pages is not None and free.size:
          heads = [queue[i] for i in range(free.size)]
          free = free[:pages.admit(free, heads, lens, saved)]
          if not free.size and not (owner >= 0).any():  # excluded by `_Pages`' checks
            raise RuntimeError("num_pages: the pool admits no row with every slot empty")
        if free.size:
          taken = np.array([queue.popleft() for _ in free])
          owner[free] = taken
          size = self.refill_rows or bucket(taken.size)
          began, compiled, groups = time.perf_counter(), 0.0, []
          for start in range(0, taken.size, size):   # one refill, or refills of refill_rows
            rows, slots = taken[start:start + size], free[start:start + size]
            k = self.refill_rows or bucket(rows.size)
            index = np.concatenate([rows, np.full(k - rows.size, rows[0])])
            where = np.concatenate([slots, np.full(k - rows.size, slots_n)]).astype(np.int32)
            packed = self._packed(target, padded, lens, index, saved, rows.size, cache_len)
            if packed is None:
              group, group_lens = _group_prompts(padded, lens, index, saved, cache_len,
                                                 self.prefill_chunk)
            else:
              group, group_lens = packed
            resume = np.array([int(i) in saved for i in index])
            row_state = None
            if pages is not None:
              row_state = _saved_rows(index, saved, state, light_keys)
              state.update(pages.with_table(state))
            args = (weights, state, inputs, group, group_lens,
                    jax.tree.map(lambda x: x[index], all_inputs), where, key,
                    None if pages is None else pages.table(), row_state, resume)
            program, seconds = program_for(
                ("refill", group.shape, k, packed is not None, tuple(state)), _refill_program,
                args, dict(refill_statics, packed=packed is not None), (1, 2))
            compiled += seconds
            state, inputs = program(*args)          # queued: the next refill's host work overlaps
            groups.append((slots, rows, resume[:rows.size]))
          jax.block_until_ready(state["anchor"])    # one host round trip for the boundary's refills
          run.refilled(time.perf_counter() - began - compiled)
          for slots, rows, resumed in groups:
            run.admitted(slots, rows, resumed)
          for i in taken:
            saved.pop(int(i), None)
        if pages is not None:
          state.update(pages.with_table(state))
        # slots free now (the pool may have admitted no one into them) + those to wait for
        need = (int((owner < 0).sum()) + min(self.refill_at, len(queue)) if queue
                else slots_n + 1 if drain else int((owner < 0).sum()) + 1)
        queued = bool(queue)
        args = (weights, state, inputs, key, np.int32(need), owner < 0)
        program, _ = program_for(("chunk", tuple(state)), _chunk_program, args, chunk_statics,
                                 (1,))
        began = time.perf_counter()
        state, iterations, busy = program(*args)
        light = jax.device_get({k: state[k] for k in light_keys})
        run.chunk_seconds += time.perf_counter() - began
        run.ran(int(iterations), int(busy), None if pages is None else pages.in_use, queued)
        if self.trace:
          run.traced(jax.device_get(state["trace"]), int(iterations))
        for slot in np.flatnonzero((owner >= 0) & light["done"]):
          run.finished(int(owner[slot]), int(slot), light)
          owner[slot] = -1
          if pages is not None:
            pages.release(int(slot))
    except Exception as error:  # noqa: BLE001 - only out-of-memory errors are rewritten
      if not _is_out_of_memory(error):
        raise
      if pages is not None:
        raise RuntimeError(
            f"out of device memory with max_batch_size={slots_n} slots over a pool of "
            f"{pages.num_pages} pages of {pages.page_size} positions (kv='paged'); lower "
            f"num_pages (pool size) or max_batch_size (concurrency), or raise "
            f"headroom_bytes") from error
      raise RuntimeError(
          f"out of device memory with max_batch_size={slots_n} slots of {cache_len} cache "
          f"positions each (the longest prompt's bucket + max_new_tokens + 2(γ + 1)); lower "
          f"max_batch_size (concurrency), max_new_tokens or max_seq_len") from error
    finally:
      run.close()
    for slot in np.flatnonzero(owner >= 0):  # drain=False: the rows still decoding
      run.finished(int(owner[slot]), int(slot), light, reason="unfinished")
    return run.result(budgets, path, choice, slots_n, cache_len, pages)
