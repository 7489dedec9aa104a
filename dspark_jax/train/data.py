"""Training data: the Python standard-library corpus and its byte-level BPE tokenizer.

This module owns the text every machine has and how it becomes token ids:

* **Corpus.** The ``.py`` files of the running interpreter's standard library (real code, docstrings
  and comments; ``site-packages`` excluded), read as UTF-8. The split is by file and deterministic: a
  file is held out iff the CRC-32 of its path relative to the library root is 0 mod 20 (≈ 5 %), so
  the same interpreter version always gives the same split. `corpus_info` records the version.
* **Tokenizer.** A byte-level BPE (the `tokenizers` library) trained on the train split, vocabulary
  8192 by default, with two reserved tokens: ``<|endoftext|>`` (id 0, separates files) and
  ``<|mask|>`` (id 1, the DSpark block filler).
* **Arrays.** `encode_files` joins encoded files with end-of-text into one uint16 stream.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

END_OF_TEXT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (END_OF_TEXT, MASK)
END_OF_TEXT_ID, MASK_ID = 0, 1
DEFAULT_VOCAB_SIZE = 8192
HELD_OUT_MODULUS = 20


def stdlib_root() -> str:
  """The running interpreter's standard-library directory."""
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted paths (relative to `root`) of the library's ``.py`` files, site-packages excluded."""
  root = root or stdlib_root()
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages",
                                                        "__pycache__"))
    for name in files:
      if name.endswith(".py"):
        found.append(os.path.relpath(os.path.join(directory, name), root))
  return sorted(found)


def is_held_out(relative_path: str) -> bool:
  """The deterministic split: held out iff crc32(path) % 20 == 0."""
  return zlib.crc32(relative_path.replace(os.sep, "/").encode()) % HELD_OUT_MODULUS == 0


def split_files(files: Sequence[str]) -> tuple[list[str], list[str]]:
  """(train, held_out) lists of relative paths."""
  held = [f for f in files if is_held_out(f)]
  return [f for f in files if not is_held_out(f)], held


def read_texts(files: Iterable[str], root: str | None = None) -> list[str]:
  """File contents as text (undecodable bytes replaced); empty files skipped."""
  root = root or stdlib_root()
  texts = []
  for relative in files:
    with open(os.path.join(root, relative), "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    if text.strip():
      texts.append(text)
  return texts


def corpus_info(root: str | None = None) -> dict:
  """What the corpus is: interpreter version, root, file counts and sizes of each split."""
  root = root or stdlib_root()
  train, held = split_files(stdlib_files(root))
  size = lambda files: sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return {"python_version": sys.version.split()[0], "implementation": sys.implementation.name,
          "root": root, "train_files": len(train), "held_out_files": len(held),
          "train_bytes": size(train), "held_out_bytes": size(held),
          "split_rule": f"held out iff crc32(relative path) % {HELD_OUT_MODULUS} == 0"}


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
  """A byte-level BPE trained on `texts`; the special tokens get ids 0 (end of text) and 1 (mask)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer=trainer)
  check_tokenizer(tokenizer)
  return tokenizer


def check_tokenizer(tokenizer) -> None:
  """Raises ValueError unless the reserved ids are where this module says."""
  for token, expected in ((END_OF_TEXT, END_OF_TEXT_ID), (MASK, MASK_ID)):
    got = tokenizer.token_to_id(token)
    if got != expected:
      raise ValueError(f"tokenizer: {token!r} has id {got}, expected {expected}")


def load_tokenizer(path: str):
  """Loads a tokenizer saved with ``tokenizer.save(path)`` and checks its reserved ids."""
  from tokenizers import Tokenizer

  tokenizer = Tokenizer.from_file(path)
  check_tokenizer(tokenizer)
  return tokenizer


def encode_files(tokenizer, texts: Sequence[str]) -> np.ndarray:
  """One uint16 stream: each text's ids followed by end-of-text."""
  if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
    raise ValueError("tokenizer: vocabulary too large for uint16 token arrays")
  encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
  parts = []
  for item in encoded:
    parts.append(np.asarray(item.ids, np.uint16))
    parts.append(np.array([END_OF_TEXT_ID], np.uint16))
  return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)
