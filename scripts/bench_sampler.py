"""Benchmark of the folded draft-block sampler against the eager path (SPEC §9).

For every (V, B) it builds a vanilla Markov head with random weights and a `DraftSampler` in FORCE
mode with ``max_batch_size=B`` (so the bucket is B and nothing is padded), then times, as the
median of ``--repeats`` calls after ``--warmup`` calls (each call: ``time.perf_counter`` around the
call plus ``jax.block_until_ready`` on its outputs):

* folded sampling: the compiled sampling variant called directly on a mixed batch (device program);
* folded greedy-only: the compiled greedy-only variant on an all-greedy batch;
* ``propose()``: `DraftSampler.propose` end to end on the mixed batch (adds host-side routing);
* eager: `proposal.sample_block_eager` on the mixed batch (γ separate step programs from Python);
* torch CUDA graph (when torch with CUDA is importable): the same loop in PyTorch with a per-step
  exponential-noise buffer, captured once and replayed (`scripts/torch_reference.py`; SGLang's
  approach), timed per replay over back-to-back replays, so it compares with the "b2b" columns.

Each time is set against an HBM floor: per step the program must read the r×V projection W2, read
the step's base logits and write the corrected logits, so
``floor = γ·(r·V + 2·B·V)·itemsize / bandwidth``, with the bandwidth measured here by a large
device-to-device copy (``x + 1``: read + write) off the GPU, and SPEC §9's 4.27 TB/s on it. Per shape it also checks that the folded tokens
equal the eager ones, and reads XLA's memory analysis of the sampling variant: a temporary area of
at least B·V·4 bytes more than the greedy-only one needs flags a materialised [B, V] float32 noise or
score buffer ("noise buf?"; the raw temporary area is coarse: weight upcasts and the [B, V] float32 bias live there too). The table
shows how much temporary memory the sampling variant needs beyond the greedy-only one
("Δgreedy MiB"), which draws no noise at all. The floor only means something on a GPU: on CPU the
bf16 copy is compute-bound.

Run (from the repository root):

  CPU smoke check (small shapes, well under a minute):
    PYTHONPATH=. python3 scripts/bench_sampler.py --small
  GPU, full shapes (V = 129280, 151936; B = 1, 8, 64, 128; γ = 7; r = 256; bf16):
    PYTHONPATH=. python3 scripts/bench_sampler.py

``--json PATH`` writes every result as JSON; if ``$OUT`` is set, ``$OUT/bench_sampler.json`` and a
copy of the text output, ``$OUT/bench_sampler.log``, are written too. The summary table is last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import proposer as draft_sampler
from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference  # noqa: E402  (scripts/torch_reference.py)

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
MIN_REPEATS = 20
SAMPLED_TEMPERATURE = 0.8
COPY_BYTES = {"gpu": 2**30, "cpu": 64 * 2**20}  # other platforms use the GPU size
MiB = 2**20


# ---- output ------------------------------------------------------------------------------------


class Report:
  """Prints lines to stdout and, when asked, mirrors them into a log file as they come."""

  def __init__(self, log_path: str | None):
    self._log = open(log_path, "w", encoding="utf-8") if log_path else None

  def line(self, text: str = "") -> None:
    print(text, flush=True)
    if self._log:
      self._log.write(text + "\n")
      self._log.flush()

  def close(self) -> None:
    if self._log:
      self._log.close()


# ---- arguments ---------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
  try:
    values = [int(part) for part in text.split(",") if part.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--vocab", type=_int_list, default=_int_list("129280,151936"),
                      help="comma list of vocab sizes V (default 129280,151936)")
  parser.add_argument("--batch", type=_int_list, default=_int_list("1,8,64,128"),
                      help="comma list of batch sizes B (default 1,8,64,128)")
  parser.add_argument("--gamma", type=int, default=7, help="block size γ (default 7)")
  parser.add_argument("--rank", type=int, default=256, help="head rank r (default 256)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                      help="logits and head weight dtype (default bf16)")
  parser.add_argument("--repeats", type=int, default=30,
                      help=f"timed calls per measurement, >= {MIN_REPEATS} (default 30)")
  parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
  parser.add_argument("--calls", type=int, default=PIPELINE_CALLS,
                      help=f"back-to-back calls per timed burst (default {PIPELINE_CALLS})")
  parser.add_argument("--small", action="store_true",
                      help="CPU smoke mode: vocab 4096, batch 1,8, repeats 20 (overrides those)")
  parser.add_argument("--json", metavar="PATH", help="also write all results as JSON to PATH")
  args = parser.parse_args(argv)
  if args.small:
    args.vocab, args.batch, args.repeats = [4096], [1, 8], MIN_REPEATS
  if args.repeats < MIN_REPEATS:
    parser.error(f"--repeats: must be >= {MIN_REPEATS} for a stable median, got {args.repeats}")
  if args.warmup < 1:
    parser.error(f"--warmup: must be >= 1 (the first call may compile), got {args.warmup}")
  if args.gamma < 1 or args.rank < 1:
    parser.error("--gamma and --rank: must be >= 1")
  return args


# ---- timing ------------------------------------------------------------------------------------


def median_seconds(fn, repeats: int, warmup: int) -> float:
  """Median seconds of ``fn()`` until its outputs are ready: `repeats` calls after `warmup`."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


SPEC_COPY_RATE = 4.27e12  # bytes/s: SPEC §9's measured H200 copy rate, the floor's denominator


def copy_bandwidth(platform: str, repeats: int, warmup: int) -> tuple[float, int]:
  """Device copy rate in bytes/s (bytes = read + write): the best of a few streaming kernels.

  Each kernel reads a large array once and writes a fresh one (no donation, so no aliasing). The
  best of bf16 ``x + 1``, uint32 ``x ^ c`` and float32 ``x * 2`` is taken, each timed as the
  median per-call time of back-to-back calls, so launch overhead is not counted as memory time.
  """
  nbytes = COPY_BYTES.get(platform, COPY_BYTES["gpu"])
  kernels = ((jnp.bfloat16, lambda a: a + 1), (jnp.uint32, lambda a: a ^ jnp.uint32(0x5A5A5A5A)),
             (jnp.float32, lambda a: a * 2))
  best = 0.0
  for dtype, fn in kernels:
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    seconds = pipelined_seconds(jax.jit(fn), (x,), repeats, warmup, calls=20)
    best = max(best, 2 * nbytes / seconds)
    del x
  return best, nbytes


PIPELINE_CALLS = 50
"""Back-to-back calls per timed burst. Each burst costs about 0.3 ms on the H200 that the GPU does
not spend on the calls: it idles until the host has dispatched the first few (traced with
``trace_sampler.py --b2b``; BENCHMARKS.md, issue 6, session 8). 50 calls leave ~6 µs of it per call;
issue 6's runs before session 8 used 10 (~30 µs per call)."""


def pipelined_seconds(fn, args, repeats: int, warmup: int, calls: int = PIPELINE_CALLS) -> float:
  """Median per-call seconds of `calls` back-to-back calls (one sync at the end): device time,
  plus 1/`calls` of the burst's start-up (`PIPELINE_CALLS`)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / calls)
    del outs
  return statistics.median(times)


def floor_seconds(vocab: int, batch: int, gamma: int, rank: int, itemsize: int,
                  bandwidth: float) -> float:
  """HBM floor of a folded call: each step reads W2 and base logits, writes corrected logits."""
  return gamma * (rank * vocab * itemsize + 2 * batch * vocab * itemsize) / bandwidth


# ---- one shape ---------------------------------------------------------------------------------


def mixed_params(batch: int) -> sp.SamplingParams:
  """Even rows greedy, odd rows sampled; a lone row is sampled, so there is always a sampled row."""
  if batch == 1:
    temperature = np.array([SAMPLED_TEMPERATURE])
  else:
    temperature = np.where(np.arange(batch) % 2 == 0, 0.0, SAMPLED_TEMPERATURE)
  return sp.SamplingParams(temperature=temperature, seed=np.arange(batch))


def greedy_params(batch: int) -> sp.SamplingParams:
  return sp.SamplingParams(temperature=np.zeros(batch), seed=np.arange(batch))


def random_logits(batch: int, gamma: int, vocab: int, dtype) -> jax.Array:
  """[B, γ, V] normal·3 logits in `dtype` (drawn in float32 inside one fused program)."""
  draw = jax.jit(lambda k: (3.0 * jax.random.normal(k, (batch, gamma, vocab), jnp.float32)
                            ).astype(dtype))
  return draw(jax.random.key(1))


def folded_args(head, base_logits, anchor, params, positions, key) -> tuple:
  """The arguments `DraftSampler.propose` passes to a compiled variant (vanilla, no confidence):
  the head's arrays prepared where the Hopper kernels may read them (`proposal.reads_w2_parts`)."""
  rows = proposal.block_arrays(params, anchor, positions)
  arrays = proposal.head_arrays_for(head.arrays(), base_logits.shape[0])
  # On the device, as inside a decoding loop: numpy arguments would be copied to the GPU on every
  # call, and back-to-back calls would then time those copies rather than the program.
  return jax.device_put((arrays, None, base_logits, rows["anchor"], None, rows["greedy"],
                         rows["temperature"], rows["seeds"], rows["positions"], key))


def temp_bytes(compiled) -> int | None:
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def bench_shape(vocab: int, batch: int, args, dtype, bandwidth: float, report: Report) -> dict:
  """Builds the head and sampler for one (V, B), checks the folded tokens, times the four paths."""
  gamma, rank = args.gamma, args.rank
  itemsize = jnp.dtype(dtype).itemsize
  head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                 dtype=dtype)
  start = time.perf_counter()
  sampler = draft_sampler.build_draft_sampler(head, max_batch_size=batch, vocab_size=vocab,
                                              gamma=gamma, logits_dtype=dtype, mode="force")
  build_s = time.perf_counter() - start
  sampling_exe = sampler.compile_variant(False, batch)
  greedy_exe = sampler.compile_variant(True, batch)

  base_logits = random_logits(batch, gamma, vocab, dtype)
  anchor = jnp.asarray(np.arange(batch) % vocab, jnp.int32)
  positions = jnp.full((batch,), 1000, jnp.int32)
  key = jax.random.key(0)
  mixed, greedy = mixed_params(batch), greedy_params(batch)
  mixed_args = folded_args(head, base_logits, anchor, mixed, positions, key)
  greedy_args = folded_args(head, base_logits, anchor, greedy, positions, key)

  # Correctness once: the folded program must reproduce the eager reference bit for bit.
  tokens, corrected, _ = jax.block_until_ready(sampling_exe(*mixed_args))
  eager = jax.block_until_ready(
      proposal.sample_block_eager(head, base_logits, anchor, None, mixed, key, positions))
  tokens_match = bool(np.array_equal(np.asarray(tokens), np.asarray(eager.tokens)))
  logits_match = bool(np.array_equal(np.asarray(corrected.astype(jnp.float32)),
                                     np.asarray(eager.corrected_logits.astype(jnp.float32))))
  block = sampler.propose(base_logits, anchor, None, mixed, key, positions)
  propose_path = block.path
  propose_match = bool(np.array_equal(np.asarray(block.tokens), np.asarray(tokens)))
  del tokens, corrected, eager, block

  def timed(fn):
    return median_seconds(fn, args.repeats, args.warmup)

  folded_s = timed(lambda: sampling_exe(*mixed_args))
  greedy_s = timed(lambda: greedy_exe(*greedy_args))
  # Back-to-back calls hide launch and sync latency: closer to what a compiled decoding loop sees.
  folded_pipe_s = pipelined_seconds(sampling_exe, mixed_args, args.repeats, args.warmup,
                                    args.calls)
  greedy_pipe_s = pipelined_seconds(greedy_exe, greedy_args, args.repeats, args.warmup,
                                    args.calls)
  propose_s = timed(lambda: sampler.propose(base_logits, anchor, None, mixed, key, positions))
  eager_s = timed(lambda: proposal.sample_block_eager(head, base_logits, anchor, None, mixed, key,
                                                      positions))

  # The same loop in PyTorch captured in a CUDA graph (SGLang's approach), when torch has CUDA.
  torch_us = None
  if torch_reference.available():
    torch_run = torch_reference.time_cuda_graph(
        np.asarray(head.arrays()["w1"], np.float32), np.asarray(head.arrays()["w2"], np.float32),
        np.asarray(base_logits.astype(jnp.float32)), np.asarray(anchor),
        np.asarray(mixed.temperature), repeats=args.repeats, warmup=args.warmup,
        replays_per_sample=args.calls)
    torch_us = torch_run["us"]

  temp, greedy_temp = temp_bytes(sampling_exe), temp_bytes(greedy_exe)
  # The greedy-only program draws no noise, so its temporaries (weight upcasts, the [B, V] bias,
  # ...) are the baseline; what the sampling variant adds on top is where a noise buffer would show.
  extra = None if temp is None or greedy_temp is None else temp - greedy_temp
  noise_limit = batch * vocab * 4
  floor_s = floor_seconds(vocab, batch, gamma, rank, itemsize, bandwidth)
  result = {
      "vocab": vocab, "batch": batch, "gamma": gamma, "rank": rank,
      "dtype": str(jnp.dtype(dtype)), "build_s": build_s,
      "floor_us": 1e6 * floor_s, "folded_sampling_us": 1e6 * folded_s,
      "folded_greedy_us": 1e6 * greedy_s, "propose_us": 1e6 * propose_s,
      "folded_sampling_pipelined_us": 1e6 * folded_pipe_s,
      "folded_greedy_pipelined_us": 1e6 * greedy_pipe_s,
      "pipelined_x_floor": folded_pipe_s / floor_s,
      "greedy_pipelined_x_floor": greedy_pipe_s / floor_s,
      "eager_us": 1e6 * eager_s,
      "torch_cuda_graph_us": torch_us,
      "torch_x_floor": None if torch_us is None else torch_us / (1e6 * floor_s),
      "torch_over_folded_b2b": None if torch_us is None else torch_us / (1e6 * folded_pipe_s),
      "folded_x_floor": folded_s / floor_s, "greedy_x_floor": greedy_s / floor_s,
      "eager_over_folded": eager_s / folded_s,
      "tokens_equal_eager": tokens_match, "corrected_equal_eager": logits_match,
      "propose_path": propose_path, "propose_tokens_equal_folded": propose_match,
      "sampling_temp_bytes": temp, "greedy_temp_bytes": greedy_temp,
      "sampling_extra_temp_bytes": extra,
      "noise_buffer_limit_bytes": noise_limit,
      # Flagged when the sampling variant needs a [B, V] float32 buffer more than greedy-only.
      "noise_buffer": None if extra is None else extra >= noise_limit,
      "gate": sampler.decision.summary() if sampler.decision else None,
      "compilations": sampler.compilations,
  }
  report.line(f"V={vocab} B={batch}: build {build_s:.1f} s, {sampler.compilations} programs; "
              f"propose path {propose_path}; tokens==eager {tokens_match}, "
              f"corrected==eager {logits_match}, propose==folded {propose_match}")
  report.line(f"  folded {1e6 * folded_s:.1f} µs, greedy-only {1e6 * greedy_s:.1f} µs, "
              f"propose {1e6 * propose_s:.1f} µs, eager {1e6 * eager_s:.1f} µs, "
              f"floor {1e6 * floor_s:.1f} µs; back-to-back: folded {1e6 * folded_pipe_s:.1f} µs, "
              f"greedy-only {1e6 * greedy_pipe_s:.1f} µs; torch CUDA graph "
              f"{'n/a' if torch_us is None else f'{torch_us:.1f} µs'}")
  report.line(f"  temp: sampling {_mib(temp)} MiB, greedy-only {_mib(greedy_temp)} MiB, "
              f"difference {_mib(extra)} MiB; a [B, V] f32 noise buffer is "
              f"{noise_limit / MiB:.2f} MiB")
  # Drop every device buffer of this shape before the next one is allocated.
  del mixed_args, greedy_args, base_logits, sampling_exe, greedy_exe, sampler, head
  gc.collect()
  return result


# ---- summary -----------------------------------------------------------------------------------


def _mib(n) -> str:
  return "n/a" if n is None else f"{n / MiB:.2f}"


COLUMNS = (("V", 7), ("B", 4), ("floor µs", 9), ("folded µs", 10), ("×floor", 7),
           ("greedy µs", 10), ("×floor", 7), ("fold b2b", 9), ("×floor", 7), ("greedy b2b", 10),
           ("×floor", 7), ("propose µs", 11), ("eager µs", 10),
           ("eager/fold", 10), ("torch µs", 9), ("×floor", 7), ("==eager", 7), ("temp MiB", 9),
           ("Δgreedy MiB", 11),
           ("noise buf?", 10))


def table_lines(results: list[dict]) -> list[str]:
  header = " ".join(name.rjust(width) for name, width in COLUMNS)
  lines = [header, "-" * len(header)]
  for r in results:
    if "error" in r:
      lines.append(f"{r['vocab']:>7} {r['batch']:>4}  FAILED: {r['error']}")
      continue
    cells = (r["vocab"], r["batch"], f"{r['floor_us']:.1f}", f"{r['folded_sampling_us']:.1f}",
             f"{r['folded_x_floor']:.2f}", f"{r['folded_greedy_us']:.1f}",
             f"{r['greedy_x_floor']:.2f}", f"{r['folded_sampling_pipelined_us']:.1f}",
             f"{r['pipelined_x_floor']:.2f}", f"{r['folded_greedy_pipelined_us']:.1f}",
             f"{r['greedy_pipelined_x_floor']:.2f}", f"{r['propose_us']:.1f}", f"{r['eager_us']:.1f}",
             f"{r['eager_over_folded']:.2f}",
             "n/a" if r.get("torch_cuda_graph_us") is None else f"{r['torch_cuda_graph_us']:.1f}",
             "n/a" if r.get("torch_x_floor") is None else f"{r['torch_x_floor']:.2f}",
             "yes" if r["tokens_equal_eager"] else "NO",
             _mib(r["sampling_temp_bytes"]), _mib(r["sampling_extra_temp_bytes"]),
             "n/a" if r["noise_buffer"] is None else ("yes" if r["noise_buffer"] else "no"))
    lines.append(" ".join(str(c).rjust(width) for c, (_, width) in zip(cells, COLUMNS)))
  return lines


def ratio_table(rows: list[dict], names: list[str]) -> list[str]:
  """Markdown lines: per row (keys V, B, floor and each name, in seconds) µs and × the floor."""
  lines = ["| V | B | floor µs | " + " | ".join(f"{n} µs (×floor)" for n in names) + " |",
           "|---:|---:|---:|" + "---:|" * len(names)]
  for row in rows:
    cells = " | ".join(f"{row[n] * 1e6:.1f} ({row[n] / row['floor']:.2f})" if n in row else "n/a"
                       for n in names)
    lines.append(f"| {row['V']} | {row['B']} | {row['floor'] * 1e6:.1f} | {cells} |")
  return lines


def write_json(path: str, meta: dict, results: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2, ensure_ascii=False)
    f.write("\n")


# ---- main --------------------------------------------------------------------------------------


def main(argv=None) -> int:
  args = parse_args(argv)
  out_dir = os.environ.get("OUT")
  report = Report(os.path.join(out_dir, "bench_sampler.log") if out_dir else None)
  dtype = DTYPES[args.dtype]
  device = jax.local_devices()[0]
  meta = {
      "device_kind": device.device_kind, "platform": device.platform,
      "jax_version": jax.__version__, "python": sys.version.split()[0],
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "vocab": args.vocab, "batch": args.batch, "gamma": args.gamma, "rank": args.rank,
      "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup, "small": args.small,
  }
  report.line(f"device: {meta['device_kind']} ({meta['platform']}); jax {meta['jax_version']}; "
              f"python {meta['python']}; {meta['date_utc']}")
  report.line(f"shapes: V={args.vocab} B={args.batch} γ={args.gamma} r={args.rank} "
              f"dtype={args.dtype}; median of {args.repeats} calls after {args.warmup} warm-up")

  measured, copy_bytes = copy_bandwidth(device.platform, args.repeats, args.warmup)
  # On a GPU the floor uses SPEC §9's copy rate (the issue's yardstick), not this run's copy.
  bandwidth = SPEC_COPY_RATE if device.platform == "gpu" else measured
  meta.update(copy_bandwidth_gbs=measured / 1e9, copy_array_bytes=copy_bytes,
              floor_bandwidth_gbs=bandwidth / 1e9)
  report.line(f"copy bandwidth: {measured / 1e9:.1f} GB/s (best of bf16 x+1, u32 x^c, f32 x*2 on "
              f"{copy_bytes / MiB:.0f} MiB, read + write counted); floor at {bandwidth / 1e9:.1f} GB/s")

  results = []
  for vocab in args.vocab:
    for batch in args.batch:
      try:
        results.append(bench_shape(vocab, batch, args, dtype, bandwidth, report))
      except Exception as exc:  # keep the other shapes' numbers; the failure is reported
        traceback.print_exc()
        report.line(f"V={vocab} B={batch}: FAILED: {type(exc).__name__}: {exc}")
        results.append({"vocab": vocab, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()

  json_paths = [args.json] if args.json else []
  if out_dir:
    json_paths.append(os.path.join(out_dir, "bench_sampler.json"))
  for path in json_paths:
    write_json(path, meta, results)
  report.line()
  if json_paths:
    report.line(f"results written to {', '.join(json_paths)}")
  report.line(f"summary ({meta['device_kind']}, {args.dtype}, γ={args.gamma}, r={args.rank}, "
              f"floor at {bandwidth / 1e9:.1f} GB/s):")
  for text in table_lines(results):
    report.line(text)
  report.close()
  failed = any("error" in r or not r["tokens_equal_eager"] for r in results)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
