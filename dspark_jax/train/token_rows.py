"""Pre-tokenized drafter training data: an ``.npz`` of token rows and their loss mask.

This module owns the second form of data `dspark_jax.train.drafter.train_drafter` takes, for data
already tokenized with the target's tokenizer (a pipeline of your own, or the target's own
continuations as `scripts/train_pair.py` makes them):

* **File.** A NumPy ``.npz`` with two arrays of one shape [N, L]: ``tokens`` (integers in
  0 .. V - 1, V the target's vocabulary) and ``loss_mask`` (bool, or integers 0/1): true on the
  tokens the drafter learns to predict, as a conversation's response tokens are. Rows are used as
  they are: L is the sequence length (the ``seq_len`` option applies to conversations only), and
  positions run 0 .. L - 1 along each row.
* **Checks** (`read_token_rows`). Every refusal is a `conversations.DataError` naming the file, the
  array and the first bad element: a file that is not an ``.npz``, a missing array, a shape that is
  not [N, L] with N ≥ 1 and L ≥ 2 or that differs between the two, a non-integer ``tokens``, a
  token outside the vocabulary, a mask entry other than 0/1, a row whose mask has no true entry.
* **Held-out prompts** (`heldout_prompts`). A held-out row's prompt is its tokens before its first
  masked one (the decode then continues it for the held-out τ); a row whose mask starts at token 0
  has no prompt and is refused by name.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from dspark_jax import validation
from dspark_jax.train import conversations as cv

TOKENS = "tokens"
MASK = "loss_mask"


def is_token_rows(path: str | os.PathLike) -> bool:
  """Whether `path` names pre-tokenized rows (an ``.npz``) rather than conversation jsonl."""
  return os.fspath(path).lower().endswith(".npz")


def read_token_rows(path: str | os.PathLike, vocab_size: int) -> cv.Packed:
  """The rows of the ``.npz`` at `path` (module docstring), checked against `vocab_size`, as
  `conversations.Packed` (``lines[r] == [r]``: row r of the file).

  Raises:
    DataError: bad data, naming the file, the array and the first bad element.
  """
  where = os.fspath(path)
  try:
    with np.load(where, allow_pickle=False) as data:
      arrays = {name: data[name] for name in data.files}
  except (OSError, ValueError, zipfile.BadZipFile) as error:
    raise cv.DataError(f"{where}: not a .npz of arrays ({error})") from None
  for name in (TOKENS, MASK):
    if name not in arrays:
      raise cv.DataError(f"{where}: no array {name!r} (found: {sorted(arrays) or 'none'}); "
                         f"expected {TOKENS!r} and {MASK!r}, both [N, L]")
  tokens, mask = arrays[TOKENS], arrays[MASK]
  if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
    raise cv.DataError(f"{where}: {TOKENS} has shape {tokens.shape}; expected [N, L] with N >= 1 "
                       "rows of L >= 2 tokens")
  if mask.shape != tokens.shape:
    raise cv.DataError(f"{where}: {MASK} has shape {mask.shape}, {TOKENS} {tokens.shape}; they "
                       "must match")
  if tokens.dtype.kind not in "iu":
    raise cv.DataError(f"{where}: {TOKENS} has dtype {tokens.dtype}; expected integer token ids")
  bad = (tokens < 0) | (tokens >= vocab_size)
  if bad.any():
    r, c = validation.first_index(bad)
    raise cv.DataError(f"{where}: {TOKENS}[{r}, {c}] = {int(tokens[r, c])} is outside the "
                       f"target's vocabulary 0..{vocab_size - 1}")
  if mask.dtype != np.bool_:
    if mask.dtype.kind not in "iu":
      raise cv.DataError(f"{where}: {MASK} has dtype {mask.dtype}; expected bool or 0/1 integers")
    bad = (mask != 0) & (mask != 1)
    if bad.any():
      r, c = validation.first_index(bad)
      raise cv.DataError(f"{where}: {MASK}[{r}, {c}] = {int(mask[r, c])}; expected 0 or 1")
  mask = mask.astype(bool)
  empty = ~mask.any(axis=1)
  if empty.any():
    raise cv.DataError(f"{where}: {MASK} row {int(np.flatnonzero(empty)[0])} has no true entry: "
                       "the row has nothing to learn")
  return cv.Packed(tokens.astype(np.int32), mask, [[r] for r in range(tokens.shape[0])])


def heldout_prompts(rows: cv.Packed, where: str) -> list[list[int]]:
  """Each row's tokens before its first masked one (module docstring).

  Raises:
    DataError: a row whose mask starts at its first token (naming `where` and the row).
  """
  prompts = []
  for r in range(rows.tokens.shape[0]):
    start = int(np.argmax(rows.mask[r]))
    if start == 0:
      raise cv.DataError(f"{where}: held-out row {rows.lines[r][0]} has no prompt (its "
                         f"{MASK} is true from token 0); a held-out row's prompt is its tokens "
                         "before the first masked one")
    prompts.append(rows.tokens[r, :start].tolist())
  return prompts
