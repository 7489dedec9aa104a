"""One speculative decoding round split into its parts, against their floors, and `generate`.

Shapes (default, GPU): a Qwen3-4B-shaped target (36 layers, hidden 2560, 32 query / 8 KV heads of
128, SwiGLU 9728, vocab 151936, tied embeddings, random bf16 weights) and a 5-layer DSpark draft of
the same layer shape (vanilla sequential head, r = 256, confidence head, γ = 7), at every context
of ``--contexts`` (1024, 4096) and batch size of ``--batches`` (1, 16, 64, 128), a mixed batch
(even rows greedy, odd rows T = 0.8; B = 1: one sampled row).

Per (context, B) it times (`benchmarks.harness`: arguments on the device, median of ``--repeats``
samples after ``--warmup`` calls) the parts of ``--parts``:

* parts without a cache write, side by side, 5 back-to-back calls per sample: the draft forward
  (context-attending block pass -> base logits [B, γ, V] and hidden states), block sampling (the
  folded sampling block on ``--backend``), accept/commit (`verification.verify_arrays` and the
  commit bookkeeping);
* parts that write a cache, one after the other, each run 10 times inside one compiled
  ``fori_loop`` with its caches carried and donated (updated in place, as in the decoding loop),
  time per iteration: the target verify (the target on [anchor, x_1..x_γ] over the KV cache), the
  context update (the draft's context K/V), the full round (the loop body as one program), and one
  autoregressive step. Each part builds its caches in its first call and drops them before the
  next part starts, so no two target caches are alive at once (B = 128 at context 4096: 78 GB).
* on request only (not in the default ``--parts``), the packed round: the full round with every
  row verifying γ + 1 through the scheduled verify (`schedules.fixed()`: `packing.packed_verify`'s
  `lax.switch` over the token buckets of B rows, taking the dense one), as `fixed` runs in the
  serving sweep's shared program.

A part that fails (e.g. out of memory) is reported as such and the others still run.

Floors: the larger of a bytes floor (what must be read once, at `harness.floor_bandwidth`) and a
compute floor (2 FLOPs per parameter per token at this run's bf16 matrix rate,
`harness.matmul_rate`). Bytes: AR step and target verify: the target's weights and its KV cache
over the context; draft forward: the draft's layers, the shared LM head and the draft's context
K/V; block sampling: ``γ·(r·V + 2·B·V)·itemsize``; full and packed round: those three together.
Parameters: the target's (AR step: B tokens; verify: B·(γ+1)); the draft's layers and the LM head (B·γ
tokens); W2 for block sampling (B·γ tokens); the full round: the sum of its three parts.
Attention's own FLOPs over the context are not counted, so the compute floor is a lower bound.

Random weights accept almost nothing, so speculative tokens/s are given at assumed τ (τ·B / round
time) against autoregressive (B / step time). With ``--e2e-batch N``: `dspark_jax.generate` end to
end at the first context (speculative and autoregressive, ``--new-tokens`` tokens, second call,
prefill subtracted), each against the step it repeats (full round, AR step) timed at the decode's
mean context in a cache of exactly that context. With ``--hf``: Hugging Face transformers' decode step on the same shapes
(`benchmarks.bench_hf`, run first in a child process so that the two never hold the GPU's memory at
once), its static-cache time beside our autoregressive step in the final table.

Run as a script, it lets JAX take 92 % of the GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
unless set) instead of JAX's default 75 %: B = 128 at context 4096 needs about 100 GB.

  python -m benchmarks.bench_decode --small          # CPU smoke check (tiny models)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.bench_decode --small --tp 2
  python -m benchmarks.bench_decode --shape 32b --tp 2 --batches 1 --contexts 1024   # GPUs
  python -m benchmarks.bench_decode --hf             # GPU: the default grid, with transformers
  python -m benchmarks.bench_decode --contexts 1024 --batches 16 --e2e-batch 16 --json out.json
  python -m benchmarks.bench_decode --parts "autoregressive step,target verify,full round"
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import harness
from dspark_jax import decoding
from dspark_jax import verification
from dspark_jax.decoding import rounds
from dspark_jax.draft import block as block_lib
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.parallel import layout
from dspark_jax.parallel import placement
from dspark_jax.scheduling import schedules

TAUS = (1.0, 2.0, 3.64, 6.11)  # 3.64 / 6.11: the paper's MT-Bench / GSM8K τ for Qwen3-4B
LOOP = 10
PART_CALLS = 5
DIRECT = ("draft forward", "block sampling", "accept/commit")
LOOPED = ("target verify", "context update", "full round", "packed round", "autoregressive step")
PARTS = ("autoregressive step", "target verify", "draft forward", "block sampling",
         "accept/commit", "context update", "full round", "packed round")
DEFAULT_PARTS = PARTS[:-1]
FLOORED = ("autoregressive step", "target verify", "draft forward", "block sampling", "full round",
           "packed round")
MEM_FRACTION = "0.92"


def part_list(text: str) -> list[str]:
  """argparse type: a comma list of part names (`PARTS`)."""
  names = [part.strip() for part in text.split(",") if part.strip()]
  bad = [name for name in names if name not in PARTS]
  if not names or bad:
    raise argparse.ArgumentTypeError(f"unknown part {bad[0] if bad else text!r}; parts are "
                                     f"{', '.join(PARTS)}")
  return [name for name in PARTS if name in names]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_grid_arguments(parser)
  parser.add_argument("--context", type=int, default=None, help="one context (= --contexts N)")
  parser.add_argument("--capacities", type=harness.int_list, default=None,
                      help="comma list of cache sizes in slots, apart from the context (default: "
                      "context + 2(γ + 1) rounded up to 64 slots, as generate allocates); e.g. 136,8200 at context 128 times the "
                      "padding cost: a step over a cache far larger than its rows' context")
  parser.add_argument("--parts", type=part_list, default=list(DEFAULT_PARTS),
                      help=f"comma list of the parts to time (default {', '.join(DEFAULT_PARTS)}; "
                      "also: packed round)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--e2e-batch", type=int, default=0,
                      help="rows of an end-to-end generate run at the first context (default 0: "
                      "skipped)")
  parser.add_argument("--new-tokens", type=int, default=None,
                      help="new tokens per row end to end (default 64; --small: 8)")
  parser.add_argument("--hf", action="store_true",
                      help="also time transformers' decode step on the same shapes "
                      "(benchmarks.bench_hf, in a child process run first)")
  parser.add_argument("--tp", type=int, default=1,
                      help="tensor parallelism: a mesh of this many devices (dspark_jax.shard's "
                      "layout; weights built straight into shards); floors at the aggregate "
                      "bandwidth of the K devices")
  parser.add_argument("--shape", choices=sorted(SHAPES), default="4b",
                      help="the target's shape (Qwen3-4B, -8B or -32B; --small overrides)")
  harness.add_common_arguments(parser, repeats=20, warmup=3)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  if args.context is not None and args.contexts is not None:
    parser.error("--context and --contexts: give one of them")
  args.batches = args.batches or ([2] if args.small else [1, 16, 64, 128])
  args.contexts = ([args.context] if args.context is not None
                   else args.contexts or ([32] if args.small else [1024, 4096]))
  if min(args.contexts) < 2:
    parser.error("--contexts: each context must be >= 2 tokens")
  if args.capacities and min(args.capacities) < max(args.contexts) + args.gamma + 1:
    parser.error(f"--capacities: each cache must hold the context and a verify block "
                 f"({max(args.contexts) + args.gamma + 1} slots)")
  if args.e2e_batch < 0:
    parser.error("--e2e-batch must be >= 0")
  args.new_tokens = args.new_tokens or (8 if args.small else 64)
  return args


SHAPES = {
    "4b": {},
    "8b": dict(num_layers=36, tie_embeddings=False, feature_layers=(1, 9, 17, 25, 33),
               layer=layers.LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8,
                                       head_dim=128, intermediate_size=12288)),
    "32b": dict(num_layers=64, tie_embeddings=False, feature_layers=(1, 16, 31, 46, 61),
                layer=layers.LayerShape(hidden_size=5120, num_heads=64, num_kv_heads=8,
                                        head_dim=128, intermediate_size=25600)),
}
"""Target shapes by name: overrides of `tm.qwen3_4b_shape` (Qwen3-8B and -32B: untied, V 151936)."""


def target_config(small: bool, shape: str = "4b", tp: int = 1) -> tm.TargetConfig:
  """The benchmark's target shape (`SHAPES`), or (`small`) a 2-layer float32 model for CPUs whose
  draft reads the embedding output and layer 0 (a DeepSpec draft may not read the final layer);
  with `tp` > 1 the small model has `tp` KV heads, so the mesh divides them."""
  if small:
    return tm.TargetConfig(
        vocab_size=512, num_layers=2, feature_layers=(-1, 0),
        layer=layers.LayerShape(hidden_size=32, num_heads=2 * tp, num_kv_heads=tp, head_dim=16,
                                intermediate_size=64))
  return tm.qwen3_4b_shape(**SHAPES[shape])


def build_models(small: bool, gamma: int, shape: str = "4b", tp: int = 1):
  """A random target (`target_config`) and a DSpark draft of its layer shape: 5 layers, vanilla
  head r = 256, bf16 (`small`: 1 layer, r = 32, float32). With `tp` > 1 both are built straight
  into shards on a mesh of `tp` devices (`dspark_jax.shard`'s layout): no whole copy anywhere."""
  config = target_config(small, shape, tp)
  draft_layers, rank, dtype = (1, 32, jnp.float32) if small else (5, 256, jnp.bfloat16)
  make_target = lambda: tm.TargetModel(config, rngs=nnx.Rngs(0))
  make_draft = lambda: dm.DSparkDraft(
      dm.DraftConfig(gamma=gamma, num_layers=draft_layers, target_layer_ids=config.feature_layers,
                     mask_token_id=config.vocab_size - 1, head_kind="vanilla", rank=rank,
                     dtype=dtype, param_dtype=dtype),
      config, rngs=nnx.Rngs(1))
  if tp == 1:
    return make_target(), make_draft()
  plan = layout.Plan(dj.make_mesh(tp))
  return sharded_random(make_target, plan, 0), sharded_random(make_draft, plan, 1)


def sharded_random(make, plan, seed: int):
  """`make()`'s model with random weights (N(0, 0.02²); ones for vectors) generated in place
  on `plan`'s mesh, each parameter by one program whose output is already sharded."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  def build(path, leaf):
    name = placement.path_name(path)
    sharding = plan.sharding(layout.param_spec(name, plan))
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) % (2 ** 31))
    fill = ((lambda: jnp.ones(leaf.shape, leaf.dtype)) if len(leaf.shape) < 2 else
            (lambda: (0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)))
    return jax.jit(fill, out_shardings=sharding)()
  model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(build, state))
  placement.set_plan(model, plan)
  return model


def _elements(tree) -> int:
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def part_costs(target, draft, batch: int, context: int) -> dict[str, tuple[float, float]]:
  """``(bytes, FLOPs)`` each floored part needs at least (module docstring)."""
  t_cfg, gamma, vocab = target.config, draft.config.gamma, target.config.vocab_size
  lm_head = target.embed if t_cfg.tie_embeddings else target.lm_head
  target_kv = harness.nbytes(jax.eval_shape(lambda: tm.init_cache(t_cfg, batch, context)))
  draft_kv = harness.nbytes(jax.eval_shape(lambda: draft.init_context(batch, context)))
  target_bytes = harness.nbytes(nnx.state(target)) + target_kv
  draft_bytes = (harness.nbytes(nnx.state(draft.layers)) + harness.nbytes(nnx.state(lm_head))
                 + draft_kv)
  # Parameters a token multiplies: an untied embedding is a lookup, the LM head a product.
  target_params = _elements(nnx.state(target)) - (
      0 if t_cfg.tie_embeddings else _elements(nnx.state(target.embed)))
  draft_params = _elements(nnx.state(draft.layers)) + _elements(nnx.state(lm_head))
  w2 = draft.head.arrays()["w2"]
  sampling_bytes = gamma * (w2.size + 2 * batch * vocab) * jnp.dtype(draft.config.dtype).itemsize
  costs = {"autoregressive step": (target_bytes, 2 * target_params * batch),
           "target verify": (target_bytes, 2 * target_params * batch * (gamma + 1)),
           "draft forward": (draft_bytes, 2 * draft_params * batch * gamma),
           "block sampling": (sampling_bytes, 2 * w2.size * batch * gamma)}
  costs["full round"] = tuple(sum(costs[n][i] for n in ("target verify", "draft forward",
                                                        "block sampling")) for i in (0, 1))
  costs["packed round"] = costs["full round"]
  return costs


def floors(costs: dict, bandwidth: float, rate: float) -> dict[str, dict]:
  """Per part ``{"bytes_s", "compute_s", "floor_s", "bound": "bytes" | "compute"}``."""
  out = {}
  for name, (nbytes, flops) in costs.items():
    bytes_s, compute_s = nbytes / bandwidth, flops / rate
    out[name] = {"bytes_s": bytes_s, "compute_s": compute_s, "floor_s": max(bytes_s, compute_s),
                 "bound": "compute" if compute_s > bytes_s else "bytes"}
  return out


def mixed_rows(batch: int) -> dict:
  temperature = np.where(np.arange(batch) % 2 == 1, 0.8, 0.0) if batch > 1 else np.array([0.8])
  return harness.on_device(decoding._row_arrays(dj.SamplingParams(temperature=temperature)))


def looped(body, weights, make_carry):
  """A thunk running ``carry = body(weights, carry)`` LOOP times in one program, the carry donated;
  its first call builds the carry (``make_carry()``), which lives as long as the thunk. After that
  call, ``thunk.compiled()`` gives the compiled program (jit's cache: no second compile)."""
  run = jax.jit(lambda w, c: jax.lax.fori_loop(0, LOOP, lambda i, c: body(w, c), c),
                donate_argnums=1)
  box = [None]

  def call():
    if box[0] is None:
      box[0] = make_carry()
    box[0] = run(weights, box[0])
    return box[0]
  call.compiled = lambda: run.lower(weights, box[0]).compile()  # after the first call
  return call


def describe_failure(exc: BaseException) -> str:
  """One line: "out of memory: ..." for an allocation failure, else the exception."""
  text = " ".join(str(exc).split())
  if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
    return "out of memory: " + text[:200]
  return f"{type(exc).__name__}: {text[:300]}"


def attempt(label: str, names, errors: dict, fn):
  """``fn()``, or None after recording the failure under every name of `names` in `errors`."""
  try:
    return fn()
  except Exception as exc:  # the other parts' numbers still count; the failure is reported
    reason = describe_failure(exc)
    if not reason.startswith("out of memory"):
      traceback.print_exc()
    print(f"  {label}: {', '.join(names)} not timed: {reason}", flush=True)
    errors.update({name: reason for name in names})
    return None
  finally:
    gc.collect()


def round_parts(target, draft, batch: int, context: int, args, capacity: int | None = None):
  """The parts of one round at (context, batch) as thunks, with caches of `capacity` slots (None:
  ``context + 2(γ + 1)``): ``(direct, makers, choice)``. ``direct(names)`` compiles and runs once
  the parts of `names` among `DIRECT` (and the draft forward, their input) and returns ``{name:
  thunk}``, each thunk one call; ``makers[name]()`` for a part of `LOOPED` returns a `looped`
  thunk, LOOP iterations a call. Every thunk has ``thunk.compiled()`` once called. `choice`: the
  block sampler's backend decision (``args.backend``, ``args.backend_config``)."""
  gamma, vocab = draft.config.gamma, target.config.vocab_size
  label = f"context {context}, B={batch}"
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
  cache_len = capacity or tm.cache_slots(context + 2 * (gamma + 1))
  anchor = jnp.asarray(rng.integers(0, vocab - 1, batch), jnp.int32)
  anchor_pos = jnp.full((batch,), context, jnp.int32)
  stop_ids = jnp.full((batch, 1), -1, jnp.int32)
  max_new = jnp.full((batch,), 10**6, jnp.int32)
  # The verify's inputs: the anchor and a block of drafts; the context update's: target features.
  drafts = jnp.asarray(rng.integers(0, vocab - 1, (batch, gamma)), jnp.int32)
  verify_in = jnp.concatenate([anchor[:, None], drafts], axis=1)
  positions = anchor_pos[:, None] + jnp.arange(gamma + 1)[None, :]
  features = jax.random.normal(jax.random.key(2), (
      batch, gamma + 1, len(target.config.feature_layers) * target.config.hidden_size),
      target.config.dtype)

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

  def direct(names):
    """The parts of `names` without a cache write; their buffers live as long as the thunks."""
    start = time.perf_counter()
    context_cache = draft.init_context(batch, cache_len)
    thunks = {"draft forward": harness.program(draft_forward, t_state, d_state, anchor,
                                               anchor_pos, context_cache)}
    outs = base, hidden = thunks["draft forward"]()
    if "block sampling" in names or "accept/commit" in names:
      thunks["block sampling"] = harness.program(sample, d_state, head, base, hidden, anchor,
                                                 anchor_pos, rows, key)
      outs = tokens, corrected, _ = thunks["block sampling"]()
    if "accept/commit" in names:
      logits = jax.random.normal(jax.random.key(3), (batch, gamma + 1, vocab), target.config.dtype)
      out = jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32)
      count = jnp.zeros((batch,), jnp.int32)
      thunks["accept/commit"] = harness.program(accept, logits, tokens, corrected, rows,
                                                anchor_pos, key, out, count)
      outs = thunks["accept/commit"]()
    jax.block_until_ready(outs)
    print(f"  {label}: direct parts compiled and run in {time.perf_counter() - start:.1f} s",
          flush=True)
    return {name: thunks[name] for name in DIRECT if name in names}

  def verify_body(w, carry):
    cache, acc = carry
    logits, _, cache = merge_t(w)(verify_in, positions, cache)
    return cache, acc + jnp.sum(jnp.argmax(logits, axis=-1))

  def context_body(w, context_cache):
    return merge_d(w).extend_context(features, positions, context_cache)

  def small_state():
    """The loop's state besides the caches; the position and output column are reset each
    iteration so every iteration does the same work."""
    return {"anchor": jnp.copy(anchor), "anchor_pos": jnp.copy(anchor_pos),
            "out": jnp.full((batch, 4 * (gamma + 1)), -1, jnp.int32),
            "count": jnp.zeros((batch,), jnp.int32), "finished": jnp.zeros((batch,), bool),
            "done": jnp.zeros((batch,), bool), "rounds": jnp.int32(0),
            "reached": jnp.zeros((gamma,), jnp.int32), "accepted": jnp.zeros((gamma,), jnp.int32),
            "row_rounds": jnp.zeros((batch,), jnp.int32),
            "row_accepted": jnp.zeros((batch,), jnp.int32)}

  reset = dict(anchor_pos=np.asarray(anchor_pos), count=np.zeros((batch,), np.int32),
               rounds=np.int32(0))  # host constants: never donated

  packed = schedules.fixed()  # every row verifies γ + 1, through the scheduled (packed) verify

  def round_body(w, state, schedule=None):
    target, draft = merge_t(w[0]), merge_d(w[1])
    new = decoding._speculative_round(target, draft, state, max_new, rows, stop_ids, key, False,
                                      head=w[2], backend=choice, schedule=schedule)
    return dict(new, **reset)

  def round_state():
    return dict(small_state(), cache=tm.init_cache(target.config, batch, cache_len),
                context=draft.init_context(batch, cache_len))

  def ar_body(w, state):
    new = decoding._autoregressive_step(merge_t(w), state, max_new, rows, stop_ids, key)
    return dict(new, **reset)

  ar_keys = ("anchor", "anchor_pos", "out", "count", "finished", "done", "rounds")
  thunk_makers = {
      "target verify": lambda: looped(
          verify_body, t_state,
          lambda: (tm.init_cache(target.config, batch, cache_len), jnp.int32(0))),
      "context update": lambda: looped(
          context_body, d_state, lambda: draft.init_context(batch, cache_len)),
      "full round": lambda: looped(round_body, (t_state, d_state, head), round_state),
      "packed round": lambda: looped(
          functools.partial(round_body, schedule=packed), (t_state, d_state, head),
          lambda: dict(round_state(), **rounds.schedule_entries(packed, batch, gamma))),
      "autoregressive step": lambda: looped(
          ar_body, t_state,
          lambda: dict({k: v for k, v in small_state().items() if k in ar_keys},
                       cache=tm.init_cache(target.config, batch, cache_len))),
  }
  return direct, thunk_makers, choice


def bench_round(target, draft, batch: int, context: int, args, capacity: int | None = None
                ) -> tuple[dict, dict, dispatch.Choice]:
  """Times the parts of ``args.parts`` at one (context, batch), with caches of `capacity` slots
  (None: ``context + 2(γ + 1)``); returns seconds per part, the failures ``{part: reason}`` of
  parts not timed, and the block sampler's backend decision."""
  label = f"context {context}, B={batch}"
  direct_thunks, thunk_makers, choice = round_parts(target, draft, batch, context, args, capacity)
  times, errors = {}, {}
  direct = [name for name in DIRECT if name in args.parts]
  if direct:
    # Side by side; every buffer dies on return.
    times.update(attempt(label, direct, errors, lambda: harness.time_side_by_side(
        direct_thunks(direct), repeats=args.repeats, warmup=args.warmup, calls=PART_CALLS)) or {})
  for name in LOOPED:
    if name in args.parts:
      # One part at a time: its thunk (and the caches it carries) is dropped before the next.
      seconds = attempt(label, [name], errors, lambda: harness.time_one(
          thunk_makers[name](), repeats=max(3, args.repeats // 4), warmup=1))
      if seconds is not None:
        times[name] = seconds / LOOP
  return times, errors, choice


def bench_e2e(pairs: dict, *, batch: int, context: int, new_tokens: int, repeats: int,
              backend: str | None = None, config=None) -> dict:
  """`generate` end to end on each ``(target, draft)`` of `pairs` (``{name: pair}``), the same
  prompts (B = `batch`, `context` - 1 - i tokens in row i) and keys: per-iteration time of the
  compiled loop, prefill subtracted.

  Per decoding mode (speculative, then autoregressive): each pair runs once with 1 and once with
  `new_tokens` new tokens (compiling both programs); then ``max(3, repeats // 4)`` repeats, each
  timing every pair (the order rotating) with 1 new token (the prefill) and `new_tokens`. Medians.

  Returns:
    ``{name: {"speculative": r, "autoregressive": r}}``; r holds "wall_s", "prefill_s", "rounds",
    "per_iteration_s", "tau", "tokens" (how many generated), "token_ids" (the last call's [B, N]
    tokens as lists, -1 after a row's end), "path", "backend".
  """
  rng = np.random.default_rng(7)
  vocab = next(iter(pairs.values()))[0].config.vocab_size
  prompts = [list(rng.integers(0, vocab - 1, max(1, context - 1 - i))) for i in range(batch)]
  params = dj.SamplingParams(temperature=np.where(np.arange(batch) % 2 == 1, 0.8, 0.0))
  names = list(pairs)
  out = {name: {} for name in names}
  for spec in (True, False):
    mode = "speculative" if spec else "autoregressive"

    def run(name, n):
      target, draft = pairs[name]
      return dj.generate(target, draft, prompts, params, jax.random.key(1), max_new_tokens=n,
                         spec=spec, mode="force", backend=backend, config=config)

    for name in names:
      run(name, 1)
      run(name, new_tokens)  # warm-up: both programs compiled
    # The median of interleaved repeats (a single difference of two walls can be noise).
    prefills = {name: [] for name in names}
    results = {name: [] for name in names}
    for i in range(max(3, repeats // 4)):
      for j in range(len(names)):
        name = names[(i + j) % len(names)]
        prefills[name].append(run(name, 1).wall_seconds)
        results[name].append(run(name, new_tokens))
    for name in names:
      result = results[name][-1]
      prefill_s = float(np.median(prefills[name]))
      wall_s = float(np.median([r.wall_seconds for r in results[name]]))
      per_iter = (wall_s - prefill_s) / max(result.rounds, 1)
      out[name][mode] = {
          "wall_s": wall_s, "prefill_s": prefill_s, "rounds": result.rounds,
          "per_iteration_s": per_iter, "tau": result.tau, "tokens": int(result.lengths.sum()),
          "token_ids": np.asarray(result.tokens).tolist(), "path": result.path,
          "backend": harness.describe_choice(result.backend)}
      print(f"  e2e {name + ' ' if name else ''}{mode}: {result.rounds} iterations, "
            f"{per_iter * 1e3:.3f} ms each (prefill {prefill_s * 1e3:.1f} ms), τ {result.tau:.3f}, "
            f"path {result.path}, backend {out[name][mode]['backend']}", flush=True)
  return out


def against_mean_context(target, draft, e2e: dict, args) -> None:
  """Adds to each mode of `e2e` (`bench_e2e`'s result for one pair) the part it repeats (the AR
  step, the full round) timed at the decode's mean context, in a cache of exactly that context:
  "mean_context", "step_at_mean_context_s" and "vs_step_at_mean_context" (the e2e's per-iteration
  time over it; 1.0 when the decode's cost follows its context)."""
  batch, first = args.e2e_batch, args.contexts[0]
  prompt = float(np.mean([max(1, first - 1 - i) for i in range(batch)]))
  context = int(round(prompt + args.new_tokens / 2))
  parts = {"speculative": "full round", "autoregressive": "autoregressive step"}
  sub = argparse.Namespace(**{**vars(args), "parts": list(parts.values())})
  times, _, _ = bench_round(target, draft, batch, context, sub)
  for mode, part in parts.items():
    if part in times and mode in e2e:
      e2e[mode].update(mean_context=context, step_at_mean_context_s=times[part],
                       vs_step_at_mean_context=e2e[mode]["per_iteration_s"] / times[part])
      print(f"  e2e {mode}: {e2e[mode]['per_iteration_s'] * 1e3:.3f} ms per iteration against "
            f"{times[part] * 1e3:.3f} ms for the {part} at the mean context {context} "
            f"({e2e[mode]['vs_step_at_mean_context']:.2f}x)", flush=True)


def run_hf(args) -> dict | None:
  """`benchmarks.bench_hf` on this run's contexts and batches, in a child process, its output
  passed through; returns its saved results, or None if it failed. Call it before this process
  puts anything on the GPU: the child must find the device's memory free."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "hf.json")
    command = [sys.executable, "-m", "benchmarks.bench_hf",
               "--contexts", ",".join(map(str, args.contexts)),
               "--batches", ",".join(map(str, args.batches)),
               "--repeats", str(max(3, args.repeats // 4)), "--json", path]
    command += ["--small"] if args.small else []
    print("transformers: " + " ".join(command[1:-2]), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    for line in child.stdout:
      print("  [hf] " + line.rstrip("\n"), flush=True)
    status = child.wait()
    print(f"transformers: exit status {status} after {time.perf_counter() - start:.1f} s",
          flush=True)
    if not os.path.exists(path):  # a status of 1 with results: some shape failed, as printed
      return None
    with open(path, encoding="utf-8") as f:
      return json.load(f)


def hf_cell(hf_rows: dict, context: int, batch: int, ours_s: float | None) -> str:
  row = hf_rows.get((context, batch))
  if row is None or row["static"].get("seconds") is None:
    return "failed" if row is not None else "n/a"
  hf_s = row["static"]["seconds"]
  ratio = f" ({hf_s / ours_s:.2f}×)" if ours_s else ""
  return f"{hf_s * 1e3:.3f}{ratio}"


def main(argv=None) -> int:
  args = parse_args(argv)
  hf = run_hf(args) if args.hf else None  # first: JAX has not touched the device yet
  meta, bandwidth = harness.start_run(args, contexts=args.contexts, gamma=args.gamma,
                                      batches=args.batches, parts=args.parts)
  rate = harness.matmul_rate(args.small)
  meta["matmul_tflops"] = rate / 1e12
  print(f"compute floors at {rate / 1e12:.1f} TFLOP/s (this run's bf16 matrix product)", flush=True)
  start = time.perf_counter()
  target, draft = build_models(args.small, args.gamma, args.shape, args.tp)
  if args.tp > 1:
    bandwidth *= args.tp
    meta["tp"] = args.tp
    print(f"tensor parallel over {args.tp} devices: floors at the aggregate {bandwidth / 1e9:.1f} "
          "GB/s", flush=True)
  jax.block_until_ready(nnx.state(target))
  meta.update(target_bytes=harness.nbytes(nnx.state(target)),
              draft_bytes=harness.nbytes(nnx.state(draft)))
  print(f"models built in {time.perf_counter() - start:.1f} s: target "
        f"{meta['target_bytes'] / 1e6:.1f} MB, draft {meta['draft_bytes'] / 1e6:.1f} MB (its "
        "head included; the shared embedding/LM head not)", flush=True)

  results = {}
  for context in args.contexts:
    for capacity in args.capacities or [tm.cache_slots(context + 2 * (args.gamma + 1))]:
      for batch in args.batches:
        label = f"context {context}, {capacity} slots, B={batch}"
        shape_start = time.perf_counter()
        times, errors, choice = bench_round(target, draft, batch, context, args, capacity)
        gc.collect()
        part_floors = floors(part_costs(target, draft, batch, context), bandwidth, rate)
        results[(context, capacity, batch)] = {
            "context": context, "capacity": capacity, "batch": batch, "seconds": times,
            "errors": errors, "floors": part_floors, "backend": choice.name,
            "backend_reason": choice.reason}
        print(f"  {label}: {time.perf_counter() - shape_start:.1f} s (compiling included); block "
              f"sampling on {harness.describe_choice(choice)}", flush=True)
        for name in args.parts:
          if name not in times:
            continue
          line = f"    {name}: {times[name] * 1e3:.3f} ms"
          if name in part_floors:
            f = part_floors[name]
            line += (f", floor {f['floor_s'] * 1e3:.3f} ms ({f['bound']}; bytes "
                     f"{f['bytes_s'] * 1e3:.3f}, compute {f['compute_s'] * 1e3:.3f}), "
                     f"× floor {times[name] / f['floor_s']:.2f}")
          print(line, flush=True)
  e2e = {}
  if args.e2e_batch:
    e2e = bench_e2e({"": (target, draft)}, batch=args.e2e_batch, context=args.contexts[0],
                    new_tokens=args.new_tokens, repeats=args.repeats, backend=args.backend,
                    config=args.backend_config)[""]
    against_mean_context(target, draft, e2e, args)

  has = lambda t, *names: all(n in t for n in names)
  print(f"\nTokens/s: autoregressive (B / step) vs speculative at τ (τ·B / round)")
  print("| context | B | AR | " + " | ".join(f"spec τ={tau}" for tau in TAUS) + " |")
  for (context, capacity, batch), r in results.items():
    t = r["seconds"]
    if has(t, "autoregressive step", "full round"):
      print(f"| {context} | {batch} | {batch / t['autoregressive step']:.0f} | " +
            " | ".join(f"{tau * batch / t['full round']:.0f}" for tau in TAUS) + " |")

  hf_rows = {(r["context"], r["batch"]): r for r in hf["results"]} if hf else {}
  header = (("context", "slots", "B", "backend") + tuple(f"{n} ms (×floor)" for n in FLOORED)
            + ("accept ms", "ctx upd ms", "draft+samp %", f"spec/AR τ={TAUS[2]}"))
  if args.hf:
    header += ("HF static ms (× ours)",)
  rows = []
  for (context, capacity, batch), r in results.items():
    t, f = r["seconds"], r["floors"]
    cell = lambda n: (f"{t[n] * 1e3:.3f} ({t[n] / f[n]['floor_s']:.2f}"
                      f"{'c' if f[n]['bound'] == 'compute' else ''})" if n in t
                      else "failed" if n in r["errors"] else "n/a")
    ms = lambda n: f"{t[n] * 1e3:.3f}" if n in t else "failed" if n in r["errors"] else "n/a"
    row = ([str(context), str(capacity), str(batch), r["backend"]] + [cell(n) for n in FLOORED]
           + [ms("accept/commit"), ms("context update"),
              f"{(t['draft forward'] + t['block sampling']) / t['full round'] * 100:.1f}"
              if has(t, "draft forward", "block sampling", "full round") else "n/a",
              f"{TAUS[2] * t['autoregressive step'] / t['full round']:.2f}"
              if has(t, "autoregressive step", "full round") else "n/a"])
    if args.hf:
      row.append(hf_cell(hf_rows, context, batch, t.get("autoregressive step")))
    rows.append(row)
  title = (f"bench_decode ({meta['device_kind']}{f' x{args.tp} TP' if args.tp > 1 else ''}, "
           f"{'small' if args.small else 'Qwen3-' + args.shape.upper()}, γ = {args.gamma}; ms per part, × its floor: the "
           f"larger of bytes at {bandwidth / 1e9:.1f} GB/s and FLOPs at {rate / 1e12:.1f} TFLOP/s, "
           "c where compute binds")
  title += ("; HF: transformers' compiled static-cache decode step, × our autoregressive step)"
            if args.hf else ")")
  if e2e:
    title = (f"generate() end to end, B = {args.e2e_batch}, context {args.contexts[0]}, "
             f"{args.new_tokens} new tokens: "
             + "; ".join(f"{k} {v['per_iteration_s'] * 1e3:.3f} ms/iteration"
                         + (f" ({v['vs_step_at_mean_context']:.2f}x the step at the mean context "
                            f"{v['mean_context']})" if "mean_context" in v else "")
                         for k, v in e2e.items())
             + "\n" + title)
  harness.finish(title, header, rows, meta=meta,
                 results={"rounds": {f"{c}/{s}/{b}": r for (c, s, b), r in results.items()},
                          "e2e": e2e, "hf": hf},
                 json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
  raise SystemExit(main())
