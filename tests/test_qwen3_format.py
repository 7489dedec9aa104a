"""Hugging Face Qwen3 checkpoints, live against transformers: logits, greedy decoding, saving, refusals.

Tiny random ``Qwen3ForCausalLM`` models (float32, fixed torch seeds, norms perturbed so a swapped norm
shows) are saved by transformers itself; `formats.qwen3.load_qwen3` must give the logits transformers
gives, `save_qwen3` must write what ``from_pretrained`` loads into the same model.

Tolerance: logits agree to 256 float32 ulps of the largest logit (|Δ| <= 256 · 2^-23 · max(1, max |L|),
about 3e-5 relative). Both sides compute in float32, summing at most 128 terms per dot product through
two layers, so rounding differs by a few ulps; a wrong mapping, norm or RoPE variant moves logits by
O(1), which each comparison also shows (the power checks).
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax.formats import qwen3, safetensors_io
from dspark_jax.models import layers
from dspark_jax.formats import checkpoints

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EPS32 = float(np.finfo(np.float32).eps)
ULPS = 256
V, E, I, L = 96, 32, 64, 2
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 24.0,
        "original_max_position_embeddings": 256}        # a ramp over dims 0..4: fractions too
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,  # dim 0 smoothed, 1.. divided
          "original_max_position_embeddings": 16, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LINEAR = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}


def tolerance(reference: np.ndarray) -> float:
  return ULPS * EPS32 * max(1.0, float(np.abs(reference).max()))


def _hf_model(seed: int, *, tie: bool, rope=None, max_positions=64):
  torch.manual_seed(seed)
  config = transformers.Qwen3Config(
      vocab_size=V, hidden_size=E, intermediate_size=I, num_hidden_layers=L, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie, max_position_embeddings=max_positions,
      initializer_range=0.2, **({"rope_parameters": dict(rope)} if rope else {}))
  model = transformers.Qwen3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight"):
        param.copy_(1 + 0.2 * torch.randn_like(param))
  return model


def _old_dialect(directory: str) -> None:
  """Rewrites a saved config.json the way transformers 4 wrote it (rope_theta + rope_scaling)."""
  path = os.path.join(directory, "config.json")
  hf = json.load(open(path))
  rope = hf.pop("rope_parameters")
  hf["rope_theta"] = rope.pop("rope_theta")
  hf["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
  hf["torch_dtype"] = hf.pop("dtype")
  hf.pop("layer_types")
  json.dump(hf, open(path, "w"), indent=2)


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory):
  """name -> a directory written by transformers' save_pretrained."""
  root = tmp_path_factory.mktemp("hf")
  specs = {
      "tied": dict(seed=0, tie=True),
      "untied_sharded": dict(seed=1, tie=False, shard="20KB"),
      "old_dialect_linear": dict(seed=2, tie=True, rope=LINEAR, old=True),
      "yarn": dict(seed=3, tie=False, rope=YARN, max_positions=1024),
      "llama3": dict(seed=4, tie=True, rope=LLAMA3, max_positions=128),
  }
  out = {}
  for name, spec in specs.items():
    model = _hf_model(spec["seed"], tie=spec["tie"], rope=spec.get("rope"),
                      max_positions=spec.get("max_positions", 64))
    directory = str(root / name)
    model.save_pretrained(directory, **({"max_shard_size": spec["shard"]} if "shard" in spec else {}))
    if spec.get("old"):
      _old_dialect(directory)
    out[name] = directory
  return out


def _hf_logits(directory: str, tokens: np.ndarray, **kw):
  model = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.as_tensor(tokens), **kw)


TOKENS = np.random.default_rng(0).integers(0, V, size=(2, 40))


@pytest.mark.parametrize("name", ["tied", "untied_sharded", "old_dialect_linear", "yarn", "llama3"])
def test_logits_equal_transformers(checkpoints_dir, name):
  directory = checkpoints_dir[name]
  target = qwen3.load_qwen3(directory)
  reference = _hf_logits(directory, TOKENS).logits.numpy()
  ours = np.asarray(dj.logits(target, TOKENS))
  assert ours.shape == (2, 40, V) and ours.dtype == np.float32
  tol = tolerance(reference)
  assert np.abs(ours - reference).max() <= tol
  assert target.config.tie_embeddings == (name in ("tied", "old_dialect_linear", "llama3"))
  if name == "untied_sharded":
    assert os.path.isfile(os.path.join(directory, safetensors_io.INDEX))
  rope_type = target.config.layer.rope_scaling.rope_type
  assert rope_type == {"old_dialect_linear": "linear", "yarn": "yarn", "llama3": "llama3"}.get(
      name, "default")
  if rope_type != "default":  # power: the same weights with plain RoPE are far off
    plain = _with_rope(target, layers.RopeScaling())
    assert np.abs(np.asarray(dj.logits(plain, TOKENS)) - reference).max() > 1000 * tol


def _with_rope(target, scaling):
  """The same weights under another RoPE variant."""
  config = target.config
  config = dataclasses.replace(config, layer=dataclasses.replace(config.layer, rope_scaling=scaling))
  return checkpoints.target_from_arrays(config, checkpoints.named_arrays(nnx.state(target, nnx.Param)))


def test_old_and_new_dialect_read_alike(checkpoints_dir):
  new = qwen3.config_to_hf(qwen3.load_qwen3(checkpoints_dir["old_dialect_linear"]).config)
  assert new["rope_parameters"] == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
  old = qwen3.read_config(checkpoints_dir["old_dialect_linear"])
  assert "rope_parameters" not in old and old["rope_scaling"]["type"] == "linear"
  assert qwen3.config_from_hf(old) == qwen3.config_from_hf(new)


def test_features_are_hf_hidden_states(checkpoints_dir):
  directory = checkpoints_dir["untied_sharded"]
  target = qwen3.load_qwen3(directory, feature_layers=(-1, 0))
  out = _hf_logits(directory, TOKENS, output_hidden_states=True)
  _, features = nnx.jit(lambda t, x: t.forward(x))(target, jnp.asarray(TOKENS, jnp.int32))
  reference = np.concatenate([out.hidden_states[0].numpy(), out.hidden_states[1].numpy()], -1)
  assert features.shape == (2, 40, 2 * E)
  assert np.abs(np.asarray(features) - reference).max() <= tolerance(reference)


def test_logits_jit_and_token_checks(checkpoints_dir):
  target = qwen3.load_qwen3(checkpoints_dir["tied"])
  eager = np.asarray(dj.logits(target, TOKENS[:, :8].tolist()))
  jitted = np.asarray(jax.jit(lambda t: dj.logits(target, t))(jnp.asarray(TOKENS[:, :8])))
  via_nnx = np.asarray(nnx.jit(dj.logits)(target, jnp.asarray(TOKENS[:, :8])))
  assert np.abs(jitted - eager).max() <= tolerance(eager)
  assert np.abs(via_nnx - eager).max() <= tolerance(eager)
  # A causal forward: the logits after a prefix do not depend on what follows it.
  assert np.abs(np.asarray(dj.logits(target, TOKENS[:, :5])) - eager[:, :5]).max() <= tolerance(eager)
  bad = TOKENS[:, :4].copy()
  bad[1, 2] = V
  with pytest.raises(ValueError, match=r"tokens: element \[1, 2\] is 96; token ids must be in"):
    dj.logits(target, bad)
  with pytest.raises(ValueError, match=r"tokens: expected a \[B, T\] array, got shape \(4,\)"):
    dj.logits(target, TOKENS[0, :4])
  with pytest.raises(ValueError, match="tokens: expected integers, got dtype float32"):
    dj.logits(target, TOKENS[:, :4].astype(np.float32))
  with pytest.raises(ValueError, match="tokens: expected at least one token per row"):
    dj.logits(target, np.zeros((2, 0), np.int32))
  with pytest.raises(ValueError, match="target: expected a TargetModel"):
    dj.logits(None, TOKENS)


@pytest.mark.parametrize("name", ["tied", "yarn"])
def test_greedy_generate_equals_transformers(checkpoints_dir, name):
  directory = checkpoints_dir[name]
  target = qwen3.load_qwen3(directory)
  model = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  prompts = [[5, 17, 3, 9, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
  steps = 16
  out = dj.generate(target, None, prompts, dj.SamplingParams(temperature=[0.0, 0.0]),
                    jax.random.key(0), spec=False, max_new_tokens=steps)
  for row, prompt in enumerate(prompts):
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=steps, output_logits=True, return_dict_in_generate=True,
                        pad_token_id=0)
    logits = torch.cat(hf.logits).numpy()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    # Each step's choice is clear beyond rounding, so the greedy paths must agree token for token.
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * tolerance(logits)
    assert out.tokens[row].tolist() == hf.sequences[0, len(prompt):].tolist()
    assert out.lengths[row] == steps


@pytest.mark.parametrize("name,shard", [("untied_sharded", 16_000), ("yarn", None)])
def test_saved_checkpoint_loads_in_transformers(checkpoints_dir, tmp_path, name, shard):
  target = qwen3.load_qwen3(checkpoints_dir[name])
  files = qwen3.save_qwen3(target, tmp_path, max_shard_bytes=shard, extra_config={"eos_token_id": 7})
  if shard:
    assert len([f for f in files if f.startswith("model-")]) > 1
    assert all(os.path.getsize(tmp_path / f) <= shard + 2**12 for f in files if f.startswith("model-"))
  hf_config = transformers.Qwen3Config.from_pretrained(tmp_path)
  assert hf_config.eos_token_id == 7 and hf_config.tie_word_embeddings == target.config.tie_embeddings
  ours = np.asarray(dj.logits(target, TOKENS))
  reference = _hf_logits(str(tmp_path), TOKENS).logits.numpy()
  assert np.abs(ours - reference).max() <= tolerance(reference)
  with pytest.raises(ValueError, match="extra_config: 'vocab_size' is written from the model"):
    qwen3.save_qwen3(target, tmp_path / "x", extra_config={"vocab_size": 3})


def _params(target):
  return {k: np.asarray(v) for k, v in checkpoints.named_arrays(nnx.state(target, nnx.Param)).items()}


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_load_save_load_round_trip(checkpoints_dir, tmp_path, dtype):
  first = qwen3.load_qwen3(checkpoints_dir["llama3"], dtype=dtype, feature_layers=(0, 1))
  qwen3.save_qwen3(first, tmp_path)
  hf = qwen3.read_config(tmp_path)
  assert hf["dtype"] == hf["torch_dtype"] == jnp.dtype(dtype or jnp.float32).name
  assert {v for v in safetensors_io.tensor_dtypes(str(tmp_path)).values()} == {
      "BF16" if dtype else "F32"}
  second = qwen3.load_qwen3(tmp_path, feature_layers=(0, 1))
  assert second.config == first.config
  a, b = _params(first), _params(second)
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  assert all(v.dtype == jnp.dtype(dtype or jnp.float32) for v in b.values())


def test_dtype_defaults_to_the_tensors_when_the_config_has_none(checkpoints_dir, tmp_path):
  qwen3.save_qwen3(qwen3.load_qwen3(checkpoints_dir["tied"], dtype=jnp.bfloat16), tmp_path)
  hf = qwen3.read_config(tmp_path)
  del hf["dtype"], hf["torch_dtype"]
  json.dump(hf, open(tmp_path / "config.json", "w"))
  assert qwen3.load_qwen3(tmp_path).config.dtype == jnp.bfloat16
  target = qwen3.load_qwen3(tmp_path, dtype=jnp.float32)
  assert target.config.dtype == target.config.param_dtype == jnp.float32


def _hf_dict(**changes):
  hf = qwen3.config_to_hf(qwen3.config_from_hf(
      {"model_type": "qwen3", "vocab_size": V, "hidden_size": E, "intermediate_size": I,
       "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))
  for key, value in changes.items():
    if value is KeyError:
      hf.pop(key)
    else:
      hf[key] = value
  return hf


@pytest.mark.parametrize("changes,kwargs,message", [
    (dict(use_sliding_window=True), {}, "use_sliding_window true is not supported"),
    (dict(layer_types=["full_attention", "sliding_attention"]), {}, "layer_types holds 'sliding_"),
    (dict(attention_bias=True), {}, "attention_bias true is not supported"),
    (dict(hidden_act="gelu"), {}, "hidden_act 'gelu' is not supported"),
    (dict(model_type="llama"), {}, "model_type 'llama' is not 'qwen3'"),
    (dict(architectures=["Qwen3DSparkModel"]), {}, "architectures .* is not"),
    (dict(vocab_size=KeyError), {}, "missing required field 'vocab_size'"),
    (dict(num_hidden_layers=0), {}, "num_hidden_layers must be an integer >= 1"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), {},
     "rope_parameters.rope_type 'dynamic' is not implemented"),
    (dict(rope_parameters=KeyError, rope_scaling={"type": "longrope", "factor": 2.0}), {},
     "rope_scaling.rope_type 'longrope' is not implemented"),
    (dict(rope_parameters={"rope_type": "linear"}), {}, "rope_parameters.factor is required"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), {},
     "partial_rotary_factor 0.5 is not supported"),
    (dict(torch_dtype="int8", dtype=KeyError), {}, "torch_dtype: 'int8' is not supported"),
    ({}, dict(feature_layers=(0, 2)), "feature_layers: 2 is not -1"),
])
def test_config_refusals(changes, kwargs, message):
  with pytest.raises(ValueError, match=message):
    qwen3.config_from_hf(_hf_dict(**changes), **kwargs)


def test_rope_config_details_follow_transformers():
  theta, yarn = qwen3.rope_from_hf(_hf_dict(max_position_embeddings=64, rope_parameters={
      "rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "mscale": 2.0,
      "mscale_all_dim": 1.0}))
  # factor from the positions, original from max_position_embeddings, attention factor from mscale
  assert theta == 10000.0 and yarn.factor == 1.0 and yarn.original_max_position_embeddings == 64
  _, yarn = qwen3.rope_from_hf(_hf_dict(original_max_position_embeddings=8,
                                        rope_parameters=dict(YARN)))
  assert yarn.original_max_position_embeddings == 8     # the top-level field wins, as in transformers
  assert yarn.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
  theta, plain = qwen3.rope_from_hf(_hf_dict(rope_parameters=KeyError))
  assert theta == 10000.0 and plain == layers.RopeScaling()
  # A TargetConfig with RoPE scaling goes through the checkpoint JSON form unchanged.
  config = qwen3.config_from_hf(_hf_dict(rope_parameters=dict(LLAMA3)))
  assert checkpoints.target_config_from_dict(checkpoints.config_to_dict(config)) == config
  with pytest.raises(ValueError, match="rope_scaling: unknown field 'kind'"):
    layers.LayerShape(32, 4, 2, 16, 64, rope_scaling={"kind": "yarn"})


def _rewrite(directory, dst, change):
  tensors = safetensors_io.read_tensors(directory)
  change(tensors)
  safetensors_io.write_tensors(str(dst), tensors)
  hf = qwen3.read_config(directory)
  json.dump(hf, open(dst / "config.json", "w"))
  return dst


@pytest.mark.parametrize("name,change,message", [
    ("untied_sharded", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
     "missing tensor 'model.layers.1.self_attn.k_norm.weight'"),
    ("untied_sharded", lambda t: t.pop("lm_head.weight"), "missing tensor 'lm_head.weight'"),
    ("tied", lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((I, E), np.float32)}),
     "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    ("tied", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight":
                                 t["model.layers.0.self_attn.o_proj.weight"].T.copy()}),
     r"tensor 'model.layers.0.self_attn.o_proj.weight' has shape \(64, 32\), expected \(32, 64\)"),
    ("tied", lambda t: t.update({"lm_head.weight": np.zeros((V, E), np.float32)}),
     "unexpected tensor 'lm_head.weight' \\(tie_word_embeddings is true"),
])
def test_tensor_refusals(checkpoints_dir, tmp_path, name, change, message):
  with pytest.raises(ValueError, match=message):
    qwen3.load_qwen3(_rewrite(checkpoints_dir[name], tmp_path, change))


def test_a_tied_checkpoint_may_repeat_the_embedding_as_lm_head(checkpoints_dir, tmp_path):
  directory = _rewrite(checkpoints_dir["tied"], tmp_path, lambda t: t.update(
      {"lm_head.weight": t["model.embed_tokens.weight"]}))
  assert qwen3.load_qwen3(directory).config.tie_embeddings


def test_file_errors(checkpoints_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json: no such file"):
    qwen3.load_qwen3(tmp_path)
  json.dump(qwen3.read_config(checkpoints_dir["tied"]), open(tmp_path / "config.json", "w"))
  with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor"):
    qwen3.load_qwen3(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
  with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
    qwen3.load_qwen3(tmp_path)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="config.json: not a JSON config"):
    qwen3.load_qwen3(tmp_path)
  sharded = checkpoints_dir["untied_sharded"]
  index = json.load(open(os.path.join(sharded, safetensors_io.INDEX)))
  moved = tmp_path / "moved"
  moved.mkdir()
  for file in os.listdir(sharded):
    os.symlink(os.path.join(sharded, file), moved / file)
  os.remove(moved / safetensors_io.INDEX)
  name = "model.norm.weight"
  wrong = next(f for f in sorted(set(index["weight_map"].values()))
               if f != index["weight_map"][name])
  index["weight_map"][name] = wrong
  json.dump(index, open(moved / safetensors_io.INDEX, "w"))
  with pytest.raises(ValueError, match=f"{wrong}: the index places tensor '{name}' in this file"):
    qwen3.load_qwen3(moved)


def test_safetensors_shards_and_bfloat16(tmp_path):
  rng = np.random.default_rng(1)
  tensors = {f"t{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(5)}
  tensors["big"] = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
  files = safetensors_io.write_tensors(str(tmp_path), tensors, max_shard_bytes=1100)
  index = json.load(open(tmp_path / safetensors_io.INDEX))
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
  assert set(index["weight_map"]) == set(tensors) and len(files) == 5     # 4 shards + the index
  back = safetensors_io.read_tensors(str(tmp_path))
  assert back["big"].dtype == jnp.bfloat16
  assert all(np.array_equal(back[k], tensors[k]) for k in tensors)
  safetensors_io.write_tensors(str(tmp_path), {"a": tensors["t0"]})    # replaces the shards
  assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
  with pytest.raises(ValueError, match="max_shard_bytes: expected None or an integer >= 1"):
    safetensors_io.write_tensors(str(tmp_path), tensors, max_shard_bytes=0)
