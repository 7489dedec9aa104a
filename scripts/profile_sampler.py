"""Runs one folded block call between profiler start/stop marks, for Nsight Compute (issue 6).

Compiles `proposal.folded_block` at one shape, form and variant, warms it up, then runs exactly one
call inside ``cudaProfilerStart``/``Stop`` so that

  ncu --clock-control none --profile-from-start off --csv \\
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
      python3 scripts/profile_sampler.py --form pallas --batch 1

lists every kernel of that call with its duration and DRAM traffic: which part of a step costs what.
For one step kernel's full sections (occupancy, registers, stalls), select it instead, e.g.
``ncu ... -k regex:^_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section
Occupancy --section WarpStateStats``, with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (BENCHMARKS.md).
`summarize` turns ncu's CSV into a per-kernel table (run it on the log: ``--summarize LOG``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import glob
import os

import numpy as np


def _profiler():
  """(start, stop) of the CUDA profiler: CuPy's wrappers when importable, else libcudart."""
  try:
    from cupy.cuda import runtime
    return runtime.profilerStart, runtime.profilerStop
  except ImportError:
    paths = sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*")) or ["libcudart.so"]
    lib = ctypes.CDLL(paths[0])
    return lib.cudaProfilerStart, lib.cudaProfilerStop


def run(args):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from dspark_jax.draft import heads
  from dspark_jax.draft import block as proposal
  from dspark_jax.sampling import params as sp

  gamma, rank, vocab, batch = 7, 256, args.vocab, args.batch
  head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                 dtype=jnp.bfloat16)
  base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(jnp.bfloat16)
  temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
  r = proposal.block_arrays(sp.SamplingParams(temperature=temperature), np.arange(batch) % vocab,
                            np.full(batch, 1000))
  arrays = proposal.head_arrays_for(head.arrays(), batch)  # as `generate` has them
  call_args = (arrays, None, base, r["anchor"], None, r["greedy"], r["temperature"],
               r["seeds"], r["positions"], jax.random.key(0))
  options = tuple((name, int(value)) for name, value in
                  (pair.split("=") for pair in args.options.split(",") if pair))
  compiled = proposal.folded_block.lower(*call_args, kind="vanilla", greedy_only=args.greedy,
                                         form=args.form, pallas_options=options).compile()
  for _ in range(3):
    jax.block_until_ready(compiled(*call_args))
  start, stop = _profiler()
  start()
  jax.block_until_ready(compiled(*call_args))
  stop()


def summarize(path):
  """Per kernel name: count, total µs, DRAM MB read/written (from ncu's --csv output)."""
  with open(path) as f:
    lines = [line for line in f if line.startswith('"')]
  rows = collections.OrderedDict()
  for rec in csv.DictReader(lines):
    name = rec["Kernel Name"][:60]
    entry = rows.setdefault(name, {"n": 0, "us": 0.0, "read": 0.0, "write": 0.0, "ids": set()})
    value = float(rec["Metric Value"].replace(",", ""))
    metric = rec["Metric Name"]
    if metric == "gpu__time_duration.sum":
      entry["us"] += value / 1e3 if rec["Metric Unit"] in ("nsecond", "ns") else value
      entry["n"] += 1
    elif metric == "dram__bytes_read.sum":
      entry["read"] += value / 1e6
    elif metric == "dram__bytes_write.sum":
      entry["write"] += value / 1e6
  total = sum(e["us"] for e in rows.values())
  print(f"{'kernel':60s} {'n':>3s} {'µs':>8s} {'MB rd':>8s} {'MB wr':>8s} {'GB/s':>7s}")
  for name, e in sorted(rows.items(), key=lambda kv: -kv[1]["us"]):
    rate = (e["read"] + e["write"]) / e["us"] * 1e3 if e["us"] else 0.0
    print(f"{name:60s} {e['n']:3d} {e['us']:8.1f} {e['read']:8.1f} {e['write']:8.1f} {rate:7.0f}")
  print(f"{'total kernel time':60s} {sum(e['n'] for e in rows.values()):3d} {total:8.1f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--form", default="pallas")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--vocab", type=int, default=129280)
  parser.add_argument("--greedy", action="store_true")
  parser.add_argument("--options", default="", help="kernel settings, e.g. 'late_base=1,rows=32'")
  parser.add_argument("--summarize", metavar="LOG")
  args = parser.parse_args()
  if args.summarize:
    summarize(args.summarize)
  else:
    run(args)


if __name__ == "__main__":
  main()
