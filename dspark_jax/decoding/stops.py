"""Stop sequences: checking them on the host, and matching them inside the compiled loop.

This module owns how a row ends on what it generated, and the codes of why a row ended.

* **Host** (`stop_sequence_array`): stop sequences shared by every row (a sequence of token-id
  sequences) or per row (a list of B such lists) become one static [B, S, L] int32 array, each
  sequence left-aligned and padded with -1, unused sequence slots all -1. S and L are rounded up to
  powers of two so that other stop sequences of similar sizes reuse the compiled program.
* **In the loop** (`first_match`): each iteration appends C committed tokens to a row. The row's
  last L − 1 generated tokens (`history`, read from the output buffer) and the C new ones form a
  window; a sequence of length n *ends at* new slot j when the n window tokens ending at j equal it.
  Matches may span iterations and may start at the first generated token, never in the prompt
  (positions before the first generated token hold -2, which equals no id). The first slot where any
  of the row's sequences ends wins, and at that slot the sequence of smallest index; nothing after
  it is committed (`rounds` cuts the commit there).
* **Finish reasons**: `FINISH_LENGTH` (the budget ran out, or the row never ended),
  `FINISH_STOP_TOKEN`, `FINISH_STOP_SEQUENCE`; `FINISH_REASONS` names them. A stop token is a
  length-1 stop sequence in effect; where a stop token and a stop sequence end at the same token, the
  row reports the stop sequence (its index is the more specific answer).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

FINISH_LENGTH, FINISH_STOP_TOKEN, FINISH_STOP_SEQUENCE = 0, 1, 2
FINISH_REASONS = ("length", "stop_token", "stop_sequence")
"""`FINISH_REASONS[code]` is the name of a finish code."""

_BEFORE_START = -2
"""History slot before a row's first generated token: equal to no token id and to no padding."""


def _bucket(n: int) -> int:
  size = 1
  while size < n:
    size *= 2
  return size


def no_stop_sequences(batch: int) -> np.ndarray:
  """The [B, 0, 1] array of a decode without stop sequences (the matching code is not traced)."""
  return np.full((batch, 0, 1), -1, np.int32)


def _is_sequence(x) -> bool:
  return isinstance(x, (Sequence, np.ndarray, jax.Array)) and not isinstance(x, (str, bytes))


def _is_token(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _one_sequence(seq, where: str, vocab: int) -> np.ndarray:
  """One stop sequence as a 1-D int64 array, or ValueError naming `where` and the bad element."""
  if not _is_sequence(seq):
    raise ValueError(f"stop_sequences: {where} is {seq!r}; expected a sequence of token ids")
  values = np.asarray(seq) if isinstance(seq, (np.ndarray, jax.Array)) else None
  if values is None:
    for j, token in enumerate(seq):
      if not _is_token(token):
        raise ValueError(f"stop_sequences: {where} element {j} is {token!r}; expected an int "
                         "token id")
    values = np.asarray(list(seq), np.int64)
  elif values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
    raise ValueError(f"stop_sequences: {where} has shape {values.shape} of {values.dtype}; "
                     "expected a 1-D sequence of int token ids")
  if values.size == 0:
    raise ValueError(f"stop_sequences: {where} is empty")
  bad = (values < 0) | (values >= vocab)
  if bad.any():
    j = int(np.flatnonzero(bad)[0])
    raise ValueError(f"stop_sequences: {where} element {j} is {values[j]}; must be in "
                     f"[0, {vocab})")
  return values.astype(np.int64)


def _padded_rows(rows: list[list[np.ndarray]]) -> np.ndarray:
  count = max((len(r) for r in rows), default=0)
  if count == 0:
    return no_stop_sequences(len(rows))
  width = _bucket(max(s.size for r in rows for s in r))
  out = np.full((len(rows), _bucket(count), width), -1, np.int32)
  for b, row in enumerate(rows):
    for s, seq in enumerate(row):
      out[b, s, :seq.size] = seq
  return out


def _from_array(array: np.ndarray, batch: int, vocab: int) -> np.ndarray:
  """A [B, S, L] array, -1 padded: checked (ids in range, padding only after each sequence)."""
  if array.ndim != 3 or array.shape[0] != batch or array.dtype.kind not in "iu":
    raise ValueError(f"stop_sequences: an array must be [{batch}, S, L] int (-1 padded), got "
                     f"shape {array.shape} of {array.dtype}")
  values = array.astype(np.int64)
  bad = (values < -1) | (values >= vocab)
  if bad.any():
    b, s, j = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"stop_sequences: row {b} sequence {s} element {j} is {values[b, s, j]}; "
                     f"must be in [0, {vocab}) or -1 (padding)")
  pad = values < 0
  gap = pad[..., :-1] & ~pad[..., 1:]
  if gap.any():
    b, s, j = (int(i) for i in np.argwhere(gap)[0])
    raise ValueError(f"stop_sequences: row {b} sequence {s} element {j + 1} follows padding; "
                     "pad each sequence with -1 after its last id")
  if values.shape[1] == 0 or values.shape[2] == 0:
    return no_stop_sequences(batch)
  count, width = values.shape[1:]
  out = np.full((batch, _bucket(count), _bucket(width)), -1, np.int32)
  out[:, :count, :width] = values
  return out


def stop_sequence_array(stop_sequences, batch: int, vocab: int) -> np.ndarray:
  """Stop sequences as the static [B, S, L] int32 array the loop reads (-1 padded).

  Args:
    stop_sequences: ``()`` (none); sequences shared by every row, e.g. ``[[13, 7], [2]]``; per
      row, a list of B lists of sequences, e.g. ``[[[13, 7]], [], [[2], [5, 5]]]``; or a
      [B, S, L] integer array, each sequence -1 padded after its last id (an all -1 slot is unused).
    batch: B, the number of prompts. vocab: V; ids must be in [0, V).

  Returns:
    [B, S', L'] int32 with S' and L' powers of two >= S, L (zero sequences: [B, 0, 1]); a row's
    sequence s keeps index s, which `GenerateResult.stop_index` reports.

  Raises:
    ValueError: naming ``stop_sequences`` and the first bad element: an empty sequence, an id
      outside [0, V), an element that is not an int id, per-row lists of the wrong number of rows,
      or a mix of shared sequences and per-row lists.
  """
  if isinstance(stop_sequences, (np.ndarray, jax.Array)):
    return _from_array(np.asarray(stop_sequences), batch, vocab)
  if not _is_sequence(stop_sequences):
    raise ValueError(f"stop_sequences: expected a sequence of token-id sequences (or one list of "
                     f"them per row), got {type(stop_sequences).__name__}")
  entries = list(stop_sequences)
  if not entries:
    return no_stop_sequences(batch)
  for i, entry in enumerate(entries):
    if not _is_sequence(entry):
      raise ValueError(f"stop_sequences: entry {i} is {entry!r}; expected a sequence of token ids "
                       "(wrap a single sequence in a list: [[a, b]])")
  # Per row when an entry holds sequences; shared when an entry holds ids. All entries empty: per
  # row (no sequences) if there is one per row, else an empty shared sequence.
  first = next((e for e in entries if len(e)), None)
  per_row = (len(entries) == batch) if first is None else _is_sequence(first[0])
  if not per_row:
    shared = [_one_sequence(seq, f"sequence {i}", vocab) for i, seq in enumerate(entries)]
    return _padded_rows([shared] * batch)
  if len(entries) != batch:
    raise ValueError(f"stop_sequences: per-row lists for {len(entries)} rows but there are "
                     f"{batch} prompts")
  rows = []
  for b, row in enumerate(entries):
    for s, seq in enumerate(row):
      if not _is_sequence(seq):
        raise ValueError(f"stop_sequences: row {b} entry {s} is {seq!r}; per-row lists hold "
                         "sequences of token ids")
    rows.append([_one_sequence(seq, f"row {b} sequence {s}", vocab) for s, seq in enumerate(row)])
  return _padded_rows(rows)


def finish_reasons(codes) -> list[str]:
  """Names of finish codes ([B] ints): "length", "stop_token" or "stop_sequence"."""
  return [FINISH_REASONS[int(c)] for c in np.asarray(codes)]


def finish_codes(finished: jax.Array, stop_index: jax.Array | None) -> jax.Array:
  """[B] int32 finish codes from the loop's `finished` and, with stop sequences, `stop_index`."""
  codes = jnp.where(finished, FINISH_STOP_TOKEN, FINISH_LENGTH)
  if stop_index is not None:
    codes = jnp.where(stop_index >= 0, FINISH_STOP_SEQUENCE, codes)
  return codes.astype(jnp.int32)


# ---- inside the loop (pure) ---------------------------------------------------------------------


def history(out: jax.Array, count: jax.Array, width: int) -> jax.Array:
  """[B, width] int32: each row's last `width` generated tokens (``out[:, :count]``), oldest first;
  slots before the first generated token hold -2."""
  index = count[:, None] - width + jnp.arange(width, dtype=count.dtype)[None, :]
  tokens = jnp.take_along_axis(out, jnp.clip(index, 0, out.shape[1] - 1), axis=1)
  return jnp.where(index >= 0, tokens, _BEFORE_START).astype(jnp.int32)


def _right_aligned(sequences: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, S, L] sequences shifted so each ends at the last column (-1 before); and their lengths."""
  width = sequences.shape[2]
  lengths = jnp.sum(sequences >= 0, axis=2, dtype=jnp.int32)
  index = jnp.arange(width, dtype=jnp.int32)[None, None, :] - (width - lengths)[..., None]
  shifted = jnp.take_along_axis(sequences, jnp.clip(index, 0, width - 1), axis=2)
  return jnp.where(index >= 0, shifted, -1), lengths


def first_match(recent: jax.Array, committed: jax.Array, num_committed: jax.Array,
                sequences: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where a stop sequence first ends among the newly committed tokens (module docstring).

  Args:
    recent: [B, L-1] the row's previous generated tokens (`history`).
    committed: [B, C] the tokens this iteration commits; only the first `num_committed` count.
    num_committed: [B] int.
    sequences: [B, S, L] int32 stop sequences, left-aligned, -1 padded.

  Returns:
    ``(hit [B] bool, end [B] int32 slot of the first match (C when none), index [B] int32 the
    matched sequence (-1 when none))``.
  """
  batch, count, width = sequences.shape
  slots = committed.shape[1]
  aligned, lengths = _right_aligned(sequences)
  window = jnp.concatenate([recent.astype(jnp.int32), committed.astype(jnp.int32)], axis=1)
  index = jnp.arange(slots)[:, None] + jnp.arange(width)[None, :]           # [C, L]
  windows = window[:, index]                                                 # [B, C, L]
  equal = (windows[:, :, None, :] == aligned[:, None, :, :]) | (aligned[:, None, :, :] < 0)
  match = jnp.all(equal, axis=3) & (lengths[:, None, :] > 0)                 # [B, C, S]
  valid = jnp.arange(slots)[None, :] < num_committed[:, None]
  ends = jnp.any(match, axis=2) & valid                                      # [B, C]
  hit = jnp.any(ends, axis=1)
  end = jnp.where(hit, jnp.argmax(ends, axis=1), slots).astype(jnp.int32)
  at_end = jnp.take_along_axis(match, jnp.minimum(end, slots - 1)[:, None, None], axis=1)[:, 0]
  which = jnp.where(hit, jnp.argmax(at_end, axis=1), -1).astype(jnp.int32)
  return hit, end, which
