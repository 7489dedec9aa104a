"""Speculative decoding with a DSpark draft, and the autoregressive baseline, as compiled loops.

This module owns `generate`: prompts in, tokens and decoding statistics out.

* **Prefill.** Prompts of different lengths are right-padded to a length bucket and run through the
  target once; the first new token is sampled from the target at each row's last prompt position
  (`target_law`, stream `Stream.TARGET`), and the draft's context cache is filled from the prompt's
  target features.
* **Rounds** (`spec=True`), all inside one `lax.while_loop`: the draft forward gives base logits and
  hidden states; the folded block sampler (`proposal.folded_block`) drafts γ tokens; the target runs
  ``[anchor, x_1..x_γ]`` at positions ``anchor_pos..anchor_pos+γ``; `verification.verify_arrays`
  accepts a prefix and a bonus; the committed tokens are appended (up to ``max_new_tokens``); the
  target features of those positions extend the draft's context. Rejected positions need no cache
  rollback: both caches are indexed by absolute position and every read is masked to positions
  before the reader, so stale entries are overwritten before anything can see them. Finished rows
  stop committing and stop advancing.
* **Routing** (docs/memory_gate.md) at the batch level: an all-greedy batch runs the greedy-only variant; a
  batch with sampled rows runs the folded sampling variant if the memory gate (`memory_gate`) allows
  it, else the *eager* fallback, which drives the same round from Python (one host sync per round,
  the block sampled step by step by `proposal.eager_block`).
* **Baseline** (`spec=False`): plain autoregressive decoding with the same target, sampler, buckets
  and stop rules, one token per loop iteration.

Shapes are bucketed (batch, prompt length and ``max_new_tokens`` rounded up to powers of two) and each
bucket's program is compiled ahead of time once per process, so calls in the same buckets never
recompile. Randomness: every draw is a function of (key, seed, absolute position, stream).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dspark_jax import validation
from dspark_jax import verification
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import target_law

PATH_AUTOREGRESSIVE = "autoregressive"
MIN_BUCKET = 8


@dataclasses.dataclass
class GenerateResult:
  """The outcome of `generate`.

  Attributes:
    tokens: [B, max_new_tokens] int32 generated tokens, -1 after each row's end.
    lengths: [B] number of generated tokens per row.
    finished: [B] bool, the row ended on a stop token.
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

  @property
  def tokens_per_second(self) -> float:
    return float(self.lengths.sum()) / max(self.wall_seconds, 1e-12)


def bucket(n: int, minimum: int = 1) -> int:
  """The padding bucket of `n`: the smallest power of two >= max(n, minimum)."""
  size = 1
  while size < max(n, minimum):
    size *= 2
  return size


# ---- the pieces of a round (pure; called inside the compiled programs) -------------------------------


def _row_arrays(params: sp.SamplingParams, xp=np) -> dict[str, Any]:
  """The per-row arrays the loop reads: NumPy for host values (`generate`), jax.numpy for values
  that may be traced (`decode`)."""
  return {"greedy": xp.asarray(params.greedy_mask, bool),
          "temperature": xp.asarray(params.draft_temperature, xp.float32),
          "top_k": xp.asarray(params.top_k, xp.int32), "top_p": xp.asarray(params.top_p, xp.float32),
          "seeds": xp.asarray(params.seed, xp.uint32)}


def _prefill(target, draft, prompt, prompt_lens, max_new, rows, stop_ids, key, cache_len, out_len):
  """Runs the prompts, samples the first token, builds the initial loop state."""
  batch, prompt_len = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
  cache = tm.init_cache(target.config, batch, cache_len)
  logits, features, cache = target(prompt, positions, cache)
  last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  keys = sampling.row_keys(key, rows["seeds"], prompt_lens, sampling.Stream.TARGET)
  first = target_law.sample_target_tokens(last, rows["greedy"], rows["temperature"], rows["top_k"],
                                          rows["top_p"], keys)
  count = jnp.minimum(max_new, 1)
  stopped = (count > 0) & verification.stop_mask(first[:, None], stop_ids)[:, 0]
  state = {
      "cache": cache, "anchor": first, "anchor_pos": prompt_lens,
      "out": jnp.full((batch, out_len), -1, jnp.int32).at[:, 0].set(first),
      "count": count, "finished": stopped, "done": stopped | (count >= max_new),
      "rounds": jnp.int32(0),
  }
  if draft is not None:
    gamma = draft.config.gamma
    state["context"] = draft.extend_context(features, positions, draft.init_context(batch, cache_len))
    state["reached"] = jnp.zeros((gamma,), jnp.int32)
    state["accepted"] = jnp.zeros((gamma,), jnp.int32)
    state["row_rounds"] = jnp.zeros((batch,), jnp.int32)
    state["row_accepted"] = jnp.zeros((batch,), jnp.int32)
  return state


def _autoregressive_step(target, state, max_new, rows, stop_ids, key):
  logits, _, cache = target(state["anchor"][:, None], state["anchor_pos"][:, None], state["cache"])
  keys = sampling.row_keys(key, rows["seeds"], state["anchor_pos"] + 1, sampling.Stream.TARGET)
  token = target_law.sample_target_tokens(logits[:, 0], rows["greedy"], rows["temperature"],
                                          rows["top_k"], rows["top_p"], keys)
  active = ~state["done"]
  out = layers.write_rows(state["out"], token[:, None], state["count"])
  count = state["count"] + active
  stopped = active & verification.stop_mask(token[:, None], stop_ids)[:, 0]
  return dict(state, cache=cache, out=out, count=count, finished=state["finished"] | stopped,
              done=state["done"] | stopped | (count >= max_new),
              anchor=jnp.where(active, token, state["anchor"]),
              anchor_pos=state["anchor_pos"] + active, rounds=state["rounds"] + 1)


def _draft_forward(target, draft, state):
  return draft(target, state["anchor"], state["anchor_pos"], state["context"])


def _draft_inputs(draft, hidden, head=None):
  """Head weights (`head`: prepared ones) and the hidden states the heads read (None when no head
  reads them)."""
  conf = None if draft.confidence is None else draft.confidence.arrays()
  needs_hidden = draft.head.needs_hidden or conf is not None
  return draft.head.arrays() if head is None else head, conf, hidden if needs_hidden else None


def _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key,
                    greedy_only):
  """Verify the drafted block with the target, commit, extend the draft context, update stats."""
  gamma = tokens.shape[1]
  anchor, anchor_pos = state["anchor"], state["anchor_pos"]
  verify_in = jnp.concatenate([anchor[:, None], tokens], axis=1)
  positions = anchor_pos[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
  logits, features, cache = target(verify_in, positions, state["cache"])
  full = jnp.full(anchor.shape, gamma + 1, jnp.int32)
  result = verification.verify_arrays(
      logits, tokens, corrected, rows["temperature"], rows["greedy"], rows["temperature"],
      rows["top_k"], rows["top_p"], rows["seeds"], anchor_pos, full, stop_ids, key,
      greedy_only=greedy_only)
  active = ~state["done"]
  taken = jnp.where(active, jnp.minimum(result.num_committed, max_new - state["count"]), 0)
  # Writes all γ+1 slots; those past `taken` are overwritten later or cut off at the end.
  out = layers.write_rows(state["out"], result.committed, state["count"])
  count = state["count"] + taken
  stopped = active & result.finished & (result.num_committed <= taken)
  last = jnp.take_along_axis(result.committed, (result.num_committed - 1)[:, None], axis=1)[:, 0]
  k = jnp.arange(gamma)[None, :]
  reached = active[:, None] & (result.accept_len[:, None] >= k)
  accepted = active[:, None] & (result.accept_len[:, None] >= k + 1)
  return dict(
      state, cache=cache, out=out, count=count, finished=state["finished"] | stopped,
      done=state["done"] | stopped | (count >= max_new),
      anchor=jnp.where(active, last, anchor),
      anchor_pos=anchor_pos + jnp.where(active, result.num_committed, 0),
      context=draft.extend_context(features, positions, state["context"]),
      rounds=state["rounds"] + 1,
      reached=state["reached"] + reached.sum(0, dtype=jnp.int32),
      accepted=state["accepted"] + accepted.sum(0, dtype=jnp.int32),
      row_rounds=state["row_rounds"] + active,
      row_accepted=state["row_accepted"] + jnp.where(active, result.accept_len, 0))


def _speculative_round(target, draft, state, max_new, rows, stop_ids, key, greedy_only,
                       store_logits=True, head=None, backend=None):
  base, hidden = _draft_forward(target, draft, state)
  head, conf, hidden = _draft_inputs(draft, hidden, head)
  tokens, corrected, _ = proposal.folded_block(
      head, conf, base, state["anchor"], hidden, rows["greedy"], rows["temperature"], rows["seeds"],
      state["anchor_pos"], key, kind=draft.head.kind, greedy_only=greedy_only,
      backend=backend, store_logits=store_logits)
  if isinstance(corrected, proposal.CompactLogits):
    corrected = corrected.with_inputs(base, head["w2"])
  return _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key,
                         greedy_only)


def _finish(state, out_len):
  cols = jnp.arange(out_len)[None, :]
  state = dict(state)
  state["out"] = jnp.where(cols < state["count"][:, None], state["out"], -1)
  state.pop("cache", None)
  state.pop("context", None)
  return state


_finish_jit = jax.jit(_finish, static_argnums=1)


def _decode_program(target_state, draft_state, prompt, prompt_lens, max_new, rows, stop_ids, key, *,
                    target_def, draft_def, path, cache_len, out_len, store_logits=True,
                    backend=None):
  """The whole decode as one program: prefill, then a `lax.while_loop` of rounds or steps."""
  target = nnx.merge(target_def, target_state)
  draft = None if draft_def is None else nnx.merge(draft_def, draft_state)
  state = _prefill(target, draft, prompt, prompt_lens, max_new, rows, stop_ids, key, cache_len,
                   out_len)
  if path == PATH_AUTOREGRESSIVE:
    step = functools.partial(_autoregressive_step, target)
  else:
    # Where the Hopper kernels run they read W2 part by part: prepared once here, outside the loop.
    head = pallas_block.head_arrays_for(draft.head.arrays(), [backend])
    step = functools.partial(_speculative_round, target, draft,
                             greedy_only=path == proposal.PATH_FOLDED_GREEDY,
                             store_logits=store_logits, head=head, backend=backend)
  limit = out_len  # every iteration commits at least one token per active row
  # The carry keeps its dtypes (under x64 some sums and index arithmetic would widen them).
  body = lambda s: jax.tree.map(lambda new, old: new.astype(old.dtype),
                                step(s, max_new, rows, stop_ids, key), s)
  state = jax.lax.while_loop(lambda s: jnp.any(~s["done"]) & (s["rounds"] < limit), body, state)
  return _finish(state, out_len)


# ---- the compiled loop as a pure function ---------------------------------------------------------------


@struct.dataclass
class DecodeOutput:
  """What `decode` returns: arrays only (a pytree), so it passes through ``jit`` and ``vmap``.

  Attributes:
    tokens: [B, max_new_tokens] int32 generated tokens, -1 after each row's end.
    lengths: [B] int32 generated tokens per row. finished: [B] bool, ended on a stop token.
    rounds: int32 loop iterations after the prefill.
    reached, accepted: [γ] int32 counts: (row, round) pairs that reached draft k, and of those,
      how many accepted it (zeros for the autoregressive loop, whose γ is 0).
    row_rounds, row_accepted: [B] int32 rounds each row was active and drafts it accepted.
  """

  tokens: jax.Array
  lengths: jax.Array
  finished: jax.Array
  rounds: jax.Array
  reached: jax.Array
  accepted: jax.Array
  row_rounds: jax.Array
  row_accepted: jax.Array


def decode(target: tm.TargetModel, draft: dm.DSparkDraft | None, prompt: jax.Array,
           prompt_lens: jax.Array, params: sp.SamplingParams, key: jax.Array, *,
           max_new_tokens: int, budgets: jax.Array | None = None,
           stop_token_ids: jax.Array | None = None, spec: bool = True, greedy_only: bool = False,
           store_logits: bool = True, backend=None, config=None) -> DecodeOutput:
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
    spec: static: speculative decoding with `draft` (True) or the autoregressive loop.
    greedy_only: static: the folded greedy-only variant; every row must then be greedy (values are
      not checked here). Otherwise the folded sampling variant, for any mix of rows.
    store_logits: static: the sampling variant stores its corrected logits (False: `CompactLogits`).
    backend, config: static: the draft block's backend (`dspark_jax.kernels.dispatch`).

  Static, so a change compiles a new program: `max_new_tokens`, `spec`, `greedy_only`,
  `store_logits`, `backend`, `config`, and every shape (B, T, S). Everything else may be traced.

  Returns:
    A `DecodeOutput`.
  """
  batch, prompt_len = np.shape(prompt)
  max_new_tokens = validation.check_nonnegative_int("max_new_tokens", max_new_tokens)
  if spec and draft is None:
    raise ValueError("draft: required for speculative decoding (pass spec=False for the loop)")
  gamma = draft.config.gamma if spec else 0
  out_len = max_new_tokens + gamma + 1
  cache_len = prompt_len + out_len + gamma + 1
  budgets = (jnp.full((batch,), max_new_tokens, jnp.int32) if budgets is None
             else jnp.minimum(jnp.asarray(budgets, jnp.int32), max_new_tokens))
  stop_ids = (jnp.full((batch, 0), -1, jnp.int32) if stop_token_ids is None
              else jnp.asarray(stop_token_ids, jnp.int32))
  rows = _row_arrays(params, jnp)
  path, choice = PATH_AUTOREGRESSIVE, None
  if spec:
    path = proposal.PATH_FOLDED_GREEDY if greedy_only else proposal.PATH_FOLDED_SAMPLING
    choice = proposal.choose_backend(
        draft.head.arrays(), jax.ShapeDtypeStruct((batch, gamma, target.config.vocab_size),
                                                  draft.config.dtype),
        kind=draft.head.kind, greedy_only=greedy_only, store_logits=store_logits,
        confidence=draft.confidence is not None, backend=backend, config=config)
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = (None, None) if not spec else nnx.split(draft)
  state = _decode_program(target_state, draft_state, jnp.asarray(prompt, jnp.int32),
                          jnp.asarray(prompt_lens, jnp.int32), budgets, rows, stop_ids, key,
                          target_def=target_def, draft_def=draft_def, path=path,
                          cache_len=cache_len, out_len=out_len, store_logits=store_logits,
                          backend=choice)
  zeros_g, zeros_b = jnp.zeros((gamma,), jnp.int32), jnp.zeros((batch,), jnp.int32)
  return DecodeOutput(
      tokens=state["out"][:, :max_new_tokens], lengths=state["count"].astype(jnp.int32),
      finished=state["finished"], rounds=state["rounds"],
      reached=state.get("reached", zeros_g), accepted=state.get("accepted", zeros_g),
      row_rounds=state.get("row_rounds", zeros_b), row_accepted=state.get("row_accepted", zeros_b))


# ---- the eager fallback: the same round driven from Python -------------------------------------------


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "cache_len", "out_len"))
def _eager_prefill(target_state, draft_state, prompt, prompt_lens, max_new, rows, stop_ids, key, *,
                   target_def, draft_def, cache_len, out_len):
  return _prefill(nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state), prompt,
                  prompt_lens, max_new, rows, stop_ids, key, cache_len, out_len)


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def"))
def _eager_draft(target_state, draft_state, state, *, target_def, draft_def):
  target, draft = nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state)
  base, hidden = _draft_forward(target, draft, state)
  head, conf, hidden = _draft_inputs(draft, hidden)
  return base, hidden, head, conf


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def"))
def _eager_verify(target_state, draft_state, state, tokens, corrected, max_new, rows, stop_ids, key, *,
                  target_def, draft_def):
  target, draft = nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state)
  return _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key, False)


def _run_eager(target_state, draft_state, args, *, target_def, draft_def, kind, cache_len, out_len,
               store_logits=True):
  prompt, prompt_lens, max_new, rows, stop_ids, key = args
  defs = dict(target_def=target_def, draft_def=draft_def)
  state = _eager_prefill(target_state, draft_state, *args, cache_len=cache_len, out_len=out_len,
                         **defs)
  while not bool(jnp.all(state["done"])) and int(state["rounds"]) < out_len:
    base, hidden, head, conf = _eager_draft(target_state, draft_state, state, **defs)
    tokens, corrected, _ = proposal.eager_block(
        head, conf, base, state["anchor"], hidden, rows["greedy"], rows["temperature"],
        rows["seeds"], state["anchor_pos"], key, kind=kind, store_logits=store_logits)
    state = _eager_verify(target_state, draft_state, state, tokens, corrected, max_new, rows,
                          stop_ids, key, **defs)
  return _finish_jit(state, out_len)


# ---- the public entry point -----------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
"""Compiled decode programs of this process, keyed by everything that fixes their shape."""


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
             store_logits: bool = True, backend: str | None = None,
             config=None) -> GenerateResult:
  """Decodes a batch of prompts speculatively with a DSpark draft (or autoregressively).

  Args:
    target: the target model.
    draft: the DSpark draft (its config must match the target); may be None when ``spec=False``.
    prompts: B token-id sequences of any lengths >= 1, or a [B, T] integer array.
    params: `SamplingParams` with B rows (greedy and sampled rows may mix).
    key: base PRNG key.
    max_new_tokens: per-row budget (an int, or B ints >= 0).
    stop_token_ids: shared stop ids, or per row as a [B, S] array padded with -1.
    spec: speculative decoding (default) or the autoregressive baseline.
    mode, memory_stats, headroom_bytes: the memory gate for the folded sampling variant
      (`memory_gate`; used only when the batch has sampled rows).
    store_logits: False drafts sampled rows without storing their corrected logits
      (`proposal.CompactLogits`: each token's log q; the verifier recomputes the one row it needs).
      The same tokens, fewer bytes per round at large batches.
    backend, config: what computes the folded draft blocks ("auto", "xla", "triton", "hopper";
      None reads ``$DSPARK_JAX_BACKEND``) and its settings (`dspark_jax.kernels.dispatch`).

  Returns:
    A `GenerateResult`; ``result.backend`` says which backend drafted and why.

  Raises:
    ValueError: bad prompts (naming the row and token), a draft that does not fit the target, a
      missing draft, params or budgets of the wrong size.
  """
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
  stop_ids = verification.stop_id_array(stop_token_ids, batch, vocab)

  padded_batch = bucket(batch)
  path, _ = _choose_path(spec, params, draft, padded_batch, vocab, mode, memory_stats,
                         headroom_bytes, store_logits)
  gamma = draft.config.gamma if spec else 0
  out_len = bucket(int(max_new.max()), MIN_BUCKET) + gamma + 1
  cache_len = prompt.shape[1] + out_len + gamma + 1
  extra = padded_batch - batch
  args = (np.pad(prompt, ((0, extra), (0, 0))),
          np.concatenate([prompt_lens, np.ones(extra, np.int32)]),
          np.concatenate([max_new.astype(np.int32), np.zeros(extra, np.int32)]),
          _row_arrays(params.padded(padded_batch)),
          np.pad(stop_ids, ((0, extra), (0, 0)), constant_values=-1), key)
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
    state = _run_eager(target_state, draft_state, args, target_def=target_def, draft_def=draft_def,
                       kind=draft.head.kind, cache_len=cache_len, out_len=out_len,
                       store_logits=store_logits)
  else:
    statics = dict(target_def=target_def, draft_def=draft_def, path=path, cache_len=cache_len,
                   out_len=out_len, store_logits=store_logits, backend=choice)
    shapes = jax.tree.map(lambda x: (np.shape(x), str(getattr(x, "dtype", type(x)))),
                          (target_state, draft_state, args))
    signature = (str(jax.tree_util.tree_structure(shapes)), str(jax.tree.leaves(shapes)),
                 tuple(statics.items()))
    program = _COMPILED.get(signature)
    if program is None:
      program = jax.jit(_decode_program, static_argnames=tuple(statics)).lower(
          target_state, draft_state, *args, **statics).compile()
      _COMPILED[signature] = program
      compile_seconds = time.perf_counter() - start
      start = time.perf_counter()
    state = program(target_state, draft_state, *args)
  state = jax.device_get(state)
  wall = time.perf_counter() - start

  tokens = np.asarray(state["out"])[:batch, :int(max_new.max()) if batch else 0]
  lengths = np.asarray(state["count"])[:batch]
  if spec:
    row_rounds = np.asarray(state["row_rounds"])[:batch].astype(np.int64)
    row_accepted = np.asarray(state["row_accepted"])[:batch].astype(np.int64)
    tau = 1.0 + float(row_accepted.sum()) / max(float(row_rounds.sum()), 1.0)
    reached = np.asarray(state["reached"]).astype(np.int64)
    accepted = np.asarray(state["accepted"]).astype(np.int64)
    acceptance = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
  else:
    tau, acceptance = 1.0, np.zeros((0,))
    reached = accepted = np.zeros((0,), np.int64)
    row_rounds = row_accepted = np.zeros((batch,), np.int64)
  return GenerateResult(tokens=tokens.astype(np.int32), lengths=lengths,
                        finished=np.asarray(state["finished"])[:batch], rounds=int(state["rounds"]),
                        tau=tau, acceptance=acceptance, path=path, wall_seconds=wall,
                        compile_seconds=compile_seconds, backend=choice, reached=reached,
                        accepted=accepted, row_rounds=row_rounds, row_accepted=row_accepted)
