"""A checkpoint pair written by `save_pretrained`, loaded by `load_pretrained`, and `generate` on it.

The pair is `benchmarks.bench_decode`'s random one: a Qwen3-4B-shaped target and a 5-layer DSpark
draft (vanilla head r = 256, confidence head, γ = 7), bf16 (``--small``: the tiny float32 pair).
It is written with `dspark_jax.save_pretrained` under ``--dir`` (default a temporary directory,
removed at the end): the target as a Hugging Face Qwen3 directory, the draft as a DeepSpec one.
Then, timed:

* saving both (seconds and the bytes of the files written);
* ``dspark_jax.load_pretrained(target_dir, draft_dir, dtype=...)`` in the pair's dtype (bf16), until
  every array is on the device: the first load in this process ("cold"; the files were just
  written, so the operating system may serve them from its page cache), then a second load;
* `dspark_jax.generate` end to end on the loaded pair and on the in-memory pair, side by side
  (`bench_decode.bench_e2e`: the same prompts and keys, ``--batch`` rows of about ``--context``
  tokens, ``--new-tokens`` new tokens, second call, prefill subtracted): ms per iteration,
  speculative and autoregressive.

Checks: every loaded array equals the in-memory one bit for bit, or (an array the pair keeps wider
than the checkpoint's dtype, e.g. the float32 confidence head of a bf16 draft) its value rounded to
that dtype; exit status 1 otherwise. Reported, not checked: how many rows of the two pairs'
generations are identical. The two targets' configs differ in fields that leave the arithmetic
alone (e.g. ``max_position_embeddings``, which a checkpoint always states), so their programs are
compiled separately; on a GPU two compilations may round differently (autotuned kernels), and a
sampled or near-tied token may then differ.

  python -m benchmarks.bench_load --small                        # CPU smoke check (tiny models)
  python -m benchmarks.bench_load --dir /tmp/pair --json load.json    # GPU
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import bench_decode
from benchmarks import harness
from dspark_jax.formats import checkpoints


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", default=None,
                      help="where to write the pair (subdirectories target/ and draft/; default a "
                      "temporary directory, removed at the end)")
  parser.add_argument("--batch", type=int, default=None, help="rows (default 16; --small: 2)")
  parser.add_argument("--context", type=int, default=None,
                      help="prompt tokens, about (default 1024; --small: 32)")
  parser.add_argument("--new-tokens", type=int, default=None,
                      help="new tokens per row (default 64; --small: 8)")
  parser.add_argument("--gamma", type=int, default=7)
  harness.add_common_arguments(parser, repeats=20, warmup=1)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batch = args.batch or (2 if args.small else 16)
  args.context = args.context or (32 if args.small else 1024)
  args.new_tokens = args.new_tokens or (8 if args.small else 64)
  if min(args.batch, args.context, args.new_tokens) < 1:
    parser.error("--batch, --context and --new-tokens must be >= 1")
  return args


def directory_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def size_text(nbytes: float) -> str:
  return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def on_device_state(*models) -> None:
  """Waits until every array of `models` is computed (on the device)."""
  jax.block_until_ready([nnx.state(m) for m in models if m is not None])


def compare_weights(written, loaded, dtype) -> dict[str, list[str]]:
  """Names of the arrays of two models by how they compare (on the device): "equal" bit for bit;
  "rounded": equal once the written value is rounded to the checkpoint's `dtype` and back (an
  array kept wider than the checkpoint's dtype in memory, e.g. a float32 confidence head in a bf16
  pair); "different": anything else (a missing or extra name, a dtype, shape or value)."""
  a = checkpoints.named_arrays(nnx.state(written))
  b = checkpoints.named_arrays(nnx.state(loaded))
  out = {"equal": [], "rounded": [], "different": sorted(set(a) ^ set(b))}
  for name in sorted(set(a) & set(b)):
    x, y = a[name], b[name]
    if x.dtype != y.dtype or x.shape != y.shape:
      out["different"].append(name)
    elif bool(jnp.all(jax.lax.bitcast_convert_type(x, jnp.uint8)
                      == jax.lax.bitcast_convert_type(y, jnp.uint8))):
      out["equal"].append(name)
    elif bool(jnp.all(x.astype(dtype).astype(x.dtype) == y)):
      out["rounded"].append(name)
    else:
      out["different"].append(name)
  return out


def token_agreement(a: list, b: list) -> dict:
  """Rows of two [B, N] token lists that are identical, and the fraction of equal positions."""
  a, b = np.asarray(a), np.asarray(b)
  return {"rows_identical": int(np.sum(np.all(a == b, axis=1))), "rows": int(a.shape[0]),
          "positions_equal": float(np.mean(a == b))}


def timed_load(target_dir: str, draft_dir: str, dtype):
  start = time.perf_counter()
  target, draft = dj.load_pretrained(target_dir, draft_dir, dtype=dtype)
  on_device_state(target, draft)
  return target, draft, time.perf_counter() - start


def main(argv=None) -> int:
  args = parse_args(argv)
  meta, _ = harness.start_run(args, batch=args.batch, context=args.context,
                              new_tokens=args.new_tokens, gamma=args.gamma)
  start = time.perf_counter()
  target, draft = bench_decode.build_models(args.small, args.gamma)
  on_device_state(target, draft)
  dtype = jnp.dtype(target.config.param_dtype)
  print(f"models built in {time.perf_counter() - start:.1f} s ({dtype.name})", flush=True)

  root = args.dir or tempfile.mkdtemp(prefix="bench_load_")
  target_dir, draft_dir = os.path.join(root, "target"), os.path.join(root, "draft")
  try:
    start = time.perf_counter()
    dj.save_pretrained(target, target_dir)
    dj.save_pretrained(draft, draft_dir, target=target)
    save_s = time.perf_counter() - start
    written = {"target": directory_bytes(target_dir), "draft": directory_bytes(draft_dir)}
    print(f"saved in {save_s:.1f} s: target {size_text(written['target'])}, draft "
          f"{size_text(written['draft'])} under {root}", flush=True)

    loaded_target, loaded_draft, cold_s = timed_load(target_dir, draft_dir, dtype)
    print(f"load_pretrained, first in this process: {cold_s:.2f} s", flush=True)
    second = timed_load(target_dir, draft_dir, dtype)
    second_s = second[2]
    del second
    print(f"load_pretrained, second: {second_s:.2f} s", flush=True)
  finally:
    if args.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  weights = {"target": compare_weights(target, loaded_target, dtype),
             "draft": compare_weights(draft, loaded_draft, dtype)}
  for name, w in weights.items():
    print(f"{name} weights, loaded against in memory: {len(w['equal'])} arrays equal bit for bit, "
          f"{len(w['rounded'])} equal after rounding to {dtype.name} {w['rounded'][:4]}, "
          f"{len(w['different'])} different {w['different'][:4]}", flush=True)
  weights_ok = not weights["target"]["different"] and not weights["draft"]["different"]

  e2e = bench_decode.bench_e2e(
      {"in memory": (target, draft), "loaded": (loaded_target, loaded_draft)},
      batch=args.batch, context=args.context, new_tokens=args.new_tokens, repeats=args.repeats,
      backend=args.backend, config=args.backend_config)
  modes = ("speculative", "autoregressive")
  agreement = {m: token_agreement(e2e["in memory"][m]["token_ids"], e2e["loaded"][m]["token_ids"])
               for m in modes}
  meta.update(save_s=save_s, bytes_written=written, load_cold_s=cold_s, load_second_s=second_s,
              weights=weights, weights_ok=weights_ok, token_agreement=agreement)

  reference = {m: e2e["in memory"][m]["per_iteration_s"] for m in modes}
  rows = []
  for name in ("in memory", "loaded"):
    r = e2e[name]
    rows.append([name] + [f"{r[m]['per_iteration_s'] * 1e3:.3f}" for m in modes]
                + [f"{r[m]['per_iteration_s'] / reference[m]:.3f}" for m in modes]
                + [f"{r['speculative']['tau']:.3f}", f"{r['speculative']['prefill_s'] * 1e3:.1f}"]
                + [f"{agreement[m]['rows_identical']}/{agreement[m]['rows']}" for m in modes])
  harness.finish(
      f"bench_load ({meta['device_kind']}, {dtype.name}; wrote {size_text(sum(written.values()))} "
      f"in {save_s:.1f} s; load_pretrained {cold_s:.2f} s first, {second_s:.2f} s second; weights "
      f"as written: {'yes' if weights_ok else 'NO'}; generate B = {args.batch}, context "
      f"{args.context}, {args.new_tokens} new tokens, ms per iteration, prefill subtracted; rows "
      "whose tokens equal the in-memory pair's)",
      ("pair", "spec ms", "AR ms", "spec / in memory", "AR / in memory", "spec τ",
       "spec prefill ms", "spec rows same", "AR rows same"), rows,
      meta=meta, results={"e2e": e2e}, json_path=args.json)
  return 0 if weights_ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
