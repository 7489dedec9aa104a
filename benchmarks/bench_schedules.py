"""Confidence-scheduled verification where the verify is expensive: tokens/s with synthetic acceptance.

Random weights accept nothing, and the shipped pair is too small for its verify to cost what a
Qwen3-4B target's does. This benchmark runs the real forwards of the Qwen3-4B-shaped pair of
`bench_decode` and replaces only the accept decision by a given law, so each schedule is timed
where it matters:

* **Acceptance law** (``--rates``): draft k survives verification, given drafts < k did, with
  probability ``c_k`` (default 0.82 … 0.55, τ ≈ 3.66 for a full verify, about the paper's MT-Bench
  τ for Qwen3-4B). Each round draws each row's accepted run from it.
* **Confidence**: the draft's confidences are replaced by the same ``c_k``: a perfectly calibrated
  head, so the schedules decide on survivals consistent with the law.
* **A round** (one compiled program, 10 rounds in a ``fori_loop``, caches carried and donated): the
  draft forward, the folded block, the schedule's ``update``, the target's verify (the packed
  verify of the scheduled tokens; for ``none``, the dense [B, γ + 1] one), the context update; a row
  commits ``min(run, ℓ_r) + 1`` tokens. Positions are reset every round so that every round attends
  over the same ``--context``.

Per schedule (``none``, ``fixed``, ``threshold``, ``prefix``, ``top_k``) it reports the round time,
τ (tokens committed per row and round), verify tokens per row, tokens/s = B·τ / round, and the cost
model's prediction B·τ·SPS(N) from `profile_sps` (N = the mean verify tokens of the round). The
table behind ``prefix``/``top_k`` and the model is chosen by ``--sps``: ``verify`` (the packed
verify alone: the draft's cost left out, so the model is an upper bound) or ``round`` (``draft_cost
=True``: whole decoding rounds); with both, each of the two schedules runs once per
table (``prefix@round``), side by side. The schedule's own work (``update`` alone on these
confidences, 10 calls in a loop) is timed separately.

  python -m benchmarks.bench_schedules --small          # CPU smoke check
  python -m benchmarks.bench_schedules --batches 1,16,64,128 --context 1024
  python -m benchmarks.bench_schedules --batches 1,16,64 --sps verify,round   # the two tables
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
from benchmarks import synthetic
from dspark_jax import decoding
from dspark_jax.decoding import packing
from dspark_jax.draft import block as block_lib
from dspark_jax.kernels import pallas_block
from dspark_jax.models import target as tm
from dspark_jax.scheduling import profile as sps_profile
from dspark_jax.scheduling import schedules

LOOP = bench_decode.LOOP
DEFAULT_RATES = synthetic.DEFAULT_RATES
NAMES = ("none", "fixed", "threshold", "prefix", "top_k")
TABLES = ("verify", "round")
READS_SPS = ("prefix", "top_k")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=harness.int_list, default=None,
                      help="comma list of batch sizes (default 1,16,64,128; --small: 4)")
  parser.add_argument("--context", type=int, default=None,
                      help="real tokens per row (default 1024; --small: 32)")
  parser.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)),
                      help="comma list of γ conditional acceptance rates c_1..c_γ in [0, 1]")
  parser.add_argument("--threshold", type=float, default=0.5, help="threshold(t)'s t")
  parser.add_argument("--schedules", default=",".join(NAMES),
                      help=f"comma list of schedules (default all: {', '.join(NAMES)})")
  parser.add_argument("--sps", default="verify",
                      help="comma list of throughput tables for prefix/top_k and the model: "
                      "verify (the packed verify alone, default), round (plus the draft forward)")
  harness.add_common_arguments(parser, repeats=5, warmup=1, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([4] if args.small else [1, 16, 64, 128])
  args.context = args.context or (32 if args.small else 1024)
  try:
    args.rates = tuple(float(r) for r in args.rates.split(","))
  except ValueError:
    parser.error(f"--rates: expected comma-separated numbers, got {args.rates!r}")
  if not args.rates or not all(0.0 <= r <= 1.0 for r in args.rates):
    parser.error(f"--rates: each must be in [0, 1], got {args.rates}")
  args.gamma = len(args.rates)
  args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
  bad = [s for s in args.schedules if s not in NAMES]
  if bad or not args.schedules:
    parser.error(f"--schedules: unknown {bad[0] if bad else args.schedules!r}; known: "
                 f"{', '.join(NAMES)}")
  args.sps = [s.strip() for s in args.sps.split(",") if s.strip()]
  if not args.sps or any(s not in TABLES for s in args.sps):
    parser.error(f"--sps: expected a comma list of {', '.join(TABLES)}, got {args.sps!r}")
  return args


def make_schedule(name: str, sps, threshold: float):
  return {"none": None, "fixed": schedules.fixed(), "threshold": schedules.threshold(threshold),
          "prefix": schedules.prefix(sps), "top_k": schedules.top_k(sps, lag=2)}[name]


def run_schedule(target, draft, batch: int, context: int, rates, schedule, args) -> dict:
  """Seconds per round, and per row and round the mean committed tokens and verify tokens."""
  gamma, vocab = draft.config.gamma, target.config.vocab_size
  rows = bench_decode.mixed_rows(batch)
  choice = block_lib.choose_backend(
      draft.head.arrays(), jax.ShapeDtypeStruct((batch, gamma, vocab), draft.config.dtype),
      kind=draft.head.kind, greedy_only=False, confidence=draft.confidence is not None)
  head = harness.on_device(pallas_block.head_arrays_for(draft.head.arrays(), [choice]))
  t_def, t_state = nnx.split(target)
  d_def, d_state = nnx.split(draft)
  cache_len = tm.cache_slots(context + 2 * (gamma + 1))
  law = jnp.asarray(rates, jnp.float32)
  base_pos = jnp.full((batch,), context, jnp.int32)
  rng = np.random.default_rng(batch)
  anchor0 = jnp.asarray(rng.integers(0, vocab - 1, batch), jnp.int32)

  def body(w, carry):
    target, draft = nnx.merge(t_def, w[0]), nnx.merge(d_def, w[1])
    cache, context_cache, sched, key, committed, verified, rounds = carry
    key, draw = jax.random.split(key)
    state = {"anchor": anchor0, "anchor_pos": base_pos, "context": context_cache}
    base, hidden = decoding._draft_forward(target, draft, state)
    head_arrays, conf, hidden = decoding._draft_inputs(draft, hidden, w[2])
    tokens, _, _ = block_lib.folded_block(
        head_arrays, conf, base, anchor0, hidden, rows["greedy"], rows["temperature"],
        rows["seeds"], base_pos, key, kind=draft.head.kind, greedy_only=False, backend=choice)
    active = jnp.ones((batch,), bool)
    confidence = jnp.broadcast_to(law, (batch, gamma))
    if schedule is None:
      lens = jnp.full((batch,), gamma + 1, jnp.int32)
    else:
      lens, sched = schedule.update(confidence, active, sched)
      lens = jnp.clip(jnp.asarray(lens, jnp.int32), 1, gamma + 1)
    verify_in = jnp.concatenate([anchor0[:, None], tokens], axis=1)
    positions = base_pos[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
    if schedule is None:
      _, features, cache = target(verify_in, positions, cache)
    else:
      _, features, cache = packing.packed_verify(target, verify_in, positions, lens, cache)
    context_cache = draft.extend_context(features, positions, context_cache)
    survive = jax.random.uniform(draw, (batch, gamma)) < law
    run = jnp.sum(jnp.cumprod(survive.astype(jnp.int32), axis=1), axis=1)
    committed = committed + jnp.sum(jnp.minimum(run, lens - 1) + 1)
    return (cache, context_cache, sched, key, committed, verified + jnp.sum(lens), rounds + 1)

  def make_carry():
    sched = () if schedule is None else schedule.init(batch, gamma)
    return (tm.init_cache(target.config, batch, cache_len), draft.init_context(batch, cache_len),
            sched, jax.random.key(0), jnp.int32(0), jnp.int32(0), jnp.int32(0))

  thunk = bench_decode.looped(body, (t_state, d_state, head), make_carry)
  seconds = harness.time_one(thunk, repeats=args.repeats, warmup=args.warmup) / LOOP
  _, _, _, _, committed, verified, rounds = thunk()
  denominator = float(rounds) * batch
  out = {"round_s": seconds, "tau": float(committed) / denominator,
         "verify_tokens": float(verified) / denominator}
  if schedule is not None:
    sched = jax.jit(lambda: jax.lax.fori_loop(
        0, LOOP, lambda i, s: schedule.update(jnp.broadcast_to(law, (batch, gamma)),
                                              jnp.ones((batch,), bool), s)[1],
        schedule.init(batch, gamma)))
    out["update_s"] = harness.time_one(sched, repeats=args.repeats, warmup=args.warmup) / LOOP
  del thunk
  gc.collect()
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  meta, _ = harness.start_run(args, context=args.context, batches=args.batches, rates=args.rates,
                              schedules=args.schedules, threshold=args.threshold)
  target, draft = bench_decode.build_models(args.small, args.gamma)
  results, rows = [], []
  for batch in args.batches:
    tables = {}
    for kind in args.sps:
      profile = sps_profile.profile_sps(target, draft, batch_size=batch, context=args.context,
                                        repeats=args.repeats, steps=4,
                                        draft_cost=kind == "round")
      tables[kind] = profile   # the schedules take the profile: its table and its buckets
      print(f"B={batch}: {kind} steps/s per bucket {profile.table()}", flush=True)
    runs = [(name, kind) for name in args.schedules
            for kind in (args.sps if name in READS_SPS else args.sps[:1])]
    for name, kind in runs:
      sps = tables[kind].dense()
      label = f"{name}@{kind}" if name in READS_SPS and len(args.sps) > 1 else name
      r = run_schedule(target, draft, batch, args.context, args.rates,
                       make_schedule(name, tables[kind], args.threshold), args)
      n = int(round(r["verify_tokens"] * batch))
      model = batch * r["tau"] * sps[min(max(n, 1), len(sps) - 1)]
      r.update(batch=batch, schedule=label, sps=kind, tokens_per_s=batch * r["tau"] / r["round_s"],
               model_tokens_per_s=model)
      results.append(r)
      print(f"  B={batch} {label}: round {r['round_s'] * 1e3:.3f} ms, τ {r['tau']:.2f}, verify "
            f"{r['verify_tokens']:.2f}/row, {r['tokens_per_s']:.0f} tokens/s (model "
            f"{model:.0f})", flush=True)
  by_batch = {}
  for r in results:
    by_batch.setdefault(r["batch"], {})[r["schedule"]] = r
  for r in results:
    base = by_batch[r["batch"]].get("fixed") or by_batch[r["batch"]].get("none")
    update = f"{r['update_s'] / r['round_s'] * 100:.1f}" if "update_s" in r else "—"
    rows.append([str(r["batch"]), r["schedule"], f"{r['round_s'] * 1e3:.3f}", f"{r['tau']:.2f}",
                 f"{r['verify_tokens']:.2f}", f"{r['tokens_per_s']:.0f}",
                 f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                 f"{r['model_tokens_per_s']:.0f}", update])
  header = ["B", "schedule", "round ms", "τ", "verify/row", "tokens/s", "× fixed", "model tokens/s",
            "update % of round"]
  title = (f"bench_schedules ({meta['device_kind']}, context {args.context}, γ = {args.gamma}, "
           f"synthetic acceptance c = {list(args.rates)}, full-verify τ = "
           f"{synthetic.expected_tau(args.rates, args.gamma):.2f}; model = B·τ·SPS(N) from the "
           f"{' or '.join(args.sps)} table: the verify's leaves the draft's cost out)")
  harness.finish(title, header, rows, meta=meta, results=results, json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
