"""DeepSpec DSpark / DFlash draft checkpoints (``Qwen3DSparkModel``) as `DSparkDraft`s, and back.

This module owns the mapping between a DeepSpec draft directory (``config.json`` +
``model.safetensors``, or an index with shards, as ``Qwen3DSparkModel.save_pretrained`` writes it)
and a `dspark_jax.models.draft.DSparkDraft`:

* `draft_config_from_deepspec` / `deepspec_config`: ``config.json`` <-> `DraftConfig`. The config
  is the target's Qwen3 config (its layer fields read by `qwen3.layer_shape_from_hf`, so the same
  RoPE variants and refusals) with ``architectures: ["Qwen3DSparkModel"]``, ``num_hidden_layers``
  = draft layers, and DeepSpec's fields: ``block_size`` (γ), ``mask_token_id``,
  ``target_layer_ids`` (-1 = the embedding output, i = target layer i, HF ``hidden_states[i + 1]``;
  strictly increasing; never the target's final layer, whose HF hidden state is after the final
  norm), ``num_target_layers``, ``num_anchors``, ``markov_rank`` (0: no sequential head, a
  DFlash-style drafter), ``markov_head_type`` (vanilla / gated / rnn, when the rank is > 0),
  ``enable_confidence_head``, ``confidence_head_with_markov`` (when enabled). Our extension:
  an optional ``confidence_temperatures`` list (γ calibrated per-position temperatures, STS),
  which the confidence head applies as ``σ(raw_k / T_k)``.
* `load_deepspec_draft` / `save_deepspec_draft`: the tensors. Names (DeepSpec -> ours):
  ``fc.weight`` [E, L·E] -> ``fc.kernel`` (transposed), ``hidden_norm.weight`` -> the context
  norm, ``norm.weight`` -> the final norm, ``layers.{i}.*`` as a Qwen3 layer
  (`qwen3.LAYER_NAMES`), ``markov_head.markov_w1.weight`` [V, r] -> ``w1``,
  ``markov_head.markov_w2.weight`` [V, r] -> ``w2`` [r, V] (transposed),
  ``markov_head.gate_proj.{weight [r, E+r], bias}`` -> ``gate_w`` [E+r, r] (input [h; e]),
  ``markov_head.joint_proj.{weight [3r, 2r+E], bias}`` -> ``joint_w`` [2r+E, 3r] (input
  [s; e; h], output [gate; candidate; output]), ``confidence_head.proj.{weight [1, W], bias [1]}``
  -> the confidence head's ``w`` [W] and ``b`` [].

The embedding and LM head. A DeepSpec draft stores ``embed_tokens.weight`` and ``lm_head.weight``,
copies of the target's (frozen in training). A `DSparkDraft` has no copies: it reads the target's.
Loading therefore compares each copy with the target's tensor, both cast to the draft's dtype, and
**refuses** a draft whose copy differs (ValueError naming the tensor): sharing it would silently
change the draft's outputs, and the library has no place to keep a second table. Saving writes the
target's tensors (cast to the draft's storage dtype) under those names, as DeepSpec's
``initialize_embeddings_and_head`` does.

A missing, unexpected or misshapen tensor, and a refused config field, raise ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax.draft import heads
from dspark_jax.formats import qwen3
from dspark_jax.formats import safetensors_io
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax.formats import checkpoints

ARCHITECTURE = "Qwen3DSparkModel"
HEAD_TYPES = ("vanilla", "gated", "rnn")
SHARED = ("embed_tokens.weight", "lm_head.weight")
"""The draft's copies of the target's embedding and LM head."""
DRAFT_FIELDS = ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids",
                "num_anchors", "enable_confidence_head", "confidence_head_with_markov",
                "markov_rank", "markov_head_type", "confidence_temperatures")
"""The fields a DeepSpec draft config adds to the target's Qwen3 config (the last is ours)."""

# How a tensor is stored: "T" transposed, "row" [W] as [1, W], "one" [] as [1], None as it is.
_HEAD_NAMES = {
    "head.w1": ("markov_head.markov_w1.weight", None),
    "head.w2": ("markov_head.markov_w2.weight", "T"),
    "head.gate_w": ("markov_head.gate_proj.weight", "T"),
    "head.gate_b": ("markov_head.gate_proj.bias", None),
    "head.joint_w": ("markov_head.joint_proj.weight", "T"),
    "head.joint_b": ("markov_head.joint_proj.bias", None),
}
_CONFIDENCE_NAMES = {
    "confidence.w": ("confidence_head.proj.weight", "row"),
    "confidence.b": ("confidence_head.proj.bias", "one"),
}


# ----------------------------------------------------------------------------------- config

def _int(hf: Mapping[str, Any], name: str, *, low: int = 0) -> int:
  if name not in hf:
    raise ValueError(f"config: missing required field {name!r}")
  value = hf[name]
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"config: {name} must be an integer >= {low}, got {value!r}")
  return value


def _bool(hf: Mapping[str, Any], name: str) -> bool:
  if name not in hf:
    raise ValueError(f"config: missing required field {name!r}")
  if not isinstance(hf[name], bool):
    raise ValueError(f"config: {name} must be true or false, got {hf[name]!r}")
  return hf[name]


def check_target_layer_ids(layer_ids: Any, num_target_layers: int) -> tuple[int, ...]:
  """`layer_ids` as a tuple, or ValueError naming ``target_layer_ids``: DeepSpec's rules (not
  empty; each -1 or in 0 .. num_target_layers-1; strictly increasing) and the evaluator's (not the
  final layer, num_target_layers-1: HF's last hidden state is after the final norm, while the
  draft was trained on the raw layer output)."""
  if not isinstance(layer_ids, (list, tuple)) or not layer_ids:
    raise ValueError(f"config: target_layer_ids must be a non-empty list of layer ids, got "
                     f"{layer_ids!r}")
  last = num_target_layers - 1
  previous = None
  for i, layer in enumerate(layer_ids):
    if isinstance(layer, bool) or not isinstance(layer, int):
      raise ValueError(f"config: target_layer_ids[{i}] is {layer!r}; expected an integer")
    if layer != -1 and not 0 <= layer <= last:
      raise ValueError(f"config: target_layer_ids[{i}] is {layer}; must be -1 (the embedding "
                       f"output) or a layer in 0..{last} (num_target_layers={num_target_layers})")
    if layer == last:
      raise ValueError(f"config: target_layer_ids[{i}] is {layer}, the target's final layer "
                       "(Hugging Face returns it after the final norm); use an earlier layer")
    if previous is not None and layer <= previous:
      raise ValueError(f"config: target_layer_ids[{i}] is {layer}; the ids must be strictly "
                       f"increasing (after {previous})")
    previous = layer
  return tuple(layer_ids)


def confidence_temperatures_from_deepspec(hf: Mapping[str, Any]) -> np.ndarray | None:
  """The optional ``confidence_temperatures`` [γ] float32, or None (a bad one: ValueError naming
  the field)."""
  temps = hf.get("confidence_temperatures")
  if temps is None:
    return None
  if not hf.get("enable_confidence_head"):
    raise ValueError("config: confidence_temperatures given but enable_confidence_head is not true")
  gamma = hf.get("block_size")
  if not isinstance(temps, (list, tuple)) or len(temps) != gamma:
    raise ValueError(f"config: confidence_temperatures must be a list of block_size={gamma} "
                     f"numbers, got {temps!r}")
  for i, t in enumerate(temps):
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
      raise ValueError(f"config: confidence_temperatures[{i}] is {t!r}; must be a finite number "
                       "> 0")
  return np.asarray(temps, np.float32)


def draft_config_from_deepspec(hf: Mapping[str, Any], *, dtype=None,
                               target_config: tm.TargetConfig | None = None) -> dm.DraftConfig:
  """The `DraftConfig` of a DeepSpec draft ``config.json`` (as a dict).

  Args:
    hf: the config.
    dtype: compute and storage dtype; default the config's ``dtype`` / ``torch_dtype``, else
      float32.
    target_config: the target the draft runs on, if known: ``num_target_layers``,
      ``vocab_size``, ``hidden_size`` and ``mask_token_id`` are checked against it.

  Raises:
    ValueError: naming the field: ``model_type`` not "qwen3", ``architectures`` not
      ``["Qwen3DSparkModel"]``, a missing or bad DeepSpec field, ``target_layer_ids`` outside the
      target or on its final layer (`check_target_layer_ids`), an unknown ``markov_head_type``, a
      confidence head "with markov" without a Markov head, a layer option
      `qwen3.layer_shape_from_hf` refuses, or a size that differs from the target's.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"config: expected a JSON object, got {type(hf).__name__}")
  if hf.get("model_type") != qwen3.MODEL_TYPE:
    raise ValueError(f"config: model_type {hf.get('model_type')!r} is not {qwen3.MODEL_TYPE!r}")
  architectures = hf.get("architectures")
  if architectures is not None and list(architectures) != [ARCHITECTURE]:
    raise ValueError(f"config: architectures {architectures!r} is not [{ARCHITECTURE!r}] (a "
                     "DeepSpec DSpark draft)")
  shape = qwen3.layer_shape_from_hf(hf)
  vocab = _int(hf, "vocab_size", low=1)
  num_target_layers = _int(hf, "num_target_layers", low=1)
  layer_ids = check_target_layer_ids(hf.get("target_layer_ids"), num_target_layers)
  gamma = _int(hf, "block_size", low=1)
  mask = _int(hf, "mask_token_id")
  if mask >= vocab:
    raise ValueError(f"config: mask_token_id {mask} is not below vocab_size {vocab}")
  rank = _int(hf, "markov_rank")
  kind = "none"
  if rank > 0:
    if "markov_head_type" not in hf:
      raise ValueError("config: missing required field 'markov_head_type' (markov_rank > 0)")
    kind = str(hf["markov_head_type"]).lower()
    if kind not in HEAD_TYPES:
      raise ValueError(f"config: markov_head_type {hf['markov_head_type']!r} is not one of "
                       f"{HEAD_TYPES}")
  confidence = _bool(hf, "enable_confidence_head")
  with_markov = _bool(hf, "confidence_head_with_markov") if confidence else False
  if with_markov and rank == 0:
    raise ValueError("config: confidence_head_with_markov is true but markov_rank is 0 (no Markov "
                     "head to read W1 from)")
  confidence_temperatures_from_deepspec(hf)
  if target_config is not None:
    if num_target_layers != target_config.num_layers:
      raise ValueError(f"config: num_target_layers {num_target_layers} differs from the target's "
                       f"num_hidden_layers {target_config.num_layers}")
    if vocab != target_config.vocab_size:
      raise ValueError(f"config: vocab_size {vocab} differs from the target's "
                       f"{target_config.vocab_size}")
    if shape.hidden_size != target_config.hidden_size:
      raise ValueError(f"config: hidden_size {shape.hidden_size} differs from the target's "
                       f"{target_config.hidden_size}")
  dtype = validation.check_dtype("dtype", dtype) if dtype is not None else (qwen3.dtype_from_hf(hf)
                                                      or jnp.dtype(jnp.float32))
  try:
    return dm.DraftConfig(
        gamma=gamma, num_layers=_int(hf, "num_hidden_layers"), target_layer_ids=layer_ids,
        mask_token_id=mask, head_kind=kind, rank=rank, confidence=confidence,
        confidence_with_markov=with_markov, layer=shape,
        num_anchors=_int(hf, "num_anchors", low=1), dtype=dtype, param_dtype=dtype)
  except ValueError as error:
    raise ValueError(f"config: {error}") from None


def deepspec_config(draft: dm.DSparkDraft, target: tm.TargetModel) -> dict[str, Any]:
  """The ``config.json`` dict DeepSpec's ``Qwen3DSparkModel.from_pretrained`` reads for `draft`.

  The target's Qwen3 config (`qwen3.config_to_hf`) with the draft's layer shape and count and
  storage dtype, ``tie_word_embeddings: false``, and the DeepSpec fields; ``markov_head_type`` only
  with a Markov head and ``confidence_head_with_markov`` only with a confidence head (as DeepSpec
  writes them); ``confidence_temperatures`` when the confidence head has calibrated temperatures.
  """
  config = draft.config
  base = dataclasses.replace(target.config, num_layers=config.num_layers, layer=draft.shape,
                             tie_embeddings=False, feature_layers=(-1,),
                             param_dtype=config.param_dtype)
  hf = qwen3.config_to_hf(base)
  hf["architectures"] = [ARCHITECTURE]
  hf.update(num_target_layers=target.config.num_layers, block_size=config.gamma,
            mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
            num_anchors=config.num_anchors, enable_confidence_head=draft.confidence is not None,
            markov_rank=draft.head.rank)
  if draft.head.kind != "none":
    hf["markov_head_type"] = draft.head.kind
  if draft.confidence is not None:
    hf["confidence_head_with_markov"] = bool(config.confidence_with_markov)
    if draft.confidence.temperatures is not None:
      hf["confidence_temperatures"] = [
          float(t) for t in np.asarray(draft.confidence.temperatures[...], np.float64)]
  return hf


# ----------------------------------------------------------------------------------- tensors

def deepspec_names(config: dm.DraftConfig) -> dict[str, tuple[str, str | None]]:
  """``{DSparkDraft parameter path: (DeepSpec tensor name, storage)}`` for a draft of `config`.

  Storage: "T" transposed, "row" a [W] vector stored [1, W], "one" a scalar stored [1], None as
  it is. A "none" head's empty ``w1`` / ``w2`` have no tensors; the confidence head's
  ``temperatures`` live in the config. The shared ``embed_tokens.weight`` / ``lm_head.weight`` are
  not parameters of a `DSparkDraft` (`SHARED`).
  """
  names = {"fc.kernel": ("fc.weight", "T"), "context_norm.scale": ("hidden_norm.weight", None),
           "final_norm.scale": ("norm.weight", None)}
  for i in range(config.num_layers):
    for ours, theirs in qwen3.layer_names(f"layers.{i}", f"layers.{i}").items():
      names[ours] = (theirs, "T" if qwen3.is_transposed(ours) else None)
  if config.head_kind != "none":
    for key in heads._HEAD_KEYS[config.head_kind]:
      names[f"head.{key}"] = _HEAD_NAMES[f"head.{key}"]
  if config.confidence:
    names.update(_CONFIDENCE_NAMES)
  return names


def _stored_shape(shape: tuple[int, ...], storage: str | None) -> tuple[int, ...]:
  return {"T": shape[::-1], "row": (1, *shape), "one": (1,)}.get(storage, shape)


def _to_ours(value: np.ndarray, storage: str | None) -> np.ndarray:
  if storage == "T":
    return value.T
  if storage in ("row", "one"):
    return value.reshape(value.shape[1:])
  return value


def _to_theirs(value: np.ndarray, storage: str | None) -> np.ndarray:
  if storage == "T":
    return np.ascontiguousarray(value.T)
  if storage in ("row", "one"):
    return value.reshape((1, *value.shape))
  return value


def target_tables(target: tm.TargetModel) -> dict[str, np.ndarray]:
  """The target's embedding and LM head as DeepSpec stores the draft's copies ([V, E] each)."""
  embed = placement.host_value(target.embed.embedding[...])
  head = embed if target.config.tie_embeddings else placement.host_value(
      target.lm_head.kernel[...]).T
  return {"embed_tokens.weight": embed, "lm_head.weight": head}


def _check_shared(tensors: Mapping[str, np.ndarray], target: tm.TargetModel, dtype,
                  what: str) -> None:
  """Refuses (ValueError naming the tensor) a copy of the embedding / LM head that is missing,
  misshapen, or differs from the target's once both are cast to the draft's dtype `dtype`."""
  for name, table in target_tables(target).items():
    if name not in tensors:
      raise ValueError(f"{what}: missing tensor {name!r}")
    copy = np.asarray(tensors[name])
    if copy.shape != table.shape:
      raise ValueError(f"{what}: tensor {name!r} has shape {copy.shape}, expected {table.shape} "
                       "(the target's)")
    ours, theirs = copy.astype(dtype), table.astype(dtype)
    if not np.array_equal(ours, theirs):
      bad = np.argwhere(ours != theirs)[0]
      raise ValueError(
          f"{what}: tensor {name!r} differs from the target's (first at {bad.tolist()}: "
          f"{ours[tuple(bad)]} vs {theirs[tuple(bad)]} in {jnp.dtype(dtype).name}); the draft "
          "shares the target's embedding and LM head, so its copies must equal them")


def draft_from_deepspec_tensors(config: dm.DraftConfig, target: tm.TargetModel,
                                tensors: Mapping[str, Any], *, what: str,
                                temperatures: np.ndarray | None = None) -> dm.DSparkDraft:
  """A `DSparkDraft` of `config` from a DeepSpec draft's tensors (``{name: array}``).

  Raises:
    ValueError: naming the tensor: unexpected, missing, misshapen, not floating point, or a shared
      copy that differs from the target's (`SHARED`).
  """
  config.check_against(target.config)
  names = deepspec_names(config)
  known = {theirs for theirs, _ in names.values()} | set(SHARED)
  unexpected = sorted(set(tensors) - known)
  if unexpected:
    raise ValueError(f"{what}: unexpected tensor {unexpected[0]!r}")
  _check_shared(tensors, target, config.dtype, what)
  draft = nnx.eval_shape(lambda: dm.DSparkDraft(config, target.config, rngs=nnx.Rngs(0)))
  params = nnx.state(draft, nnx.Param)
  shapes = {k: v.shape for k, v in checkpoints.named_arrays(params).items()}
  arrays = {k: np.zeros(shapes[k], np.float32) for k in ("head.w1", "head.w2")
            if config.head_kind == "none"}
  for path, (name, storage) in names.items():
    if name not in tensors:
      raise ValueError(f"{what}: missing tensor {name!r}")
    value = tensors[name]
    expected = _stored_shape(tuple(shapes[path]), storage)
    if tuple(np.shape(value)) != expected:
      raise ValueError(f"{what}: tensor {name!r} has shape {tuple(np.shape(value))}, expected "
                       f"{expected}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise ValueError(f"{what}: tensor {name!r} has dtype {value.dtype}, expected floating point")
    arrays[path] = _to_ours(np.asarray(value), storage)
  nnx.update(draft, checkpoints.replace_named(params, arrays, what=what))
  if temperatures is not None:
    conf = draft.confidence.arrays()
    conf["temperatures"] = jnp.asarray(temperatures, conf["w"].dtype)
    draft.confidence = nnx.data(heads.ConfidenceHead(conf))
  return draft


def deepspec_tensors(draft: dm.DSparkDraft, target: tm.TargetModel) -> dict[str, np.ndarray]:
  """``{DeepSpec tensor name: NumPy array}`` of `draft`, in its storage dtype, with the target's
  embedding and LM head as the draft's copies."""
  dtype = jnp.dtype(draft.config.param_dtype)
  arrays = checkpoints.named_arrays(placement.canonical_state(draft))
  arrays.pop("confidence.temperatures", None)
  names = deepspec_names(draft.config)
  if draft.head.kind == "none":
    arrays = {k: v for k, v in arrays.items() if k not in ("head.w1", "head.w2")}
  extra = sorted(set(arrays) - set(names))
  if extra:
    raise ValueError(f"draft: parameter {extra[0]!r} has no DeepSpec name")
  out = {names[path][0]: _to_theirs(np.asarray(value).astype(dtype), names[path][1])
         for path, value in arrays.items()}
  out.update({k: np.ascontiguousarray(v.astype(dtype)) for k, v in target_tables(target).items()})
  return out


# ----------------------------------------------------------------------------------- directories

def read_draft_config(directory: str) -> dict[str, Any]:
  """The ``config.json`` of a DeepSpec draft directory (errors name the file)."""
  return qwen3.read_config(directory)


def load_deepspec_draft(directory: str, target: tm.TargetModel, *, dtype=None) -> dm.DSparkDraft:
  """A `DSparkDraft` from a DeepSpec draft directory, for `target`.

  Args:
    directory: ``config.json`` and ``model.safetensors`` (or an index and its shards).
    target: the target it drafts for; it must return the draft's ``target_layer_ids`` as its
      features (`TargetConfig.feature_layers`; `dspark_jax.load_pretrained` arranges this).
    dtype: compute and storage dtype; default the checkpoint's (config, else the tensors').

  Raises:
    FileNotFoundError: no directory, config or weights file (naming the path).
    ValueError: a refused config field (`draft_config_from_deepspec`), a target whose features are
      not the draft's ``target_layer_ids``, or a missing, unexpected, misshapen or differing
      tensor (naming it).
  """
  directory = validation.check_path("directory", directory)
  hf = read_draft_config(directory)
  tensors = safetensors_io.read_tensors(directory)
  dtype = (qwen3._checkpoint_dtype(hf, tensors) if dtype is None
           else validation.check_dtype("dtype", dtype))
  config = draft_config_from_deepspec(hf, dtype=dtype, target_config=target.config)
  if tuple(target.config.feature_layers) != config.target_layer_ids:
    raise ValueError(f"config: target_layer_ids {list(config.target_layer_ids)} differ from the "
                     f"target's feature_layers {list(target.config.feature_layers)}")
  return draft_from_deepspec_tensors(config, target, tensors, what=directory,
                                     temperatures=confidence_temperatures_from_deepspec(hf))


def save_deepspec_draft(draft: dm.DSparkDraft, directory: str, target: tm.TargetModel, *,
                        max_shard_bytes: int | None = None) -> list[str]:
  """Writes `draft` as a DeepSpec draft directory that ``Qwen3DSparkModel.from_pretrained`` loads
  into the same model (the embedding and LM head copies taken from `target`).

  Args:
    draft: the draft; written in its storage dtype (``param_dtype``).
    directory: created if needed; an earlier checkpoint's weight files there are replaced.
    target: the target whose embedding and LM head the draft shares.
    max_shard_bytes: None for one ``model.safetensors``, else shards with an index.

  Returns:
    The names of the files written.

  Raises:
    ValueError: not a draft and its target, or a draft that reads the target's final layer
      (``target_layer_ids``: DeepSpec would read that layer after the final norm).
  """
  check_savable(draft, target)
  return write_directory(directory, deepspec_config(draft, target), deepspec_tensors(draft, target),
                         max_shard_bytes=max_shard_bytes)


def check_savable(draft: dm.DSparkDraft, target: tm.TargetModel) -> None:
  """Raises ValueError unless `draft` is a `DSparkDraft` fitting `target` whose layers have a
  faithful Hugging Face hidden-state index (not the target's final layer: DeepSpec and the
  speculators pipeline read that one after the final norm, where ours is the raw output)."""
  if not isinstance(draft, dm.DSparkDraft):
    raise ValueError(f"draft: expected a DSparkDraft, got {type(draft).__name__}")
  if not isinstance(target, tm.TargetModel):
    raise ValueError(f"target: expected the TargetModel the draft shares its embedding and LM head "
                     f"with, got {type(target).__name__}")
  draft.config.check_against(target.config)
  check_target_layer_ids(list(draft.config.target_layer_ids), target.config.num_layers)


def write_directory(directory: str, hf: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                    max_shard_bytes: int | None = None) -> list[str]:
  """Writes `tensors` (safetensors, sharded above `max_shard_bytes`) and `hf` as ``config.json``
  into `directory`; returns the names of the files written."""
  directory = os.fspath(directory)
  files = safetensors_io.write_tensors(directory, tensors, max_shard_bytes=max_shard_bytes)
  with open(os.path.join(directory, qwen3.CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")
  return files + [qwen3.CONFIG_FILE]
