"""``dspark-jax generate`` and ``dspark-jax eval`` on a tiny pretrained pair written by
`save_pretrained` (a random Qwen3 target, a random DeepSpec drafter and the tiny tokenizer of
test_text), and the errors that name a bad flag, file or line."""

import json
import os

import pytest
from flax import nnx

import dspark_jax
from dspark_jax.apps import cli
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from tests.test_text import write_tokenizer_dir

DATASET = os.path.join(os.path.dirname(__file__), "data", "eval_sample.jsonl")
GAMMA = 3
# V = 320 > the tokenizer's 303 tokens (as Qwen3's 151936 > 151669); the mask id is past them.
TARGET = tm.TargetConfig(vocab_size=320, num_layers=2, feature_layers=(0,),
                         layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                 head_dim=8, intermediate_size=64))
DRAFT = dm.DraftConfig(gamma=GAMMA, num_layers=1, target_layer_ids=(0,), mask_token_id=310,
                       head_kind="vanilla", rank=8)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
  if not hasattr(dspark_jax, "save_pretrained"):
    pytest.skip("dspark_jax.save_pretrained is not available")
  root = tmp_path_factory.mktemp("pretrained")
  target = tm.TargetModel(TARGET, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(DRAFT, TARGET, rngs=nnx.Rngs(1))
  target_dir, draft_dir = str(root / "target"), str(root / "draft")
  dspark_jax.save_pretrained(target, target_dir)
  dspark_jax.save_pretrained(draft, draft_dir, target=target)
  write_tokenizer_dir(target_dir, config_eos=None)  # beside the weights, as on the Hub
  return target_dir, draft_dir


@pytest.mark.slow  # builds the pair (first initialisers) and compiles its program: ~15 s on 2 cores
def test_generate_prints_the_completion_and_tau(pair_dirs, capsys):
  target, draft = pair_dirs
  assert cli.main(["generate", "--target", target, "--draft", draft, "--prompt", "Hello world",
                   "--prompt", "def add(x, y):", "--max-new-tokens", "8", "--chat",
                   "--system", "Be brief.", "--chat-kwargs", '{"enable_thinking": false}']) == 0
  out = capsys.readouterr().out
  assert "--- prompt 1 ---" in out and "--- prompt 2 ---" in out
  assert out.count("[finish: ") == 2 and "τ = " in out and "tokens/s" in out
  assert f"acceptance k = 1..{GAMMA}:" in out


@pytest.mark.slow  # compiles the autoregressive program
def test_generate_without_a_drafter(pair_dirs, capsys):
  target, _ = pair_dirs
  assert cli.main(["generate", "--target", target, "--prompt", "The quick brown fox",
                   "--max-new-tokens", "5", "--temperature", "1", "--top-p", "0.9",
                   "--top-k", "50", "--seed", "3", "--stop", "zz"]) == 0
  out = capsys.readouterr().out
  assert "τ = 1 (autoregressive" in out and "[finish: " in out


def test_generate_passes_its_flags_on(config_dirs, monkeypatch, capsys):
  from dspark_jax.text import generation
  target, _ = config_dirs
  seen = {}

  class Batch:
    tau, acceptance, tokens_per_second, compile_seconds = 1.0, (), 12.5, 0.25

  def fake_generate_text(target_model, draft, tokenizer, prompts, params, key, **kwargs):
    seen.update(prompts=prompts, params=params, tokenizer=tokenizer, draft=draft, **kwargs)
    return [generation.TextResult(text=f"out {i}", token_ids=[5, 6], finish_reason="stop_string",
                                  stop="\n", prompt_token_ids=[1], tau=1.0, rounds=0, accepted=0,
                                  batch=Batch) for i in range(len(prompts))]

  monkeypatch.setattr(dspark_jax, "load_pretrained", lambda t, d, dtype=None: ("T", None))
  monkeypatch.setattr(generation, "generate_text", fake_generate_text)
  assert cli.main(["generate", "--target", target, "--prompt", "a", "--prompt", "b", "--chat",
                   "--system", "S", "--temperature", "0.7", "--top-p", "0.5", "--top-k", "9",
                   "--seed", "4", "--max-new-tokens", "3", "--stop", "\\n", "--stop", "é|"]) == 0
  assert seen["prompts"] == [[{"role": "system", "content": "S"}, {"role": "user", "content": p}]
                             for p in "ab"]
  assert seen["stop"] == ["\n", "é|"] and seen["chat"] is True and seen["spec"] is False
  assert seen["max_new_tokens"] == 3 and seen["draft"] is None
  np = pytest.importorskip("numpy")
  np.testing.assert_allclose(seen["params"].temperature, [0.7, 0.7], rtol=1e-6)
  np.testing.assert_allclose(seen["params"].top_p, [0.5, 0.5])
  np.testing.assert_array_equal(seen["params"].top_k, [9, 9])
  np.testing.assert_array_equal(seen["params"].seed, [4, 5])
  assert seen["tokenizer"].stop_token_ids == (2, 0)
  out = capsys.readouterr().out
  assert "out 0\n[finish: stop_string '\\n'; 2 tokens]" in out and "--- prompt 2 ---" in out
  assert "τ = 1 (autoregressive" in out and "12.5 tokens/s" in out


@pytest.mark.slow  # reuses the program of the test above: fast after it, ~10 s alone
def test_eval_reports_tau_acceptance_and_throughput(pair_dirs, tmp_path, capsys):
  target, draft = pair_dirs
  # The shapes of the generate test above (batch 2, chat prompts of at most 64 tokens, greedy,
  # 8 new tokens): its compiled program serves here too.
  assert cli.main(["eval", "--target", target, "--draft", draft, "--dataset", DATASET,
                   "--num-prompts", "2", "--concurrency", "2", "--max-new-tokens", "6",
                   "--temperature", "0", "--chat", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "on " + DATASET + ": 2 prompts, concurrency 2" in out
  assert "T = 0: τ = " in out and "tokens/s" in out and "[95 %: " in out
  result = json.load(open(tmp_path / "acceptance.json"))
  assert result["prompts"] == 2 and result["concurrency"] == 2 and result["chat"] is True
  [row] = result["rows"]
  assert row["temperature"] == 0.0 and len(row["acceptance"]) == GAMMA
  lo, hi = row["tau_interval"]
  assert 1.0 <= row["tau"] <= GAMMA + 1 and lo <= row["tau"] <= hi
  assert 0 < row["tokens"] <= 2 * 6 and row["tokens_per_second"] > 0
  assert row["reached"][0] >= row["accepted"][0] and row["baseline_tokens_per_second"] is None
  assert all(r >= a for r, a in zip(row["reached"], row["accepted"]))
  assert (tmp_path / "acceptance.png").stat().st_size > 1000
  # --out FILE.jsonl: each prompt appended as it finishes; a rerun finds both and decodes nothing.
  results = tmp_path / "run.jsonl"
  args = ["eval", "--target", target, "--draft", draft, "--dataset", DATASET, "--num-prompts", "2",
          "--concurrency", "2", "--max-new-tokens", "6", "--temperature", "0", "--chat",
          "--out", str(results), "--json"]
  assert cli.main(args) == 0
  records = [json.loads(line) for line in open(results)]
  assert sorted(r["prompt"] for r in records) == [0, 1] and (tmp_path / "run.json").exists()
  capsys.readouterr()
  assert cli.main(args) == 0
  again = json.loads(capsys.readouterr().out)
  assert len(open(results).readlines()) == 2 and again["rows"][0]["tokens"] == 0
  assert again["rows"][0]["tau"] == row["tau"]
  # --kv paged: the same prompts through paged caches of a pool of 4 pages decode the same tokens.
  paged = tmp_path / "paged.jsonl"
  assert cli.main([*args[:-2], str(paged), "--json", "--kv", "paged", "--num-pages", "4"]) == 0
  capsys.readouterr()
  assert json.load(open(tmp_path / "paged.json"))["kv"] == "paged"
  by_prompt = lambda lines: {r["prompt"]: r["tokens"] for r in lines}
  assert by_prompt(json.loads(line) for line in open(paged)) == by_prompt(records)


def test_pooling_adds_the_counts_of_batches():
  import numpy as np
  from dspark_jax import decoding
  from dspark_jax.apps import evaluation

  def result(lengths, reached, accepted, row_rounds, row_accepted, wall):
    return decoding.GenerateResult(
        tokens=np.zeros((len(lengths), 1), np.int32), lengths=np.asarray(lengths),
        finished=np.zeros(len(lengths), bool), rounds=1, tau=0.0, acceptance=np.zeros(2),
        path="folded-greedy", wall_seconds=wall, compile_seconds=9.0, reached=np.asarray(reached),
        accepted=np.asarray(accepted), row_rounds=np.asarray(row_rounds),
        row_accepted=np.asarray(row_accepted))

  pooled = evaluation.pool([result([5, 3], [4, 2], [2, 1], [2, 2], [2, 1], 0.5),
                            result([4], [3, 1], [1, 0], [3], [1], 1.5)])
  np.testing.assert_array_equal(pooled.reached, [7, 3])
  np.testing.assert_array_equal(pooled.accepted, [3, 1])
  np.testing.assert_array_equal(pooled.row_rounds, [2, 2, 3])
  assert pooled.tau == 1 + 4 / 7 and pooled.tokens == 12 and pooled.tokens_per_second == 6.0
  np.testing.assert_allclose(pooled.acceptance, [3 / 7, 1 / 3])
  with pytest.raises(ValueError, match="results: nothing to pool"):
    evaluation.pool([])
  assert evaluation.read_eval_dataset(DATASET) == [
      "Hello, how are you today?", "Write a function that adds two numbers.",
      "The quick brown fox jumps over the lazy dog. What does the fox do?",
      "Speculative decoding drafts a block of tokens. Explain it briefly."]
  assert len(evaluation.read_eval_dataset(DATASET, 3)) == 3


def _error(argv, capsys) -> str:
  """The message of the error exit of `argv` (argparse's usage errors go to stderr)."""
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  code = exit_info.value.code
  return code if isinstance(code, str) else capsys.readouterr().err


@pytest.fixture
def config_dirs(tmp_path):
  """A target directory with a Qwen3 config and the tokenizer but no weights, and a draft
  directory: enough for every error that comes before the weights are read."""
  if not hasattr(dspark_jax, "load_pretrained"):
    pytest.skip("dspark_jax.load_pretrained is not available")
  from dspark_jax.formats import qwen3
  target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
  target_dir.mkdir()
  draft_dir.mkdir()
  (target_dir / "config.json").write_text(json.dumps(qwen3.config_to_hf(TARGET)))
  write_tokenizer_dir(target_dir, config_eos=None)
  return str(target_dir), str(draft_dir)


def test_bad_flags_and_files_are_named(config_dirs, tmp_path, capsys):
  target, draft = config_dirs
  assert "argument --target: nowhere is not a directory" in _error(
      ["generate", "--target", "nowhere", "--prompt", "x"], capsys)
  assert "argument --draft: needs --target" in _error(
      ["generate", "--draft", draft, "--prompt", "x"], capsys)
  assert "argument --system: needs --chat" in _error(
      ["generate", "--target", target, "--prompt", "x", "--system", "s"], capsys)
  assert "argument --top-p: must be in (0, 1]" in _error(
      ["generate", "--prompt", "x", "--top-p", "0"], capsys)
  assert "argument --stop: must not be empty" in _error(
      ["generate", "--prompt", "x", "--stop", ""], capsys)
  assert "argument --chat: the shipped tokenizer has no chat template" in _error(
      ["generate", "--prompt", "x", "--chat"], capsys)
  assert "argument --chat-kwargs: needs --chat" in _error(
      ["generate", "--prompt", "x", "--chat-kwargs", "{}"], capsys)
  assert "argument --chat-kwargs: expected a JSON object" in _error(
      ["generate", "--prompt", "x", "--chat-kwargs", "[1]"], capsys)
  assert "argument --draft: required with --target" in _error(
      ["eval", "--target", target, "--dataset", DATASET], capsys)
  assert "argument --dataset: required with --target" in _error(
      ["eval", "--target", target, "--draft", draft], capsys)
  assert "argument --num-pages: needs --kv paged" in _error(["eval", "--num-pages", "8"], capsys)
  assert "argument --kv: the schedule comparison decodes through contiguous" in _error(
      ["eval", "--schedule", "fixed", "--kv", "paged"], capsys)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"turns": ["fine"]}\n\n{"turns": []}\n')
  assert f"argument --dataset: {bad}:3: expected an object whose 'turns'" in _error(
      ["eval", "--target", target, "--draft", draft, "--dataset", str(bad)], capsys)
  bad.write_text('{"turns": ["fine"]}\n{"turns": ["a"]\n')
  assert f"argument --dataset: {bad}:2: not valid JSON" in _error(
      ["eval", "--dataset", str(bad)], capsys)
  assert "argument --dataset: " in _error(["eval", "--dataset", str(tmp_path / "absent")], capsys)
  # A broken draft config is the --draft's fault; a tokenizer without a template, --chat's.
  (tmp_path / "draft" / "config.json").write_text("{broken")
  message = _error(["generate", "--target", target, "--draft", draft, "--prompt", "x"], capsys)
  assert "argument --draft: " in message and "config.json" in message
  os.remove(os.path.join(target, "tokenizer.json"))
  message = _error(["generate", "--target", target, "--prompt", "x"], capsys)
  assert "argument --target: " in message and "tokenizer.json: missing" in message
  plain = tmp_path / "plain_tokenizer"
  write_tokenizer_dir(plain, template=None, config_eos=None)
  message = _error(["generate", "--target", target, "--tokenizer", str(plain), "--prompt", "x",
                    "--chat"], capsys)
  assert "argument --chat: " in message and "has no chat template" in message
