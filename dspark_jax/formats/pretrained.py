"""`load_pretrained` / `save_pretrained`: a Hugging Face Qwen3 target and a DeepSpec draft, by
directory.

This module owns the two entry points that pair the formats:

* the target is a transformers ``Qwen3ForCausalLM`` directory (`dspark_jax.formats.qwen3`);
* the draft is a DeepSpec ``Qwen3DSparkModel`` directory (`dspark_jax.formats.deepspec`): DSpark
  (a Markov head of rank r > 0: vanilla, gated or rnn) or DFlash-style (``markov_rank`` 0), with
  or without a confidence head.

The target returns as its draft features exactly the layers the draft's ``target_layer_ids`` names
(-1: the embedding output; i: decoder layer i's output, Hugging Face ``hidden_states[i + 1]``).
The draft shares the target's embedding and LM head; a draft whose stored copies differ from them
is refused (see `dspark_jax.formats.deepspec`).
"""

from __future__ import annotations

import os

from dspark_jax.formats import deepspec
from dspark_jax.formats import qwen3
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm


def load_pretrained(target_dir: str, draft_dir: str | None = None, *, dtype=None
                    ) -> tuple[tm.TargetModel, dm.DSparkDraft | None]:
  """Loads a Hugging Face Qwen3 target and, optionally, a DeepSpec draft for it.

  Args:
    target_dir: ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
      with its shards); tokenizer and generation files may sit beside them.
    draft_dir: a DeepSpec draft directory, or None for the target alone.
    dtype: the compute and storage dtype of both models; default each checkpoint's own.

  Returns:
    ``(target, draft)``; `draft` is None without `draft_dir`. With a draft, the target's
    ``feature_layers`` are the draft's ``target_layer_ids``, so ``dspark_jax.generate(target,
    draft, ...)`` and ``dspark_jax.draft_proposal`` run the pair as DeepSpec's evaluator does.

  Raises:
    FileNotFoundError: a missing directory, config or weights file (naming the path).
    ValueError: a config field or tensor that is refused (naming it): see `qwen3.load_qwen3` and
      `deepspec.load_deepspec_draft`; ``target_layer_ids`` outside the target or on its final
      layer, or ``num_target_layers`` other than the target's layer count.
  """
  if draft_dir is None:
    return qwen3.load_qwen3(target_dir, dtype=dtype), None
  hf_target = qwen3.read_config(os.fspath(target_dir))
  hf_draft = deepspec.read_draft_config(os.fspath(draft_dir))
  deepspec.draft_config_from_deepspec(hf_draft, dtype=dtype)  # its own fields, before any weights
  layers = hf_target.get("num_hidden_layers")
  if isinstance(layers, int) and not isinstance(layers, bool):
    if deepspec._int(hf_draft, "num_target_layers", low=1) != layers:
      raise ValueError(f"config: num_target_layers {hf_draft['num_target_layers']} of the draft "
                       f"differs from the target's num_hidden_layers {layers}")
    layer_ids = deepspec.check_target_layer_ids(hf_draft.get("target_layer_ids"), layers)
  else:
    layer_ids = (-1,)  # the target's own config check names the bad field
  target = qwen3.load_qwen3(target_dir, dtype=dtype, feature_layers=layer_ids)
  return target, deepspec.load_deepspec_draft(draft_dir, target, dtype=dtype)


def save_pretrained(model: tm.TargetModel | dm.DSparkDraft, directory: str, *,
                    target: tm.TargetModel | None = None,
                    max_shard_bytes: int | None = None) -> list[str]:
  """Writes a target as a Hugging Face Qwen3 checkpoint, or a draft as a DeepSpec one.

  ``Qwen3ForCausalLM.from_pretrained`` (a target) and DeepSpec's
  ``Qwen3DSparkModel.from_pretrained`` (a draft) load the result into models with the same
  outputs; `load_pretrained` reads it back.

  Args:
    model: a `TargetModel` or a `DSparkDraft`; written in its storage dtype.
    directory: created if needed; an earlier checkpoint's weight files there are replaced.
    target: for a draft, the target whose embedding and LM head it shares (DeepSpec stores copies
      of them); not used for a target.
    max_shard_bytes: None for one ``model.safetensors``; else shards with an index.

  Returns:
    The names of the files written.

  Raises:
    ValueError: `model` is neither, a draft without its `target` or with one it does not fit.
  """
  if isinstance(model, tm.TargetModel):
    if target is not None:
      raise ValueError("target: only a draft takes a target (it shares the target's embedding "
                       "and LM head)")
    return qwen3.save_qwen3(model, directory, max_shard_bytes=max_shard_bytes)
  if isinstance(model, dm.DSparkDraft):
    if target is None:
      raise ValueError("target: saving a draft needs the target it shares its embedding and LM "
                       "head with (DeepSpec's format stores copies of them)")
    return deepspec.save_deepspec_draft(model, directory, target, max_shard_bytes=max_shard_bytes)
  raise ValueError(f"model: expected a TargetModel or a DSparkDraft, got {type(model).__name__}")
