"""`generate`: the checked host wrapper around the compiled loop, and its compile cache.

This module owns what happens on the host around a decode: checking and padding the prompts
(right-padded to a length bucket), budgets and stop tokens; routing (docs/memory_gate.md: an
all-greedy batch runs the greedy-only variant; a batch with sampled rows runs the folded sampling
variant if the memory gate allows it, else the eager fallback); compiling each bucket's program
ahead of time once per process (`_COMPILED`: batch, prompt length and ``max_new_tokens`` rounded up
to powers of two, stop sequences to [B, S, L] powers of two, so calls in the same buckets never
recompile; a schedule is part of the key by identity: reuse the object; `compiled`); and the
`GenerateResult`. With ``max_batch_size`` it hands the prompts to the queue (`decoding.queue`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax import verification
from dspark_jax.decoding import loop
from dspark_jax.decoding import stops
from dspark_jax.decoding.rounds import PATH_AUTOREGRESSIVE, PREFILL_CHUNK, _row_arrays
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.kernels import dispatch
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax.sampling import params as sp

MIN_BUCKET = 8


@dataclasses.dataclass
class GenerateResult:
  """The outcome of `generate`.

  Attributes:
    tokens: [B, max_new_tokens] int32 generated tokens, -1 after each row's end.
    lengths: [B] number of generated tokens per row.
    finished: [B] bool, the row ended on a stop token or a stop sequence.
    rounds: loop iterations (speculative rounds, or autoregressive steps) after the prefill.
    tau: mean tokens per round per active row, accepted drafts + bonus (τ); 1 for the baseline.
    acceptance: [γ] conditional acceptance: P(draft k accepted | drafts 1..k-1 accepted), over active
      rows and rounds; NaN where no round reached draft k (empty for the baseline).
    reached, accepted: [γ] int counts behind `acceptance`: how many (row, round) pairs reached
      draft k (drafts 1..k-1 accepted), and how many of those accepted it (empty for the baseline).
    row_rounds, row_accepted: [B] int: rounds each row was active, and drafts it accepted over
      them (zeros for the baseline); row b's τ is ``1 + row_accepted[b] / row_rounds[b]``. Counts,
      so that calls can be pooled and error bars computed.
    path: "folded-sampling", "folded-greedy", "eager" or "autoregressive".
    wall_seconds: execution time of the decode (compilation excluded; includes the final sync).
    compile_seconds: time spent compiling in this call (0 when every program was cached).
    backend: the `dispatch.Choice` that drafted the blocks of a folded path (None otherwise).
    finish_reason: per row, "stop_token", "stop_sequence" or "length" (the budget ran out).
    stop_index: [B] int the index of the matched sequence in the row's stop-sequence list (the
      shared list, or the row's own), -1 otherwise.
    verify_tokens: mean tokens verified per round per active row, anchor included (γ + 1 without a
      schedule; 1 for the baseline). row_verified: [B] int the counts behind it, summed over each
      row's rounds (zeros for the baseline): ``verify_tokens = row_verified.sum() /
      row_rounds.sum()``.
    trace: with ``trace=True``, a `loop.RoundTrace` of NumPy arrays cut to the rounds run:
      confidence [rounds, B, γ], verify_lens, accept_len, active [rounds, B]; else None.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  finished: np.ndarray
  rounds: int
  tau: float
  acceptance: np.ndarray
  path: str
  wall_seconds: float
  compile_seconds: float
  backend: dispatch.Choice | None = None
  reached: np.ndarray | None = None
  accepted: np.ndarray | None = None
  row_rounds: np.ndarray | None = None
  row_accepted: np.ndarray | None = None
  finish_reason: list[str] | None = None
  stop_index: np.ndarray | None = None
  verify_tokens: float = 1.0
  row_verified: np.ndarray | None = None
  trace: loop.RoundTrace | None = None

  @property
  def tokens_per_second(self) -> float:
    return float(self.lengths.sum()) / max(self.wall_seconds, 1e-12)


def bucket(n: int, minimum: int = 1) -> int:
  """The padding bucket of `n`: the smallest power of two >= max(n, minimum)."""
  size = 1
  while size < max(n, minimum):
    size *= 2
  return size

_COMPILED: dict[tuple, Any] = {}
"""Compiled decode programs of this process, keyed by everything that fixes their shape."""


def compiled(fn, args: tuple, statics: dict, donate: tuple[int, ...] = ()) -> tuple[Any, float]:
  """`fn` compiled ahead of time for `args`' shapes and dtypes and the `statics` keywords, from
  `_COMPILED` when it holds that program; and the seconds spent compiling it here (0 when cached).
  `donate`: positions of arguments whose buffers the program may reuse for its outputs."""
  shapes = jax.tree.map(lambda x: (np.shape(x), str(getattr(x, "dtype", type(x)))), args)
  signature = (getattr(fn, "__qualname__", repr(fn)), str(jax.tree_util.tree_structure(shapes)),
               str(jax.tree.leaves(shapes)), tuple(statics.items()), donate)
  program = _COMPILED.get(signature)
  if program is not None:
    return program, 0.0
  start = time.perf_counter()
  program = jax.jit(fn, static_argnames=tuple(statics), donate_argnums=donate).lower(
      *args, **statics).compile()
  _COMPILED[signature] = program
  return program, time.perf_counter() - start


def compiled_programs() -> int:
  """How many decode programs this process has compiled (for compile guards)."""
  return len(_COMPILED)


def _prepare_prompts(prompts, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
    rows = [np.asarray(p) for p in np.asarray(prompts)]
  elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
    rows = [np.asarray(p) for p in prompts]
  else:
    raise ValueError("prompts: expected a sequence of token-id sequences or a [B, T] array")
  if not rows:
    raise ValueError("prompts: empty batch")
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size == 0:
      raise ValueError(f"prompts: row {i} must be a non-empty 1-D token sequence, got shape "
                       f"{row.shape}")
    if row.dtype.kind not in "iu":
      raise ValueError(f"prompts: row {i} has dtype {row.dtype}; expected integer token ids")
    bad = (row < 0) | (row >= vocab)
    if bad.any():
      j = int(np.flatnonzero(bad)[0])
      raise ValueError(f"prompts: row {i} token {j} is {row[j]}; must be in [0, {vocab})")
  lens = np.array([r.size for r in rows], np.int32)
  padded = np.zeros((len(rows), bucket(int(lens.max()), MIN_BUCKET)), np.int32)
  for i, row in enumerate(rows):
    padded[i, :row.size] = row
  return padded, lens


def _check_budgets(max_new_tokens, batch: int) -> np.ndarray:
  """[B] int64 budgets from an int or B ints in [0, 2**31), or ValueError naming the first bad one."""
  budgets = np.asarray(max_new_tokens)
  if budgets.dtype.kind not in "iu":
    raise ValueError(f"max_new_tokens: expected an int or {batch} ints, got {max_new_tokens!r}")
  if budgets.ndim > 1 or (budgets.ndim == 1 and budgets.shape[0] != batch):
    raise ValueError(f"max_new_tokens: expected an int or {batch} ints (one per prompt), got "
                     f"shape {budgets.shape}")
  budgets = np.broadcast_to(budgets.astype(np.int64), (batch,))
  validation.check_range("max_new_tokens", budgets, 0, validation.POSITION_LIMIT,
                         what="must be in [0, 2**31)")
  return budgets


def check_pair(target: tm.TargetModel, draft: dm.DSparkDraft) -> None:
  """Raises ValueError unless the draft's real weights fit the target's: the vocabulary of its
  head and the width of its context projection (configs can agree while the arrays do not)."""
  vocab, hidden = target.embed.embedding.shape
  if draft.head.vocab_size != vocab:
    raise ValueError(f"draft: its head has a vocabulary of {draft.head.vocab_size}, the target's "
                     f"embedding {vocab}")
  features = len(draft.config.target_layer_ids) * hidden
  kernel = tuple(draft.fc.kernel.shape)
  if kernel != (features, hidden):
    raise ValueError(f"draft: its context projection fc is {list(kernel)}; the target (hidden size "
                     f"{hidden}, {len(draft.config.target_layer_ids)} feature layers) needs "
                     f"{[features, hidden]}")


def _choose_path(spec, params, draft, batch, vocab, mode, memory_stats, headroom_bytes,
                 store_logits=True):
  if not spec:
    return PATH_AUTOREGRESSIVE, None
  if params.all_greedy():
    return proposal.PATH_FOLDED_GREEDY, None
  mode = memory_gate.resolve_mode(mode)
  need = memory_gate.sampling_need_bytes(batch, vocab, draft.config.gamma, draft.config.dtype,
                                         store_logits=store_logits, rank=draft.head.rank)
  free, source = memory_gate.probe_free_bytes(memory_stats)
  enabled, reason = memory_gate.decide(mode, need, free, headroom_bytes, source)
  if not enabled and mode is memory_gate.FoldedSampling.AUTO:
    memory_gate.logger.warning("dspark_jax: folded sampling disabled; %s", reason)
  return (proposal.PATH_FOLDED_SAMPLING if enabled else proposal.PATH_EAGER), reason


def generate(target: tm.TargetModel, draft: dm.DSparkDraft | None, prompts, params: sp.SamplingParams,
             key: jax.Array, *, max_new_tokens: int | Sequence[int] = 32,
             stop_token_ids: Sequence[int] | np.ndarray = (), spec: bool = True,
             mode: memory_gate.FoldedSampling | str | None = None, memory_stats=None,
             headroom_bytes: int = memory_gate.DEFAULT_HEADROOM_BYTES,
             store_logits: bool = True, backend: str | None = None, config=None,
             stop_sequences=(), schedule=None, trace: bool = False,
             max_batch_size: int | None = None, max_seq_len: int | None = None,
             progress: bool = False, on_finish=None, kv: str | None = None,
             num_pages: int | None = None, page_size: int | None = None,
             prefill_chunk: int | None = PREFILL_CHUNK) -> GenerateResult:
  """Decodes a batch of prompts speculatively with a DSpark draft (or autoregressively).

  Args:
    target: the target model.
    draft: the DSpark draft (its config must match the target); may be None when ``spec=False``.
    prompts: B token-id sequences of any lengths >= 1, or a [B, T] integer array.
    params: `SamplingParams` with B rows (greedy and sampled rows may mix).
    key: base PRNG key.
    max_new_tokens: per-row budget (an int, or B ints >= 0).
    stop_token_ids: shared stop ids, or per row as a [B, S] array padded with -1.
    stop_sequences: token-id sequences shared by every row (``[[13, 7], [2]]``), or per row (a list
      of B lists of sequences), or a [B, S, L] array -1 padded (`stops.stop_sequence_array`). A row
      finishes when its generated tokens end with one of its sequences (matches may span rounds and
      start at the first generated token, never in the prompt); nothing after the match is kept.
    spec: speculative decoding (default) or the autoregressive baseline.
    mode, memory_stats, headroom_bytes: the memory gate for the folded sampling variant
      (`memory_gate`; used only when the batch has sampled rows).
    store_logits: False drafts sampled rows without storing their corrected logits
      (`proposal.CompactLogits`: each token's log q; the verifier recomputes the one row it needs).
      The same tokens, fewer bytes per round at large batches.
    backend, config: what computes the folded draft blocks ("auto", "xla", "triton", "hopper";
      None reads ``$DSPARK_JAX_BACKEND``) and its settings (`dspark_jax.kernels.dispatch`).
    schedule: a `Schedule` (``dspark_jax.scheduling.schedules``) choosing each round's verify length
      per row from the block's confidence, inside the loop; None verifies γ + 1 (``fixed()``'s
      decisions). Part of the compile key by identity: reuse the object across calls. The verify
      forward keeps its [B, γ + 1] shape (`rounds`): fewer tokens verified, not a cheaper forward.
    trace: record per-round confidence, verify lengths, accepted runs and activity
      (`GenerateResult.trace`; with `max_batch_size`, per slot and iteration: `queue.Engine.trace`).
    max_batch_size: S: decode any number of prompts through S slots, each taking the next prompt
      as its row finishes (`queue.Engine`); returns a `queue.QueueResult`. None (default): one
      fixed batch of all prompts.
    max_seq_len, progress, on_finish: with `max_batch_size` only: tokens a slot holds (None: sized
      from the prompts and budgets), a tqdm bar, a callback given each `queue.PromptResult` as its
      prompt finishes (`queue.Engine`).
    kv, num_pages, page_size: with `max_batch_size` only: the slots' caches, "contiguous" (None:
      the default) or "paged", and the paged pool's pages and page size (`queue.Engine`).
    prefill_chunk: prompt positions per prefill pass: a longer prompt is prefilled in passes of
      this many, each attending to the cache written so far, so its activation memory follows the
      chunk, not the prompt (`loop.decode`). None: the whole prompt in one pass.

  Returns:
    A `GenerateResult` (with `max_batch_size`: a `queue.QueueResult`, the same array fields plus
    per-prompt results and occupancy); ``result.backend`` says which backend drafted and why.

  Raises:
    ValueError: bad prompts (naming the row and token), a draft that does not fit the target, a
      missing draft, params or budgets of the wrong size, bad stop sequences (naming
      ``stop_sequences`` and the element), a schedule that reads the confidence with a draft that
      has no confidence head, or a schedule or trace with ``spec=False``.
  """
  if max_batch_size is not None:
    if not isinstance(trace, (bool, np.bool_)):
      raise ValueError(f"trace: expected a bool, got {trace!r}")
    from dspark_jax.decoding import queue  # the queue builds on this module
    paging = {name: value for name, value in
              (("kv", kv), ("num_pages", num_pages), ("page_size", page_size)) if value is not None}
    engine = queue.Engine(target, draft, max_batch_size, max_seq_len=max_seq_len, spec=spec,
                          schedule=schedule, mode=mode, memory_stats=memory_stats,
                          headroom_bytes=headroom_bytes, store_logits=store_logits,
                          backend=backend, config=config, trace=bool(trace),
                          prefill_chunk=prefill_chunk, **paging)
    return engine.generate(prompts, params, key, max_new_tokens=max_new_tokens,
                           stop_token_ids=stop_token_ids, stop_sequences=stop_sequences,
                           progress=progress, on_finish=on_finish)
  for name, value in (("max_seq_len", max_seq_len), ("progress", progress or None),
                      ("on_finish", on_finish), ("kv", kv), ("num_pages", num_pages),
                      ("page_size", page_size)):
    if value is not None:
      raise ValueError(f"{name}: only the queue-driven decode takes it (pass max_batch_size)")
  vocab = target.config.vocab_size
  if spec:
    if draft is None:
      raise ValueError("draft: required for speculative decoding (pass spec=False for the baseline)")
    draft.config.check_against(target.config)
    check_pair(target, draft)
  prompt, prompt_lens = _prepare_prompts(prompts, vocab)
  batch = prompt.shape[0]
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != batch:
    raise ValueError(f"params: has {params.batch_size} rows but there are {batch} prompts")
  max_new = _check_budgets(max_new_tokens, batch)
  validation.check_key("key", key)
  stop_ids = verification.stop_id_array(stop_token_ids, batch, vocab)
  stop_seqs = stops.stop_sequence_array(stop_sequences, batch, vocab)
  loop.check_schedule(schedule, draft, spec)
  if not isinstance(trace, (bool, np.bool_)):
    raise ValueError(f"trace: expected a bool, got {trace!r}")
  if trace and not spec:
    raise ValueError("trace: only speculative decoding has rounds to trace (got spec=False)")
  trace = bool(trace)
  prefill_chunk = loop.check_prefill_chunk(prefill_chunk)

  padded_batch = bucket(batch)
  path, _ = _choose_path(spec, params, draft, padded_batch, vocab, mode, memory_stats,
                         headroom_bytes, store_logits)
  gamma = draft.config.gamma if spec else 0
  out_len = bucket(int(max_new.max()), MIN_BUCKET) + gamma + 1
  cache_len = tm.cache_slots(prompt.shape[1] + out_len + gamma + 1)
  extra = padded_batch - batch
  args = (np.pad(prompt, ((0, extra), (0, 0))),
          np.concatenate([prompt_lens, np.ones(extra, np.int32)]),
          np.concatenate([max_new.astype(np.int32), np.zeros(extra, np.int32)]),
          _row_arrays(params.padded(padded_batch)),
          np.pad(stop_ids, ((0, extra), (0, 0)), constant_values=-1),
          np.pad(stop_seqs, ((0, extra), (0, 0), (0, 0)), constant_values=-1), key)
  args = jax.device_put(args)
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = (None, None) if not spec else nnx.split(draft)

  choice = None
  if path in (proposal.PATH_FOLDED_GREEDY, proposal.PATH_FOLDED_SAMPLING):
    choice = proposal.choose_backend(
        draft.head.arrays(),
        jax.ShapeDtypeStruct((padded_batch, gamma, vocab), draft.config.dtype),
        kind=draft.head.kind, greedy_only=path == proposal.PATH_FOLDED_GREEDY,
        store_logits=store_logits, confidence=draft.confidence is not None, backend=backend,
        config=config)
  compile_seconds = 0.0
  start = time.perf_counter()
  if path == proposal.PATH_EAGER:
    out = loop._run_eager(target_state, draft_state, args, target_def=target_def,
                          draft_def=draft_def, kind=draft.head.kind, cache_len=cache_len,
                          out_len=out_len, store_logits=store_logits, schedule=schedule,
                          trace=trace, prefill_chunk=prefill_chunk)
  else:
    statics = dict(target_def=target_def, draft_def=draft_def, path=path, cache_len=cache_len,
                   out_len=out_len, store_logits=store_logits, backend=choice,
                   schedule=schedule, trace=trace, prefill_chunk=prefill_chunk)
    program, compile_seconds = compiled(loop._decode_program, (target_state, draft_state, *args),
                                        statics)
    start += compile_seconds
    out = program(target_state, draft_state, *args)
  out = jax.device_get(placement.to_host(out))   # dp rows on other hosts: gathered
  wall = time.perf_counter() - start
  return _result(out, batch, int(max_new.max()), spec, path, wall, compile_seconds, choice)


def _result(out: loop.DecodeOutput, batch: int, width: int, spec: bool, path: str, wall: float,
            compile_seconds: float, choice) -> GenerateResult:
  """The `GenerateResult` of a decode's host `DecodeOutput` (padding rows dropped)."""
  rounds = int(out.rounds)
  tokens = np.asarray(out.tokens)[:batch, :width if batch else 0]
  lengths = np.asarray(out.lengths)[:batch]
  trace = None
  if spec:
    row_rounds = np.asarray(out.row_rounds)[:batch].astype(np.int64)
    row_accepted = np.asarray(out.row_accepted)[:batch].astype(np.int64)
    row_verified = np.asarray(out.row_verified)[:batch].astype(np.int64)
    tau = 1.0 + float(row_accepted.sum()) / max(float(row_rounds.sum()), 1.0)
    verify_tokens = float(row_verified.sum()) / max(float(row_rounds.sum()), 1.0)
    reached = np.asarray(out.reached).astype(np.int64)
    accepted = np.asarray(out.accepted).astype(np.int64)
    acceptance = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
    if out.trace is not None:
      trace = jax.tree.map(lambda x: np.asarray(x)[:rounds, :batch], out.trace)
  else:
    tau, verify_tokens, acceptance = 1.0, 1.0, np.zeros((0,))
    reached = accepted = np.zeros((0,), np.int64)
    row_rounds = row_accepted = row_verified = np.zeros((batch,), np.int64)
  return GenerateResult(tokens=tokens.astype(np.int32), lengths=lengths,
                        finished=np.asarray(out.finished)[:batch], rounds=rounds,
                        tau=tau, acceptance=acceptance, path=path, wall_seconds=wall,
                        compile_seconds=compile_seconds, backend=choice, reached=reached,
                        accepted=accepted, row_rounds=row_rounds, row_accepted=row_accepted,
                        finish_reason=stops.finish_reasons(np.asarray(out.finish_reason)[:batch]),
                        stop_index=np.asarray(out.stop_index)[:batch], verify_tokens=verify_tokens,
                        row_verified=row_verified, trace=trace)
