"""The queue-driven decode (continuous batching): S slots that take the next prompt as rows finish.

This module owns `Engine` (and `dj.generate(..., max_batch_size=S)`, which calls it): any number
of prompts decoded through S static slots, results in prompt order (`QueueResult`, one
`PromptResult` per prompt).

**Programs.** Two compiled programs, both from `host.compiled`'s cache:

* the *refill* (`_refill_program`): prefills K new prompts (right-padded to a length bucket T, K a
  power of two up to S, so one program per (K, T) bucket and never one per prompt length; a group
  with a prompt over ``prefill_chunk`` positions is padded to the slot's capacity and prefilled in
  passes of that many, so all such groups of K rows share one program) with the same
  `rounds._prefill` as `generate`, and writes their rows into the chosen slots (`SlotCaches`
  for the caches, a scatter for every other per-row array: tokens, counts, flags, per-row sampling
  parameters, budgets, stop ids and sequences);
* the *chunk* (`_chunk_program`): a `lax.while_loop` of the usual iterations (`loop.iteration`)
  that runs until ``rounds_per_call`` iterations have run, every slot is idle, or at least
  ``need`` slots are free (``need`` = min(``refill_at``, prompts still queued); with the queue
  empty it never stops for a free slot).

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
`SlotCaches.admit`. Paged (``kv="paged"``): the target's and the draft's context pools share one
block table, owned by the host's `paging.allocator.PageAllocator` (`_Pages`) and passed in at each
boundary. Policy (docs/serving.md): release finished rows' pages; grow every running row to its
length + `allocator.lookahead(rounds_per_call, γ)`, preempting the newest rows when the pool is
short (their row state kept on the host, re-queued at the head); admit queued rows first come
first served while pages allow. A preempted row's refill recomputes its caches from its prompt and
committed tokens and restores its saved state, so it continues with the tokens it would have
decoded (same keys, same positions).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax import verification
from dspark_jax.decoding import host
from dspark_jax.decoding import loop
from dspark_jax.decoding import stops
from dspark_jax.decoding.rounds import PREFILL_CHUNK, _prefill, _row_arrays
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.paging import allocator as page_alloc
from dspark_jax.paging import cache as paging
from dspark_jax.sampling import params as sp

GLOBAL_KEYS = ("rounds", "reached", "accepted", "schedule", "trace")
"""Loop-state entries shared by the batch; every other entry is per row (leading axis S)."""
CACHE_KEYS = ("cache", "context")
"""Loop-state entries that are caches, written only through `SlotCaches`."""


class SlotCaches:
  """How a slot's caches are written when it takes a new prompt.

  `admit(cache, fresh, slots, table)` returns the state's cache with the K prefilled rows' caches
  `fresh` (from `rounds._prefill`) in slots `slots` ([K] int32; entries >= S are padding and
  dropped):

  * contiguous caches (pytrees of [S, ...] arrays, a slot one row): a scatter of whole rows, so
    nothing of the slot's previous prompt is left;
  * paged caches (`paging.cache.PagedKV`): the prefill already wrote the rows into the shared
    pools through their slots' table rows (`paged_rows`), so `fresh` holds the whole pools; the
    result is those pools with the host's full block table `table` ([S, max_pages]).
  """

  @staticmethod
  def admit(cache, fresh, slots, table=None):
    if isinstance(cache, paging.PagedKV):
      return dataclasses.replace(fresh, table=table)
    return jax.tree.map(lambda old, new: old.at[slots].set(new.astype(old.dtype), mode="drop"),
                        cache, fresh)

  @staticmethod
  def paged_rows(cache, table, slots):
    """`cache` (a `PagedKV`) with the table rows of `slots` ([K]; entries >= S get no pages), the
    cache a K-row prefill writes through."""
    count = table.shape[0]
    mine = table[jnp.minimum(slots, count - 1)]
    mine = jnp.where((slots < count)[:, None], mine, paging.UNALLOCATED)
    return dataclasses.replace(cache, table=mine)


@dataclasses.dataclass
class PromptResult:
  """One prompt's outcome in a queue-driven decode.

  Attributes:
    index: the prompt's position in the input.
    tokens: [n] int32 generated tokens.
    finish_reason: "stop_token", "stop_sequence" or "length".
    stop_index: the matched stop sequence's index, -1 otherwise.
    rounds: iterations the prompt was active (speculative rounds; 0 for the baseline).
    accepted_drafts: drafts accepted over those rounds.
    verified: tokens verified over those rounds, anchors included.
    reached, accepted: [γ] int the per-position counts behind `acceptance` (empty for the baseline).
    ttft_seconds: from the start of the run (compilation excluded) until its first token was on
      the device (its prefill finished), queueing included.
    seconds: from its admission into a slot until the host saw it finished.
    slot: the slot it ran in (the last one, if it was preempted).
    preempted: times it was preempted for pages (paged caches) and recomputed.
  """

  index: int
  tokens: np.ndarray
  finish_reason: str
  stop_index: int
  rounds: int
  accepted_drafts: int
  verified: int
  reached: np.ndarray
  accepted: np.ndarray
  ttft_seconds: float
  seconds: float
  slot: int
  preempted: int = 0

  @property
  def tau(self) -> float:
    """Mean tokens per round (accepted drafts + bonus); 1 for the baseline or without rounds."""
    return 1.0 + self.accepted_drafts / max(self.rounds, 1)

  @property
  def acceptance(self) -> np.ndarray:
    """[γ] P(draft k accepted | drafts 1..k-1 accepted) over the prompt's rounds (NaN unreached)."""
    return np.where(self.reached > 0, self.accepted / np.maximum(self.reached, 1), np.nan)

  @property
  def tokens_per_second(self) -> float:
    return self.tokens.size / max(self.seconds, 1e-12)

  def as_dict(self) -> dict:
    """JSON-ready fields (NaN acceptance as None)."""
    return {"index": self.index, "tokens": [int(t) for t in self.tokens],
            "finish_reason": self.finish_reason, "stop_index": self.stop_index,
            "rounds": self.rounds, "accepted_drafts": self.accepted_drafts,
            "verified": self.verified, "reached": [int(x) for x in self.reached],
            "accepted": [int(x) for x in self.accepted], "tau": self.tau,
            "ttft_seconds": self.ttft_seconds, "seconds": self.seconds, "slot": self.slot,
            "preempted": self.preempted,
            "tokens_per_second": self.tokens_per_second}


@dataclasses.dataclass
class QueueResult:
  """The outcome of a queue-driven decode: per-prompt results in prompt order, and run statistics.

  The array fields mirror `GenerateResult`'s (one row per prompt), so pooling code reads both.

  Attributes:
    results: one `PromptResult` per prompt, in prompt order.
    tokens: [N, max budget] int32, -1 after each prompt's end. lengths: [N].
    rounds: loop iterations of all chunks. slot_rounds: S × rounds; busy_slot_rounds: the
      (slot, iteration) pairs whose slot held an unfinished prompt.
    wall_seconds: the run (compilation excluded); compile_seconds: compilation in this call.
    path, backend: as in `GenerateResult`. max_batch_size: S. cache_len: positions per slot's
      cache (with paged caches: the capacity before rounding to whole pages).
    kv: "contiguous" or "paged". num_pages, page_size: the pool (None for contiguous caches).
    pages_peak, pages_mean: pages in use, the most and the mean over loop iterations (0 for
      contiguous caches). preemptions: rows preempted for pages and recomputed later.
    queued_rounds, queued_busy_slot_rounds: the iterations of chunks that started with prompts
      still waiting in the queue, and their busy slot-iterations (`saturated_rows`).
    trace: with ``Engine(trace=True)``, a `loop.RoundTrace` of NumPy arrays whose batch axis is the
      S slots (not the prompts) and whose rounds are every iteration run, in order ([rounds, S, γ]);
      an idle slot is inactive. Else None.
  """

  results: list[PromptResult]
  tokens: np.ndarray
  lengths: np.ndarray
  rounds: int
  slot_rounds: int
  busy_slot_rounds: int
  wall_seconds: float
  compile_seconds: float
  path: str
  backend: Any
  max_batch_size: int
  cache_len: int
  kv: str = "contiguous"
  num_pages: int | None = None
  page_size: int | None = None
  pages_peak: int = 0
  pages_mean: float = 0.0
  preemptions: int = 0
  queued_rounds: int = 0
  queued_busy_slot_rounds: int = 0
  trace: Any = None

  @property
  def occupancy(self) -> float:
    """Busy slot-iterations over all slot-iterations (1 when nothing ran)."""
    return self.busy_slot_rounds / self.slot_rounds if self.slot_rounds else 1.0

  @property
  def saturated_rows(self) -> float:
    """The mean busy slots over the iterations run while prompts waited (NaN if none did): how
    many rows run at once when the queue is not the limit (with paged caches, what the free pages
    admit). The drain at the end, with fewer prompts left than slots, is not counted."""
    return (self.queued_busy_slot_rounds / self.queued_rounds if self.queued_rounds
            else float("nan"))

  @property
  def tokens_per_second(self) -> float:
    return float(self.lengths.sum()) / max(self.wall_seconds, 1e-12)

  @property
  def finish_reason(self) -> list[str]:
    return [r.finish_reason for r in self.results]

  @property
  def finished(self) -> np.ndarray:
    return np.array([r.finish_reason != "length" for r in self.results])

  @property
  def stop_index(self) -> np.ndarray:
    return np.array([r.stop_index for r in self.results], np.int64)

  @property
  def row_rounds(self) -> np.ndarray:
    return np.array([r.rounds for r in self.results], np.int64)

  @property
  def row_accepted(self) -> np.ndarray:
    return np.array([r.accepted_drafts for r in self.results], np.int64)

  @property
  def row_verified(self) -> np.ndarray:
    return np.array([r.verified for r in self.results], np.int64)

  @property
  def reached(self) -> np.ndarray:
    return np.sum([r.reached for r in self.results], axis=0).astype(np.int64)

  @property
  def accepted(self) -> np.ndarray:
    return np.sum([r.accepted for r in self.results], axis=0).astype(np.int64)

  @property
  def tau(self) -> float:
    return 1.0 + float(self.row_accepted.sum()) / max(float(self.row_rounds.sum()), 1.0)

  @property
  def acceptance(self) -> np.ndarray:
    reached = self.reached
    return np.where(reached > 0, self.accepted / np.maximum(reached, 1), np.nan)

  @property
  def verify_tokens(self) -> float:
    rounds = float(self.row_rounds.sum())
    return float(self.row_verified.sum()) / rounds if rounds else 1.0


# ---- the compiled programs ------------------------------------------------------------------------


def _admit(state, inputs, fresh, new_inputs, slots, table=None):
  """The state and per-row inputs with the K prefilled rows `fresh`/`new_inputs` written into
  `slots`; per-row entries `fresh` lacks (counts a prefill does not start) become zeros."""
  out = dict(state)
  for name, value in state.items():
    if name in GLOBAL_KEYS:
      continue
    if name in CACHE_KEYS:
      out[name] = SlotCaches.admit(value, fresh[name], slots, table)
      continue
    new = fresh.get(name)
    if new is None:
      new = jnp.zeros((slots.shape[0],) + value.shape[1:], value.dtype)
    out[name] = value.at[slots].set(new.astype(value.dtype), mode="drop")
  inputs = jax.tree.map(lambda old, new: old.at[slots].set(new.astype(old.dtype), mode="drop"),
                        inputs, new_inputs)
  return out, inputs


def _refill_program(target_state, draft_state, state, inputs, prompt, prompt_lens, new_inputs,
                    slots, key, table, saved, resume, *, target_def, draft_def, cache_len, out_len,
                    prefill_chunk):
  """Prefills K prompts ([K, T]) and admits them into `slots` (module docstring).

  Paged caches (`table`: the host's [S, max_pages] block table, else None): the prefill writes
  through the slots' table rows. `saved` (per-row state entries, [K, ...] each, or None) and
  `resume` ([K] bool): a resumed row (a preempted one, `prompt` its prompt and committed tokens
  but the last) takes its saved state instead of the prefill's; only its caches are recomputed.
  """
  target = nnx.merge(target_def, target_state)
  draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
  caches = {}
  if table is not None:
    caches = {name: SlotCaches.paged_rows(state[name], table, slots)
              for name in CACHE_KEYS if name in state}
  fresh = _prefill(target, draft, prompt, prompt_lens, new_inputs["max_new"], new_inputs["rows"],
                   new_inputs["stop_ids"], key, cache_len, out_len, new_inputs["stop_seqs"],
                   cache=caches.get("cache"), context=caches.get("context"), chunk=prefill_chunk)
  if saved is not None:
    fresh = dict(fresh)
    for name, value in saved.items():
      base = fresh.get(name, jnp.zeros(value.shape, value.dtype))
      mask = resume.reshape(resume.shape + (1,) * (value.ndim - 1))
      fresh[name] = jnp.where(mask, value.astype(base.dtype), base)
  return _admit(state, inputs, fresh, new_inputs, slots, table)


def _chunk_program(target_state, draft_state, state, inputs, key, need, idle, *, target_def,
                   draft_def, path, store_logits, backend, schedule, rounds_per_call):
  """Up to `rounds_per_call` iterations; stops early once every slot is done or `need` are.
  Slots `idle` ([S] bool: holding no prompt, e.g. one just preempted) are done.

  With a ``trace`` entry in `state` (`Engine.trace`: buffers of ``rounds_per_call`` rounds), the
  chunk's iteration i is recorded at index i: the round counter runs from 0 inside the chunk and is
  restored to the global count after it (it keys nothing else without a stateful schedule).

  Returns ``(state, iterations run, busy slot-iterations)``."""
  state = dict(state, done=state["done"] | idle)
  traced = "trace" in state
  start = state["rounds"]
  if traced:
    state = dict(state, rounds=jnp.zeros_like(start))
  target = nnx.merge(target_def, target_state)
  draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
  body = loop.iteration(target, draft, path, inputs["max_new"], inputs["rows"], inputs["stop_ids"],
                        inputs["stop_seqs"], key, store_logits=store_logits, backend=backend,
                        schedule=schedule)

  def more(carry):
    state, i, _ = carry
    done = state["done"]
    return (i < rounds_per_call) & jnp.any(~done) & (jnp.sum(done, dtype=jnp.int32) < need)

  def step(carry):
    state, i, busy = carry
    return body(state), i + 1, busy + jnp.sum(~state["done"], dtype=jnp.int32)

  state, i, busy = jax.lax.while_loop(more, step, (state, jnp.int32(0), jnp.int32(0)))
  if traced:
    state = dict(state, rounds=start + i)
  return state, i, busy


# ---- the engine -----------------------------------------------------------------------------------


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
      holds fewer prompts); larger values refill in bigger groups, less often.
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
    prefill_chunk: prompt positions per prefill pass (as in `generate`); a refill whose longest
      prompt is longer is padded to the slot's capacity, so such refills share one program per K.
  """

  target: tm.TargetModel
  draft: dm.DSparkDraft | None
  max_batch_size: int
  max_seq_len: int | None = None
  spec: bool = True
  schedule: Any = None
  rounds_per_call: int = 16
  refill_at: int = 1
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

  def __post_init__(self):
    self.max_batch_size = _check_positive("max_batch_size", self.max_batch_size)
    self.rounds_per_call = _check_positive("rounds_per_call", self.rounds_per_call)
    self.refill_at = _check_positive("refill_at", self.refill_at)
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
    if self.spec:
      if self.draft is None:
        raise ValueError("draft: required for speculative decoding (pass spec=False for the "
                         "baseline)")
      self.draft.config.check_against(self.target.config)
      host.check_pair(self.target, self.draft)
    loop.check_schedule(self.schedule, self.draft, self.spec)
    if self.trace:
      if not self.spec:
        raise ValueError("trace: only speculative decoding has rounds to trace (got spec=False)")
      gamma = self.draft.config.gamma
      if self.schedule is not None and jax.tree.leaves(self.schedule.init(1, gamma)):
        raise ValueError("trace: the queue traces only stateless schedules (a stateful one keys "
                         "its draft noise by the round counter the trace reuses)")

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
               on_finish: Callable[[PromptResult], Any] | None = None) -> QueueResult:
    """Decodes N prompts (any N >= 1) through the engine's S slots.

    Args:
      prompts, params, key, max_new_tokens, stop_token_ids, stop_sequences: as in `generate`, one
        row per prompt (N rows); each prompt's parameters, budget and stops follow it into
        whichever slot it lands in.
      progress: a tqdm progress bar over prompts.
      on_finish: called with each `PromptResult` as its prompt finishes (in finishing order).

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
    padded, lens = host._prepare_prompts(prompts, vocab)
    count = len(lens)
    if not isinstance(params, sp.SamplingParams):
      raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
    if params.batch_size != count:
      raise ValueError(f"params: has {params.batch_size} rows but there are {count} prompts")
    budgets = host._check_budgets(max_new_tokens, count).astype(np.int32)
    validation.check_key("key", key)
    stop_ids = np.asarray(verification.stop_id_array(stop_token_ids, count, vocab), np.int32)
    stop_seqs = stops.stop_sequence_array(stop_sequences, count, vocab)
    slots_n = self.max_batch_size
    gamma = draft.config.gamma if spec else 0
    out_len = host.bucket(int(budgets.max()), host.MIN_BUCKET) + gamma + 1
    margin = 2 * (gamma + 1)
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
      cache_len = tm.cache_slots(self.max_seq_len + margin)
      out_len = host.bucket(self.max_seq_len, host.MIN_BUCKET) + gamma + 1
    pages = None
    if self.kv == "paged":
      pages = _Pages(self, slots_n, cache_len, gamma, lens)
    path, _ = host._choose_path(spec, params, draft, slots_n, vocab, self.mode,
                                self.memory_stats, self.headroom_bytes, self.store_logits)
    if path == proposal.PATH_EAGER:
      raise ValueError(f"max_batch_size: the memory gate disables folded sampling at "
                       f"{slots_n} slots (the queue has no eager fallback); lower max_batch_size "
                       f"or pass mode='force'")
    rows = _row_arrays(params)
    all_inputs = {"max_new": budgets, "rows": rows, "stop_ids": stop_ids, "stop_seqs": stop_seqs}
    choice = None
    if spec:
      choice = proposal.choose_backend(
          draft.head.arrays(),
          jax.ShapeDtypeStruct((slots_n, gamma, vocab), draft.config.dtype),
          kind=draft.head.kind, greedy_only=path == proposal.PATH_FOLDED_GREEDY,
          store_logits=self.store_logits, confidence=draft.confidence is not None,
          backend=self.backend, config=self.config)
    target_def, target_state = nnx.split(target)
    draft_def, draft_state = (None, None) if not spec else nnx.split(draft)
    models = (target_state, draft_state)
    refill_statics = dict(target_def=target_def, draft_def=draft_def, cache_len=cache_len,
                          out_len=out_len, prefill_chunk=self.prefill_chunk)
    chunk_statics = dict(target_def=target_def, draft_def=draft_def, path=path,
                         store_logits=self.store_logits, backend=choice, schedule=schedule,
                         rounds_per_call=self.rounds_per_call)
    state = _empty_state(target, draft, schedule, slots_n, cache_len, out_len, all_inputs)
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
    light = None
    try:
      while queue or (owner >= 0).any():
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
          k = host.bucket(taken.size)
          index = np.concatenate([taken, np.full(k - taken.size, taken[0])])
          where = np.concatenate([free, np.full(k - taken.size, slots_n)]).astype(np.int32)
          group, group_lens = _group_prompts(padded, lens, index, saved, cache_len,
                                             self.prefill_chunk)
          resume = np.array([int(i) in saved for i in index])
          row_state = None
          if pages is not None:
            row_state = _saved_rows(index, saved, state, light_keys)
            state.update(pages.with_table(state))
          args = (*models, state, inputs, group, group_lens,
                  jax.tree.map(lambda x: x[index], all_inputs), where, key,
                  None if pages is None else pages.table(), row_state, resume)
          program, seconds = host.compiled(_refill_program, args, refill_statics, donate=(2, 3))
          run.compile(seconds)
          state, inputs = program(*args)
          jax.block_until_ready(state["anchor"])
          run.admitted(free, taken, resume[:taken.size])
          for i in taken:
            saved.pop(int(i), None)
        if pages is not None:
          state.update(pages.with_table(state))
        # slots free now (the pool may have admitted no one into them) + those to wait for
        need = (int((owner < 0).sum()) + min(self.refill_at, len(queue)) if queue
                else slots_n + 1)
        queued = bool(queue)
        args = (*models, state, inputs, key, np.int32(need), owner < 0)
        program, seconds = host.compiled(_chunk_program, args, chunk_statics, donate=(2,))
        run.compile(seconds)
        state, iterations, busy = program(*args)
        light = jax.device_get({k: state[k] for k in light_keys})
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
    return run.result(budgets, path, choice, slots_n, cache_len, pages)


def _group_prompts(padded, lens, index, saved, cache_len, chunk=None):
  """The [K, T] tokens and [K] lengths a refill prefills: each prompt, or for a resumed one its
  prompt and committed tokens but the last (its anchor), right-padded to a length bucket T; to
  `cache_len` when the longest is over `chunk` (a chunked prefill's passes follow the longest row,
  so the padding costs nothing and every such refill of K rows is one program)."""
  rows, row_lens = [], []
  for i in (int(i) for i in index):
    tokens = padded[i, :lens[i]]
    if i in saved:
      count = int(saved[i]["count"])
      tokens = np.concatenate([tokens, np.asarray(saved[i]["out"][:count - 1], np.int32)])
    rows.append(tokens)
    row_lens.append(tokens.size)
  width = min(host.bucket(max(row_lens), host.MIN_BUCKET), cache_len)
  if chunk is not None and max(row_lens) > chunk:
    width = cache_len
  group = np.zeros((len(rows), width), np.int32)
  for r, tokens in enumerate(rows):
    group[r, :tokens.size] = tokens
  return group, np.asarray(row_lens, lens.dtype)


def _saved_rows(index, saved, state, light_keys):
  """[K, ...] per-row state entries of the refill's rows: a resumed row's saved state, zeros for
  a new one (the refill keeps the prefill's values there)."""
  out = {}
  for name in light_keys:
    value = state[name]
    rows = np.zeros((index.size,) + value.shape[1:], value.dtype)
    for r, i in enumerate(int(i) for i in index):
      if i in saved:
        rows[r] = saved[i][name]
    out[name] = rows
  return out


class _Pages:
  """The host side of a paged queue: the pool's `PageAllocator`, admission by free pages, growth
  before each chunk with preemption of the newest rows, and the pages-in-use statistics."""

  def __init__(self, engine: Engine, slots_n: int, cache_len: int, gamma: int, lens):
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


def _trace_buffers(rounds, slots_n, gamma):
  """Zeroed `loop.RoundTrace` buffers (a dict) of `rounds` iterations over S slots."""
  return {"confidence": jnp.full((rounds, slots_n, gamma), jnp.nan, jnp.float32),
          "verify_lens": jnp.zeros((rounds, slots_n), jnp.int32),
          "accept_len": jnp.zeros((rounds, slots_n), jnp.int32),
          "active": jnp.zeros((rounds, slots_n), bool)}


def _empty_state(target, draft, schedule, slots_n, cache_len, out_len, all_inputs):
  """The loop state of S idle slots: every per-row entry zeroed and ``done``; the global entries
  fresh (the schedule's `init` on S rows)."""
  one = jax.tree.map(lambda x: x[:1].repeat(slots_n, 0), all_inputs)

  def shapes():
    prompt = jnp.zeros((slots_n, host.MIN_BUCKET), jnp.int32)
    lens = jnp.ones((slots_n,), jnp.int32)
    return _prefill(target, draft, prompt, lens, one["max_new"], one["rows"], one["stop_ids"],
                    jax.random.key(0), cache_len, out_len, one["stop_seqs"])

  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(shapes))
  state["done"] = jnp.ones((slots_n,), bool)
  if draft is not None:
    gamma = draft.config.gamma
    state["row_reached"] = jnp.zeros((slots_n, gamma), jnp.int32)
    state["row_hits"] = jnp.zeros((slots_n, gamma), jnp.int32)
    if schedule is not None:
      state["schedule"] = schedule.init(slots_n, gamma)
      state["row_verified"] = jnp.zeros((slots_n,), jnp.int32)
  return state


class _Run:
  """The host's bookkeeping of one queue-driven decode: clocks (compilation excluded), per-prompt
  results as they finish, the progress bar and the callback."""

  def __init__(self, count, slots_n, gamma, progress, on_finish):
    from tqdm.auto import tqdm

    self.count, self.slots_n, self.gamma, self.on_finish = count, slots_n, gamma, on_finish
    self.results: list[PromptResult | None] = [None] * count
    self.start = time.perf_counter()
    self.compile_seconds = 0.0
    self.admit_at = np.zeros(count)
    self.preempted = np.zeros(count, np.int64)
    self.first_at = np.zeros(count)
    self.rounds = self.busy = 0
    self.queued_rounds = self.queued_busy = 0
    self.pages_peak = self.page_rounds = 0
    self.traces: list[dict] = []
    self.bar = tqdm(total=count, desc="decode", disable=not progress)

  def now(self) -> float:
    return time.perf_counter() - self.start - self.compile_seconds

  def compile(self, seconds: float):
    self.compile_seconds += seconds

  def admitted(self, slots, prompts, resumed):
    """`prompts` took `slots`; a `resumed` one (preempted before) keeps its first times."""
    now = self.now()
    self.first_at[prompts[~resumed]] = now
    self.admit_at[prompts[~resumed]] = now

  def ran(self, iterations: int, busy: int, pages: int | None, queued: bool):
    """A chunk ran `iterations` with `busy` busy slot-iterations and `pages` pages in use, having
    started with prompts waiting (`queued`) or not."""
    self.rounds += iterations
    self.busy += busy
    if queued:
      self.queued_rounds += iterations
      self.queued_busy += busy
    if pages is not None:
      self.pages_peak = max(self.pages_peak, pages)
      self.page_rounds += pages * iterations

  def traced(self, trace, iterations: int):
    self.traces.append({k: np.asarray(v)[:iterations] for k, v in trace.items()})

  def finished(self, index: int, slot: int, light):
    n = int(light["count"][slot])
    stop_index = int(light["stop_index"][slot]) if "stop_index" in light else -1
    reason = ("stop_sequence" if stop_index >= 0 else
              "stop_token" if light["finished"][slot] else "length")
    rounds = int(light["row_rounds"][slot]) if "row_rounds" in light else 0
    verified = (int(light["row_verified"][slot]) if "row_verified" in light
                else (self.gamma + 1) * rounds)
    per_position = lambda name: (np.asarray(light[name][slot], np.int64) if name in light
                                 else np.zeros((self.gamma,), np.int64))
    result = PromptResult(
        index=index, tokens=np.asarray(light["out"][slot, :n], np.int32), finish_reason=reason,
        stop_index=stop_index, rounds=rounds,
        accepted_drafts=int(light["row_accepted"][slot]) if "row_accepted" in light else 0,
        verified=verified,
        reached=per_position("row_reached"), accepted=per_position("row_hits"),
        ttft_seconds=float(self.first_at[index]), seconds=self.now() - self.admit_at[index],
        slot=slot, preempted=int(self.preempted[index]))
    self.results[index] = result
    self.bar.update(1)
    if self.on_finish is not None:
      self.on_finish(result)

  def close(self):
    self.bar.close()

  def result(self, budgets, path, choice, slots_n, cache_len, pages) -> QueueResult:
    width = int(budgets.max())
    tokens = np.full((self.count, width), -1, np.int32)
    for r in self.results:
      tokens[r.index, :r.tokens.size] = r.tokens
    return QueueResult(
        results=self.results, tokens=tokens,
        lengths=np.array([r.tokens.size for r in self.results], np.int32), rounds=self.rounds,
        slot_rounds=self.rounds * slots_n, busy_slot_rounds=self.busy,
        wall_seconds=self.now(), compile_seconds=self.compile_seconds,
        path=path, backend=choice,
        max_batch_size=slots_n, cache_len=cache_len,
        kv="contiguous" if pages is None else "paged",
        num_pages=None if pages is None else pages.num_pages,
        page_size=None if pages is None else pages.page_size,
        pages_peak=self.pages_peak,
        pages_mean=self.page_rounds / self.rounds if self.rounds else 0.0,
        preemptions=0 if pages is None else pages.preemptions,
        queued_rounds=self.queued_rounds, queued_busy_slot_rounds=self.queued_busy,
        trace=loop.RoundTrace(**{k: np.concatenate([t[k] for t in self.traces])
                                 for k in self.traces[0]}) if self.traces else None)
