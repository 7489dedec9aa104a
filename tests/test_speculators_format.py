"""speculators drafts: load_pretrained, draft_proposal and save_pretrained against the library.

The golden files (tests/golden/speculators, written by scripts/make_speculators_goldens.py with
speculators 0.9.0, its version in the manifest) hold tiny DSpark (vanilla, gated, rnn) and DFlash
drafts saved by the library for the DeepSpec goldens' tiny Qwen3 targets, the greedy block the
library's own modules compute after a fixed prompt, and the same block computed by the library
from each draft as our ``save_pretrained(..., format="speculators")`` writes it.

Tolerance as in test_deepspec_format: corrected logits to 64 float32 ulps of the row's largest
magnitude, confidences to 64 ulps of 1; tokens exactly (no recorded greedy choice is within 1e-3
of a tie).
"""

import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.formats import safetensors_io, speculators

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "speculators")
MANIFEST = json.load(open(os.path.join(GOLDEN, "manifest.json")))
OUTPUTS = dict(np.load(os.path.join(GOLDEN, "outputs.npz")))
CASES = {case["name"]: case for case in MANIFEST["cases"]}
EPS32 = float(np.finfo(np.float32).eps)
GREEDY = dj.SamplingParams(temperature=0.0, batch_size=1)


def path(*parts):
  return os.path.normpath(os.path.join(GOLDEN, *parts))


@functools.lru_cache(maxsize=None)
def load(name):
  case = CASES[name]
  return dj.load_pretrained(path(case["target_dir"]), path(case["dir"]))


def block_of(target, draft):
  return dj.draft_proposal(target, draft, np.asarray([MANIFEST["prompt"]]), GREEDY,
                           jax.random.key(0))


def assert_block(block, name, prefix=""):
  tokens = OUTPUTS[f"{name}_{prefix}tokens"]
  np.testing.assert_array_equal(np.asarray(block.tokens)[0], tokens)
  theirs = OUTPUTS[f"{name}_{prefix}corrected"].astype(np.float64)
  ours = np.asarray(block.corrected_logits, np.float64)[0]
  scale = np.maximum(np.abs(theirs).max(axis=-1, keepdims=True), 1.0)
  assert (np.abs(ours - theirs) / scale).max() <= 64 * EPS32
  key = f"{name}_{prefix}confidence"
  if key in OUTPUTS:
    expected = 1.0 / (1.0 + np.exp(-OUTPUTS[key].astype(np.float64)))
    np.testing.assert_allclose(np.asarray(block.confidence, np.float64)[0], expected, rtol=0,
                               atol=64 * EPS32)
  else:
    assert block.confidence is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_library_draft_proposes_the_library_block(name):
  """A draft the library saved loads with the layout the library trains (the layers read, the
  heads, the draft's own MLP width) and proposes the block the library's modules compute."""
  target, draft = load(name)
  case = CASES[name]
  assert draft.config.target_layer_ids == tuple(i - 1 for i in case["aux"])
  assert draft.head.kind == (case.get("head") if case["rank"] else "none")
  assert (draft.confidence is not None) == case["confidence"]
  assert draft.shape.intermediate_size == 8 and draft.config.gamma == case["block_size"]
  assert_block(block_of(target, draft), name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_draft_is_the_library_draft(name, tmp_path):
  """save_pretrained(format="speculators") writes what the library loads into the same block (the
  library's run on our file is in the goldens), with the library's tensors, and reads back into
  the same draft."""
  target, draft = load(name)
  assert_block(block_of(target, draft), name, prefix="roundtrip_")
  files = dj.save_pretrained(draft, tmp_path, target=target, format="speculators",
                             verifier=CASES[name]["target_dir"])
  assert sorted(files) == ["config.json", "model.safetensors"]
  ours = safetensors_io.read_tensors(str(tmp_path))
  theirs = safetensors_io.read_tensors(path(name))
  assert sorted(ours) == sorted(theirs)
  for key, value in theirs.items():
    np.testing.assert_array_equal(ours[key], value, err_msg=key)
  written = json.load(open(tmp_path / "config.json"))
  library = json.load(open(path(name, "config.json")))
  for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size",
              "sample_from_anchor", "target_hidden_size"):
    assert written[key] == library[key], key
  # Every draft is written as "dspark" (a DFlash one with markov_rank 0 and no confidence head).
  assert written["speculators_model_type"] == written["speculators_config"]["algorithm"] == "dspark"
  assert (dict(written["speculators_config"], algorithm=None)
          == dict(library["speculators_config"], algorithm=None))
  again = dj.load_pretrained(path(CASES[name]["target_dir"]), str(tmp_path))[1]
  assert_block(block_of(target, again), name)


def test_written_config_matches_the_library_config():
  """Our writer's fields for a DSpark draft are the library's, with the library's values (its
  auto_map is left out: it names a config.py the library's own loader never reads)."""
  target, draft = load("dspark_vanilla")
  ours = speculators.speculators_config(draft, target, verifier="../deepspec/target_untied")
  library = json.load(open(path("dspark_vanilla", "config.json")))
  assert set(library) - set(ours) == {"auto_map", "transformers_version"}
  for key in set(library) & set(ours):
    if key != "transformer_layer_config":
      assert ours[key] == library[key], key
  layer = library["transformer_layer_config"]
  for key, value in ours["transformer_layer_config"].items():
    assert layer[key] == value, key


def _copy(name, tmp_path, **changes):
  out = tmp_path / name
  shutil.copytree(path(name), out)
  config = json.load(open(out / "config.json"))
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  json.dump(config, open(out / "config.json", "w"))
  return out


@pytest.mark.parametrize("name, changes, message", [
    ("dflash", {"sample_from_anchor": False}, "sample_from_anchor false is not supported"),
    ("dspark_vanilla", {"sample_from_anchor": False}, "sample_from_anchor false is not supported"),
    ("dspark_vanilla", {"draft_vocab_size": 32}, "draft_vocab_size 32 differs"),
    ("dspark_vanilla", {"aux_hidden_state_layer_ids": [0, 3]},
     r"aux_hidden_state_layer_ids\[1\] is 3; must be in 0..2"),
    ("dspark_vanilla", {"aux_hidden_state_layer_ids": [2, 0]},
     r"aux_hidden_state_layer_ids\[1\] is 0; the ids must be strictly increasing"),
    ("dspark_vanilla", {"speculators_model_type": "eagle3"},
     "speculators_model_type 'eagle3' is not supported"),
    ("dspark_vanilla", {"target_hidden_size": 64}, "target_hidden_size 64 differs"),
    ("dspark_vanilla", {"mask_token_id": None}, "missing required field 'mask_token_id'"),
    ("dspark_vanilla", {"markov_head_type": "lstm"}, "markov_head_type 'lstm' is not one of"),
])
def test_conventions_not_implemented_are_refused_by_name(tmp_path, name, changes, message):
  """A speculators field whose convention we do not implement is refused, naming the field and
  the draft's directory, never loaded as something else."""
  directory = _copy(name, tmp_path, **changes)
  with pytest.raises(ValueError, match=message) as error:
    dj.load_pretrained(path(CASES[name]["target_dir"]), str(directory))
  assert str(error.value).startswith(str(directory))


def test_sliding_window_layers_are_refused(tmp_path):
  """Sliding-window draft layers (the library's dflash2 layout) are refused by name."""
  config = json.load(open(path("dspark_gated", "config.json")))
  layer = dict(config["transformer_layer_config"], layer_types=["sliding_attention"])
  directory = _copy("dspark_gated", tmp_path, transformer_layer_config=layer)
  with pytest.raises(ValueError, match="transformer_layer_config.layer_types holds "
                                       "'sliding_attention'"):
    dj.load_pretrained(path(CASES["dspark_gated"]["target_dir"]), str(directory))


def test_qwen3_defaults_are_transformers_defaults():
  """The defaults filled into a transformer_layer_config are transformers' Qwen3Config's."""
  transformers = pytest.importorskip("transformers")
  defaults = transformers.Qwen3Config().to_dict()
  for key, value in speculators.QWEN3_DEFAULTS.items():
    assert defaults[key] == value, key


def test_save_refuses_bad_format_and_verifier(tmp_path):
  """format and verifier are checked by name."""
  target, draft = load("dflash")
  with pytest.raises(ValueError, match="format: expected one of"):
    dj.save_pretrained(draft, tmp_path, target=target, format="vllm")
  with pytest.raises(ValueError, match="verifier: only the speculators format"):
    dj.save_pretrained(draft, tmp_path, target=target, verifier="x")
  with pytest.raises(ValueError, match="verifier: expected a Hub id or a path"):
    dj.save_pretrained(draft, tmp_path, target=target, format="speculators", verifier=3)
