"""Confidence-scheduled verification: how many drafts of each row the target checks in a round.

This module owns the schedules (SPEC §7, DSpark paper §3.2.2, Algorithm 1, and §5.2) and the
throughput table they read. A schedule is a pair of pure functions, optax style::

  schedule = schedules.prefix(sps)
  state = schedule.init(batch_size, gamma)
  verify_lens, state = schedule.update(confidence, active, state)

* ``confidence`` [B, γ] float: the calibrated conditional confidence c_{r,k} ∈ [0, 1] of each draft
  (`DraftBlock.confidence`): P(draft k accepted | drafts < k accepted).
* ``active`` [B] bool: rows still decoding. Inactive rows get 1 and count for nothing (they add
  neither verify tokens nor expected accepts).
* ``verify_lens`` [B] int32 in 1..γ+1 is `verification.verify`'s argument: the anchor plus ℓ_r drafts.

``update`` is jit- and vmap-able, does no host synchronisation, and computes in float32 and int32
whether or not x64 is enabled. Shapes are checked always; confidence values only when they are
concrete (outside jit). Inside a compiled program a NaN confidence counts as 0 and values outside
[0, 1] are clipped.

**Survival.** a_{r,j} = Π_{i≤j} c_{r,i}, computed once in float32 by sequential multiplication
(`survivals`). Each factor lies in [0, 1] and rounding is monotone, so a_{r,j} ≤ a_{r,j−1} holds
exactly, ties included. Pairs (r, j) are admitted in the *admission order*: a descending, ties by
position j ascending, then row r ascending. Because survivals never increase along j and equal
values go position first, (r, j) always precedes (r, j + 1): any prefix of the admission order holds,
for each row, a prefix of its drafts, so ℓ_r is well defined. The candidates are the pairs of
active rows with a > 0 (Algorithm 1's candidate space); a zero-survival draft is never admitted.

**Throughput.** ``sps`` is a 1-D table: ``sps[n]`` is the target's verify steps per second with n
batch tokens (n ≥ 1; ``sps[0]`` is never read). With A active rows the walk starts at B = A tokens and
τ = A expected accepts, Θ_0 = τ·sps[B]; the k-th admission in the order adds 1 to B and its survival
to τ, Θ_k = τ_k·sps[A + k]. An admission that would reach ``len(sps)`` tokens is not made.

**The schedules.**

* `fixed`: every active row verifies its whole block (γ + 1).
* `threshold`: DeepSpec's static rule: ℓ_r = the number of leading positions with c_{r,k} ≥ t.
* `prefix`: Algorithm 1: admissions are kept while each raises Θ above the best so far; the walk
  stops at the first that does not. Whether (r, j) is admitted therefore reads only survivals ranked
  up to it, which depend on x_{r,<j} and on other rows, never on x_{r,j} itself: it is
  non-anticipating, hence lossless. **Plateaus.** A packed verify's cost is a step function of the
  batch tokens (one value per token bucket), and there Algorithm 1's test stalls at the first
  bucket boundary: one admission adds at most 1 to τ but costs the whole next bucket's drop. So an
  admission inside the plateau the walk stands in (the run of equal ``sps`` values) is made (it
  raises Θ), and one that enters a new plateau is tested on the Θ that plateau *guarantees*: its
  own survival plus, for the plateau's other tokens, the largest *frontiers* (each row's first
  pair not yet admitted; the entering pair's own row left out). The pairs the order admits there
  are at least as large, so once entered, the plateau ends at a Θ above the best so far, and the
  walk stops only at a plateau's edge: it never ends below Algorithm 1's Θ on the same
  confidences (the walks agree up to Algorithm 1's stop). On a table without equal neighbours this
  is exactly Algorithm 1. Whether (r, j) is admitted reads survivals ranked before it and the
  frontiers of the other rows (functions of their own drafts), never a survival of row r past j,
  so it is as lossless.
* `top_k`: the production variant (§5.2): a budget K = the first argmax over k of Θ_k with no early
  stop, computed on the survivals of `lag` rounds ago (all ones until `lag` rounds have run), then
  the K first pairs of the admission order on *current* survivals. K does not depend on the current
  draws and the rank of (r, j) depends on x_{r,<j} and other rows only, so it is lossless for
  ``lag >= 1``. ``lag = 0`` computes K on the current survivals: that is Algorithm 1 without its
  early stop, the retrospective search of the paper's Appendix A, which is *not* lossless (offered
  to measure what the early stop costs, and to check that the law tests can see the bias).

**What verify checks, and the caller's part.** A row's ``verify_len = 1 + ℓ_r`` puts the anchor and
drafts 1..ℓ_r into the target's batch; `verification.verify` then checks drafts 1..ℓ_r + 1 (draft
ℓ_r + 1, when accepted, is the bonus). So x_{r,j} is checked iff ℓ_r ≥ j − 1, an event that these
schedules (except ``top_k(lag=0)``) decide from x_{r,<j−1}: one step of margin. The guarantee also
needs each round's drafts to be drawn with randomness that nothing the schedule has seen was drawn
with: a later round that redraws a position with the noise an earlier round used there (noise keyed
by absolute position only) lets a lagged budget, which read the earlier draft's survival, depend on
the new draft; tests/test_schedule_law.py shows the bias. Fold a per-round counter into the draft's
key.

The table: `load_sps` / `save_sps` read and write ``{"batch_tokens": [...], "steps_per_second": [...],
"device": ..., "date": ...}`` (JSON); `load_sps` fills the dense array by linear interpolation between
measured batch sizes.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import validation


class Schedule(NamedTuple):
  """A verify-length schedule as two pure functions, and the token buckets its table assumes.

  Attributes:
    init: ``init(batch_size, gamma) -> state``, a pytree of arrays with static shapes.
    update: ``update(confidence [B, γ], active [B] bool, state) -> (verify_lens [B] int32, state)``.
    buckets: the static token counts the packed verify packs into, ascending, the last B·(γ + 1)
      (a profile's `SpsProfile.buckets`: the sizes its table was measured at that are faster than
      every larger one); None, or a set for another batch: `decoding.packing.token_buckets`.
  """

  init: Callable[[int, int], Any]
  update: Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
  buckets: tuple[int, ...] | None = None


class EmptyState(NamedTuple):
  """The state of a schedule that keeps nothing between rounds (`fixed`, `threshold`, `prefix`)."""


class TopKState(NamedTuple):
  """The state of `top_k`.

  Attributes:
    history: [lag, B, γ] float32 survivals of the last `lag` rounds, oldest first; a row that was
      inactive in a round, and every round before the first `lag`, holds ones.
  """

  history: jax.Array


# ---- checks ---------------------------------------------------------------------------------------


def _check_init(batch_size, gamma) -> tuple[int, int]:
  return (validation.check_positive_int("batch_size", batch_size),
          validation.check_positive_int("gamma", gamma))


def _check_update(confidence, active) -> tuple[jax.Array, jax.Array]:
  """Shapes always, values when concrete; returns float32 confidences in [0, 1] and bool `active`."""
  confidence = validation.as_array("confidence", confidence)
  active = validation.as_array("active", active)
  if np.ndim(confidence) != 2:
    raise ValueError(f"confidence: expected shape [B, γ], got {np.shape(confidence)}")
  batch, gamma = np.shape(confidence)
  if batch < 1 or gamma < 1:
    raise ValueError(f"confidence: expected B >= 1 rows and γ >= 1 positions, got "
                     f"{np.shape(confidence)}")
  if not jnp.issubdtype(confidence.dtype, jnp.floating):
    raise ValueError(f"confidence: expected floats, got dtype {confidence.dtype}")
  if np.shape(active) != (batch,):
    raise ValueError(f"active: expected shape ({batch},), got {np.shape(active)}")
  if active.dtype != np.bool_:
    raise ValueError(f"active: expected bool, got dtype {active.dtype}")
  if not validation.is_traced(confidence):
    host = np.asarray(confidence, np.float64)
    bad = ~((host >= 0) & (host <= 1))  # NaN is bad too
    if bad.any():
      index = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"confidence: element {list(index)} is {host[index]}; must be in [0, 1]")
  c = jnp.asarray(confidence).astype(jnp.float32)
  c = jnp.where(jnp.isnan(c), jnp.float32(0), jnp.clip(c, 0, 1))
  return c, jnp.asarray(active)


def _table_and_buckets(sps) -> tuple[np.ndarray, tuple[int, ...] | None]:
  """A table argument -> (the checked dense table, the buckets to pack into or None): an
  `SpsProfile` gives its `dense` table and its `buckets`; an array, itself and None."""
  if callable(getattr(sps, "dense", None)) and callable(getattr(sps, "buckets", None)):
    return _check_sps(sps.dense()), sps.buckets()
  return _check_sps(sps), None


def _check_sps(sps) -> np.ndarray:
  """`sps` as a float32 host array; sps[1:] must be finite and > 0 (sps[0] is never read: set to 0)."""
  if validation.is_traced(sps):
    raise ValueError("sps: expected a concrete table (a NumPy array or list), got a traced value")
  sps = validation.as_array("sps", sps)
  host = np.asarray(sps)
  if host.ndim != 1:
    raise ValueError(f"sps: expected a 1-D table (sps[n] = steps per second at n batch tokens), "
                     f"got shape {host.shape}")
  if host.shape[0] < 2:
    raise ValueError(f"sps: needs an entry for n = 1 at least (length >= 2), got length "
                     f"{host.shape[0]}")
  if host.dtype.kind not in "iuf":
    raise ValueError(f"sps: expected numbers, got dtype {host.dtype}")
  values = host.astype(np.float64)
  with np.errstate(over="ignore"):
    narrow = values.astype(np.float32)
  bad = ~(np.isfinite(values) & np.isfinite(narrow) & (values > 0) & (narrow > 0))
  bad[0] = False
  if bad.any():
    n = int(np.flatnonzero(bad)[0])
    raise ValueError(f"sps: entry {n} is {values[n]}; sps[n] for n >= 1 must be finite and > 0 "
                     "(in float32)")
  narrow[0] = 0.0
  return narrow


def _fit_table(table: np.ndarray, batch: int, gamma: int) -> tuple[np.ndarray, np.ndarray]:
  """The table cut or zero-padded to the B·(γ + 1) + 1 entries a round can read, and its length.

  The compiled cores then depend on (B, γ) only, not on the table's length.
  """
  size = batch * (gamma + 1) + 1
  fitted = np.zeros(size, np.float32)
  fitted[:min(size, table.shape[0])] = table[:size]
  return fitted, np.int32(min(table.shape[0], size))


def _check_unit(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
    raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
  value = float(value)
  if not 0.0 <= value <= 1.0:  # NaN fails too
    raise ValueError(f"{name}: must be in [0, 1], got {value}")
  return value


# ---- the pieces -----------------------------------------------------------------------------------


def survivals(confidence: jax.Array) -> jax.Array:
  """[B, γ] float32 prefix survivals a_{r,j} = Π_{i≤j} c_{r,i}, multiplied left to right.

  Sequential products (not a scan), so the values are the same in every program, and a_{r,j} ≤
  a_{r,j−1} exactly for confidences in [0, 1]. A value below float32's smallest normal number
  (about 1.2e-38) is 0: XLA may flush subnormals on one device and not on another, so they are
  flushed everywhere.
  """
  c = jnp.asarray(confidence, jnp.float32)
  tiny = jnp.float32(np.finfo(np.float32).tiny)

  def flush(x):
    return jnp.where(x < tiny, jnp.float32(0), x)

  columns = [flush(c[:, 0])]
  for j in range(1, c.shape[1]):
    columns.append(flush(columns[-1] * c[:, j]))
  return jnp.stack(columns, axis=1)


def _admission_order(a: jax.Array, candidate: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sorts the pairs of `a` [B, γ] into the admission order.

  Returns:
    (sorted survivals [B·γ] (0 past the candidates), rank [B, γ] int32 of each pair in the order,
    number of candidates, int32).
  """
  batch, gamma = a.shape
  flat_a = a.T.reshape(-1)  # position-major: flat index = j·B + r, so index order = (j, r) order
  flat_candidate = candidate.T.reshape(-1)
  index = jnp.arange(batch * gamma, dtype=jnp.int32)
  key = jnp.where(flat_candidate, -flat_a, jnp.float32(jnp.inf))  # candidates have a > 0: no -0.0
  _, order = jax.lax.sort((key, index), num_keys=2)
  sorted_a = jnp.where(flat_candidate[order], flat_a[order], jnp.float32(0))
  rank = jnp.zeros(batch * gamma, jnp.int32).at[order].set(index)
  count = jnp.sum(flat_candidate, dtype=jnp.int32)
  return sorted_a, rank.reshape(gamma, batch).T, count


def _expected_accepts(sorted_a: jax.Array, n_active: jax.Array) -> jax.Array:
  """τ_k = A + the first k survivals of the admission order, for k = 0..B·γ (float32 [B·γ + 1])."""
  return jnp.cumsum(jnp.concatenate([n_active.astype(jnp.float32)[None], sorted_a]))


def _throughput_path(sorted_a: jax.Array, count: jax.Array, n_active: jax.Array, sps: jax.Array,
                     limit: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Θ_k = τ_k·sps[A + k] for k = 0..B·γ along the admission order, and which k may be made.

  Returns:
    (theta [B·γ + 1] float32, possible [B·γ + 1] bool); k = 0 (no admission) is always possible,
    k ≥ 1 when there are k candidates and A + k < `limit` (the table's length).
  """
  steps = jnp.arange(sorted_a.shape[0] + 1, dtype=jnp.int32)
  tau = _expected_accepts(sorted_a, n_active)
  tokens = n_active + steps
  theta = tau * sps[jnp.clip(tokens, 0, sps.shape[0] - 1)]
  possible = (steps <= count) & (tokens < limit)
  return theta, possible | (steps == 0)


def _lengths(admitted: jax.Array, active: jax.Array) -> jax.Array:
  """verify_lens from an admitted mask [B, γ]: 1 + the number of leading admitted drafts."""
  leading = jnp.cumprod(admitted.astype(jnp.int32), axis=1).sum(axis=1, dtype=jnp.int32)
  return jnp.where(active, 1 + leading, 1).astype(jnp.int32)


def _empty_init(batch_size, gamma) -> EmptyState:
  _check_init(batch_size, gamma)
  return EmptyState()


def _check_empty_state(state) -> None:
  if not isinstance(state, EmptyState):
    raise ValueError(f"state: expected the EmptyState from this schedule's init, got "
                     f"{type(state).__name__}")


# ---- the schedules --------------------------------------------------------------------------------


def fixed() -> Schedule:
  """Every active row verifies its whole block: verify_lens = γ + 1 (inactive rows: 1)."""

  def update(confidence, active, state):
    _check_empty_state(state)
    c, active = _check_update(confidence, active)
    return jnp.where(active, c.shape[1] + 1, 1).astype(jnp.int32), state

  return Schedule(_empty_init, update)


def threshold(t: float) -> Schedule:
  """DeepSpec's static rule: ℓ_r = the number of leading positions k with c_{r,k} ≥ t.

  Args:
    t: the threshold in [0, 1] (0 verifies every draft; a NaN confidence never passes t > 0).
  """
  t = _check_unit("t", t)

  def update(confidence, active, state):
    _check_empty_state(state)
    c, active = _check_update(confidence, active)
    return _lengths(c >= jnp.float32(t), active), state

  return Schedule(_empty_init, update)


@jax.jit
def _prefix_lens(c: jax.Array, active: jax.Array, table: jax.Array, limit: jax.Array) -> jax.Array:
  """Algorithm 1 with the plateau test (module docstring) on checked inputs and a `_fit_table`
  table."""
  batch, gamma = c.shape
  a = survivals(c)
  candidate = active[:, None] & (a > 0)
  sorted_a, rank, count = _admission_order(a, candidate)
  n_active = jnp.sum(active, dtype=jnp.int32)
  theta, possible = _throughput_path(sorted_a, count, n_active, table, limit)
  # Before the k-th admission (k = 0..B·γ-1, pair (r_k, j_k)): each row's frontier, the survival of
  # its first pair not yet admitted (0 past γ or for a non-candidate), row r_k's left out.
  row = jnp.zeros(batch * gamma, jnp.int32).at[rank.reshape(-1)].set(
      jnp.repeat(jnp.arange(batch, dtype=jnp.int32), gamma))
  mine = jax.nn.one_hot(row, batch, dtype=jnp.int32)                       # [B·γ, B]
  made_before = jnp.cumsum(mine, axis=0) - mine                             # [B·γ, B]
  padded = jnp.concatenate([jnp.where(candidate, a, 0.0), jnp.zeros((batch, 1), a.dtype)], axis=1)
  frontier = padded[jnp.arange(batch)[None, :], made_before]               # [B·γ, B]
  frontier = jnp.where(mine > 0, 0.0, frontier)
  # The plateau (run of equal `table` values) the k-th admission's tokens t_k = A + k + 1 fall in.
  index = jnp.arange(table.shape[0], dtype=jnp.int32)
  last = (index + 1 >= limit) | (table != jnp.roll(table, -1))
  plateau_end = jax.lax.cummin(jnp.where(last, index, table.shape[0]), reverse=True)
  tokens = jnp.clip(n_active + 1 + jnp.arange(batch * gamma, dtype=jnp.int32), 1,
                    table.shape[0] - 1)
  entry = table[tokens] != table[tokens - 1]
  # A guaranteed fill of the plateau: its other tokens taken by the largest frontiers (the pairs
  # the order admits there are at least as large), read from no later pair of row r_k.
  largest = jnp.cumsum(-jnp.sort(-frontier, axis=1), axis=1)
  largest = jnp.concatenate([jnp.zeros((batch * gamma, 1), largest.dtype), largest], axis=1)
  others = jnp.clip(plateau_end[tokens] - tokens, 0, batch)
  fill = jnp.take_along_axis(largest, others[:, None], axis=1)[:, 0]
  tau = _expected_accepts(sorted_a, n_active)[1:]
  floor = (tau + fill) * table[tokens]
  better = possible[1:] & (~entry | (floor > jax.lax.cummax(theta)[:-1]))
  made = jnp.sum(jnp.cumprod(better.astype(jnp.int32)), dtype=jnp.int32)
  return _lengths(candidate & (rank < made), active)


@jax.jit
def _top_k_lens(c: jax.Array, active: jax.Array, history: jax.Array, table: jax.Array,
                limit: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The lagged top-K on checked inputs and a `_fit_table` table; the lag is ``history.shape[0]``."""
  lag = history.shape[0]
  a = survivals(c)
  n_active = jnp.sum(active, dtype=jnp.int32)
  past = history[0] if lag else a
  past_candidate = active[:, None] & (past > 0)
  past_sorted, _, past_count = _admission_order(past, past_candidate)
  theta, possible = _throughput_path(past_sorted, past_count, n_active, table, limit)
  budget = jnp.argmax(jnp.where(possible, theta, -jnp.inf)).astype(jnp.int32)
  candidate = active[:, None] & (a > 0)
  _, rank, _ = _admission_order(a, candidate)
  lens = _lengths(candidate & (rank < budget), active)
  if lag:
    recorded = jnp.where(active[:, None], a, jnp.float32(1))
    history = jnp.concatenate([history[1:], recorded[None]], axis=0)
  return lens, history


def prefix(sps) -> Schedule:
  """Algorithm 1 (the hardware-aware prefix scheduler), with its early stop.

  Admissions are made in the admission order (module docstring) while each one raises
  Θ = τ·sps[B] strictly above the best so far; the walk stops at the first that does not, at the
  last candidate, or before an admission that would reach ``len(sps)`` tokens. On a step table an
  admission that enters a new plateau is tested on the Θ the plateau guarantees (module docstring,
  Plateaus); the result's Θ is never below Algorithm 1's own.

  Args:
    sps: 1-D table, ``sps[n]`` = verify steps per second at n batch tokens; ``sps[n]`` for n ≥ 1 must
      be finite and > 0 (``sps[0]`` is not read). Or an `SpsProfile` (`profile_sps`): its `dense`
      table, and the decoding loop packs into its `buckets` (`Schedule.buckets`).
  """
  table, buckets = _table_and_buckets(sps)

  def update(confidence, active, state):
    _check_empty_state(state)
    c, active = _check_update(confidence, active)
    return _prefix_lens(c, active, *_fit_table(table, *c.shape)), state

  return Schedule(_empty_init, update, buckets)


def top_k(sps, lag: int = 2) -> Schedule:
  """The production variant: a budget K from the survivals of `lag` rounds ago, then top-K now.

  K is the first argmax over k = 0, 1, ... of Θ_k (no early stop) along the admission order of the
  lagged survivals of the currently active rows, candidates a > 0, capped by ``len(sps)``; until
  `lag` rounds have run (and for a row that was inactive then) the lagged survivals are ones. Then
  the first K pairs of the admission order of the current survivals are verified (all current
  candidates when there are fewer than K).

  Args:
    sps: 1-D throughput table, or an `SpsProfile` (see `prefix`).
    lag: rounds between the survivals that set the budget and the round that uses it; an integer
      ≥ 0. ``lag = 0`` is the anticipating search of the paper's Appendix A: NOT lossless.

  State: `TopKState` (``history`` [lag, B, γ] float32).
  """
  table, buckets = _table_and_buckets(sps)
  lag = validation.check_nonnegative_int("lag", lag)

  def init(batch_size, gamma):
    batch_size, gamma = _check_init(batch_size, gamma)
    return TopKState(history=jnp.ones((lag, batch_size, gamma), jnp.float32))

  def update(confidence, active, state):
    c, active = _check_update(confidence, active)
    batch, gamma = c.shape
    if not isinstance(state, TopKState):
      raise ValueError(f"state: expected the TopKState from top_k's init, got "
                       f"{type(state).__name__}")
    if np.shape(state.history) != (lag, batch, gamma):
      raise ValueError(f"state: history has shape {np.shape(state.history)}; this update needs "
                       f"({lag}, {batch}, {gamma}) (lag, B, γ)")
    lens, history = _top_k_lens(c, active, jnp.asarray(state.history, jnp.float32),
                                *_fit_table(table, batch, gamma))
    return lens, TopKState(history=history)

  return Schedule(init, update, buckets)


# ---- the throughput table -------------------------------------------------------------------------


MAX_BATCH_TOKENS = 2**24
"""The largest batch size a throughput table may name (its dense form is float64 [size + 1])."""


def _table_points(name: str, batch_tokens, steps_per_second) -> tuple[np.ndarray, np.ndarray]:
  """Measured points as (int64 [M] strictly increasing, ≥ 1; float64 [M] finite, > 0)."""
  tokens = np.asarray(batch_tokens)
  rates = np.asarray(steps_per_second)
  if tokens.ndim != 1 or tokens.shape[0] < 1:
    raise ValueError(f"{name}: batch_tokens must be a non-empty list, got shape {tokens.shape}")
  if rates.shape != tokens.shape:
    raise ValueError(f"{name}: steps_per_second has shape {rates.shape}; batch_tokens has "
                     f"{tokens.shape}")
  if tokens.dtype.kind not in "iu" and not (tokens.dtype.kind == "f" and
                                            np.all(np.mod(tokens, 1) == 0)):
    raise ValueError(f"{name}: batch_tokens must be integers, got {tokens.tolist()[:8]}")
  if rates.dtype.kind not in "iuf":
    raise ValueError(f"{name}: steps_per_second must be numbers, got dtype {rates.dtype}")
  tokens = tokens.astype(np.int64)
  rates = rates.astype(np.float64)
  bad = tokens < 1
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{name}: batch_tokens[{i}] is {tokens[i]}; must be >= 1")
  bad = tokens > MAX_BATCH_TOKENS
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{name}: batch_tokens[{i}] is {tokens[i]}; must be <= {MAX_BATCH_TOKENS} (the "
                     "dense table holds one float per batch size up to the largest)")
  bad = np.diff(tokens) <= 0
  if bad.any():
    i = int(np.flatnonzero(bad)[0]) + 1
    raise ValueError(f"{name}: batch_tokens[{i}] is {tokens[i]}; must be strictly increasing")
  bad = ~(np.isfinite(rates) & (rates > 0))
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{name}: steps_per_second[{i}] is {rates[i]}; must be finite and > 0")
  return tokens, rates


def dense_sps(batch_tokens, steps_per_second) -> np.ndarray:
  """The dense table from measured points: float64 [max(batch_tokens) + 1].

  ``sps[n]`` is interpolated linearly between the measured batch sizes around n, equals the first
  measurement below the smallest measured size, and ``sps[0]`` (never read) repeats ``sps[1]``.
  """
  tokens, rates = _table_points("table", batch_tokens, steps_per_second)
  n = np.arange(tokens[-1] + 1)
  out = np.interp(n, tokens, rates)
  out[0] = out[1]
  return out


def save_sps(path: str | os.PathLike, table, meta: Mapping[str, Any]) -> None:
  """Writes a throughput table as JSON.

  Args:
    path: the file to write.
    table: the measurements: a mapping {batch tokens: steps per second}, or a pair of sequences
      (batch_tokens, steps_per_second); batch tokens integers ≥ 1, rates finite and > 0.
    meta: at least ``device`` (a description of the accelerator) and ``date`` (ISO 8601); other
      JSON-serialisable keys (model shapes, context length) are stored as they are.

  Raises:
    ValueError: a bad table or meta.
  """
  if isinstance(table, Mapping):
    pairs = sorted(table.items())
    tokens, rates = [k for k, _ in pairs], [v for _, v in pairs]
  elif isinstance(table, Sequence) and len(table) == 2:
    tokens, rates = table
  else:
    raise ValueError("table: expected {batch_tokens: steps_per_second} or a pair "
                     f"(batch_tokens, steps_per_second), got {type(table).__name__}")
  tokens, rates = _table_points("table", tokens, rates)
  if not isinstance(meta, Mapping):
    raise ValueError(f"meta: expected a mapping with 'device' and 'date', got {type(meta).__name__}")
  missing = [k for k in ("device", "date") if k not in meta]
  if missing:
    raise ValueError(f"meta: missing {missing}")
  clash = [k for k in ("batch_tokens", "steps_per_second") if k in meta]
  if clash:
    raise ValueError(f"meta: {clash} belong to the table, not to meta")
  document = {"batch_tokens": [int(t) for t in tokens],
              "steps_per_second": [float(r) for r in rates], **dict(meta)}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(document, f, indent=1)
    f.write("\n")


def load_sps(path: str | os.PathLike) -> np.ndarray:
  """Reads a table written by `save_sps` into the dense float64 array `prefix` and `top_k` take.

  The measured points are interpolated linearly (`dense_sps`); the array ends at the largest
  measured batch size, so a schedule never admits past it.

  Raises:
    ValueError: the file is not JSON, lacks ``batch_tokens`` / ``steps_per_second``, or holds bad
      values (each named with the file).
  """
  try:
    with open(path, encoding="utf-8") as f:
      document = json.load(f)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}: not a JSON throughput table ({error})") from error
  if not isinstance(document, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(document).__name__}")
  missing = [k for k in ("batch_tokens", "steps_per_second") if k not in document]
  if missing:
    raise ValueError(f"{path}: missing {missing}")
  try:
    tokens = np.asarray(document["batch_tokens"])
    rates = np.asarray(document["steps_per_second"], np.float64)
  except (TypeError, ValueError) as error:
    raise ValueError(f"{path}: batch_tokens / steps_per_second must be lists of numbers") from error
  tokens, rates = _table_points(str(path), tokens, rates)
  return dense_sps(tokens, rates)
