"""The pieces of one decoding iteration, as pure functions traced into the compiled programs.

This module owns what one iteration does to the loop state (a dict of arrays, the
`lax.while_loop` carry): `_prefill` (run the prompts, in passes of at most ``PREFILL_CHUNK``
positions by default (`_prefill_forward`), sample the first token, build the state),
`_autoregressive_step` (one target token), `_speculative_round` (draft forward, folded block,
`_after_proposal`: choose the verify lengths, verify, commit, extend the draft's context, count),
and `_finish` (cut the output after each row's length). Nothing here synchronises with the host.

**Stops.** Verification cuts a commit after its first stop token (`verification`); then
`stops.first_match` cuts it after the first stop sequence ending in it. A row whose commit was cut by
either, within its budget, is finished; ``stop_index`` records the matched sequence.

**Schedules.** With a `Schedule` (``dspark_jax.scheduling.schedules``), each round calls
``verify_lens, state = schedule.update(confidence, active, state)`` on the block's confidence, its
state in the carry (``state["schedule"]``), and verifies ``verify_lens`` tokens per row (anchor
included; `verification.verify_arrays` caps the accepted run there). The verify forward runs only
those tokens, packed into the smallest static token bucket that holds them (`packing`), so a
shorter verify makes the forward cheaper; finished rows send none. Without a schedule every row
verifies γ + 1 in the dense [B, γ + 1] forward and the program is the one without schedules.
A schedule with state (one that reads earlier rounds, e.g. a lagged `top_k`) gets fresh draft noise
each round (`draft_key`: the base key folded with the round index): drafts a round discarded unseen
were drawn with the noise of their positions, and a later round redrawing those positions with the
same noise would let a budget computed from the earlier survivals depend on the new drafts. Without
state, the draft key is the base key (noise by position only, as without a schedule).

**Counts.** ``reached[k]``/``accepted[k]`` count (row, round) pairs whose outcome for draft k + 1 was
decided inside the accepted run (so k + 1 < verify length) and reached it, and of those, accepted it;
``row_verified`` sums the verify lengths of each row's active rounds. A state that carries
``row_reached``/``row_hits`` ([B, γ] int32, the queue's) gets the same two counts per row. With ``trace`` the per-round
confidence, verify lengths, accepted run and activity are written to fixed-size buffers indexed by
the round (`_record`).

Rejected positions need no cache rollback: both caches are indexed by absolute position and every
read is masked to positions before the reader, so stale entries are overwritten before anything can
see them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import verification
from dspark_jax.decoding import packing
from dspark_jax.decoding import stops
from dspark_jax.draft import block as proposal
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import target_law

PATH_AUTOREGRESSIVE = "autoregressive"
PREFILL_CHUNK = 512
"""Default prompt positions per prefill pass (`_prefill_forward`): a longer prompt is prefilled in
passes of this many positions, each attending to the cache written so far."""


def _row_arrays(params: sp.SamplingParams, xp=np) -> dict[str, Any]:
  """The per-row arrays the loop reads: NumPy for host values (`generate`), jax.numpy for values
  that may be traced (`decode`)."""
  return {"greedy": xp.asarray(params.greedy_mask, bool),
          "temperature": xp.asarray(params.draft_temperature, xp.float32),
          "top_k": xp.asarray(params.top_k, xp.int32), "top_p": xp.asarray(params.top_p, xp.float32),
          "seeds": xp.asarray(params.seed, xp.uint32)}


def _has_sequences(stop_seqs) -> bool:
  return stop_seqs is not None and stop_seqs.shape[1] > 0


def _cut_at_sequences(state, committed, num, finished, stop_seqs):
  """This iteration's commit cut after the first stop sequence ending in it (`stops.first_match`).

  Returns ``(committed, num, finished, hit, index)``; `hit`/`index` are None without sequences."""
  if not _has_sequences(stop_seqs):
    return committed, num, finished, None, None
  recent = stops.history(state["out"], state["count"], stop_seqs.shape[2] - 1)
  hit, end, index = stops.first_match(recent, committed, num, stop_seqs)
  num = jnp.where(hit, end + 1, num).astype(jnp.int32)
  slot = jnp.arange(committed.shape[1], dtype=jnp.int32)[None, :]
  return jnp.where(slot < num[:, None], committed, -1), num, finished | hit, hit, index


def _with_stop_index(new, state, stopped, hit, index):
  if hit is not None:
    new["stop_index"] = jnp.where(stopped & hit, index, state["stop_index"])
  return new


def _prefill_forward(target, draft, prompt, prompt_lens, cache, context, chunk):
  """Runs [B, T] right-padded prompts through the target (and their features into the draft's
  context cache) -> (logits [B, V] at each row's last prompt token, cache, context).

  With `chunk` (a static int) and T > chunk, the prompts run in passes of `chunk` positions: the
  first T // chunk in a `lax.while_loop` that stops after the longest row's last chunk, then the
  T % chunk left, if any row reaches them. Each pass attends to the cache written so far, so the
  activations (attention scores included) follow the chunk, not T. Only the last token's logits
  are computed. `context` is None without a draft."""
  batch, width = prompt.shape

  def run(tokens, start, cache, context, last, fresh=False):
    positions = start + jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
    hidden, features, cache = target(tokens, positions, cache, head=False, fresh=fresh)
    if draft is not None:
      context = draft.extend_context(features, positions, context)
    at = prompt_lens - 1 - start
    inside = (at >= 0) & (at < tokens.shape[1])
    mine = jnp.take_along_axis(hidden, jnp.clip(at, 0, tokens.shape[1] - 1)[:, None, None],
                               axis=1)[:, 0]
    return cache, context, jnp.where(inside[:, None], mine.astype(last.dtype), last)

  last = jnp.zeros((batch, target.config.hidden_size), target.config.dtype)
  if chunk is None or width <= chunk:
    cache, context, last = run(prompt, jnp.int32(0), cache, context, last, fresh=True)
    return target.logits(last), cache, context
  full, rest = divmod(width, chunk)
  longest = jnp.max(prompt_lens).astype(jnp.int32)

  def body(carry):
    i, cache, context, last = carry
    start = i * chunk
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
    return (i + 1, *run(tokens, start, cache, context, last))

  count = jnp.minimum((longest + chunk - 1) // chunk, full)
  _, cache, context, last = jax.lax.while_loop(lambda c: c[0] < count, body,
                                               (jnp.int32(0), cache, context, last))
  if rest:
    start = jnp.int32(full * chunk)
    cache, context, last = jax.lax.cond(
        longest > start, lambda c, x, h: run(prompt[:, full * chunk:], start, c, x, h),
        lambda c, x, h: (c, x, h), cache, context, last)
  return target.logits(last), cache, context


def _packed_prefill_forward(target, draft, tokens, prompt_lens, cache, context):
  """`_prefill_forward` of B prompts packed one after another into [N] `tokens` (prompt b the
  next ``prompt_lens[b]`` tokens, each >= 1; tokens past them are padding): one pass of
  `TargetModel.packed_prefill`, whose attention keeps to each prompt, so its work follows the
  prompts' tokens rather than B times the longest. -> (logits [B, V] at each row's last prompt
  token, cache, context)."""
  size = tokens.shape[0]
  rows, positions, _ = packing.pack(prompt_lens, size)
  tokens = jnp.where(rows < prompt_lens.shape[0], tokens, 0)
  hidden, features, cache = target.packed_prefill(tokens, rows, positions, prompt_lens, cache)
  if draft is not None:
    context = draft.extend_context(features, positions, context, rows=rows)
  last = jnp.cumsum(prompt_lens.astype(jnp.int32)) - 1
  return target.logits(hidden[last]), cache, context


def schedule_entries(schedule, batch: int, gamma: int) -> dict:
  """The loop state a verify-length schedule adds for `batch` rows: its own state
  (``schedule.init``) and ``row_verified``, [batch] int32 tokens verified so far (zeros)."""
  return {"schedule": schedule.init(batch, gamma),
          "row_verified": jnp.zeros((batch,), jnp.int32)}


def _prefill(target, draft, prompt, prompt_lens, max_new, rows, stop_ids, key, cache_len, out_len,
             stop_seqs=None, schedule=None, trace=False, cache=None, context=None,
             chunk=PREFILL_CHUNK, packed=False):
  """Runs the prompts, samples the first token, builds the initial loop state.

  `cache`/`context` (optional): the target's and the draft's caches to write the prompts into
  (e.g. paged ones whose tables hold these rows' pages); None builds contiguous ones of
  `cache_len` positions. `chunk`: positions per prefill pass (`_prefill_forward`; None: the whole
  prompt in one pass). `packed` (static): `prompt` is the B prompts packed into [N] tokens
  (`_packed_prefill_forward`; `chunk` unused) rather than right-padded [B, T]."""
  batch = prompt_lens.shape[0]
  if cache is None:
    cache = tm.init_cache(target.config, batch, cache_len)
  if draft is not None and context is None:
    context = draft.init_context(batch, cache_len)
  if packed:
    last, cache, context = _packed_prefill_forward(target, draft, prompt, prompt_lens, cache,
                                                   context)
  else:
    last, cache, context = _prefill_forward(target, draft, prompt, prompt_lens, cache, context,
                                            chunk)
  keys = sampling.row_keys(key, rows["seeds"], prompt_lens, sampling.Stream.TARGET)
  first = target_law.sample_target_tokens(last, rows["greedy"], rows["temperature"], rows["top_k"],
                                          rows["top_p"], keys)
  count = jnp.minimum(max_new, 1)
  state = {
      "cache": cache, "anchor": first, "anchor_pos": prompt_lens,
      "out": jnp.full((batch, out_len), -1, jnp.int32), "count": jnp.zeros_like(count),
      "rounds": jnp.int32(0),
  }
  if _has_sequences(stop_seqs):
    state["stop_index"] = jnp.full((batch,), -1, jnp.int32)
  token_stop = verification.stop_mask(first[:, None], stop_ids)[:, 0]
  _, _, finished, hit, index = _cut_at_sequences(state, first[:, None], jnp.ones_like(count),
                                                 token_stop, stop_seqs)
  stopped = (count > 0) & finished
  state = _with_stop_index(state, state, stopped, hit, index)
  state.update(out=state["out"].at[:, 0].set(first), count=count, finished=stopped,
               done=stopped | (count >= max_new))
  if draft is not None:
    gamma = draft.config.gamma
    state["context"] = context
    state["reached"] = jnp.zeros((gamma,), jnp.int32)
    state["accepted"] = jnp.zeros((gamma,), jnp.int32)
    state["row_rounds"] = jnp.zeros((batch,), jnp.int32)
    state["row_accepted"] = jnp.zeros((batch,), jnp.int32)
    if schedule is not None:
      state.update(schedule_entries(schedule, batch, gamma))
    if trace:
      state["trace"] = {"confidence": jnp.full((out_len, batch, gamma), jnp.nan, jnp.float32),
                        "verify_lens": jnp.zeros((out_len, batch), jnp.int32),
                        "accept_len": jnp.zeros((out_len, batch), jnp.int32),
                        "active": jnp.zeros((out_len, batch), bool)}
  return state


def _autoregressive_step(target, state, max_new, rows, stop_ids, key, stop_seqs=None):
  logits, _, cache = target(state["anchor"][:, None], state["anchor_pos"][:, None], state["cache"])
  keys = sampling.row_keys(key, rows["seeds"], state["anchor_pos"] + 1, sampling.Stream.TARGET)
  token = target_law.sample_target_tokens(logits[:, 0], rows["greedy"], rows["temperature"],
                                          rows["top_k"], rows["top_p"], keys)
  active = ~state["done"]
  token_stop = verification.stop_mask(token[:, None], stop_ids)[:, 0]
  _, _, finished, hit, index = _cut_at_sequences(state, token[:, None], jnp.ones_like(state["count"]),
                                                 token_stop, stop_seqs)
  out = layers.write_rows(state["out"], token[:, None], state["count"])
  count = state["count"] + active
  stopped = active & finished
  new = dict(state, cache=cache, out=out, count=count, finished=state["finished"] | stopped,
             done=state["done"] | stopped | (count >= max_new),
             anchor=jnp.where(active, token, state["anchor"]),
             anchor_pos=state["anchor_pos"] + active, rounds=state["rounds"] + 1)
  return _with_stop_index(new, state, stopped, hit, index)


def _draft_forward(target, draft, state):
  return draft(target, state["anchor"], state["anchor_pos"], state["context"])


def _draft_inputs(draft, hidden, head=None):
  """Head weights (`head`: prepared ones) and the hidden states the heads read (None when no head
  reads them)."""
  conf = None if draft.confidence is None else draft.confidence.arrays()
  needs_hidden = draft.head.needs_hidden or conf is not None
  return draft.head.arrays() if head is None else head, conf, hidden if needs_hidden else None


def draft_key(key, rounds, schedule, gamma: int):
  """The key a round drafts with: `key`, or with a stateful schedule ``fold_in(key, rounds)``."""
  if schedule is None or not jax.tree.leaves(schedule.init(1, gamma)):
    return key
  return jax.random.fold_in(key, rounds)


def _verify_lens(schedule, state, confidence, active, gamma):
  """[B] int32 verify lengths in 1..γ+1 and the schedule's next state (None without a schedule)."""
  batch = active.shape[0]
  if schedule is None:
    return jnp.full((batch,), gamma + 1, jnp.int32), None
  if confidence is None:  # only a schedule that does not read it gets here (`loop.check_schedule`)
    confidence = jnp.zeros((batch, gamma), jnp.float32)
  lens, schedule_state = schedule.update(confidence.astype(jnp.float32), active, state["schedule"])
  return jnp.clip(jnp.asarray(lens, jnp.int32), 1, gamma + 1), schedule_state


def _buckets(schedule, batch: int, width: int) -> tuple[int, ...] | None:
  """The schedule's token buckets (`Schedule.buckets`) where they are this batch's (the last is
  B·W), else None (`packing.token_buckets`)."""
  buckets = getattr(schedule, "buckets", None)
  if buckets and int(buckets[-1]) == batch * width:
    return tuple(int(n) for n in buckets)
  return None


def _record(trace, index, confidence, lens, accept_len, active):
  """The trace buffers with round `index` written (verify lengths and runs 0 for inactive rows)."""
  put = lambda buffer, value: jax.lax.dynamic_update_index_in_dim(
      buffer, value.astype(buffer.dtype), index, axis=0)
  out = dict(trace, verify_lens=put(trace["verify_lens"], jnp.where(active, lens, 0)),
             accept_len=put(trace["accept_len"], jnp.where(active, accept_len, 0)),
             active=put(trace["active"], active))
  if confidence is not None:
    out["confidence"] = put(trace["confidence"], confidence)
  return out


def _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key,
                    greedy_only, confidence=None, stop_seqs=None, schedule=None):
  """Choose verify lengths, verify the drafted block with the target, commit, extend the draft
  context, update the counts (module docstring)."""
  gamma = tokens.shape[1]
  anchor, anchor_pos = state["anchor"], state["anchor_pos"]
  active = ~state["done"]
  lens, schedule_state = _verify_lens(schedule, state, confidence, active, gamma)
  verify_in = jnp.concatenate([anchor[:, None], tokens], axis=1)
  positions = anchor_pos[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
  if schedule is None:
    logits, features, cache = target(verify_in, positions, state["cache"])
  else:  # only the scheduled tokens: the forward's cost follows them (`packing`)
    logits, features, cache = packing.packed_verify(target, verify_in, positions,
                                                    jnp.where(active, lens, 0), state["cache"],
                                                    _buckets(schedule, *verify_in.shape))
  result = verification.verify_arrays(
      logits, tokens, corrected, rows["temperature"], rows["greedy"], rows["temperature"],
      rows["top_k"], rows["top_p"], rows["seeds"], anchor_pos, lens, stop_ids, key,
      greedy_only=greedy_only)
  committed, num, finished, hit, index = _cut_at_sequences(
      state, result.committed, result.num_committed, result.finished, stop_seqs)
  taken = jnp.where(active, jnp.minimum(num, max_new - state["count"]), 0)
  # Writes all γ+1 slots; those past `taken` are overwritten later or cut off at the end.
  out = layers.write_rows(state["out"], committed, state["count"])
  count = state["count"] + taken
  stopped = active & finished & (num <= taken)
  last = jnp.take_along_axis(committed, (num - 1)[:, None], axis=1)[:, 0]
  k = jnp.arange(gamma)[None, :]
  reached = active[:, None] & (result.accept_len[:, None] >= k)
  if schedule is not None:  # draft k+1 at the cap is the bonus: its outcome is not counted
    reached = reached & (k + 1 < lens[:, None])
  accepted = active[:, None] & (result.accept_len[:, None] >= k + 1)
  new = dict(
      state, cache=cache, out=out, count=count, finished=state["finished"] | stopped,
      done=state["done"] | stopped | (count >= max_new),
      anchor=jnp.where(active, last, anchor),
      anchor_pos=anchor_pos + jnp.where(active, num, 0),
      context=draft.extend_context(features, positions, state["context"]),
      rounds=state["rounds"] + 1,
      reached=state["reached"] + reached.sum(0, dtype=jnp.int32),
      accepted=state["accepted"] + accepted.sum(0, dtype=jnp.int32),
      row_rounds=state["row_rounds"] + active,
      row_accepted=state["row_accepted"] + jnp.where(active, result.accept_len, 0))
  if "row_reached" in state:  # per-row acceptance counts (the queue's per-prompt statistics)
    new["row_reached"] = state["row_reached"] + reached
    new["row_hits"] = state["row_hits"] + accepted
  if schedule is not None:
    new["schedule"] = schedule_state
    new["row_verified"] = state["row_verified"] + jnp.where(active, lens, 0)
  if "trace" in state:
    new["trace"] = _record(state["trace"], state["rounds"], confidence, lens, result.accept_len,
                           active)
  return _with_stop_index(new, state, stopped, hit, index)


def _speculative_round(target, draft, state, max_new, rows, stop_ids, key, greedy_only,
                       store_logits=True, head=None, backend=None, stop_seqs=None, schedule=None):
  base, hidden = _draft_forward(target, draft, state)
  head, conf, hidden = _draft_inputs(draft, hidden, head)
  tokens, corrected, confidence = proposal.folded_block(
      head, conf, base, state["anchor"], hidden, rows["greedy"], rows["temperature"], rows["seeds"],
      state["anchor_pos"], draft_key(key, state["rounds"], schedule, draft.config.gamma),
      kind=draft.head.kind, greedy_only=greedy_only,
      backend=backend, store_logits=store_logits)
  if isinstance(corrected, proposal.CompactLogits):
    corrected = corrected.with_inputs(base, head["w2"])
  return _after_proposal(target, draft, state, tokens, corrected, max_new, rows, stop_ids, key,
                         greedy_only, confidence, stop_seqs, schedule)


def _finish(state, out_len):
  cols = jnp.arange(out_len)[None, :]
  state = dict(state)
  state["out"] = jnp.where(cols < state["count"][:, None], state["out"], -1)
  state.pop("cache", None)
  state.pop("context", None)
  return state


_finish_jit = jax.jit(_finish, static_argnums=1)
