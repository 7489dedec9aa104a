"""The pieces of one decoding iteration, as pure functions traced into the compiled programs.

This module owns what one iteration does to the loop state (a dict of arrays, the
`lax.while_loop` carry): `_prefill` (run the prompts, sample the first token, build the state),
`_autoregressive_step` (one target token), `_speculative_round` (draft forward, folded block,
`_after_proposal`: verify, commit, extend the draft's context, count), and `_finish` (cut the output
after each row's length). Nothing here synchronises with the host.

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
from dspark_jax.draft import block as proposal
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import target_law

PATH_AUTOREGRESSIVE = "autoregressive"


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
