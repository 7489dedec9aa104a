"""Issue 6 probe: what the sampling block's noise costs, and what is left without it.

For each batch size at V = 129280 (γ = 7, r = 256, bf16) it times, back to back (bursts of
`bench_sampler.PIPELINE_CALLS` calls), the noise alone (every step's row keys and tile noise), as
jax.random's ``fold_in`` chain and Philox draws (the form before session 9, rebuilt here) and as
`sampling.row_keys` / `sampling.tile_noise` now; the whole Pallas block (sampling and greedy-only);
and the sampling block with its noise passed in (drawn outside the timed program; below 64 rows,
where the tiles draw). It also counts the kernels XLA compiled for each noise program. Session 9
ran it before the noise became a kernel of the chain (BENCHMARKS.md, issue 6, version 27).

  PYTHONPATH=. python3 scripts/noise_probe.py [--batches 1,8,64,128] [--vocab 129280]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.kernels import token_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402


def old_noise(key, seeds, positions, gamma, tiles, tile):
  """[γ, B, V/c + c]: the noise as sessions 1-8 drew it (jax.random fold_in chain, Philox)."""
  steps = positions[None, :] + jnp.arange(1, gamma + 1, dtype=positions.dtype)[:, None]
  stream_key = jax.random.fold_in(key, jnp.uint32(sampling.Stream.DRAFT))

  def one(seed, position):
    k = jax.random.fold_in(stream_key, seed.astype(jnp.uint32))
    k = jax.random.fold_in(k, position.astype(jnp.uint32))
    bits = jax.random.bits(k, (2,), jnp.uint32)
    k = jax.random.wrap_key_data(bits, impl="philox4x32")
    return jax.random.gumbel(k, (tiles + tile,), jnp.float32)

  flat = jax.vmap(one)(jnp.broadcast_to(seeds, steps.shape).reshape(-1), steps.reshape(-1))
  return flat.reshape(*steps.shape, tiles + tile)


def new_noise(key, seeds, positions, gamma, tiles, tile):
  """[γ, B, V/c + c]: the noise as `proposal._pallas_block` draws it now."""
  steps = positions[None, :] + jnp.arange(1, gamma + 1, dtype=positions.dtype)[:, None]
  keys = sampling.row_keys(key, jnp.broadcast_to(seeds, steps.shape).reshape(-1),
                           steps.reshape(-1), sampling.Stream.DRAFT).reshape(steps.shape)
  return sampling.tile_noise(keys, tiles, tile)


def kernel_count(compiled) -> int:
  """Kernels in the entry computation of a compiled program (fusions and custom calls)."""
  text = compiled.as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  return len(re.findall(r"= [^=]*\b(fusion|custom-call|copy|sort|reduce)\(", entry))


def block_with_noise(args, noise, greedy_only=False):
  """The Pallas block with `noise` as an argument (row keys, XLA's tile noise and the noise
  kernel patched out; from 64 rows the token choice draws its own noise, and this changes
  nothing)."""
  saved = sampling.row_keys, sampling.tile_noise, token_kernels.block_noise
  sampling.row_keys = lambda key, seeds, positions, stream: jnp.zeros(seeds.shape, jnp.uint32)
  sampling.tile_noise = lambda keys, tiles, tile: noise
  token_kernels.block_noise = lambda *args, **kwargs: noise
  try:
    (head_arrays, conf, base, anchor, hidden, greedy, temperature, seeds, positions, key) = args
    return proposal._pallas_block("vanilla", head_arrays, conf, base, anchor, hidden, greedy,
                                  temperature, seeds, positions, key, greedy_only, ())
  finally:
    sampling.row_keys, sampling.tile_noise, token_kernels.block_noise = saved


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", default="1,8,64,128")
  parser.add_argument("--vocab", type=int, default=129280)
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args(argv)
  gamma, rank, vocab = 7, 256, args.vocab
  tile = sampling.vocab_tile(vocab)
  tiles = vocab // tile
  head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                 dtype=jnp.bfloat16)
  rows = []
  for batch in map(int, args.batches.split(",")):
    floor = bench_sampler.floor_seconds(vocab, batch, gamma, rank, 2, bench_sampler.SPEC_COPY_RATE)
    base = bench_sampler.random_logits(batch, gamma, vocab, jnp.bfloat16)
    call_args = bench_sampler.folded_args(head, base, np.arange(batch) % vocab,
                                          bench_sampler.mixed_params(batch),
                                          np.full(batch, 1000), jax.random.key(0))
    key, seeds, positions = call_args[9], call_args[7], call_args[8]
    time = lambda fn, fargs: bench_sampler.pipelined_seconds(fn, fargs, args.repeats, 3) * 1e6
    cells = {}
    for name, make in (("old noise", old_noise), ("new noise", new_noise)):
      fn = jax.jit(lambda k, s, p, make=make: make(k, s, p, gamma, tiles, tile))
      compiled = fn.lower(key, seeds, positions).compile()
      cells[name] = f"{time(compiled, (key, seeds, positions)):.1f} ({kernel_count(compiled)} k)"
    for greedy_only in (False, True):
      compiled = proposal.folded_block.lower(*call_args, kind="vanilla", greedy_only=greedy_only,
                                             form="pallas").compile()
      cells["greedy" if greedy_only else "sampling"] = (
          f"{time(compiled, call_args):.1f} ({time(compiled, call_args) * 1e-6 / floor:.2f})")
    noise = jax.jit(lambda k, s, p: new_noise(k, s, p, gamma, tiles, tile))(key, seeds, positions)
    given = jax.jit(lambda a, n: block_with_noise(a, n))
    cells["sampling, noise given"] = f"{time(given, (call_args, noise)):.1f}"
    same = jax.jit(lambda a: block_with_noise(a, new_noise(a[9], a[7], a[8], gamma, tiles, tile)))
    tokens_given = given(call_args, noise)[0]
    tokens_default = proposal.folded_block(*call_args, kind="vanilla", greedy_only=False,
                                           form="pallas")[0]
    cells["same tokens"] = str(bool(jnp.all(tokens_given == tokens_default))
                               and bool(jnp.all(same(call_args)[0] == tokens_default)))
    print(f"V={vocab} B={batch} floor {floor * 1e6:.1f}: "
          + " | ".join(f"{k} {v}" for k, v in cells.items()), flush=True)
    rows.append((batch, cells))
  print(f"\nµs, V = {vocab}, bursts of {bench_sampler.PIPELINE_CALLS}, median of {args.repeats}; "
        f"{jax.devices()[0].device_kind}")
  names = list(rows[0][1])
  print("| B | " + " | ".join(names) + " |")
  for batch, cells in rows:
    print(f"| {batch} | " + " | ".join(cells[n] for n in names) + " |")


if __name__ == "__main__":
  main()
