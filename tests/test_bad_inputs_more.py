"""Bad input, continued (issue 37): each case ends in an error naming the argument, field, flag or
file and its first bad element, instead of a silent wrong result or an error from deep inside
NumPy or JAX. One test per case; each asserts the message text."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax.apps import cli
from dspark_jax.decoding import loop
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.scheduling import calibration, schedules
from dspark_jax.text import encode_prompts
from tests.test_text import write_tokenizer_dir

TARGET = tm.TargetConfig(vocab_size=320, num_layers=2, feature_layers=(0,),
                         layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                 head_dim=8, intermediate_size=64))
DRAFT = dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(0,), mask_token_id=310,
                       head_kind="vanilla", rank=8)
PARAMS = dj.SamplingParams(temperature=[1.0, 0.0])


@pytest.fixture(scope="module")
def pair():
  return tm.TargetModel(TARGET, rngs=nnx.Rngs(0)), dm.DSparkDraft(DRAFT, TARGET, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, pair):
  """A saved target (with the test tokenizer) and its DeepSpec draft."""
  root = tmp_path_factory.mktemp("pair")
  target, draft = pair
  dj.save_pretrained(target, str(root / "target"))
  dj.save_pretrained(draft, str(root / "draft"), target=target)
  write_tokenizer_dir(str(root / "target"), config_eos=None)
  return str(root / "target"), str(root / "draft")


def _generate(pair, **kw):
  target, draft = pair
  args = dict(max_new_tokens=2, key=jax.random.key(0))
  args.update(kw)
  return dj.generate(target, draft, [[1, 2, 3], [4, 5]], PARAMS, **args)


# ---- keys -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, message", [
    (0.3, "key: expected a PRNG key (jax.random.key(seed)), got float"),
    (0.9, "key: expected a PRNG key (jax.random.key(seed)), got float"),
    (0, "key: expected a PRNG key (jax.random.key(seed)), got int"),
    ("seed", "key: expected a PRNG key (jax.random.key(seed)), got str"),
])
def test_generate_refuses_a_key_that_is_not_a_key(pair, key, message):
  """A float key (truncated to 0 before: two streams silently shared), an int or a string."""
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    _generate(pair, key=key)


def test_generate_refuses_a_batch_of_keys(pair):
  keys = jax.random.split(jax.random.key(0), 2)
  with pytest.raises(ValueError, match=r"key: expected one key, got a batch of keys of shape \(2,\)"):
    _generate(pair, key=keys)


def test_decode_and_generate_text_check_the_key(pair, dirs):
  """decode and generate_text check the key by the same rule (validation.check_key)."""
  target, draft = pair
  with pytest.raises(ValueError, match="key: expected a PRNG key"):
    dj.decode(target, draft, jnp.ones((2, 3), jnp.int32), jnp.array([3, 2]), PARAMS, 0.3,
              max_new_tokens=2)
  tokenizer = dj.load_tokenizer(dirs[0])
  with pytest.raises(ValueError, match="key: expected a PRNG key"):
    dj.generate_text(target, draft, tokenizer, ["a", "b"], PARAMS, 0.3, max_new_tokens=2)


# ---- paths and dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, 3])
def test_load_pretrained_names_a_path_that_is_not_a_path(value):
  with pytest.raises(TypeError, match=f"target_dir: expected a path \\(str or os.PathLike\\), got "
                                      f"{type(value).__name__}"):
    dj.load_pretrained(value)


def test_load_pretrained_names_a_draft_dir_that_is_not_a_path(dirs):
  with pytest.raises(TypeError, match="draft_dir: expected a path"):
    dj.load_pretrained(dirs[0], 3)


def test_load_tokenizer_names_a_path_that_is_not_a_path():
  with pytest.raises(TypeError, match="directory: expected a path .* got NoneType"):
    dj.load_tokenizer(None)


@pytest.mark.parametrize("dtype, shown", [(jnp.int32, "'int32'"), ("bogus", "'bogus'"),
                                          ("float8_e4m3fn", "'float8_e4m3fn'")])
def test_load_pretrained_refuses_a_dtype_the_layers_do_not_compute_in(dirs, dtype, shown):
  with pytest.raises(ValueError, match=f"dtype: {shown} is not supported; the layers compute in "
                                       "float32, bfloat16, float16"):
    dj.load_pretrained(*dirs, dtype=dtype)


def test_config_dtype_float8_is_refused_at_load(dirs, tmp_path):
  """float8 in config.json loaded before and failed at the first dj.logits."""
  directory = tmp_path / "target"
  os.makedirs(directory)
  for name in os.listdir(dirs[0]):
    with open(os.path.join(dirs[0], name), "rb") as src:
      (directory / name).write_bytes(src.read())
  config = json.loads((directory / "config.json").read_text())
  config["dtype"] = config["torch_dtype"] = "float8_e4m3fn"
  (directory / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="config: dtype: 'float8_e4m3fn' is not supported"):
    dj.load_pretrained(str(directory))


# ---- text, schedules, tables, calibration, sampling -------------------------------------------------


def test_chat_kwargs_must_be_a_mapping(dirs):
  tokenizer = dj.load_tokenizer(dirs[0])
  with pytest.raises(ValueError, match=r"chat_kwargs: expected a mapping .* got list \[1\]"):
    encode_prompts(tokenizer, ["hi"], chat=True, chat_kwargs=[1])


@pytest.mark.parametrize("schedule, message", [
    (schedules.Schedule(lambda b, g: schedules.EmptyState(),
                        lambda c, a, s: (jnp.ones(c.shape, jnp.int32), s)),
     r"schedule.update: verify_lens has shape \(2, 3\) .* expected \[2\] integers"),
    (schedules.Schedule(lambda b, g: schedules.EmptyState(),
                        lambda c, s: (jnp.ones(c.shape[0], jnp.int32), s)),
     "schedule.update: raised TypeError on a 2-row batch: .*positional argument"),
    (schedules.Schedule(lambda b, g: schedules.EmptyState(),
                        lambda c, a, s: jnp.ones(c.shape[0], jnp.int32)),
     r"schedule.update: returned .*, not \(verify_lens, state\)"),
    (schedules.Schedule(lambda b: schedules.EmptyState(),
                        lambda c, a, s: (jnp.ones(c.shape[0], jnp.int32), s)),
     r"schedule.init: init\(2, 3\) raised TypeError"),
    (schedules.Schedule(lambda b, g: jnp.zeros(b),
                        lambda c, a, s: (jnp.ones(c.shape[0], jnp.int32), s[None])),
     "schedule.update: the state it returns .* differs from init's"),
])
def test_a_users_schedule_is_checked_against_its_contract(pair, schedule, message):
  """Before: raw JAX errors (broadcasting, argument counts, indices) from inside the loop."""
  with pytest.raises(ValueError, match=message):
    _generate(pair, schedule=schedule)


def test_the_shipped_schedules_keep_the_contract():
  for schedule in (schedules.fixed(), schedules.threshold(0.5),
                   schedules.prefix(np.ones(64)), schedules.top_k(np.ones(64))):
    loop.check_schedule_contract(schedule, 3)


def test_load_sps_refuses_a_table_too_large_to_densify(tmp_path):
  path = tmp_path / "sps.json"
  path.write_text(json.dumps({"batch_tokens": [1, 2**40], "steps_per_second": [10.0, 1.0]}))
  with pytest.raises(ValueError, match=rf"sps.json: batch_tokens\[1\] is {2**40}; must be <= "
                                       f"{2**24}"):
    schedules.load_sps(path)


def test_fit_sts_names_the_ragged_row():
  with pytest.raises(TypeError, match=r"confidence: .*ragged list \(entry 1 has shape \(1,\), "
                                      r"entry 0 has \(2,\)\)"):
    calibration.fit_sts([[0.5, 0.5], [0.5]], [1, 1])


def test_sample_step_refuses_an_empty_vocabulary():
  with pytest.raises(ValueError, match=r"logits: expected V >= 1 columns .* got shape \(2, 0\)"):
    dj.sample_step(jnp.zeros((2, 0)), PARAMS, jax.random.key(0), jnp.array([0, 1]))


def test_logits_of_no_rows_is_empty(pair):
  """B = 0 gives an empty [0, T, V] array in the dtype of a one-row call (it raised
  ZeroDivisionError in a reshape); concrete tokens and tokens traced under jit alike."""
  target = pair[0]
  one = dj.logits(target, np.zeros((1, 5), np.int32))
  out = dj.logits(target, np.zeros((0, 5), np.int32))
  assert out.shape == (0, 5, TARGET.vocab_size) and out.dtype == one.dtype
  traced = jax.jit(lambda tokens: dj.logits(target, tokens))(jnp.zeros((0, 3), jnp.int32))
  assert traced.shape == (0, 3, TARGET.vocab_size) and traced.dtype == one.dtype
  with pytest.raises(ValueError, match=r"tokens: expected at least one token per row"):
    dj.logits(target, np.zeros((0, 0), np.int32))


def test_sampling_params_fields_are_read_only_and_documented():
  """Writing into a field is refused (NumPy's read-only error); the docstring says so and how to
  change a value."""
  with pytest.raises(ValueError, match="read-only"):
    PARAMS.temperature[0] = 2.0
  with pytest.raises(AttributeError, match="SamplingParams is immutable"):
    PARAMS.temperature = np.ones(2)
  assert "The fields are read-only" in dj.SamplingParams.__doc__


# ---- the command line -------------------------------------------------------------------------------


def _error(argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  code = exit_info.value.code
  return code if isinstance(code, str) else capsys.readouterr().err


def test_cli_blames_draft_for_a_target_directory_given_as_draft(dirs, capsys):
  target, _ = dirs
  message = _error(["generate", "--target", target, "--draft", target, "--prompt", "x"], capsys)
  assert "argument --draft: " in message and "architectures ['Qwen3ForCausalLM']" in message


def test_cli_blames_draft_for_layers_outside_the_target(dirs, tmp_path, capsys):
  target, draft = dirs
  bad = tmp_path / "draft"
  os.makedirs(bad)
  for name in os.listdir(draft):
    with open(os.path.join(draft, name), "rb") as src:
      (bad / name).write_bytes(src.read())
  config = json.loads((bad / "config.json").read_text())
  config["target_layer_ids"] = [5]
  (bad / "config.json").write_text(json.dumps(config))
  message = _error(["generate", "--target", target, "--draft", str(bad), "--prompt", "x"], capsys)
  assert "argument --draft: " in message and "target_layer_ids[0] is 5" in message


def test_cli_eval_names_the_file_and_line_of_an_empty_prompt(dirs, tmp_path, capsys):
  target, draft = dirs
  dataset = tmp_path / "eval.jsonl"
  dataset.write_text('{"turns": ["fine"]}\n{"turns": [""]}\n')
  message = _error(["eval", "--target", target, "--draft", draft, "--dataset", str(dataset)],
                   capsys)
  assert f"argument --dataset: {dataset}:2: the first turn (the prompt) is empty" in message
