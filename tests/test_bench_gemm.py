"""The projection GEMM benchmark (`benchmarks.bench_gemm`) on the CPU: --small runs, its xla rows
are exact and floored, the child-process candidates come back (or are skipped where XLA rejects
their flag), the fastest ignores inexact rows, and the Hopper kernel's programs lower for CUDA."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_gemm as bg

FAST = ["--small", "--repeats", "1", "--rows", "1"]


def read_table(out: str, title: str) -> tuple[str, list[str]]:
  lines = out.rstrip("\n").splitlines()
  start = max(i for i, line in enumerate(lines) if line.startswith(title))
  header, rule, *rows = lines[start + 1:]
  assert set(rule) == {"-"} and rows
  return header, rows


def test_small_run_reports_exact_xla_rows(tmp_path, capsys):
  path = tmp_path / "gemm.json"
  assert bg.main(FAST + ["--json", str(path)]) == 0
  out = capsys.readouterr().out
  header, rows = read_table(out, "bench_gemm (")
  assert header.split()[:4] == ["proj", "M", "floor", "µs"]
  assert [row.split()[0] for row in rows] == list(bg.PROJECTIONS)
  assert "needs a GPU" in out and "needs Hopper" in out
  saved = json.loads(path.read_text())
  meta, results = saved["meta"], saved["results"]
  assert meta["matmul_tflops"] > 0 and meta["copy_bandwidth_gbs"] > 0 and meta["git_commit"]
  assert set(meta["skipped"]) == {"xla_cublas", "xla_no_fusion_autotune", "mgpu"}
  assert len(results["rows"]) == len(bg.PROJECTIONS)
  for row in results["rows"]:
    assert row["candidate"] == "xla" and row["exact"] and row["rel_err"] < 1e-2
    assert row["us_per_layer"] > 0 and row["floor_us"] > 0 and row["bound"] in ("bytes", "compute")
    assert row["layers"] == (1 if row["projection"] == "lm_head" else 3)
  assert all(f["candidate"] == "xla" and f["vs_xla"] == 1.0 for f in results["fastest"])
  (total,) = results["totals"]
  assert total["M"] == 1 and total["xla_us"] == total["fastest_us"] > total["floor_us"] > 0


def test_child_processes_return_rows_or_a_rejected_flag(tmp_path, capsys, monkeypatch):
  """Two children on the CPU (--children-anywhere): one with a flag XLA takes, whose rows come
  back under its name; one with a flag XLA does not know, skipped with the reason."""
  monkeypatch.setitem(bg.CHILD_FLAGS, "xla_no_fusion_autotune", "--xla_gpu_no_such_flag=false")
  path = tmp_path / "gemm.json"
  assert bg.main(FAST + ["--projections", "o", "--children-anywhere", "--candidates",
                         "xla,xla_cublas,xla_no_fusion_autotune", "--json", str(path)]) == 0
  saved = json.loads(path.read_text())
  rows = {r["candidate"]: r for r in saved["results"]["rows"]}
  assert set(rows) == {"xla", "xla_cublas"}
  assert rows["xla_cublas"]["exact"] and rows["xla_cublas"]["us_per_layer"] > 0
  assert rows["xla_cublas"]["flags"] == bg.CHILD_FLAGS["xla_cublas"]
  assert rows["xla_cublas"]["rel_err"] == rows["xla"]["rel_err"]  # same weights, same product
  assert "rejects --xla_gpu_no_such_flag" in saved["meta"]["skipped"]["xla_no_fusion_autotune"]
  header, (row,) = read_table(capsys.readouterr().out, "bench_gemm (")
  assert header.split()[4:7] == ["bound", "xla", "cublas"] and row.split()[:2] == ["o", "1"]


def test_floors_and_the_fastest_exact_candidate():
  row = lambda name, us, exact: {"projection": "o", "K": 4, "N": 8, "M": 2, "candidate": name,
                                 "us_per_layer": us, "exact": exact, "config": None}
  rows = [row("xla", 10.0, True), row("mgpu", 5.0, False), row("xla_cublas", 8.0, True),
          row("xla_no_fusion_autotune", None, None)]
  bg.add_floors(rows, bandwidth=64e6, rate=64e6)  # bytes 64 / 64e6 = 1 µs; FLOPs 128 -> 2 µs
  assert rows[0]["floor_us"] == pytest.approx(2.0) and rows[0]["bound"] == "compute"
  assert rows[0]["x_floor"] == pytest.approx(5.0) and rows[3]["x_floor"] is None
  best = bg.fastest(rows)["o", 2]
  assert best["candidate"] == "xla_cublas" and best["vs_xla"] == pytest.approx(0.8)


def test_mgpu_configs_fit_the_shapes():
  hm, why = bg.mgpu_module()
  if hm is None:
    pytest.skip(why)
  for rows in (1, 128):
    configs = bg.mgpu_configs(hm, None, rows)
    assert {c.tile_m for c in configs} == ({64} if rows == 1 else {64, 128})
    for k, n in bg.PROJECTIONS.values():
      assert any(c.unfit(k, n) is None for c in configs)
  wide = bg.MgpuConfig(64, 128, 64, 2)  # two warpgroups of 128 columns: 151936 = 256·593.5
  assert "multiple" in wide.unfit(*bg.PROJECTIONS["lm_head"])
  assert "shared memory" in bg.MgpuConfig(64, 256, 64, 6).unfit(2560, 6144)


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_mgpu_program_lowers_for_cuda(loop, monkeypatch):
  """The Hopper kernel inside the layer loop, lowered for CUDA on the CPU (no GPU runs it): the
  config's call signature, the padded rows and the loop trace; one kernel lowering per program."""
  hm, why = bg.mgpu_module()
  if hm is None or not hasattr(hm, "get_num_sms"):
    pytest.skip(why or "this jax's kernel reads the device's SM count inline")
  monkeypatch.setattr(hm, "get_num_sms", lambda: 132)
  config = bg.mgpu_configs(hm, [(64, 128, 64, 4)], 16)[0]
  k, n = bg.PROJECTIONS["qkv"]
  x = bg.pad_rows(jnp.zeros((16, k), jnp.bfloat16), config.block_m)
  assert x.shape == (config.block_m, k)
  weight = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  weights = (jax.ShapeDtypeStruct((4, k, n), jnp.bfloat16) if loop == "scan" else (weight,) * 4)
  run = bg.layered(bg.mgpu_matmul(hm, config), loop)
  text = run.trace(jax.ShapeDtypeStruct(x.shape, x.dtype), weights).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1 and len(text) < 500_000
