"""Bad input gets a clear error naming the argument and its first bad element, never a wrong token.

Each test is one case a careful user hit: the silent ones (no error and a wrong or out-of-range
result) and the obscure ones (an exception from deep inside NumPy or JAX that names no argument).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax import validation
from dspark_jax.draft import memory_gate
from tests import helpers

V, GAMMA, RANK = 8, 3, 4


@pytest.fixture(scope="module")
def head():
  return helpers.make_head("vanilla", V, RANK, 3)


def _propose(head, anchor, positions=(5, 6), key=None, base=None, **kw):
  base = jnp.zeros((2, GAMMA, V)) if base is None else base
  params = dj.SamplingParams(temperature=[0.0, 1.0])
  return dj.sample_block(head, base, anchor, None, params,
                         jax.random.key(0) if key is None else key, positions, **kw)


# ---- the silent cases --------------------------------------------------------------------------------


@pytest.mark.parametrize("anchor,shown", [([0, V], str(V)), ([-1, 0], "-1"),
                                          (np.array([0, 2**32 + 3], np.int64), str(2**32 + 3))])
def test_anchor_outside_the_vocabulary_is_named(head, anchor, shown):
  # Was: anchor = V gave NaN logits and token 0; -1 read W1[V-1]; 2**32 + 3 wrapped to 3.
  with pytest.raises(ValueError, match=rf"^anchor: row \d is {shown}; must be in \[0, {V}\)"):
    _propose(head, anchor)
  sampler = dj.build_draft_sampler(head, max_batch_size=2, vocab_size=V, gamma=GAMMA,
                                   logits_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"^anchor: row \d is"):
    sampler.propose(jnp.zeros((2, GAMMA, V)), np.asarray(anchor), None,
                    dj.SamplingParams(temperature=[0.0, 1.0]), jax.random.key(0), [5, 6])


def test_verify_refuses_draft_tokens_outside_the_vocabulary(head):
  # Was: committed held -1 and counted it in num_committed.
  block = _propose(head, [1, 2])
  params = dj.SamplingParams(temperature=[0.0, 1.0])
  target = jnp.zeros((2, GAMMA + 1, V))
  for bad in (-1, V):
    with pytest.raises(ValueError, match=rf"^block.tokens: element \[0, 0\] is {bad}; must be in"):
      dj.verify(target, block.replace(tokens=jnp.full_like(block.tokens, bad)), params,
                jax.random.key(1), [5, 6])


@pytest.mark.parametrize("field,value,rule", [
    ("temperature", 1e39, "float32"), ("top_p", 1e-50, "float32")])
def test_values_are_checked_as_they_are_stored(field, value, rule):
  # Was: 1e39 passed the float64 check and became inf; 1e-50 became 0.
  with pytest.raises(ValueError, match=rf"^SamplingParams.{field}: row 1 is .*{rule}"):
    dj.SamplingParams(**{field: [0.5, value]})


def test_sampling_params_fields_are_read_only():
  # Was: q.temperature[0] = nan after validation was silently used.
  params = dj.SamplingParams(temperature=[0.5, 1.0], seed=[1, 2])
  for field in ("temperature", "top_k", "top_p", "seed"):
    with pytest.raises(ValueError, match="read-only"):
      getattr(params, field)[0] = 0
  given = np.array([0.5, 1.0])
  dj.SamplingParams(temperature=given)
  given[0] = 3.0  # the caller's array is neither kept nor changed
  assert given[0] == 3.0


@pytest.mark.parametrize("stats,name", [
    ({"bytes_limit": 2**34, "bytes_in_use": -2**40}, "bytes_in_use"),
    ({"bytes_limit": -1, "bytes_in_use": 0}, "bytes_limit"),
    ({"bytes_limit": "abc", "bytes_in_use": 0}, "bytes_limit"),
    ({"bytes_limit": float("nan"), "bytes_in_use": 0}, "bytes_limit"),
])
def test_memory_stats_must_be_sane(stats, name):
  # Was: a negative bytes_in_use inflated free memory past the limit and turned folded sampling on.
  with pytest.raises(ValueError, match=rf"^memory_stats: {name} "):
    memory_gate.probe_free_bytes(stats)


def test_memory_stats_must_be_a_mapping():
  with pytest.raises(ValueError, match=r"^memory_stats: expected a mapping"):
    memory_gate.probe_free_bytes([1, 2])


@pytest.mark.parametrize("positions,shown", [([5, -1], "-1"), ([2**32, 5], str(2**32)),
                                             ([2**31, 5], str(2**31))])
def test_positions_must_not_wrap(head, positions, shown):
  # Was: -1 and 2**32 drew the same noise as 2**32 - 1 and 0.
  with pytest.raises(ValueError, match=rf"^positions: row \d is {shown}; must be in \[0, 2\*\*31\)"):
    _propose(head, [1, 2], positions=np.asarray(positions, np.int64))
  logits = jnp.zeros((2, V))
  params = dj.SamplingParams(temperature=[1.0, 1.0])
  with pytest.raises(ValueError, match=r"^positions: row \d is"):
    dj.sample_step(logits, params, jax.random.key(0), np.asarray(positions, np.int64))


@pytest.mark.parametrize("key,what", [
    (jnp.zeros((2,), jnp.float32), "dtype float32"),
    (jax.random.split(jax.random.key(0), 3), "a batch of keys"),
    (7, "got int"),
])
def test_keys_are_validated(head, key, what):
  # Was: float keys drew like key(0); a batch of keys was folded into one.
  logits = jnp.zeros((2, V))
  params = dj.SamplingParams(temperature=[1.0, 1.0])
  with pytest.raises(ValueError, match=rf"^key: .*{what}"):
    dj.sample_step(logits, params, key, [0, 1])
  with pytest.raises(ValueError, match=rf"^key: .*{what}"):
    _propose(head, [1, 2], key=key)


# ---- the obscure cases -------------------------------------------------------------------------------


def test_python_lists_are_accepted(head):
  listed = _propose(head, [1, 2], positions=[5, 6], base=np.zeros((2, GAMMA, V)).tolist())
  arrays = _propose(head, jnp.asarray([1, 2]), positions=jnp.asarray([5, 6]),
                    base=jnp.zeros((2, GAMMA, V)))
  np.testing.assert_array_equal(listed.tokens, arrays.tokens)
  params = dj.SamplingParams(temperature=[0.0, 1.0])
  result = dj.verify(np.zeros((2, GAMMA + 1, V)).tolist(), listed, params, jax.random.key(1),
                     [5, 6], verify_lens=[1, 2])
  assert np.asarray(result.num_committed).shape == (2,)
  dj.sample_step(np.zeros((2, V)).tolist(), dj.SamplingParams(temperature=[1.0, 0.0]),
                 jax.random.key(0), [3, 4])


def test_non_arrays_are_refused_by_name(head):
  with pytest.raises(TypeError, match=r"^base_logits: expected an array, got str"):
    _propose(head, [1, 2], base="logits")
  with pytest.raises(TypeError, match=r"^positions: expected an array, got dict"):
    _propose(head, [1, 2], positions={"a": 1})


@pytest.mark.parametrize("kwargs,name", [
    ({"max_batch_size": 2.5}, "max_batch_size"), ({"max_batch_size": -1}, "max_batch_size"),
    ({"gamma": 2.5}, "gamma"), ({"gamma": 0}, "gamma"), ({"vocab_size": 0}, "vocab_size"),
])
def test_sampler_sizes_are_named(head, kwargs, name):
  args = dict(max_batch_size=2, vocab_size=V, gamma=GAMMA) | kwargs
  with pytest.raises(ValueError, match=rf"^{name}: "):
    dj.build_draft_sampler(head, **args)


@pytest.mark.parametrize("size", [-1, 0, 2.5])
def test_sampling_params_batch_size_is_named(size):
  with pytest.raises(ValueError, match=r"^SamplingParams.batch_size: "):
    dj.SamplingParams(temperature=0.5, batch_size=size)


def test_stream_must_be_a_stream(head):
  with pytest.raises(ValueError, match=r"^stream: expected a Stream"):
    dj.sample_step(jnp.zeros((2, V)), dj.SamplingParams(temperature=[1.0, 1.0]),
                   jax.random.key(0), [0, 1], stream="draft")


def test_propose_refuses_int_and_batched_keys(head):
  sampler = dj.build_draft_sampler(head, max_batch_size=2, vocab_size=V, gamma=GAMMA,
                                   logits_dtype=jnp.float32)
  params = dj.SamplingParams(temperature=[0.0, 1.0])
  for key in (3, jax.random.split(jax.random.key(0), 2)):
    with pytest.raises(ValueError, match=r"^key: "):
      sampler.propose(jnp.zeros((2, GAMMA, V)), [1, 2], None, params, key, [5, 6])


def test_validation_helpers():
  with pytest.raises(ValueError, match=r"^x: element \[1, 0\] is 9; must be in \[0, 4\)"):
    validation.check_range("x", np.array([[0, 1], [9, 2]]), 0, 4)
  validation.check_range("x", np.array([], np.int64), 0, 4)
  with pytest.raises(ValueError, match=r"^n: expected an integer, got 2.5"):
    validation.check_positive_int("n", 2.5)
  with pytest.raises(ValueError, match=r"^n: expected an integer, got True"):
    validation.check_positive_int("n", True)
  assert validation.check_nonnegative_int("n", np.int64(0)) == 0
  with pytest.raises(TypeError, match=r"^a: expected an array or a \(nested\) list"):
    validation.as_array("a", [[1, 2], [3]])
  validation.check_key("key", jax.random.PRNGKey(0))


# ---- x64 ---------------------------------------------------------------------------------------------

X64_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
assert jax.config.jax_enable_x64
import dspark_jax as dj
from tests import helpers
from tests.test_decoding import make_target, make_draft, PROMPTS
V = 12
head = helpers.make_head("gated", V, 4, 3)
params = dj.SamplingParams(temperature=[0.0, 0.7, 1.0])
base = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, V)), jnp.float32)
hidden = jnp.ones((3, 2, 3), jnp.float32)
step = dj.sample_step(base[:, 0], params, jax.random.key(0), np.array([1, 2, 3]))
block = dj.sample_block(head, base, np.array([1, 2, 3]), hidden, params, jax.random.key(0),
                        np.array([4, 5, 6]))
eager = dj.sample_block_eager(head, base, np.array([1, 2, 3]), hidden, params, jax.random.key(0),
                              np.array([4, 5, 6]))
result = dj.verify(jnp.zeros((3, 3, V)), block, params, jax.random.key(1), np.array([4, 5, 6]))
target = make_target()
draft = make_draft(target, 3, "vanilla")
for temps in ([0.0] * 5, [0.0, 1.0, 0.5, 1.0, 0.0]):
  p = dj.SamplingParams(temperature=temps)
  spec = dj.generate(target, draft, PROMPTS, p, jax.random.key(0), max_new_tokens=6)
  plain = dj.generate(target, None, PROMPTS, p, jax.random.key(0), max_new_tokens=6, spec=False)
  assert spec.tokens.shape == plain.tokens.shape == (5, 6)
print("x64 ok", step.dtype, block.tokens.dtype, int(result.num_committed.sum()))
"""


@pytest.mark.slow
def test_core_paths_run_under_x64():
  # With jax_enable_x64 (common in distribution work) every public path runs: sampling, the folded
  # and eager block, verification, speculative and plain generate. Was: generate failed with
  # "while_loop body ... int32 vs int64". A subprocess, since x64 is a process-wide setting.
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-c", X64_SCRIPT], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "x64 ok int32 int32" in run.stdout


# ---- generate ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
  from tests.test_decoding import make_draft, make_target
  target = make_target()
  return target, make_draft(target, 2, "vanilla")


@pytest.mark.parametrize("budget,message", [
    ([4, 4], r"^max_new_tokens: expected an int or 3 ints \(one per prompt\), got shape \(2,\)"),
    (2**31, r"^max_new_tokens: row 0 is 2147483648; must be in \[0, 2\*\*31\)"),
    ([1, -1, 2], r"^max_new_tokens: row 1 is -1"),
    (2.5, r"^max_new_tokens: expected an int or 3 ints"),
])
def test_generate_budgets_are_named(pair, budget, message):
  params = dj.SamplingParams(temperature=[0.0, 0.0, 0.0])
  with pytest.raises(ValueError, match=message):
    dj.generate(*pair, [[1, 2], [3], [4]], params, jax.random.key(0), max_new_tokens=budget)


def test_generate_refuses_ragged_stop_ids(pair):
  params = dj.SamplingParams(temperature=[0.0, 0.0])
  with pytest.raises(TypeError, match=r"^stop_token_ids: expected an array or a \(nested\) list"):
    dj.generate(*pair, [[1, 2], [3]], params, jax.random.key(0), max_new_tokens=2,
                stop_token_ids=[[1, 2], [3]])


def test_generate_checks_the_draft_weights_not_only_its_config(pair):
  # Was: check_against compared configs; a draft whose arrays were built for another vocabulary or
  # hidden size failed deep inside a matmul, or drafted out-of-range tokens.
  from tests.test_decoding import make_draft, make_target
  target, _ = pair
  foreign = make_draft(make_target(vocab=16), 2, "vanilla")
  foreign.config = dataclasses.replace(foreign.config, mask_token_id=3)  # the configs agree
  params = dj.SamplingParams(temperature=[0.0])
  with pytest.raises(ValueError, match=r"^draft: its head has a vocabulary of 16, the target's "
                                       r"embedding 12"):
    dj.generate(target, foreign, [[1, 2]], params, jax.random.key(0), max_new_tokens=2)


# ---- statistics a paper can pool, and no global side effects ------------------------------------------


def test_eval_intervals():
  from dspark_jax.apps import evaluation
  # Wilson score interval of 8 / 10 at 95 %: [0.4902, 0.9433] (a textbook value).
  np.testing.assert_allclose(evaluation.wilson_interval(np.array([8]), np.array([10]))[0],
                             [0.4902, 0.9433], atol=1e-4)
  assert np.isnan(evaluation.wilson_interval(np.array([0]), np.array([0]))).all()
  # τ's interval by prompts: equal per-prompt ratios give a zero-width interval at the ratio.
  lo, hi = evaluation.tau_interval(np.array([2, 4, 6]), np.array([1, 2, 3]))
  assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
  lo, hi = evaluation.tau_interval(np.array([0, 4, 9]), np.array([2, 2, 3]))
  assert lo < 1 + 13 / 7 < hi


def test_plot_acceptance_leaves_matplotlib_backend_alone(tmp_path):
  import matplotlib
  from dspark_jax.apps import evaluation
  before = matplotlib.get_backend()
  row = evaluation.StudyRow(
      drafter="d", temperature=0.0, tau=2.0, acceptance=np.array([0.5, np.nan]), rounds=3,
      tau_interval=(1.5, 2.5), acceptance_interval=np.array([[0.3, 0.7], [np.nan, np.nan]]),
      reached=np.array([4, 0]), accepted=np.array([2, 0]), tokens=6, tokens_per_second=1.0,
      baseline_tokens_per_second=1.0)
  path = evaluation.plot_acceptance([row], str(tmp_path / "a.png"))
  assert (tmp_path / "a.png").stat().st_size > 0 and path.endswith("a.png")
  assert matplotlib.get_backend() == before
  assert "2.00 [1.50, 2.50]" in evaluation.format_table([row])


# ---- files: checkpoints and shipped assets -----------------------------------------------------------


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
  from tests.test_decoding import make_draft, make_target
  from dspark_jax.formats import checkpoints
  directory = tmp_path_factory.mktemp("ckpt")
  target = make_target()
  checkpoints.save_model(str(directory / "target.safetensors"), target)
  checkpoints.save_model(str(directory / "draft.safetensors"), make_draft(target, 2, "vanilla"))
  return directory, target


def _rewrite_config(src, dst, edit):
  """A copy of the checkpoint `src` at `dst` with its metadata passed through `edit`."""
  from safetensors import safe_open
  from safetensors.numpy import load_file, save_file
  with safe_open(str(src), framework="numpy") as f:
    meta = dict(f.metadata())
  save_file(load_file(str(src)), str(dst), metadata=edit(meta))


@pytest.mark.parametrize("edit,message", [
    (lambda m: {k: v for k, v in m.items() if k != "config"}, r"metadata has no 'config'"),
    (lambda m: dict(m, config="{not json"), r"config: expected a JSON object, got str"),
    (lambda m: dict(m, config=m["config"].replace('"vocab_size"', '"vocab_sise"')),
     r"config: unknown field 'vocab_sise'"),
    (lambda m: dict(m, config=m["config"].replace('"num_layers": 2', '"num_layers": -2')),
     r"config: num_layers: must be >= 1, got -2"),
    (lambda m: dict(m, config=m["config"].replace('"num_kv_heads": 2', '"num_kv_heads": 0')),
     r"config.layer: num_kv_heads: must be >= 1, got 0"),
])
def test_bad_checkpoint_metadata_is_named(saved_target, tmp_path, edit, message):
  from dspark_jax.formats import checkpoints
  directory, _ = saved_target
  bad = tmp_path / "bad.safetensors"
  _rewrite_config(directory / "target.safetensors", bad, edit)
  with pytest.raises(ValueError, match=rf"^{bad}: .*{message}"):
    checkpoints.load_target(str(bad))


def test_truncated_and_wrong_kind_checkpoints_are_named(saved_target, tmp_path):
  from dspark_jax.formats import checkpoints
  directory, target = saved_target
  data = (directory / "target.safetensors").read_bytes()
  for cut in (20, len(data) // 2):
    bad = tmp_path / f"cut{cut}.safetensors"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=rf"^{bad}: not a readable safetensors file"):
      checkpoints.load_target(str(bad))
  with pytest.raises(ValueError, match=r"holds a DSparkDraft, not a TargetModel"):
    checkpoints.load_target(str(directory / "draft.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"no such checkpoint file"):
    checkpoints.load_target(str(tmp_path / "absent.safetensors"))


def test_damaged_shipped_assets_are_named(tmp_path):
  import shutil
  from dspark_jax.formats import shipped
  copy = tmp_path / "assets"
  shutil.copytree(shipped.ASSETS, copy)
  (copy / "manifest.json").write_text("{broken")
  with pytest.raises(ValueError, match=r"manifest.json: not valid JSON"):
    shipped.load_shipped(str(copy))
  (copy / "manifest.json").write_text('{"corpus": {}}')
  with pytest.raises(ValueError, match=r"manifest.json: expected an object with a 'files' entry"):
    shipped.load_shipped(str(copy))
  shutil.copy(os.path.join(shipped.ASSETS, "manifest.json"), copy / "manifest.json")
  (copy / "tokenizer.json").write_text('{"truncated": ')
  with pytest.raises(ValueError, match=r"tokenizer.json: not a readable tokenizer"):
    shipped.load_shipped(str(copy))
  (copy / "tokenizer.json").unlink()
  with pytest.raises(ValueError, match=r"tokenizer.json: the shipped tokenizer is missing"):
    shipped.load_shipped(str(copy))
  shutil.copy(os.path.join(shipped.ASSETS, "tokenizer.json"), copy / "tokenizer.json")
  part = copy / "draft.part0.safetensors"
  part.write_bytes(part.read_bytes()[:1000])
  with pytest.raises(ValueError, match=r"draft.part0.safetensors: not a readable safetensors"):
    shipped.load_shipped(str(copy))


# ---- the command line --------------------------------------------------------------------------------


def test_probe_decides_from_shapes_alone():
  # Was: probe --vocab 10000000 allocated real zero weights (5 GB at r = 256) to decide from shapes.
  # Now its head is abstract: the process stays far below the weights' size (here r = 256, bf16:
  # W1 and W2 would take 10.2 GB).
  import subprocess
  import sys
  # The child's own peak: /proc's VmHWM belongs to the process image (reset by exec); getrusage's
  # ru_maxrss keeps the forking parent's peak across exec, which made the verdict depend on how
  # much the pytest worker had used before this test.
  script = ("import resource, sys; from dspark_jax.apps import cli; "
            "code = cli.main(['probe', '--max-batch-size', '2', '--vocab', '10000000', '--gamma', "
            "'2', '--mode', 'off']); "
            "lines = open('/proc/self/status').read().splitlines() if sys.platform == 'linux' "
            "else []; hwm = [int(l.split()[1]) for l in lines if l.startswith('VmHWM:')]; "
            "print('maxrss_kb', hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF)"
            ".ru_maxrss); sys.exit(code)")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stderr[-2000:]
  assert "greedy   B=2" in run.stdout
  maxrss_gb = int(run.stdout.split("maxrss_kb")[1].split()[0]) / 2**20
  assert maxrss_gb < 2.0, f"probe used {maxrss_gb:.1f} GB"


@pytest.mark.parametrize("argv,message", [
    (["probe", "--max-batch-size", "2", "--vocab", "64", "--gamma", "2", "--headroom-gib", "nan"],
     "argument --headroom-gib: must be a finite number >= 0, got 'nan'"),
    (["probe", "--max-batch-size", "2", "--vocab", "64", "--gamma", "2", "--headroom-gib", "inf"],
     "argument --headroom-gib: must be a finite number >= 0, got 'inf'"),
    (["eval", "--temperatures", "abc"], "argument --temperatures/--temperature: expected comma-separated numbers"),
    (["demo", "--first-prompt", "-1"], "argument --first-prompt: must be >= 0"),
    (["demo", "--first-prompt", "1000"], "argument --first-prompt: 1000 is past the last"),
])
def test_cli_names_the_flag(argv, message, capsys):
  from dspark_jax.apps import cli
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  text = str(exit_info.value.code) + capsys.readouterr().err
  assert message in text
