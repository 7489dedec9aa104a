"""The prefill: the whole prompt in one pass against passes of a chunk of positions, and packed.

Shapes (default, GPU): the Qwen3-4B-shaped target and its 5-layer draft of `bench_decode` (random
bf16 weights). Each cell prefills B prompts of ``--lengths`` tokens into caches of that length
plus 2056 slots (a decode's budget) with `decoding.rounds._prefill_forward`, the function every
decode and refill calls: the target's layers, the draft's context cache, the last token's logits.

For every (B, length) and every ``--chunks`` entry (``whole``: one pass) it reports:

* ms per prefill, the median of ``--repeats`` samples after ``--warmup``, every chunk size of a cell
  timed side by side in one loop (`harness.time_side_by_side`);
* the compiled program's scratch memory (XLA's `memory_analysis`: its temporaries, which include
  the target's and the draft's caches wherever XLA keeps them there, e.g. a one-pass prefill; the
  attention's own scratch is bounded by `attention.attend_flash`'s tile, tested on the CPU);
* the floor: the larger of the weights read once at `harness.floor_bandwidth` and the FLOPs at
  this run's matrix rate: 2 per target parameter per prompt token plus the causal attention's
  ``4·layers·B·N·D·T(T+1)/2`` (the scores and the weighted values of each query over its prefix).

``--chunks`` may name ``packed``: the prompts one after another in one pass
(`decoding.rounds._packed_prefill_forward`, what a refill and a fixed batch run by default). With
``--ragged LO,HI`` each cell's B prompts have lengths uniform in [LO, HI] (seeded by B), right-padded
to the cell's length for the other entries: the refill of prompts of different lengths, where the
padded forms compute B × the longest and the packed one about their sum (the floor is the sum's).

A cell whose compile or run fails (e.g. out of memory) reports the error and the others still run;
the exit status is 1 if a chunked cell failed (a whole-prompt pass may run out of memory: that is
what the chunks are for).

  python -m benchmarks.bench_prefill --small                          # CPU smoke check
  python -m benchmarks.bench_prefill --batches 1,16 --lengths 1024,4096,8192
  python -m benchmarks.bench_prefill --batches 8 --lengths 1024 --ragged 128,1024 --chunks 512,packed
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode
from benchmarks import harness
from dspark_jax.decoding import packing
from dspark_jax.decoding import rounds
from dspark_jax.models import target as tm

BUDGET = 2056  # cache slots past the prompt, as a decode of 2048 new tokens with γ = 7 allocates


PACKED = "packed"


def chunk_list(text: str) -> list[int | str | None]:
  """``"whole,512,packed"`` -> [None, 512, "packed"]."""
  out = []
  for part in text.split(","):
    part = part.strip()
    out.append(None if part == "whole" else PACKED if part == PACKED
               else harness.int_list(part)[0])
  return out


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=harness.int_list, default=None,
                      help="comma list of batch sizes (default 1,16; --small: 2)")
  parser.add_argument("--lengths", type=harness.int_list, default=None,
                      help="comma list of prompt lengths (default 1024,4096,8192; --small: 96)")
  parser.add_argument("--chunks", type=chunk_list, default=None,
                      help="comma list of chunk sizes, 'whole' for one pass (default "
                      f"whole,512,1024,2048; --small: whole,32)")
  parser.add_argument("--ragged", type=harness.int_list, default=None, metavar="LO,HI",
                      help="prompt lengths uniform in [LO, HI] (at most the cell's length) "
                           "instead of every prompt the cell's length")
  parser.add_argument("--gamma", type=int, default=7)
  harness.add_common_arguments(parser, repeats=5, warmup=1, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [1, 16])
  args.lengths = args.lengths or ([96] if args.small else [1024, 4096, 8192])
  args.chunks = args.chunks or ([None, 32] if args.small else [None, 512, 1024, 2048])
  if min(args.batches) < 1 or min(args.lengths) < 1 or any(
      isinstance(c, int) and c < 1 for c in args.chunks):
    parser.error("--batches, --lengths and --chunks: each must be >= 1")
  if args.ragged is not None and (len(args.ragged) != 2 or not 1 <= args.ragged[0] <= args.ragged[1]
                                  or args.ragged[1] > min(args.lengths)):
    parser.error(f"--ragged: LO,HI with 1 <= LO <= HI <= every length, got {args.ragged}")
  return args


def prompt_lengths(args, batch: int, length: int) -> np.ndarray:
  """The cell's [B] prompt lengths: `length` each, or uniform in ``--ragged`` (seeded by B)."""
  if args.ragged is None:
    return np.full((batch,), length, np.int32)
  low, high = args.ragged
  return np.random.default_rng(batch).integers(low, high + 1, batch).astype(np.int32)


def program(target, draft, batch: int, length: int, chunk, lens: np.ndarray):
  """A compiled prefill of `batch` prompts of `lens` tokens (right-padded to `length`, or
  ``chunk == PACKED``: packed), its thunk, and its scratch bytes."""
  (t_def, t_state), (d_def, d_state) = nnx.split(target), nnx.split(draft)
  slots = tm.cache_slots(length + BUDGET)

  def run(t_state, d_state, prompt, lens):
    target, draft = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
    cache, context = tm.init_cache(target.config, batch, slots), draft.init_context(batch, slots)
    if chunk == PACKED:
      logits, cache, context = rounds._packed_prefill_forward(target, draft, prompt, lens, cache,
                                                              context)
    else:
      logits, cache, context = rounds._prefill_forward(target, draft, prompt, lens, cache,
                                                       context, chunk)
    return jnp.argmax(logits, axis=-1), cache["k"][0][:, :, :1], context["k"][0][:, :, :1]

  vocab = target.config.vocab_size
  padded = np.random.default_rng(batch).integers(0, vocab, (batch, length)).astype(np.int32)
  padded[np.arange(length)[None, :] >= lens[:, None]] = 0
  if chunk == PACKED:
    prompt = packing.pack_prompts([padded[i, :n] for i, n in enumerate(lens)], 1 << 62)[0]
  else:
    prompt = padded
  prompt, lens = jnp.asarray(prompt), jnp.asarray(lens)
  compiled = jax.jit(run).lower(t_state, d_state, prompt, lens).compile()
  stats = compiled.memory_analysis()
  temp = None if stats is None else int(stats.temp_size_in_bytes)
  return (lambda: compiled(t_state, d_state, prompt, lens)), temp


def attention_flops(config, lens: np.ndarray) -> float:
  """FLOPs of the causal attention of prompts of `lens` tokens: per layer, query head and query
  t, 2·D for each of its t + 1 scores and 2·D for each weighted value."""
  shape = config.layer
  per_row = lens.astype(np.float64) * (lens + 1) / 2
  return 4 * config.num_layers * shape.num_heads * shape.head_dim * float(per_row.sum())


def floor_ms(target, lens: np.ndarray, bandwidth: float, rate: float) -> float:
  params = bench_decode._elements(nnx.state(target))
  flops = 2 * params * float(lens.sum()) + attention_flops(target.config, lens)
  return max(harness.nbytes(nnx.state(target)) / bandwidth, flops / rate) * 1e3


def main(argv=None) -> int:
  args = parse_args(argv)
  names = ["whole" if c is None else str(c) for c in args.chunks]
  ragged = None if args.ragged is None else list(args.ragged)
  meta, bandwidth = harness.start_run(args, batches=args.batches, lengths=args.lengths,
                                      chunks=names, ragged=ragged, gamma=args.gamma)
  rate = harness.matmul_rate(args.small)
  meta["matmul_tflops"] = rate / 1e12
  target, draft = bench_decode.build_models(args.small, args.gamma)
  results, rows = [], []
  for batch in args.batches:
    for length in args.lengths:
      thunks, temps, errors = {}, {}, {}
      lens = prompt_lengths(args, batch, length)
      for name, chunk in zip(names, args.chunks):
        try:
          thunks[name], temps[name] = program(target, draft, batch, length, chunk, lens)
        except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the rest still run
          errors[name] = bench_decode.describe_failure(exc)
      ms = {}
      if thunks:
        try:
          ms = {k: v * 1e3 for k, v in harness.time_side_by_side(
              thunks, repeats=args.repeats, warmup=args.warmup).items()}
        except Exception as exc:  # noqa: BLE001
          errors.update({k: bench_decode.describe_failure(exc) for k in thunks})
      floor = floor_ms(target, lens, bandwidth, rate)
      for name in names:
        cell = {"batch": batch, "length": length, "tokens": int(lens.sum()), "chunk": name,
                "ms": ms.get(name),
                "temp_bytes": temps.get(name), "floor_ms": floor, "error": errors.get(name)}
        results.append(cell)
        print(f"  B={batch} T={length} chunk {name}: "
              + (cell["error"] or f"{cell['ms']:.2f} ms, scratch "
                 f"{(cell['temp_bytes'] or 0) / 2**20:.1f} MiB"), flush=True)
        rows.append([str(batch), str(length), str(cell["tokens"]), name,
                     "-" if cell["ms"] is None else f"{cell['ms']:.2f}",
                     "-" if cell["temp_bytes"] is None else f"{cell['temp_bytes'] / 2**20:.0f}",
                     "-" if cell["ms"] is None else f"{cell['ms'] / floor:.2f}",
                     (cell["error"] or "")[:40]])
      del thunks
  title = (f"bench_prefill ({meta['device_kind']}; ms per prefill of B prompts of T tokens, "
           f"the program's scratch MiB, × floor)")
  harness.finish(title, ["B", "T", "tokens", "chunk", "ms", "scratch MiB", "× floor", "error"],
                 rows, meta=meta, results=results, json_path=args.json)
  return int(any(r["error"] and r["chunk"] != "whole" for r in results))


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
