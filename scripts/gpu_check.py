"""The check to run on the H200 before submitting anything that touches a GPU path: one call, < 10 min.

Each step runs as a subprocess from the repository root (``PYTHONPATH`` set to it, so this tree's
``dspark_jax`` is used, not an installed one) with a timeout; its output goes to
``$OUT/<n>_<step>.log`` (``$OUT`` defaults to ``./gpu_check_out``). Steps, in order:

  device   JAX's devices, this device's measured copy rate, bf16 matrix rate and free memory
           (the figures every floor of the benchmarks uses), and the dispatch table; on the GPU
           run the first device must be a GPU (else nothing else runs).
  tests    ``pytest -q -x`` on `TESTS` with ``-m "kernel or gpu"`` (`TEST_MARKS`); on the GPU with
           ``JAX_PLATFORMS=cuda``,
           ``DSPARK_TEST_GPU=1`` (tests/conftest.py otherwise pins the CPU) and no preallocation
           (pytest's workers share the GPU).
  demo     ``python -m dspark_jax.apps.cli demo``: the shipped pair, greedy; it reports how many
           tokens the speculative and plain outputs share.
  eval     ``python -m dspark_jax.apps.cli eval`` on the first prompts (T = 0 and 1); passes if the
           DSpark drafter's greedy τ is at least `EVAL_MIN_TAU` (a broken draft path gives ~1).
  sampler  ``python -m benchmarks.bench_sampler`` at V = 129280, B = 8 and 128, γ = 7, r = 256, bf16
           (backend auto: on the H200 Triton at B = 8, Hopper at B = 128). It exits 1 unless, at
           each shape: on the XLA backend the folded sampling tokens and corrected logits equal the
           eager path's bit for bit, and the greedy-only tokens too; on a kernel backend the
           corrected logits are within one bf16 ulp of the eager ones wherever the earlier tokens
           agree (token agreement is reported); and ``DraftSampler.propose`` returns the folded
           variant's tokens exactly.
  decode   ``python -m benchmarks.bench_decode`` at one size (Qwen3-4B shape, B = 16, context 1024).
  padding  ``python -m benchmarks.bench_verify`` at B = 16 and 64, context 128: the AR step and the
           verify in caches of 192 and 8256 slots (the padding cost), and the packed verify
           against the dense one at 2 and 8 tokens per row.
  prefill  ``python -m benchmarks.bench_prefill`` at B = 16, 4096-token prompts: the whole prompt in
           one pass against passes of 1024 positions (ms and scratch memory); a failed chunked
           cell fails the step.

The pass/fail table (result, seconds, a note) is printed last and written to
``$OUT/gpu_check.json``; the exit status is 0 only if every step passed. A step that would start
with less than `MIN_STEP_SECONDS` of the ``--budget`` left is not run (and fails the check).

  python scripts/gpu_check.py                          # on the H200 (device tool), ~8-10 min
  python scripts/gpu_check.py --steps tests,sampler    # a subset
  python scripts/gpu_check.py --cpu-smoke              # here: the same steps, tiny shapes, on the CPU

``--cpu-smoke`` runs every step on the CPU with ``--small`` (and few prompts and tokens), with
larger timeouts: the kernel tests run there in Pallas' interpreter. Set ``GIT_COMMIT`` where the
tree has no ``.git`` (the device machine) so the benchmarks record it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = (
    "tests/test_hopper_step.py",
    "tests/test_proposal.py",
    "tests/test_compact_logits.py",
    "tests/test_draft_sampler.py",
    "tests/test_attention.py",
    "tests/test_attention_inputs.py",
    "tests/test_ragged_attention.py",
    "tests/test_shared_attention.py",
    "tests/test_packing.py",
    "tests/test_paged.py",
    "tests/test_prefill.py",
    "tests/test_packed_prefill.py",
)
"""The GPU-relevant test files (edit here)."""
TEST_MARKS = "kernel or gpu"
"""On the GPU: every test that runs a kernel, the law tests marked slow too (slow only in the
CPU's interpreter). With --cpu-smoke: the tests not marked slow."""
EVAL_MIN_TAU = 1.6
"""The DSpark drafter's greedy τ on the eval subset must reach this: a broken draft path gives ~1;
the shipped pair gave 2.06 on the subset on the H200 (2026-12-02) and 3.77 on all prompts, 128
tokens."""
MIN_STEP_SECONDS = 20
GPU_BUDGET_S = 570
SMOKE_BUDGET_S = 3600


@dataclasses.dataclass
class Step:
  """One step: its command, its timeout, and a check of its output beyond the exit status
  (returns ``(ok, note)``)."""

  name: str
  argv: list[str]
  timeout_s: float
  check: Callable[[str], tuple[bool, str]] | None = None
  env: dict[str, str] = dataclasses.field(default_factory=dict)


def _last_line_with(text: str, *words: str) -> str:
  lines = [line.strip() for line in text.splitlines() if all(w in line for w in words)]
  return lines[-1][:90] if lines else ""


def _check_device(cpu: bool):
  def check(log: str) -> tuple[bool, str]:
    line = _last_line_with(log, "platform:")
    platform = line.split("platform:")[-1].split()[0] if line else "?"
    ok = platform == ("cpu" if cpu else "gpu")
    rates = _last_line_with(log, "GB/s", "TFLOP/s")
    return ok, ((line.split("platform:")[-1].strip() + "; " + rates) if line and rates
                else line or "no platform line")
  return check


def _check_tests(log: str) -> tuple[bool, str]:
  return True, _last_line_with(log, " in ") or _last_line_with(log, "passed")


def _check_demo(log: str) -> tuple[bool, str]:
  return True, _last_line_with(log, "τ (tokens per round")


def _check_eval(out_dir: str):
  def check(log: str) -> tuple[bool, str]:
    path = os.path.join(out_dir, "acceptance.json")
    try:
      with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as exc:
      return False, f"no results: {exc}"
    taus = {(r["drafter"], r["temperature"]): r["tau"] for r in rows}
    greedy = taus.get(("dspark", 0.0))
    note = ", ".join(f"{d.split()[0]} T={t:g} τ {tau:.2f}" for (d, t), tau in taus.items())
    if greedy is None:
      return True, note
    return greedy >= EVAL_MIN_TAU, note + ("" if greedy >= EVAL_MIN_TAU
                                           else f" < {EVAL_MIN_TAU} at T=0")
  return check


def _check_bench(json_path: str, describe: Callable[[dict], str]):
  def check(log: str) -> tuple[bool, str]:
    try:
      with open(json_path, encoding="utf-8") as f:
        results = json.load(f)["results"]
    except (OSError, ValueError, KeyError) as exc:
      return False, f"no results: {exc}"
    return True, describe(results)
  return check


def _sampler_note(results: list[dict]) -> str:
  return "; ".join(
      f"B={r['batch']} " + (f"FAILED {r['error'][:40]}" if "error" in r else
                            f"{r['sampling_backend']}/{r['greedy_backend']} "
                            f"{r['sampling_us']:.0f} µs {r['check']['mode']}"
                            f"{'' if r['ok'] else ' NOT OK'}")
      for r in results)


def _padding_note(results: dict) -> str:
  parts = [f"B={r['batch']} {r['call']} {r['padding_cost']:.2f}x" for r in results["padding"]]
  parts += [f"B={r['batch']} {r['tokens']}/row packed/dense {r['packed_ms'] / r['dense_ms']:.2f}"
            for r in results["tokens"]]
  return "padding cost " + "; ".join(parts)


def _prefill_note(results: list[dict]) -> str:
  return "; ".join(f"B={r['batch']} T={r['length']} {r['chunk']} "
                   + (r["error"][:30] if r["error"] else
                      f"{r['ms']:.1f} ms {r['temp_bytes'] / 2**30:.1f} GiB") for r in results)


def _decode_note(results: dict) -> str:
  return "; ".join(f"B={r['batch']} {r['backend']} round {r['seconds']['full round'] * 1e3:.2f} ms"
                   for r in results["rounds"].values())


def steps(args, out: str) -> list[Step]:
  """The steps of this run (module docstring), sized for the GPU or, with --cpu-smoke, the CPU."""
  py, smoke = sys.executable, args.cpu_smoke
  platform = {"JAX_PLATFORMS": "cpu" if smoke else os.environ.get("JAX_PLATFORMS", "cuda")}
  # On the GPU: tests/conftest.py keeps JAX on the CPU unless DSPARK_TEST_GPU=1, and pytest's
  # workers (pyproject's addopts) share the GPU, so none may take most of its memory up front.
  test_env = {} if smoke else {"DSPARK_TEST_GPU": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  cli = [py, "-m", "dspark_jax.apps.cli"]
  probe = ("import jax; from dspark_jax.kernels import dispatch; from benchmarks import harness; "
           "d = jax.devices()[0]; print(jax.devices()); print('jax', jax.__version__, 'platform:', "
           f"d.platform, d.device_kind); free = harness.free_device_bytes(); small = {smoke}; "
           "print(f'copy {harness.floor_bandwidth(small)[0] / 1e9:.0f} GB/s, bf16 matmul "
           "{harness.matmul_rate(small) / 1e12:.1f} TFLOP/s, free memory ' + "
           "('n/a' if free is None else f'{free / 2**30:.1f} GiB')); print(dispatch.table())")
  eval_dir = os.path.join(out, "eval")
  sampler_json = os.path.join(out, "bench_sampler.json")
  decode_json = os.path.join(out, "bench_decode.json")
  verify_json = os.path.join(out, "bench_verify.json")
  prefill_json = os.path.join(out, "bench_prefill.json")
  # The same sample on both: EVAL_MIN_TAU is a property of the shipped models on it (on 2 prompts
  # × 16 tokens the greedy τ is ~1.5).
  eval_args = ["--prompts", "4", "--max-new-tokens", "64"]
  if smoke:
    demo_args = ["--prompts", "1", "--max-new-tokens", "16"]
    sampler_args = ["--small"]
    decode_args = ["--small"]
    verify_args = ["--small", "--tokens", "2,8"]
    prefill_args = ["--small"]
  else:
    demo_args = ["--prompts", "2", "--max-new-tokens", "64"]
    sampler_args = ["--vocab", "129280", "--batch", "8,128", "--gamma", "7", "--rank", "256",
                    "--dtype", "bf16", "--repeats", "10", "--warmup", "3", "--no-torch"]
    decode_args = ["--batches", "16", "--context", "1024", "--e2e-batch", "0", "--repeats", "10"]
    verify_args = ["--batches", "16,64", "--context", "128", "--capacities", "192,8256",
                   "--tokens", "2,8", "--repeats", "5"]
    prefill_args = ["--batches", "16", "--lengths", "4096", "--chunks", "whole,1024",
                    "--repeats", "3"]
  scale = 6 if smoke else 1  # the CPU runs kernels in the interpreter
  workers = "2" if smoke else str(max(2, min(6, (os.cpu_count() or 2) // 2)))
  return [
      Step("device", [py, "-c", probe], 60, _check_device(smoke), platform),
      # addopts replaced: the GPU machine has no nbmake (notebooks run in CI, on the CPU). The
      # step is bound by compiling, so the GPU host's cores share it (memory is not preallocated).
      Step("tests", [py, "-m", "pytest", "-o", "addopts=-ra", "-n", workers, "-q", "-x", "-p",
                     "no:cacheprovider", *TESTS, "-m", "not slow" if smoke else TEST_MARKS],
           330 * scale, _check_tests, dict(platform, **test_env)),
      Step("demo", cli + ["demo", *demo_args], 60 * scale, _check_demo, platform),
      Step("eval", cli + ["eval", *eval_args, "--temperatures", "0,1", "--out", eval_dir],
           90 * scale, _check_eval(eval_dir), platform),
      Step("sampler", [py, "-m", "benchmarks.bench_sampler", *sampler_args, "--json", sampler_json],
           120 * scale, _check_bench(sampler_json, _sampler_note), platform),
      Step("decode", [py, "-m", "benchmarks.bench_decode", *decode_args, "--json", decode_json],
           180 * scale, _check_bench(decode_json, _decode_note), platform),
      Step("padding", [py, "-m", "benchmarks.bench_verify", *verify_args, "--json", verify_json],
           150 * scale, _check_bench(verify_json, _padding_note), platform),
      Step("prefill", [py, "-m", "benchmarks.bench_prefill", *prefill_args, "--json", prefill_json],
           120 * scale, _check_bench(prefill_json, _prefill_note), platform),
  ]


def run_step(step: Step, log_path: str, deadline: float) -> dict:
  """Runs `step` with its timeout cut to the budget left; returns its row of the table."""
  timeout = min(step.timeout_s, deadline - time.monotonic())
  if timeout < MIN_STEP_SECONDS:
    return {"step": step.name, "result": "NOT RUN", "seconds": 0.0, "note": "budget spent"}
  env = dict(os.environ, **step.env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  env.setdefault("PYTHONUNBUFFERED", "1")
  start = time.monotonic()
  with open(log_path, "w", encoding="utf-8") as log:
    log.write(f"$ {shlex.join(step.argv)}\n")
    log.flush()
    # A session of its own, so that a timeout ends the step's whole process group and nothing else.
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      rc = None
  seconds = time.monotonic() - start
  with open(log_path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  if rc is None:
    return {"step": step.name, "result": "TIMEOUT", "seconds": seconds,
            "note": f"killed after {timeout:.0f} s"}
  ok, note = step.check(text) if step.check else (True, "")
  if rc != 0:
    ok, note = False, f"exit {rc}; " + (note or _last_line_with(text, "Error"))
  return {"step": step.name, "result": "PASS" if ok else "FAIL", "seconds": seconds, "note": note}


def table(rows: list[dict]) -> list[str]:
  width = max(len(r["step"]) for r in rows)
  lines = [f"{'step'.ljust(width)}  result   seconds  note", "-" * (width + 40)]
  lines += [f"{r['step'].ljust(width)}  {r['result']:<7}  {r['seconds']:7.1f}  {r['note']}"
            for r in rows]
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cpu-smoke", action="store_true",
                      help="every step on the CPU with tiny shapes (--small), larger timeouts")
  parser.add_argument("--steps", default=None,
                      help="comma list of steps to run (default: all): device,tests,demo,eval,"
                      "sampler,decode,padding,prefill")
  parser.add_argument("--budget", type=float, default=None,
                      help=f"seconds for the whole check (default {GPU_BUDGET_S}; --cpu-smoke: "
                      f"{SMOKE_BUDGET_S})")
  args = parser.parse_args(argv)
  out = os.path.abspath(os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_check_out"))
  os.makedirs(out, exist_ok=True)
  plan = steps(args, out)
  if args.steps:
    wanted = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {s.name for s in plan})
    if unknown:
      parser.error(f"--steps: unknown {unknown}; steps are {[s.name for s in plan]}")
    plan = [s for s in plan if s.name in wanted]
  budget = args.budget or (SMOKE_BUDGET_S if args.cpu_smoke else GPU_BUDGET_S)
  deadline = time.monotonic() + budget
  start = time.monotonic()
  print(f"gpu_check{' --cpu-smoke' if args.cpu_smoke else ''}: {len(plan)} steps, budget "
        f"{budget:.0f} s, logs in {out}", flush=True)
  rows = []
  for i, step in enumerate(plan, 1):
    shown = "python -c <device probe>" if step.name == "device" else shlex.join(step.argv[1:])
    print(f"[{i}/{len(plan)}] {step.name}: {shown[:150]}", flush=True)
    if rows and rows[0]["step"] == "device" and rows[0]["result"] != "PASS":
      row = {"step": step.name, "result": "NOT RUN", "seconds": 0.0, "note": "wrong device"}
    else:
      row = run_step(step, os.path.join(out, f"{i}_{step.name}.log"), deadline)
    rows.append(row)
    print(f"      {row['result']} in {row['seconds']:.1f} s  {row['note']}", flush=True)
    if row["result"] in ("FAIL", "TIMEOUT"):
      with open(os.path.join(out, f"{i}_{step.name}.log"), encoding="utf-8",
                errors="replace") as f:
        tail = f.read().splitlines()[-25:]
      print("\n".join("      | " + line[:160] for line in tail), flush=True)
  passed = all(r["result"] == "PASS" for r in rows)
  total = time.monotonic() - start
  with open(os.path.join(out, "gpu_check.json"), "w", encoding="utf-8") as f:
    json.dump({"cpu_smoke": args.cpu_smoke, "passed": passed, "seconds": total, "tests": TESTS,
               "steps": rows}, f, indent=2, ensure_ascii=False)
  print()
  print(f"gpu_check{' --cpu-smoke' if args.cpu_smoke else ''}: "
        f"{'PASS' if passed else 'FAIL'} ({sum(r['result'] == 'PASS' for r in rows)}/{len(rows)} "
        f"steps) in {total:.0f} s; logs in {out}")
  print("\n".join(table(rows)), flush=True)
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main())
