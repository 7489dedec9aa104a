"""`load_pretrained` / `save_pretrained`: a Hugging Face Qwen3 target and a DeepSpec or
`speculators` draft, by directory.

This module owns the two entry points that pair the formats:

* the target is a transformers ``Qwen3ForCausalLM`` directory (`dspark_jax.formats.qwen3`);
* the draft is a DeepSpec ``Qwen3DSparkModel`` directory (`dspark_jax.formats.deepspec`) or a
  ``speculators`` "dspark" / "dflash" directory (`dspark_jax.formats.speculators`; told apart by
  the config's ``speculators_model_type``): DSpark (a Markov head of rank r > 0: vanilla, gated or
  rnn) or DFlash-style (rank 0), with or without a confidence head.

The target returns as its draft features exactly the layers the draft reads (DeepSpec's
``target_layer_ids``: -1 the embedding output, i decoder layer i's output, Hugging Face
``hidden_states[i + 1]``; speculators' ``aux_hidden_state_layer_ids`` are those indices
themselves). The draft shares the target's embedding and LM head.
"""

from __future__ import annotations

import os

from dspark_jax.formats import deepspec
from dspark_jax.formats import qwen3
from dspark_jax.formats import speculators
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax import validation

DRAFT_FORMATS = ("deepspec", "speculators")


def load_pretrained(target_dir: str, draft_dir: str | None = None, *, dtype=None, mesh=None,
                    tp: str = "tp", dp: str | None = None
                    ) -> tuple[tm.TargetModel, dm.DSparkDraft | None]:
  """Loads a Hugging Face Qwen3 target and, optionally, a DeepSpec or speculators draft for it.

  Args:
    target_dir: ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
      with its shards); tokenizer and generation files may sit beside them.
    draft_dir: a DeepSpec or speculators draft directory, or None for the target alone.
    dtype: the compute and storage dtype of both models (float32, bfloat16 or float16); default
      each checkpoint's own.
    mesh, tp, dp: a `jax.sharding.Mesh` to load into (`dspark_jax.shard`'s layout; axis `tp`
      splits the weights, `dp` holds replicas). The target is read straight into shards, each
      device's part of each tensor on its own (`qwen3.load_qwen3`); the draft, small, is read
      whole and then placed. None (default): one device.

  Returns:
    ``(target, draft)``; `draft` is None without `draft_dir`. With a draft, the target's
    ``feature_layers`` are the layers the draft reads, so ``dspark_jax.generate(target, draft,
    ...)`` and ``dspark_jax.draft_proposal`` run the pair as DeepSpec's evaluator does.

  Raises:
    TypeError: `target_dir` or `draft_dir` is not a path (naming it).
    FileNotFoundError: a missing directory, config or weights file (naming the path).
    ValueError: a `dtype` other than float32, bfloat16 or float16; a config field or tensor that is
      refused (naming it): see `qwen3.load_qwen3`, `deepspec.load_deepspec_draft` and
      `speculators.load_speculators_draft`; draft layers outside the target or on its final layer,
      or a DeepSpec ``num_target_layers`` other than the target's layer count. Errors about the
      draft's files start with `draft_dir`'s path.
  """
  target_dir = validation.check_path("target_dir", target_dir)
  if dtype is not None:
    dtype = validation.check_dtype("dtype", dtype)
  sharding = dict(mesh=mesh, tp=tp, dp=dp)
  if draft_dir is None:
    return qwen3.load_qwen3(target_dir, dtype=dtype, **sharding), None
  draft_dir = validation.check_path("draft_dir", draft_dir)
  hf_target = qwen3.read_config(target_dir)
  layers = hf_target.get("num_hidden_layers")
  known = isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1
  with _naming(draft_dir):
    hf_draft = deepspec.read_draft_config(draft_dir)
    if speculators.is_speculators_config(hf_draft):
      layer_ids = (speculators.target_layer_ids(hf_draft, layers) if known else (-1,))
      load_draft = speculators.load_speculators_draft
    else:
      deepspec.draft_config_from_deepspec(hf_draft, dtype=dtype)  # its own fields, before weights
      layer_ids = (-1,)  # the target's own config check names the bad field
      if known:
        if deepspec._int(hf_draft, "num_target_layers", low=1) != layers:
          raise ValueError(f"config: num_target_layers {hf_draft['num_target_layers']} of the "
                           f"draft differs from the target's num_hidden_layers {layers}")
        layer_ids = deepspec.check_target_layer_ids(hf_draft.get("target_layer_ids"), layers)
      load_draft = deepspec.load_deepspec_draft
  target = qwen3.load_qwen3(target_dir, dtype=dtype, feature_layers=layer_ids, **sharding)
  with _naming(draft_dir):
    draft = load_draft(draft_dir, target, dtype=dtype)
    if mesh is not None:
      _, draft = placement.shard(target, draft, mesh, tp=tp, dp=dp)
  return target, draft


class _naming:
  """Prefixes a ValueError raised inside with `path` (the draft's directory) unless it already
  names a file in it, so that a draft's refusal is never read as the target's."""

  def __init__(self, path: str):
    self.path = os.fspath(path)

  def __enter__(self):
    return self

  def __exit__(self, kind, error, traceback):
    if kind is ValueError and not str(error).startswith(self.path):
      raise ValueError(f"{self.path}: {error}") from None
    return False


def save_pretrained(model: tm.TargetModel | dm.DSparkDraft, directory: str, *,
                    target: tm.TargetModel | None = None,
                    max_shard_bytes: int | None = None, format: str = "deepspec",
                    verifier: str | None = None) -> list[str]:
  """Writes a target as a Hugging Face Qwen3 checkpoint, or a draft as a DeepSpec or speculators
  one.

  ``Qwen3ForCausalLM.from_pretrained`` (a target), DeepSpec's ``Qwen3DSparkModel.from_pretrained``
  and speculators' ``SpeculatorModel.from_pretrained`` (a draft) load the result into models with
  the same outputs; `load_pretrained` reads it back.

  Args:
    model: a `TargetModel` or a `DSparkDraft`; written in its storage dtype.
    directory: created if needed; an earlier checkpoint's weight files there are replaced.
    target: for a draft, the target whose embedding and LM head it shares (DeepSpec stores copies
      of them); not used for a target.
    max_shard_bytes: None for one ``model.safetensors``; else shards with an index.
    format: a draft's format, "deepspec" (default) or "speculators" (a "dspark" draft).
    verifier: with format "speculators", the verifier's Hub id or path written as
      ``speculators_config.verifier.name_or_path`` (the library loads the embedding and LM head
      from it).

  Returns:
    The names of the files written.

  Raises:
    ValueError: `model` is neither, a draft without its `target` or with one it does not fit, an
      unknown `format`, or `format` / `verifier` given for a target.
  """
  if format not in DRAFT_FORMATS:
    raise ValueError(f"format: expected one of {DRAFT_FORMATS}, got {format!r}")
  if isinstance(model, tm.TargetModel):
    if target is not None:
      raise ValueError("target: only a draft takes a target (it shares the target's embedding "
                       "and LM head)")
    if format != "deepspec" or verifier is not None:
      raise ValueError("format: a target is always written as a Hugging Face Qwen3 checkpoint; "
                       "format and verifier are for drafts")
    return qwen3.save_qwen3(model, directory, max_shard_bytes=max_shard_bytes)
  if isinstance(model, dm.DSparkDraft):
    if target is None:
      raise ValueError("target: saving a draft needs the target it shares its embedding and LM "
                       "head with (DeepSpec's format stores copies of them)")
    if format == "speculators":
      return speculators.save_speculators_draft(model, directory, target, verifier=verifier,
                                                max_shard_bytes=max_shard_bytes)
    if verifier is not None:
      raise ValueError("verifier: only the speculators format records a verifier")
    return deepspec.save_deepspec_draft(model, directory, target, max_shard_bytes=max_shard_bytes)
  raise ValueError(f"model: expected a TargetModel or a DSparkDraft, got {type(model).__name__}")
