"""Hugging Face transformers' greedy decode step on our target's shapes: static and dynamic cache.

The model is ``Qwen3ForCausalLM(Qwen3Config(...))`` with random weights, the config written from
the same `TargetConfig` as `benchmarks.bench_decode`'s target (`formats.qwen3.config_to_hf` of
`models.target.qwen3_4b_shape`): bf16 on CUDA. ``--small``: bench_decode's tiny float32 target, on
the CPU unless torch sees a GPU. Nothing is downloaded.

One decode step, as timed here, is the model's forward on one new token per row over a cache that
already holds `context` tokens, then the greedy choice as ``generate`` makes it (the last logits in
float32, argmax), whose token is the next step's input. This is the model call ``generate`` makes
once per new token, not a whole ``generate``: its per-step Python work (logits processors,
stopping criteria, the growing ``input_ids``) is left out, so the times are a lower bound on a
``generate`` step. The cache's contents are zeros (no prefill is run; the time does not depend on
the values).

* static: a ``StaticCache`` of ``context + 16`` slots (our target's cache has the same), called
  through ``model.get_compiled_call(...)``, the ``torch.compile`` wrapper ``generate`` uses for a
  static cache on CUDA (transformers' default ``CompileConfig``: inductor, mode "reduce-overhead",
  i.e. CUDA graphs). Compile caches are reset before each shape, so each shape runs the
  static-shape graph a process decoding only that shape gets. ``generate`` compiles only on
  accelerators, and so does this: on the CPU the static cache runs eagerly (the table says so).
* dynamic: transformers' default ``DynamicCache``, eager, as ``generate`` runs it: each step
  concatenates the new keys and values onto the whole cache.

Timing: a sample is ``--steps`` consecutive steps and one device sync, divided by the steps; the
median of ``--repeats`` samples after ``--warmup`` samples (the first compiles and records the CUDA
graphs). Between samples the cache is rolled back to `context` tokens (`rollback`, untimed).
A shape that fails (e.g. out of memory) is reported and the others still run.

JAX is imported (the shapes come from dspark_jax) but never started here, so that this can run in a
child process beside a JAX benchmark (`bench_decode --hf` runs it first). Run as a script, it keeps
JAX from taking GPU memory if anything did start it.

  python -m benchmarks.bench_hf --small                      # CPU smoke check
  python -m benchmarks.bench_hf --contexts 1024 --batches 1,16,64
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import os
import platform
import statistics
import sys
import time
import traceback

import jax.numpy as jnp

from benchmarks import bench_decode
from benchmarks import harness
from dspark_jax.formats import qwen3 as qwen3_format

HEADROOM = 16
"""Cache slots past the context: bench_decode's 2·(γ + 1) at γ = 7; bounds --steps."""
CACHES = ("static", "dynamic")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_grid_arguments(parser)
  parser.add_argument("--steps", type=int, default=None,
                      help=f"decode steps per sample, 1..{HEADROOM} (default 8; --small: 2)")
  parser.add_argument("--caches", default=",".join(CACHES),
                      help="comma list of the caches to time (default static,dynamic)")
  harness.add_common_arguments(parser, repeats=10, warmup=3, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [1, 16, 64, 128])
  args.contexts = args.contexts or ([32] if args.small else [1024, 4096])
  args.steps = args.steps or (2 if args.small else 8)
  if not 1 <= args.steps <= HEADROOM:
    parser.error(f"--steps must be in 1..{HEADROOM}, got {args.steps}")
  args.caches = [c.strip() for c in args.caches.split(",") if c.strip()]
  if not args.caches or any(c not in CACHES for c in args.caches):
    parser.error(f"--caches: expected names from {CACHES}, got {args.caches}")
  return args


def hf_config(config, transformers):
  """``Qwen3Config`` of a `TargetConfig` (through the checkpoint writer's config dict)."""
  values = qwen3_format.config_to_hf(config)
  values.pop("model_type", None)
  return transformers.Qwen3Config(**values)


def build_model(config, device, torch, transformers):
  """A random ``Qwen3ForCausalLM`` of `config`'s shape, built on `device` in its storage dtype."""
  dtype = getattr(torch, jnp.dtype(config.param_dtype).name)
  previous = torch.get_default_dtype()
  torch.manual_seed(0)
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      model = transformers.Qwen3ForCausalLM(hf_config(config, transformers))
  finally:
    torch.set_default_dtype(previous)
  return model.to(dtype).eval()


def fill(cache, model, batch: int, context: int, torch) -> None:
  """Writes `context` tokens of zero keys and values into every layer of `cache`."""
  cfg = model.config
  zeros = torch.zeros((batch, cfg.num_key_value_heads, context, cfg.head_dim),
                      dtype=model.dtype, device=model.device)
  for layer in range(cfg.num_hidden_layers):
    cache.update(zeros, zeros, layer)


def rollback(cache, kind: str, tokens: int) -> None:
  """Forgets the last `tokens` tokens of every layer. Static layers: their fill counter
  (``cumulative_length``, a tensor the compiled graph reads) is lowered in place, which is what
  the newer transformers' ``StaticLayer.crop`` does (older ones have no such method); dynamic
  layers: ``crop``."""
  if kind == "static":
    for layer in cache.layers:
      layer.cumulative_length.sub_(tokens)
  else:
    cache.crop(-tokens)


def time_steps(step, first, reset, sync, *, steps: int, repeats: int, warmup: int
               ) -> tuple[float, float]:
  """``(median seconds per step, seconds of the first warm-up sample)``; module docstring."""
  def sample():
    token = first
    sync()
    start = time.perf_counter()
    for _ in range(steps):
      token = step(token)
    sync()
    seconds = time.perf_counter() - start
    reset()
    return seconds

  first_s = sample()
  for _ in range(warmup - 1):
    sample()
  return statistics.median(sample() / steps for _ in range(repeats)), first_s


def bench_cache(kind: str, model, batch: int, context: int, args, torch, transformers) -> dict:
  """One cache kind at one shape: ``{"seconds", "compiled", "first_sample_s"}``."""
  cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
  compiled = kind == "static" and model.device.type != "cpu"
  if kind == "static":
    cache = transformers.StaticCache(config=model.config, max_cache_len=context + HEADROOM)
  else:
    cache = transformers.DynamicCache(config=model.config)
  fill(cache, model, batch, context, torch)
  if compiled:
    torch._dynamo.reset()
    forward = model.get_compiled_call(getattr(model.generation_config, "compile_config", None))
  else:
    forward = model.__call__
  cuda = model.device.type == "cuda"

  def step(token):
    if compiled:
      torch.compiler.cudagraph_mark_step_begin()
    out = forward(input_ids=token, use_cache=True, **{cache_kw: cache})
    return out.logits[:, -1, :].float().argmax(-1, keepdim=True)

  first = torch.randint(0, model.config.vocab_size - 1, (batch, 1), device=model.device,
                        generator=torch.Generator(model.device).manual_seed(batch))
  with torch.no_grad():
    seconds, first_s = time_steps(
        step, first, lambda: rollback(cache, kind, args.steps),
        torch.cuda.synchronize if cuda else (lambda: None),
        steps=args.steps, repeats=args.repeats, warmup=args.warmup)
  return {"seconds": seconds, "compiled": compiled, "first_sample_s": first_s}


def free(torch) -> None:
  gc.collect()
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def metadata(args, device, torch, transformers) -> dict:
  kind = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor()
                                                                            or "cpu")
  return {"device_kind": kind, "platform": device.type, "torch_version": torch.__version__,
          "transformers_version": transformers.__version__, "python": sys.version.split()[0],
          "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "git_commit": harness.git_commit(), "repeats": args.repeats, "warmup": args.warmup,
          "steps": args.steps, "contexts": args.contexts, "batches": args.batches,
          "caches": args.caches, "small": args.small}


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    import torch
    import transformers
  except ImportError as exc:
    print(f"bench_hf needs torch and transformers: {exc}", file=sys.stderr)
    return 2
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  meta = metadata(args, device, torch, transformers)
  print(f"device {meta['device_kind']} ({device.type}); torch {meta['torch_version']}; "
        f"transformers {meta['transformers_version']}; {meta['date_utc']}; commit "
        f"{meta['git_commit']}; median of {args.repeats} samples of {args.steps} steps after "
        f"{args.warmup} warm-up samples", flush=True)
  start = time.perf_counter()
  config = bench_decode.target_config(args.small)
  model = build_model(config, device, torch, transformers)
  meta.update(attention=model.config._attn_implementation,
              compile_config=repr(getattr(model.generation_config, "compile_config", None)
                                  or model._default_compile_config()))
  print(f"model built in {time.perf_counter() - start:.1f} s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
        f"{model.dtype}, attention {meta['attention']}", flush=True)

  results = []
  for context in args.contexts:
    for batch in args.batches:
      row = {"context": context, "batch": batch}
      for kind in CACHES:
        if kind not in args.caches:
          row[kind] = {"seconds": None, "skipped": True}
          continue
        try:
          row[kind] = bench_cache(kind, model, batch, context, args, torch, transformers)
          print(f"  context {context}, B={batch}: {kind} cache {row[kind]['seconds'] * 1e3:.3f} ms "
                f"per step ({'compiled' if row[kind]['compiled'] else 'eager'}; first sample "
                f"{row[kind]['first_sample_s']:.1f} s)", flush=True)
        except Exception as exc:  # the other shapes' numbers still count; the failure is reported
          oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
          if not oom:
            traceback.print_exc()
          reason = ("out of memory: " if oom else f"{type(exc).__name__}: ") + " ".join(
              str(exc).split())[:300]
          row[kind] = {"seconds": None, "error": reason}
          print(f"  context {context}, B={batch}: {kind} cache not timed: {reason}", flush=True)
        finally:
          free(torch)
      results.append(row)

  ms = lambda r: "n/a" if r.get("skipped") else ("failed" if r["seconds"] is None
                                                 else f"{r['seconds'] * 1e3:.3f}")
  rows = []
  for r in results:
    s, d = r["static"], r["dynamic"]
    rows.append([str(r["context"]), str(r["batch"]), ms(s),
                 "n/a" if s.get("seconds") is None else ("yes" if s["compiled"] else "no"),
                 ms(d), f"{d['seconds'] / s['seconds']:.2f}"
                 if s.get("seconds") and d.get("seconds") else "n/a"])
  harness.finish(
      f"bench_hf ({meta['device_kind']}, transformers {meta['transformers_version']}, torch "
      f"{meta['torch_version']}, attention {meta['attention']}; ms per greedy decode step: the "
      "forward of one token per row over a cache of `context` tokens, then argmax)",
      ("context", "B", "static ms", "compiled", "dynamic ms", "dynamic / static"), rows,
      meta=meta, results=results, json_path=args.json)
  return 0 if all(r[k].get("seconds") is not None or r[k].get("skipped")
                  for r in results for k in CACHES) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  raise SystemExit(main())
