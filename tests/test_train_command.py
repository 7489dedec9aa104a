"""``dspark-jax train`` and ``dspark-jax regenerate`` on a tiny Qwen3 target whose greedy law is a
known bigram chain (newline -> 1 -> 2 -> 3 -> 4 -> 1 ...): the loss falls, the trained drafter
beats the untrained one in held-out τ, the saved drafter loads and decodes losslessly; the
`Trainer` resumes bit for bit and data parallelism over 4 CPU devices equals one device; the
conversation data is rendered with the target's template, masked to the responses and packed; and
every bad input is refused by name."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.apps import cli
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax.text import load_tokenizer
from dspark_jax.train import conversations as cv
from dspark_jax.train import trainer as training
from tests.test_text import write_tokenizer_dir

# A Qwen3-style template (written for these tests): an empty think block after the generation
# prompt and in the last assistant turn when thinking is off.
TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if loop.last and enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{{ m.content }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif -%}"""
TARGET = tm.TargetConfig(vocab_size=320, num_layers=2, tie_embeddings=False,
                         layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                 head_dim=8, intermediate_size=64))
WORDS = "the quick brown fox jumps over lazy dog hello world".split()


def chain_target(tokenizer) -> tm.TargetModel:
  """A target whose layers add nothing (attention and MLP outputs zero) and whose LM head sends
  newline -> "1" -> "2" -> "3" -> "4" -> "1" and every other token to itself, sharply."""
  model = tm.TargetModel(TARGET, rngs=nnx.Rngs(0))
  for layer in model.layers:
    layer.attention.o_proj.kernel[...] = jnp.zeros_like(layer.attention.o_proj.kernel[...])
    layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
  ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "1", "2", "3", "4")]
  assert all(len(i) == 1 for i in ids)
  chain = [i[0] for i in ids]
  successor = np.arange(TARGET.vocab_size)
  for a, b in zip(chain, chain[1:] + [chain[1]]):
    successor[a] = b
  embed = np.asarray(model.embed.embedding[...])
  embed = embed / np.linalg.norm(embed, axis=1, keepdims=True)
  head = np.zeros((TARGET.hidden_size, TARGET.vocab_size), np.float32)
  for token, nxt in enumerate(successor):
    head[:, nxt] += 60.0 * embed[token]
  model.embed.embedding[...] = jnp.asarray(embed)
  model.lm_head.kernel[...] = jnp.asarray(head)
  return model


def write_conversations(path, count, *, answer="1234" * 5, seed=0):
  rng = np.random.default_rng(seed)
  with open(path, "w") as f:
    for i in range(count):
      question = " ".join(rng.choice(WORDS, 4))
      record = ({"turns": [question, answer]} if i % 2 else
                {"messages": [{"role": "user", "content": question},
                              {"role": "assistant", "content": answer}]})
      f.write(json.dumps(record) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("chain")
  directory = str(root / "target")
  write_tokenizer_dir(directory, template=TEMPLATE, config_eos=None)
  tokenizer = load_tokenizer(directory)
  dspark_jax.save_pretrained(chain_target(tokenizer), directory)
  data = write_conversations(root / "data.jsonl", 28)
  return root, directory, data


@pytest.fixture(scope="module")
def trained(chain_dir):
  """`dspark-jax train` run once: 40 steps, held-out τ at steps 0 and 40."""
  root, target, data = chain_dir
  out = str(root / "drafter")
  assert cli.main(["train", "--target", target, "--data", data, "--out", out, "--layers", "1",
                   "--gamma", "3", "--rank", "8", "--steps", "40", "--batch-size", "4",
                   "--seq-len", "64", "--anchors", "8", "--lr", "1e-2", "--heldout", "4",
                   "--eval-every", "40", "--eval-tokens", "12", "--log-every", "5",
                   "--checkpoint-every", "20"]) == 0
  with open(os.path.join(out, "training", "history.json")) as f:
    return out, json.load(f)


# ---- the command ---------------------------------------------------------------------------------


@pytest.mark.slow  # the fixture trains 40 steps and measures τ twice: ~20 s on 2 cores
def test_trained_drafter_loss_falls_and_beats_untrained_tau(trained):
  out, log = trained
  losses = [h["loss"] for h in log["history"]]
  assert log["step"] == 40 and len(losses) == 8
  assert losses[-1] < 0.5 * losses[0]
  assert {"ce", "tv", "bce", "lr", "tokens_per_s"} <= set(log["history"][-1])
  taus = {e["step"]: e["tau"] for e in log["evaluations"]}
  assert sorted(taus) == [0, 40]
  assert taus[0] < 1.5 and taus[40] > taus[0] + 1.0      # γ = 3: τ is at most 4
  for name in ("loss.png", "train_state.safetensors", "options.json"):
    assert os.path.exists(os.path.join(out, "training", name))


@pytest.mark.slow  # shares the training fixture (the cost lands here when run alone)
def test_saved_drafter_loads_and_decodes_losslessly(chain_dir, trained):
  _, target_dir, _ = chain_dir
  out, _ = trained
  target, draft = dspark_jax.load_pretrained(target_dir, out)
  assert draft.config.gamma == 3 and draft.config.target_layer_ids == (0,)
  tokenizer = load_tokenizer(target_dir)
  prompt = [tokenizer.encode_chat([{"role": "user", "content": "hello world"}])]
  params = dspark_jax.SamplingParams(temperature=np.zeros(1))
  spec = dspark_jax.generate(target, draft, prompt, params, jax.random.key(0), max_new_tokens=9)
  assert tokenizer.decode(spec.tokens[0]) == "123412341"   # the target's own greedy chain
  assert spec.tau > 2.0


def test_regenerate_writes_the_targets_answers_and_resumes(chain_dir, tmp_path, capsys):
  _, target_dir, _ = chain_dir
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in ("hello", "the fox")))
  out = str(tmp_path / "answers.jsonl")
  argv = ["regenerate", "--target", target_dir, "--prompts", str(prompts), "--out", out,
          "--max-new-tokens", "6", "--concurrency", "2"]
  assert cli.main(argv) == 0
  rows = [json.loads(line) for line in open(out)]
  assert sorted(r["line"] for r in rows) == [1, 2]
  for row in rows:
    assert row["messages"][-1] == {"role": "assistant", "content": "123412"}
    assert row["messages"][0]["role"] == "user"
  with open(out, "w") as f:  # as if interrupted after the first answer
    f.write(json.dumps(rows[0]) + "\n")
  assert cli.main(argv) == 0
  assert "1 answers appended" in capsys.readouterr().out
  assert sorted(json.loads(line)["line"] for line in open(out)) == [1, 2]
  # The answers are conversations the trainer reads.
  assert len(cv.read_conversations(out)) == 2


# ---- the trainer: resume and data parallelism -------------------------------------------------------


SMALL = tm.TargetConfig(vocab_size=64, num_layers=2, feature_layers=(0,),
                        layer=layers.LayerShape(hidden_size=16, num_heads=2, num_kv_heads=1,
                                                head_dim=8, intermediate_size=32))


def _draft_loss(model, target, batch):
  return training.dspark_loss(model, target, *batch)


_OPTIMIZER = training.make_optimizer(1e-2, 4)   # one object: the trainers share their program


def _small_trainer(path=None, dtype=jnp.float32, **kwargs):
  target = tm.TargetModel(SMALL, rngs=nnx.Rngs(0))
  config = dm.DraftConfig(gamma=2, num_layers=1, target_layer_ids=(0,), mask_token_id=63,
                          rank=4, dtype=dtype, param_dtype=dtype)
  draft = dm.DSparkDraft(config, SMALL, rngs=nnx.Rngs(1))
  return training.Trainer(draft, _draft_loss, _OPTIMIZER, frozen=target, checkpoint_path=path,
                          master_dtype=jnp.float32, **kwargs)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resumed_training_equals_uninterrupted_bit_for_bit(tmp_path):
  sequences = np.random.default_rng(0).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=3)
  whole = _small_trainer()
  whole.train(batches, 4, progress=False)
  path = str(tmp_path / "state.safetensors")
  first = _small_trainer(path, max_seconds=0.0)   # interrupted after its first step
  first.train(batches, 4, progress=False)
  assert first.step == 1
  resumed = _small_trainer(path)
  assert resumed.step == 1
  resumed.train(batches, 4, progress=False)
  for a, b in zip(_leaves((whole.params, whole.opt_state)),
                  _leaves((resumed.params, resumed.opt_state))):
    np.testing.assert_array_equal(a, b)


def test_the_schedule_is_optax_warmup_cosine_and_the_optimizer_optax_adamw():
  peak = 1e-3
  steps = jnp.arange(0, 220)
  for total, warmup in ((50, 10), (200, 8)):   # float32 cosines
    reference = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end_value=0.1 * peak)
    ours = training.make_schedule(peak, total, warmup_steps=warmup)
    np.testing.assert_allclose(np.asarray(ours(steps)), np.asarray(reference(steps)),
                               rtol=1e-5, atol=1e-9)
  # make_optimizer is optax's AdamW on that schedule after clipping (the horizon in the state).
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)}
  ours = training.make_optimizer(peak, 30, weight_decay=0.01, b2=0.95)
  reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      training.make_schedule(peak, 30), b1=0.9, b2=0.95, weight_decay=0.01))
  states = [ours.init(params), reference.init(params)]
  for step in range(12):
    grads = {"w": jnp.asarray(rng.standard_normal((3, 4)) * (step + 1), jnp.float32)}
    (a, states[0]), (b, states[1]) = (ours.update(grads, states[0], params),
                                      reference.update(grads, states[1], params))
    np.testing.assert_allclose(np.asarray(a["w"]), np.asarray(b["w"]), rtol=1e-5, atol=1e-12)


def test_set_horizon_moves_the_cosine_and_a_fractional_warmup():
  params = {"w": jnp.ones((3,), jnp.float32)}
  grads = {"w": jnp.ones((3,), jnp.float32)}
  peak = 1e-3
  for warmup_steps, moved_warmup in ((10, 10), (None, 8)):       # a share: 4 % of 200 steps
    optimizer = training.make_optimizer(peak, 1000, warmup_steps=warmup_steps, weight_decay=0.0)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for _ in range(15):
      _, state = update(grads, state, params)
    assert training.horizon(state) == 1000
    moved = training.set_horizon(state, 200)
    (schedule,) = [s for s in jax.tree.leaves(moved, is_leaf=lambda s: isinstance(
        s, training.ScheduleState)) if isinstance(s, training.ScheduleState)]
    assert (int(schedule.count), int(schedule.total), int(schedule.warmup)) == (15, 200,
                                                                                moved_warmup)
    assert training.horizon(moved) == 200
    # The update is Adam's direction (±1 at bias-corrected equal gradients) times the rate.
    updates, _ = update(grads, moved, params)
    expected = float(training.make_schedule(peak, 200, warmup_steps=moved_warmup)(15))
    assert training.learning_rate_at(moved, 15) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(np.asarray(updates["w"]), -expected, rtol=1e-4)
    long_updates, _ = update(grads, state, params)                         # the old horizon
    first_warmup = 10 if warmup_steps else 40
    np.testing.assert_allclose(np.asarray(long_updates["w"]), -float(
        training.make_schedule(peak, 1000, warmup_steps=first_warmup)(15)), rtol=1e-4)
  assert training.horizon({"no": "schedule"}) is None
  assert training.learning_rate_at({"no": "schedule"}, 3) is None


class _Clock:
  """A stand-in for time.perf_counter: every reading is `tick` seconds after the last."""

  def __init__(self, tick: float):
    self.now, self.tick = 0.0, tick

  def __call__(self) -> float:
    self.now += self.tick
    return self.now


_FITTED = training.make_optimizer(1e-2, 40, warmup_steps=2)


def test_a_fitted_horizon_is_what_the_budget_allows_and_resumes_to_it(tmp_path, monkeypatch):
  # A clock that advances 0.1 s a reading (not the host's): the verdict does not depend on it.
  monkeypatch.setattr(training.time, "perf_counter", _Clock(0.1))
  sequences = np.random.default_rng(0).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=3)
  path = str(tmp_path / "state.safetensors")

  def trainer(**kwargs):
    target = tm.TargetModel(SMALL, rngs=nnx.Rngs(0))
    config = dm.DraftConfig(gamma=2, num_layers=1, target_layer_ids=(0,), mask_token_id=63,
                            rank=4)
    return training.Trainer(dm.DSparkDraft(config, SMALL, rngs=nnx.Rngs(1)), _draft_loss,
                            _FITTED, frozen=target, checkpoint_path=path, fit_horizon=True,
                            probe_steps=3, **kwargs)

  run = trainer(max_seconds=3.0)
  run.train(batches, 40, log_every=1, progress=False)
  fitted = run.fitted
  assert fitted["requested_steps"] == 40 and 4 < fitted["horizon"] < 40
  assert fitted["horizon"] == training.horizon(run.opt_state)
  assert run.history[-1]["lr"] == pytest.approx(
      float(training.make_schedule(1e-2, fitted["horizon"], warmup_steps=2)(run.step - 1)))
  assert fitted["steps_per_second"] > 0 and run.step <= fitted["horizon"]
  # A rerun resumes to the saved horizon (no second fit), where the rate has reached its end.
  resumed = trainer(max_seconds=1e6)
  resumed.train(batches, 40, log_every=1, progress=False)
  assert resumed.fitted is None and resumed.step == fitted["horizon"]
  assert resumed.history[-1]["lr"] == pytest.approx(
      float(training.make_schedule(1e-2, fitted["horizon"], warmup_steps=2)(resumed.step - 1)))
  assert training.learning_rate_at(resumed.opt_state, resumed.step) == pytest.approx(1e-3)


def test_without_a_budget_or_when_asked_for_few_steps_nothing_is_fitted():
  sequences = np.random.default_rng(0).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=3)
  unbudgeted = _small_trainer(fit_horizon=True)
  unbudgeted.train(batches, 3, progress=False)
  assert unbudgeted.fitted is None and unbudgeted.step == 3
  assert training.horizon(unbudgeted.opt_state) == 4         # _OPTIMIZER's
  with pytest.raises(ValueError, match="^probe_steps:"):
    _small_trainer(probe_steps=0)


def test_master_parameters_and_optimizer_state_are_float32_over_bfloat16_weights():
  trainer = _small_trainer(dtype=jnp.bfloat16)
  assert trainer.model.fc.kernel[...].dtype == jnp.bfloat16
  assert {x.dtype for x in _leaves((trainer.params, trainer.opt_state))
          if jnp.issubdtype(x.dtype, jnp.floating)} == {np.dtype(np.float32)}
  assert trainer.model_params()["fc"]["kernel"][...].dtype == jnp.bfloat16


def test_data_parallel_over_four_devices_equals_one_device():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 CPU devices)")
  sequences = np.random.default_rng(1).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=4)
  one = _small_trainer()
  one.train(batches, 2, progress=False)
  four = _small_trainer(mesh=placement.make_mesh(1, 4), accumulate=2)
  four.train(batches, 2, progress=False)
  assert len(four.params["fc"]["kernel"][...].sharding.device_set) == 4
  np.testing.assert_allclose([h["loss"] for h in one.history],
                             [h["loss"] for h in four.history], rtol=1e-6)
  # Adam normalises each update, so a gradient's rounding difference (another summation order)
  # moves a parameter by up to lr (1e-2) times its relative size: far below one step.
  for a, b in zip(_leaves(one.params), _leaves(four.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_data_parallel_step_is_traced_with_the_batch_sharding_for_the_kernels():
  # Pallas kernels are not partitioned by jit: the step of a trainer with a mesh is traced inside
  # `attention.batch_sharded`, which runs them per shard (tests/test_shared_attention.py).
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 CPU devices)")
  from dspark_jax.kernels import attention
  seen = []

  def loss(model, target, batch):
    seen.append(attention._BATCH_SHARDING.get())
    return training.dspark_loss(model, target, *batch)
  sequences = np.random.default_rng(1).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=4)
  mesh = placement.make_mesh(1, 4)
  target = tm.TargetModel(SMALL, rngs=nnx.Rngs(0))
  config = dm.DraftConfig(gamma=2, num_layers=1, target_layer_ids=(0,), mask_token_id=63, rank=4)
  trainer = training.Trainer(dm.DSparkDraft(config, SMALL, rngs=nnx.Rngs(1)), loss, _OPTIMIZER,
                             frozen=target, mesh=mesh)
  trainer.train(batches, 1, progress=False)
  assert seen and all(s == (mesh, "dp") for s in seen)
  seen.clear()
  single = training.Trainer(dm.DSparkDraft(config, SMALL, rngs=nnx.Rngs(1)), loss, _OPTIMIZER,
                            frozen=target)
  single.train(batches, 1, progress=False)
  assert seen and all(s is None for s in seen)


def test_a_target_split_over_tp_trains_as_on_one_device():
  # The frozen target laid out by `dspark_jax.shard` over a (dp 2, tp 2) mesh of 4 CPU devices
  # (weights, heads and vocabulary split over tp), the batch over dp: the losses and parameters
  # of 2 steps equal one device's within rounding, and the target keeps its split layout.
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 CPU devices)")
  config = tm.TargetConfig(vocab_size=64, num_layers=2, feature_layers=(0,),
                           layer=layers.LayerShape(hidden_size=16, num_heads=2, num_kv_heads=2,
                                                   head_dim=8, intermediate_size=32))
  sequences = np.random.default_rng(2).integers(0, 60, (16, 24))
  batches = training.draft_batches(sequences, 8, 4, 2, first_anchor=1, seed=5)

  def trainer(mesh=None):
    target = tm.TargetModel(config, rngs=nnx.Rngs(0))
    if mesh is not None:
      target, _ = placement.shard(target, None, mesh, tp="tp", dp="dp")
    draft = dm.DSparkDraft(dm.DraftConfig(gamma=2, num_layers=1, target_layer_ids=(0,),
                                          mask_token_id=63, rank=4), config, rngs=nnx.Rngs(1))
    return training.Trainer(draft, _draft_loss, _OPTIMIZER, frozen=target,
                            master_dtype=jnp.float32, mesh=mesh)

  one = trainer()
  one.train(batches, 2, progress=False)
  split = trainer(placement.make_mesh(2, 2))
  split.train(batches, 2, progress=False)
  embedding = split.frozen_state["embed"]["embedding"][...]   # what the steps read
  assert not embedding.sharding.is_fully_replicated             # still split over tp
  np.testing.assert_allclose([h["loss"] for h in one.history],
                             [h["loss"] for h in split.history], rtol=1e-5)
  for a, b in zip(_leaves(one.params), _leaves(split.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a second short training run through the command
def test_the_command_trains_with_the_target_split_over_tp(chain_dir, tmp_path):
  # `dspark-jax train --dp 2 --tp 2`: 4 steps on 4 CPU devices, the held-out τ measured on the
  # split pair, and the drafter written and loadable.
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 CPU devices)")
  _, target, data = chain_dir
  out = str(tmp_path / "drafter")
  assert cli.main(["train", "--target", target, "--data", data, "--out", out, "--layers", "1",
                   "--gamma", "3", "--rank", "8", "--steps", "4", "--batch-size", "4",
                   "--seq-len", "64", "--anchors", "8", "--heldout", "2", "--eval-every", "4",
                   "--eval-tokens", "6", "--dp", "2", "--tp", "2"]) == 0
  with open(os.path.join(out, "training", "history.json")) as f:
    log = json.load(f)
  assert log["step"] == 4 and [e["step"] for e in log["evaluations"]] == [0, 4]
  assert all(e["tau"] >= 1.0 for e in log["evaluations"])
  _, draft = dspark_jax.load_pretrained(target, out)
  assert draft.config.gamma == 3


# ---- data --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(chain_dir):
  return load_tokenizer(chain_dir[1])


@pytest.mark.parametrize("thinking", [None, False])
def test_the_loss_mask_covers_the_assistant_turns_only(tokenizer, thinking):
  conversation = cv.Conversation((
      {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
      {"role": "assistant", "content": "the fox"}, {"role": "user", "content": "and"},
      {"role": "assistant", "content": "1234"}))
  kwargs = {} if thinking is None else {"enable_thinking": thinking}
  ids, mask = cv.render(tokenizer, conversation, template_kwargs=kwargs)
  assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
      list(conversation.messages), add_generation_prompt=False, **kwargs)
  assert tokenizer.decode(ids[mask]) == "the fox<|im_end|>1234<|im_end|>"


def test_packing_fills_rows_in_order_and_masks_the_padding():
  examples = [(np.full(n, n, np.int32), np.arange(n) % 2 == 1) for n in (5, 4, 6, 3)]
  packed = cv.pack(examples, 10, pad_id=0)
  assert packed.lines == [[0, 1], [2, 3]]
  np.testing.assert_array_equal(packed.tokens[0], [5] * 5 + [4] * 4 + [0])
  np.testing.assert_array_equal(packed.mask[1], [0, 1, 0, 1, 0, 1, 0, 1, 0, 0])
  batches = training.masked_draft_batches(packed.tokens, packed.mask, 3, 5, 2, seed=0)
  tokens, anchors, mask = batches(7)
  assert tokens.shape == (3, 10) and anchors.shape == (3, 5) and mask.shape == (3, 10)
  assert np.all(np.take_along_axis(np.asarray(mask), np.asarray(anchors) + 1, axis=1))
  assert np.all((np.asarray(anchors) >= 1) & (np.asarray(anchors) <= 10 - 2 - 1))


def _fails(argv, capsys) -> str:
  with pytest.raises(SystemExit) as error:
    cli.main(argv)
  return str(error.value.code) + capsys.readouterr().err


def test_bad_schedule_flags_are_named(chain_dir, tmp_path, capsys):
  _, target, data = chain_dir
  base = ["train", "--target", target, "--data", data, "--out", str(tmp_path / "out")]
  assert "--fit-budget" in _fails(base + ["--fit-budget"], capsys)        # no --max-seconds
  assert "--warmup" in _fails(base + ["--warmup", "1.5"], capsys)
  assert "--warmup-steps" in _fails(base + ["--warmup-steps", "-2"], capsys)


def test_bad_data_is_refused_by_name(chain_dir, tmp_path, capsys):
  _, target, _ = chain_dir
  out = str(tmp_path / "out")

  def train(data):
    return _fails(["train", "--target", target, "--data", str(data), "--out", out,
                   "--seq-len", "64", "--heldout", "0"], capsys)

  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  assert f"{empty}: the file holds no conversations (it is empty)" in train(empty)
  missing = tmp_path / "missing.jsonl"
  missing.write_text(json.dumps({"turns": ["hi", "yes"]}) + "\n" +
                     json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant"}]}) + "\n")
  assert f"{missing}:2: messages[1].content is missing" in train(missing)
  blank = tmp_path / "blank.jsonl"
  blank.write_text(json.dumps({"turns": ["hi", "  "]}) + "\n")
  assert f"{blank}:1: turns[1] is empty" in train(blank)
  long = tmp_path / "long.jsonl"
  long.write_text(json.dumps({"turns": ["hi", "ok"]}) + "\n" +
                  json.dumps({"turns": ["hi", "the quick brown fox " * 20]}) + "\n")
  message = train(long)
  assert f"{long}:2: the conversation has" in message and "sequence length 64" in message
  prompts_only = tmp_path / "prompts.jsonl"
  prompts_only.write_text(json.dumps({"turns": ["just a question"]}) + "\n")
  assert f"{prompts_only}:1: turns has no assistant turn" in train(prompts_only)
  role = tmp_path / "role.jsonl"
  role.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
  assert f"{role}:1: messages[0].role is 'robot'" in train(role)


def test_a_tokenizer_without_a_chat_template_is_refused(chain_dir, tmp_path, capsys):
  _, target, data = chain_dir
  plain = write_tokenizer_dir(str(tmp_path / "plain"), template=None, config_eos=None)
  message = _fails(["train", "--target", target, "--tokenizer", plain, "--data", data,
                    "--out", str(tmp_path / "out")], capsys)
  assert f"{plain}: tokenizer: the tokenizer has no chat template" in message
  with pytest.raises(cv.DataError, match="no chat template"):
    cv.load_packed(data, load_tokenizer(plain), 64)
  assert "--target: nowhere is not a directory" in _fails(
      ["train", "--target", "nowhere", "--data", data, "--out", "x"], capsys)
  assert "--batch-size" in _fails(["train", "--target", target, "--data", data, "--out", "x",
                                   "--batch-size", "3", "--accumulate", "2"], capsys)


def test_the_defaults_are_deepspecs_recipe():
  # tests/golden/deepspec/manifest.json's "recipe": DeepSpec's own Qwen3-4B DSpark configuration
  # and the defaults of the optimizer and schedule it builds, read from a fetched snapshot by
  # scripts/make_deepspec_goldens.py. Our command's defaults must be the same settings.
  import inspect

  import optax

  from dspark_jax.train import drafter
  golden = os.path.join(os.path.dirname(__file__), "golden", "deepspec", "manifest.json")
  with open(golden) as f:
    recipe = json.load(f)["recipe"]
  model, train, data = recipe["model"], recipe["train"], recipe["data"]
  options = drafter.TrainOptions()
  assert options.batch_size == train["global_batch_size"]
  assert options.batch_size // options.micro_batches == train["local_batch_size"]
  assert options.seq_len == data["max_length"] and options.anchors == model["num_anchors"]
  assert options.learning_rate == train["lr"]
  assert options.warmup_fraction == train["warmup_ratio"]
  assert options.weight_decay == train["weight_decay"]
  assert options.epochs == train["num_train_epochs"] and options.steps == train["max_train_steps"]
  assert options.adam_b2 == recipe["adamw"]["betas"][1]
  assert options.final_lr_fraction * options.learning_rate == recipe["schedule"]["eta_min"]
  optimizer = inspect.signature(training.make_optimizer).parameters
  assert optimizer["clip_norm"].default == train["max_grad_norm"]
  adam = inspect.signature(optax.scale_by_adam).parameters
  assert [0.9, options.adam_b2] == recipe["adamw"]["betas"]       # make_optimizer's b1 is 0.9
  assert adam["eps"].default == recipe["adamw"]["eps"]
  assert training.LOSS_WEIGHTS["ce"] == model["ce_loss_alpha"]
  assert training.LOSS_WEIGHTS["tv"] == model["l1_loss_alpha"]
  assert training.LOSS_WEIGHTS["bce"] == model["confidence_head_alpha"]
  assert training.POSITION_DECAY == model["loss_decay_gamma"]
  config = drafter.default_draft_config(tm.qwen3_4b_shape(), mask_token_id=model["mask_token_id"])
  assert config.gamma == model["block_size"] and config.num_layers == model["num_draft_layers"]
  assert list(config.target_layer_ids) == model["target_layer_ids"]
  assert config.rank == model["markov_rank"] and config.head_kind == model["markov_head_type"]
  assert config.confidence_with_markov == model["confidence_head_with_markov"]
  assert config.num_anchors == model["num_anchors"]
  # DeepSpec's step count: epochs x (rows // global batch); the learning rate ends at eta_min.
  assert options.total_steps(5000) == 10 * (5000 // 512)
  assert drafter.TrainOptions(steps=7).total_steps(5000) == 7
  assert options.total_steps(3) == 10            # fewer rows than a batch: one step per epoch
  schedule = training.make_schedule(6e-4, 100, end_fraction=options.final_lr_fraction)
  assert float(schedule(100)) == pytest.approx(recipe["schedule"]["eta_min"], abs=1e-12)
  assert float(schedule(4)) == pytest.approx(6e-4)


@pytest.mark.parametrize("changes, name", [
    (dict(epochs=0), "epochs"), (dict(steps=0), "steps"), (dict(accumulate=0), "accumulate"),
    (dict(weight_decay=-1.0), "weight_decay"), (dict(adam_b2=1.0), "adam_b2"),
    (dict(final_lr_fraction=1.5), "final_lr_fraction"), (dict(learning_rate=0.0), "learning_rate"),
    (dict(batch_size=6, dp=4), "batch_size"), (dict(warmup_steps=-1), "warmup_steps"),
    (dict(fit_to_budget=True), "fit_to_budget")])
def test_bad_training_options_are_named(changes, name):
  from dspark_jax.train import drafter
  with pytest.raises(ValueError, match=f"^{name}:"):
    drafter.TrainOptions(**changes)


# ---- pre-tokenized rows (.npz) -------------------------------------------------------------------

_ROW_FLAGS = ["--layers", "1", "--gamma", "3", "--rank", "8", "--steps", "3", "--batch-size", "4",
              "--seq-len", "64", "--anchors", "8", "--lr", "1e-2", "--eval-every", "3",
              "--eval-tokens", "8", "--log-every", "1", "--checkpoint-every", "3",
              "--accumulate", "1"]


def _history(out):
  with open(os.path.join(out, "training", "history.json")) as f:
    return json.load(f)


@pytest.mark.slow  # three short training runs through the command: ~12 s on 2 cores
def test_token_rows_train_as_the_same_rows_from_conversations(chain_dir, tmp_path):
  # The conversations packed by the jsonl path, saved as an .npz, train bit for bit the same
  # drafter: the two data forms differ only in how the rows are made.
  _, target, data = chain_dir
  packed = cv.load_packed(data, load_tokenizer(target), 64)
  rows = tmp_path / "rows.npz"
  np.savez(rows, tokens=packed.tokens, loss_mask=packed.mask)
  runs = {}
  for name, source in (("jsonl", data), ("npz", str(rows))):
    out = str(tmp_path / name)
    assert cli.main(["train", "--target", target, "--data", source, "--out", out,
                     "--heldout", "0"] + _ROW_FLAGS) == 0
    runs[name] = _history(out)["history"]
  assert [h["loss"] for h in runs["npz"]] == [h["loss"] for h in runs["jsonl"]]
  assert runs["npz"][-1]["loss"] < runs["npz"][0]["loss"]
  # Held-out rows: their prompts are the tokens before the first masked one, decoded for τ.
  out = str(tmp_path / "heldout")
  assert cli.main(["train", "--target", target, "--data", str(rows), "--out", out,
                   "--heldout", "2"] + _ROW_FLAGS) == 0
  evaluations = _history(out)["evaluations"]
  assert [e["step"] for e in evaluations] == [0, 3] and all(e["tau"] >= 1 for e in evaluations)
  with open(os.path.join(out, "training", "options.json")) as f:
    assert json.load(f)["rows"] == len(packed.tokens) - 2


def test_heldout_prompts_are_the_tokens_before_the_first_masked_one():
  from dspark_jax.train import token_rows
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
  mask = np.array([[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1]], bool)
  rows = cv.Packed(tokens, mask, [[7], [8]])
  assert token_rows.heldout_prompts(rows, "f.npz") == [[0, 1], [6]]
  mask[1, 0] = True
  with pytest.raises(cv.DataError, match=r"f\.npz: held-out row 8 has no prompt"):
    token_rows.heldout_prompts(rows, "f.npz")


def test_bad_token_rows_are_refused_by_name(chain_dir, tmp_path, capsys):
  _, target, _ = chain_dir
  good = np.ones((3, 16), np.int32), np.ones((3, 16), bool)

  def train(name, heldout="0", **arrays):
    path = tmp_path / name
    if arrays:
      np.savez(path, **arrays)
    return _fails(["train", "--target", target, "--data", str(path), "--out",
                   str(tmp_path / "out"), "--heldout", heldout], capsys)

  not_npz = tmp_path / "text.npz"
  not_npz.write_text("tokens")
  assert f"{not_npz}: not a .npz of arrays" in train("text.npz")
  assert "no array 'loss_mask'" in train("a.npz", tokens=good[0])
  assert "loss_mask has shape (3, 15), tokens (3, 16)" in train(
      "b.npz", tokens=good[0], loss_mask=good[1][:, :15])
  assert "tokens has dtype float32" in train("c.npz", tokens=good[0].astype(np.float32),
                                             loss_mask=good[1])
  far = good[0].copy()
  far[1, 4] = TARGET.vocab_size
  assert f"tokens[1, 4] = {TARGET.vocab_size} is outside the target's vocabulary" in train(
      "d.npz", tokens=far, loss_mask=good[1])
  two = good[1].astype(np.int8)
  two[2, 3] = 2
  assert "loss_mask[2, 3] = 2; expected 0 or 1" in train("e.npz", tokens=good[0], loss_mask=two)
  empty = good[1].copy()
  empty[1] = False
  assert "loss_mask row 1 has no true entry" in train("f.npz", tokens=good[0], loss_mask=empty)
  assert "3 rows, but heldout=3 are kept out" in train("g.npz", "3", tokens=good[0],
                                                       loss_mask=good[1])
  assert "held-out row 2 has no prompt" in train("h.npz", "1", tokens=good[0], loss_mask=good[1])
