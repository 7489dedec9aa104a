"""What a target call costs against the work it does: the padding cost, and the packed verify.

Shapes (default, GPU): the Qwen3-4B-shaped target of `bench_decode` (random bf16 weights), every
row holding ``--context`` real tokens.

* **Padding cost** (``--capacities``, default ``context + 8`` and 8200 slots, each rounded up to 64
  as the decoding loops allocate, `models.target.cache_slots`): the autoregressive
  step (one token per row) and the dense verify (γ + 1 tokens per row) over a KV cache of each
  capacity; the ratio of the largest capacity's time to the smallest's is the padding cost (1.0:
  the cost follows the rows' context, not the cache). A cache that would not fit the device's
  free memory at a batch size is replaced by the largest that does (`fitting_capacity`; the table
  names the capacity measured).
* **Tokens per row** (``--tokens``, default 1..γ + 1), in a cache of the smallest capacity: the
  dense call on [B, k] tokens, and the packed verify (`decoding.packing.packed_verify`) of k
  tokens of every row of a [B, γ + 1] block, packed into a bucket of exactly B·k tokens; the ratio
  packed / dense is the packing's own cost.

Every call runs 10 times inside one compiled ``fori_loop``, its cache carried and donated, the
anchor position reset every iteration (`bench_decode.looped`); the median of ``--repeats`` samples
after ``--warmup``. The floor is the larger of the target's weights plus the rows' KV read once
(context + k slots) at `harness.floor_bandwidth` and 2 FLOPs per parameter per token at this
run's matrix rate.

  python -m benchmarks.bench_verify --small                       # CPU smoke check
  python -m benchmarks.bench_verify --batches 1,16,64,128 --context 128     # 192 vs 8256 slots
"""

from __future__ import annotations

import argparse
import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode
from benchmarks import harness
from dspark_jax.decoding import packing
from dspark_jax.models import target as tm

LOOP = bench_decode.LOOP


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=harness.int_list, default=None,
                      help="comma list of batch sizes (default 1,16,64,128; --small: 2)")
  parser.add_argument("--context", type=int, default=None,
                      help="real tokens per row (default 128; --small: 16)")
  parser.add_argument("--capacities", type=harness.int_list, default=None,
                      help="comma list of cache sizes in slots (default context + 8 and 8200, "
                      "rounded up to 64; --small: 8200 -> 512)")
  parser.add_argument("--tokens", type=harness.int_list, default=None,
                      help="comma list of verify tokens per row (default 1..γ + 1)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--skip", default="", help="comma list of sections to skip: padding,tokens")
  harness.add_common_arguments(parser, repeats=8, warmup=1, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [1, 16, 64, 128])
  args.context = args.context or (16 if args.small else 128)
  width = args.gamma + 1
  args.capacities = sorted(args.capacities or [tm.cache_slots(args.context + width),
                                               tm.cache_slots(512 if args.small else 8200)])
  if args.capacities[0] < args.context + width:
    parser.error(f"--capacities: each cache must hold the context and a verify block "
                 f"({args.context + width} slots)")
  args.tokens = args.tokens or list(range(1, width + 1))
  if min(args.tokens) < 1 or max(args.tokens) > width:
    parser.error(f"--tokens: each must be in 1..{width}")
  return args


def call_floor(target, batch: int, slots: int, tokens: int, bandwidth: float, rate: float) -> float:
  """The floor of one call of `tokens` tokens per row over `slots` real cache slots per row."""
  params = bench_decode._elements(nnx.state(target))
  kv = harness.nbytes(jax.eval_shape(lambda: tm.init_cache(target.config, batch, slots)))
  return max((harness.nbytes(nnx.state(target)) + kv) / bandwidth,
             2 * params * batch * tokens / rate)


def fitting_capacity(target, batch: int, wanted: int, share: float = 0.8) -> int:
  """`wanted`, or the largest multiple of 64 slots whose [B]-row cache takes at most `share` of
  the device memory still free (where the device reports it): a cell that does not fit is
  measured at the largest capacity that does, never left to run out of memory."""
  free = harness.free_device_bytes()
  if free is None:
    return wanted
  per_slot = harness.nbytes(jax.eval_shape(lambda: tm.init_cache(target.config, batch, 64))) / 64
  return min(wanted, int(free * share / per_slot) // 64 * 64)


def timer(target, batch: int, context: int, capacity: int, width: int, tokens: int, packed: bool,
          args):
  """Seconds per call: `tokens` tokens per row at positions ``context ..``, dense or packed."""
  t_def, t_state = nnx.split(target)
  t_state, t_tree = jax.tree.flatten(t_state)
  merge = lambda leaves: nnx.merge(t_def, jax.tree.unflatten(t_tree, leaves))
  rng = np.random.default_rng(batch)
  vocab = target.config.vocab_size
  block = jnp.asarray(rng.integers(0, vocab, (batch, width if packed else tokens)), jnp.int32)
  positions = context + jnp.arange(block.shape[1], dtype=jnp.int32)[None, :].repeat(batch, 0)
  counts = jnp.full((batch,), tokens, jnp.int32)

  def body(w, carry):
    cache, acc = carry
    target = merge(w)
    if packed:
      logits, _, cache = packing.packed_verify(target, block, positions, counts, cache,
                                               (batch * tokens,))
    else:
      logits, _, cache = target(block, positions, cache)
    return cache, acc + jnp.sum(jnp.argmax(logits[:, 0], axis=-1))

  thunk = bench_decode.looped(
      body, t_state, lambda: (tm.init_cache(target.config, batch, capacity), jnp.int32(0)))
  seconds = harness.time_one(thunk, repeats=args.repeats, warmup=args.warmup) / LOOP
  del thunk
  gc.collect()
  return seconds


def main(argv=None) -> int:
  args = parse_args(argv)
  width = args.gamma + 1
  meta, bandwidth = harness.start_run(args, context=args.context, capacities=args.capacities,
                                      batches=args.batches, tokens=args.tokens, gamma=args.gamma)
  rate = harness.matmul_rate(args.small)
  meta["matmul_tflops"] = rate / 1e12
  target, _ = bench_decode.build_models(args.small, args.gamma)
  skip = {s.strip() for s in args.skip.split(",") if s.strip()}
  padding, sweep = [], []
  for batch in args.batches:
    if "padding" not in skip:
      lo, hi = args.capacities[0], fitting_capacity(target, batch, args.capacities[-1])
      if hi < args.capacities[-1]:
        print(f"  B={batch}: {args.capacities[-1]} slots do not fit this device's free memory; "
              f"the largest cache measured is {hi} slots", flush=True)
      for name, tokens in (("AR step", 1), (f"verify {width}", width)):
        ms = {}
        for capacity in sorted({lo, hi}):
          ms[capacity] = timer(target, batch, args.context, capacity, width, tokens, False,
                               args) * 1e3
          print(f"  B={batch} {name} {capacity} slots: {ms[capacity]:.3f} ms", flush=True)
        floor = call_floor(target, batch, args.context + tokens, tokens, bandwidth, rate) * 1e3
        padding.append({"batch": batch, "call": name, "ms": ms, "floor_ms": floor,
                        "smallest": lo, "largest": hi, "padding_cost": ms[hi] / ms[lo]})
    if "tokens" not in skip:
      for tokens in args.tokens:
        dense = timer(target, batch, args.context, args.capacities[0], width, tokens, False,
                      args) * 1e3
        packed = timer(target, batch, args.context, args.capacities[0], width, tokens, True,
                       args) * 1e3
        floor = call_floor(target, batch, args.context + tokens, tokens, bandwidth, rate) * 1e3
        print(f"  B={batch} {tokens} tokens/row: dense {dense:.3f} ms, packed {packed:.3f} ms "
              f"(floor {floor:.3f})", flush=True)
        sweep.append({"batch": batch, "tokens": tokens, "dense_ms": dense, "packed_ms": packed,
                      "floor_ms": floor})
  rows = [[str(r["batch"]), r["call"], f"{r['ms'][r['smallest']]:.3f}",
           f"{r['ms'][r['largest']]:.3f} ({r['largest']})", f"{r['padding_cost']:.2f}",
           f"{min(r['ms'].values()) / r['floor_ms']:.2f}"] for r in padding]
  rows += [[str(r["batch"]), f"{r['tokens']} tok/row dense | packed",
            f"{r['dense_ms']:.3f}", f"{r['packed_ms']:.3f}",
            f"{r['packed_ms'] / r['dense_ms']:.2f}", f"{r['dense_ms'] / r['floor_ms']:.2f}"]
           for r in sweep]
  header = ["B", "call", f"{args.capacities[0]} slots ms", "largest ms (slots)",
            "largest / smallest", "× floor"]
  title = (f"bench_verify ({meta['device_kind']}, context {args.context}, γ = {args.gamma}; "
           f"padding rows: ms per call at each cache size; token rows: dense ms, packed ms, "
           f"packed / dense, dense × floor)")
  harness.finish(title, header, rows, meta=meta,
                 results={"padding": padding, "tokens": sweep}, json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
