"""Issue 6 experiment: the Hopper greedy step (`hopper_step`) against the Triton step kernel.

For each (V, B) it times, back to back (`bench_sampler.pipelined_seconds`), the greedy-only block of
γ = 7 dependent steps written three ways, all with ``v = W1[x]`` gathered in XLA:

* ``triton``: `fused_step.step_stats` (greedy-only) per step, then `sampling.tokens_from_tile_choices`;
* ``hopper t<tile> s<stages>``: `hopper_step.greedy_partials` per step, then `hopper_step.tokens`;
* ``auto``: `proposal.folded_block` greedy-only as `build_draft_sampler` runs it (W1 in the kernel);

and checks each hopper program's tokens against the triton program's (they may differ at
near-ties: the two sum ``v @ W2`` in different orders). Needs a Hopper GPU.

  PYTHONPATH=. python3 scripts/hopper_probe.py [--batches 64,128] [--configs 64:2,64:3,64:2:264]
  PYTHONPATH=. python3 scripts/hopper_probe.py --small    # CPU smoke check, interpreted

The floor is the issue's (SPEC §9, with the corrected-logits write greedy-only does not do).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.draft import heads
from dspark_jax.kernels import hopper_step
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402


def block_program(step_tokens, gamma):
  """γ dependent greedy steps: tokens [B, γ] from (w1, w2, base, anchor)."""
  def run(w1, w2, base, anchor):
    prev, out = anchor, []
    for k in range(gamma):
      prev = step_tokens(jnp.take(w1, prev, axis=0), w2, base, k)
      out.append(prev)
    return jnp.stack(out, axis=1)
  return jax.jit(run)


INTERPRET = jax.default_backend() == "cpu"  # --small on the CPU: both kernels interpreted


def triton_step(v, w2, base, k):
  stats = fused_step.step_stats(v, w2, base, jnp.ones(v.shape[:1]), None, None, step=k,
                                greedy_only=True, interpret=INTERPRET)
  return sampling.tokens_from_tile_choices(stats.tile_key, stats.tile_token)


def hopper_step_fn(tile, stages, programs=None):
  def step(v, w2, base, k):
    return hopper_step.tokens(*hopper_step.greedy_partials(
        v, w2, base, step=k, tile=tile, stages=stages, programs=programs, interpret=INTERPRET))
  return step


def config_name(config):
  return "hopper " + " ".join(f"{letter}{value}" for letter, value in zip("tsp", config))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", default="64,128")
  parser.add_argument("--vocabs", default="129280,151936")
  parser.add_argument("--configs", default="64:2,64:3,128:2",
                      help="comma-separated tile:stages[:programs] for the hopper kernel "
                           "(programs default: one per multiprocessor)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--small", action="store_true", help="CPU smoke check (interpreted kernels)")
  args = parser.parse_args(argv)
  gamma, rank, dtype = 7, 256, jnp.bfloat16
  if args.small:
    gamma, rank, args.vocabs, args.batches, args.repeats = 2, 64, "640", "64", 1
  configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  table = []
  for vocab in (int(v) for v in args.vocabs.split(",")):
    head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                   dtype=dtype)
    w1, w2 = head.arrays()["w1"], head.arrays()["w2"]
    for batch in (int(b) for b in args.batches.split(",")):
      base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(dtype)
      anchor = jnp.arange(batch, dtype=jnp.int32) * 37 % vocab
      floor = gamma * (rank * vocab + 2 * batch * vocab) * 2 / bench_sampler.SPEC_COPY_RATE
      row = {"V": vocab, "B": batch, "floor": floor}
      args_ = jax.device_put((w1, w2, base, anchor))
      programs = {"triton": block_program(triton_step, gamma)}
      programs.update({config_name(c): block_program(hopper_step_fn(*c), gamma)
                       for c in configs})
      reference = None
      for name, program in programs.items():
        try:
          compiled = program.lower(*args_).compile()
          tokens = np.asarray(compiled(*args_))
          if reference is None:
            reference = tokens
          else:
            row[f"{name} equal"] = float(np.mean(tokens == reference))
          row[name] = bench_sampler.pipelined_seconds(compiled, args_, args.repeats, 3, 10)
        except Exception as error:  # an experiment: report and go on
          row[f"{name} error"] = f"{type(error).__name__}: {str(error)[:400]}"
      r = proposal.block_arrays(sp.SamplingParams(temperature=np.zeros(batch)), np.asarray(anchor),
                                np.full(batch, 1000))
      call = jax.device_put((head.arrays(), None, base, r["anchor"], None, r["greedy"],
                             r["temperature"], r["seeds"], r["positions"], jax.random.key(0)))
      auto = proposal.folded_block.lower(*call, kind="vanilla", greedy_only=True,
                                         form="pallas").compile()
      row["auto"] = bench_sampler.pipelined_seconds(auto, call, args.repeats, 3, 10)
      print({k: (f"{v * 1e6:.1f}us" if isinstance(v, float) and "equal" not in k else v)
             for k, v in row.items()}, flush=True)
      table.append(row)
  names = ["auto", "triton"] + [config_name(c) for c in configs]
  print("\n" + "\n".join(bench_sampler.ratio_table(table, names)))


if __name__ == "__main__":
  main()
