"""dspark_jax's own checkpoint format: model weights and configs in safetensors files.

This module owns how our models go to disk and come back (the formats of other libraries are its
neighbours in `dspark_jax.formats`; training state for resuming is `dspark_jax.train.trainer`'s):

* `save_model` / `load_target` / `load_draft`: an nnx model's parameters as one safetensors file
  (tensor names are the parameter paths, e.g. ``layers.0.attention.q_proj.kernel``), its config as
  JSON in the file's metadata, and any extra metadata you pass (how it was trained). Saving can cast
  to another dtype (bf16 for shipping).
* `config_to_dict` and the ``*_config_from_dict`` functions: the JSON form of the configs.

Loading builds a model from its config and replaces every parameter, checking names and shapes: a
missing, unexpected or misshapen tensor raises ValueError naming it.

Tensor names are the unfused ones: a layer's fused projections (``attention.qkv_proj``,
``mlp.gate_up_proj``, one product each at run time) are named by their parts (``q_proj``,
``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) in every name `named_arrays` gives and
`replace_named` takes, so files and the checkpoint formats built on these names stay as they were.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import heads
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement

_DTYPE_FIELDS = ("dtype", "param_dtype")


def config_to_dict(config) -> dict[str, Any]:
  """A JSON-ready dict of a `TargetConfig` / `DraftConfig` (dtypes by name, tuples as lists)."""
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name in _DTYPE_FIELDS:
      value = jnp.dtype(value).name
    elif isinstance(value, layers.LayerShape):
      value = dataclasses.asdict(value)
    elif isinstance(value, tuple):
      value = list(value)
    out[field.name] = value
  return out


def _build(cls, values: Any, what: str):
  """``cls(**values)`` with every field checked by name: unknown, missing or of a bad value."""
  if not isinstance(values, dict):
    raise ValueError(f"{what}: expected a JSON object, got {type(values).__name__}")
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f"{what}: unknown field {unknown[0]!r} (a {cls.__name__} has {sorted(names)})")
  try:
    return cls(**values)
  except TypeError as error:  # a required field is missing
    raise ValueError(f"{what}: {error}") from None
  except ValueError as error:
    raise ValueError(f"{what}: {error}") from None


def _common_from_dict(values: Any, what: str) -> dict[str, Any]:
  if not isinstance(values, dict):
    raise ValueError(f"{what}: expected a JSON object, got {type(values).__name__}")
  values = dict(values)
  for name in _DTYPE_FIELDS:
    if name in values:
      try:
        values[name] = jnp.dtype(values[name])
      except TypeError:
        raise ValueError(f"{what}: {name} {values[name]!r} is not a dtype") from None
  if values.get("layer") is not None:
    values["layer"] = _build(layers.LayerShape, values["layer"], f"{what}.layer")
  return values


def _ids(values: dict, name: str, what: str) -> None:
  if name in values:
    if not isinstance(values[name], (list, tuple)):
      raise ValueError(f"{what}: {name} must be a list of layer ids, got {values[name]!r}")
    values[name] = tuple(values[name])


def target_config_from_dict(values: Any, what: str = "config") -> tm.TargetConfig:
  """A `TargetConfig` from its JSON dict; ValueError names a bad, unknown or missing field."""
  values = _common_from_dict(values, what)
  _ids(values, "feature_layers", what)
  return _build(tm.TargetConfig, values, what)


def draft_config_from_dict(values: Any, what: str = "config") -> dm.DraftConfig:
  """A `DraftConfig` from its JSON dict; ValueError names a bad, unknown or missing field."""
  values = _common_from_dict(values, what)
  _ids(values, "target_layer_ids", what)
  return _build(dm.DraftConfig, values, what)


def _name(path) -> str:
  parts = []
  for key in path:
    part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
    if part != "value":  # the Variable's own field, not part of the parameter's name
      parts.append(str(part))
  return ".".join(parts)


FUSED = layers.FUSED
"""A fused parameter's path suffix -> the names of its column blocks, in order (`layers.FUSED`)."""


def _fused_suffix(name: str) -> str | None:
  for suffix in FUSED:
    if name == suffix or name.endswith("." + suffix):
      return suffix
  return None


def _part_widths(named: dict, name: str, suffix: str) -> tuple[int, ...]:
  """Column widths of the parts of fused parameter `name` (q/k/v: the query width is the output
  projection's input width, the rest splits in two equal halves)."""
  total = int(np.shape(named[name])[-1])
  if suffix.startswith("attention."):
    queries = int(np.shape(named[name[:-len(suffix)] + "attention.o_proj.kernel"])[0])
    return (queries, (total - queries) // 2, (total - queries) // 2)
  return (total // 2, total // 2)


def _columns(leaf, start: int, width: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(tuple(leaf.shape[:-1]) + (width,), leaf.dtype)
  return leaf[..., start:start + width]


def _unfused(named: dict) -> dict:
  """`named` with each fused parameter replaced by its parts (slices; abstract shapes stay
  abstract)."""
  out = {}
  for name, leaf in named.items():
    suffix = _fused_suffix(name)
    if suffix is None:
      out[name] = leaf
      continue
    prefix, start = name[:-len(suffix)], 0
    for part, width in zip(FUSED[suffix], _part_widths(named, name, suffix)):
      out[prefix + part] = _columns(leaf, start, width)
      start += width
  return out


def named_arrays(tree) -> dict[str, jax.Array]:
  """``{path name: array}`` of a pytree (an nnx.State, an optax state, ...), fused projections
  named by their parts (module docstring)."""
  return _unfused({_name(path): leaf
                   for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]})


def replace_named(tree, arrays: dict[str, Any], *, what: str):
  """`tree` with each leaf replaced by ``arrays[name]`` (cast to the leaf's dtype); strict.

  `arrays` uses the names of `named_arrays` (a fused projection's parts, concatenated here).
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = [_name(path) for path, _ in leaves]
  expected = _unfused(dict(zip(names, (leaf for _, leaf in leaves))))
  unexpected = sorted(set(arrays) - set(expected))
  if unexpected:
    raise ValueError(f"{what}: unexpected tensor {unexpected[0]!r}")
  for name, leaf in expected.items():
    if name not in arrays:
      raise ValueError(f"{what}: missing tensor {name!r}")
    value = arrays[name]
    if tuple(np.shape(value)) != tuple(np.shape(leaf)):
      raise ValueError(f"{what}: tensor {name!r} has shape {tuple(np.shape(value))}, expected "
                       f"{tuple(np.shape(leaf))}")
  new = []
  for name, (_, leaf) in zip(names, leaves):
    dtype = getattr(leaf, "dtype", None)
    suffix = _fused_suffix(name)
    if suffix is None:
      new.append(jnp.asarray(arrays[name], dtype))
    else:
      prefix = name[:-len(suffix)]
      new.append(jnp.concatenate([jnp.asarray(arrays[prefix + part], dtype)
                                  for part in FUSED[suffix]], axis=-1))
  return jax.tree_util.tree_unflatten(treedef, new)


def model_payload(model: nnx.Module, *, dtype=None, metadata: dict | None = None
                  ) -> tuple[dict[str, jax.Array], dict[str, str]]:
  """(tensors, file metadata) of a model: its parameters cast to `dtype` if given, its config and
  kind, and `metadata` (JSON-encoded)."""
  arrays = named_arrays(placement.canonical_state(model))
  if dtype is not None:
    arrays = {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v
              for k, v in arrays.items()}
  config = dataclasses.replace(model.config, param_dtype=jnp.dtype(dtype)) if dtype else model.config
  info = {"config": json.dumps(config_to_dict(config)), "kind": type(model).__name__}
  info.update({k: json.dumps(v) for k, v in (metadata or {}).items()})
  return {k: jnp.asarray(v) for k, v in arrays.items()}, info


def save_model(path: str, model: nnx.Module, *, dtype=None, metadata: dict | None = None) -> None:
  """Writes the model's parameters (cast to `dtype` if given) and config to a safetensors file."""
  from safetensors.flax import save_file

  arrays, info = model_payload(model, dtype=dtype, metadata=metadata)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_file(arrays, path, metadata=info)


def _open_error(path: str, error: Exception) -> ValueError:
  return ValueError(f"{path}: not a readable safetensors file ({type(error).__name__}: {error}); "
                    "truncated or not a checkpoint?")


def read_metadata(path: str) -> dict[str, Any]:
  """The metadata of a file written by `save_model` (JSON values decoded).

  Raises:
    FileNotFoundError: no file at `path`. ValueError: not a readable safetensors file.
  """
  from safetensors import safe_open

  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such checkpoint file")
  try:
    with safe_open(path, framework="flax") as f:
      raw = f.metadata() or {}
  except Exception as error:  # safetensors raises its own error type for a damaged header
    raise _open_error(path, error) from error
  out = {}
  for key, value in raw.items():
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def load_arrays(path: str) -> dict[str, jax.Array]:
  """All tensors of a safetensors file (ValueError naming `path` if it cannot be read)."""
  from safetensors.flax import load_file
  try:
    return load_file(path)
  except FileNotFoundError:
    raise
  except Exception as error:  # a truncated file fails here, after its header parsed
    raise _open_error(path, error) from error


def _model_config(path: str, kind: str) -> Any:
  """The config in the metadata of a `kind` ("TargetModel" / "DSparkDraft") file at `path`."""
  meta = read_metadata(path)
  if "config" not in meta:
    raise ValueError(f"{path}: its metadata has no 'config' (keys: {sorted(meta)}); not a model "
                     "file written by save_model")
  if meta.get("kind", kind) != kind:
    raise ValueError(f"{path}: holds a {meta['kind']}, not a {kind}")
  return meta["config"]


def _with_compute_dtype(config, compute_dtype):
  return config if compute_dtype is None else dataclasses.replace(config, dtype=compute_dtype)


def target_from_arrays(config: tm.TargetConfig, arrays: dict[str, Any]) -> tm.TargetModel:
  """A `TargetModel` of `config` whose parameters are `arrays` (names as `named_arrays` gives)."""
  model = nnx.eval_shape(lambda: tm.TargetModel(config, rngs=nnx.Rngs(0)))
  nnx.update(model, replace_named(nnx.state(model, nnx.Param), arrays, what="target"))
  return model


def draft_from_arrays(config: dm.DraftConfig, target_config: tm.TargetConfig,
                      arrays: dict[str, Any]) -> dm.DSparkDraft:
  """A `DSparkDraft` of `config` (for a target of `target_config`) with parameters `arrays`.

  An optional ``confidence.temperatures`` [γ] (calibrated, `dspark_jax.calibration.fit_sts`) goes
  to the confidence head, which then applies them."""
  model = nnx.eval_shape(lambda: dm.DSparkDraft(config, target_config, rngs=nnx.Rngs(0)))
  arrays = dict(arrays)
  temperatures = arrays.pop("confidence.temperatures", None)
  if temperatures is not None:
    if not config.confidence:
      raise ValueError("draft: tensor 'confidence.temperatures' but the config has no confidence "
                       "head")
    if tuple(np.shape(temperatures)) != (config.gamma,):
      raise ValueError(f"draft: tensor 'confidence.temperatures' has shape "
                       f"{tuple(np.shape(temperatures))}, expected ({config.gamma},)")
  nnx.update(model, replace_named(nnx.state(model, nnx.Param), arrays, what="draft"))
  if temperatures is not None:
    head = model.confidence.arrays()
    head["temperatures"] = jnp.asarray(temperatures, head["w"].dtype)
    model.confidence = nnx.data(heads.ConfidenceHead(head))
  return model


def load_target(path: str, *, compute_dtype=None) -> tm.TargetModel:
  """Builds the `TargetModel` saved at `path` (optionally with another compute dtype)."""
  config = target_config_from_dict(_model_config(path, "TargetModel"), f"{path}: config")
  return target_from_arrays(_with_compute_dtype(config, compute_dtype), load_arrays(path))


def load_draft(path: str, target_config: tm.TargetConfig, *, compute_dtype=None) -> dm.DSparkDraft:
  """Builds the `DSparkDraft` saved at `path` for a target of `target_config`."""
  config = draft_config_from_dict(_model_config(path, "DSparkDraft"), f"{path}: config")
  return draft_from_arrays(_with_compute_dtype(config, compute_dtype), target_config,
                           load_arrays(path))
