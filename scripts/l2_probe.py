"""Issue 6 probe: how much of W2 stays in L2 from one draft step to the next?

Times γ = 7 chained greedy-only step kernels (`fused_step.step_stats` with ``W1`` gathered in the
kernel, the token choice between steps, as in the Pallas block) over a W2 of only the first P
128-column vocabulary tiles, for several P and cache settings. Where the per-step time stops
growing with W2's bytes, steps after the first find W2 in L2; the time at the smallest P is the
step's fixed cost (two kernels and the latency chain between them).

  PYTHONPATH=. python3 scripts/l2_probe.py --batch 1
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.sampling import sampler as sampling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402

TILE = 128


def chained_steps(tokens, w1, w2, base, temperature, *, gamma, cache_hints, serpentine):
  for k in range(gamma):
    stats = fused_step.step_stats(tokens, w2, base, temperature, None, None, w1=w1, step=k,
                                  greedy_only=True, cache_hints=cache_hints,
                                  serpentine=serpentine,
                                  interpret=jax.default_backend() == "cpu")
    tokens = sampling.tokens_from_tile_choices(stats.tile_key, stats.tile_token)
  return tokens


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tiles", default="80,160,320,480,640,800,960,1010",
                      help="comma-separated tile counts P (1010 tiles: V = 129280)")
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--settings", default="11,00,10",
                      help="comma-separated (cache hints, serpentine) pairs as two digits")
  args = parser.parse_args(argv)
  gamma, rank, batch = 7, 256, args.batch
  print(f"device {jax.devices()[0].device_kind}, B = {batch}, γ = {gamma}, r = {rank}")
  settings = [(a == "1", b == "1") for a, b in args.settings.split(",")]
  runs = [(c, t) for c in settings for t in map(int, args.tiles.split(","))]
  for (cache_hints, serpentine), tiles in runs:
    vocab = tiles * TILE
    w2 = (0.02 * jax.random.normal(jax.random.key(0), (rank, vocab))).astype(jnp.bfloat16)
    w1 = (0.02 * jax.random.normal(jax.random.key(1), (vocab, rank))).astype(jnp.bfloat16)
    base = jax.random.normal(jax.random.key(2), (batch, gamma, vocab)).astype(jnp.bfloat16)
    call_args = (jnp.zeros((batch,), jnp.int32), w1, w2, base, jnp.ones((batch,), jnp.float32))
    program = jax.jit(lambda *a: chained_steps(*a, gamma=gamma, cache_hints=cache_hints,
                                               serpentine=serpentine))
    seconds = bench_sampler.pipelined_seconds(program.lower(*call_args).compile(), call_args,
                                              args.repeats, 3)
    w2_bytes = rank * vocab * 2
    print(f"hints {cache_hints:d} serpentine {serpentine:d} P {tiles:5d} W2 "
          f"{w2_bytes / 1e6:5.1f} MB: {seconds * 1e6:7.1f} µs, {seconds * 1e6 / gamma:6.2f} µs "
          f"per step, {gamma * (w2_bytes + batch * vocab * 2) / seconds / 1e12:5.2f} TB/s",
          flush=True)


if __name__ == "__main__":
  main()
