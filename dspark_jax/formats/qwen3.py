"""Hugging Face Qwen3 checkpoints (``Qwen3ForCausalLM``) as `TargetModel`s, and back.

This module owns the mapping between a transformers Qwen3 checkpoint directory and a
`dspark_jax.models.target.TargetModel`:

* `config_from_hf` / `config_to_hf`: ``config.json`` (either dialect: transformers 5's
  ``rope_parameters: {rope_type, rope_theta, ...}`` or the older ``rope_theta`` + ``rope_scaling``)
  <-> `TargetConfig`. RoPE variants "default", "linear", "yarn" and "llama3" are carried exactly
  (`layers.RopeScaling`); any other variant, a partial rotary factor, sliding-window attention,
  attention biases, another activation, model type or architecture is refused with a ValueError
  naming the field;
* `hf_names`, `layer_names`, `to_hf_tensors`, `from_hf_tensors`: parameter paths <-> tensor names
  (``model.layers.{i}.self_attn.q_proj.weight`` ...). HF linear weights are [out, in]; nnx kernels
  are [in, out], so every ``*.kernel`` is transposed on the way in and out;
* `load_qwen3` / `save_qwen3`: a whole directory (``config.json`` + ``model.safetensors`` or an
  index with shards, via `safetensors_io`).

Where a config leaves a field out, the value is the one transformers' ``Qwen3Config`` uses (e.g.
``head_dim`` 128, ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000, ``tie_word_embeddings`` false), so a
directory means the same model here as in transformers. The size fields (vocab_size, hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads) are required.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax.formats import safetensors_io
from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.models import target as tm
from dspark_jax.parallel import loading
from dspark_jax.parallel import placement
from dspark_jax.formats import checkpoints

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
CONFIG_FILE = "config.json"
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
DEFAULT_MAX_POSITIONS = 32768   # Qwen3Config's max_position_embeddings when a config has none
DEFAULT_ROPE_THETA = 10000.0    # transformers' theta when a config names none

LAYER_NAMES = {
    "input_norm.scale": "input_layernorm.weight",
    "attention.q_proj.kernel": "self_attn.q_proj.weight",
    "attention.k_proj.kernel": "self_attn.k_proj.weight",
    "attention.v_proj.kernel": "self_attn.v_proj.weight",
    "attention.o_proj.kernel": "self_attn.o_proj.weight",
    "attention.q_norm.scale": "self_attn.q_norm.weight",
    "attention.k_norm.scale": "self_attn.k_norm.weight",
    "post_norm.scale": "post_attention_layernorm.weight",
    "mlp.gate_proj.kernel": "mlp.gate_proj.weight",
    "mlp.up_proj.kernel": "mlp.up_proj.weight",
    "mlp.down_proj.kernel": "mlp.down_proj.weight",
}
"""A `layers.DecoderLayer`'s parameter paths -> the names of a Qwen3 decoder layer's tensors."""


# ----------------------------------------------------------------------------------- config

def _field(hf: Mapping[str, Any], name: str, default: Any = None, *, required: bool = False):
  if name not in hf or hf[name] is None:
    if required:
      raise ValueError(f"config: missing required field {name!r}")
    return default
  return hf[name]


def _number(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"config: {name} must be a finite number, got {value!r}")
  return float(value)


def _int_field(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"config: {name} must be an integer >= 1, got {value!r}")
  return value


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, layers.RopeScaling]:
  """(rope_theta, `layers.RopeScaling`) of a Qwen3-style config, in either dialect.

  The RoPE dict is ``rope_scaling`` if present and non-empty, else ``rope_parameters`` (as
  transformers reads them); its ``rope_type`` (or old ``type``) defaults to "default", its
  ``rope_theta`` to the top-level ``rope_theta``, then 10000. For "yarn" and "llama3" a top-level
  ``original_max_position_embeddings`` takes precedence over the dict's, which defaults to
  ``max_position_embeddings`` (transformers 5 builds the model that way).

  Raises:
    ValueError: a variant other than "default", "linear", "yarn", "llama3" (naming it), a partial
      rotary factor other than 1, or a missing or bad parameter (naming the field).
  """
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  if not isinstance(params, Mapping):
    raise ValueError(f"config: {field} must be an object, got {params!r}")
  if isinstance(params.get("full_attention"), Mapping):   # the per-layer-type form
    extra = sorted(k for k in params if k != "full_attention")
    if extra:
      raise ValueError(f"config: {field} has RoPE parameters for layer type {extra[0]!r}; only "
                       "'full_attention' layers are supported")
    params, field = params["full_attention"], f"{field}.full_attention"
  rope_type = params.get("rope_type", params.get("type", "default"))
  theta = _number(f"{field}.rope_theta",
                  params.get("rope_theta", _field(hf, "rope_theta", DEFAULT_ROPE_THETA)))
  if theta <= 0:
    raise ValueError(f"config: {field}.rope_theta must be > 0, got {theta}")
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if partial is not None and partial != 1:
    raise ValueError(f"config: partial_rotary_factor {partial!r} is not supported (Qwen3 rotates "
                     "the whole head)")
  if rope_type not in layers.ROPE_TYPES:
    raise ValueError(f"config: {field}.rope_type {rope_type!r} is not implemented (implemented: "
                     f"{', '.join(layers.ROPE_TYPES)})")
  if rope_type == "default":
    return theta, layers.RopeScaling()

  def need(name):
    if params.get(name) is None:
      raise ValueError(f"config: {field}.{name} is required for rope_type {rope_type!r}")
    return _number(f"{field}.{name}", params[name])

  max_positions = _field(hf, "max_position_embeddings", DEFAULT_MAX_POSITIONS)
  if rope_type == "linear":
    return theta, _scaling(field, rope_type="linear", factor=need("factor"))
  original = hf.get("original_max_position_embeddings")
  if original is None:
    original = params.get("original_max_position_embeddings", max_positions)
  original = _int_field(f"{field}.original_max_position_embeddings", original)
  if rope_type == "llama3":
    return theta, _scaling(field, rope_type="llama3", factor=need("factor"),
                           original_max_position_embeddings=original,
                           low_freq_factor=need("low_freq_factor"),
                           high_freq_factor=need("high_freq_factor"))
  if "factor" not in params:
    raise ValueError(f"config: {field}.factor is required for rope_type 'yarn'")
  factor = params["factor"]
  factor = (max_positions / original if factor is None else _number(f"{field}.factor", factor))
  attention_factor = params.get("attention_factor")
  if attention_factor is None:
    def mscale(scale, weight=1.0):
      return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0
    weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = (mscale(factor, weight) / mscale(factor, weight_all)
                        if weight and weight_all else mscale(factor))
  truncate = params.get("truncate", True)
  return theta, _scaling(field, rope_type="yarn", factor=factor,
                         original_max_position_embeddings=original,
                         beta_fast=_number(f"{field}.beta_fast", params.get("beta_fast") or 32),
                         beta_slow=_number(f"{field}.beta_slow", params.get("beta_slow") or 1),
                         truncate=truncate,
                         attention_factor=_number(f"{field}.attention_factor", attention_factor))


def _scaling(field: str, **values) -> layers.RopeScaling:
  try:
    return layers.RopeScaling(**values)
  except ValueError as error:
    raise ValueError(f"config: {field}: {error}") from None


def _check_supported(hf: Mapping[str, Any]) -> None:
  """Refuses the Qwen3 options this library does not implement (naming the field)."""
  if hf.get("use_sliding_window"):
    raise ValueError("config: use_sliding_window true is not supported (full attention only)")
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    other = [t for t in layer_types if t != "full_attention"]
    if other:
      raise ValueError(f"config: layer_types holds {other[0]!r}; only 'full_attention' layers are "
                       "supported")
  if hf.get("attention_bias"):
    raise ValueError("config: attention_bias true is not supported (Qwen3 projections have no "
                     "bias)")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config: hidden_act {act!r} is not supported (SwiGLU with 'silu' only)")


def layer_shape_from_hf(hf: Mapping[str, Any]) -> layers.LayerShape:
  """The `layers.LayerShape` of a Qwen3-style config's decoder layers (sizes, eps and RoPE).

  Checks the layer options (`_check_supported`) but not the model type or architecture, so a
  config that extends Qwen3's (a DeepSpec draft's) reads the same way.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"config: expected a JSON object, got {type(hf).__name__}")
  _check_supported(hf)
  for name in REQUIRED_FIELDS:
    _field(hf, name, required=True)
  heads = _int_field("num_attention_heads", hf["num_attention_heads"])
  theta, scaling = rope_from_hf(hf)
  try:
    return layers.LayerShape(
        hidden_size=_int_field("hidden_size", hf["hidden_size"]),
        num_heads=heads,
        num_kv_heads=_int_field("num_key_value_heads", _field(hf, "num_key_value_heads", heads)),
        head_dim=_int_field("head_dim", _field(hf, "head_dim", 128)),
        intermediate_size=_int_field("intermediate_size", hf["intermediate_size"]),
        rope_theta=theta,
        rms_eps=_number("rms_norm_eps", _field(hf, "rms_norm_eps", 1e-6)),
        rope_scaling=scaling)
  except ValueError as error:
    raise ValueError(f"config: {error}") from None


def dtype_from_hf(hf: Mapping[str, Any]):
  """The checkpoint's dtype named by ``dtype`` (transformers 5) or ``torch_dtype``, or None; one
  the layers do not compute in (`validation.COMPUTE_DTYPES`) is refused naming the field."""
  name = hf.get("dtype") or hf.get("torch_dtype")
  if name is None:
    return None
  field = "dtype" if hf.get("dtype") else "torch_dtype"
  return validation.check_dtype(f"config: {field}", str(name))


def config_from_hf(hf: Mapping[str, Any], *, dtype=None,
                   feature_layers: Sequence[int] = (-1,)) -> tm.TargetConfig:
  """The `TargetConfig` of a Hugging Face Qwen3 ``config.json`` (as a dict).

  Args:
    hf: the config; ``model_type`` must be "qwen3" and ``architectures``, if given,
      ``["Qwen3ForCausalLM"]``.
    dtype: compute and storage dtype; default the config's ``dtype`` / ``torch_dtype``, else
      float32.
    feature_layers: the target layers whose hidden states feed a draft (-1: the embedding output,
      i: decoder layer i's output, HF ``hidden_states[i + 1]``).

  Raises:
    ValueError: naming the field: an unknown model type or architecture, a missing size, an
      unsupported option (`layer_shape_from_hf`), a feature layer outside the target.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"config: expected a JSON object, got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type != MODEL_TYPE:
    raise ValueError(f"config: model_type {model_type!r} is not {MODEL_TYPE!r}")
  architectures = hf.get("architectures")
  if architectures is not None and list(architectures) != [ARCHITECTURE]:
    raise ValueError(f"config: architectures {architectures!r} is not [{ARCHITECTURE!r}]")
  shape = layer_shape_from_hf(hf)
  dtype = (validation.check_dtype("dtype", dtype) if dtype is not None
           else (dtype_from_hf(hf) or jnp.dtype(jnp.float32)))
  tie = hf.get("tie_word_embeddings", False)
  if not isinstance(tie, bool):
    raise ValueError(f"config: tie_word_embeddings must be true or false, got {tie!r}")
  max_positions = hf.get("max_position_embeddings")
  if max_positions is not None:
    max_positions = _int_field("max_position_embeddings", max_positions)
  try:
    return tm.TargetConfig(
        vocab_size=_int_field("vocab_size", hf["vocab_size"]),
        num_layers=_int_field("num_hidden_layers", hf["num_hidden_layers"]),
        layer=shape, tie_embeddings=tie, feature_layers=tuple(feature_layers), dtype=dtype,
        param_dtype=dtype, max_position_embeddings=max_positions)
  except ValueError as error:
    raise ValueError(f"config: {error}") from None


def rope_to_hf(shape: layers.LayerShape) -> dict[str, Any]:
  """The transformers 5 ``rope_parameters`` dict of a layer shape's RoPE."""
  scaling = shape.rope_scaling
  out: dict[str, Any] = {"rope_type": scaling.rope_type, "rope_theta": float(shape.rope_theta)}
  if scaling.rope_type in ("linear", "yarn", "llama3"):
    out["factor"] = float(scaling.factor)
  if scaling.rope_type in ("yarn", "llama3"):
    out["original_max_position_embeddings"] = int(scaling.original_max_position_embeddings)
  if scaling.rope_type == "llama3":
    out.update(low_freq_factor=float(scaling.low_freq_factor),
               high_freq_factor=float(scaling.high_freq_factor))
  if scaling.rope_type == "yarn":
    out.update(beta_fast=float(scaling.beta_fast), beta_slow=float(scaling.beta_slow),
               truncate=bool(scaling.truncate),
               attention_factor=float(scaling.attention_factor))
  return out


def config_to_hf(config: tm.TargetConfig) -> dict[str, Any]:
  """A transformers-5-style Qwen3 ``config.json`` dict of `config` (``Qwen3Config`` reads it).

  The dtype is the storage dtype (``param_dtype``), written as ``dtype`` and ``torch_dtype``
  (older transformers read the latter). ``max_position_embeddings`` is the config's, else the
  RoPE extension's ``original * factor``, else Qwen3Config's 32768. Token ids (bos, eos, pad) are
  not part of a `TargetConfig`: add them to the dict if wanted (`save_qwen3`'s ``extra_config``).
  """
  shape = config.layer
  scaling = shape.rope_scaling
  max_positions = config.max_position_embeddings
  if max_positions is None:
    max_positions = (int(scaling.original_max_position_embeddings * scaling.factor)
                     if scaling.rope_type in ("yarn", "llama3") else DEFAULT_MAX_POSITIONS)
  dtype = jnp.dtype(config.param_dtype).name
  return {
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": shape.hidden_size,
      "intermediate_size": shape.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": shape.num_heads,
      "num_key_value_heads": shape.num_kv_heads,
      "head_dim": shape.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": float(shape.rms_eps),
      "rope_parameters": rope_to_hf(shape),
      "max_position_embeddings": max_positions,
      "tie_word_embeddings": bool(config.tie_embeddings),
      "attention_bias": False,
      "attention_dropout": 0.0,
      "use_sliding_window": False,
      "sliding_window": None,
      "max_window_layers": config.num_layers,
      "layer_types": ["full_attention"] * config.num_layers,
      "use_cache": True,
      "dtype": dtype,
      "torch_dtype": dtype,
  }


def read_config(directory: str) -> dict[str, Any]:
  """The ``config.json`` of a checkpoint directory as a dict (errors name the file)."""
  path = os.path.join(os.fspath(directory), CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (a Hugging Face checkpoint directory has one)")
  try:
    with open(path) as f:
      hf = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"{path}: not a JSON config ({error})") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
  return hf


# ----------------------------------------------------------------------------------- tensors

def layer_names(ours: str, theirs: str) -> dict[str, str]:
  """`LAYER_NAMES` of one layer under prefixes, e.g. ``layer_names("layers.0",
  "model.layers.0")``."""
  return {f"{ours}.{k}": f"{theirs}.{v}" for k, v in LAYER_NAMES.items()}


def hf_names(config: tm.TargetConfig) -> dict[str, str]:
  """``{TargetModel parameter path: Hugging Face tensor name}`` for a target of `config`.

  Paths are those of `dspark_jax.formats.checkpoints.named_arrays` (e.g.
  ``layers.0.attention.q_proj.kernel``); a tied target has no ``lm_head.kernel`` (and its
  checkpoint no ``lm_head.weight``). Paths ending in ``.kernel`` are stored transposed
  (`is_transposed`).
  """
  names = {"embed.embedding": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight"}
  for i in range(config.num_layers):
    names.update(layer_names(f"layers.{i}", f"model.layers.{i}"))
  if not config.tie_embeddings:
    names["lm_head.kernel"] = "lm_head.weight"
  return names


def is_transposed(path: str) -> bool:
  """Whether the parameter at `path` is an nnx kernel [in, out] stored as HF's [out, in]."""
  return path.endswith(".kernel")


def to_hf_tensors(arrays: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, np.ndarray]:
  """``{HF name: NumPy array}`` of ``{parameter path: array}`` (kernels transposed, dtypes kept).

  Raises:
    ValueError: a path of `arrays` missing from `names`, or the other way round (naming it).
  """
  extra = sorted(set(arrays) - set(names))
  if extra:
    raise ValueError(f"parameter {extra[0]!r} has no Hugging Face name")
  missing = sorted(set(names) - set(arrays))
  if missing:
    raise ValueError(f"parameter {missing[0]!r} is missing")
  out = {}
  for path, value in arrays.items():
    value = np.asarray(value)
    out[names[path]] = np.ascontiguousarray(value.T if is_transposed(path) else value)
  return out


def from_hf_tensors(tensors: Mapping[str, Any], names: Mapping[str, str],
                    shapes: Mapping[str, tuple[int, ...]], *, what: str) -> dict[str, Any]:
  """``{parameter path: array}`` of ``{HF name: array}`` (kernels transposed back).

  Args:
    tensors: the checkpoint's tensors. names: parameter path -> HF name (`hf_names`).
    shapes: parameter path -> the parameter's shape (ours: kernels [in, out]).
    what: names the checkpoint in errors (e.g. its directory).

  Raises:
    ValueError: naming the tensor: one the model does not have, one it lacks, a wrong shape, or
      values that are not floating point.
  """
  wanted = {hf: path for path, hf in names.items()}
  unexpected = sorted(set(tensors) - set(wanted))
  if unexpected:
    raise ValueError(f"{what}: unexpected tensor {unexpected[0]!r}")
  out = {}
  for path, hf in names.items():
    if hf not in tensors:
      raise ValueError(f"{what}: missing tensor {hf!r}")
    value = tensors[hf]
    expected = tuple(shapes[path])[::-1] if is_transposed(path) else tuple(shapes[path])
    if tuple(np.shape(value)) != expected:
      raise ValueError(f"{what}: tensor {hf!r} has shape {tuple(np.shape(value))}, expected "
                       f"{expected}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise ValueError(f"{what}: tensor {hf!r} has dtype {value.dtype}, expected floating point")
    out[path] = value.T if is_transposed(path) else value
  return out


def _checkpoint_dtype(hf: Mapping[str, Any], tensors: Mapping[str, Any]):
  """The config's dtype, else the tensors' (the widest floating one; refused unless the layers
  compute in it, naming ``dtype``: pass one)."""
  dtype = dtype_from_hf(hf)
  if dtype is None:
    floats = [v.dtype for v in tensors.values() if jnp.issubdtype(v.dtype, jnp.floating)]
    dtype = jnp.result_type(*floats) if floats else jnp.dtype(jnp.float32)
    dtype = validation.check_dtype("dtype (the tensors' own; config.json names none)", dtype)
  return jnp.dtype(dtype)


def load_qwen3(directory: str, *, dtype=None, feature_layers: Sequence[int] = (-1,),
               mesh=None, tp: str = "tp", dp: str | None = None) -> tm.TargetModel:
  """A `TargetModel` from a Hugging Face Qwen3 checkpoint directory.

  Args:
    directory: holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
      and its shards); other files (tokenizer, generation config) are ignored here.
    dtype: the compute and storage dtype; default the checkpoint's (``dtype`` / ``torch_dtype``
      in the config, else the tensors' widest floating dtype). Weights are cast to it.
    feature_layers: the layers whose hidden states the model returns as draft features.
    mesh, tp, dp: a `jax.sharding.Mesh` to load straight into shards (`dspark_jax.shard`'s
      layout over axis `tp`, replicas over `dp`): each device's part of each tensor is read from
      the files on its own (`safetensors_io.LazyTensors`), no tensor is ever whole on the host.
      None (default): one device.

  Raises:
    FileNotFoundError: no directory, config or weights file (naming the path).
    ValueError: a refused config field (`config_from_hf`), or a missing, unexpected or misshapen
      tensor (naming it). A tied checkpoint may hold ``lm_head.weight`` only if it equals the
      embedding. With a mesh, also: a mesh that does not divide the heads, KV heads, SwiGLU width
      or vocabulary (`models.layout.check_divisible`).
  """
  directory = validation.check_path("directory", directory)
  hf = read_config(directory)
  if mesh is not None:
    return _load_sharded(directory, hf, dtype, feature_layers, layout.Plan(mesh, tp, dp))
  tensors = safetensors_io.read_tensors(directory)
  dtype = (_checkpoint_dtype(hf, tensors) if dtype is None
           else validation.check_dtype("dtype", dtype))
  config = config_from_hf(hf, dtype=dtype, feature_layers=feature_layers)
  if config.tie_embeddings and "lm_head.weight" in tensors:
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None or not np.array_equal(np.asarray(tensors["lm_head.weight"]), np.asarray(embed)):
      raise ValueError(f"{directory}: unexpected tensor 'lm_head.weight' (tie_word_embeddings is "
                       "true and it differs from 'model.embed_tokens.weight')")
    tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
  abstract = nnx.eval_shape(lambda: tm.TargetModel(config, rngs=nnx.Rngs(0)))
  shapes = {k: v.shape for k, v in checkpoints.named_arrays(nnx.state(abstract, nnx.Param)).items()}
  arrays = from_hf_tensors(tensors, hf_names(config), shapes, what=directory)
  return checkpoints.target_from_arrays(config, arrays)


def _load_sharded(directory: str, hf, dtype, feature_layers, plan) -> tm.TargetModel:
  """`load_qwen3` into shards: headers checked as the whole load checks tensors, then each
  device's part read on its own (`parallel.loading`)."""
  tensors = safetensors_io.LazyTensors(directory)
  dtype = (_checkpoint_dtype(hf, tensors) if dtype is None
           else validation.check_dtype("dtype", dtype))
  config = config_from_hf(hf, dtype=dtype, feature_layers=feature_layers)
  layout.check_divisible(plan, vocab_size=config.vocab_size, shapes={"target": config.layer})
  names = hf_names(config)
  if config.tie_embeddings and "lm_head.weight" in tensors:
    embed = "model.embed_tokens.weight"
    same = embed in tensors and tensors[embed].shape == tensors["lm_head.weight"].shape
    rows = tensors[embed].shape[0] if same else 0
    for start in range(0, rows, 4096):  # compared a block of rows at a time
      index = (slice(start, min(start + 4096, rows)), slice(None))
      same = same and np.array_equal(tensors.read("lm_head.weight", index),
                                     tensors.read(embed, index))
    if not same:
      raise ValueError(f"{directory}: unexpected tensor 'lm_head.weight' (tie_word_embeddings is "
                       "true and it differs from 'model.embed_tokens.weight')")
  abstract = nnx.eval_shape(lambda: tm.TargetModel(config, rngs=nnx.Rngs(0)))
  shapes = {k: v.shape for k, v in checkpoints.named_arrays(nnx.state(abstract, nnx.Param)).items()}
  headers = {k: v for k, v in tensors.items() if not (config.tie_embeddings and k == "lm_head.weight")}
  from_hf_tensors(headers, names, shapes, what=directory)   # names, shapes and dtypes checked

  def read(name, index):
    if is_transposed(name):
      return tensors.read(names[name], index[::-1]).T
    return tensors.read(names[name], index)
  return loading.sharded_model(abstract, plan, config.layer, read)


def save_qwen3(target: tm.TargetModel, directory: str, *, max_shard_bytes: int | None = None,
               extra_config: Mapping[str, Any] | None = None) -> list[str]:
  """Writes `target` as a Hugging Face Qwen3 checkpoint that ``Qwen3ForCausalLM.from_pretrained``
  loads into the same model.

  Args:
    target: the model; its tensors are written in its storage dtype (``param_dtype``).
    directory: created if needed; an earlier checkpoint's weight files there are replaced.
    max_shard_bytes: None for one ``model.safetensors``; else shards of at most this many bytes
      with ``model.safetensors.index.json`` (`safetensors_io.write_tensors`).
    extra_config: keys added to ``config.json`` (e.g. ``eos_token_id``); a key `config_to_hf`
      writes is refused (ValueError naming it), so the file always describes the model.

  Returns:
    The names of the files written.
  """
  if not isinstance(target, tm.TargetModel):
    raise ValueError(f"target: expected a TargetModel, got {type(target).__name__}")
  hf = config_to_hf(target.config)
  clash = sorted(set(extra_config or {}) & set(hf))
  if clash:
    raise ValueError(f"extra_config: {clash[0]!r} is written from the model's config")
  hf.update(extra_config or {})
  arrays = checkpoints.named_arrays(placement.canonical_state(target))
  tensors = to_hf_tensors(arrays, hf_names(target.config))
  directory = os.fspath(directory)
  files = safetensors_io.write_tensors(directory, tensors, max_shard_bytes=max_shard_bytes)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")
  return files + [CONFIG_FILE]

