"""The one timing harness of the benchmarks: how a time is taken, against what floor, and how it is shown.

Timing (`time_side_by_side`): every argument is put on the device first (`on_device`: a NumPy
argument would be copied to the device on every call, and the copy timed instead of the program).
Each candidate runs `warmup` untimed calls (the first compiles), then `repeats` timed samples; a
sample is `calls` back-to-back calls and one ``jax.block_until_ready`` on all their outputs, divided
by `calls` (``calls=1``: one call with its launch and sync latency; more: device time, as a compiled
decoding loop sees it, plus 1/`calls` of a burst's start-up). The result is the median sample.
Candidates compared with each other are timed side by side in the same run, their samples
interleaved (the order rotating each repeat), so a ratio of two medians is not a ratio of two runs
under different clocks, temperatures or neighbours.

Floor (`floor_bandwidth`, `sampler_floor_seconds`): a memory-bound program cannot beat the bytes it
must move divided by the device's bandwidth: this run's best streaming copy on this device (read +
write counted; an H100 80 GB copies ~2.96 TB/s, an H200 ~4.27). A compute-bound program cannot beat
its FLOPs divided by this run's bf16 matrix rate (`matmul_rate`: a large bf16 product, measured once
per run). No card's rate is written into the code: every floor is the card's own, and `start_run`
prints the device beside both rates. On a CPU the ×floor columns say little.

Record (`metadata`): device, platform, jax version, Python, UTC date, git commit (``$GIT_COMMIT``
where the tree has no ``.git``, e.g. on the device machine), and ``$DSPARK_JAX_BACKEND``.
`finish` writes the JSON (``--json``) and prints the summary table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.kernels import dispatch

PIPELINE_CALLS = 50
"""Back-to-back calls per sample where device time is wanted. A burst costs the H200 ~0.3 ms of
idling until the host has dispatched the first calls (BENCHMARKS.md, issue 6, session 8); 50 calls
leave ~6 µs of it per call."""
COPY_BYTES = {"gpu": 2**30, "cpu": 64 * 2**20}
"""Array size of the bandwidth measurement per platform (others use the GPU's); `--small`: 8 MiB."""
SMALL_COPY_BYTES = 8 * 2**20
MATMUL_SIZE = {"gpu": 8192, "cpu": 1024}
"""n of the [n, n] bf16 product of `matmul_rate` per platform (others use the GPU's); `--small`: 256."""
SMALL_MATMUL_SIZE = 256


# ---- the record of a run -----------------------------------------------------------------------


def git_commit() -> str:
  """The checkout's commit (``+dirty`` with uncommitted changes), else ``$GIT_COMMIT``, else
  "unknown"."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=30).stdout.strip()
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return os.environ.get("GIT_COMMIT", "unknown")


def metadata(**extra) -> dict:
  """What a result depends on besides its shapes: device, versions, date, commit; plus `extra`."""
  device = jax.local_devices()[0]
  return {
      "device_kind": device.device_kind, "platform": device.platform,
      "jax_version": jax.__version__, "python": sys.version.split()[0],
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "git_commit": git_commit(), "backend_env": os.environ.get(dispatch.ENV_VAR), **extra,
  }


def describe_run(meta: dict) -> str:
  return (f"device {meta['device_kind']} ({meta['platform']}); jax {meta['jax_version']}; python "
          f"{meta['python']}; {meta['date_utc']}; commit {meta['git_commit']}")


def start_run(args: argparse.Namespace, **extra) -> tuple[dict, float]:
  """Records and prints the run (`metadata` with the common arguments and `extra`), measures this
  device's copy and bf16 matrix rates (printed beside the device's name); returns ``(meta,
  bandwidth the floors use)``."""
  meta = metadata(repeats=args.repeats, warmup=args.warmup, backend=getattr(args, "backend", None),
                  config=getattr(args, "config", ""), small=args.small, **extra)
  print(describe_run(meta), flush=True)
  bandwidth, _ = floor_bandwidth(args.small)
  rate = matmul_rate(args.small)
  meta.update(floor_bandwidth_gbs=bandwidth / 1e9, copy_bandwidth_gbs=bandwidth / 1e9,
              matmul_tflops=rate / 1e12)
  print(f"floors from this device ({meta['device_kind']}): copy {bandwidth / 1e9:.1f} GB/s, bf16 "
        f"matmul {rate / 1e12:.1f} TFLOP/s; median of {args.repeats} samples after {args.warmup} "
        "warm-up calls", flush=True)
  return meta, bandwidth


def each_shape(vocabs: Sequence[int], batches: Sequence[int],
               bench: Callable[[int, int], dict]) -> list[dict]:
  """``bench(vocab, batch)`` for every shape; a shape that raises gives a row
  ``{"vocab", "batch", "ok": False, "error"}`` and the others still run."""
  results = []
  for vocab in vocabs:
    for batch in batches:
      try:
        results.append(bench(vocab, batch))
      except Exception as exc:  # the other shapes' numbers still count; the failure is reported
        traceback.print_exc()
        results.append({"vocab": vocab, "batch": batch, "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"})
      gc.collect()  # drop this shape's device buffers before the next shape allocates its own
  return results


# ---- timing ------------------------------------------------------------------------------------


def on_device(tree):
  """`tree` on the default device, transferred and ready."""
  return jax.block_until_ready(jax.device_put(tree))


def program(fn, *args) -> Callable[[], Any]:
  """The thunk ``fn(*args)`` of a jitted `fn`, with ``thunk.compiled()``: its compiled program
  (from jit's cache, no second compile), whose HLO a profile reads (`benchmarks.bench_profile`)."""
  thunk = lambda: fn(*args)
  thunk.compiled = lambda: fn.lower(*args).compile()
  return thunk


def time_side_by_side(candidates: dict[str, Callable[[], Any]], *, repeats: int, warmup: int,
                      calls: int = 1) -> dict[str, float]:
  """Median seconds per call of each candidate (a function of no arguments returning arrays).

  After `warmup` calls of each, `repeats` samples of each, interleaved: sample i of every
  candidate is taken before sample i + 1 of any, starting at a rotating candidate. A sample times
  `calls` back-to-back calls and one sync on all their outputs, divided by `calls`.
  """
  if repeats < 1 or warmup < 0 or calls < 1:
    raise ValueError(f"repeats >= 1, warmup >= 0, calls >= 1; got {repeats}, {warmup}, {calls}")
  names = list(candidates)
  for name in names:
    for _ in range(warmup):
      jax.block_until_ready(candidates[name]())
  samples = {name: [] for name in names}
  for i in range(repeats):
    for j in range(len(names)):
      name = names[(i + j) % len(names)]
      fn = candidates[name]
      start = time.perf_counter()
      outs = [fn() for _ in range(calls)]
      jax.block_until_ready(outs)
      samples[name].append((time.perf_counter() - start) / calls)
      del outs
  return {name: statistics.median(samples[name]) for name in names}


def time_one(fn: Callable[[], Any], *, repeats: int, warmup: int, calls: int = 1) -> float:
  """`time_side_by_side` of one candidate."""
  return time_side_by_side({"": fn}, repeats=repeats, warmup=warmup, calls=calls)[""]


# ---- floors ------------------------------------------------------------------------------------


@functools.cache
def copy_bandwidth(nbytes: int) -> float:
  """This device's copy rate in bytes/s (read + write): the best of bf16 ``x + 1``, uint32
  ``x ^ c`` and float32 ``x * 2`` over `nbytes`, each timed back to back (a few samples)."""
  kernels = ((jnp.bfloat16, lambda a: a + 1), (jnp.uint32, lambda a: a ^ jnp.uint32(0x5A5A5A5A)),
             (jnp.float32, lambda a: a * 2))
  best = 0.0
  for dtype, fn in kernels:
    x = on_device(jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype))
    run = jax.jit(fn)
    seconds = time_one(lambda: run(x), repeats=5, warmup=2, calls=10)
    best = max(best, 2 * nbytes / seconds)
    del x
  return best


def floor_bandwidth(small: bool = False) -> tuple[float, float]:
  """``(bandwidth the floors use, this run's copy rate)`` in bytes/s: both this device's measured
  copy rate (the pair is kept for the callers that record both)."""
  platform = jax.local_devices()[0].platform
  nbytes = SMALL_COPY_BYTES if small else COPY_BYTES.get(platform, COPY_BYTES["gpu"])
  measured = copy_bandwidth(nbytes)
  return measured, measured


@functools.cache
def _matmul_rate(n: int) -> float:
  a = on_device(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16))
  b = on_device(jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16))
  run = jax.jit(jnp.matmul)
  seconds = time_one(lambda: run(a, b), repeats=5, warmup=2, calls=10)
  return 2 * n**3 / seconds


def matmul_rate(small: bool = False) -> float:
  """This device's bf16 matrix rate in FLOP/s: ``2·n³`` over the median time of a bf16
  [n, n] @ [n, n] product of random values (bf16 result), timed back to back (a few samples).
  n = 8192 on a GPU, 1024 elsewhere, 256 with `small`; measured once per process and size."""
  platform = jax.local_devices()[0].platform
  n = SMALL_MATMUL_SIZE if small else MATMUL_SIZE.get(platform, MATMUL_SIZE["gpu"])
  return _matmul_rate(n)


def sampler_floor_seconds(vocab: int, batch: int, gamma: int, rank: int, itemsize: int,
                          bandwidth: float) -> float:
  """HBM floor of a folded block: per step read W2 [r, V] and the base logits, write the
  corrected logits: ``γ·(r·V + 2·B·V)·itemsize / bandwidth``."""
  return gamma * (rank * vocab + 2 * batch * vocab) * itemsize / bandwidth


def free_device_bytes() -> int | None:
  """Bytes the first device's allocator can still hand out (its limit less what is in use), or
  None where the device reports no memory statistics (the CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def nbytes(tree) -> int:
  """Bytes of every array (or `jax.ShapeDtypeStruct`) in `tree`."""
  return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


# ---- checks ------------------------------------------------------------------------------------


def compare_blocks(ref_tokens, ref_logits, tokens, logits, *, exact: bool) -> dict:
  """Compares two drafted blocks of the same inputs: tokens [B, γ] and corrected logits [B, γ, V].

  Logits are compared at the positions whose earlier tokens agree (after a differing token the
  two blocks condition on different prefixes). `exact`: the same arithmetic (e.g. XLA against the
  eager path): tokens and logits must be equal bit for bit. Else (a kernel backend against XLA, or
  two kernel backends, which sum ``v @ W2`` in their own order): the logits must be close, within
  one unit in the last place of their dtype (``|a - b| <= eps·max(|a|, |b|) + 1e-3``); tokens may
  then differ at near-ties, and their agreement is only reported.

  Returns ``{"mode", "tokens_equal" (fraction), "logits_equal" (fraction of compared values),
  "logits_close" (bool), "max_abs_diff", "ok"}``.
  """
  ref_tokens, tokens = np.asarray(ref_tokens), np.asarray(tokens)
  tokens_equal = float(np.mean(ref_tokens == tokens))
  out = {"mode": "exact" if exact else "close", "tokens_equal": tokens_equal,
         "logits_equal": None, "logits_close": None, "max_abs_diff": None}
  if ref_logits is not None and logits is not None:
    a = np.asarray(jnp.asarray(ref_logits).astype(jnp.float32))
    b = np.asarray(jnp.asarray(logits).astype(jnp.float32))
    same = np.concatenate([np.ones_like(tokens[:, :1], bool),
                           np.cumprod(ref_tokens == tokens, axis=1)[:, :-1].astype(bool)], axis=1)
    a, b = a[same], b[same]
    equal = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
      diff = np.where(equal, 0.0, np.abs(a - b))
    eps = float(jnp.finfo(jnp.asarray(logits).dtype).eps)
    tolerance = eps * np.maximum(np.abs(a), np.abs(b)) + 1e-3
    out.update(logits_equal=float(np.mean(equal)) if equal.size else 1.0,
               logits_close=bool(np.all(equal | (diff <= tolerance))),
               max_abs_diff=float(np.nanmax(diff)) if diff.size else 0.0)
  if exact:
    out["ok"] = tokens_equal == 1.0 and out["logits_equal"] in (None, 1.0)
  else:
    out["ok"] = bool(out["logits_close"]) if out["logits_close"] is not None else True
  return out


def check_text(check: dict) -> str:
  """One word for a table cell: "exact", "close", or what failed."""
  if check["ok"]:
    return check["mode"] if check["tokens_equal"] == 1.0 else f"close/tok {check['tokens_equal']:.3f}"
  return "NO:tokens" if check["mode"] == "exact" and check["tokens_equal"] < 1.0 else "NO:logits"


# ---- arguments ---------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
  """argparse type: a comma list of positive integers."""
  try:
    values = [int(part) for part in text.split(",") if part.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
  """``--batches`` and ``--contexts``: the decode benchmarks' grid (comma lists)."""
  parser.add_argument("--batches", type=int_list, default=None,
                      help="comma list of batch sizes (default 1,16,64,128; --small: 2)")
  parser.add_argument("--contexts", type=int_list, default=None,
                      help="comma list of context lengths in tokens (default 1024,4096; --small: 32)")


def add_common_arguments(parser: argparse.ArgumentParser, *, repeats: int, warmup: int,
                         backend: bool = True) -> None:
  """--small, --repeats, --warmup, --json and (with `backend`) --backend and --config."""
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes and few repeats: a smoke check that takes seconds on a CPU")
  parser.add_argument("--repeats", type=int, default=None,
                      help=f"timed samples per measurement (default {repeats}; --small: 3)")
  parser.add_argument("--warmup", type=int, default=None,
                      help=f"untimed calls first (default {warmup}; --small: 1)")
  parser.add_argument("--json", metavar="PATH", help="also write every result as JSON to PATH")
  if backend:
    parser.add_argument("--backend", choices=("auto",) + tuple(b.value for b in dispatch.Backend),
                        default=None, help="what computes the folded blocks (default: "
                        f"${dispatch.ENV_VAR}, else auto; dspark_jax.kernels.dispatch)")
    parser.add_argument("--config", default="", metavar="KEY=VALUE,...",
                        help="settings of an explicit --backend, e.g. 'num_warps=8,rows=32' "
                        "(fields of XlaConfig / TritonConfig / HopperConfig)")
  parser.set_defaults(_default_repeats=repeats, _default_warmup=warmup)


DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
SMALL_BLOCK = {"vocab": [2048], "batch": [8]}


def add_block_arguments(parser: argparse.ArgumentParser, *, calls: int, small_calls: int) -> None:
  """The shapes of a folded-block benchmark: --vocab, --batch, --gamma, --rank, --dtype, and
  --calls (back-to-back calls per sample)."""
  parser.add_argument("--vocab", type=int_list, default=None,
                      help="comma list of vocab sizes V (default 129280,151936; --small: "
                      f"{SMALL_BLOCK['vocab'][0]})")
  parser.add_argument("--batch", type=int_list, default=None,
                      help="comma list of batch sizes B (default 1,8,64,128; --small: "
                      f"{SMALL_BLOCK['batch'][0]})")
  parser.add_argument("--gamma", type=int, default=7, help="block size γ (default 7)")
  parser.add_argument("--rank", type=int, default=256, help="head rank r (default 256)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                      help="logits and head weight dtype (default bf16)")
  parser.add_argument("--calls", type=int, default=None,
                      help=f"back-to-back calls per sample (default {calls}; --small: {small_calls})")
  parser.set_defaults(_block_calls=(calls, small_calls))


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
  """Fills --repeats / --warmup defaults and parses --config into ``args.backend_config``."""
  if args.repeats is None:
    args.repeats = 3 if args.small else args._default_repeats
  if args.warmup is None:
    args.warmup = 1 if args.small else args._default_warmup
  if args.repeats < 1 or args.warmup < 1:
    parser.error("--repeats and --warmup must be >= 1 (the first call compiles)")
  if hasattr(args, "_block_calls"):
    args.vocab = args.vocab or (SMALL_BLOCK["vocab"] if args.small else [129280, 151936])
    args.batch = args.batch or (SMALL_BLOCK["batch"] if args.small else [1, 8, 64, 128])
    args.calls = args.calls or args._block_calls[args.small]
    if args.gamma < 1 or args.rank < 1 or args.calls < 1:
      parser.error("--gamma, --rank and --calls: must be >= 1")
  if hasattr(args, "config"):
    try:
      args.backend_config = backend_config(args.backend, args.config)
    except ValueError as exc:
      parser.error(f"--config: {exc}")
  return args


def backend_config(backend: str | None, text: str):
  """The `dispatch` config of `backend` from ``"key=value,..."`` (None for an empty text).
  Values are ints, ``true``/``false`` or strings."""
  if not text:
    return None
  if backend in (None, "auto"):
    raise ValueError("settings need an explicit --backend (xla, triton or hopper)")
  kind = dispatch.CONFIG_TYPES[dispatch.Backend(backend)]
  fields = {f.name for f in dataclasses.fields(kind)}
  values = {}
  for pair in text.split(","):
    name, _, value = pair.partition("=")
    name, value = name.strip(), value.strip()
    if name not in fields:
      raise ValueError(f"{kind.__name__} has no field {name!r} (it has {sorted(fields)})")
    lowered = value.lower()
    values[name] = (lowered == "true" if lowered in ("true", "false")
                    else int(value) if value.lstrip("-").isdigit() else value)
  return kind(**values)


def describe_choice(choice: dispatch.Choice | None) -> str:
  return "n/a" if choice is None else f"{choice.name}: {choice.reason}"


# ---- output ------------------------------------------------------------------------------------


def cell(value, digits: int = 1) -> str:
  """A table cell: floats with `digits` decimals, None as "n/a"."""
  if value is None:
    return "n/a"
  if isinstance(value, float):
    return f"{value:.{digits}f}"
  return str(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence], markdown: bool = False
                 ) -> list[str]:
  """Right-aligned columns, each as wide as its widest cell; cells are strings already. With
  `markdown`, a Markdown table (``| a | b |``, right-aligned ``---:`` rule)."""
  widths = [max([len(h)] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]
  if markdown:
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    return [line(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [
        line(r) for r in rows]
  line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
  return [line(header), "-" * len(line(header))] + [line(r) for r in rows]


def finish(title: str, header: Sequence[str], rows: Sequence[Sequence], *, meta: dict,
           results: Any, json_path: str | None, markdown: bool = False) -> None:
  """Writes ``{"meta", "results"}`` to `json_path` (if given), then prints `title` and the table
  (`format_table`, `markdown` or not): the last thing a benchmark prints."""
  if json_path:
    directory = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(directory, exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
      json.dump({"meta": meta, "results": results}, f, indent=2, ensure_ascii=False, default=str)
      f.write("\n")
    print(f"results written to {json_path}")
  print()
  print(title)
  for text in format_table(header, rows, markdown):
    print(text)
  sys.stdout.flush()


def run_block_benchmark(args: argparse.Namespace, name: str,
                        bench_shape: Callable[[int, int, argparse.Namespace, float], dict],
                        header: Sequence[str], table_row: Callable[[dict], list[str]],
                        legend: str) -> int:
  """The main of a folded-block benchmark (`add_block_arguments`): `bench_shape(vocab, batch,
  args, bandwidth)` at every shape, then the table. Exit status 1 if a shape failed its check."""
  meta, bandwidth = start_run(args, vocab=args.vocab, batch=args.batch, gamma=args.gamma,
                              rank=args.rank, dtype=args.dtype, calls=args.calls)
  results = each_shape(args.vocab, args.batch,
                       lambda vocab, batch: bench_shape(vocab, batch, args, bandwidth))
  finish(f"{name} ({meta['device_kind']}, {args.dtype}, γ={args.gamma}, r={args.rank}, floor at "
         f"{bandwidth / 1e9:.1f} GB/s; {legend}):", header, [table_row(r) for r in results],
         meta=meta, results=results, json_path=args.json)
  return 0 if all(r["ok"] for r in results) else 1
