"""What streaming W2 γ times in a dependent chain costs on this device, with no sampler around it.

The HBM floor of issue 6 (SPEC §9) divides the bytes by a long copy's rate. A draft block cannot
stream like one long copy: each step reads W2 (r·V·2 bytes, 66 MB at V = 129280) only after the
previous step's token is known. This times γ dependent full reads of W2 in XLA, each a max over
``W2 + s`` where ``s`` is the previous read's result, so no read can start before the last ends:
the practical floor of B = 1 for a program of one read kernel per step. Also times one read alone
and a long copy, back to back, for the rate of each.

  PYTHONPATH=. python3 scripts/stream_floor.py          # GPU
  PYTHONPATH=. python3 scripts/stream_floor.py --small  # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402


def chained_reads(w2, start, steps):
  """`steps` full reads of `w2`, each waiting for the previous one's scalar result."""
  s = start
  for _ in range(steps):
    s = jnp.max(w2.astype(jnp.float32) + s) * 1e-30
  return s


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--rank", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  vocabs = [4096] if args.small else [129280, 151936]
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
  copy = jax.jit(lambda a: a + 1)
  big = jnp.ones((2**29 if not args.small else 2**22,), jnp.bfloat16)
  seconds = bench_sampler.pipelined_seconds(copy, (big,), args.repeats, 3)
  print(f"copy of {big.nbytes / 1e6:.0f} MB: {seconds * 1e6:.1f} µs, "
        f"{2 * big.nbytes / seconds / 1e12:.2f} TB/s (read + write)")
  for vocab in vocabs:
    w2 = jax.random.normal(jax.random.key(0), (args.rank, vocab), jnp.bfloat16)
    start = jnp.zeros((), jnp.float32)
    one = bench_sampler.pipelined_seconds(jax.jit(lambda w, s: chained_reads(w, s, 1)),
                                          (w2, start), args.repeats, 3)
    chain = bench_sampler.pipelined_seconds(
        jax.jit(lambda w, s: chained_reads(w, s, args.gamma)), (w2, start), args.repeats, 3)
    spec = args.gamma * w2.nbytes / bench_sampler.SPEC_COPY_RATE
    print(f"V={vocab}: one read of W2 ({w2.nbytes / 1e6:.1f} MB) {one * 1e6:.1f} µs "
          f"({w2.nbytes / one / 1e12:.2f} TB/s); {args.gamma} dependent reads {chain * 1e6:.1f} µs "
          f"= {chain / spec:.2f}x the W2 part of the floor ({spec * 1e6:.1f} µs)")


if __name__ == "__main__":
  main()
