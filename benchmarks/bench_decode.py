"""One speculative decoding round split into its parts, against their memory floors, and `generate`.

Shapes (default, GPU): a Qwen3-4B-shaped target (36 layers, hidden 2560, 32 query / 8 KV heads of
128, SwiGLU 9728, vocab 151936, tied embeddings, random bf16 weights) and a 5-layer DSpark draft of
the same layer shape (vanilla sequential head, r = 256, confidence head, γ = 7), context 1024
tokens, B ∈ {1, 16, 64}, a mixed batch (even rows greedy, odd rows T = 0.8; B = 1: one sampled row).

Per B it times (`benchmarks.harness`: arguments on the device, median of ``--repeats`` samples
after ``--warmup`` calls), side by side in two groups:

* parts without a cache write, 5 back-to-back calls per sample: the draft forward
  (context-attending block pass -> base logits [B, γ, V] and hidden states), block sampling (the
  folded sampling block on ``--backend``), accept/commit (`verification.verify_arrays` and the
  commit bookkeeping);
* parts that write a cache, each run 10 times inside one compiled ``fori_loop`` with the cache
  carried (updated in place, as in the decoding loop), time per iteration: the target verify (the
  target on [anchor, x_1..x_γ] over the KV cache), the context update (the draft's context K/V),
  the full round (the loop body as one program), and one autoregressive step.

Floors (bytes that must be read once, at the floor bandwidth of `harness.floor_bandwidth`): AR step
and target verify: the target's weights and its KV cache over the context; draft forward: the
draft's layers, the shared LM head and the draft's context K/V; block sampling:
``γ·(r·V + 2·B·V)·itemsize``; full round: those three together. Random weights accept almost
nothing, so speculative tokens/s are given at assumed τ (τ·B / round time) against autoregressive
(B / step time). Finally, at ``--e2e-batch`` rows, `dspark_jax.generate` end to end (speculative
and autoregressive, ``--new-tokens`` tokens, second call, prefill subtracted).

  python -m benchmarks.bench_decode --small          # CPU smoke check (tiny models)
  python -m benchmarks.bench_decode                  # GPU
  python -m benchmarks.bench_decode --batches 16 --e2e-batch 0 --json out.json
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import harness
from dspark_jax import decoding
from dspark_jax import verification
from dspark_jax.draft import block as block_lib
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm

TAUS = (1.0, 2.0, 3.64, 6.11)  # 3.64 / 6.11: the paper's MT-Bench / GSM8K τ for Qwen3-4B
LOOP = 10
PART_CALLS = 5
FLOORED = ("autoregressive step", "target verify", "draft forward", "block sampling", "full round")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=harness.int_list, default=None,
                      help="comma list of batch sizes (default 1,16,64; --small: 2)")
  parser.add_argument("--context", type=int, default=None, help="context tokens (default 1024; "
                      "--small: 32)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--e2e-batch", type=int, default=None,
                      help="rows of the end-to-end generate run, 0 to skip (default 16; --small: 2)")
  parser.add_argument("--new-tokens", type=int, default=None,
                      help="new tokens per row end to end (default 64; --small: 8)")
  harness.add_common_arguments(parser, repeats=20, warmup=3)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [1, 16, 64])
  args.context = args.context or (32 if args.small else 1024)
  if args.e2e_batch is None:
    args.e2e_batch = 2 if args.small else 16
  args.new_tokens = args.new_tokens or (8 if args.small else 64)
  return args


def build_models(small: bool, gamma: int):
  if small:
    target_config = tm.TargetConfig(
        vocab_size=512, num_layers=2, feature_layers=(0, 1),
        layer=layers.LayerShape(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                intermediate_size=64))
    draft_layers, rank, dtype = 1, 32, jnp.float32
  else:
    target_config = tm.qwen3_4b_shape()
    draft_layers, rank, dtype = 5, 256, jnp.bfloat16
  target = tm.TargetModel(target_config, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(
      dm.DraftConfig(gamma=gamma, num_layers=draft_layers,
                     target_layer_ids=target_config.feature_layers,
                     mask_token_id=target_config.vocab_size - 1, head_kind="vanilla", rank=rank,
                     dtype=dtype, param_dtype=dtype),
      target_config, rngs=nnx.Rngs(1))
  return target, draft


def floor_bytes(target, draft, batch: int, context: int) -> dict[str, float]:
  """The bytes each floored part must read at least (module docstring)."""
  t_cfg, gamma, vocab = target.config, draft.config.gamma, target.config.vocab_size
  lm_head = target.embed if t_cfg.tie_embeddings else target.lm_head
  target_kv = harness.nbytes(jax.eval_shape(lambda: tm.init_cache(t_cfg, batch, context)))
  draft_kv = harness.nbytes(jax.eval_shape(lambda: draft.init_context(batch, context)))
  target_bytes = harness.nbytes(nnx.state(target)) + target_kv
  draft_bytes = (harness.nbytes(nnx.state(draft.layers)) + harness.nbytes(nnx.state(lm_head))
                 + draft_kv)
  w2 = draft.head.arrays()["w2"]
  sampling_bytes = gamma * (w2.size + 2 * batch * vocab) * jnp.dtype(draft.config.dtype).itemsize
  return {"autoregressive step": target_bytes, "target verify": target_bytes,
          "draft forward": draft_bytes, "block sampling": sampling_bytes,
          "full round": target_bytes + draft_bytes + sampling_bytes}


def mixed_rows(batch: int) -> dict:
  temperature = np.where(np.arange(batch) % 2 == 1, 0.8, 0.0) if batch > 1 else np.array([0.8])
  return harness.on_device(decoding._row_arrays(dj.SamplingParams(temperature=temperature)))


def looped(body, weights, carry):
  """A thunk running ``carry = body(weights, carry)`` LOOP times in one program (carry donated)."""
  run = jax.jit(lambda w, c: jax.lax.fori_loop(0, LOOP, lambda i, c: body(w, c), c),
                donate_argnums=1)
  box = [carry]

  def call():
    box[0] = run(weights, box[0])
    return box[0]
  return call


def bench_round(target, draft, batch: int, args) -> tuple[dict, dispatch.Choice]:
  """Times the parts of one round and the whole round at one batch size; returns seconds per part
  and the block sampler's backend decision."""
  gamma, vocab, context = draft.config.gamma, target.config.vocab_size, args.context
  choice = block_lib.choose_backend(
      draft.head.arrays(), jax.ShapeDtypeStruct((batch, gamma, vocab), draft.config.dtype),
      kind=draft.head.kind, greedy_only=False, confidence=draft.confidence is not None,
      backend=args.backend, config=args.backend_config)
  head = harness.on_device(pallas_block.head_arrays_for(draft.head.arrays(), [choice]))
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
    return merge_d(d_state)(merge_t(t_state), anchor, anchor_pos, context_cache)

  @jax.jit
  def sample(d_state, head, base, hidden, anchor, anchor_pos, rows, key):
    draft = merge_d(d_state)
    head, conf, hidden = decoding._draft_inputs(draft, hidden, head)
    return block_lib.folded_block(head, conf, base, anchor, hidden, rows["greedy"],
                                  rows["temperature"], rows["seeds"], anchor_pos, key,
                                  kind=draft.head.kind, greedy_only=False, backend=choice)

  @jax.jit
  def accept(logits, tokens, corrected, rows, anchor_pos, key, out, count):
    result = verification.verify_arrays(
        logits, tokens, corrected, rows["temperature"], rows["greedy"], rows["temperature"],
        rows["top_k"], rows["top_p"], rows["seeds"], anchor_pos,
        jnp.full(anchor_pos.shape, gamma + 1, jnp.int32), stop_ids, key, greedy_only=False)
    return layers.write_rows(out, result.committed, count), count + result.num_committed

  start = time.perf_counter()
  context_cache = draft.init_context(batch, cache_len)
  base, hidden = draft_forward(t_state, d_state, anchor, anchor_pos, context_cache)
  tokens, corrected, _ = sample(d_state, head, base, hidden, anchor, anchor_pos, rows, key)
  verify_in = jnp.concatenate([anchor[:, None], tokens], axis=1)
  positions = anchor_pos[:, None] + jnp.arange(gamma + 1)[None, :]
  logits, features, _ = jax.jit(lambda w, c: merge_t(w)(verify_in, positions, c))(
      t_state, tm.init_cache(target.config, batch, cache_len))
  out = jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32)
  count = jnp.zeros((batch,), jnp.int32)
  jax.block_until_ready(accept(logits, tokens, corrected, rows, anchor_pos, key, out, count))
  print(f"  B={batch}: block sampling on {harness.describe_choice(choice)}; parts compiled and run "
        f"in {time.perf_counter() - start:.1f} s", flush=True)

  times = harness.time_side_by_side({
      "draft forward": lambda: draft_forward(t_state, d_state, anchor, anchor_pos, context_cache),
      "block sampling": lambda: sample(d_state, head, base, hidden, anchor, anchor_pos, rows, key),
      "accept/commit": lambda: accept(logits, tokens, corrected, rows, anchor_pos, key, out, count),
  }, repeats=args.repeats, warmup=args.warmup, calls=PART_CALLS)

  def verify_body(w, carry):
    cache, acc = carry
    logits, _, cache = merge_t(w)(verify_in, positions, cache)
    return cache, acc + jnp.sum(jnp.argmax(logits, axis=-1))

  def context_body(w, context):
    return merge_d(w).extend_context(features, positions, context)

  # The loop body as one program, and one autoregressive step, on a state like the loop's; the
  # position and output column are reset each iteration so every iteration does the same work.
  small = {"anchor": anchor, "anchor_pos": anchor_pos,
           "out": jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32),
           "count": jnp.zeros((batch,), jnp.int32), "finished": jnp.zeros((batch,), bool),
           "done": jnp.zeros((batch,), bool), "rounds": jnp.int32(0),
           "reached": jnp.zeros((gamma,), jnp.int32), "accepted": jnp.zeros((gamma,), jnp.int32),
           "row_rounds": jnp.zeros((batch,), jnp.int32),
           "row_accepted": jnp.zeros((batch,), jnp.int32)}
  reset = dict(anchor_pos=np.asarray(anchor_pos), count=np.zeros((batch,), np.int32),
               rounds=np.int32(0))  # host constants: never donated

  def round_body(w, state):
    target, draft = merge_t(w[0]), merge_d(w[1])
    new = decoding._speculative_round(target, draft, state, max_new, rows, stop_ids, key, False,
                                      head=w[2], backend=choice)
    return dict(new, **reset)

  def ar_body(w, state):
    new = decoding._autoregressive_step(merge_t(w), state, max_new, rows, stop_ids, key)
    return dict(new, **reset)

  ar_state = {k: jnp.copy(small[k]) for k in ("anchor", "anchor_pos", "out", "count", "finished",
                                              "done", "rounds")}
  looped_times = harness.time_side_by_side({
      "target verify": looped(verify_body, t_state,
                              (tm.init_cache(target.config, batch, cache_len), jnp.int32(0))),
      "context update": looped(context_body, d_state, draft.init_context(batch, cache_len)),
      "full round": looped(round_body, (t_state, d_state, head),
                           dict(jax.tree.map(jnp.copy, small),
                                cache=tm.init_cache(target.config, batch, cache_len),
                                context=draft.init_context(batch, cache_len))),
      "autoregressive step": looped(ar_body, t_state,
                                    dict(ar_state, cache=tm.init_cache(target.config, batch,
                                                                       cache_len))),
  }, repeats=max(3, args.repeats // 4), warmup=1, calls=1)
  times.update({name: seconds / LOOP for name, seconds in looped_times.items()})
  return times, choice


def bench_e2e(target, draft, args) -> dict:
  """`generate` end to end: per-iteration time of the compiled loops, prefill subtracted."""
  batch, context = args.e2e_batch, args.context
  rng = np.random.default_rng(7)
  vocab = target.config.vocab_size
  prompts = [list(rng.integers(0, vocab - 1, context - 1 - i)) for i in range(batch)]
  params = dj.SamplingParams(temperature=np.where(np.arange(batch) % 2 == 1, 0.8, 0.0))
  out = {}
  for spec in (True, False):
    name = "speculative" if spec else "autoregressive"
    run = lambda n: dj.generate(target, draft, prompts, params, jax.random.key(1), max_new_tokens=n,
                                spec=spec, mode="force", backend=args.backend,
                                config=args.backend_config)
    run(1)
    run(args.new_tokens)  # warm-up: both programs compiled
    # The median of interleaved repeats of each (a single difference of two walls can be noise).
    prefills, results = [], []
    for _ in range(max(3, args.repeats // 4)):
      prefills.append(run(1).wall_seconds)
      results.append(run(args.new_tokens))
    result = results[-1]
    prefill_s = float(np.median(prefills))
    wall_s = float(np.median([r.wall_seconds for r in results]))
    per_iter = (wall_s - prefill_s) / max(result.rounds, 1)
    out[name] = {"wall_s": wall_s, "prefill_s": prefill_s,
                 "rounds": result.rounds, "per_iteration_s": per_iter, "tau": result.tau,
                 "tokens": int(result.lengths.sum()), "path": result.path,
                 "backend": harness.describe_choice(result.backend)}
    print(f"  e2e {name}: {result.rounds} iterations, {per_iter * 1e3:.3f} ms each (prefill "
          f"{prefill_s * 1e3:.1f} ms), τ {result.tau:.3f}, path {result.path}, backend "
          f"{out[name]['backend']}", flush=True)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  meta, bandwidth = harness.start_run(args, context=args.context, gamma=args.gamma,
                                      batches=args.batches)
  start = time.perf_counter()
  target, draft = build_models(args.small, args.gamma)
  jax.block_until_ready(nnx.state(target))
  meta.update(target_bytes=harness.nbytes(nnx.state(target)),
              draft_bytes=harness.nbytes(nnx.state(draft)))
  print(f"models built in {time.perf_counter() - start:.1f} s: target "
        f"{meta['target_bytes'] / 1e6:.1f} MB, draft {meta['draft_bytes'] / 1e6:.1f} MB (its "
        "head included; the shared embedding/LM head not)", flush=True)

  results = {}
  for batch in args.batches:
    times, choice = bench_round(target, draft, batch, args)
    floors = {name: b / bandwidth for name, b in floor_bytes(target, draft, batch,
                                                               args.context).items()}
    results[batch] = {"seconds": times, "floor_seconds": floors, "backend": choice.name,
                      "backend_reason": choice.reason}
    print(f"  B={batch}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()),
          flush=True)
  e2e = bench_e2e(target, draft, args) if args.e2e_batch else {}

  print(f"\nTokens/s: autoregressive (B / step) vs speculative at τ (τ·B / round)")
  print("| B | AR | " + " | ".join(f"spec τ={tau}" for tau in TAUS) + " |")
  for batch, r in results.items():
    t = r["seconds"]
    print(f"| {batch} | {batch / t['autoregressive step']:.0f} | " +
          " | ".join(f"{tau * batch / t['full round']:.0f}" for tau in TAUS) + " |")

  header = (("B", "backend") + tuple(f"{n} ms (×floor)" for n in FLOORED)
            + ("accept ms", "ctx upd ms", "draft+samp %", f"spec/AR τ={TAUS[2]}"))
  rows = []
  for batch, r in results.items():
    t, f = r["seconds"], r["floor_seconds"]
    rows.append([str(batch), r["backend"]]
                + [f"{t[n] * 1e3:.3f} ({t[n] / f[n]:.2f})" for n in FLOORED]
                + [f"{t['accept/commit'] * 1e3:.3f}", f"{t['context update'] * 1e3:.3f}",
                   f"{(t['draft forward'] + t['block sampling']) / t['full round'] * 100:.1f}",
                   f"{TAUS[2] * t['autoregressive step'] / t['full round']:.2f}"])
  title = (f"bench_decode ({meta['device_kind']}, context {args.context}, γ = {args.gamma}; ms per "
           f"part, × its floor at {bandwidth / 1e9:.1f} GB/s)")
  if e2e:
    title = (f"generate() end to end, B = {args.e2e_batch}, {args.new_tokens} new tokens: "
             + "; ".join(f"{k} {v['per_iteration_s'] * 1e3:.3f} ms/iteration" for k, v in e2e.items())
             + "\n" + title)
  harness.finish(title, header, rows, meta=meta,
                 results={"rounds": {str(b): r for b, r in results.items()}, "e2e": e2e},
                 json_path=args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
