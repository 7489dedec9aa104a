"""The schedule study: ``eval --schedule`` and ``calibrate`` flags and their errors, replay and the
threshold sweep against the schedules themselves, calibration files, figures, and the study end
to end on the shipped pair (few prompts, few tokens)."""

import json
import math

import numpy as np
import pytest

from dspark_jax import decoding
from dspark_jax.apps import calibration_study as cs
from dspark_jax.apps import cli
from dspark_jax.apps import evaluation
from dspark_jax.apps import schedule_study as ss
from dspark_jax.apps import study_figures
from dspark_jax.apps.schedule_specs import ScheduleSpec, parse_schedules
from dspark_jax.scheduling import calibration
from dspark_jax.scheduling import schedules


def _error(argv, capsys) -> str:
  """The message of the error exit of `argv` (argparse's usage errors go to stderr)."""
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  code = exit_info.value.code
  return code if isinstance(code, str) else capsys.readouterr().err


def synthetic_traces(seed=0, rounds=30, batch=4, gamma=3, traces=2):
  """Fixed-schedule traces: survival-shaped confidences, runs drawn from them, some rows
  inactive late."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(traces):
    confidence = rng.uniform(0.05, 0.95, (rounds, batch, gamma)).astype(np.float32)
    accept = (rng.uniform(size=(rounds, batch, gamma)) < confidence).cumprod(axis=2).sum(axis=2)
    active = np.ones((rounds, batch), bool)
    active[rounds // 2:, 0] = False
    out.append(decoding.RoundTrace(confidence=confidence,
                                   verify_lens=np.where(active, gamma + 1, 0).astype(np.int32),
                                   accept_len=np.where(active, accept, 0).astype(np.int32),
                                   active=active))
  return out


# ---- names -----------------------------------------------------------------------------------------


def test_parse_schedules_reads_names_and_values():
  specs = parse_schedules("fixed, threshold:0.5,prefix,top_k,top_k:0")
  assert [s.label for s in specs] == ["fixed", "threshold:0.5", "prefix", "top_k:2", "top_k:0"]
  assert [s.needs_sps for s in specs] == [False, False, True, True, True]
  assert [s.lossless for s in specs] == [True, True, True, True, False]
  assert specs[0].build() is None
  table = np.full(33, 5.0)
  assert specs[2].build(table) is specs[2].build(table.copy())  # one schedule, one program
  assert specs[2].build(table) is not specs[2].build(np.full(33, 6.0))
  with pytest.raises(ValueError, match="^sps: prefix needs a throughput table"):
    specs[2].build()
  # The study functions check their arguments before decoding anything.
  with pytest.raises(ValueError, match="^sps: prefix, top_k:2 need a throughput table"):
    ss.compare_schedules(None, None, [[1]], specs[1:4])
  with pytest.raises(ValueError, match="^batch_sizes: entry 0 must be an integer >= 1"):
    ss.throughput_sweep(None, None, [[1]], specs[:1], [1, 0])
  with pytest.raises(ValueError, match="^prompts: empty"):
    ss.throughput_sweep(None, None, [], specs[:1], [1])


@pytest.mark.parametrize("text, match", [
    ("threshold:abc", "'threshold:abc': the threshold must be a number in \\[0, 1\\]"),
    ("threshold", "'threshold': the threshold must be a number"),
    ("threshold:1.5", "the threshold must be in \\[0, 1\\], got 1.5"),
    ("top_k:-1", "'top_k:-1': the lag must be an integer >= 0, got -1"),
    ("top_k:1.5", "'top_k:1.5': the lag must be an integer >= 0"),
    ("fixed:3", "'fixed:3': fixed takes no value"),
    ("fixed,,prefix", "empty schedule"),
    ("topk", "unknown schedule 'topk'"),
    ("prefix,prefix", "prefix is given twice"),
])
def test_parse_schedules_names_the_bad_entry(text, match):
  with pytest.raises(ValueError, match=match):
    parse_schedules(text)


def test_flags_are_named_before_any_model_loads(tmp_path, capsys):
  for value, message in [("threshold:abc", "the threshold must be a number"),
                         ("top_k:-1", "the lag must be an integer >= 0, got -1"),
                         ("fixed,bogus", "unknown schedule 'bogus'")]:
    assert "argument --schedule: " in (err := _error(["eval", "--schedule", value], capsys))
    assert message in err
  missing = str(tmp_path / "absent.json")
  assert f"argument --sps: {missing}: no such file" in _error(
      ["eval", "--schedule", "fixed,prefix", "--sps", missing], capsys)
  assert "argument --sps: no schedule in --schedule reads a table" in _error(
      ["eval", "--schedule", "threshold:0.5", "--sps", missing], capsys)
  bad = tmp_path / "bad_sps.json"
  bad.write_text('{"batch_tokens": [8, 4], "steps_per_second": [1, 2]}')
  assert "argument --sps: " in (err := _error(["eval", "--schedule", "top_k", "--sps", str(bad)],
                                              capsys))
  assert "must be strictly increasing" in err
  for flag, value in [("--sps", missing), ("--calibration", missing),
                      ("--throughput-concurrency", "1,2")]:
    assert f"argument {flag}: needs --schedule" in _error(["eval", flag, value], capsys)
  assert "argument --calibration: " in _error(
      ["eval", "--schedule", "fixed", "--calibration", missing], capsys)
  bad.write_text('{"temperatures": [1.0, -2]}')
  assert "temperatures[1] is -2; must be a finite number > 0" in _error(
      ["eval", "--schedule", "fixed", "--calibration", str(bad)], capsys)
  assert "--throughput-batches: batch sizes must be >= 1, got 0" in _error(
      ["eval", "--schedule", "fixed", "--throughput-batches", "1,0"], capsys)
  assert "argument --save-draft: needs --target and --draft" in _error(
      ["calibrate", "--out", str(tmp_path / "t.json"), "--save-draft", str(tmp_path)], capsys)
  assert "argument --out: " in _error(["calibrate", "--out", str(tmp_path / "no" / "t.json")],
                                      capsys)
  assert "the following arguments are required: --out" in _error(["calibrate"], capsys)


# ---- replay and the threshold sweep ------------------------------------------------------------------


def test_replay_of_fixed_is_the_trace():
  traces = synthetic_traces()
  row = ss.replay(traces, ScheduleSpec("fixed"))
  confidence, accept = cs.full_rounds(traces)
  assert row.rounds == accept.size == sum(int(t.active.sum()) for t in traces)
  assert row.tau == pytest.approx(1 + accept.mean(), rel=1e-12)
  assert row.verify_tokens == 4.0 and row.source == "replay" and math.isnan(row.tokens_per_second)
  assert row.acceptance_rate == pytest.approx(accept.mean() / 3, rel=1e-12)
  for k in range(3):  # conditional acceptance from the runs
    assert row.reached[k] == np.sum(accept >= k) and row.accepted[k] == np.sum(accept >= k + 1)


def test_threshold_sweep_is_the_threshold_schedule_replayed():
  traces = synthetic_traces(seed=1)
  thresholds = [0.0, 0.3, 0.5, 0.8, 1.0]
  sweep = ss.threshold_sweep(traces, thresholds)
  for i, t in enumerate(thresholds):
    row = ss.replay(traces, ScheduleSpec("threshold", t))
    assert sweep.tau[i] == pytest.approx(row.tau, rel=1e-12)
    assert sweep.verify_tokens[i] == pytest.approx(row.verify_tokens, rel=1e-12)
    if math.isnan(row.acceptance_rate):
      assert math.isnan(sweep.acceptance_rate[i])
    else:
      assert sweep.acceptance_rate[i] == pytest.approx(row.acceptance_rate, rel=1e-12)
  assert sweep.verify_tokens[0] == 4.0 and sweep.verify_tokens[-1] == 1.0  # c < 1 everywhere
  assert np.all(np.diff(sweep.verify_tokens) <= 0) and np.all(np.diff(sweep.tau) <= 0)
  # By hand, one round: c = (0.9, 0.4, 0.8), A = 2; t = 0.5 verifies 1 draft and accepts it.
  one = decoding.RoundTrace(confidence=np.array([[[0.9, 0.4, 0.8]]], np.float32),
                            verify_lens=np.array([[4]], np.int32),
                            accept_len=np.array([[2]], np.int32), active=np.array([[True]]))
  by_hand = ss.threshold_sweep([one], [0.5])
  assert (by_hand.tau[0], by_hand.verify_tokens[0], by_hand.acceptance_rate[0]) == (2.0, 2.0, 1.0)
  # Temperatures are applied before the comparison: T = 10 pulls every confidence towards 0.5.
  hot = ss.threshold_sweep([one], [0.5], temperatures=[10.0, 10.0, 10.0])
  assert hot.verify_tokens[0] == 2.0  # σ(logit(0.9)/10) > 0.5 > σ(logit(0.4)/10)


def test_replay_of_prefix_follows_the_table():
  traces = synthetic_traces(seed=2)
  flat = np.full(4 * 4 + 1, 7.0)  # every admission raises τ·sps: all drafts verified
  fixed = ss.replay(traces, ScheduleSpec("fixed"))
  row = ss.replay(traces, ScheduleSpec("prefix"), sps=flat)
  assert (row.tau, row.verify_tokens) == (fixed.tau, fixed.verify_tokens)
  steep = 100.0 / np.arange(1, 18) ** 2  # each extra token costs more than it can bring
  steep = np.concatenate([[0.0], steep])
  row = ss.replay(traces, ScheduleSpec("prefix"), sps=steep)
  assert row.verify_tokens == 1.0 and row.tau == 1.0
  lagged = ss.replay(traces, ScheduleSpec("top_k", 2), sps=flat)
  assert lagged.verify_tokens == fixed.verify_tokens  # the budget covers every candidate
  with pytest.raises(ValueError, match="^sps: top_k:2 need a throughput table"):
    ss.replay(traces, ScheduleSpec("top_k", 2))


def test_full_rounds_and_ratio_interval():
  traces = synthetic_traces(seed=3, traces=1)
  traces[0] = traces[0].replace(verify_lens=np.where(traces[0].active, 2, 0).astype(np.int32))
  with pytest.raises(ValueError, match="no active round verified every position"):
    cs.full_rounds(traces)
  nan = synthetic_traces(seed=3, traces=1)[0]
  nan = nan.replace(confidence=np.full_like(nan.confidence, np.nan))
  with pytest.raises(ValueError, match="NaN confidences"):
    cs.full_rounds([nan])
  lo, hi = evaluation.ratio_interval([2, 4, 3], [4, 4, 4])
  assert lo < 0.75 < hi
  assert evaluation.ratio_interval([1], [2]) == (0.5, 0.5)
  assert all(math.isnan(x) for x in evaluation.ratio_interval([1], [0]))
  assert evaluation.tau_interval([2, 4, 3], [4, 4, 4]) == pytest.approx((1 + lo, 1 + hi))


# ---- calibration files and figures -------------------------------------------------------------------


def test_calibration_file_round_trip(tmp_path):
  confidence, accept = cs.full_rounds(synthetic_traces(seed=4))
  result = cs.fit_calibration(confidence, accept, bins=10)
  np.testing.assert_array_equal(result.temperatures, calibration.fit_sts(confidence, accept, bins=10))
  np.testing.assert_array_equal(result.ece_after,
                                calibration.ece(confidence, accept, result.temperatures, bins=10))
  path = cs.save_calibration(tmp_path / "t.json", result, {"pair": "synthetic"})
  np.testing.assert_array_equal(cs.load_temperatures(path), result.temperatures)
  assert json.load(open(path))["pair"] == "synthetic"
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="bad.json: not valid JSON"):
    cs.load_temperatures(tmp_path / "bad.json")
  (tmp_path / "bad.json").write_text('{"temps": [1]}')
  with pytest.raises(ValueError, match="non-empty 'temperatures' list"):
    cs.load_temperatures(tmp_path / "bad.json")


def _row(schedule, batch, tps, tau=2.0, verify=4.0):
  return ss._row(schedule, "decode", 0.0, batch, row_accepted=[int((tau - 1) * 10)],
                 row_rounds=[10], row_verified=[int(verify * 10)], reached=[10, 5, 2],
                 accepted=[5, 2, 1], tokens=100, tokens_per_second=tps)


def test_figures_are_written_without_touching_the_backend(tmp_path):
  import matplotlib

  backend = matplotlib.get_backend()
  traces = synthetic_traces(seed=5)
  confidence, accept = cs.full_rounds(traces)
  result = cs.fit_calibration(confidence, accept, traces=traces)
  sweeps = {"raw": ss.threshold_sweep(traces),
            "STS": ss.threshold_sweep(traces, temperatures=result.temperatures)}
  rows = [_row(s, b, 10.0 * b) for s in ("fixed", "prefix") for b in (1, 2, 4)]
  paths = [study_figures.plot_reliability(result, tmp_path / "rel.png"),
           study_figures.plot_threshold_sweep(sweeps, tmp_path / "sweep.png"),
           study_figures.plot_throughput(rows, tmp_path / "tps.png", sps=np.linspace(20, 5, 40))]
  assert paths == [str(tmp_path / n) for n in ("rel.png", "sweep.png", "tps.png")]
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert matplotlib.get_backend() == backend
  # The verify-bound model: B·τ·sps[B·verify tokens], NaN past the table.
  sps = np.arange(40, dtype=float)
  assert ss.verify_bound_tokens_per_second(_row("x", 4, 1.0, tau=2.0, verify=2.5), sps) == 4 * 2 * 10
  assert math.isnan(ss.verify_bound_tokens_per_second(_row("x", 16, 1.0), sps))
  table = ss.format_schedule_table([_row("fixed", 2, 12.0)])
  assert "| fixed | 0 | 2 | 2.00 " in table and "| 0.50 | 0.40 | 0.50 | 12 |" in table


# ---- end to end on the shipped pair --------------------------------------------------------------------

CALIBRATE = ["--prompts", "3", "--max-new-tokens", "16", "--temperatures", "0", "--concurrency", "4"]


@pytest.mark.slow  # one decode program (~8 s to compile on 2 cores)
def test_calibrate_writes_the_sts_fit_of_its_trace(tmp_path, capsys):
  from dspark_jax.formats import shipped

  out = tmp_path / "cal.json"
  assert cli.main(["calibrate", *CALIBRATE, "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "3 calibration prompts from 42" in printed and "| k | T_k | ECE before |" in printed
  document = json.load(open(out))
  pair = shipped.load_shipped()
  ids = [pair.encode(t) for t in pair.prompts[42:45]]
  # The command fits the raw head: the shipped draft's own temperatures are set aside.
  assert "own temperatures were set aside" in printed
  raw = cs.with_temperatures(pair.draft, None)
  traces = cs.trace_rounds(pair.target, raw, ids, temperatures=[0.0], concurrency=4,
                           max_new_tokens=16, stop_token_ids=pair.tokenizer.stop_token_ids)
  confidence, accept = cs.full_rounds(traces)
  assert document["rounds"] == accept.size
  np.testing.assert_array_equal(document["temperatures"], calibration.fit_sts(confidence, accept))
  np.testing.assert_allclose(document["ece_before"], calibration.ece(confidence, accept),
                             rtol=1e-12)
  assert document["ece_after"][0] <= document["ece_before"][0]  # T = 1 is on the grid
  with open(tmp_path / "cal_reliability.png", "rb") as f:
    assert f.read(4) == b"\x89PNG"
  # The threshold sweep at t = 0 is the fixed schedule.
  sweep = ss.threshold_sweep(traces, [0.0, 0.5])
  assert sweep.tau[0] == pytest.approx(1 + accept.mean()) and sweep.verify_tokens[0] == 8.0


@pytest.mark.slow  # two decode programs (fixed, prefix)
def test_eval_schedule_reports_each_schedule(tmp_path, capsys):
  table = tmp_path / "sps.json"
  schedules.save_sps(table, ([1, 64], [30.0, 30.0]), {"device": "test", "date": "2026-12-02"})
  assert cli.main(["eval", "--schedule", "fixed,prefix", "--sps", str(table), "--prompts", "3",
                   "--max-new-tokens", "16", "--temperatures", "0", "--batch-size", "4",
                   "--out", str(tmp_path / "ev"), "--json"]) == 0
  document = json.loads(capsys.readouterr().out)
  assert json.load(open(tmp_path / "ev" / "schedules.json")) == document
  assert document["sps"]["source"] == str(table) and document["sps"]["device"] == "test"
  assert not any("static [B, γ + 1] shape" in note for note in document["notes"])  # packed now
  fixed, prefix = document["rows"]
  assert (fixed["schedule"], prefix["schedule"]) == ("fixed", "prefix")
  assert fixed["verify_tokens"] == 8.0
  assert fixed["acceptance_rate"] == pytest.approx((fixed["tau"] - 1) / 7)
  assert fixed["tau_interval"][0] <= fixed["tau"] <= fixed["tau_interval"][1]
  assert len(fixed["acceptance"]) == 7 and fixed["tokens_per_second"] > 0
  # A flat table: every admission raises τ·sps, so prefix verifies every draft and decodes the
  # same greedy rounds as fixed.
  assert prefix["verify_tokens"] == 8.0 and prefix["tau"] == fixed["tau"]
  assert prefix["reached"] == fixed["reached"] and prefix["accepted"] == fixed["accepted"]


@pytest.mark.slow  # builds a small random pair (its initialisers compile: ~6 s)
def test_calibrated_draft_saves_its_temperatures(tmp_path):
  from flax import nnx

  import dspark_jax
  from dspark_jax.models import draft as dm
  from dspark_jax.models import layers
  from dspark_jax.models import target as tm

  target_config = tm.TargetConfig(vocab_size=64, num_layers=2, feature_layers=(0,),
                                  layer=layers.LayerShape(hidden_size=16, num_heads=2,
                                                          num_kv_heads=1, head_dim=8,
                                                          intermediate_size=32))
  config = dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(0,), mask_token_id=63,
                          head_kind="vanilla", rank=4)
  target = tm.TargetModel(target_config, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(config, target_config, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"^temperatures: expected 3 values"):
    cs.with_temperatures(draft, [1.0, 2.0])
  with pytest.raises(ValueError, match="entry 1 is 0.0; must be finite, > 0"):
    cs.with_temperatures(draft, [1.0, 0.0, 2.0])
  calibrated = cs.with_temperatures(draft, [0.5, 2.0, 4.0])
  assert draft.confidence.temperatures is None
  dspark_jax.save_pretrained(calibrated, str(tmp_path / "draft"), target=target)
  assert json.load(open(tmp_path / "draft" / "config.json"))["confidence_temperatures"] == [
      0.5, 2.0, 4.0]
  assert cs.with_temperatures(calibrated, None).confidence.temperatures is None
  bare = dm.DSparkDraft(dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(0,),
                                       mask_token_id=63, head_kind="vanilla", rank=4,
                                       confidence=False), target_config, rngs=nnx.Rngs(2))
  with pytest.raises(ValueError, match="^draft: has no confidence head"):
    cs.with_temperatures(bare, [1.0, 1.0, 1.0])
