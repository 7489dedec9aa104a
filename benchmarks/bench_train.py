"""One drafter training step: tokens/s and model FLOP utilisation.

Shapes (default, GPU): `bench_decode`'s Qwen3-4B-shaped target (36 layers, E 2560, V 151936,
random bf16 weights, frozen) and its 5-layer DSpark draft (vanilla Markov head r = 256, confidence
head reading W1, γ = 7, bf16 weights); ``--batch`` sequences of ``--seq-len`` tokens with
``--anchors`` blocks each, every position a response token. The defaults are DeepSpec's Qwen3-4B
recipe per device (``config/dspark/dspark_qwen3_4b.py``: one sequence of up to 4096 tokens per
device, 512 anchors). The step is `trainer.Trainer`'s
compiled step exactly as ``dspark-jax train`` runs it: `trainer.dspark_loss` with the response
mask (the target's forward, the draft's blocks, SPEC §8's loss), its gradient with respect to
float32 master parameters, AdamW. ``--small``: `bench_decode`'s 2-layer float32 CPU model pair.

Reported per step (median of ``--repeats`` steps after ``--warmup``, `harness.time_one`):

* sequence tokens/s (``batch·seq_len`` per step: the tokens DeepSpec's trainer counts) and block
  tokens/s (``batch·anchors·γ`` predictions per step);
* model FLOPs: the target's forward, ``2·P_t·B·L`` with P_t its parameters a token multiplies
  (the LM head included: the loss reads the target's law at every position), plus the draft's
  forward and backward, ``6·P_d·B·A·γ`` with P_d the draft's layers, ``fc``, the shared LM head
  and W2 (their gradients flow through the LM head to the draft's states). Attention is not
  counted, so the MFU is a lower bound;
* MFU: model FLOPs per second over this run's bf16 matrix rate (`harness.matmul_rate`, measured
  on this device: no card's peak is written here);
* the target's part alone (`trainer.target_law`: the frozen target's forward with its LM head at
  every position and the float32 softmax, reduced to a scalar so that XLA keeps all of it), timed
  the same way in a program of its own, and its share of the step: what a cache of the target's
  features (DeepSpec's offline target cache) could save at most;
* the compiled step's memory as XLA plans it (`memory_analysis`, before the step runs, so it is
  printed even when the step then fails): its scratch and the estimated peak, arguments (the
  parameters, optimizer state, target and batch) plus outputs plus scratch, less what is donated;
* with ``--profile DIR``, where the step's time goes: ``--trace-repeats`` steps traced into DIR
  (`bench_profile.trace_call`, the optimized HLO beside them) and reduced to `bench_profile`'s
  kernel table (kernel groups by HLO op, µs per step, share of the busy time, bytes and FLOPs
  against their floors at this run's rates), also in the JSON under ``profile``;
* with ``--shared-attention xla,ragged``, one step per form of the draft's shared-context
  attention (``$DSPARK_JAX_SHARED_ATTENTION``, `kernels.attention.choose_shared`), side by side
  in one process, each row with its tokens/s against the first's (``× first``); the profile is
  the first form's. The JSON's ``runs`` holds every row;
* with ``--dp 1,2,8``, data parallelism: for each count N, the `Trainer`'s step over a mesh of N
  devices (`placement.make_mesh(1, N)`: the batch split by rows, ``--batch`` rows per device, the
  Pallas kernels per shard), each row with the tokens/s per device and the scaling against N
  times the first row's per-device rate; MFU against N times this device's matrix rate.

  python -m benchmarks.bench_train --small                   # CPU smoke check
  python -m benchmarks.bench_train                           # DeepSpec's: 1 x 4096, 512 anchors
  python -m benchmarks.bench_train --batch 2 --seq-len 2048 --anchors 64
  python -m benchmarks.bench_train --profile /tmp/train_profile   # and its kernels by group
  python -m benchmarks.bench_train --shared-attention xla,ragged     # the flash form against it
  python -m benchmarks.bench_train --dp 1,2,4,8                       # data-parallel scaling
"""

from __future__ import annotations

import argparse
import gzip
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode
from benchmarks import bench_profile
from benchmarks import harness
from dspark_jax.kernels import attention
from dspark_jax.parallel import placement
from dspark_jax.train import trainer as training


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 1)")
  parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (4096)")
  parser.add_argument("--anchors", type=int, default=None, help="blocks per sequence (512)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--shape", choices=sorted(bench_decode.SHAPES), default="4b")
  parser.add_argument("--shared-attention", default="auto",
                      help="comma list of forms of the draft's shared-context attention to time "
                           f"side by side (${attention.SHARED_ENV_VAR} for each step: "
                           f"{', '.join(attention.SHARED_FORMS)}; default auto)")
  parser.add_argument("--dp", type=harness.int_list, default=[1],
                      help="comma list of data-parallel device counts, each its own row (--batch "
                           "rows per device; default 1)")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="also trace steps into DIR and print their kernels by group")
  parser.add_argument("--trace-repeats", type=int, default=3, help="steps traced (default 3)")
  parser.add_argument("--top", type=int, default=25, help="kernel groups shown (default 25)")
  harness.add_common_arguments(parser, repeats=5, warmup=2, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batch = args.batch or (2 if args.small else 1)
  args.seq_len = args.seq_len or (64 if args.small else 4096)
  args.anchors = args.anchors or (8 if args.small else 512)
  if min(args.batch, args.seq_len, args.anchors, args.gamma) < 1:
    parser.error("--batch, --seq-len, --anchors and --gamma: each must be >= 1")
  if args.seq_len < args.gamma + 2:
    parser.error(f"--seq-len: needs at least γ + 2 = {args.gamma + 2} tokens")
  args.shared_attention = [name.strip() for name in args.shared_attention.split(",")
                           if name.strip()]
  if not args.shared_attention or any(name not in attention.SHARED_FORMS
                                      for name in args.shared_attention):
    parser.error(f"--shared-attention: expected a comma list of "
                 f"{', '.join(attention.SHARED_FORMS)}")
  return args


def _elements(tree) -> int:
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape")))


def model_flops(target, draft, batch: int, length: int, anchors: int) -> dict[str, float]:
  """The step's model FLOPs (module docstring): ``{"target", "draft", "total"}``."""
  config = target.config
  lm_head = target.embed if config.tie_embeddings else target.lm_head
  head = _elements(nnx.state(lm_head))
  target_params = _elements(nnx.state(target.layers)) + head
  draft_params = (_elements(nnx.state(draft.layers)) + _elements(nnx.state(draft.fc)) + head
                  + int(draft.head.arrays()["w2"].size))
  out = {"target": 2.0 * target_params * batch * length,
         "draft": 6.0 * draft_params * batch * anchors * draft.config.gamma}
  out["total"] = out["target"] + out["draft"]
  return out


def build_step(target, draft, batch: int, length: int, anchors: int, dp: int = 1):
  """A thunk running one training step (the trainer's state carried from call to call), and the
  step's compiled memory (`memory`); with `dp` > 1 over a mesh of that many devices, `batch` rows
  on each."""
  def loss(model, frozen, data):
    return training.dspark_loss(model, frozen, *data)

  optimizer = training.make_optimizer(6e-4, 1000, weight_decay=0.0, b2=0.999,   # DeepSpec's
                                      end_fraction=0.0)
  graphdef, state = nnx.split(draft)        # a copy: the step donates the trained parameters
  draft = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  mesh = None if dp == 1 else placement.make_mesh(1, dp)
  trainer = training.Trainer(draft, loss, optimizer, frozen=target, master_dtype=jnp.float32,
                             mesh=mesh)
  gamma = draft.config.gamma
  rng = np.random.default_rng(0)
  rows = batch * dp
  tokens = rng.integers(0, target.config.vocab_size - 1, (rows, length))
  data = (jnp.asarray(tokens, jnp.int32),
          jnp.asarray(rng.integers(1, length - gamma, (rows, anchors)), jnp.int32),
          jnp.ones((rows, length), bool))
  data = harness.on_device(data) if mesh is None else jax.block_until_ready(trainer._place(data))

  def step():
    with trainer._tracing():
      trainer.params, trainer.opt_state, metrics = trainer._step_fn(
          trainer.params, trainer.rest, trainer.frozen_state, trainer.opt_state, data)
    return metrics["loss"]
  with trainer._tracing():
    compiled = trainer._step_fn.lower(trainer.params, trainer.rest, trainer.frozen_state,
                                      trainer.opt_state, data).compile()
  step.hlo = compiled.as_text
  return step, memory(compiled)


def profile_step(step, directory: str, *, calls: int, bandwidth: float, rate: float) -> dict:
  """`calls` traced steps under `directory` (replaced), reduced by `bench_profile.reduce_calls`
  (one iteration a call) over the step's optimized HLO, which is saved beside the trace."""
  text = step.hlo() or ""
  bench_profile.trace_call(step, directory, calls)
  if text:
    with gzip.open(os.path.join(directory, "module.hlo.txt.gz"), "wt", encoding="utf-8") as f:
      f.write(text)
  return bench_profile.reduce_calls(
      bench_profile.read_trace(directory), bench_profile.hlo_costs(text) if text else {},
      calls=calls, iterations=1, gap_us=2.0, bandwidth=bandwidth, rate=rate,
      module=bench_profile.module_name(text) if text else None)


def build_target_part(target, batch: int, length: int):
  """A thunk running the step's target part alone (module docstring) on random tokens."""
  t_def, t_state = nnx.split(target)
  rng = np.random.default_rng(1)
  tokens = harness.on_device(jnp.asarray(
      rng.integers(0, target.config.vocab_size - 1, (batch, length)), jnp.int32))

  @jax.jit
  def run(state, tokens):
    probs, features = training.target_law(nnx.merge(t_def, state), tokens)
    return jnp.sum(probs[..., 0] * probs[..., -1]) + jnp.sum(features.astype(jnp.float32))

  compiled = run.lower(t_state, tokens).compile()
  return lambda: jax.block_until_ready(compiled(t_state, tokens))


def memory(compiled) -> dict[str, int] | None:
  """``{"temp_bytes", "peak_bytes"}`` of a compiled program (module docstring), or None where
  the backend does not say."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)
  return {"temp_bytes": int(stats.temp_size_in_bytes), "peak_bytes": int(peak)}


def _size(nbytes: int) -> str:
  return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def main(argv=None) -> int:
  args = parse_args(argv)
  meta, bandwidth = harness.start_run(args, batch=args.batch, seq_len=args.seq_len,
                                      anchors=args.anchors, gamma=args.gamma, shape=args.shape)
  rate = meta["matmul_tflops"] * 1e12
  target, draft = bench_decode.build_models(args.small, args.gamma, args.shape)
  flops = model_flops(target, draft, args.batch, args.seq_len, args.anchors)
  results, target_s, error = [], None, None
  for implementation in args.shared_attention:
    for dp in args.dp:
      results.append(time_step(args, target, draft, implementation, flops, bandwidth, rate,
                               profile=args.profile if not results else None, dp=dp))
  if not any(r["error"] for r in results):
    try:
      target_s = harness.time_one(build_target_part(target, args.batch, args.seq_len),
                                  repeats=args.repeats, warmup=args.warmup)
    except Exception as exc:  # noqa: BLE001 - reported (e.g. out of memory), not raised
      error = bench_decode.describe_failure(exc)
  rows = []
  for result in results:
    result["target_seconds"] = target_s
    if result["seconds"] is not None and target_s is not None:
      result["target_share"] = target_s / result["seconds"]
    first = results[0]
    if result["seconds"] is not None and first["seconds"] is not None:
      result["vs_first"] = result["sequence_tokens_per_s"] / first["sequence_tokens_per_s"]
      result["scaling"] = result["vs_first"] * first["dp"] / result["dp"]
    cell = lambda key, fmt, r=result: "-" if r.get(key) is None else fmt.format(r[key])
    planned = result["memory"]
    rows.append([result["shared_attention"], str(result["dp"]), str(args.batch),
                 str(args.seq_len), str(args.anchors), str(args.gamma), cell("seconds", "{:.4f}"),
                 cell("vs_first", "{:.3f}"), cell("scaling", "{:.3f}"),
                 cell("sequence_tokens_per_s", "{:.0f}"), cell("block_tokens_per_s", "{:.0f}"),
                 f"{flops['total'] * result['dp'] / 1e12:.2f}", cell("mfu", "{:.3f}"),
                 cell("target_seconds", "{:.4f}"), cell("target_share", "{:.2f}"),
                 "-" if not planned else _size(planned["peak_bytes"]),
                 (result["error"] or error or "")[:40]])
  result = dict(results[0], runs=results) if len(results) > 1 else results[0]
  title = (f"bench_train ({meta['device_kind']}; one drafter training step; MFU against this "
           f"run's bf16 matmul rate {meta['matmul_tflops']:.1f} TFLOP/s)")
  header = ["shared attn", "dp", "B/dev", "L", "A", "γ", "s/step", "× first", "scaling",
            "seq tok/s", "block tok/s", "TFLOP", "MFU", "target s", "share", "peak", "error"]
  harness.finish(title, header, rows, meta=meta, results=result, json_path=args.json)
  return int(error is not None or any(r["error"] for r in results))


def time_step(args, target, draft, implementation: str, flops: dict, bandwidth: float,
              rate: float, profile: str | None, dp: int = 1) -> dict:
  """One training step compiled with the shared-context attention `implementation`
  (``$DSPARK_JAX_SHARED_ATTENTION`` while it is traced) over `dp` devices, timed (and with
  `profile`, traced and reduced): its result row (`flops`: one device's rows)."""
  error, seconds, planned, reduced = None, None, None, None
  before = os.environ.get(attention.SHARED_ENV_VAR)
  os.environ[attention.SHARED_ENV_VAR] = implementation
  try:
    if dp > len(jax.devices()):
      raise ValueError(f"--dp {dp}: {len(jax.devices())} devices here")
    step, planned = build_step(target, draft, args.batch, args.seq_len, args.anchors, dp)
    if planned:
      print(f"shared attention {implementation}, dp {dp}: compiled step: scratch "
            f"{_size(planned['temp_bytes'])}, estimated peak {_size(planned['peak_bytes'])}",
            flush=True)
    seconds = harness.time_one(step, repeats=args.repeats, warmup=args.warmup)
    if profile:
      reduced = profile_step(step, profile, calls=args.trace_repeats, bandwidth=bandwidth,
                             rate=rate)
      print(f"profile of one step ({reduced['source']}, {reduced['calls']} steps kept): busy "
            f"{reduced.get('busy_us', 0) / 1e3:.1f} ms of a {reduced.get('span_us', 0) / 1e3:.1f} "
            f"ms span", flush=True)
      if reduced["calls"]:
        print("\n".join(bench_profile.kernel_table(reduced, args.top)), flush=True)
    del step
  except Exception as exc:  # noqa: BLE001 - reported (e.g. out of memory), not raised
    error = bench_decode.describe_failure(exc)
  finally:
    if before is None:
      os.environ.pop(attention.SHARED_ENV_VAR, None)
    else:
      os.environ[attention.SHARED_ENV_VAR] = before
  result = {"shared_attention": implementation, "dp": dp, "batch": args.batch,
            "seq_len": args.seq_len, "anchors": args.anchors, "gamma": args.gamma,
            "seconds": seconds, "model_flops": flops, "error": error, "memory": planned,
            "profile": reduced}
  if seconds is not None:
    rows = args.batch * dp
    result.update(sequence_tokens_per_s=rows * args.seq_len / seconds,
                  block_tokens_per_s=rows * args.anchors * args.gamma / seconds,
                  per_device_tokens_per_s=args.batch * args.seq_len / seconds,
                  mfu=flops["total"] / seconds / rate)
  return result


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
