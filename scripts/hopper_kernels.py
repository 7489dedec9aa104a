"""Issue 6 experiment: the γ Hopper sampling step kernels alone, without the token choice between them.

For each (V, B) it times, back to back (`bench_sampler.pipelined_seconds`), γ = 7 calls of
`hopper_step.sampling_partials` in one program, each with its own v (so no step waits for a
token), odd steps walking backwards as in a block, under each requested variant: W2 as [r, V] or
part by part (`hopper_step.w2_parts`), plus kernel settings. Against a whole block's time
(`explore_sampler.py`) the difference is what the token choices and launches between the steps
cost. Each variant's corrected logits are checked against the first's. Needs a Hopper GPU.

  PYTHONPATH=. python3 scripts/hopper_kernels.py --variants 'rows;parts=1;parts=1,stages=2'
  PYTHONPATH=. python3 scripts/hopper_kernels.py --small    # CPU smoke check, interpreted

A variant is comma-separated ``name=value`` settings of `sampling_partials` (integers), ``parts=1``
for W2 part by part; ``rows`` (or an empty setting) is W2 [r, V] with the defaults.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.kernels import hopper_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402

GAMMA, RANK = 7, 256


def kernels_program(vocab, batch, parts, rank=RANK, gamma=GAMMA, interpret=False, **settings):
  """(compiled program, its arguments): γ sampling step kernels writing one corrected buffer."""
  w2 = (0.05 * jax.random.normal(jax.random.key(0), (rank, vocab))).astype(jnp.bfloat16)
  base = (3 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(jnp.bfloat16)
  vs = jax.random.normal(jax.random.key(2), (gamma, batch, rank)).astype(jnp.bfloat16)
  temperature = jnp.where(jnp.arange(batch) % 2 == 0, 1.0, 0.8).astype(jnp.float32)
  greedy = (jnp.arange(batch) % 2 == 0).astype(jnp.int32)  # even rows greedy, as the benchmarks
  w2 = jax.block_until_ready(hopper_step.w2_parts(w2) if parts else w2)

  def run(vs, w2, base, temperature, greedy):
    corrected = hopper_step.new_corrected(base.shape, base.dtype)
    total = 0.0
    for k in range(gamma):
      keys, _ = hopper_step.sampling_partials(vs[k], w2, base, corrected, temperature, greedy,
                                              step=k, reverse=k % 2 == 1, argmax=False,
                                              interpret=interpret, **settings)
      total = total + keys[0, 0]  # every kernel's output is used
    return total, jax.freeze(corrected)
  args = (vs, w2, base, temperature, greedy)
  return jax.jit(run).lower(*args).compile(), args


def parse_variants(text):
  """'rows;parts=1,stages=2' -> [(name, parts, settings)]."""
  variants = []
  for item in text.split(";"):
    settings = dict((k, int(v)) for k, v in (pair.split("=") for pair in item.split(",")
                                             if "=" in pair))
    variants.append((item or "rows", bool(settings.pop("parts", 0)), settings))
  return variants


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variants", default="rows;parts=1")
  parser.add_argument("--batches", default="64,128")
  parser.add_argument("--vocabs", default="129280,151936")
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--small", action="store_true", help="CPU smoke check (interpreted kernels)")
  args = parser.parse_args(argv)
  vocabs = [int(v) for v in args.vocabs.split(",")]
  batches = [int(b) for b in args.batches.split(",")]
  shape = dict(rank=RANK, gamma=GAMMA)
  if args.small:
    vocabs, batches, shape = [768], [64], dict(rank=64, gamma=2)
  variants = parse_variants(args.variants)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  for vocab in vocabs:
    for batch in batches:
      floor = (shape["gamma"] * (shape["rank"] * vocab + 2 * batch * vocab) * 2
               / bench_sampler.SPEC_COPY_RATE)
      cells, reference = [f"V={vocab} B={batch} floor {floor * 1e6:.1f} µs"], None
      for name, parts, settings in variants:
        try:
          program, program_args = kernels_program(vocab, batch, parts, interpret=args.small,
                                                  **shape, **settings)
          out = jax.block_until_ready(program(*program_args))
          same = ""
          if reference is None:
            reference = np.asarray(out[1], np.float32)
          else:
            equal = np.array_equal(np.asarray(out[1], np.float32), reference)
            same = " equal" if equal else " DIFFER"
          seconds = bench_sampler.pipelined_seconds(program, program_args,
                                                    1 if args.small else args.repeats,
                                                    1 if args.small else 3, 2 if args.small else 50)
          cells.append(f"{name} {seconds * 1e6:.1f} ({seconds / floor:.2f}){same}")
        except Exception as error:  # an experiment: report and go on
          cells.append(f"{name} error {type(error).__name__}: {str(error)[:200]}")
      print(" | ".join(cells), flush=True)


if __name__ == "__main__":
  main()
