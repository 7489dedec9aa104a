"""Smoke test of the maintained benchmarks (`benchmarks`): each main runs with --small on the CPU,
exits 0 (its checks passed) and prints its summary table last. No timing is asserted."""

import json

import pytest

from benchmarks import bench_compact, bench_decode, bench_sampler

FAST = ["--small", "--backend", "xla", "--repeats", "1"]


def run_and_read_table(module, title, argv, path, capsys) -> dict:
  """Runs `module.main`; checks the table printed last under `title`; returns the saved JSON."""
  assert module.main(argv + ["--json", str(path)]) == 0
  out = capsys.readouterr().out.rstrip("\n").splitlines()
  start = max(i for i, line in enumerate(out) if line.startswith(title))
  header, rule, *rows = out[start + 1:]
  assert set(rule) == {"-"} and len(rule) == len(header)
  assert rows and all(len(row) == len(header) for row in rows)
  assert "FAILED" not in "\n".join(rows) and "NO:" not in "\n".join(rows)
  saved = json.loads(path.read_text())
  assert saved["meta"]["jax_version"] and saved["meta"]["git_commit"] and saved["results"]
  return saved


@pytest.mark.parametrize("module, title", [
    (bench_sampler, "bench_sampler ("),
    (bench_compact, "bench_compact ("),
])
@pytest.mark.slow
def test_block_benchmark_prints_its_table(module, title, tmp_path, capsys):
  saved = run_and_read_table(module, title, FAST, tmp_path / "results.json", capsys)
  assert all(r["ok"] and r["check"]["mode"] == "exact" for r in saved["results"])


@pytest.mark.slow
def test_decode_benchmark_prints_its_table(tmp_path, capsys):
  """Tiny models, but a dozen programs to compile (the round's parts, and `generate`'s two decode
  loops end to end): ~20 s on 2 cores."""
  saved = run_and_read_table(bench_decode, "bench_decode (", FAST, tmp_path / "results.json",
                             capsys)
  assert set(saved["results"]["e2e"]) == {"speculative", "autoregressive"}
