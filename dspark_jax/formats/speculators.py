"""Drafts in the format of the `speculators` library (vLLM's): DSpark and DFlash, as `DSparkDraft`s.

This module owns the mapping between a ``speculators`` draft directory (``config.json`` +
``model.safetensors``, as ``DSparkDraftModel`` / ``DFlashDraftModel.save_pretrained`` of
speculators 0.9 write it) and a `dspark_jax.models.draft.DSparkDraft`.

The config. ``speculators_model_type`` is "dspark" or "dflash"; ``transformer_layer_config`` is
the draft layers' Qwen3 config (``num_hidden_layers`` = draft layers; read by
`qwen3.layer_shape_from_hf`, fields it leaves out take ``Qwen3Config``'s defaults); beside it:

* ``aux_hidden_state_layer_ids``: Hugging Face ``hidden_states`` indices (0 = the embedding
  output, i = decoder layer i-1's output), so ours (DeepSpec's ``target_layer_ids``) are each
  minus one. The target's last layer (index = its layer count) is refused: the library's
  pipeline takes it from vLLM, Hugging Face gives it after the final norm, and no test pins which.
* ``sample_from_anchor``: true is our layout (the block ``[anchor, mask × (γ-1)]``, slot k
  predicts token k+1 after the anchor, the Markov head reads the token before it). False (the
  library's DFlash default, z-lab's layout) makes the anchor the bonus token and slot k predict
  token k; there is no exact form of it here, so it is **refused** by name. Loading it as ours
  would shift every prediction by one position and drop the acceptance to about one token.
* ``block_size`` (γ), ``mask_token_id``; for "dspark": ``markov_rank`` (0: no sequential head),
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``. A "dflash"
  draft has neither head.
* Refused by name: ``draft_vocab_size`` other than the vocabulary (a reduced draft vocabulary with
  ``t2d`` / ``d2t`` maps), a ``target_hidden_size`` other than ``hidden_size``, sliding-window
  layers (``transformer_layer_config.layer_types``), a missing ``mask_token_id``, another
  ``speculators_model_type`` (eagle3, dflash2, ...).
* Written, not read: ``speculators_config`` (algorithm, the greedy proposal of γ tokens, and the
  verifier's ``name_or_path`` and architectures), ``speculators_version``.

The tensors have DeepSpec's names (`deepspec.deepspec_names`): ``layers.{i}.*``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``, ``markov_head.*``, ``confidence_head.proj.*``. The
embedding and LM head are the verifier's: the library leaves them out of the file and fills them
from ``speculators_config.verifier.name_or_path`` on load (overwriting any stored copy), so here
they are the target's; ``embed_tokens.weight`` / ``lm_head.weight`` in a file are ignored as the
library ignores them, and so are the training-only ``verifier_norm.weight`` and
``verifier_lm_head.weight``. DeepSpec's training field ``num_anchors`` has no place in this
format: a loaded draft takes `DraftConfig`'s default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dspark_jax import validation
from dspark_jax.formats import deepspec
from dspark_jax.formats import qwen3
from dspark_jax.formats import safetensors_io
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm

TYPE_FIELD = "speculators_model_type"
MODEL_TYPES = ("dspark", "dflash")
ARCHITECTURES = {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel"}
LIBRARY_VERSION = "0.9.0"
"""The speculators release whose files this module reads and writes (its goldens' version)."""
QWEN3_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "head_dim": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                  "max_position_embeddings": 32768}
"""transformers' ``Qwen3Config`` defaults, which the library's config reader applies to the
fields a ``transformer_layer_config`` leaves out."""
IGNORED = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight",
           "verifier_lm_head.weight")
"""Tensors the library fills from the verifier or uses only in training."""


def is_speculators_config(hf: Any) -> bool:
  """Whether a ``config.json`` dict is a speculators draft's (it has ``speculators_model_type``)."""
  return isinstance(hf, Mapping) and TYPE_FIELD in hf


def _layer_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  layer = hf.get("transformer_layer_config")
  if not isinstance(layer, Mapping):
    raise ValueError(f"config: transformer_layer_config must be a JSON object (the draft layers' "
                     f"Qwen3 config), got {layer!r}")
  if layer.get("model_type", qwen3.MODEL_TYPE) != qwen3.MODEL_TYPE:
    raise ValueError(f"config: transformer_layer_config.model_type {layer.get('model_type')!r} is "
                     f"not {qwen3.MODEL_TYPE!r}")
  return {**QWEN3_DEFAULTS, **layer}


def _flag(hf: Mapping[str, Any], name: str, default: bool) -> bool:
  value = hf.get(name, default)
  if not isinstance(value, bool):
    raise ValueError(f"config: {name} must be true or false, got {value!r}")
  return value


def target_layer_ids(hf: Mapping[str, Any], num_target_layers: int) -> tuple[int, ...]:
  """Our ``target_layer_ids`` (each ``aux_hidden_state_layer_ids`` entry minus one), checked
  against a target of `num_target_layers` layers (ValueError naming the field and entry)."""
  aux = hf.get("aux_hidden_state_layer_ids")
  if not isinstance(aux, (list, tuple)) or not aux:
    raise ValueError(f"config: aux_hidden_state_layer_ids must be a non-empty list of Hugging "
                     f"Face hidden-state indices, got {aux!r}")
  for i, index in enumerate(aux):
    if isinstance(index, bool) or not isinstance(index, int):
      raise ValueError(f"config: aux_hidden_state_layer_ids[{i}] is {index!r}; expected an integer")
    if not 0 <= index < num_target_layers:
      raise ValueError(
          f"config: aux_hidden_state_layer_ids[{i}] is {index}; must be in 0..{num_target_layers - 1}"
          f" (0: the embedding output, i: layer i-1's output) for a target of {num_target_layers} "
          "layers; the last layer's output is not supported")
    if i and index <= aux[i - 1]:
      raise ValueError(f"config: aux_hidden_state_layer_ids[{i}] is {index}; the ids must be "
                       f"strictly increasing (after {aux[i - 1]})")
  return tuple(index - 1 for index in aux)


def deepspec_form(hf: Mapping[str, Any], num_target_layers: int) -> dict[str, Any]:
  """The DeepSpec ``config.json`` dict of the same draft (`deepspec.draft_config_from_deepspec`
  reads it), for a target of `num_target_layers` layers.

  Raises:
    ValueError: naming the speculators field that is missing, malformed, or a convention this
      module does not implement (see the module docstring).
  """
  if not is_speculators_config(hf):
    raise ValueError(f"config: missing required field {TYPE_FIELD!r} (not a speculators draft)")
  kind = hf[TYPE_FIELD]
  if kind not in MODEL_TYPES:
    raise ValueError(f"config: {TYPE_FIELD} {kind!r} is not supported; only {MODEL_TYPES} drafts "
                     "are")
  layer = _layer_config(hf)
  if not _flag(hf, "sample_from_anchor", kind == "dspark"):
    raise ValueError(
        "config: sample_from_anchor false is not supported: that layout makes the anchor the bonus "
        "token and slot k predict token k (block_size - 1 drafts); dspark_jax drafts sample from "
        "the anchor (slot k predicts token k + 1)")
  vocab = deepspec._int(layer, "vocab_size", low=1)
  if hf.get("draft_vocab_size", vocab) != vocab:
    raise ValueError(f"config: draft_vocab_size {hf['draft_vocab_size']!r} differs from the "
                     f"vocabulary ({vocab}); reduced draft vocabularies (t2d / d2t) are not "
                     "supported")
  hidden = hf.get("target_hidden_size")
  if hidden is not None and hidden != layer.get("hidden_size"):
    raise ValueError(f"config: target_hidden_size {hidden!r} differs from "
                     f"transformer_layer_config.hidden_size {layer.get('hidden_size')!r}")
  if hf.get("mask_token_id") is None:
    raise ValueError("config: missing required field 'mask_token_id'")
  types = layer.get("layer_types") or []
  other = [t for t in types if t != "full_attention"]
  if other or layer.get("use_sliding_window"):
    raise ValueError(f"config: transformer_layer_config.layer_types holds "
                     f"{(other or ['sliding_attention'])[0]!r}; only full-attention draft layers "
                     "are supported")
  out = {key: value for key, value in layer.items() if key != "architectures"}
  out.update(
      num_target_layers=num_target_layers,
      target_layer_ids=list(target_layer_ids(hf, num_target_layers)),
      block_size=hf.get("block_size"), mask_token_id=hf["mask_token_id"],
      num_anchors=dm.DraftConfig.num_anchors)
  for name in ("dtype", "torch_dtype"):
    if name in hf:
      out[name] = hf[name]
  if kind == "dflash":
    out.update(markov_rank=0, enable_confidence_head=False)
    return out
  rank = hf.get("markov_rank", 256)
  out["markov_rank"] = rank
  if isinstance(rank, int) and rank > 0:
    out["markov_head_type"] = hf.get("markov_head_type", "vanilla")
  out["enable_confidence_head"] = _flag(hf, "enable_confidence_head", True)
  out["confidence_head_with_markov"] = _flag(hf, "confidence_head_with_markov", True)
  return out


def speculators_config(draft: dm.DSparkDraft, target: tm.TargetModel, *,
                       verifier: str | None = None) -> dict[str, Any]:
  """The ``config.json`` dict the library's ``SpeculatorModel.from_pretrained`` reads for `draft`
  (always a "dspark" draft with ``sample_from_anchor`` true; rank 0 for a DFlash-style one).

  Args:
    verifier: ``speculators_config.verifier.name_or_path``, where the library loads the
      embedding and LM head from (a Hub id or a path); None writes null (the library then leaves
      them unset).
  """
  ours = deepspec.deepspec_config(draft, target)
  layer = {key: ours[key] for key in (
      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
      "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
      "attention_dropout", "use_sliding_window", "sliding_window",
      "layer_types", "use_cache", "dtype")}
  config = draft.config
  hf = {
      "architectures": [ARCHITECTURES["dspark"]],
      TYPE_FIELD: "dspark",
      "speculators_version": LIBRARY_VERSION,
      "transformer_layer_config": layer,
      "draft_vocab_size": target.config.vocab_size,
      "block_size": config.gamma,
      "target_hidden_size": None,
      "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
      "mask_token_id": config.mask_token_id,
      "sliding_window_non_causal": False,
      "sample_from_anchor": True,
      "markov_rank": draft.head.rank,
      "markov_head_type": draft.head.kind if draft.head.kind != "none" else "vanilla",
      "enable_confidence_head": draft.confidence is not None,
      "confidence_head_with_markov": bool(draft.confidence is not None
                                          and config.confidence_with_markov),
      "tie_word_embeddings": False,
      "dtype": ours["dtype"],
      "speculators_config": {
          "algorithm": "dspark",
          "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.gamma,
                                "accept_tolerance": 0.0, "verifier_accept_k": 1}],
          "verifier": {"name_or_path": verifier, "architectures": [qwen3.ARCHITECTURE]},
      },
  }
  if "confidence_temperatures" in ours:
    hf["confidence_temperatures"] = ours["confidence_temperatures"]
  return hf


def load_speculators_draft(directory: str, target: tm.TargetModel, *,
                           dtype=None) -> dm.DSparkDraft:
  """A `DSparkDraft` from a speculators draft directory, for `target` (whose ``feature_layers``
  must be the draft's layers: `dspark_jax.load_pretrained` arranges this).

  Raises:
    FileNotFoundError: no directory, config or weights file (naming the path).
    ValueError: a refused config field (`deepspec_form`, then DeepSpec's own checks), or a
      missing, unexpected or misshapen tensor (naming it).
  """
  directory = os.fspath(directory)
  hf = qwen3.read_config(directory)
  form = deepspec_form(hf, target.config.num_layers)
  tensors = {k: v for k, v in safetensors_io.read_tensors(directory).items() if k not in IGNORED}
  dtype = (qwen3._checkpoint_dtype(form, tensors) if dtype is None
           else validation.check_dtype("dtype", dtype))
  config = deepspec.draft_config_from_deepspec(form, dtype=dtype, target_config=target.config)
  if tuple(target.config.feature_layers) != config.target_layer_ids:
    raise ValueError(f"config: aux_hidden_state_layer_ids {hf['aux_hidden_state_layer_ids']} "
                     f"(our layers {list(config.target_layer_ids)}) differ from the target's "
                     f"feature_layers {list(target.config.feature_layers)}")
  tensors.update(deepspec.target_tables(target))
  return deepspec.draft_from_deepspec_tensors(
      config, target, tensors, what=directory,
      temperatures=deepspec.confidence_temperatures_from_deepspec(form))


def save_speculators_draft(draft: dm.DSparkDraft, directory: str, target: tm.TargetModel, *,
                           verifier: str | None = None,
                           max_shard_bytes: int | None = None) -> list[str]:
  """Writes `draft` as a speculators "dspark" draft directory (no embedding or LM head: the
  library takes them from `verifier`); returns the names of the files written.

  Raises:
    ValueError: not a draft and its target, or a draft that reads the target's final layer.
  """
  deepspec.check_savable(draft, target)
  if verifier is not None and not isinstance(verifier, str):
    raise ValueError(f"verifier: expected a Hub id or a path (str), got {type(verifier).__name__}")
  tensors = {k: v for k, v in deepspec.deepspec_tensors(draft, target).items() if k not in IGNORED}
  return deepspec.write_directory(directory, speculators_config(draft, target, verifier=verifier),
                                  tensors, max_shard_bytes=max_shard_bytes)
