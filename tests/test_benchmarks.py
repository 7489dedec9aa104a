"""Smoke test of the maintained benchmarks (`benchmarks`): each main runs with --small on the CPU,
exits 0 (its checks passed) and prints its summary table last. No timing is asserted."""

import importlib.util
import json

import numpy as np
import pytest

from benchmarks import (bench_attention, bench_compact, bench_decode, bench_hf, bench_load,
                        bench_loop, bench_sampler)

FAST = ["--small", "--backend", "xla", "--repeats", "1"]
HAS_HF = all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def run_and_read_table(module, title, argv, path, capsys) -> tuple[dict, list[str], list[list[str]]]:
  """Runs `module.main`; checks the table printed last under `title`; returns the saved JSON, the
  table's header line and its rows split into cells."""
  assert module.main(argv + ["--json", str(path)]) == 0
  out = capsys.readouterr().out.rstrip("\n").splitlines()
  start = max(i for i, line in enumerate(out) if line.startswith(title))
  header, rule, *rows = out[start + 1:]
  assert set(rule) == {"-"} and len(rule) == len(header)
  assert rows and all(len(row) == len(header) for row in rows)
  text = "\n".join(rows)
  assert "FAILED" not in text and "NO:" not in text and "failed" not in text
  saved = json.loads(path.read_text())
  assert saved["meta"]["git_commit"] and saved["results"]
  return saved, header, [row.split() for row in rows]


@pytest.mark.parametrize("module, title", [
    (bench_sampler, "bench_sampler ("),
    (bench_compact, "bench_compact ("),
])
@pytest.mark.slow
def test_block_benchmark_prints_its_table(module, title, tmp_path, capsys):
  saved, _, _ = run_and_read_table(module, title, FAST, tmp_path / "results.json", capsys)
  assert saved["meta"]["jax_version"]
  assert all(r["ok"] and r["check"]["mode"] == "exact" for r in saved["results"])


@pytest.mark.slow
def test_decode_benchmark_prints_its_table(tmp_path, capsys, monkeypatch):
  """Tiny models, but the round's parts to compile: ~15 s on 2 cores. With --hf, the child
  process's results (`run_hf`, whose table `test_hf_benchmark_prints_its_table` checks) are
  stubbed with bench_hf's document shape. (`bench_e2e` runs in the bench_load test.)"""
  hf_doc = {"results": [{"context": 32, "batch": 2, "static": {"seconds": 0.004,
                                                              "compiled": False}}]}
  monkeypatch.setattr(bench_decode, "run_hf", lambda args: hf_doc)
  every_part = ["--parts", ",".join(bench_decode.PARTS)]   # the packed round only on request
  saved, header, rows = run_and_read_table(bench_decode, "bench_decode (",
                                           FAST + ["--hf"] + every_part,
                                           tmp_path / "results.json", capsys)
  rounds = saved["results"]["rounds"]
  assert list(rounds) == ["32/48/2"]   # context 32 in a cache of 32 + 2(γ + 1) slots
  assert rounds["32/48/2"]["errors"] == {}
  assert set(rounds["32/48/2"]["seconds"]) == set(bench_decode.PARTS)
  assert all(rounds["32/48/2"]["seconds"][name] > 0 for name in ("full round", "packed round"))
  assert set(rounds["32/48/2"]["floors"]) == set(bench_decode.FLOORED)
  assert saved["meta"]["matmul_tflops"] > 0
  assert saved["results"]["e2e"] == {} and saved["results"]["hf"] == hf_doc
  assert header.split()[:3] == ["context", "slots", "B"] and rows[0][:3] == ["32", "48", "2"]
  assert header.rstrip().endswith("HF static ms (× ours)")
  hf_ms, ratio = rows[0][-2:]
  assert hf_ms == "4.000" and ratio.startswith("(") and ratio.endswith("×)")


def test_decode_parts_and_contexts_are_checked():
  args = bench_decode.parse_args(["--small", "--parts", "full round,target verify",
                                  "--contexts", "16,32"])
  assert args.parts == ["target verify", "full round"] and args.contexts == [16, 32]
  assert bench_decode.parse_args([]).parts == list(bench_decode.DEFAULT_PARTS)
  assert "packed round" in bench_decode.PARTS and "packed round" not in bench_decode.DEFAULT_PARTS
  assert bench_decode.parse_args(["--context", "64"]).contexts == [64]
  assert bench_decode.parse_args([]).contexts == [1024, 4096]
  assert bench_decode.parse_args([]).batches == [1, 16, 64, 128]
  assert bench_decode.parse_args([]).e2e_batch == 0
  assert bench_decode.parse_args(["--context", "128", "--capacities", "136,8200"]).capacities == [
      136, 8200]
  for bad in (["--parts", "target verify,draft"], ["--contexts", "0"],
              ["--context", "8", "--contexts", "16"], ["--context", "128", "--capacities", "135"]):
    with pytest.raises(SystemExit):
      bench_decode.parse_args(bad)


def test_floors_take_the_larger_of_bytes_and_compute():
  costs = {"a": (100.0, 10.0), "b": (1.0, 1000.0)}
  out = bench_decode.floors(costs, bandwidth=10.0, rate=10.0)
  assert out["a"]["floor_s"] == 10.0 and out["a"]["bound"] == "bytes"
  assert out["b"]["floor_s"] == 100.0 and out["b"]["bound"] == "compute"


def test_spread_rows_keep_the_mean_and_span_the_ratio():
  # bench_attention --spread: rows of mean L, log-spaced, longest / shortest = R, within T..S.
  lengths = bench_attention.row_lengths(16, 1024, 8.0, 8320)
  assert abs(lengths.mean() - 1024) < 1 and lengths.max() / lengths.min() == pytest.approx(8, 0.01)
  assert (np.diff(lengths) > 0).all()
  assert (bench_attention.row_lengths(4, 1024, 1.0, 8320) == 1024).all()
  assert bench_attention.row_lengths(2, 100, 1000.0, 150, t=8).tolist() == [8, 150]
  with pytest.raises(ValueError, match="--spread: expected at least 1, got 0.5"):
    bench_attention.row_lengths(2, 100, 0.5, 150)


@pytest.mark.slow
def test_hf_benchmark_prints_its_table(tmp_path, capsys):
  """transformers' Qwen3 on the tiny shape, both caches (eager on the CPU): ~10 s."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  saved, _, rows = run_and_read_table(bench_hf, "bench_hf (", ["--small", "--repeats", "1"],
                                      tmp_path / "hf.json", capsys)
  (row,) = saved["results"]
  assert (row["context"], row["batch"]) == (32, 2)
  assert row["static"]["seconds"] > 0 and row["dynamic"]["seconds"] > 0
  assert row["static"]["compiled"] is False
  assert rows[0][:2] == ["32", "2"] and rows[0][3] == "no"


@pytest.mark.slow
def test_load_benchmark_prints_its_table(tmp_path, capsys):
  """save_pretrained -> load_pretrained of the tiny pair, then generate on both pairs (four decode
  loops to compile): ~50 s on 2 cores."""
  saved, _, rows = run_and_read_table(
      bench_load, "bench_load (", FAST + ["--dir", str(tmp_path / "pair")],
      tmp_path / "load.json", capsys)
  meta = saved["meta"]
  assert meta["weights_ok"] and not meta["weights"]["target"]["different"]
  assert meta["weights"]["target"]["equal"] and not meta["weights"]["target"]["rounded"]
  assert meta["weights"]["draft"]["equal"] and not meta["weights"]["draft"]["different"]
  # float32 on the CPU, the same programs: the two pairs decode the same tokens.
  assert all(a["rows_identical"] == a["rows"] == 2 for a in meta["token_agreement"].values())
  assert meta["bytes_written"]["target"] > 0 and meta["bytes_written"]["draft"] > 0
  assert meta["load_cold_s"] > 0 and meta["load_second_s"] > 0
  assert (tmp_path / "pair" / "target" / "config.json").exists()
  assert (tmp_path / "pair" / "draft" / "config.json").exists()
  assert [row[0] for row in rows] == ["in", "loaded"]  # "in memory", split on spaces
  assert rows[1][-2:] == ["2/2", "2/2"]
  assert set(saved["results"]["e2e"]) == {"in memory", "loaded"}


@pytest.mark.slow
def test_loop_benchmark_compares_the_chunks_with_the_table(tmp_path, capsys):
  """One slot, paged: the table's round and the queue's chunks, both traced back to kernel groups
  per round (~20 s on 2 cores). Only the structure is checked: the rounds ran, both traces held
  kernels, the ratio is the two rounds' quotient."""
  saved, _, rows = run_and_read_table(
      bench_loop, "bench_loop (", ["--small", "--repeats", "1", "--rounds-per-call", "4",
                                   "--out", str(tmp_path / "trace")],
      tmp_path / "loop.json", capsys)
  (result,) = saved["results"]
  assert (result["kv"], result["rounds_per_call"]) == ("paged", 4) and result["rounds"] > 0
  assert result["table_round_s"] > 0 and result["queue_round_s"] > 0
  assert result["table_kernel_us"] > 0 and result["queue_kernel_us"] > 0 and result["groups"]
  assert rows[0][:2] == ["paged", "4"]
  assert float(rows[0][4]) == pytest.approx(result["queue_round_s"] / result["table_round_s"],
                                            abs=0.006)


def test_train_benchmark_times_the_step_and_its_target_part(tmp_path, capsys, monkeypatch):
  # --profile: the traced steps reduce to kernel groups whose time is the step's busy time.
  from benchmarks import bench_train
  from dspark_jax.kernels import attention, ragged_attention, shared_attention
  for module, name in ((ragged_attention, "ragged_attention"),   # kernels in the interpreter
                       (shared_attention, "backward_kernels")):
    monkeypatch.setattr(module, name, lambda *a, fn=getattr(module, name), **kw: fn(
        *a, **{**kw, "interpret": True}))
  monkeypatch.setattr(attention, "_platform", lambda: "gpu")
  # --shared-attention: a step per form, side by side (the kernel form in the interpreter).
  saved, header, (row, kernel_row) = run_and_read_table(
      bench_train, "bench_train (", ["--small", "--repeats", "1", "--profile",
                                     str(tmp_path / "profile"), "--trace-repeats", "2",
                                     "--shared-attention", "xla,ragged"],
      tmp_path / "train.json", capsys)
  result = saved["results"]
  assert [run["shared_attention"] for run in result["runs"]] == ["xla", "ragged"]
  assert (row[0], kernel_row[0]) == ("xla", "ragged") and row[7] == "1.000"
  assert result["runs"][1]["profile"] is None and result["runs"][1]["seconds"] > 0
  assert result["error"] is None and result["seconds"] > 0 and result["target_seconds"] > 0
  profile = result["profile"]
  assert profile["calls"] >= 1 and profile["groups"]
  assert sum(g["us"] for g in profile["groups"]) == pytest.approx(profile["kernel_us"], rel=1e-6)
  assert (tmp_path / "profile" / "module.hlo.txt.gz").exists()
  assert result["target_share"] == pytest.approx(result["target_seconds"] / result["seconds"])
  assert result["model_flops"]["total"] == pytest.approx(
      result["model_flops"]["target"] + result["model_flops"]["draft"])
  assert "target s" in header and "share" in header
  assert float(row[6]) == pytest.approx(result["seconds"], rel=1e-3, abs=1e-4)   # s/step


def test_train_benchmark_scales_over_data_parallel_devices(tmp_path, capsys):
  # --dp 1,2: the trainer's step over 1 and 2 devices (tests/conftest.py forces 8 CPU devices),
  # --batch rows on each; per-device rates and the scaling against the first row.
  import jax

  from benchmarks import bench_train
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  saved, header, (one, two) = run_and_read_table(
      bench_train, "bench_train (", ["--small", "--repeats", "1", "--warmup", "1", "--dp", "1,2"],
      tmp_path / "train_dp.json", capsys)
  runs = saved["results"]["runs"]
  assert [run["dp"] for run in runs] == [1, 2] and (one[1], two[1]) == ("1", "2")
  assert all(run["error"] is None for run in runs)
  for run in runs:
    assert run["sequence_tokens_per_s"] == pytest.approx(
        run["dp"] * run["per_device_tokens_per_s"])
  assert runs[1]["scaling"] == pytest.approx(runs[1]["vs_first"] / 2)
  assert float(two[9]) > 0 and "scaling" in header                       # seq tok/s
