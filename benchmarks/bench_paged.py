"""What the paged KV cache costs per target call against the contiguous cache it replaces.

Shapes (default, GPU): the Qwen3-4B-shaped target of `bench_decode` (random bf16 weights), B rows
each holding L = ``--contexts`` real tokens, at ``--batches``. Two calls: the autoregressive step
(one token per row) and the verify (γ + 1 = 8 tokens per row), each over

* ``contiguous``: a head-major cache of ``cache_slots(L + γ + 1)`` slots per row (what `generate`
  allocates for this context; the attention takes the ragged kernel on GPUs,
  `kernels.attention.choose_cached`);
* ``paged``: page pools of ``--page-size`` positions (`paging.cache`), every row holding
  ``ceil((L + γ + 1) / page_size)`` pages assigned in a shuffled order (a pool after many rows came
  and went), read through the block table (`kernels.paged_attention`: the kernel with a table on
  GPUs, the gathered XLA form elsewhere).

The ratio paged / contiguous is the paging's cost (the issue's goal: at most 1.05). Every call
runs 10 times inside one compiled ``fori_loop``, its cache carried and donated
(`bench_decode.looped`); the median of ``--repeats`` samples after ``--warmup``
(`harness.time_one`, the two caches timed one after the other so that only one lives at a time).
Each shape also compares one call's logits of the two caches (max relative error; rounding only).

  python -m benchmarks.bench_paged --small                  # CPU smoke check
  python -m benchmarks.bench_paged --batches 16,64,128 --contexts 1024,4096
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
from dspark_jax.kernels import attention
from dspark_jax.kernels import paged_attention
from dspark_jax.models import target as tm
from dspark_jax.paging import cache as paging

LOOP = bench_decode.LOOP


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_grid_arguments(parser)
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--page-size", type=int, default=None,
                      help="positions per page (default 64; --small: 16)")
  harness.add_common_arguments(parser, repeats=8, warmup=1, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [16, 64, 128])
  args.contexts = args.contexts or ([32] if args.small else [1024, 4096])
  args.page_size = args.page_size or (16 if args.small else paging.DEFAULT_PAGE_SIZE)
  try:
    paging.check_page_size(args.page_size)
  except ValueError as exc:
    parser.error(f"--page-size: {exc}")
  return args


def make_cache(config, kind: str, batch: int, capacity: int, page_size: int, seed: int):
  """The contiguous cache of `capacity` slots, or a paged one holding as many positions per row
  in shuffled pages."""
  if kind == "contiguous":
    return tm.init_cache(config, batch, capacity)
  max_pages = -(-capacity // page_size)
  order = np.random.default_rng(seed).permutation(batch * max_pages).reshape(batch, max_pages)
  cache = paging.paged_cache(config, slots=batch, num_pages=batch * max_pages,
                             max_pages=max_pages, page_size=page_size)
  return cache.with_table(order.astype(np.int32))


def timer(target, kind: str, batch: int, context: int, tokens: int, args):
  """Seconds per call of `tokens` tokens per row at positions ``context ..`` over a cache of
  `kind`, and the first call's logits [B, V] (float32, on the host)."""
  t_def, t_state = nnx.split(target)
  t_state, t_tree = jax.tree.flatten(t_state)
  merge = lambda leaves: nnx.merge(t_def, jax.tree.unflatten(t_tree, leaves))
  width = args.gamma + 1
  capacity = tm.cache_slots(context + width)
  rng = np.random.default_rng(batch)
  block = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, tokens)), jnp.int32)
  positions = context + jnp.arange(tokens, dtype=jnp.int32)[None, :].repeat(batch, 0)
  make = lambda: make_cache(target.config, kind, batch, capacity, args.page_size, batch)
  first = jax.jit(lambda w, cache: merge(w)(block, positions, cache)[0][:, -1])(t_state, make())

  def body(w, carry):
    cache, acc = carry
    logits, _, cache = merge(w)(block, positions, cache)
    return cache, acc + jnp.sum(jnp.argmax(logits[:, 0], axis=-1))

  thunk = bench_decode.looped(body, t_state, lambda: (make(), jnp.int32(0)))
  seconds = harness.time_one(thunk, repeats=args.repeats, warmup=args.warmup) / LOOP
  del thunk
  gc.collect()
  return seconds, np.asarray(first, np.float32)


def attention_path(config, kind: str, batch: int, context: int, tokens: int, args) -> str:
  """Which attention form the call takes (``ragged``, ``cudnn`` or ``xla``)."""
  layer = config.layer
  q = jax.ShapeDtypeStruct((batch, tokens, layer.num_heads, layer.head_dim), config.dtype)
  cache = jax.eval_shape(lambda: make_cache(config, kind, batch, tm.cache_slots(
      context + args.gamma + 1), args.page_size, 0))
  if kind == "contiguous":
    return attention.choose_cached(q, cache["k"][0])
  return paged_attention.choose_paged(q, cache.k[0], cache.table)


def main(argv=None) -> int:
  args = parse_args(argv)
  width = args.gamma + 1
  meta, _ = harness.start_run(args, contexts=args.contexts, batches=args.batches,
                              gamma=args.gamma, page_size=args.page_size)
  target, _ = bench_decode.build_models(args.small, args.gamma)
  results = []
  for context in args.contexts:
    for batch in args.batches:
      for name, tokens in (("AR step", 1), (f"verify {width}", width)):
        row = {"batch": batch, "context": context, "call": name}
        try:
          for kind in ("contiguous", "paged"):
            seconds, logits = timer(target, kind, batch, context, tokens, args)
            row[f"{kind}_ms"] = seconds * 1e3
            row[f"{kind}_path"] = attention_path(target.config, kind, batch, context, tokens,
                                                 args)
            row[f"{kind}_logits"] = logits
          row["ratio"] = row["paged_ms"] / row["contiguous_ms"]
          ref = row.pop("contiguous_logits")
          row["max_rel_err"] = float(np.max(np.abs(row.pop("paged_logits") - ref))
                                     / max(np.max(np.abs(ref)), 1e-30))
          row["ok"] = True
        except Exception as exc:  # the other shapes still run; the failure is reported
          row = {k: v for k, v in row.items() if not k.endswith("_logits")}
          row.update(ok=False, error=bench_decode.describe_failure(exc))
        print(f"  L={context} B={batch} {name}: " + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            if k not in ("batch", "context", "call")), flush=True)
        results.append(row)
        gc.collect()
  rows = [[str(r["context"]), str(r["batch"]), r["call"]]
          + ([f"{r['contiguous_ms']:.3f} ({r['contiguous_path']})",
              f"{r['paged_ms']:.3f} ({r['paged_path']})", f"{r['ratio']:.3f}",
              f"{r['max_rel_err']:.1e}"] if r["ok"] else [r["error"][:60], "", "", ""])
          for r in results]
  harness.finish(f"bench_paged ({meta['device_kind']}, γ = {args.gamma}, pages of "
                 f"{args.page_size}; ms per call (attention form), paged / contiguous, logits' "
                 f"max relative difference)",
                 ["L", "B", "call", "contiguous ms", "paged ms", "paged / contiguous", "logits"],
                 rows, meta=meta, results=results, json_path=args.json)
  return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
