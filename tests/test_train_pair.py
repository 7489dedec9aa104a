"""scripts/train_pair.py and the corpus of dspark_jax.train.data: the corpus rules (deduplication, cap,
split, calibration files), the draft's feature layers, the budget-fitted schedule, a checkpoint
with calibrated temperatures, and a whole ``--tiny --stage all`` run whose exports load."""

import importlib.util
import json
import os
import zlib

import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax.models import draft as dm
from dspark_jax.formats import shipped
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.text import load_tokenizer
from dspark_jax.formats import checkpoints
from dspark_jax.text import byte_bpe
from dspark_jax.train import data

_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                       "train_pair.py")
_spec = importlib.util.spec_from_file_location("train_pair", _SCRIPT)
train_pair = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_pair)


# ---- corpus ---------------------------------------------------------------------------------------


def _write(root, relative, text):
  file = root / relative
  file.parent.mkdir(parents=True, exist_ok=True)
  file.write_bytes(text.encode() if isinstance(text, str) else text)


@pytest.fixture
def sources(tmp_path, monkeypatch):
  """A stand-in standard library and an importable package `fakepkg_tp` (never imported)."""
  lib = tmp_path / "lib"
  for i in range(40):
    _write(lib, f"mod{i:02d}.py", f"def f{i}():\n  return {i}\n" * (i + 1))
  _write(lib, "copy_of_mod03.py", (lib / "mod03.py").read_text())     # a duplicate
  _write(lib, "blank.py", "  \n\n")                                   # empty
  _write(lib, "huge.py", "x = 1\n" * 400)                             # 2400 bytes
  _write(lib, "site-packages/skipped.py", "never = True\n")
  _write(lib, "notes.txt", "not python\n")
  site = tmp_path / "site"
  _write(site, "fakepkg_tp/__init__.py", "from .core import g\n")
  _write(site, "fakepkg_tp/core.py", "def g():\n  return 'g'\n" * 5)
  _write(site, "fakepkg_tp/sub/dup.py", (lib / "mod05.py").read_text())  # a stdlib duplicate
  monkeypatch.syspath_prepend(str(site))
  return lib


def test_corpus_deduplicates_caps_and_records(sources):
  corpus = data.collect_corpus(["fakepkg_tp", "no_such_package_tp"], max_file_bytes=2000,
                               stdlib_root_dir=str(sources))
  keys = [f.key for f in corpus.files]
  assert "site-packages/skipped.py" not in keys and "notes.txt" not in keys
  assert "huge.py" not in keys and "blank.py" not in keys
  assert ("mod03.py" in keys) != ("copy_of_mod03.py" in keys)           # one copy kept
  assert "fakepkg_tp/sub/dup.py" not in keys and "mod05.py" in keys      # stdlib wins
  assert {"fakepkg_tp/__init__.py", "fakepkg_tp/core.py"} <= set(keys)
  assert "fakepkg_tp" not in sys_modules_names()                        # found, not imported
  assert keys == [f.key for f in sorted(corpus.files, key=data.priority)]
  assert [f.source for f in corpus.files] == [data.STDLIB] * 40 + ["fakepkg_tp"] * 2
  info = corpus.info
  stdlib, package = info["sources"]
  assert (stdlib["duplicates"], stdlib["empty"], stdlib["too_large"]) == (1, 1, 1)
  assert (package["name"], package["duplicates"], package["files"]) == ("fakepkg_tp", 1, 2)
  assert info["missing_packages"] == ["no_such_package_tp"]
  assert info["bytes"] == sum(f.size for f in corpus.files) == sum(len(t) for t in corpus.texts)
  assert info["files"] == stdlib["files"] + package["files"] == len(corpus.texts)
  train, held = corpus.split()
  assert sorted(train + held) == list(range(len(keys)))
  assert all((zlib.crc32(keys[i].encode()) % 20 == 0) == (i in held) for i in range(len(keys)))
  assert info["held_out_files"] == len(held) and info["train_files"] == len(train)

  again = data.collect_corpus(["fakepkg_tp"], max_file_bytes=2000, stdlib_root_dir=str(sources))
  assert [f.key for f in again.files] == keys and again.texts == corpus.texts

  cap = sum(f.size for f in corpus.files[:10]) + 1
  capped = data.collect_corpus(["fakepkg_tp"], max_bytes=cap, max_file_bytes=2000,
                               stdlib_root_dir=str(sources))
  assert [f.key for f in capped.files] == keys[:10]                     # a prefix in order
  assert capped.info["bytes"] < cap
  assert sum(s["over_cap"] for s in capped.info["sources"]) > 0
  with pytest.raises(ValueError, match="max_bytes"):
    data.collect_corpus([], max_bytes=0, stdlib_root_dir=str(sources))
  with pytest.raises(ValueError, match="packages: 'not-a-name'"):
    data.collect_corpus(["not-a-name"], stdlib_root_dir=str(sources))


def sys_modules_names():
  import sys
  return set(sys.modules)


def test_calibration_files_are_train_files():
  keys = [f"pkg/module_{i}.py" for i in range(4000)]
  calibration = [k for k in keys if data.is_calibration(k)]
  assert 20 < len(calibration) < 80                                     # about 1 %
  assert not any(data.is_held_out(k) for k in calibration)
  assert all(zlib.crc32(k.encode()) % 100 == 1 for k in calibration)
  with pytest.raises(ValueError, match="modulus"):
    data.is_calibration("a.py", 1)


def test_encode_each_ends_every_file_with_end_of_text():
  tokenizer = data.train_tokenizer(["def f(x):\n  return x\n"] * 20, vocab_size=300)
  arrays = data.encode_each(tokenizer, ["a = 1\n", "def f(x):\n  return x\n"])
  assert [a[-1] for a in arrays] == [byte_bpe.END_OF_TEXT_ID] * 2
  assert all(a.dtype == np.uint16 for a in arrays)
  stream = data.join(arrays)
  np.testing.assert_array_equal(stream, data.encode_files(tokenizer, ["a = 1\n",
                                                                      "def f(x):\n  return x\n"]))
  assert tokenizer.decode(arrays[1][:-1].tolist()) == "def f(x):\n  return x\n"
  assert data.join([]).shape == (0,)


# ---- configuration and schedule ------------------------------------------------------------------


def test_feature_layers_spread_like_qwen3_and_skip_the_final_layer():
  assert train_pair.spread_layers(36) == (1, 9, 17, 25, 33)
  assert train_pair.spread_layers(12) == (1, 3, 5, 7, 9)
  assert train_pair.spread_layers(2) == (0,)
  for n in range(2, 65):
    ids = train_pair.spread_layers(n)
    assert list(ids) == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < n - 1
  with pytest.raises(ValueError, match="num_layers"):
    train_pair.spread_layers(1)
  full = train_pair.target_config(False, 8192)
  assert full.num_layers - 1 not in full.feature_layers
  for markov in (True, False):
    assert train_pair.draft_choices(False, markov, full)["target_layer_ids"] == full.feature_layers


def test_repetition_flags_loops():
  loop = [5, 6, 7] * 40
  assert train_pair.repetition(loop)["loop"] and train_pair.repetition(loop)["repeated_4grams"] > 0.9
  fresh = list(range(120))
  assert train_pair.repetition(fresh) == {"repeated_4grams": 0.0, "loop": False}
  assert not train_pair.repetition([1, 2, 3])["loop"]


def test_draft_checkpoint_keeps_calibrated_temperatures(tmp_path):
  config = tm.TargetConfig(vocab_size=64, num_layers=2, feature_layers=(0,),
                           layer=layers.LayerShape(hidden_size=16, num_heads=2, num_kv_heads=1,
                                                   head_dim=8, intermediate_size=32))
  draft_config = dm.DraftConfig(gamma=3, target_layer_ids=(0,), rank=4)
  abstract = nnx.eval_shape(lambda: dm.DSparkDraft(draft_config, config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  arrays = {k: rng.standard_normal(v.shape).astype(np.float32)
            for k, v in checkpoints.named_arrays(nnx.state(abstract, nnx.Param)).items()}
  arrays["confidence.temperatures"] = np.array([0.5, 1.25, 2.0], np.float32)
  draft = checkpoints.draft_from_arrays(draft_config, config, arrays)
  head = draft.confidence.arrays()
  np.testing.assert_array_equal(np.asarray(head["temperatures"]), [0.5, 1.25, 2.0])
  file = str(tmp_path / "draft.safetensors")
  checkpoints.save_model(file, draft)
  loaded = checkpoints.load_draft(file, config)
  np.testing.assert_array_equal(np.asarray(loaded.confidence.temperatures[...]), [0.5, 1.25, 2.0])
  np.testing.assert_array_equal(np.asarray(loaded.confidence.w[...]), np.asarray(head["w"]))

  arrays = checkpoints.load_arrays(file)
  arrays["confidence.temperatures"] = np.ones((4,), np.float32)
  with pytest.raises(ValueError, match=r"'confidence.temperatures' has shape \(4,\), expected \(3,\)"):
    checkpoints.draft_from_arrays(loaded.config, config, arrays)
  plain = dm.DraftConfig(gamma=3, target_layer_ids=(0,), rank=4, confidence=False,
                         confidence_with_markov=False)
  with pytest.raises(ValueError, match="no confidence head"):
    checkpoints.draft_from_arrays(plain, config, {"confidence.temperatures": np.ones((3,), np.float32)})


def test_budgets_are_shared_and_parsed():
  budgets = train_pair.parse_budgets("target=100,draft=50")
  assert budgets["target"] == 100 and budgets["draft"] == 50 and budgets["data"] == 50
  stages = list(train_pair.STAGES)
  total = sum(budgets.values())
  assert train_pair.budget_for("target", total, stages, budgets) == pytest.approx(100)
  assert train_pair.budget_for("target", total / 2, stages, budgets) == pytest.approx(50)
  assert train_pair.budget_for("target", total * 2, stages, budgets) == pytest.approx(130)
  assert train_pair.budget_for("data", total * 2, stages, budgets) == pytest.approx(50)
  with pytest.raises(SystemExit, match="unknown stage 'nope'"):
    train_pair.parse_budgets("nope=3")


# ---- the whole pipeline ---------------------------------------------------------------------------


@pytest.mark.slow  # about 40 s of CPU on 2 cores: six programs compiled
def test_tiny_all_stages_export_pairs_that_load(tmp_path, capsys):
  work, export, hf, logs = (str(tmp_path / n) for n in ("work", "export", "hf", "logs"))
  train_pair.main(["--tiny", "--stage", "all", "--work", work, "--export", export,
                   "--hf-dir", hf, "--logs", logs])
  out = capsys.readouterr().out
  table = out[out.rindex("stage        seconds"):]
  for stage in train_pair.STAGES:
    assert f"\n{stage} " in table
  assert "\ntotal " in table and "FAILED" not in table

  manifest = json.load(open(os.path.join(export, "manifest.json")))
  corpus = manifest["corpus"]
  assert [s["name"] for s in corpus["sources"]] == ["stdlib", "optax"]
  assert corpus["sources"][1]["version"] and corpus["train_tokens"] > 0
  assert corpus["split_rule"].startswith("held out iff crc32(key) % 20 == 0")
  assert manifest["files"]["ablation"]["steps"] == manifest["files"]["draft"]["steps"]
  cal = manifest["calibration"]
  gamma = 3
  assert len(cal["stored_temperatures"]) == gamma and cal["rounds"] > 0
  for group in cal["groups"].values():
    assert len(group["ece_before"]) == len(group["ece_after"]) == gamma
  # STS never raises the ECE of the positions it fits (a grid with T = 1 near the start).
  whole = cal["groups"]["all"]
  assert whole["ece_after"][0] <= whole["ece_before"][0] + 0.02

  pair = shipped.load_shipped(export)
  target_layers = pair.target.config.num_layers
  assert target_layers - 1 not in pair.draft.config.target_layer_ids
  np.testing.assert_array_equal(np.asarray(pair.draft.confidence.temperatures[...], np.float64),
                                cal["stored_temperatures"])
  assert pair.ablation.confidence.temperatures is None
  assert pair.tokenizer.get_vocab_size() == pair.target.config.vocab_size
  assert pair.prompts and pair.decode(pair.encode(pair.prompts[0])) == pair.prompts[0]

  target, draft = dj.load_pretrained(os.path.join(hf, "target"), os.path.join(hf, "draft"))
  np.testing.assert_array_equal(
      np.asarray(target.embed.embedding[...], np.float32),
      np.asarray(pair.target.embed.embedding[...], np.float32))
  np.testing.assert_array_equal(np.asarray(draft.head.w2[...], np.float32),
                                np.asarray(pair.draft.head.w2[...], np.float32))
  np.testing.assert_array_equal(np.asarray(draft.confidence.temperatures[...], np.float64),
                                cal["stored_temperatures"])
  assert target.config.feature_layers == pair.draft.config.target_layer_ids
  assert load_tokenizer(os.path.join(hf, "target")).eos_token_ids == (byte_bpe.END_OF_TEXT_ID,)
  _, ablation = dj.load_pretrained(os.path.join(hf, "target"), os.path.join(hf, "ablation"))
  assert ablation.head.kind == "none" and ablation.config.rank == 0
  assert {"corpus.json", "calibration_log.json", "target_log.json"} <= set(os.listdir(logs))
  # The drafters were trained by `dspark-jax train`'s function, which wrote them loadable as
  # they are, with their resumable state; the ablation ran on the drafter's horizon.
  draft_log = json.load(open(os.path.join(work, "draft_log.json")))
  ablation_log = json.load(open(os.path.join(work, "ablation_log.json")))
  assert draft_log["run"]["horizon"] == ablation_log["run"]["horizon"] == 30
  _, command_draft = dj.load_pretrained(os.path.join(work, "hf_target"),
                                        os.path.join(work, "draft"))
  assert command_draft.config.gamma == gamma and command_draft.head.kind == "vanilla"
  assert os.path.exists(os.path.join(work, "draft", "training", "train_state.safetensors"))
  assert command_draft.config.rank == pair.draft.config.rank
  assert command_draft.config.target_layer_ids == pair.draft.config.target_layer_ids
