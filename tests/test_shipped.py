"""The shipped pair (files, manifest, tokenizer), demo and eval end to end, and training basics."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.formats import checkpoints
from dspark_jax.apps import cli
from dspark_jax.text import byte_bpe
from dspark_jax.train import data
from dspark_jax.models import layers
from dspark_jax.formats import shipped
from dspark_jax.train import trainer as training
from dspark_jax.models import target as tm


@pytest.fixture(scope="module")
def pair():
  return shipped.load_shipped()


def test_shipped_files_match_the_manifest(pair):
  manifest = json.load(open(os.path.join(shipped.ASSETS, "manifest.json")))
  total = 0
  for name, entry in manifest["files"].items():
    for part in entry["parts"]:
      path = os.path.join(shipped.ASSETS, part)
      total += os.path.getsize(path)
      assert os.path.getsize(path) <= shipped.PART_BYTES + 2**16
      meta = checkpoints.read_metadata(path)
      assert meta["config"]["param_dtype"] == "bfloat16"
      assert all(v.dtype == jnp.bfloat16 for v in checkpoints.load_arrays(path).values())
    assert entry["steps"] > 0 and entry["final_metrics"]["loss"] > 0
  total += sum(os.path.getsize(os.path.join(shipped.ASSETS, f))
               for f in ("tokenizer.json", "heldout_prompts.json", "manifest.json"))
  assert total <= 60 * 10**6, f"shipped assets are {total / 1e6:.1f} MB"
  assert manifest["corpus"]["python_version"] and manifest["corpus"]["split_rule"]
  # The models fit together: the drafts read the target's feature layers and its vocabulary.
  assert pair.draft.config.target_layer_ids == pair.target.config.feature_layers
  assert pair.draft.head.vocab_size == pair.target.config.vocab_size == pair.tokenizer.get_vocab_size()
  assert pair.draft.config.mask_token_id == byte_bpe.MASK_ID
  assert float(jnp.abs(pair.ablation.head.w2[...]).max()) == 0.0  # no sequential correction
  n_target = sum(x.size for x in jax.tree.leaves(nnx.state(pair.target, nnx.Param)))
  assert 10e6 <= n_target <= 30e6


def test_loading_rejects_a_broken_asset_directory(tmp_path):
  for name in os.listdir(shipped.ASSETS):
    if name != "draft.part0.safetensors":
      os.symlink(os.path.join(shipped.ASSETS, name), tmp_path / name)
  with pytest.raises(ValueError, match="draft part 'draft.part0.safetensors' is missing"):
    shipped.load_shipped(str(tmp_path))
  with pytest.raises(FileNotFoundError):
    shipped.load_shipped(str(tmp_path / "nowhere"))


def test_tokenizer_round_trips_held_out_text(pair):
  # Held-out files of the running interpreter (which may differ from the training interpreter).
  _, held = data.split_files(data.stdlib_files())
  texts = data.read_texts(held[:5]) + pair.prompts[:5]
  assert texts
  for text in texts:
    assert pair.decode(pair.encode(text)) == text
  assert pair.tokenizer.token_to_id(byte_bpe.END_OF_TEXT) == byte_bpe.END_OF_TEXT_ID


def test_split_is_deterministic_and_disjoint():
  files = data.stdlib_files()
  train, held = data.split_files(files)
  assert set(train).isdisjoint(held) and len(train) + len(held) == len(files)
  assert held == data.split_files(list(reversed(files)))[1][::-1]
  assert 0.02 < len(held) / len(files) < 0.09


@pytest.mark.slow
def test_demo_runs_end_to_end(capsys):
  assert cli.main(["demo", "--prompts", "2", "--max-new-tokens", "12"]) == 0
  out = capsys.readouterr().out
  assert "τ (tokens per round" in out and "greedy speculative and plain outputs share" in out


@pytest.mark.slow
def test_eval_runs_end_to_end(tmp_path, capsys, monkeypatch):
  # One temperature (one decode program per drafter; the notebook and gpu_check run both), the
  # two prompts through one slot: each decoder (plain, DSpark, ablation) is called once, queued.
  from dspark_jax.apps import evaluation
  calls = []
  generate = evaluation.decoding.generate
  def spy(target, draft, prompts, *args, **kwargs):
    calls.append((draft is None, len(prompts)))
    return generate(target, draft, prompts, *args, **kwargs)
  monkeypatch.setattr(evaluation.decoding, "generate", spy)
  assert cli.main(["eval", "--prompts", "2", "--max-new-tokens", "12", "--temperatures", "1",
                   "--concurrency", "1", "--out", str(tmp_path)]) == 0
  assert sorted(calls) == [(False, 2)] * 2 + [(True, 2)]
  result = json.load(open(tmp_path / "acceptance.json"))
  assert result["concurrency"] == 1 and result["prompts"] == 2
  assert {(r["drafter"], r["temperature"]) for r in result["rows"]} == {
      ("dspark", 1.0), ("parallel (ablation)", 1.0)}
  assert all(r["tau"] >= 1.0 for r in result["rows"])
  assert (tmp_path / "acceptance.png").stat().st_size > 1000
  assert "| dspark | 1 |" in capsys.readouterr().out


TINY = tm.TargetConfig(vocab_size=64, num_layers=2, feature_layers=(-1, 1),
                       layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                               head_dim=8, intermediate_size=64))


@pytest.mark.slow  # 13-15 s on 2 cores
def test_training_decreases_the_loss_and_resumes(tmp_path):
  stream = np.tile(np.arange(64, dtype=np.uint16), 200)  # a learnable pattern
  batches = training.lm_batches(stream, 8, 32, seed=0)
  model = tm.TargetModel(TINY, rngs=nnx.Rngs(0))
  ckpt = str(tmp_path / "state.safetensors")
  trainer = training.Trainer(model, lambda m, _, b: training.lm_loss(m, b),
                             training.make_optimizer(1e-2, 40), checkpoint_path=ckpt,
                             checkpoint_every=20)
  initial = float(training.lm_loss(model, batches(999))[0])
  trainer.train(batches, 20, log_every=10)
  resumed = training.Trainer(tm.TargetModel(TINY, rngs=nnx.Rngs(5)),
                             lambda m, _, b: training.lm_loss(m, b),
                             training.make_optimizer(1e-2, 40), checkpoint_path=ckpt)
  assert resumed.step == 20
  model = resumed.train(batches, 40, log_every=10)
  final = float(training.lm_loss(model, batches(999))[0])
  assert final < 0.5 * initial, (initial, final)


def test_checkpoints_round_trip_and_are_strict(tmp_path):
  model = tm.TargetModel(TINY, rngs=nnx.Rngs(0))
  path = str(tmp_path / "m.safetensors")
  checkpoints.save_model(path, model, metadata={"note": "x"})
  loaded = checkpoints.load_target(path)
  for (name, a), b in zip(checkpoints.named_arrays(nnx.state(model, nnx.Param)).items(),
                          checkpoints.named_arrays(nnx.state(loaded, nnx.Param)).values()):
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert checkpoints.read_metadata(path)["note"] == "x"
  arrays = dict(checkpoints.load_arrays(path))
  arrays.pop("final_norm.scale")
  with pytest.raises(ValueError, match="missing tensor 'final_norm.scale'"):
    checkpoints.target_from_arrays(TINY, arrays)
