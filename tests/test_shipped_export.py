"""The shipped pair in the public formats: `save_pretrained` writes the target as a Hugging Face Qwen3
directory and the drafts as DeepSpec directories, and `load_pretrained` gives the same models back.

The shipped drafts read target layers that are not the final one, so the DeepSpec format can express
them (`scripts/train_pair.py --stage export-hf` does the same at scale). Weights are compared bit
for bit in their storage dtypes and the configs field by field (they differ only in
`max_position_embeddings`, which is not enforced), so the round-tripped pair and the shipped one
build the same programs; decoding equality is proven on tiny pairs against transformers and DeepSpec
(tests/test_qwen3_format.py, tests/test_deepspec_format.py).
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax.formats import deepspec
from dspark_jax.formats import shipped
from dspark_jax.formats import checkpoints


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(shipped pair in bf16 compute, directory with target/, draft/, ablation/ written by
  save_pretrained)."""
  pair = shipped.load_shipped(compute_dtype=jnp.bfloat16)
  root = tmp_path_factory.mktemp("shipped_hf")
  dj.save_pretrained(pair.target, str(root / "target"))
  for name in ("draft", "ablation"):
    dj.save_pretrained(getattr(pair, name), str(root / name), target=pair.target)
  return pair, root


def assert_same_weights(ours, theirs):
  """Same names, dtypes and stored bits (bf16 matrices; the confidence head is kept in float32)."""
  a = checkpoints.named_arrays(nnx.state(ours, nnx.Param))
  b = checkpoints.named_arrays(nnx.state(theirs, nnx.Param))
  assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
  for name in a:
    x, y = np.asarray(a[name]), np.asarray(b[name])
    assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
    np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8),
                                  err_msg=name)


def test_shipped_pair_saves_and_loads_back_exactly(exported):
  pair, root = exported
  config = json.load(open(root / "draft" / "config.json"))
  assert config["architectures"] == ["Qwen3DSparkModel"]
  assert config["target_layer_ids"] == list(pair.draft.config.target_layer_ids)
  assert config["num_target_layers"] == pair.target.config.num_layers
  assert max(config["target_layer_ids"]) < pair.target.config.num_layers - 1  # not the final layer
  assert json.load(open(root / "target" / "config.json"))["architectures"] == ["Qwen3ForCausalLM"]

  target, draft = dj.load_pretrained(str(root / "target"), str(root / "draft"))
  ablation = deepspec.load_deepspec_draft(str(root / "ablation"), target)
  assert target.config == dataclasses.replace(pair.target.config, max_position_embeddings=32768)
  assert_same_weights(pair.target, target)
  for ours, back in ((pair.draft, draft), (pair.ablation, ablation)):
    assert back.config == dataclasses.replace(ours.config, layer=pair.target.config.layer)
    assert_same_weights(ours, back)
  # The STS temperatures stored in the shipped draft's confidence head travel with it.
  temperatures = pair.draft.confidence.temperatures
  assert temperatures is not None
  assert config["confidence_temperatures"] == [float(t) for t in np.asarray(temperatures[...])]
