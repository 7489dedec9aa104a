"""The attention of a prefill, per candidate: which flash attention computes `attend_limited` there.

Shapes: Qwen3-4B's attention (N = 32 query heads, K = 8 kv heads, D = 128, bfloat16). A cell is B
prompts of T tokens prefilled in one pass into a head-major cache [B, K, S, D] of S = T + 64 slots:
query t of a row sees slots ``s < t + 1`` (causal). With ``--chunk C`` a second cell runs the last
chunk of a chunked prefill: C queries at positions T - C .. T - 1 over the cache written so far.

Candidates (each where it runs; a failure is reported and the rest still run):

* ``ragged_*``: our kernel (`kernels.ragged_attention`) in query tiles, reading the cache in place,
  with several KV block sizes and warp counts; any limits, so also the chunked cell;
* ``cudnn``: cuDNN's fused attention through JAX's head-major entry point (the cache read in place,
  cut to the T slots of a one-pass prefill), causal mask; one pass only (no bottom-right mask);
* ``cudnn_parts``: the chunked cell only, `attention.attend_chunk` (what a prefill chunk past
  slot 0 runs where `choose_causal` holds): cuDNN over the cache before the chunk (padding mask,
  ``kv_seqlen`` = C's start, the cache read in place) and over the chunk's own keys (causal),
  joined by log-sum-exp; the chunk's keys are sliced out of the cache (the layer holds them);
* ``cudnn_public``: `jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`
  on token-major copies of keys and values (the copy is timed with it);
* ``pallas_mha``: JAX's Pallas (Triton) flash attention (`jax.experimental.pallas.ops.gpu.
  attention.mha`, causal) on token-major copies, keys and values repeated to N heads (no GQA);
* ``mosaic_fa3``: JAX's Mosaic GPU FlashAttention-3 (`jax.experimental.pallas.ops.gpu.
  attention_mgpu.attention`, causal; Hopper) on token-major copies;
* ``xla_flash``: `attention.attend_flash`, the XLA fallback (online softmax over KV chunks).

Each candidate's output is compared with ``xla_flash`` on float32-upcast inputs at full precision
(max |out - ref| / max |ref|; bf16 rounding is ~4e-3). Time: the median of ``--repeats`` calls
after ``--warmup`` (`harness.time_side_by_side`); TFLOP/s counts the causal FLOPs, ``4·B·N·D·Σ_t
limit_t``, and × floor is that over this run's bf16 matrix rate (`harness.matmul_rate`).

  PYTHONPATH=. python -m benchmarks.bench_flash --shapes 16x4096,2x32768 --chunk 1024
  PYTHONPATH=. python -m benchmarks.bench_flash --small          # CPU smoke (interpreted kernel)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from dspark_jax.kernels import attention
from dspark_jax.kernels import ragged_attention as ra

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def shape_list(text: str) -> list[tuple[int, int]]:
  """``"16x4096,2x32768"`` -> [(16, 4096), (2, 32768)]."""
  out = []
  for part in text.split(","):
    b, t = part.strip().lower().split("x")
    out.append((int(b), int(t)))
  return out


def _token_major(x):
  return jnp.swapaxes(x, 1, 2)                       # [B, K, S, D] -> [B, S, K, D]


def candidates(t: int, start: int, interpret: bool, heads: int, kv_heads: int) -> dict:
  """Name -> fn(q, k, v, limits) for queries at positions start .. start + t - 1."""
  out = {}
  for block_kv, warps in ((64, 4), (64, 8), (128, 4), (128, 8)):
    out[f"ragged_b{block_kv}_w{warps}"] = functools.partial(
        lambda q, k, v, lim, bkv, w: ra.ragged_attention(q, k, v, lim, block_kv=bkv, num_warps=w,
                                                         interpret=interpret)[0],
        bkv=block_kv, w=warps)
  out["xla_flash"] = attention.attend_flash
  if jax.default_backend() != "gpu":
    return out
  if start:
    if attention.cudnn_precondition(jnp.bfloat16, HEAD_DIM) is None:
      own = lambda x: x[:, :, start:start + t]       # the chunk's keys, as the layer holds them
      out["cudnn_parts"] = lambda q, k, v, lim: attention.attend_chunk(
          q, own(k), own(v), k, v, jnp.full((q.shape[0],), start, jnp.int32))
    return out
  one_pass = lambda x: x[:, :, :t]
  scale = 1.0 / math.sqrt(HEAD_DIM)
  if attention.cudnn_precondition(jnp.bfloat16, HEAD_DIM) is None:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    out["cudnn"] = lambda q, k, v, lim: jnp.swapaxes(fa.dot_product_attention(
        jnp.swapaxes(q, 1, 2), one_pass(k), one_pass(v), scale=scale,
        mask_type=fa.MaskType.CAUSAL, qkv_layout="BNTH"), 1, 2)
  out["cudnn_public"] = lambda q, k, v, lim: jax.nn.dot_product_attention(
      q, _token_major(one_pass(k)), _token_major(one_pass(v)), is_causal=True,
      implementation="cudnn")
  groups = heads // kv_heads
  try:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    out["pallas_mha"] = lambda q, k, v, lim: pallas_attention.mha(
        q, jnp.repeat(_token_major(one_pass(k)), groups, axis=2),
        jnp.repeat(_token_major(one_pass(v)), groups, axis=2), None, sm_scale=scale, causal=True)
  except ImportError:
    pass
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                                         causal=True)
    out["mosaic_fa3"] = lambda q, k, v, lim: attention_mgpu.attention(
        q, _token_major(one_pass(k)), _token_major(one_pass(v)), config)
  except ImportError:
    pass
  return out


def causal_flops(limits) -> float:
  return 4.0 * HEADS * HEAD_DIM * float(np.sum(np.asarray(limits, np.float64)))


def bench_cell(batch: int, length: int, chunk: int | None, args, rate: float) -> list[dict]:
  t = chunk or length
  start = length - t
  slots = -(-(length + 64) // 128) * 128
  keys = jax.random.split(jax.random.key(batch * 7 + length), 3)
  q = jax.random.normal(keys[0], (batch, t, HEADS, HEAD_DIM), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, KV_HEADS, slots, HEAD_DIM), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, KV_HEADS, slots, HEAD_DIM), jnp.bfloat16)
  limits = jnp.broadcast_to(start + 1 + jnp.arange(t, dtype=jnp.int32), (batch, t))
  with jax.default_matmul_precision("highest"):
    up = lambda x: x.astype(jnp.float32)
    ref = np.asarray(jax.jit(attention.attend_flash)(up(q), up(k), up(v), limits), np.float32)
  flops = causal_flops(limits)
  interpret = jax.default_backend() != "gpu"
  thunks, errors, rel = {}, {}, {}
  for name, fn in candidates(t, start, interpret, HEADS, KV_HEADS).items():
    run = jax.jit(fn)
    try:
      out = np.asarray(jax.block_until_ready(run(q, k, v, limits)), np.float32)
      rel[name] = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
      thunks[name] = functools.partial(run, q, k, v, limits)
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported
      errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
  ms = {}
  if thunks:
    ms = {n: s * 1e3 for n, s in harness.time_side_by_side(
        thunks, repeats=args.repeats, warmup=args.warmup).items()}
  floor_ms = flops / rate * 1e3
  rows = []
  for name in list(ms) + list(errors):
    row = {"batch": batch, "length": length, "queries": t, "start": start, "slots": slots,
           "form": name, "ms": ms.get(name), "rel_err": rel.get(name), "error": errors.get(name),
           "tflops": None if name not in ms else flops / ms[name] / 1e9, "floor_ms": floor_ms}
    rows.append(row)
    print(f"  B={batch} T={length} queries {t} from {start}: {name}: "
          + (row["error"] or f"{row['ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s, "
             f"{row['ms'] / floor_ms:.2f}x floor, rel err {row['rel_err']:.1e}"), flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", type=shape_list, default=None,
                      help="comma list of BxT prompt shapes (default 16x4096,2x32768; --small: "
                      "2x160)")
  parser.add_argument("--chunk", type=int, default=None,
                      help="also time the last chunk of this many queries (default 1024; --small "
                      "64; 0: none)")
  parser.add_argument("--budget", type=float, default=240.0,
                      help="seconds after which no new cell starts")
  harness.add_common_arguments(parser, repeats=10, warmup=2, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  if args.small:
    global HEADS, KV_HEADS, HEAD_DIM
    HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
  shapes = args.shapes or ([(2, 160)] if args.small else [(16, 4096), (2, 32768)])
  chunk = args.chunk if args.chunk is not None else (64 if args.small else 1024)
  meta = harness.metadata(shapes=shapes, chunk=chunk, heads=HEADS, kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, repeats=args.repeats, warmup=args.warmup)
  print(harness.describe_run(meta), flush=True)
  rate = harness.matmul_rate(args.small)
  meta["matmul_tflops"] = rate / 1e12
  print(f"floors at this device's bf16 matmul rate, {rate / 1e12:.1f} TFLOP/s", flush=True)
  begin = time.perf_counter()
  results = []
  for batch, length in shapes:
    for c in ([None] + ([chunk] if chunk and chunk < length else [])):
      if time.perf_counter() - begin > args.budget:
        print(f"  skipped B={batch} T={length} chunk {c}: budget spent", flush=True)
        continue
      results += bench_cell(batch, length, c, args, rate)
  rows = [[str(r["batch"]), str(r["length"]), f"{r['queries']}@{r['start']}", r["form"],
           "-" if r["ms"] is None else f"{r['ms']:.2f}",
           "-" if r["tflops"] is None else f"{r['tflops']:.0f}",
           "-" if r["ms"] is None else f"{r['ms'] / r['floor_ms']:.2f}",
           "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}", (r["error"] or "")[:50]]
          for r in results]
  title = (f"bench_flash ({meta['device_kind']}; one layer's prefill attention: ms, causal "
           "TFLOP/s, × floor at the measured matmul rate, error against float32)")
  harness.finish(title, ["B", "T", "queries@start", "form", "ms", "TFLOP/s", "× floor",
                         "rel err", "error"], rows, meta=meta, results=results,
                 json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  raise SystemExit(main())
