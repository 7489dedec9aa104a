"""The GPU timeline of one folded sampler call: every kernel, its duration and the gap before it.

Where `profile_sampler.py` (Nsight Compute) measures each kernel alone and cannot run the sampling
programs, this records the calls with JAX's profiler (CUPTI) and reads the kernel events back from
the Perfetto trace it writes. The calls are separated by host pauses, so the last call's kernels are
the last burst of GPU events. It answers "how much of the call is kernels, how much is the time
between them, and which kernels are the small ones".

  PYTHONPATH=. python3 scripts/trace_sampler.py --vocab 129280 --batch 1 --form pallas

`--form` takes `proposal.FORMS`, "auto", or a Pallas variant of `explore_sampler.PALLAS_VARIANTS`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402
import explore_sampler  # noqa: E402


def gpu_kernel_events(trace_file):
  """[(start µs, duration µs, name)] of the events on GPU stream tracks, in start order."""
  with gzip.open(trace_file, "rt") as f:
    events = json.load(f)["traceEvents"]
  process, thread = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e["pid"], e["tid"])] = e["args"]["name"]
  kernels = []
  for e in events:
    if e.get("ph") != "X" or "GPU" not in process.get(e["pid"], ""):
      continue
    track = thread.get((e["pid"], e["tid"]), "")
    if "Stream" not in track or "Memcpy" in e["name"]:
      continue
    kernels.append((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
  return sorted(kernels)


def track_names(trace_file):
  """{process name: [thread names]} of a trace (to see how a profiler version names the tracks)."""
  with gzip.open(trace_file, "rt") as f:
    events = json.load(f)["traceEvents"]
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  names = collections.defaultdict(set)
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      names[process.get(e["pid"], e["pid"])].add(e["args"]["name"])
  return {p: sorted(t)[:12] for p, t in names.items()}


def last_burst(kernels, pause_us=2000.0):
  """The kernels after the last gap longer than `pause_us` (the last call)."""
  start = 0
  for i in range(1, len(kernels)):
    if kernels[i][0] - (kernels[i - 1][0] + kernels[i - 1][1]) > pause_us:
      start = i
  return kernels[start:]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, default=129280)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--form", default="auto")
  parser.add_argument("--greedy-only", action="store_true")
  parser.add_argument("--compact", action="store_true",
                      help="the sampling variant with store_logits=False (proposal.CompactLogits)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--rank", type=int, default=256)
  parser.add_argument("--out", default=None, help="folder for the trace (default: a temporary one)")
  parser.add_argument("--in-program", type=int, default=0, metavar="N",
                      help="trace N calls chained inside one program instead "
                           "(explore_sampler.chained_program)")
  parser.add_argument("--b2b", type=int, default=0, metavar="N",
                      help="also trace N back-to-back calls: per call, its start-to-start time, "
                           "its kernels' time and the idle time before it")
  args = parser.parse_args(argv)
  head = heads.MarkovHead.random("vanilla", vocab_size=args.vocab, rank=args.rank,
                                 rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  batch, gamma = args.batch, args.gamma
  base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, args.vocab))).astype(jnp.bfloat16)
  temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
  call_args = bench_sampler.folded_args(  # the head's arrays as generate has them
      head, base, np.arange(batch), sp.SamplingParams(temperature=temperature),
      np.full(batch, 1000), jax.random.key(0))
  options = dict(greedy_only=args.greedy_only, form=args.form.split("-")[0],
                 pallas_options=explore_sampler.PALLAS_VARIANTS.get(args.form, ()),
                 store_logits=not args.compact)
  if args.in_program:
    compiled = explore_sampler.chained_program(args.in_program, **options).lower(
        *call_args).compile()
  else:
    compiled = proposal.folded_block.lower(*call_args, kind="vanilla", **options).compile()
  b2b = explore_sampler.b2b_seconds(compiled, call_args)
  out = args.out or tempfile.mkdtemp()
  with jax.profiler.trace(out, create_perfetto_trace=True):
    for _ in range(3):
      time.sleep(0.02)  # a host pause between calls separates their kernels on the timeline
      jax.block_until_ready(compiled(*call_args))
  files = glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise SystemExit(f"no Perfetto trace under {out}")
  kernels = last_burst(gpu_kernel_events(max(files, key=os.path.getmtime)))
  if not kernels:
    raise SystemExit(f"no GPU stream events in the trace; its tracks: {track_names(files[0])}")
  variant = "greedy-only" if args.greedy_only else "compact" if args.compact else "sampling"
  span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
  busy = sum(d for _, d, _ in kernels)
  print(f"V={args.vocab} B={batch} {variant} form={args.form}: {len(kernels)} kernels, "
        f"span {span:.1f} µs, kernels {busy:.1f} µs, gaps {span - busy:.1f} µs; back-to-back "
        f"calls {b2b * 1e6:.1f} µs each")
  end = kernels[0][0]
  for start, duration, name in kernels:
    print(f"  gap {start - end:6.1f}  {duration:7.1f} µs  {name[:90]}")
    end = start + duration
  by_name = collections.defaultdict(list)
  for _, duration, name in kernels:
    by_name[name[:60]].append(duration)
  print("  by kernel: " + "; ".join(f"{n} x{len(d)} {sum(d):.1f}" for n, d in
                                    sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]))
  if args.b2b:
    back_to_back(compiled, call_args, args.b2b, len(kernels), tempfile.mkdtemp())


def back_to_back(compiled, call_args, calls, per_call, out):
  """Traces `calls` back-to-back calls of `per_call` kernels each and prints, per call, the
  start-to-start time, the time its kernels ran and the GPU's idle time before it."""
  with jax.profiler.trace(out, create_perfetto_trace=True):
    time.sleep(0.02)
    jax.block_until_ready([compiled(*call_args) for _ in range(calls)])
  files = glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)
  kernels = last_burst(gpu_kernel_events(max(files, key=os.path.getmtime)))
  if len(kernels) != calls * per_call:
    print(f"  back to back: {len(kernels)} kernels, not {calls} x {per_call}; first ones: "
          f"{[k[2][:30] for k in kernels[:per_call + 3]]}")
    return
  rows, end = [], None
  for i in range(calls):
    call = kernels[i * per_call:(i + 1) * per_call]
    start = call[0][0]
    busy = sum(d for _, d, _ in call)
    rows.append((start, busy, None if end is None else start - end,
                 call[-1][0] + call[-1][1] - start))
    end = call[-1][0] + call[-1][1]
  starts = [r[0] for r in rows]
  print(f"  back to back, {calls} calls: start-to-start "
        f"{np.median(np.diff(starts)):.1f} µs (median), span {np.median([r[3] for r in rows]):.1f}"
        f", kernels {np.median([r[1] for r in rows]):.1f}, idle before a call "
        f"{np.median([r[2] for r in rows[1:]]):.1f}")
  for start, busy, idle, span in rows:
    print(f"    call at {start - starts[0]:8.1f} µs: span {span:6.1f}, kernels {busy:6.1f}, idle "
          f"before {'-' if idle is None else f'{idle:.1f}'}")


if __name__ == "__main__":
  main()
