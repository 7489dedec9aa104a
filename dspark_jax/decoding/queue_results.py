"""What a queue-driven decode returns: one `PromptResult` per prompt and the run's `QueueResult`.

This module owns the results of `decoding.queue.Engine` and `_Run`, the host's bookkeeping that
builds them as prompts finish: clocks (compilation excluded), per-prompt counts read from the
slots' state, pages in use, traces, the progress bar and the ``on_finish`` callback.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from dspark_jax.decoding import loop

@dataclasses.dataclass
class PromptResult:
  """One prompt's outcome in a queue-driven decode.

  Attributes:
    index: the prompt's position in the input.
    tokens: [n] int32 generated tokens.
    finish_reason: "stop_token", "stop_sequence" or "length"; "unfinished" for a prompt still
      decoding when a run with ``drain=False`` ended (its tokens so far).
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
    rounds: loop iterations of all chunks; chunks: the chunk programs run (calls). slot_rounds:
      S × rounds; busy_slot_rounds: the (slot, iteration) pairs whose slot held an unfinished
      prompt.
    wall_seconds: the run (compilation excluded); compile_seconds: compilation in this call.
    refill_seconds: of the wall, the refills (prefills of admitted prompts, from a boundary's
      first launch until its last refill is done, the host's preparation of the later ones
      included: it overlaps the device's work); chunk_seconds: the chunks (from launch until the
      host holds their results). The rest of the wall is the host's own work between them
      (`host_seconds`). fill_seconds: of the refills, those before the first chunk (filling the
      empty slots: the start-up transient, which a queue in its steady state does not pay).
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
  refill_seconds: float = 0.0
  chunk_seconds: float = 0.0
  fill_seconds: float = 0.0
  chunks: int = 0

  @property
  def host_seconds(self) -> float:
    """The wall less the refills and chunks: the host's work between programs."""
    return max(self.wall_seconds - self.refill_seconds - self.chunk_seconds, 0.0)

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
    return np.array([r.finish_reason in ("stop_token", "stop_sequence") for r in self.results])

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


class _Run:
  """The host's bookkeeping of one queue-driven decode: clocks (compilation excluded), per-prompt
  results as they finish, the progress bar and the callback."""

  def __init__(self, count, slots_n, gamma, progress, on_finish):
    from tqdm.auto import tqdm

    self.count, self.slots_n, self.gamma, self.on_finish = count, slots_n, gamma, on_finish
    self.results: list[PromptResult | None] = [None] * count
    self.start = time.perf_counter()
    self.compile_seconds = 0.0
    self.refill_seconds = self.chunk_seconds = self.fill_seconds = 0.0
    self.admit_at = np.zeros(count)
    self.preempted = np.zeros(count, np.int64)
    self.first_at = np.zeros(count)
    self.rounds = self.busy = self.chunks = 0
    self.queued_rounds = self.queued_busy = 0
    self.pages_peak = self.page_rounds = 0
    self.traces: list[dict] = []
    self.bar = tqdm(total=count, desc="decode", disable=not progress)

  def now(self) -> float:
    return time.perf_counter() - self.start - self.compile_seconds

  def compile(self, seconds: float):
    self.compile_seconds += seconds

  def refilled(self, seconds: float):
    """A boundary's refills took `seconds`; before the first chunk they fill the empty slots."""
    self.refill_seconds += seconds
    if self.chunks == 0:
      self.fill_seconds += seconds

  def admitted(self, slots, prompts, resumed):
    """`prompts` took `slots`; a `resumed` one (preempted before) keeps its first times."""
    now = self.now()
    self.first_at[prompts[~resumed]] = now
    self.admit_at[prompts[~resumed]] = now

  def ran(self, iterations: int, busy: int, pages: int | None, queued: bool):
    """A chunk ran `iterations` with `busy` busy slot-iterations and `pages` pages in use, having
    started with prompts waiting (`queued`) or not."""
    self.rounds += iterations
    self.chunks += 1
    self.busy += busy
    if queued:
      self.queued_rounds += iterations
      self.queued_busy += busy
    if pages is not None:
      self.pages_peak = max(self.pages_peak, pages)
      self.page_rounds += pages * iterations

  def traced(self, trace, iterations: int):
    self.traces.append({k: np.asarray(v)[:iterations] for k, v in trace.items()})

  def finished(self, index: int, slot: int, light, reason: str | None = None):
    """Prompt `index` in `slot` ended (`reason`: as read from `light`, or "unfinished")."""
    n = int(light["count"][slot])
    stop_index = int(light["stop_index"][slot]) if "stop_index" in light else -1
    reason = reason or ("stop_sequence" if stop_index >= 0 else
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
        refill_seconds=self.refill_seconds, chunk_seconds=self.chunk_seconds,
        fill_seconds=self.fill_seconds, chunks=self.chunks,
        trace=loop.RoundTrace(**{k: np.concatenate([t[k] for t in self.traces])
                                 for k in self.traces[0]}) if self.traces else None)
