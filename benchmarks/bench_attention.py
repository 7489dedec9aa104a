"""What the attention of a decode step or a verify pass costs over a large KV cache, per form.

Shapes: Qwen3-4B's attention (N=32 query heads, K=8 kv heads, D=128, bfloat16) over a head-major
cache of ``S = --slots`` slots (default 8320: 8200 rounded up to a multiple of 128), every row
holding L real tokens; the T queries of a row see ``limits[b, t] = L - T + t + 1`` slots (causal).
With ``--spread R`` the rows hold different lengths of mean L instead, log-spaced so that the
longest is R times the shortest (`row_lengths`), as a serving batch's rows do; a kernel whose
rows take equal shares of the grid then waits for its longest row.
One sample is a compiled program of 36 attention calls (one per layer of the model), each call's
output the next call's queries, rotating among 4 cache sets (36 distinct caches do not fit at
B=128); the median of ``--repeats`` samples after ``--warmup``, all forms timed side by side
(`harness.time_side_by_side`).

Forms:

* ``xla_full``: `attention.attend_xla` over the whole S-slot cache with the mask (what a model
  without a cut pays);
* ``xla_cut``: `attend_xla` over the cache cut to L slots (``k[:, :, :L]``), the XLA candidate;
* ``xla_exact``: `attend_xla` over caches of exactly L slots (copies made before timing): the
  least an XLA form could read;
* ``kernel_bkv{64,128}``: `ragged_attention.ragged_attention` with the limits, reading each row's
  L slots of the S-slot cache; ``kernel_s{n}`` (``--splits``): the same with n splits a row;
* ``cudnn_cut``: `attention.attend_cudnn` over the cut cache, where it runs (else n/a).

Each form's output of one call is compared with ``xla_full``'s (max relative error). The floor is
the KV bytes a call must read, ``2·K·ΣL·D·2`` (keys and values, bf16, over the rows' lengths),
times 36, at this device's measured copy rate (`harness.floor_bandwidth`). ``xla_cut`` and
``xla_exact`` cut the caches to the longest row.

  PYTHONPATH=. python -m benchmarks.bench_attention [--quick] [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from dspark_jax.kernels import attention
from dspark_jax.kernels import ragged_attention as ra

LAYERS = 36
SETS = 4
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BUDGET_S = 210.0  # no new shape starts after this many seconds (the whole run stays < 4 min)


def layered(fn):
  """A compiled program of `LAYERS` calls ``x = fn(x, k, v, limits)``, rotating the cache sets."""
  @jax.jit
  def program(x, ks, vs, limits):
    def body(_, x):
      for c in range(SETS):
        x = fn(x, ks[c], vs[c], limits)
      return x
    return jax.lax.fori_loop(0, LAYERS // SETS, body, x)
  return program


def forms(length: int, slots: int, variants) -> dict:
  """Name -> fn(q, k, v, limits) -> out, the forms compared at one context length (``xla_exact``
  is called with caches of exactly `length` slots, the others with the S-slot caches)."""
  full_mask = lambda limits: attention._limit_mask(limits, slots)
  cut_mask = lambda limits: attention._limit_mask(limits, length)
  cut = lambda x: x[:, :, :length]
  out = {
      "xla_full": lambda q, k, v, lim: attention.attend_xla(q, k, v, full_mask(lim)),
      "xla_cut": lambda q, k, v, lim: attention.attend_xla(q, cut(k), cut(v), cut_mask(lim)),
      "xla_exact": lambda q, k, v, lim: attention.attend_xla(q, k, v, cut_mask(lim)),
  }
  interpret = jax.default_backend() != "gpu"  # a smoke run on the CPU
  for name, settings in variants.items():
    out[name] = (lambda settings: lambda q, k, v, lim: ra.ragged_attention(
        q, k, v, lim, interpret=interpret, **settings)[0])(settings)
  if attention.cudnn_precondition(jnp.bfloat16, HEAD_DIM) is None:
    out["cudnn_cut"] = lambda q, k, v, lim: attention.attend_cudnn(q, cut(k), cut(v), cut_mask(lim))
  return out


def floor_ms(tokens: int) -> float:
  """The KV read floor of `LAYERS` calls over rows of `tokens` real slots in all."""
  return LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM * 2 / harness.floor_bandwidth()[0] * 1e3


def row_lengths(batch: int, length: int, spread: float, slots: int, t: int = 1) -> np.ndarray:
  """[B] int row lengths of mean about `length`, log-spaced so that the longest is `spread` times
  the shortest (1: all `length`), each clipped to T..S."""
  if spread < 1:
    raise ValueError(f"--spread: expected at least 1, got {spread}")
  weights = spread ** (np.arange(batch) / max(batch - 1, 1))
  lengths = np.rint(length * weights / weights.mean()).astype(np.int64)
  return np.clip(lengths, t, slots)


def rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


_CACHES = {}


def caches(batch: int, slots: int):
  """`SETS` random bf16 key and value caches [B, K, S, D] (kept for the next shape of this B)."""
  if (batch, slots) not in _CACHES:
    _CACHES.clear()
    gc.collect()
    keys = jax.random.split(jax.random.key(batch), 2 * SETS)
    shape = (batch, KV_HEADS, slots, HEAD_DIM)
    _CACHES[batch, slots] = jax.block_until_ready((
        tuple(jax.random.normal(keys[i], shape, jnp.bfloat16) for i in range(SETS)),
        tuple(jax.random.normal(keys[SETS + i], shape, jnp.bfloat16) for i in range(SETS))))
  return _CACHES[batch, slots]


def bench_shape(batch, length, t, slots, variants, args) -> dict:
  ks, vs = caches(batch, slots)
  q = jax.random.normal(jax.random.key(length * 16 + t), (batch, t, HEADS, HEAD_DIM), jnp.bfloat16)
  lengths = row_lengths(batch, length, args.spread, slots, t)
  longest = int(lengths.max())
  limits = jnp.asarray(lengths[:, None] - t + 1 + np.arange(t), jnp.int32)
  exact = jax.block_until_ready(tuple(tuple(jnp.array(x[:, :, :longest]) for x in sets)
                                      for sets in (ks, vs)))
  row = {"batch": batch, "length": length, "t": t, "slots": slots, "spread": args.spread,
         "lengths": lengths.tolist(), "floor_ms": floor_ms(int(lengths.sum())),
         "default_splits": ra.default_splits(batch, KV_HEADS, slots, ra.DEFAULT_BLOCK_KV),
         "ms": {}, "rel_err": {}, "errors": {}}
  candidates, reference = {}, None
  for name, fn in forms(longest, slots, variants).items():
    k_sets, v_sets = exact if name == "xla_exact" else (ks, vs)
    try:
      out = jax.block_until_ready(jax.jit(fn)(q, k_sets[0], v_sets[0], limits))
      if reference is None:
        reference = out
      row["rel_err"][name] = rel_err(out, reference)
      program = layered(fn)
      jax.block_until_ready(program(q, k_sets, v_sets, limits))  # compile outside the timing
      candidates[name] = (lambda program, k_sets, v_sets: lambda: program(
          q, k_sets, v_sets, limits))(program, k_sets, v_sets)
    except Exception as exc:  # a form that does not run here is reported as n/a
      row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
      if args.verbose:
        traceback.print_exc()
  times = harness.time_side_by_side(candidates, repeats=args.repeats, warmup=args.warmup)
  row["ms"] = {name: seconds * 1e3 for name, seconds in times.items()}
  return row


def describe(row) -> str:
  spread = (f" (rows {min(row['lengths'])}..{max(row['lengths'])})"
            if row.get("spread", 1) > 1 else "")
  parts = [f"B={row['batch']:<3} L={row['length']:<4}{spread} T={row['t']}  floor "
           f"{row['floor_ms']:.3f} ms, default splits {row['default_splits']}"]
  for name, ms in row["ms"].items():
    ratio, err = ms / row["floor_ms"], row["rel_err"][name]
    parts.append(f"{name} {ms:.3f} ms ({ratio:.2f}x, err {err:.1e})")
  for name, error in row["errors"].items():
    parts.append(f"{name} n/a ({error.splitlines()[0][:120]})")
  return "\n    ".join(parts)


def sweep_variants(batch: int, slots: int) -> dict:
  """Kernel settings tried by ``--sweep``: block_kv, num_warps, num_stages, splits."""
  variants = {}
  for block_kv in (64, 128):
    base = ra.default_splits(batch, KV_HEADS, slots, block_kv)
    for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
      variants[f"bkv{block_kv}_w{warps}_s{stages}"] = dict(block_kv=block_kv, num_warps=warps,
                                                          num_stages=stages)
    for factor in (0.5, 2):
      splits = max(1, min(slots // block_kv, int(base * factor)))
      if splits != base:
        variants[f"bkv{block_kv}_splits{splits}"] = dict(block_kv=block_kv, splits=splits)
  return variants


def write(path, meta, rows, sweeps, skipped) -> None:
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"meta": meta, "results": rows, "sweeps": sweeps, "skipped": skipped}, f, indent=2,
              default=str)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few shapes only")
  parser.add_argument("--sweep", action="store_true",
                      help="also time kernel settings (block_kv, warps, stages, splits)")
  parser.add_argument("--batches", default="1,16,64,128")
  parser.add_argument("--lengths", default="128,1024,4096")
  parser.add_argument("--tokens", default="1,8")
  parser.add_argument("--slots", type=int, default=8320)
  parser.add_argument("--spread", type=float, default=1.0,
                      help="longest row / shortest row, lengths log-spaced around mean L "
                           "(default 1: every row L)")
  parser.add_argument("--splits", default="",
                      help="comma list of split counts also timed (kernel_s{n}, block_kv 64)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--budget", type=float, default=BUDGET_S,
                      help="seconds after which no new shape starts (skipped ones are listed)")
  parser.add_argument("--out", default=None, help="write every number to this JSON file")
  parser.add_argument("--verbose", action="store_true")
  args = parser.parse_args()
  begin = time.perf_counter()
  meta = harness.metadata(layers=LAYERS, cache_sets=SETS, slots=args.slots, spread=args.spread)
  print(harness.describe_run(meta), flush=True)
  if args.quick:
    shapes = [(1, 1024, 1), (16, 4096, 1), (64, 4096, 1), (64, 4096, 8), (128, 1024, 8)]
  else:
    shapes = [(b, l, t) for b in harness.int_list(args.batches)
              for l in harness.int_list(args.lengths) for t in harness.int_list(args.tokens)]
  variants = {"kernel_bkv64": dict(block_kv=64), "kernel_bkv128": dict(block_kv=128)}
  variants.update({f"kernel_s{n}": dict(block_kv=64, splits=n)
                   for n in harness.int_list(args.splits)} if args.splits else {})
  rows, skipped = [], []
  sweeps = []
  if args.sweep:
    for batch, length, t in ((1, 4096, 1), (16, 1024, 8), (64, 4096, 1), (64, 4096, 8)):
      if time.perf_counter() - begin > args.budget:
        skipped.append(("sweep", batch, length, t))
        continue
      row = bench_shape(batch, length, t, args.slots, sweep_variants(batch, args.slots), args)
      sweeps.append(row)
      print("sweep " + describe(row), flush=True)
      write(args.out, meta, rows, sweeps, skipped)
      gc.collect()
  for batch, length, t in shapes:
    if time.perf_counter() - begin > args.budget:
      skipped.append((batch, length, t))
      continue
    try:
      row = bench_shape(batch, length, t, args.slots, variants, args)
    except Exception as exc:
      traceback.print_exc()
      row = {"batch": batch, "length": length, "t": t, "error": f"{type(exc).__name__}: {exc}"}
    rows.append(row)
    print(describe(row) if "ms" in row else f"B={batch} L={length} T={t}: {row['error']}",
          flush=True)
    write(args.out, meta, rows, sweeps, skipped)  # after every shape: a cut-off run keeps its rows
    gc.collect()
  if skipped:
    print(f"skipped (time budget {args.budget:.0f} s): {skipped}")
  write(args.out, meta, rows, sweeps, skipped)
  if args.out:
    print(f"results written to {args.out}")
  names = []
  for row in rows:
    names += [n for n in list(row.get("ms", {})) + list(row.get("errors", {})) if n not in names]
  header = ["B", "L", "T", "floor"] + [f"{n} ms (x)" for n in names]
  table = []
  for row in rows:
    cells = [row["batch"], row["length"], row["t"], f"{row.get('floor_ms', math.nan):.3f}"]
    for name in names:
      ms = row.get("ms", {}).get(name)
      cells.append("n/a" if ms is None else f"{ms:.3f} ({ms / row['floor_ms']:.2f})")
    table.append(cells)
  print(f"\n{LAYERS} attention calls per sample, ms (x KV floor at "
        f"{harness.floor_bandwidth()[0] / 1e12:.2f} TB/s, {meta['device_kind']}), "
        f"{time.perf_counter() - begin:.0f} s in all")
  for line in harness.format_table(header, table):
    print(line)


if __name__ == "__main__":
  main()
