"""The projection GEMMs of the Qwen3-4B target, per candidate: the fastest exact GEMM per shape.

Shapes (bf16 in, bf16 out), as (name, K, N): ``qkv`` (2560, 6144) (q/k/v fused: 32 + 8 + 8 heads ×
128), ``o`` (4096, 2560), ``gate_up`` (2560, 19456) (gate/up fused), ``down`` (9728, 2560) and
``lm_head`` (2560, 151936); ``--rows`` M (default 1,16,64,128,512: B rows × verify tokens).

Program: the four layer projections run over ``--layers`` (default 36) DISTINCT random bf16
weights in one jitted program, so every layer's weight streams from HBM, not L2: ``--loop scan``
(default) is a `jax.lax.scan` over the stacked [L, K, N] weights, ``--loop unrolled`` a Python
loop over L separate [K, N] arrays (as `models.target` runs its layers). The lm_head is one weight
(L = 1: one product, whatever ``--loop``). The input x [M, K] is the same for every layer; no
product is dead code: the scan carries each layer's output (and returns the last), the unrolled
program returns all L (an ``optimization_barrier`` chain would not do: XLA drops the barriers and
then the products). The products run one after another (one stream), as the model's layers do.
A sample times the whole program (``--calls`` calls back to back, `harness.time_side_by_side`:
median of ``--repeats`` samples after ``--warmup`` calls, the candidates of a cell interleaved);
the table gives µs per layer (program time / L).

Candidates (``--candidates``, default all; one that does not apply here is listed as skipped):

* ``xla``: ``jnp.dot(x, w)`` on bf16 operands with XLA's default precision and a bf16 result:
  what ``nnx.Linear`` (``dspark_jax/models/layers.py``, ``dtype=bf16``, no
  ``preferred_element_type``) computes for every projection of the model;
* ``xla_cublas``: the same program in a child process whose ``XLA_FLAGS`` add
  ``--xla_gpu_enable_triton_gemm=false`` (XLA's flags are per process: the script runs itself
  with ``--child-flags=...`` and reads the child's JSON); GPU only;
* ``xla_no_fusion_autotune``: likewise with ``--xla_gpu_experimental_enable_fusion_autotuner=
  false``; GPU only; skipped with a note where this jaxlib's XLA rejects the flag;
* ``mgpu``: JAX's Hopper Pallas (Mosaic GPU) matmul, ``jax.experimental.pallas.ops.gpu.
  hopper_matmul_mgpu`` (``matmul(a, b, None, config)``, or the older ``matmul_kernel(a, b,
  config)``), with x's rows zero-padded to the kernel's row tile before the program (the padded
  rows' outputs are carried, and sliced off only for the check). A sweep per projection and padded
  M (``--mgpu-configs``; default tile_m 64 or 128, tile_n 64/128/256, tile_k 64, 2/4/6 concurrent
  steps, 64×64 epilogue tiles, the two compute warpgroups splitting N; configs whose shared memory
  or divisibility cannot work are not tried) keeps the fastest exact config, reported beside its
  time; sm_90 (H100/H200) only.

Checks: every candidate's output (the last layer's) against a float32 reference, ``jnp.dot`` of
the float32-cast operands under ``jax.default_matmul_precision("highest")``: exact when
``max|out - ref| <= 4·2⁻⁸·max|ref|`` (bf16 rounding). A candidate that is not exact is reported
("inexact") and never counted as the fastest. ``copies`` counts the non-GEMM kernels of the
compiled program that move at least one layer's weight (`bench_profile.hlo_costs`): 0 expected on
a GPU (on a CPU, XLA's bf16 → f32 converts count); more means the candidate pays a weight copy
(e.g. a scan's slice of the stacked weights copied before a custom call that cannot read it in
place: compare ``--loop unrolled``).

Floor per layer: ``max(K·N·2 / copy rate, 2·M·K·N / bf16 matmul rate)`` at this run's measured
rates (`harness.start_run`; the x read and the output write are not counted); ``bound`` says which
term applies. Per (projection, M) the fastest exact candidate and its ratio to ``xla``; per M the
sum over the four layer projections × 36 layers (one forward) of ``xla`` against the fastest.

A full default run compiles and autotunes 25 cells per candidate; ``--budget`` (seconds, default
540) stops new cells (and sweeps) after it, the skipped ones listed; split a run by
``--projections`` where one command may take 10 minutes.

  PYTHONPATH=. python -m benchmarks.bench_gemm --json gemm.json
  PYTHONPATH=. python -m benchmarks.bench_gemm --projections qkv,o --json gemm_a.json
  PYTHONPATH=. python -m benchmarks.bench_gemm --projections gate_up,down,lm_head --json gemm_b.json
  PYTHONPATH=. python -m benchmarks.bench_gemm --loop unrolled --candidates xla,mgpu --json u.json
  PYTHONPATH=. python -m benchmarks.bench_gemm --small          # CPU smoke: only xla applies
  # what the parent runs for xla_cublas (xla_no_fusion_autotune alike), for one by hand:
  XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_triton_gemm=false" PYTHONPATH=. python -m \\
      benchmarks.bench_gemm --child-flags=--xla_gpu_enable_triton_gemm=false --json child.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECTIONS = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456),
               "down": (9728, 2560), "lm_head": (2560, 151936)}
"""(K, N) of Qwen3-4B's projections: hidden 2560, 32 query and 8 kv heads of 128, MLP 9728."""
SMALL_PROJECTIONS = {"qkv": (64, 192), "o": (128, 64), "gate_up": (64, 256), "down": (128, 64),
                     "lm_head": (64, 512)}
LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")
MODEL_LAYERS = 36
CANDIDATES = ("xla", "xla_cublas", "xla_no_fusion_autotune", "mgpu")
CHILD_FLAGS = {"xla_cublas": "--xla_gpu_enable_triton_gemm=false",
               "xla_no_fusion_autotune": "--xla_gpu_experimental_enable_fusion_autotuner=false"}
CHILD_SHARE = 0.25
"""Each child process may use this share of ``--budget``; the in-process candidates the rest."""
TOLERANCE = 4 * 2.0**-8
"""Exact: max|out - ref| <= TOLERANCE · max|ref| (bf16 rounding of the result, with margin)."""
SMEM_BYTES = 227 * 1024
"""Shared memory per block on sm_90: configs whose pipeline needs more are not tried."""
MGPU_SWEEP = {"tile_n": (64, 128, 256), "tile_k": (64,), "steps": (2, 4, 6)}


SHORT = {"xla": "xla", "xla_cublas": "cublas", "xla_no_fusion_autotune": "no_fusion_at",
         "mgpu": "mgpu"}
"""The candidates' names in the table's header."""


# ---- candidates --------------------------------------------------------------------------------


def xla_matmul(x, w):
  """The model's projection: bf16 operands, XLA's default precision, bf16 result."""
  return jnp.dot(x, w)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """One setting of the Hopper Pallas matmul; `split_n`: its two compute warpgroups split the
  block's columns (``wg_dimension=N``; the older kernel splits rows)."""
  tile_m: int
  tile_n: int
  tile_k: int
  steps: int
  split_n: bool = True

  @property
  def block_m(self) -> int:
    return self.tile_m if self.split_n else 2 * self.tile_m

  @property
  def block_n(self) -> int:
    return 2 * self.tile_n if self.split_n else self.tile_n

  @property
  def name(self) -> str:
    return f"m{self.tile_m}n{self.tile_n}k{self.tile_k}s{self.steps}"

  def smem_bytes(self) -> int:
    stage = (self.block_m * self.tile_k + self.tile_k * self.block_n) * 2
    out = 2 * min(2, self.tile_m * self.tile_n // (64 * 64)) * 64 * 64 * 2
    return stage * self.steps + out

  def unfit(self, k: int, n: int) -> str | None:
    """Why this config cannot run [·, k] @ [k, n] (None if it can)."""
    if n % self.block_n or k % self.tile_k:
      return f"N={n} or K={k} not a multiple of {self.block_n}, {self.tile_k}"
    if self.smem_bytes() > SMEM_BYTES:
      return f"needs {self.smem_bytes() // 1024} KiB of shared memory"
    return None


def mgpu_module():
  """``(hopper_matmul_mgpu module, None)``, or ``(None, why not)``."""
  try:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  except Exception as exc:  # noqa: BLE001 - reported as the candidate's skip reason
    return None, f"import failed: {type(exc).__name__}: {exc}"
  if not hasattr(hm, "TuningConfig") or not (hasattr(hm, "matmul") or hasattr(hm, "matmul_kernel")):
    return None, "hopper_matmul_mgpu has no TuningConfig / matmul"
  return hm, None


def config_list(text: str) -> list[tuple[int, int, int, int]]:
  """argparse type: "64x128x64x4,..." -> [(tile_m, tile_n, tile_k, steps), ...]."""
  try:
    out = [tuple(int(v) for v in part.strip().lower().split("x")) for part in text.split(",")]
  except ValueError:
    out = []
  if not out or any(len(c) != 4 or min(c) < 1 for c in out):
    raise argparse.ArgumentTypeError(f"expected MxNxKxS,... (e.g. 64x128x64x4); got {text!r}")
  return out


def mgpu_configs(hm, given, rows: int) -> list[MgpuConfig]:
  """The sweep: the `given` (tile_m, tile_n, tile_k, steps), else tile_m 64 (and 128 past 64
  rows) with the tile_n, tile_k and step counts of `MGPU_SWEEP`."""
  split_n = "wg_dimension" in {f.name for f in dataclasses.fields(hm.TuningConfig)}
  if given:
    return [MgpuConfig(*c, split_n=split_n) for c in given]
  tiles_m = (64,) if rows <= 64 else (64, 128)
  return [MgpuConfig(tm, tn, tk, s, split_n) for tm in tiles_m for tn in MGPU_SWEEP["tile_n"]
          for tk in MGPU_SWEEP["tile_k"] for s in MGPU_SWEEP["steps"]]


def mgpu_matmul(hm, config: MgpuConfig):
  """fn(x, w) of `config`: x's rows a multiple of ``config.block_m``."""
  fields = {f.name for f in dataclasses.fields(hm.TuningConfig)}
  kw = dict(tile_m=config.tile_m, tile_n=config.tile_n, tile_k=config.tile_k,
            max_concurrent_steps=config.steps)
  kw.update({name: 64 for name in ("epi_tile_m", "epi_tile_n") if name in fields})
  if "wg_dimension" in fields:
    kw["wg_dimension"] = hm.MatmulDimension.N
  tuning = hm.TuningConfig(**kw)
  if hasattr(hm, "matmul"):
    if len(inspect.signature(hm.matmul).parameters) >= 4:
      return lambda x, w: hm.matmul(x, w, None, tuning)
    return lambda x, w: hm.matmul(x, w, tuning)
  return lambda x, w: hm.matmul_kernel(x, w, tuning)


def error_text(exc: Exception) -> str:
  """The exception's type and first line, for a table cell and the JSON."""
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def pad_rows(x, multiple: int):
  rows = -(-x.shape[0] // multiple) * multiple
  return x if rows == x.shape[0] else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def skip_reasons(names, *, children_anywhere: bool) -> dict[str, str]:
  """Name -> why it does not run here, for the `names` that do not."""
  device = jax.local_devices()[0]
  gpu = device.platform == "gpu"
  capability = str(getattr(device, "compute_capability", ""))
  hopper = gpu and (capability.startswith("9.") or any(k in device.device_kind
                                                       for k in ("H100", "H200", "H800", "GH200")))
  out = {}
  for name in names:
    if name in CHILD_FLAGS and not (gpu or children_anywhere):
      out[name] = "needs a GPU"
    elif name == "mgpu" and not hopper:
      out[name] = "needs Hopper (sm_90)"
    elif name == "mgpu":
      reason = mgpu_module()[1]
      if reason:
        out[name] = reason
  return out


# ---- programs ----------------------------------------------------------------------------------


def layered(fn, loop: str):
  """The jitted program of one product ``fn(x, w)`` per weight, every one live: ``run(x,
  weights)``, `weights` [L, K, N] (``scan``: the product is the loop's carry, the last one
  returned) or a tuple of L [K, N] arrays (``unrolled``: all L products returned; an
  ``optimization_barrier`` chain would not do, XLA drops the barriers and then the products).
  `fn` is jitted, so the unrolled program lowers it once (a Pallas kernel 36 times: seconds)."""
  fn = jax.jit(fn)
  if loop == "scan":
    def run(x, weights):
      y0 = jnp.zeros((x.shape[0], weights.shape[-1]), x.dtype)  # once per call, not per layer
      return jax.lax.scan(lambda y, w: (fn(x, w), None), y0, weights)[0]
  else:
    def run(x, weights):
      return tuple(fn(x, w) for w in weights)
  return jax.jit(run)


def last_layer(out):
  """The last layer's product of a `layered` program's result."""
  return jax.tree.leaves(out)[-1]


@functools.partial(jax.jit, static_argnums=1)
def normal(key, shape):
  return jax.random.normal(key, shape, jnp.bfloat16)


def make_weights(k: int, n: int, layers: int, loop: str, seed: int):
  """`layers` distinct random bf16 [k, n] weights (stacked for ``scan``) and the last of them."""
  key = jax.random.key(seed)
  if loop == "scan":
    weights = normal(key, (layers, k, n))
    return harness.on_device(weights), harness.on_device(weights[-1])
  weights = tuple(normal(jax.random.fold_in(key, i), (k, n)) for i in range(layers))
  return harness.on_device(weights), weights[-1]


@jax.jit
def _error(out, ref):
  return jnp.max(jnp.abs(out[:ref.shape[0]].astype(jnp.float32) - ref)), jnp.max(jnp.abs(ref))


def check(out, ref) -> tuple[float, bool]:
  """``(max|out - ref| / max|ref|, exact)``; out may carry padding rows past ref's."""
  err, scale = (float(v) for v in _error(out, ref))
  rel = err / max(scale, 1e-30)
  return rel, bool(math.isfinite(rel) and err <= TOLERANCE * scale)


def weight_copies(thunk, k: int, n: int) -> tuple[int | None, list[str]]:
  """Non-GEMM kernels of the compiled program that move at least one [k, n] bf16 weight, and their
  labels (`bench_profile.hlo_costs`); ``(None, [])`` where the HLO cannot be read."""
  try:
    from benchmarks import bench_profile as bp
    text = thunk.compiled().as_text()
    ops = {name: i for comp in bp.parse_hlo(text).values() for name, i in comp.items()}
    big = [(name, cost) for name, cost in bp.hlo_costs(text).items()
           if not cost.gemm and ops[name].opcode != "custom-call" and cost.bytes >= k * n * 2]
  except Exception:  # noqa: BLE001 - a diagnostic only
    return None, []
  return len(big), [cost.label for _, cost in big]


# ---- one cell: a projection at one M -----------------------------------------------------------


@dataclasses.dataclass
class State:
  args: argparse.Namespace
  start: float
  budget: float
  save: Callable[[list[dict]], None] = lambda rows: None  # after every cell: the rows so far
  loop: str = "scan"  # this projection's (a single weight: "unrolled", one product, no loop)
  programs: dict = dataclasses.field(default_factory=dict)
  sweeps: dict = dataclasses.field(default_factory=dict)

  def over(self) -> bool:
    return time.perf_counter() - self.start > self.budget

  def program(self, key, fn):
    if key not in self.programs:
      self.programs[key] = layered(fn, self.loop)
    return self.programs[key]


def sweep_mgpu(proj: str, x, weights, ref, state: State) -> dict:
  """The fastest exact config of the sweep for this projection and padded M (cached: M = 1, 16
  and 64 pad to the same programs): ``{"config", "fn", "tried"}`` ("config" None if none ran)."""
  hm, _ = mgpu_module()
  k, n = x.shape[1], ref.shape[1]
  configs = mgpu_configs(hm, state.args.mgpu_configs, x.shape[0])
  key = (proj, tuple(-(-x.shape[0] // c.block_m) * c.block_m for c in configs))
  if key in state.sweeps:
    return state.sweeps[key]
  tried, best = [], None
  for config in configs:
    entry = {"config": config.name, "not_tried": config.unfit(k, n), "error": None}
    if entry["not_tried"] is None and state.over():
      entry["not_tried"] = "budget"
    tried.append(entry)
    if entry["not_tried"]:
      continue
    try:
      run = state.program(("mgpu", config), mgpu_matmul(hm, config))
      xin = harness.on_device(pad_rows(x, config.block_m))
      entry["rel_err"], entry["exact"] = check(last_layer(run(xin, weights)), ref)
      entry["program_s"] = harness.time_one(
          harness.program(run, xin, weights), repeats=max(2, state.args.repeats // 2),
          warmup=1, calls=state.args.calls)
    except Exception as exc:  # noqa: BLE001 - a config that fails is reported
      entry["error"] = error_text(exc)
      continue
    if entry["exact"] and (best is None or entry["program_s"] < best[1]["program_s"]):
      best = (config, entry)
  ran = [f"{e['config']} " + (e["error"][:80] if e["error"] else
                             f"{e['program_s'] * 1e3:.3f} ms" + ("" if e["exact"] else " inexact"))
         for e in tried if not e["not_tried"]]
  print(f"  {proj} M={x.shape[0]} mgpu sweep: {'; '.join(ran) or 'no config tried'}", flush=True)
  if best is None:
    inexact = [e["config"] for e in tried if e.get("exact") is False]
    errors = [e["error"] for e in tried if e["error"]]
    reason = (f"inexact: {', '.join(inexact)}" if inexact else errors[-1] if errors else
              "no config of the sweep fits (or budget)")
    out = {"config": None, "fn": None, "tried": tried, "error": reason}
  else:
    out = {"config": best[0], "fn": mgpu_matmul(hm, best[0]), "tried": tried, "error": None}
  state.sweeps[key] = out
  return out


def bench_cell(proj: str, k: int, n: int, rows: int, layers: int, weights, last, names,
               state: State) -> list[dict]:
  """One row per candidate in `names` (in-process ones) at M = `rows`."""
  args = state.args
  x = harness.on_device(jax.random.normal(jax.random.key(rows * 7919 + k), (rows, k), jnp.bfloat16))
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))(x, last)
  ref = jax.block_until_ready(ref)
  base = {"projection": proj, "K": k, "N": n, "M": rows, "layers": layers, "loop": state.loop}
  results, thunks = {}, {}
  for name in names:
    row = results[name] = dict(base, candidate=name, program_s=None, us_per_layer=None,
                               rel_err=None, exact=None, error=None, copies=None, config=None)
    try:
      if name == "xla":
        run, xin = state.program(("xla",), xla_matmul), x
      else:  # mgpu
        sweep = sweep_mgpu(proj, x, weights, ref, state)
        row["sweep"] = sweep["tried"]
        if sweep["config"] is None:
          row["error"] = sweep["error"]
          continue
        row["config"] = sweep["config"].name
        run = state.program(("mgpu", sweep["config"]), sweep["fn"])
        xin = harness.on_device(pad_rows(x, sweep["config"].block_m))
      row["rel_err"], row["exact"] = check(last_layer(run(xin, weights)), ref)
      thunks[name] = harness.program(run, xin, weights)
      row["copies"], row["copy_ops"] = weight_copies(thunks[name], k, n)
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported
      traceback.print_exc()
      row["error"] = error_text(exc)
  if thunks:
    times = harness.time_side_by_side(thunks, repeats=args.repeats, warmup=args.warmup,
                                      calls=args.calls)
    for name, seconds in times.items():
      results[name].update(program_s=seconds, us_per_layer=seconds / layers * 1e6)
  for row in results.values():
    print(f"  {proj} M={rows} {row['candidate']}: " + (
        f"error {row['error']}" if row["us_per_layer"] is None else
        f"{row['us_per_layer']:.2f} µs/layer, rel err {row['rel_err']:.1e}"
        f"{'' if row['exact'] else ' INEXACT'}, weight copies {row['copies']}"
        + (f", {row['config']}" if row["config"] else "")), flush=True)
  return list(results.values())


def run_in_process(names, projections, state: State) -> tuple[list[dict], list[str]]:
  """Every (projection, M) cell of the in-process candidates `names`; rows and skipped cells."""
  args, rows, skipped = state.args, [], []
  shapes = SMALL_PROJECTIONS if args.small else PROJECTIONS
  for proj in projections:
    k, n = shapes[proj]
    layers = 1 if proj == "lm_head" else args.layers
    if state.over():
      skipped += [f"{proj} M={m}" for m in args.rows]
      continue
    state.loop = args.loop if layers > 1 else "unrolled"  # no [1, K, N] stack to slice
    weights, last = make_weights(k, n, layers, state.loop, seed=list(PROJECTIONS).index(proj))
    state.programs.clear()
    for m in args.rows:
      if state.over():
        skipped.append(f"{proj} M={m}")
        continue
      rows += bench_cell(proj, k, n, m, layers, weights, last, names, state)
      state.save(rows)
    del weights, last
    gc.collect()
  return rows, skipped


# ---- child processes ---------------------------------------------------------------------------


def run_child(name: str, args, projections, budget: float
              ) -> tuple[list[dict], list[str], str | None]:
  """The ``xla`` rows of a child process whose ``XLA_FLAGS`` add ``CHILD_FLAGS[name]``, renamed
  `name`; the cells it skipped (budget); why there are no rows (None if there are)."""
  flags = CHILD_FLAGS[name]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(),
             PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "child.json")
    command = [sys.executable, "-m", "benchmarks.bench_gemm", f"--child-flags={flags}",
               "--candidates", "xla", "--projections", ",".join(projections),
               "--rows", ",".join(map(str, args.rows)), "--layers", str(args.layers),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--calls", str(args.calls), "--loop", args.loop, "--budget", f"{budget:.0f}",
               "--json", path] + (["--small"] if args.small else [])
    print(f"{name}: {' '.join(command[1:])} with XLA_FLAGS += {flags}", flush=True)
    with open(os.path.join(tmp, "stderr"), "w+", encoding="utf-8") as err:
      child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                               text=True)
      watchdog = threading.Timer(budget + 120, child.kill)
      watchdog.start()
      for line in child.stdout:
        print(f"  [{name}] {line.rstrip()}", flush=True)
      code = child.wait()
      watchdog.cancel()
      err.seek(0)
      stderr = err.read()
    if code != 0:
      if "unknown flag" in stderr.lower():
        return [], [], f"this jaxlib's XLA rejects {flags}"
      lines = [line for line in stderr.splitlines() if line.strip()]
      return [], [], f"child exited {code}: {lines[-1][:200] if lines else ''}"
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
  rows = [dict(r, candidate=name, flags=flags) for r in doc["results"]["rows"]
          if r["candidate"] == "xla"]
  skipped = [f"{name} {cell}" for cell in doc["results"]["skipped_cells"]]
  return rows, skipped, None if rows else "the child returned no rows (budget?)"


# ---- summary -----------------------------------------------------------------------------------


def add_floors(rows: list[dict], bandwidth: float, rate: float) -> None:
  for row in rows:
    k, n, m = row["K"], row["N"], row["M"]
    by_bytes, by_flops = k * n * 2 / bandwidth, 2 * m * k * n / rate
    row["floor_us"] = max(by_bytes, by_flops) * 1e6
    row["bound"] = "bytes" if by_bytes >= by_flops else "compute"
    row["x_floor"] = None if row["us_per_layer"] is None else row["us_per_layer"] / row["floor_us"]


def fastest(rows: list[dict]) -> dict:
  """``{(projection, M): {"candidate", "us_per_layer", "x_floor", "vs_xla", "floor_us", "bound"}}``:
  the fastest exact candidate of each cell."""
  cells = {}
  for row in rows:
    cells.setdefault((row["projection"], row["M"]), []).append(row)
  out = {}
  for key, cell in cells.items():
    exact = [r for r in cell if r["exact"] and r["us_per_layer"] is not None]
    xla = next((r for r in exact if r["candidate"] == "xla"), None)
    best = min(exact, key=lambda r: r["us_per_layer"]) if exact else None
    out[key] = {"candidate": best and best["candidate"], "config": best and best["config"],
                "us_per_layer": best and best["us_per_layer"],
                "x_floor": best and best["x_floor"], "floor_us": cell[0]["floor_us"],
                "bound": cell[0]["bound"], "xla_us": xla and xla["us_per_layer"],
                "vs_xla": (best["us_per_layer"] / xla["us_per_layer"]) if best and xla else None}
  return out


def totals(best: dict, ms: list[int]) -> list[dict]:
  """Per M: one forward's four layer projections × 36 layers, xla against the fastest exact."""
  out = []
  for m in ms:
    cells = [best.get((p, m)) for p in LAYER_PROJECTIONS]
    if not all(c and c["xla_us"] and c["us_per_layer"] for c in cells):
      continue
    row = {"M": m, "xla_us": MODEL_LAYERS * sum(c["xla_us"] for c in cells),
           "fastest_us": MODEL_LAYERS * sum(c["us_per_layer"] for c in cells),
           "floor_us": MODEL_LAYERS * sum(c["floor_us"] for c in cells)}
    head = best.get(("lm_head", m))
    if head and head["xla_us"] and head["us_per_layer"]:
      row.update(lm_head_xla_us=head["xla_us"], lm_head_fastest_us=head["us_per_layer"])
    out.append(row)
  return out


def total_line(t: dict) -> str:
  gain = t["xla_us"] - t["fastest_us"]
  text = (f"M={t['M']}: one forward's 4 projections × {MODEL_LAYERS} layers: xla "
          f"{t['xla_us']:.0f} µs, fastest exact {t['fastest_us']:.0f} µs (saves {gain:.0f} µs, "
          f"{gain / t['xla_us'] * 100:.1f}%), floor {t['floor_us']:.0f} µs")
  if "lm_head_xla_us" in t:
    text += f"; lm_head xla {t['lm_head_xla_us']:.0f} → {t['lm_head_fastest_us']:.0f} µs"
  return text


def table(rows: list[dict], best: dict, names: list[str]) -> tuple[list[str], list[list[str]]]:
  header = ["proj", "M", "floor µs", "bound"] + [SHORT[n] for n in names] + [
      "fastest", "vs xla", "mgpu config", "copies", "error"]
  by_cell = {}
  for row in rows:
    by_cell.setdefault((row["projection"], row["M"]), {})[row["candidate"]] = row
  out = []
  for (proj, m), cell in by_cell.items():
    b = best[proj, m]
    cells = [proj, str(m), f"{b['floor_us']:.2f}", b["bound"]]
    for name in names:
      r = cell.get(name)
      if r is None:
        cells.append("-")
      elif r["us_per_layer"] is None:
        cells.append("error")
      else:
        cells.append(f"{r['us_per_layer']:.2f} ({r['x_floor']:.2f})"
                     + ("" if r["exact"] else " inexact"))
    errors = [f"{n}: {r['error']}" for n, r in cell.items() if r["error"]]
    counts = {SHORT[n]: r["copies"] for n, r in cell.items() if r["copies"] is not None}
    copies = (str(next(iter(counts.values()))) if len(set(counts.values())) == 1 else
              ",".join(f"{n}:{c}" for n, c in counts.items()) or "?")
    cells += [SHORT.get(b["candidate"], "none"), "-" if b["vs_xla"] is None else f"{b['vs_xla']:.2f}",
              (cell.get("mgpu") or {}).get("config") or "-", copies,
              (errors[0][:70] if errors else "")]
    out.append(cells)
  return header, out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=harness.int_list, default=None,
                      help="comma list of rows M (default 1,16,64,128,512; --small: 1,16)")
  parser.add_argument("--layers", type=int, default=None,
                      help="distinct weights per layer projection (default 36; --small: 3)")
  parser.add_argument("--projections", default=",".join(PROJECTIONS),
                      help="comma list of " + ", ".join(PROJECTIONS) + " (default: all)")
  parser.add_argument("--candidates", default=",".join(CANDIDATES),
                      help="comma list of " + ", ".join(CANDIDATES) + " (default: all that apply)")
  parser.add_argument("--loop", choices=("scan", "unrolled"), default="scan",
                      help="the layers as a lax.scan over stacked weights (default) or a Python "
                      "loop over separate arrays (the model's form)")
  parser.add_argument("--calls", type=int, default=None,
                      help="back-to-back calls per sample (default 10; --small: 2)")
  parser.add_argument("--mgpu-configs", type=config_list, default=None, metavar="MxNxKxS,...",
                      help="mgpu configs to sweep instead of the default sweep, each "
                      "tile_m x tile_n x tile_k x max_concurrent_steps, e.g. 64x128x64x4")
  parser.add_argument("--budget", type=float, default=540.0,
                      help="seconds after which no new cell or sweep config starts (default 540)")
  parser.add_argument("--children-anywhere", action="store_true",
                      help="run the child-process candidates off a GPU too (their flags then "
                      "change nothing): a test of the re-invocation")
  parser.add_argument("--child-flags", default=None, help=argparse.SUPPRESS)
  harness.add_common_arguments(parser, repeats=10, warmup=2, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.rows = args.rows or ([1, 16] if args.small else [1, 16, 64, 128, 512])
  args.layers = args.layers or (3 if args.small else MODEL_LAYERS)
  args.calls = args.calls or (2 if args.small else 10)
  for option, known in (("projections", tuple(PROJECTIONS)), ("candidates", CANDIDATES)):
    chosen = [name.strip() for name in getattr(args, option).split(",") if name.strip()]
    if not chosen or set(chosen) - set(known):
      parser.error(f"--{option}: a comma list of {', '.join(known)}; got {getattr(args, option)!r}")
    setattr(args, option, chosen)
  if args.layers < 1 or args.calls < 1:
    parser.error("--layers and --calls must be >= 1")
  if args.child_flags is not None and not args.json:
    parser.error("--child-flags needs --json (the child's rows go there)")
  return args


def child_main(args) -> int:
  """A child process: the in-process ``xla`` rows under this process's XLA_FLAGS, as JSON."""
  if args.child_flags not in os.environ.get("XLA_FLAGS", ""):
    print(f"warning: XLA_FLAGS lacks {args.child_flags}: the rows are plain xla's", flush=True)
  state = State(args, time.perf_counter(), args.budget)
  rows, skipped = run_in_process(["xla"], args.projections, state)
  meta = harness.metadata(child_flags=args.child_flags, xla_flags=os.environ.get("XLA_FLAGS"))
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump({"meta": meta, "results": {"rows": rows, "skipped_cells": skipped}}, f, default=str)
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child_flags is not None:
    return child_main(args)
  start = time.perf_counter()
  skipped = skip_reasons(args.candidates, children_anywhere=args.children_anywhere)
  names = [n for n in args.candidates if n not in skipped]
  meta, bandwidth = harness.start_run(args, rows=args.rows, layers=args.layers, loop=args.loop,
                                      calls=args.calls, projections=args.projections,
                                      candidates=args.candidates, xla_flags=os.environ.get(
                                          "XLA_FLAGS"), tolerance=TOLERANCE)
  rate = meta["matmul_tflops"] * 1e12
  for name, reason in skipped.items():
    print(f"skipped {name}: {reason}", flush=True)
  rows, skipped_cells = [], []

  def save(own: list[dict]) -> None:  # a run cut short (a kernel killing the process) keeps these
    if args.json:
      os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": {"rows": rows + own, "partial": True}}, f, default=str)

  for name in [n for n in names if n in CHILD_FLAGS]:
    share = min(args.budget - (time.perf_counter() - start), CHILD_SHARE * args.budget)
    if share < 10:
      child_rows, child_skipped, reason = [], [], f"budget ({share:.0f} s left for it)"
    else:
      child_rows, child_skipped, reason = run_child(name, args, args.projections, share)
    rows += child_rows
    skipped_cells += child_skipped
    save([])
    if reason:
      skipped[name] = reason
      print(f"skipped {name}: {reason}", flush=True)
  in_process = [n for n in names if n not in CHILD_FLAGS]
  if in_process:
    own, own_skipped = run_in_process(in_process, args.projections,
                                      State(args, start, args.budget, save))
    rows += own
    skipped_cells += own_skipped
  if skipped_cells:
    print(f"skipped (budget {args.budget:.0f} s): {', '.join(skipped_cells)}", flush=True)
  add_floors(rows, bandwidth, rate)
  best = fastest(rows)
  sums = totals(best, args.rows)
  shown = [n for n in CANDIDATES if any(r["candidate"] == n for r in rows)]
  header, lines = table(rows, best, shown)
  print()
  for t in sums:
    print(total_line(t))
  meta.update(skipped=skipped, skipped_cells=skipped_cells,
              seconds=time.perf_counter() - start)
  results = {"rows": rows,
             "fastest": [dict(projection=p, M=m, **b) for (p, m), b in best.items()],
             "totals": sums}
  harness.finish(f"bench_gemm ({meta['device_kind']}, bf16, {args.loop} over {args.layers} "
                 f"layers; µs per layer (× floor at {bandwidth / 1e9:.0f} GB/s, "
                 f"{rate / 1e12:.1f} TFLOP/s); fastest exact per cell):", header, lines,
                 meta=meta, results=results, json_path=args.json)
  baseline = [r for r in rows if r["candidate"] == "xla"]
  return 0 if all(r["exact"] for r in baseline) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # room for the child processes
  raise SystemExit(main())
