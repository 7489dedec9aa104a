"""The slots of the queue-driven decode: their loop state and the two programs that run them.

This module owns the device side of `decoding.queue.Engine` and the host arrays a refill takes:

* the state of S idle slots (`_empty_state`, `_trace_buffers`): the loop state of `loop.iteration`
  with every per-row entry (leading axis S) zeroed and done, the global entries (`GLOBAL_KEYS`)
  fresh; the caches (`CACHE_KEYS`) are written only through `SlotCaches`;
* the *refill* (`_refill_program`): prefills K new prompts with the same `rounds._prefill` as
  `generate`, either packed one after another into N tokens (`_pack_prompts`: N one of a few
  sizes, so one program per (K, N) and never one per prompt length; each prompt attends to
  itself only, so the work follows the prompts' tokens) or, where packing does not apply,
  right-padded to a length bucket T (K a power of two up to S, one program per (K, T); a group
  wider than ``prefill_chunk`` positions is padded to the most whole passes of that many a slot
  holds, so all such groups of K rows share one program: `_group_prompts`), and writes their rows
  into the chosen slots (`SlotCaches` for the caches, a scatter for every other per-row array:
  tokens, counts, flags, per-row sampling parameters, budgets, stop ids and sequences); a resumed
  (preempted) row takes its saved state (`_saved_rows`) and recomputes only its caches;
* the *chunk* (`_chunk_program`): a `lax.while_loop` of the usual iterations (`loop.iteration`)
  that runs until ``rounds_per_call`` iterations have run, every slot is idle, or at least
  ``need`` slots are free (``need`` = min(``refill_at``, prompts still queued); with the queue
  empty it never stops for a free slot).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import loop
from dspark_jax.decoding import packing
from dspark_jax.decoding.requests import MIN_BUCKET, bucket
from dspark_jax.decoding.rounds import _prefill, schedule_entries
from dspark_jax.paging import cache as paging

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


def _models(weights, weights_tree, target_def, draft_def):
  """The target and draft (None without `draft_def`) from `weights`, the flat leaves of their
  states ``(target_state, draft_state)`` whose tree is `weights_tree`. The queue's programs take
  the weights as such a list, which the host passes per call far faster than the nnx states."""
  target_state, draft_state = jax.tree.unflatten(weights_tree, weights)
  target = nnx.merge(target_def, target_state)
  return target, None if draft_def is None else nnx.merge(draft_def, draft_state)


def _refill_program(weights, state, inputs, prompt, prompt_lens, new_inputs, slots, key, table,
                    saved, resume, *, weights_tree, target_def, draft_def, cache_len, out_len,
                    prefill_chunk, packed=False):
  """Prefills K prompts ([K, T]; `packed`: [N] tokens of the K prompts one after another,
  `_pack_prompts`) and admits them into `slots` (module docstring).

  Paged caches (`table`: the host's [S, max_pages] block table, else None): the prefill writes
  through the slots' table rows. `saved` (per-row state entries, [K, ...] each, or None) and
  `resume` ([K] bool): a resumed row (a preempted one, `prompt` its prompt and committed tokens
  but the last) takes its saved state instead of the prefill's; only its caches are recomputed.
  """
  target, draft = _models(weights, weights_tree, target_def, draft_def)
  caches = {}
  if table is not None:
    caches = {name: SlotCaches.paged_rows(state[name], table, slots)
              for name in CACHE_KEYS if name in state}
  fresh = _prefill(target, draft, prompt, prompt_lens, new_inputs["max_new"], new_inputs["rows"],
                   new_inputs["stop_ids"], key, cache_len, out_len, new_inputs["stop_seqs"],
                   cache=caches.get("cache"), context=caches.get("context"), chunk=prefill_chunk,
                   packed=packed)
  if saved is not None:
    fresh = dict(fresh)
    for name, value in saved.items():
      base = fresh.get(name, jnp.zeros(value.shape, value.dtype))
      mask = resume.reshape(resume.shape + (1,) * (value.ndim - 1))
      fresh[name] = jnp.where(mask, value.astype(base.dtype), base)
  return _admit(state, inputs, fresh, new_inputs, slots, table)


def _chunk_program(weights, state, inputs, key, need, idle, *, weights_tree, target_def,
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
  target, draft = _models(weights, weights_tree, target_def, draft_def)
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


def _row_tokens(padded, lens, index, saved):
  """The tokens each refill row prefills: its prompt, or for a resumed one its prompt and
  committed tokens but the last (its anchor)."""
  rows = []
  for i in (int(i) for i in index):
    tokens = padded[i, :lens[i]]
    if i in saved:
      count = int(saved[i]["count"])
      tokens = np.concatenate([tokens, np.asarray(saved[i]["out"][:count - 1], np.int32)])
    rows.append(tokens)
  return rows


def _group_prompts(padded, lens, index, saved, cache_len, chunk=None):
  """The [K, T] tokens and [K] lengths a refill prefills (`_row_tokens`), right-padded to a
  length bucket T: the power of two at least the longest (and `MIN_BUCKET`), at most
  `cache_len`. Where that is over `chunk`, T is the most whole passes of `chunk` a slot holds
  instead: a chunked prefill's passes follow the longest row, so the padding costs nothing, every
  such refill of K rows is one program, and that program compiles one pass body (a partial last
  pass, needed only when the longest row reaches past the whole passes, would be a second copy of
  the forward)."""
  rows = _row_tokens(padded, lens, index, saved)
  row_lens = [tokens.size for tokens in rows]
  width = _group_width(max(row_lens), cache_len, chunk)
  group = np.zeros((len(rows), width), np.int32)
  for r, tokens in enumerate(rows):
    group[r, :tokens.size] = tokens
  return group, np.asarray(row_lens, lens.dtype)


def _group_width(longest: int, cache_len: int, chunk: int | None) -> int:
  """T of `_group_prompts` for a refill whose longest prompt has `longest` tokens."""
  width = min(bucket(longest, MIN_BUCKET), cache_len)
  if chunk is not None and width > chunk:
    whole = cache_len // chunk * chunk
    width = whole if longest <= whole else cache_len
  return width


def refill_form(lengths, rows: int, *, pack: bool, packs, cache_len: int,
                chunk: int | None) -> tuple[str, int]:
  """``("packed", N)`` or ``("padded", T)``: the refill program (`_refill_program`) that prefills
  prompts of `lengths` tokens in a refill of `rows` rows (the rows past them are padding), as
  `decoding.queue.Engine.generate` chooses it: packed into N tokens (`_pack_prompts`: a padding
  row is one token) where `pack`, N is at most `packing.prompt_limit` and ``packs(N)`` (the
  packed attention runs, `packing.packs`); else right-padded to T (`_group_prompts`)."""
  if pack:
    size = packing.prompt_size(sum(lengths) + rows - len(lengths))
    if size <= packing.prompt_limit(rows, chunk, cache_len) and packs(size):
      return ("packed", size)
  return ("padded", _group_width(max(lengths), cache_len, chunk))


def warm_up_groups(low: int, high: int, rows: int, form) -> list[list[int]]:
  """One refill's prompt lengths (1 to `rows` prompts of `low`..`high` tokens) for each refill
  program ``form(lengths)`` (`refill_form`) that such refills can meet, in the order found.

  Packed programs follow the refill's total tokens (padding rows one each), padded ones its
  longest prompt; where a longest prompt's refill can be either (packing stops past a size), its
  fullest refill (every row that long) is the padded one. So the candidates are one refill per
  packed size (the fewest prompts that reach it, balanced) and, per longest length, a refill of
  that prompt alone and one of `rows` such prompts."""
  groups = {}

  def add(lengths):
    groups.setdefault(form(lengths), lengths)

  def balanced(total: int) -> list[int] | None:    # total includes the padding rows' tokens
    for real in range(1, rows + 1):
      tokens = total - (rows - real)
      if real * low <= tokens <= real * high:
        base, extra = divmod(tokens, real)
        return [base + (i < extra) for i in range(real)]
    return None

  first, last = low + rows - 1, rows * high
  below, size = first - 1, packing.prompt_size(first)
  while below < last:
    for total in range(min(size, last), below, -1):   # the totals this size packs
      lengths = balanced(total)
      if lengths is not None:
        add(lengths)
        break
    below, size = size, packing.prompt_size(size + 1)
  for longest in range(low, high + 1):
    add([longest])
    add([longest] * rows)
  return list(groups.values())


def _pack_prompts(padded, lens, index, saved, real: int, limit: int):
  """The refill's prompts (`_row_tokens`) packed one after another (`packing.pack_prompts`;
  `rounds._packed_prefill_forward`), or None where they would pass `limit` tokens. Rows past the
  first `real` (a group's padding, dropped on admission) get one token each rather than a copy
  of a prompt."""
  rows = _row_tokens(padded, lens, index[:real], saved)
  packed = packing.pack_prompts(rows + [rows[0][:1]] * (len(index) - real), limit)
  return None if packed is None else (packed[0], packed[1].astype(lens.dtype))


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


def _trace_buffers(rounds, slots_n, gamma):
  """Zeroed `loop.RoundTrace` buffers (a dict) of `rounds` iterations over S slots."""
  return {"confidence": jnp.full((rounds, slots_n, gamma), jnp.nan, jnp.float32),
          "verify_lens": jnp.zeros((rounds, slots_n), jnp.int32),
          "accept_len": jnp.zeros((rounds, slots_n), jnp.int32),
          "active": jnp.zeros((rounds, slots_n), bool)}


def _empty_state(target, draft, schedule, slots_n, cache_len, out_len, all_inputs,
                 caches: bool = True, memo: dict | None = None):
  """The loop state of S idle slots: every per-row entry zeroed and ``done``; the global entries
  fresh (the schedule's `init` on S rows). ``caches=False`` (a paged queue, whose caches are its
  page pool) allocates no contiguous caches: `CACHE_KEYS` are left out. `memo` (an engine's):
  the state's shapes by everything they follow, so that a later call with the same ones does not
  trace the prefill again (a second or more of the host's time on a deep model)."""
  leaves, structure = jax.tree.flatten(all_inputs)
  key = (id(target), id(draft), repr(target.config), None if draft is None else repr(draft.config),
         slots_n, cache_len, out_len, caches, structure,
         tuple((np.shape(x)[1:], np.result_type(x)) for x in leaves))
  shaped = None if memo is None else memo.get(key)
  if shaped is None:
    one = jax.tree.map(lambda x: x[:1].repeat(slots_n, 0), all_inputs)

    def shapes():
      prompt = jnp.zeros((slots_n, MIN_BUCKET), jnp.int32)
      lens = jnp.ones((slots_n,), jnp.int32)
      return _prefill(target, draft, prompt, lens, one["max_new"], one["rows"], one["stop_ids"],
                      jax.random.key(0), cache_len, out_len, one["stop_seqs"])

    shaped = jax.eval_shape(shapes)
    if not caches:
      shaped = {k: v for k, v in shaped.items() if k not in CACHE_KEYS}
    if memo is not None:
      memo[key] = shaped
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shaped)
  state["done"] = jnp.ones((slots_n,), bool)
  if draft is not None:
    gamma = draft.config.gamma
    state["row_reached"] = jnp.zeros((slots_n, gamma), jnp.int32)
    state["row_hits"] = jnp.zeros((slots_n, gamma), jnp.int32)
    if schedule is not None:
      state.update(schedule_entries(schedule, slots_n, gamma))
  return state
