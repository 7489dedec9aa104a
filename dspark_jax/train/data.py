"""Training data: the Python source corpus and its byte-level BPE tokenizer.

This module owns the text every machine has and how it becomes token ids:

* **Standard library.** The ``.py`` files of the running interpreter's standard library (real code,
  docstrings and comments; ``site-packages`` excluded), read as UTF-8 (`stdlib_files`).
* **Packages.** The pure-Python sources (``*.py``) of installed scientific packages
  (`DEFAULT_PACKAGES`), found with ``importlib.util.find_spec`` without importing them
  (`package_files`). Packages that are not installed are skipped.
* **Corpus.** `collect_corpus` takes the standard library's files, then the packages' files, each
  group in the order of the SHA-256 of their keys (`priority`: deterministic, packages mixed); it
  drops files larger than ``max_file_bytes``, empty ones and exact duplicates by content (SHA-256;
  the first taken is kept), and stops at the first file that would pass the byte cap. Its ``info``
  records the interpreter, each package's name, version, file count and bytes, the totals and the
  rules.
* **Split.** By file and deterministic: a file is held out iff the CRC-32 of its key is 0 mod 20
  (≈ 5 %). The key of a standard-library file is its path relative to the library root, of a package
  file its path relative to the directory holding the package (``numpy/linalg/_linalg.py``), with
  ``/`` separators; so the same interpreter and package versions always give the same split.
* **Tokenizer.** A byte-level BPE (the `tokenizers` library) trained on the train split, vocabulary
  8192 by default, with the two reserved tokens of `dspark_jax.text.byte_bpe`: ``<|endoftext|>``
  (id 0, separates files) and ``<|mask|>`` (id 1, the DSpark block filler).
* **Calibration files.** Train files with crc32(key) % 100 == 1 (`is_calibration`, ≈ 1 %) give the
  prompts that calibrate the draft's confidence head; the draft's own training prompts avoid them.
* **Arrays.** `encode_each` encodes files (each followed by end-of-text) as uint16 arrays, `join`
  and `encode_files` make one stream of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from dspark_jax.text.byte_bpe import END_OF_TEXT_ID, SPECIAL_TOKENS, check_tokenizer

DEFAULT_VOCAB_SIZE = 8192
HELD_OUT_MODULUS = 20
DEFAULT_PACKAGES = ("numpy", "scipy", "jax", "flax", "optax", "chex", "matplotlib", "pandas",
                    "sklearn", "torch", "transformers", "sympy", "networkx")
"""Import names of the packages whose sources join the standard library (those installed)."""
MAX_FILE_BYTES = 2**20
"""Larger files (generated tables, test fixtures) are left out of the corpus."""
STDLIB = "stdlib"


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


def is_calibration(key: str, modulus: int = 100) -> bool:
  """A train file set aside for calibration prompts: crc32(key) % modulus == 1 (never a held-out
  file when `modulus` shares a factor with 20, since then crc32 % 20 == 0 is impossible)."""
  if isinstance(modulus, bool) or not isinstance(modulus, int) or modulus < 2:
    raise ValueError(f"modulus: expected an int >= 2, got {modulus!r}")
  return (not is_held_out(key)
          and zlib.crc32(key.replace(os.sep, "/").encode()) % modulus == 1)


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


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One corpus file: its `source` ("stdlib" or a package's import name), absolute `path`, split
  `key` (module docstring) and `size` in bytes."""

  source: str
  path: str
  key: str
  size: int


@dataclasses.dataclass
class Corpus:
  """What `collect_corpus` returns: the kept `files` in listing order, their `texts` (same order) and
  the `info` the manifest records."""

  files: list[SourceFile]
  texts: list[str]
  info: dict

  def split(self) -> tuple[list[int], list[int]]:
    """(train, held-out) indices into `files`/`texts` by `is_held_out` of each key."""
    held = [i for i, f in enumerate(self.files) if is_held_out(f.key)]
    chosen = set(held)
    return [i for i in range(len(self.files)) if i not in chosen], held


def package_root(name: str) -> str | None:
  """The directory of an installed top-level package (or its single ``.py`` module file), found
  without importing it; None if it is not installed or is a compiled extension."""
  if not name.isidentifier():
    raise ValueError(f"packages: {name!r} is not a top-level import name")
  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return None
  if spec is None:
    return None
  if spec.submodule_search_locations:
    locations = sorted(str(p) for p in spec.submodule_search_locations)
    return locations[0] if locations else None
  origin = spec.origin or ""
  return origin if origin.endswith(".py") else None


def package_version(name: str) -> str | None:
  """The version of the distribution that provides import name `name` (None if unknown)."""
  dists = importlib.metadata.packages_distributions().get(name) or []
  for dist in sorted(set(dists)):
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def _walk_py(root: str) -> list[str]:
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in ("__pycache__", "site-packages",
                                                        "dist-packages"))
    found.extend(os.path.join(directory, n) for n in files if n.endswith(".py"))
  return sorted(found)


def _key(path: str, base: str) -> str:
  return os.path.relpath(path, base).replace(os.sep, "/")


def package_files(name: str) -> list[SourceFile]:
  """The ``.py`` files of installed package `name`, keys relative to its parent directory, sorted;
  empty if it is not installed."""
  root = package_root(name)
  if root is None:
    return []
  paths = [root] if os.path.isfile(root) else _walk_py(root)
  base = os.path.dirname(root)
  return [SourceFile(name, p, _key(p, base), os.path.getsize(p)) for p in paths]


def _stdlib_sources(root: str) -> list[SourceFile]:
  return [SourceFile(STDLIB, os.path.join(root, rel), rel.replace(os.sep, "/"),
                     os.path.getsize(os.path.join(root, rel))) for rel in stdlib_files(root)]


def priority(file: SourceFile) -> tuple[bool, str]:
  """The corpus order of `collect_corpus`: standard-library files first, then package files, each
  group in order of the SHA-256 of the key (a deterministic order that mixes packages)."""
  return (file.source != STDLIB, hashlib.sha256(file.key.encode()).hexdigest())


def collect_corpus(packages: Sequence[str] = DEFAULT_PACKAGES, *, stdlib: bool = True,
                   max_bytes: int | None = None, max_file_bytes: int = MAX_FILE_BYTES,
                   stdlib_root_dir: str | None = None) -> Corpus:
  """The standard library plus the installed `packages`' sources, deduplicated and capped.

  Files are taken in `priority` order: a file larger than `max_file_bytes`, empty (whitespace
  only) or with the bytes of a file taken before is dropped; the first file that would take the
  total past `max_bytes` ends the corpus.

  Args:
    packages: top-level import names; those not installed are recorded as missing.
    stdlib: include the standard library.
    max_bytes: cap on the kept bytes (None: no cap).
    max_file_bytes: larger files are left out.
    stdlib_root_dir: the library root (default: the running interpreter's).

  Returns:
    A `Corpus` whose files are in `priority` order; ``info`` has the interpreter, the rules, one
    entry per source (name, version, root, files and bytes kept, and the files dropped as too
    large, empty, duplicate or over the cap) and the totals of each split.
  """
  if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
    raise ValueError(f"max_bytes: must be positive or None, got {max_bytes!r}")
  packages = list(dict.fromkeys(packages))
  for name in packages:
    if not isinstance(name, str) or not name.isidentifier() or name == STDLIB:
      raise ValueError(f"packages: {name!r} is not a top-level import name")
  root = stdlib_root_dir or stdlib_root()
  listed: list[SourceFile] = _stdlib_sources(root) if stdlib else []
  sources = {}
  if stdlib:
    sources[STDLIB] = {"name": STDLIB, "version": sys.version.split()[0], "root": root}
  missing = []
  for name in packages:
    files = package_files(name)
    if not files:
      missing.append(name)
      continue
    sources[name] = {"name": name, "version": package_version(name),
                     "root": os.path.dirname(package_root(name))}
    listed.extend(files)
  for entry in sources.values():
    entry.update(files=0, bytes=0, found=0, too_large=0, empty=0, duplicates=0, over_cap=0)

  seen: set[str] = set()
  files, texts, total, full = [], [], 0, False
  for file in sorted(listed, key=priority):
    entry = sources[file.source]
    entry["found"] += 1
    if full:
      entry["over_cap"] += 1
      continue
    if file.size > max_file_bytes:
      entry["too_large"] += 1
      continue
    with open(file.path, "rb") as f:
      raw = f.read()
    if not raw.strip():
      entry["empty"] += 1
      continue
    digest = hashlib.sha256(raw).hexdigest()
    if digest in seen:
      entry["duplicates"] += 1
      continue
    if max_bytes is not None and total + len(raw) > max_bytes:
      full = True
      entry["over_cap"] += 1
      continue
    seen.add(digest)
    total += len(raw)
    entry["files"] += 1
    entry["bytes"] += len(raw)
    files.append(dataclasses.replace(file, size=len(raw)))
    texts.append(raw.decode("utf-8", errors="replace"))

  held = [f for f in files if is_held_out(f.key)]
  train = [f for f in files if not is_held_out(f.key)]
  held_stdlib = [f for f in held if f.source == STDLIB]
  info = {
      "python_version": sys.version.split()[0], "implementation": sys.implementation.name,
      "root": root, "sources": list(sources.values()), "missing_packages": missing,
      "files": len(files), "bytes": total,
      "train_files": len(train), "held_out_files": len(held),
      "train_bytes": sum(f.size for f in train), "held_out_bytes": sum(f.size for f in held),
      "held_out_stdlib_files": len(held_stdlib),
      "held_out_stdlib_bytes": sum(f.size for f in held_stdlib),
      "split_rule": f"held out iff crc32(key) % {HELD_OUT_MODULUS} == 0; key = the path relative "
                    "to the stdlib root, or to the directory holding the package",
      "order_rule": "stdlib files first, then package files, each group by sha256(key)",
      "dedup_rule": "exact content (sha256 of the bytes): the first file in that order is kept; "
                    "empty files dropped",
      "max_file_bytes": max_file_bytes, "max_bytes": max_bytes,
      "cap_rule": "files in that order up to the first that does not fit in max_bytes",
  }
  return Corpus(files, texts, info)


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


def encode_each(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
  """Each text's ids followed by end-of-text, one uint16 array per text (encoded in parallel)."""
  if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
    raise ValueError("tokenizer: vocabulary too large for uint16 token arrays")
  encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
  return [np.concatenate([np.asarray(item.ids, np.uint16), np.array([END_OF_TEXT_ID], np.uint16)])
          for item in encoded]


def join(arrays: Sequence[np.ndarray]) -> np.ndarray:
  """One uint16 stream of `encode_each`'s arrays (empty if there are none)."""
  return np.concatenate(list(arrays)) if len(arrays) else np.zeros((0,), np.uint16)


def encode_files(tokenizer, texts: Sequence[str]) -> np.ndarray:
  """One uint16 stream: each text's ids followed by end-of-text."""
  return join(encode_each(tokenizer, texts))
