"""The shipped model pair: trained target, DSpark drafter, parallel ablation and tokenizer.

This module owns the files in ``dspark_jax/assets`` (written by ``scripts/train_pair.py --stage
export``) and loading them with no download:

* ``manifest.json``: the corpus (its sources and their versions, the split), the training recipe,
  each model's steps and final metrics, the draft's calibration, and the weight files of each model;
* ``target.part*.safetensors``, ``draft.part*.safetensors``, ``ablation.part*.safetensors``: bf16
  weights with their configs in the metadata, split into parts of at most 15 MiB;
* ``tokenizer.json`` (byte-level BPE) and ``heldout_prompts.json`` (openings of held-out files).

`load_shipped` builds the models (computing in float32 on the CPU, bf16 elsewhere unless told) and
the tokenizer, and checks every file against the manifest. The tokenizer is a
`dspark_jax.text.Tokenizer` (alone: `load_shipped_tokenizer`): ``<|endoftext|>`` = 0 is its EOS and
stop token, ``<|mask|>`` = 1 its mask token. That rule holds for the shipped pair only; loaded
models take their ids from their files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.formats import checkpoints
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.text import byte_bpe
from dspark_jax.text.tokenizer import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PART_BYTES = 15 * 2**20

RECIPE = {
    "target": "next-token cross-entropy on the train split, 512-token windows, AdamW (b2 0.95, wd "
              "0.01), warm-up 4 %, cosine to 10 %, grad-norm 1.0",
    "draft_data": "64-token train-split prompts continued by the target for 192 tokens, half greedy, "
                  "half T = 1",
    "draft": "docs/design.md: 0.1 CE + 0.9 TV + 1.0 BCE(confidence), position weights exp(-(k-1)/4), "
             "block 7, 8 random anchors per sequence in the generated part, vanilla sequential head",
    "ablation": "the same without the sequential head (W2 = 0: a DFlash-style parallel drafter), same "
                "data, steps and seed",
}


def save_parts(prefix: str, model, *, dtype=jnp.bfloat16, metadata: dict | None = None) -> list[str]:
  """Writes a model as ``prefix.partK.safetensors`` files of at most `PART_BYTES` each (whole tensors
  per part, largest first); returns the file names."""
  from safetensors.flax import save_file

  arrays, info = checkpoints.model_payload(model, dtype=dtype, metadata=metadata)
  parts: list[dict[str, jax.Array]] = []
  sizes: list[int] = []
  for name in sorted(arrays, key=lambda n: -arrays[n].nbytes):
    size = arrays[name].nbytes
    for i, used in enumerate(sizes):
      if used + size <= PART_BYTES:
        parts[i][name] = arrays[name]
        sizes[i] += size
        break
    else:
      parts.append({name: arrays[name]})
      sizes.append(size)
  names = []
  for i, part in enumerate(parts):
    name = f"{os.path.basename(prefix)}.part{i}.safetensors"
    save_file(part, os.path.join(os.path.dirname(prefix), name), metadata=info)
    names.append(name)
  return names


def _read_json(path: str) -> Any:
  """The JSON in `path`, or ValueError naming the file."""
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ValueError(f"{path}: missing") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ValueError(f"{path}: not valid JSON ({error})") from None


def _read_parts(directory: str, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
  arrays, meta = {}, None
  for name in names:
    file = os.path.join(directory, name)
    arrays.update(checkpoints.load_arrays(file))
    meta = meta or checkpoints.read_metadata(file)
  return arrays, meta


@dataclasses.dataclass
class ShippedPair:
  """The loaded assets. `ablation` is the parallel drafter trained without the sequential head;
  `tokenizer` is a `dspark_jax.text.Tokenizer` (`load_shipped_tokenizer`)."""

  tokenizer: Tokenizer
  target: tm.TargetModel
  draft: dm.DSparkDraft
  ablation: dm.DSparkDraft
  manifest: dict
  prompts: list[str]

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids if i >= 0])


def load_shipped_tokenizer(directory: str = ASSETS) -> Tokenizer:
  """The shipped byte-level BPE as a `dspark_jax.text.Tokenizer`: ``<|endoftext|>`` (id 0) is its
  EOS and only stop token, ``<|mask|>`` (id 1) its mask token (`dspark_jax.text.byte_bpe`).

  Raises:
    ValueError: ``tokenizer.json`` missing, unreadable, or with the reserved tokens elsewhere.
  """
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.exists(path):
    raise ValueError(f"{path}: the shipped tokenizer is missing")
  try:
    backend = byte_bpe.load_tokenizer(path)
  except Exception as error:  # the tokenizers library raises its own error for a damaged file
    raise ValueError(f"{path}: not a readable tokenizer ({error})") from error
  return Tokenizer.from_backend(backend, special_tokens={"eos_token": byte_bpe.END_OF_TEXT,
                                                         "mask_token": byte_bpe.MASK})


def available(directory: str = ASSETS) -> bool:
  return os.path.exists(os.path.join(directory, "manifest.json"))


def load_shipped(directory: str = ASSETS, *, compute_dtype=None) -> ShippedPair:
  """Loads the shipped pair. `compute_dtype` defaults to float32 on the CPU and bf16 elsewhere.

  Raises:
    FileNotFoundError: no manifest in `directory`.
    ValueError: a file that does not match the manifest (missing, or tensors of other shapes).
  """
  manifest_path = os.path.join(directory, "manifest.json")
  if not os.path.exists(manifest_path):
    raise FileNotFoundError(f"no shipped models: {manifest_path} does not exist")
  manifest = _read_json(manifest_path)
  files = manifest.get("files") if isinstance(manifest, dict) else None
  if not isinstance(files, dict):
    raise ValueError(f"{manifest_path}: expected an object with a 'files' entry")
  if compute_dtype is None:
    compute_dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  for name in ("target", "draft", "ablation"):
    parts = files.get(name, {}).get("parts") if isinstance(files.get(name), dict) else None
    if not isinstance(parts, list) or not parts:
      raise ValueError(f"{manifest_path}: files.{name}.parts is missing or empty")
    for part in parts:
      if not os.path.exists(os.path.join(directory, part)):
        raise ValueError(f"manifest: {name} part {part!r} is missing from {directory}")
  arrays, meta = _read_parts(directory, manifest["files"]["target"]["parts"])
  target_config = dataclasses.replace(checkpoints.target_config_from_dict(meta["config"]),
                                      dtype=compute_dtype)
  target = checkpoints.target_from_arrays(target_config, arrays)
  drafts = {}
  for name in ("draft", "ablation"):
    arrays, meta = _read_parts(directory, manifest["files"][name]["parts"])
    config = dataclasses.replace(checkpoints.draft_config_from_dict(meta["config"]),
                                 dtype=compute_dtype)
    drafts[name] = checkpoints.draft_from_arrays(config, target_config, arrays)
  tokenizer = load_shipped_tokenizer(directory)
  prompts = _read_json(os.path.join(directory, "heldout_prompts.json"))
  return ShippedPair(tokenizer=tokenizer, target=target, draft=drafts["draft"],
                     ablation=drafts["ablation"], manifest=manifest, prompts=prompts)
