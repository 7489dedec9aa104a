"""Issue 6: the sampling variant with stored corrected logits vs ``store_logits=False``, side by side.

For each (V, B) it times, back to back with every argument on the device (median of repeats after
warm-up, `bench_sampler.pipelined_seconds`):

* ``stored``: the folded sampling block (`proposal.folded_block`, form "pallas" on a GPU), which
  writes the [B, γ, V] corrected logits;
* ``compact``: the same block with ``store_logits=False`` (`proposal.CompactLogits`: per step B
  floats of log q instead of B·V logits);
* ``stored+verify`` and ``compact+verify``: the block and `verification.verify_arrays` in one
  program, given target logits [B, γ+1, V]: the verifier reads the stored logits (log-softmax over
  all γ rows) or recomputes one row per request (one more pass over W2).

It checks once per shape that the two blocks' tokens are equal and that the compact block's
recomputed rows equal the stored logits bit for bit, and prints a table against SPEC §9's floor
``γ·(r·V + 2·B·V)·2 bytes / 4.27 TB/s`` (the block's; the verifier's own traffic is not in it).

  PYTHONPATH=. python3 scripts/bench_compact.py              # GPU, the issue's shapes
  PYTHONPATH=. python3 scripts/bench_compact.py --small      # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax import verification
from dspark_jax.sampling import params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402

NAMES = ("stored", "compact", "stored+verify", "compact+verify")


def round_program(store_logits: bool, verify: bool, pallas_options=()):
  """One jitted program: the sampling block, then (with `verify`) its verification."""
  def run(head_arrays, base, anchor, greedy, temperature, seeds, positions, key, target, top_k,
          top_p, lens, stop_ids):
    tokens, law, _ = proposal.folded_block(
        head_arrays, None, base, anchor, None, greedy, temperature, seeds, positions, key,
        kind="vanilla", greedy_only=False, store_logits=store_logits,
        pallas_options=pallas_options)
    if not verify:
      return tokens, law  # a CompactLogits leaves without its inputs: they are not copied
    if isinstance(law, proposal.CompactLogits):
      law = law.with_inputs(base, head_arrays["w2"])
    result = verification.verify_arrays(target, tokens, law, temperature, greedy, temperature,
                                        top_k, top_p, seeds, positions, lens, stop_ids, key,
                                        greedy_only=False)
    return tokens, result.committed
  return jax.jit(run)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--batches", help="comma-separated batch sizes (default: the issue's)")
  parser.add_argument("--vocabs", help="comma-separated vocabulary sizes (default: the issue's)")
  parser.add_argument("--compact-options", default="",
                      help="pallas_options of the compact programs, e.g. 'late_base=1,num_warps=8'")
  args = parser.parse_args(argv)
  compact_options = tuple((name, int(value)) for name, value in
                          (pair.split("=") for pair in args.compact_options.split(",") if pair))
  vocabs, batches = ([4096], [1, 8]) if args.small else ([129280, 151936], [1, 8, 64, 128])
  if args.batches:
    batches = [int(b) for b in args.batches.split(",")]
  if args.vocabs:
    vocabs = [int(v) for v in args.vocabs.split(",")]
  gamma, rank, dtype = 7, 256, jnp.bfloat16
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  rows = []
  for vocab in vocabs:
    head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                   dtype=dtype)
    for batch in batches:
      keys = jax.random.split(jax.random.key(1), 2)
      base = (3.0 * jax.random.normal(keys[0], (batch, gamma, vocab))).astype(dtype)
      target = (3.0 * jax.random.normal(keys[1], (batch, gamma + 1, vocab))).astype(dtype)
      temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
      params = sp.SamplingParams(temperature=temperature)
      r = proposal.block_arrays(params, np.arange(batch) % vocab, np.full(batch, 1000))
      call_args = jax.device_put((
          head.arrays(), base, r["anchor"], r["greedy"], r["temperature"], r["seeds"],
          r["positions"], jax.random.key(0), target, np.asarray(params.top_k),
          np.asarray(params.top_p), np.full(batch, gamma + 1, np.int32),
          np.full((batch, 1), -1, np.int32)))
      floor = gamma * (rank * vocab + 2 * batch * vocab) * 2 / bench_sampler.SPEC_COPY_RATE
      row = {"V": vocab, "B": batch, "floor": floor}
      programs = {name: round_program(not name.startswith("compact"), name.endswith("verify"),
                                      compact_options if name.startswith("compact") else ())
                  for name in NAMES}
      stored = jax.block_until_ready(programs["stored"](*call_args))
      compact = jax.block_until_ready(programs["compact"](*call_args))
      row["tokens equal"] = float(np.mean(np.asarray(stored[0]) == np.asarray(compact[0])))
      law = compact[1].with_inputs(call_args[1], call_args[0]["w2"])
      row["rows equal"] = float(np.mean(np.asarray(jax.jit(lambda law: law.dense())(law))
                                        == np.asarray(stored[1])))
      for name, program in programs.items():
        row[name] = bench_sampler.pipelined_seconds(program, call_args, args.repeats, 3, 10)
      print({k: (f"{v * 1e6:.1f}us" if k in NAMES or k == "floor" else v) for k, v in row.items()},
            flush=True)
      rows.append(row)
  print("\n" + "\n".join(bench_sampler.ratio_table(rows, list(NAMES))))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
