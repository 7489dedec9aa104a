"""The studies on the queue: the queue's round trace (what `calibrate` fits on) against a fixed
batch's, the serving figure from a `bench_serving` document, and the benchmark's length law. Tiny
f32 models on the CPU."""

import json

import jax
import matplotlib
import numpy as np
import pytest

import dspark_jax as dj
from benchmarks import bench_serving
from dspark_jax.apps import calibration_study as cs
from dspark_jax.apps import study_figures
from tests.test_decoding import make_draft, make_target

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3], [2, 2, 2, 2, 2, 2, 2], [7, 1]]
STOP = 4


def test_queue_trace_holds_each_prompts_rounds():
  # 6 greedy prompts (budget 8, stop token 4, so rows finish at different rounds) through 2 slots
  # refilled two at a time, with trace=True (what `calibrate` fits on): the trace's active rounds
  # are exactly the prompts' rounds (their count, their accepted runs and the per-position counts
  # rebuilt from those runs equal the run's counts, which equal a fixed batch's: test_queue.py);
  # idle slots are inactive and verify nothing.
  target = make_target()
  draft = make_draft(target, 3, "vanilla")
  params = dj.SamplingParams(temperature=np.zeros(6), seed=np.arange(6))
  engine = dj.Engine(target, draft, max_batch_size=2, refill_at=2, trace=True)
  result = engine.generate(PROMPTS, params, jax.random.key(0), max_new_tokens=8,
                           stop_token_ids=[STOP])
  trace = result.trace
  active = trace.active
  assert active.shape == (result.rounds, 2) and trace.confidence.shape == active.shape + (3,)
  assert active.sum() == result.row_rounds.sum() and not active.all()
  assert (trace.verify_lens[active] == 4).all() and (trace.verify_lens[~active] == 0).all()
  runs = trace.accept_len[active]
  assert runs.sum() == result.row_accepted.sum()
  k = np.arange(3)
  np.testing.assert_array_equal((runs[:, None] >= k).sum(0), result.reached)
  np.testing.assert_array_equal((runs[:, None] >= k + 1).sum(0), result.accepted)
  assert np.isfinite(trace.confidence[active]).all()
  with pytest.raises(ValueError, match="^batch_size: a deprecated alias of concurrency"):
    cs.trace_rounds(target, draft, PROMPTS, concurrency=2, batch_size=2)
  with pytest.raises(ValueError, match="^trace: only speculative decoding"):
    dj.Engine(target, None, max_batch_size=2, spec=False, trace=True)
  with pytest.warns(DeprecationWarning, match="batch_size is deprecated"):
    assert cs.concurrency_of(None, 3) == 3
  with pytest.raises(ValueError, match="^concurrency: must be an integer >= 1, got 0"):
    cs.concurrency_of(0, None)
  # A stateful schedule keys its draft noise by the round counter the trace reuses: refused.
  stateful = dj.schedules.top_k(np.full(40, 10.0), lag=2)
  with pytest.raises(ValueError, match="^trace: the queue traces only stateless schedules"):
    dj.Engine(target, draft, max_batch_size=2, schedule=stateful, trace=True)


def _document():
  points = [{"concurrency": c, "schedule": name, "per_user_tokens_per_s": 100.0 / c ** 0.3,
             "tokens_per_s": 90.0 * c ** 0.8 * (1.1 if name == "top_k" else 1.0)}
            for name in ("fixed", "top_k") for c in (1, 4, 16)]
  return {"meta": {"device_kind": "test"}, "results": {"pair": "tiny", "throughput": points}}


def test_serving_figure_from_the_benchmark_document(tmp_path):
  backend = matplotlib.get_backend()
  document = _document()
  curves = study_figures.serving_points(document)
  assert list(curves) == ["fixed", "top_k"] and [c for c, _, _ in curves["fixed"]] == [1, 4, 16]
  path = tmp_path / "serving.json"
  path.write_text(json.dumps(document))
  png = study_figures.plot_serving(str(path), tmp_path / "serving.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert matplotlib.get_backend() == backend
  with pytest.raises(ValueError, match="^document: no results.throughput points"):
    study_figures.serving_points({"results": {"occupancy": {}}})
  bad = _document()
  del bad["results"]["throughput"][1]["tokens_per_s"]
  with pytest.raises(ValueError, match=r"^document: results.throughput\[1\] lacks"):
    study_figures.serving_points(bad)


def test_output_lengths_follow_the_stated_law():
  # N = 20,000 draws of the log-uniform law on 16..1024: every draw in range, the same draws for
  # the same seed, and log(length) spread evenly: each quarter of [log 16, log 1025) holds
  # 25 % ± 1.5 % of them (binomial sd 0.3 %); a uniform law on 16..1024 puts ~3 % in the first
  # quarter (power).
  lengths = bench_serving.output_lengths(20_000, 16, 1024, seed=0)
  np.testing.assert_array_equal(lengths, bench_serving.output_lengths(20_000, 16, 1024, seed=0))
  assert lengths.min() >= 16 and lengths.max() <= 1024 and lengths.dtype == np.int32
  edges = np.exp(np.linspace(np.log(16), np.log(1025), 5))
  shares = np.histogram(lengths, edges)[0] / lengths.size
  assert np.all(np.abs(shares - 0.25) < 0.015), shares
  uniform = np.random.default_rng(0).integers(16, 1025, 20_000)
  assert np.histogram(uniform, edges)[0][0] / uniform.size < 0.1


def test_the_cost_model_counts_busy_rows_their_verify_tokens_and_tau():
  # 16 slots at occupancy 0.5: 8 busy rows verifying 3 tokens each = 24 tokens, halfway between
  # the buckets of 16 (100 rounds/s) and 32 (50/s): 75 rounds/s; τ 2.5: 8 · 2.5 · 75 = 1500 tokens/s
  # while rounds run, so 3000 tokens take 2 s of rounds; with 0.5 s of measured refills, 3000 / 2.5
  # = 1200 tokens/s, and with 0.5 s of host work besides, 1000. At a bucket's own size its rate
  # (4 tokens a row: 32, 50/s), below the smallest the smallest's. No table (plain decoding): None.
  table = ([16, 32], [100.0, 50.0])
  run = {"occupancy": 0.5, "verify_tokens": 3.0, "tau": 2.5, "tokens": 3000}
  assert bench_serving.model_tokens_per_s(run, 16, table) == pytest.approx(1500.0)
  assert bench_serving.model_tokens_per_s(dict(run, refill_s=0.5), 16, table) == pytest.approx(1200.0)
  assert bench_serving.model_tokens_per_s(dict(run, refill_s=0.5, host_s=0.5), 16,
                                          table) == pytest.approx(1000.0)
  assert bench_serving.model_tokens_per_s(dict(run, verify_tokens=4.0), 16,
                                          table) == pytest.approx(8 * 2.5 * 50)
  assert bench_serving.model_tokens_per_s(dict(run, verify_tokens=1.0), 16,
                                          table) == pytest.approx(8 * 2.5 * 100)
  assert bench_serving.model_tokens_per_s(run, 16, None) is None
  assert bench_serving.table_rate(run, 16, table) == pytest.approx(75.0)   # the round it models
  assert bench_serving.table_rate(run, 16, None) is None
  # The table's context: a busy row's mean prompt + made tokens in the steady state, E[L²]/(2E[L])
  # (equal rows: halfway; rows of 100 and 300 tokens: a slot holds the long one 3/4 of the time,
  # 125 in on average).
  assert bench_serving.steady_context([10, 30], [8, 8]) == 24
  assert bench_serving.steady_context([100], [100, 300]) == 100 + round(50_000 / 400)
  assert bench_serving.parse_args(["--small"]).schedules == ["plain", "fixed", "top_k"]
  assert bench_serving.parse_args(["--prompt-lengths", "128,1024"]).prompt_lengths == [128, 1024]
  with pytest.raises(SystemExit):
    bench_serving.parse_args(["--prompt-lengths", "9,3"])

