"""`generate`: the front that decodes a fixed batch or hands the prompts to the queue.

This module owns `generate` and the fixed batch: with ``max_batch_size`` the prompts go to the
queue (`decoding.queue.Engine`); without, one batch of every prompt runs here, checked and padded
by `decoding.requests` (batch, prompt length and ``max_new_tokens`` rounded up to powers of two,
stop sequences to [B, S, L] powers of two), its path and backend chosen there too, its program
compiled once per process (`decoding.compile_cache`), its `DecodeOutput` turned into the
`GenerateResult`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from dspark_jax.decoding import compile_cache
from dspark_jax.decoding import loop
from dspark_jax.decoding import packing
from dspark_jax.decoding import queue
from dspark_jax.decoding import stops
from dspark_jax.decoding.requests import (MIN_BUCKET, _choose_path, bucket, check_models,
                                          check_request, choose_block_backend)
from dspark_jax.decoding.rounds import PREFILL_CHUNK, _row_arrays
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.kernels import dispatch
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax.sampling import params as sp


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
             prefill_chunk: int | None = PREFILL_CHUNK,
             pack_prompts: bool = True) -> GenerateResult:
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
    pack_prompts: prefill the prompts packed one after another into one pass, each attending to
      itself only (`TargetModel.packed_prefill`), so the prefill's work follows their tokens
      rather than B times the longest; where the packed attention does not run
      (`kernels.attention.choose_segments`), the prompts would pass `packing.prompt_limit`
      tokens, or the models are placed on a mesh, they are right-padded and prefilled in passes
      of `prefill_chunk` instead. The same tokens either way (up to rounding).

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
    paging = {name: value for name, value in
              (("kv", kv), ("num_pages", num_pages), ("page_size", page_size)) if value is not None}
    engine = queue.Engine(target, draft, max_batch_size, max_seq_len=max_seq_len, spec=spec,
                          schedule=schedule, mode=mode, memory_stats=memory_stats,
                          headroom_bytes=headroom_bytes, store_logits=store_logits,
                          backend=backend, config=config, trace=bool(trace),
                          prefill_chunk=prefill_chunk, pack_prompts=pack_prompts, **paging)
    return engine.generate(prompts, params, key, max_new_tokens=max_new_tokens,
                           stop_token_ids=stop_token_ids, stop_sequences=stop_sequences,
                           progress=progress, on_finish=on_finish)
  for name, value in (("max_seq_len", max_seq_len), ("progress", progress or None),
                      ("on_finish", on_finish), ("kv", kv), ("num_pages", num_pages),
                      ("page_size", page_size)):
    if value is not None:
      raise ValueError(f"{name}: only the queue-driven decode takes it (pass max_batch_size)")
  return _fixed_batch(target, draft, prompts, params, key, max_new_tokens=max_new_tokens,
                      stop_token_ids=stop_token_ids, spec=spec, mode=mode,
                      memory_stats=memory_stats, headroom_bytes=headroom_bytes,
                      store_logits=store_logits, backend=backend, config=config,
                      stop_sequences=stop_sequences, schedule=schedule, trace=trace,
                      prefill_chunk=prefill_chunk, pack_prompts=pack_prompts)


def _fixed_batch(target, draft, prompts, params, key, *, max_new_tokens, stop_token_ids, spec,
                 mode, memory_stats, headroom_bytes, store_logits, backend, config,
                 stop_sequences, schedule, trace, prefill_chunk,
                 pack_prompts=True) -> GenerateResult:
  """`generate` without `max_batch_size`: every prompt in one batch (its arguments), prefilled
  packed where `pack_prompts` and the packed attention allow (`packing.packs`), else padded."""
  vocab = target.config.vocab_size
  check_models(target, draft, spec)
  prompt, prompt_lens, max_new, stop_ids, stop_seqs = check_request(
      prompts, params, key, max_new_tokens, stop_token_ids, stop_sequences, vocab)
  batch = prompt.shape[0]
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
  packed = None
  if pack_prompts and target.plan is None:   # rows sharded over a mesh stay padded
    each = [prompt[i, :n] for i, n in enumerate(prompt_lens)] + [prompt[:1, 0]] * extra
    packed = packing.pack_prompts(each, packing.prompt_limit(padded_batch, prefill_chunk,
                                                             cache_len))
    if packed is not None and packing.packs(target.config, packed[0].size):
      args = (packed[0],) + args[1:]
    else:
      packed = None
  args = jax.device_put(args)
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = (None, None) if not spec else nnx.split(draft)

  choice = None
  if path in (proposal.PATH_FOLDED_GREEDY, proposal.PATH_FOLDED_SAMPLING):
    choice = choose_block_backend(draft, path, padded_batch, vocab, store_logits=store_logits,
                                  backend=backend, config=config)
  compile_seconds = 0.0
  start = time.perf_counter()
  if path == proposal.PATH_EAGER:
    out = loop._run_eager(target_state, draft_state, args, target_def=target_def,
                          draft_def=draft_def, kind=draft.head.kind, cache_len=cache_len,
                          out_len=out_len, store_logits=store_logits, schedule=schedule,
                          trace=trace, prefill_chunk=prefill_chunk, packed=packed is not None)
  else:
    statics = dict(target_def=target_def, draft_def=draft_def, path=path, cache_len=cache_len,
                   out_len=out_len, store_logits=store_logits, backend=choice,
                   schedule=schedule, trace=trace, prefill_chunk=prefill_chunk,
                   packed=packed is not None)
    program, compile_seconds = compile_cache.compiled(
        loop._decode_program, (target_state, draft_state, *args), statics)
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
