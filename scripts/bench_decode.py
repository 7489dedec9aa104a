"""Benchmark of one speculative decoding round, split into its parts, and of the decoding loops.

Shapes (default, GPU): a Qwen3-4B-shaped target (36 layers, hidden 2560, 32 query / 8 KV heads of 128,
SwiGLU 9728, vocab 151936, tied embeddings, random bf16 weights) and a 5-layer DSpark draft of the
same layer shape (vanilla sequential head, r = 256, confidence head, γ = 7), context 1024 tokens,
B ∈ {1, 16, 64}, a mixed batch (even rows greedy, odd rows T = 0.8).

Per B it times (median of ``--repeats`` samples after ``--warmup`` calls; a sample is 5 back-to-back
calls and one sync, so host dispatch overlaps device work); parts that write a cache (target verify,
context update, the full round, the autoregressive step) run 10 times inside one compiled
`fori_loop` with the cache carried, exactly as in the decoding loop, and report the time per
iteration:

* draft forward: context-attending block pass -> base logits [B, γ, V] and hidden states;
* block sampling: the folded γ-step sampler (`proposal.folded_block`, sampling variant);
* target verify: the target on [anchor, x_1..x_γ] (γ + 1 tokens per row) over the KV cache;
* accept/commit: `verification.verify_arrays` and the commit bookkeeping;
* context update: the draft's context K/V for the verified positions;
* full round: the loop body as one program (all of the above), and one autoregressive step.

From these: the draft side (forward + sampling) as a fraction of the round, and tokens/s of
speculative decoding at given τ (τ·B / round time) against autoregressive decoding (B / step time).
Random weights accept almost nothing, so τ is an input here, not a measurement (issue 5 measures τ
with trained models). Finally, at ``--e2e-batch`` rows, it runs `dspark_jax.generate` end to end
(speculative and autoregressive, ``--new-tokens`` tokens) and reports the loop's time per iteration
(prefill subtracted), to check that the compiled loop costs what its parts do.

Run (from the repository root):
  CPU smoke check (tiny shapes):  PYTHONPATH=. python3 scripts/bench_decode.py --small
  GPU:                            PYTHONPATH=. python3 scripts/bench_decode.py
Writes ``$OUT/bench_decode.json`` and ``$OUT/bench_decode.log`` when ``$OUT`` is set. Table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from dspark_jax import decoding
from dspark_jax.models import layers
from dspark_jax.draft import block as proposal
from dspark_jax import verification
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm

TAUS = (1.0, 2.0, 3.64, 6.11)  # 3.64 / 6.11: the paper's MT-Bench / GSM8K τ for Qwen3-4B


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke check")
  parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
  parser.add_argument("--context", type=int, default=None)
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--e2e-batch", type=int, default=None)
  parser.add_argument("--new-tokens", type=int, default=64)
  return parser.parse_args(argv)


def build_models(small: bool, gamma: int):
  if small:
    target_config = tm.TargetConfig(
        vocab_size=2048, num_layers=4, feature_layers=(0, 2, 3),
        layer=layers.LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                intermediate_size=128))
    draft_layers, rank, dtype = 1, 32, jnp.float32
  else:
    target_config = tm.qwen3_4b_shape()
    draft_layers, rank, dtype = 5, 256, jnp.bfloat16
  target = tm.TargetModel(target_config, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(
      dm.DraftConfig(gamma=gamma, num_layers=draft_layers, target_layer_ids=target_config.feature_layers,
                     mask_token_id=target_config.vocab_size - 1, head_kind="vanilla", rank=rank,
                     dtype=dtype, param_dtype=dtype),
      target_config, rngs=nnx.Rngs(1))
  return target, draft


def median_time(fn, repeats, warmup, calls=5):
  """Median per-call seconds of `fn()` (which returns something to block on) after `warmup`
  calls, each sample timing `calls` back-to-back calls and one sync: dispatch overlaps the device
  work, so this is device time unless the host is the bottleneck."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls - 1):
      fn()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


LOOP = 10


def loop_time(body, weights, carry, args):
  """Per-iteration seconds of ``carry = body(weights, carry)`` run LOOP times in one program."""
  run = jax.jit(lambda w, c: jax.lax.fori_loop(0, LOOP, lambda i, c: body(w, c), c),
                donate_argnums=1)
  box = [carry]

  def call():
    box[0] = run(weights, box[0])
    return box[0]
  return median_time(call, max(3, args.repeats // 4), 1, calls=1) / LOOP


def mixed_rows(batch):
  temperature = np.where(np.arange(batch) % 2 == 1, 0.8, 0.0) if batch > 1 else np.array([0.8])
  params = dj.SamplingParams(temperature=temperature)
  return jax.device_put(decoding._row_arrays(params))


def bench_round(target, draft, batch, context, args, log):
  """Times the parts of one round and the whole round at one batch size."""
  gamma, vocab = draft.config.gamma, target.config.vocab_size
  # Weights travel as flat lists of arrays: dispatching an nnx.State of ~500 leaves through a
  # Python-flattened pytree costs milliseconds of host time per call, which the loop never pays.
  t_def, t_state = nnx.split(target)
  d_def, d_state = nnx.split(draft)
  t_state, t_tree = jax.tree.flatten(t_state)
  d_state, d_tree = jax.tree.flatten(d_state)
  merge_t = lambda leaves: nnx.merge(t_def, jax.tree.unflatten(t_tree, leaves))
  merge_d = lambda leaves: nnx.merge(d_def, jax.tree.unflatten(d_tree, leaves))
  rows = mixed_rows(batch)
  key = jax.random.key(0)
  rng = np.random.default_rng(batch)
  cache_len = context + 2 * (gamma + 1)
  anchor = jnp.asarray(rng.integers(0, vocab - 1, batch), jnp.int32)
  anchor_pos = jnp.full((batch,), context, jnp.int32)
  stop_ids = jnp.full((batch, 1), -1, jnp.int32)
  max_new = jnp.full((batch,), 10**6, jnp.int32)

  @jax.jit
  def draft_forward(t_state, d_state, anchor, anchor_pos, context_cache):
    target, draft = merge_t(t_state), merge_d(d_state)
    base, hidden = draft(target, anchor, anchor_pos, context_cache)
    return base, hidden

  @jax.jit
  def sample(d_state, base, hidden, anchor, anchor_pos, rows, key):
    draft = merge_d(d_state)
    head, conf, hidden = decoding._draft_inputs(draft, hidden)
    return proposal.folded_block(head, conf, base, anchor, hidden, rows["greedy"],
                                 rows["temperature"], rows["seeds"], anchor_pos, key,
                                 kind=draft.head.kind, greedy_only=False)

  @jax.jit
  def accept(logits, tokens, corrected, rows, anchor_pos, key, out, count):
    result = verification.verify_arrays(
        logits, tokens, corrected, rows["temperature"], rows["greedy"], rows["temperature"],
        rows["top_k"], rows["top_p"], rows["seeds"], anchor_pos,
        jnp.full(anchor_pos.shape, gamma + 1, jnp.int32), stop_ids, key, greedy_only=False)
    return layers.write_rows(out, result.committed, count), count + result.num_committed

  compile_start = time.perf_counter()
  context_cache = draft.init_context(batch, cache_len)
  base, hidden = draft_forward(t_state, d_state, anchor, anchor_pos, context_cache)
  tokens, corrected, _ = sample(d_state, base, hidden, anchor, anchor_pos, rows, key)
  verify_in = jnp.concatenate([anchor[:, None], tokens], axis=1)
  positions = anchor_pos[:, None] + jnp.arange(gamma + 1)[None, :]
  logits, features, _ = jax.jit(lambda w, c: merge_t(w)(verify_in, positions, c))(
      t_state, tm.init_cache(target.config, batch, cache_len))
  out = jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32)
  count = jnp.zeros((batch,), jnp.int32)
  jax.block_until_ready(accept(logits, tokens, corrected, rows, anchor_pos, key, out, count))
  log(f"  B={batch}: parts compiled and run in {time.perf_counter() - compile_start:.1f} s")

  times = {}
  times["draft forward"] = median_time(
      lambda: draft_forward(t_state, d_state, anchor, anchor_pos, context_cache),
      args.repeats, args.warmup)
  times["block sampling"] = median_time(
      lambda: sample(d_state, base, hidden, anchor, anchor_pos, rows, key), args.repeats, args.warmup)
  times["accept/commit"] = median_time(
      lambda: accept(logits, tokens, corrected, rows, anchor_pos, key, out, count),
      args.repeats, args.warmup)

  # Parts that write a cache run LOOP times inside one program with the cache carried (as in the
  # decoding loop: updated in place, no per-call dispatch of the weights).
  def verify_body(w, carry):
    cache, acc = carry
    logits, _, cache = merge_t(w)(verify_in, positions, cache)
    return cache, acc + jnp.sum(jnp.argmax(logits, axis=-1))
  times["target verify"] = loop_time(
      verify_body, t_state, (tm.init_cache(target.config, batch, cache_len), jnp.int32(0)), args)

  def context_body(w, context):
    return merge_d(w).extend_context(features, positions, context)
  times["context update"] = loop_time(context_body, d_state, draft.init_context(batch, cache_len),
                                      args)

  # The loop body as one program, and one autoregressive step, on a state like the loop's; the
  # position and output column are reset each iteration so every iteration does the same work.
  small = {"anchor": anchor, "anchor_pos": anchor_pos,
           "out": jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32),
           "count": jnp.zeros((batch,), jnp.int32), "finished": jnp.zeros((batch,), bool),
           "done": jnp.zeros((batch,), bool), "rounds": jnp.int32(0),
           "reached": jnp.zeros((gamma,)), "accepted": jnp.zeros((gamma,)),
           "tau_sum": jnp.float32(0), "active_rounds": jnp.float32(0)}
  reset = dict(anchor_pos=np.asarray(anchor_pos), count=np.zeros((batch,), np.int32),
               rounds=np.int32(0))  # host constants: never donated

  def round_body(w, state):
    target, draft = merge_t(w[0]), merge_d(w[1])
    new = decoding._speculative_round(target, draft, state, max_new, rows, stop_ids, key, False)
    return dict(new, **reset)
  times["full round"] = loop_time(
      round_body, (t_state, d_state),
      dict(jax.tree.map(jnp.copy, small), cache=tm.init_cache(target.config, batch, cache_len),
           context=draft.init_context(batch, cache_len)), args)

  def ar_body(w, state):
    new = decoding._autoregressive_step(merge_t(w), state, max_new, rows, stop_ids, key)
    return dict(new, **reset)
  ar_small = {k: jnp.copy(small[k]) for k in ("anchor", "anchor_pos", "out", "count", "finished", "done",
                                     "rounds")}
  times["autoregressive step"] = loop_time(
      ar_body, t_state, dict(ar_small, cache=tm.init_cache(target.config, batch, cache_len)), args)
  return times


def bench_e2e(target, draft, batch, context, new_tokens, log):
  """`generate` end to end: per-iteration time of the compiled loops, prefill subtracted."""
  rng = np.random.default_rng(7)
  vocab = target.config.vocab_size
  prompts = [list(rng.integers(0, vocab - 1, context - 1 - i)) for i in range(batch)]
  params = dj.SamplingParams(temperature=np.where(np.arange(batch) % 2 == 1, 0.8, 0.0))
  out = {}
  for spec in (True, False):
    name = "speculative" if spec else "autoregressive"
    kw = dict(spec=spec, mode="force")
    dj.generate(target, draft, prompts, params, jax.random.key(1), max_new_tokens=1, **kw)
    prefill = dj.generate(target, draft, prompts, params, jax.random.key(1), max_new_tokens=1, **kw)
    dj.generate(target, draft, prompts, params, jax.random.key(1), max_new_tokens=new_tokens, **kw)
    result = dj.generate(target, draft, prompts, params, jax.random.key(1),
                         max_new_tokens=new_tokens, **kw)
    per_iter = (result.wall_seconds - prefill.wall_seconds) / max(result.rounds, 1)
    out[name] = {"wall_s": result.wall_seconds, "prefill_s": prefill.wall_seconds,
                 "rounds": result.rounds, "per_iteration_s": per_iter, "tau": result.tau,
                 "tokens": int(result.lengths.sum()), "path": result.path}
    log(f"  e2e {name}: {result.rounds} iterations, {per_iter * 1e3:.2f} ms each (prefill "
        f"{prefill.wall_seconds * 1e3:.1f} ms), τ {result.tau:.3f}, path {result.path}")
  return out


def main(argv=None):
  args = parse_args(argv)
  out_dir = os.environ.get("OUT")
  log_file = open(os.path.join(out_dir, "bench_decode.log"), "w") if out_dir else None

  def log(text=""):
    print(text, flush=True)
    if log_file:
      log_file.write(text + "\n")
      log_file.flush()

  batches = ([int(b) for b in args.batches.split(",")] if args.batches
             else ([1, 4] if args.small else [1, 16, 64]))
  context = args.context or (64 if args.small else 1024)
  e2e_batch = args.e2e_batch if args.e2e_batch is not None else (2 if args.small else 16)
  meta = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
          "backend": jax.default_backend(), "jax": jax.__version__, "context": context,
          "gamma": args.gamma, "repeats": args.repeats, "warmup": args.warmup}
  log(f"bench_decode {meta}")
  start = time.perf_counter()
  target, draft = build_models(args.small, args.gamma)
  jax.block_until_ready(nnx.state(target))
  n_target = sum(x.size for x in jax.tree.leaves(nnx.state(target)))
  n_draft = sum(x.size for x in jax.tree.leaves(nnx.state(draft)))
  meta.update(target_params=int(n_target), draft_params=int(n_draft))
  log(f"models built in {time.perf_counter() - start:.1f} s: target {n_target / 1e9:.3f} B params, "
      f"draft {n_draft / 1e6:.1f} M params (shared embedding/LM head not counted)")

  results = {}
  for batch in batches:
    results[batch] = bench_round(target, draft, batch, context, args, log)
    log(f"  B={batch}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in results[batch].items()))
  e2e = bench_e2e(target, draft, e2e_batch, context, args.new_tokens, log) if e2e_batch else {}

  parts = ["draft forward", "block sampling", "target verify", "accept/commit", "context update"]
  log("")
  log(f"One round, ms (median of {args.repeats}); device {meta['device']}, context {context}, "
      f"γ = {args.gamma}")
  log("| B | " + " | ".join(parts) + " | sum of parts | full round | draft+sampling % of round "
      "| sampling % of round | AR step |")
  log("|---:|" + "---:|" * (len(parts) + 5))
  for batch, t in results.items():
    total = sum(t[p] for p in parts)
    draft_share = (t["draft forward"] + t["block sampling"]) / t["full round"] * 100
    sample_share = t["block sampling"] / t["full round"] * 100
    log(f"| {batch} | " + " | ".join(f"{t[p] * 1e3:.3f}" for p in parts) +
        f" | {total * 1e3:.3f} | {t['full round'] * 1e3:.3f} | {draft_share:.1f} | "
        f"{sample_share:.1f} | {t['autoregressive step'] * 1e3:.3f} |")
  log("")
  log("Tokens/s: autoregressive (B / step) vs speculative at τ (τ·B / round)")
  log("| B | AR | " + " | ".join(f"spec τ={tau}" for tau in TAUS) + " | speed-up at τ=" +
      f"{TAUS[-1]} |")
  log("|---:|---:|" + "---:|" * (len(TAUS) + 1))
  for batch, t in results.items():
    ar = batch / t["autoregressive step"]
    spec = [tau * batch / t["full round"] for tau in TAUS]
    log(f"| {batch} | {ar:.0f} | " + " | ".join(f"{s:.0f}" for s in spec) +
        f" | {spec[-1] / ar:.2f}× |")
  if e2e:
    log("")
    log(f"generate() end to end, B = {e2e_batch}, {args.new_tokens} new tokens, context {context}: "
        + "; ".join(f"{k}: {v['per_iteration_s'] * 1e3:.2f} ms/iteration over {v['rounds']}"
                    for k, v in e2e.items()))
  if out_dir:
    with open(os.path.join(out_dir, "bench_decode.json"), "w") as f:
      json.dump({"meta": meta, "rounds": {str(b): t for b, t in results.items()}, "e2e": e2e}, f,
                indent=2)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
