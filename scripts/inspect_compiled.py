"""Writes the optimised HLO and XLA's memory analysis of the folded block programs at one shape.

For reading what XLA did with the γ-step loop (fusions, hoisted converts, buffers) on the device at
hand. Usage: PYTHONPATH=. python3 scripts/inspect_compiled.py --vocab 129280 --batch 64 --out DIR
"""

import argparse
import os

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft import proposer as draft_sampler
from dspark_jax.draft import heads


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=129280)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--rank", type=int, default=256)
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  args = parser.parse_args()
  head = heads.MarkovHead.random("vanilla", vocab_size=args.vocab, rank=args.rank,
                                 rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  sampler = draft_sampler.build_draft_sampler(
      head, max_batch_size=args.batch, vocab_size=args.vocab, gamma=args.gamma,
      logits_dtype=jnp.bfloat16, mode="force")
  for greedy_only in (False, True):
    compiled = sampler.compile_variant(greedy_only, args.batch)
    name = "greedy" if greedy_only else "sampling"
    path = os.path.join(args.out, f"hlo_{name}_V{args.vocab}_B{args.batch}.txt")
    with open(path, "w") as f:
      f.write(compiled.as_text())
    m = compiled.memory_analysis()
    print(f"{name}: temp {m.temp_size_in_bytes / 2**20:.2f} MiB, output "
          f"{m.output_size_in_bytes / 2**20:.2f} MiB, [B,V] f32 = "
          f"{args.batch * args.vocab * 4 / 2**20:.2f} MiB -> {path}")
  print(jax.local_devices()[0].device_kind)


if __name__ == "__main__":
  main()
