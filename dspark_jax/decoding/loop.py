"""The compiled decoding loop: the program `generate` compiles, `decode`, and the eager fallback.

This module owns the whole decode as one program (`_decode_program`: prefill, then a
`lax.while_loop` of speculative rounds or autoregressive steps from `rounds`, then the
`DecodeOutput`), its unwrapped pure form `decode` (arrays in, a `DecodeOutput` pytree out, for the
user's own ``jit``/``vmap``), the check of a verify-length schedule (`check_schedule`), and the eager
fallback `_run_eager`, which drives the same round from Python (one host sync per round, the block
sampled step by step by `proposal.eager_block`) when the memory gate disables folded sampling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct
from jax.extend import core as jax_core

from dspark_jax import validation
from dspark_jax.decoding import stops
from dspark_jax.decoding.rounds import (PATH_AUTOREGRESSIVE, PREFILL_CHUNK, _after_proposal,
                                        _autoregressive_step, _draft_forward, _draft_inputs,
                                        _finish, _prefill, _row_arrays, _speculative_round,
                                        draft_key)
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import pallas_block
from dspark_jax.models import draft as dm
from dspark_jax.models import layout
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp


@struct.dataclass
class RoundTrace:
  """Per-round records of a speculative decode (``trace=True``), for calibration and error bars.

  R is the loop's round limit (the output width): rounds at and after `DecodeOutput.rounds` were not
  run (``active`` False there). Rounds whose ``verify_lens`` is γ + 1 verified every position; their
  ``accept_len`` is the label of `scheduling.calibration.fit_sts`.

  Attributes:
    confidence: [R, B, γ] float32 the block's conditional confidences (NaN without a confidence head).
    verify_lens: [R, B] int32 tokens verified per row, anchor included (0 where inactive).
    accept_len: [R, B] int32 drafts accepted (capped at verify_lens - 1, before stops; 0 where
      inactive).
    active: [R, B] bool, the row was still decoding in that round.
  """

  confidence: jax.Array
  verify_lens: jax.Array
  accept_len: jax.Array
  active: jax.Array


@struct.dataclass
class DecodeOutput:
  """What `decode` returns: arrays only (a pytree), so it passes through ``jit`` and ``vmap``.

  Attributes:
    tokens: [B, max_new_tokens] int32 generated tokens, -1 after each row's end.
    lengths: [B] int32 generated tokens per row.
    finished: [B] bool, ended on a stop token or a stop sequence.
    rounds: int32 loop iterations after the prefill.
    reached, accepted: [γ] int32 counts: (row, round) pairs that reached draft k, and of those,
      how many accepted it (zeros for the autoregressive loop, whose γ is 0).
    row_rounds, row_accepted: [B] int32 rounds each row was active and drafts it accepted.
    finish_reason: [B] int32 `stops.FINISH_LENGTH` (0), `FINISH_STOP_TOKEN` (1) or
      `FINISH_STOP_SEQUENCE` (2).
    stop_index: [B] int32 the index of the row's matched stop sequence, -1 otherwise.
    row_verified: [B] int32 tokens verified over each row's rounds, anchors included (zeros for the
      autoregressive loop).
    trace: a `RoundTrace` with ``trace=True``, else None.
  """

  tokens: jax.Array
  lengths: jax.Array
  finished: jax.Array
  rounds: jax.Array
  reached: jax.Array
  accepted: jax.Array
  row_rounds: jax.Array
  row_accepted: jax.Array
  finish_reason: jax.Array
  stop_index: jax.Array
  row_verified: jax.Array
  trace: RoundTrace | None = None


def _as_output(state, gamma: int) -> DecodeOutput:
  """The `DecodeOutput` of a finished loop state (tokens at the full output width)."""
  batch = state["count"].shape[0]
  zeros_g, zeros_b = jnp.zeros((gamma,), jnp.int32), jnp.zeros((batch,), jnp.int32)
  row_rounds = state.get("row_rounds", zeros_b)
  stop_index = state.get("stop_index")
  trace = state.get("trace")
  return DecodeOutput(
      tokens=state["out"], lengths=state["count"].astype(jnp.int32),
      finished=state["finished"], rounds=state["rounds"],
      reached=state.get("reached", zeros_g), accepted=state.get("accepted", zeros_g),
      row_rounds=row_rounds, row_accepted=state.get("row_accepted", zeros_b),
      finish_reason=stops.finish_codes(state["finished"], stop_index),
      stop_index=jnp.full((batch,), -1, jnp.int32) if stop_index is None else stop_index,
      row_verified=state.get("row_verified", (gamma + 1) * row_rounds if gamma else zeros_b),
      trace=None if trace is None else RoundTrace(**trace))


def _decode_program(target_state, draft_state, prompt, prompt_lens, max_new, rows, stop_ids,
                    stop_seqs, key, *, target_def, draft_def, path, cache_len, out_len,
                    store_logits=True, backend=None, schedule=None, trace=False,
                    prefill_chunk=PREFILL_CHUNK, packed=False):
  """The whole decode as one program: prefill, then a `lax.while_loop` of rounds or steps.
  `packed`: `prompt` is the prompts packed into [N] tokens (`rounds._prefill`)."""
  target = nnx.merge(target_def, target_state)
  draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
  state = _prefill(target, draft, prompt, prompt_lens, max_new, rows, stop_ids, key, cache_len,
                   out_len, stop_seqs, schedule, trace, chunk=prefill_chunk, packed=packed)
  body = iteration(target, draft, path, max_new, rows, stop_ids, stop_seqs, key,
                   store_logits=store_logits, backend=backend, schedule=schedule)
  limit = out_len  # every iteration commits at least one token per active row
  state = jax.lax.while_loop(lambda s: jnp.any(~s["done"]) & (s["rounds"] < limit), body, state)
  return _as_output(_finish(state, out_len), 0 if draft is None else draft.config.gamma)


def iteration(target, draft, path, max_new, rows, stop_ids, stop_seqs, key, *, store_logits=True,
              backend=None, schedule=None):
  """One loop iteration as ``state -> state`` (a speculative round, or an autoregressive step on
  `PATH_AUTOREGRESSIVE`) for the per-row inputs given; the carry keeps its dtypes (under x64 some
  sums and index arithmetic would widen them). Call it inside the program that runs the loop."""
  if path == PATH_AUTOREGRESSIVE:
    step = functools.partial(_autoregressive_step, target, stop_seqs=stop_seqs)
  else:
    # Where the Hopper kernels run they read W2 part by part: prepared once here, outside the loop.
    head = pallas_block.head_arrays_for(draft.head.arrays(), [backend])
    step = functools.partial(_speculative_round, target, draft,
                             greedy_only=path == proposal.PATH_FOLDED_GREEDY,
                             store_logits=store_logits, head=head, backend=backend,
                             stop_seqs=stop_seqs, schedule=schedule)
  return lambda s: jax.tree.map(lambda new, old: new.astype(old.dtype),
                                step(s, max_new, rows, stop_ids, key), s)


# ---- schedules ------------------------------------------------------------------------------------


def _reads_first_input(closed: jax_core.ClosedJaxpr) -> bool:
  """Whether any output of `closed` depends on its first input (backward liveness; an equation
  with any live output, or with effects, reads all its inputs)."""
  jaxpr = closed.jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, jax_core.Literal))
  return jaxpr.invars[0] in live


def check_schedule(schedule, draft: dm.DSparkDraft | None, spec: bool) -> None:
  """Raises ValueError naming ``schedule`` unless it can run in this decode: a `Schedule`
  (``init``, ``update``), speculative decoding, and, when its verify lengths or state depend on the
  confidence (traced once on a one-row batch), a draft with a confidence head."""
  if schedule is None:
    return
  init, update = getattr(schedule, "init", None), getattr(schedule, "update", None)
  if not (callable(init) and callable(update)):
    raise ValueError(f"schedule: expected a Schedule(init, update) from "
                     f"dspark_jax.scheduling.schedules, got {type(schedule).__name__}")
  if not spec:
    raise ValueError("schedule: only speculative decoding verifies blocks (got spec=False)")
  check_schedule_contract(schedule, draft.config.gamma)
  if draft.confidence is None:
    gamma = draft.config.gamma
    closed = jax.make_jaxpr(update)(jnp.zeros((1, gamma), jnp.float32), jnp.ones((1,), bool),
                                    init(1, gamma))
    if _reads_first_input(closed):
      raise ValueError("schedule: reads the draft's confidence, but the draft has no confidence "
                       "head; use schedule=None (or schedules.fixed()) or a draft with one")


_CONTRACT = ("init(batch_size, gamma) -> state, and update(confidence [B, γ] float32, active [B] "
             "bool, state) -> (verify_lens [B] int, state of the same structure, shapes and dtypes)")


def check_schedule_contract(schedule, gamma: int, batch: int = 2) -> None:
  """Raises ValueError naming ``schedule.init`` or ``schedule.update`` unless, traced on a `batch`-row
  batch (no values computed), they keep `_CONTRACT`."""
  try:
    state = schedule.init(batch, gamma)
  except Exception as error:  # a user's function: any failure is a broken contract
    raise ValueError(f"schedule.init: init({batch}, {gamma}) raised {type(error).__name__}: {error}; "
                     f"a schedule must be {_CONTRACT}") from error
  try:
    out = jax.eval_shape(schedule.update, jax.ShapeDtypeStruct((batch, gamma), jnp.float32),
                         jax.ShapeDtypeStruct((batch,), jnp.bool_), state)
  except Exception as error:  # a user's function: any failure is a broken contract
    raise ValueError(f"schedule.update: raised {type(error).__name__} on a {batch}-row batch: "
                     f"{error}; a schedule must be {_CONTRACT}") from error
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise ValueError(f"schedule.update: returned {type(out).__name__}"
                     f"{'' if not isinstance(out, (tuple, list)) else f' of {len(out)}'}, not "
                     f"(verify_lens, state); a schedule must be {_CONTRACT}")
  lens, new_state = out
  if getattr(lens, "shape", None) != (batch,) or not jnp.issubdtype(lens.dtype, jnp.integer):
    raise ValueError(f"schedule.update: verify_lens has shape {getattr(lens, 'shape', None)} and "
                     f"dtype {getattr(lens, 'dtype', None)} for a {batch}-row batch; expected "
                     f"[{batch}] integers (one verify length per row)")
  before = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), state)
  after = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), new_state)
  if jax.tree.structure(before) != jax.tree.structure(after) or before != after:
    raise ValueError(f"schedule.update: the state it returns ({after}) differs from init's "
                     f"({before}) in structure, shape or dtype; a schedule must be {_CONTRACT}")


# ---- the compiled loop as a pure function ---------------------------------------------------------


def decode(target: tm.TargetModel, draft: dm.DSparkDraft | None, prompt: jax.Array,
           prompt_lens: jax.Array, params: sp.SamplingParams, key: jax.Array, *,
           max_new_tokens: int, budgets: jax.Array | None = None,
           stop_token_ids: jax.Array | None = None, stop_sequences: jax.Array | None = None,
           spec: bool = True, greedy_only: bool = False, store_logits: bool = True, backend=None,
           config=None, schedule=None, trace: bool = False,
           prefill_chunk: int | None = PREFILL_CHUNK) -> DecodeOutput:
  """The whole decode as a pure function of arrays: the program `generate` compiles, unwrapped.

  Call it under your own ``jax.jit`` (the models may be closed over or passed through
  ``nnx.split``/``nnx.merge``), ``jax.vmap`` it over keys or seeds, or call it from a training step.
  It does no host work: no padding, no memory gate, no checks of values (shapes are checked when
  traced; `generate` is the convenient, checked wrapper).

  Args:
    target, draft: the models (`draft` may be None when ``spec=False``).
    prompt: [B, T] int token ids, right-padded (any padding ids in [0, V)).
    prompt_lens: [B] int lengths in 1..T.
    params: `SamplingParams` with B rows (concrete or traced values).
    key: base PRNG key.
    max_new_tokens: static, the output width: at most this many tokens per row.
    budgets: optional [B] int per-row budgets in 0..max_new_tokens (default: max_new_tokens).
    stop_token_ids: optional [B, S] int stop ids per row, -1 padded (default: none).
    stop_sequences: optional [B, S, L] int stop sequences per row, each left-aligned and -1 padded
      after its last id, an all -1 slot unused (`stops.stop_sequence_array` builds it; default none).
    spec: static: speculative decoding with `draft` (True) or the autoregressive loop.
    greedy_only: static: the folded greedy-only variant; every row must then be greedy (values are
      not checked here). Otherwise the folded sampling variant, for any mix of rows.
    store_logits: static: the sampling variant stores its corrected logits (False: `CompactLogits`).
    backend, config: static: the draft block's backend (`dspark_jax.kernels.dispatch`).
    schedule: static: a `Schedule` choosing each round's verify lengths from the block's confidence
      (``dspark_jax.scheduling.schedules``); None verifies γ + 1 tokens per row (`rounds`).
    trace: static: record per-round arrays (`RoundTrace`; speculative decoding only).
    prefill_chunk: static: prompt positions per prefill pass; a longer prompt is prefilled in
      passes of this many, each attending to the cache written so far (activation memory follows
      the chunk, not T). None: the whole prompt in one pass.

  Static, so a change compiles a new program: `max_new_tokens`, `spec`, `greedy_only`,
  `store_logits`, `backend`, `config`, `schedule` (by identity), `trace`, `prefill_chunk`, and
  every shape (B, T, S, L). Everything else may be traced.

  Returns:
    A `DecodeOutput`.

  Raises:
    ValueError: a missing draft; a schedule or trace without speculative decoding; a schedule that
      reads the confidence with a draft that has none.
  """
  batch, prompt_len = np.shape(prompt)
  validation.check_key("key", key)
  max_new_tokens = validation.check_nonnegative_int("max_new_tokens", max_new_tokens)
  prefill_chunk = check_prefill_chunk(prefill_chunk)
  if spec and draft is None:
    raise ValueError("draft: required for speculative decoding (pass spec=False for the loop)")
  check_schedule(schedule, draft, spec)
  if trace and not spec:
    raise ValueError("trace: only speculative decoding has rounds to trace (got spec=False)")
  gamma = draft.config.gamma if spec else 0
  out_len = max_new_tokens + gamma + 1
  cache_len = tm.cache_slots(prompt_len + out_len + gamma + 1)
  budgets = (jnp.full((batch,), max_new_tokens, jnp.int32) if budgets is None
             else jnp.minimum(jnp.asarray(budgets, jnp.int32), max_new_tokens))
  stop_ids = (jnp.full((batch, 0), -1, jnp.int32) if stop_token_ids is None
              else jnp.asarray(stop_token_ids, jnp.int32))
  stop_seqs = jnp.asarray(stops.no_stop_sequences(batch) if stop_sequences is None
                          else stop_sequences, jnp.int32)
  if stop_seqs.ndim != 3 or stop_seqs.shape[0] != batch:
    raise ValueError(f"stop_sequences: expected [{batch}, S, L], got shape {stop_seqs.shape}")
  rows = _row_arrays(params, jnp)
  path, choice = PATH_AUTOREGRESSIVE, None
  if spec:
    path = proposal.PATH_FOLDED_GREEDY if greedy_only else proposal.PATH_FOLDED_SAMPLING
    choice = proposal.choose_backend(
        draft.head.arrays(), jax.ShapeDtypeStruct((batch, gamma, target.config.vocab_size),
                                                  draft.config.dtype),
        kind=draft.head.kind, greedy_only=greedy_only, store_logits=store_logits,
        confidence=draft.confidence is not None, backend=backend, config=config,
        devices=layout.plan_devices(draft.plan))
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = (None, None) if not spec else nnx.split(draft)
  out = _decode_program(target_state, draft_state, jnp.asarray(prompt, jnp.int32),
                        jnp.asarray(prompt_lens, jnp.int32), budgets, rows, stop_ids, stop_seqs,
                        key, target_def=target_def, draft_def=draft_def, path=path,
                        cache_len=cache_len, out_len=out_len, store_logits=store_logits,
                        backend=choice, schedule=schedule, trace=bool(trace),
                        prefill_chunk=prefill_chunk)
  return out.replace(tokens=out.tokens[:, :max_new_tokens])


def check_prefill_chunk(value) -> int | None:
  """`value` (None or an integer >= 1), or ValueError naming ``prefill_chunk``."""
  return None if value is None else validation.check_positive_int("prefill_chunk", value)


# ---- the eager fallback: the same round driven from Python -------------------------------------------


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "cache_len", "out_len",
                                             "schedule", "trace", "prefill_chunk", "packed"))
def _eager_prefill(target_state, draft_state, prompt, prompt_lens, max_new, rows, stop_ids,
                   stop_seqs, key, *, target_def, draft_def, cache_len, out_len, schedule, trace,
                   prefill_chunk, packed=False):
  return _prefill(nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state), prompt,
                  prompt_lens, max_new, rows, stop_ids, key, cache_len, out_len, stop_seqs,
                  schedule, trace, chunk=prefill_chunk, packed=packed)


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def"))
def _eager_draft(target_state, draft_state, state, *, target_def, draft_def):
  target, draft = nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state)
  base, hidden = _draft_forward(target, draft, state)
  head, conf, hidden = _draft_inputs(draft, hidden)
  return base, hidden, head, conf


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "schedule"))
def _eager_verify(target_state, draft_state, state, tokens, corrected, confidence, max_new, rows,
                  stop_ids, stop_seqs, key, *, target_def, draft_def, schedule):
  target, draft = nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state)
  return _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key,
                         False, confidence, stop_seqs, schedule)


@functools.partial(jax.jit, static_argnames=("out_len", "gamma"))
def _eager_output(state, *, out_len, gamma):
  return _as_output(_finish(state, out_len), gamma)


def _run_eager(target_state, draft_state, args, *, target_def, draft_def, kind, cache_len, out_len,
               store_logits=True, schedule=None, trace=False, prefill_chunk=PREFILL_CHUNK,
               packed=False):
  """The eager fallback's decode: the `DecodeOutput` `_decode_program` would return."""
  prompt, prompt_lens, max_new, rows, stop_ids, stop_seqs, key = args
  defs = dict(target_def=target_def, draft_def=draft_def)
  state = _eager_prefill(target_state, draft_state, *args, cache_len=cache_len, out_len=out_len,
                         schedule=schedule, trace=trace, prefill_chunk=prefill_chunk,
                         packed=packed, **defs)
  while not bool(jnp.all(state["done"])) and int(state["rounds"]) < out_len:
    base, hidden, head, conf = _eager_draft(target_state, draft_state, state, **defs)
    tokens, corrected, confidence = proposal.eager_block(
        head, conf, base, state["anchor"], hidden, rows["greedy"], rows["temperature"],
        rows["seeds"], state["anchor_pos"],
        draft_key(key, state["rounds"], schedule, base.shape[1]), kind=kind,
        store_logits=store_logits)
    state = _eager_verify(target_state, draft_state, state, tokens, corrected, confidence, max_new,
                          rows, stop_ids, stop_seqs, key, schedule=schedule, **defs)
  return _eager_output(state, out_len=out_len, gamma=state["reached"].shape[0])
