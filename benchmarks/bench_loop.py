"""The decoding loop's own cost: the queue's chunks against the round table, round by round.

Owns the check of what `dj.profile_sps`'s round table (whole rounds, `draft_cost=True`) leaves out
of a serving run: for ``--slots`` c slots (default 1), each ``--kv`` form and each
``--rounds-per-call`` R, it

* times the table's round for c greedy rows verifying every drafted token (`fixed`) at the
  queue's mean context (``--prompt`` + ``--new`` / 2): the loop's own iteration in a `fori_loop`,
  a call of ``steps + 1`` rounds less a call of one (`scheduling.profile`);
* runs the queue (`dj.Engine` with `schedules.fixed`, greedy rows, 2 c prompts of ``--prompt``
  random tokens and ``--new`` new tokens each) once to compile and once timed: its chunk seconds
  per round, the loop as serving runs it (a `while_loop` of at most R rounds a call);
* traces one more queue run and a call of the table's rounds (`jax.profiler`, read back by
  `bench_profile.read_trace`): kernel time per round in each, each one's busy share and gaps
  (both traced alike, without command buffers), and the kernel groups where the two differ most (``--top``).

The last table has one row per (kv, R): the table's round, the chunks' round and their ratio,
the kernels per round in each, the chunks' and the table's busy shares and gaps per round. Where the ratio
is above 1 and the kernels match, the loop pays outside its kernels (launches, syncs between
rounds, the host between chunks); where the kernels differ, the groups say which work.

  python -m benchmarks.bench_loop --small                 # CPU smoke check, < 1 minute
  python -m benchmarks.bench_loop --kv paged,contiguous --rounds-per-call 16,64   # GPU
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import time

import jax
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import bench_decode
from benchmarks import bench_profile
from benchmarks import harness
from dspark_jax.decoding import packing
from dspark_jax.decoding import queue as queue_module
from dspark_jax.scheduling import profile


def _names(text: str) -> list[str]:
  return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_common_arguments(parser, repeats=5, warmup=1, backend=False)
  parser.add_argument("--slots", type=int, default=None, help="c, the queue's slots (default 1)")
  parser.add_argument("--kv", type=_names, default=["paged"],
                      help="comma list of the queue's cache forms (paged, contiguous)")
  parser.add_argument("--rounds-per-call", type=harness.int_list, default=[16],
                      help="comma list of R, rounds a chunk runs at most (default 16)")
  parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024)")
  parser.add_argument("--new", type=int, default=None, help="new tokens a prompt (default 256)")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--top", type=int, default=12, help="kernel groups shown per comparison")
  parser.add_argument("--out", default="bench_loop_trace", help="directory of the traces")
  args = parser.parse_args(argv)
  small = args.small
  args.repeats = args.repeats or (3 if small else 5)
  args.warmup = 1 if args.warmup is None else args.warmup
  args.slots = args.slots or 1
  args.prompt = args.prompt or (24 if small else 1024)
  args.new = args.new or (32 if small else 256)
  for kv in args.kv:
    if kv not in queue_module.KV_FORMS:
      parser.error(f"--kv: {kv!r} is not one of {queue_module.KV_FORMS}")
  if min(args.rounds_per_call) < 1 or args.slots < 1 or args.prompt < 1 or args.new < 1:
    parser.error("--slots, --rounds-per-call, --prompt and --new must be >= 1")
  return args


def kernel_groups(events, rounds: int) -> dict[str, float]:
  """µs per round of each kernel group (the kernel's name less its uniquifying numbers)."""
  groups = collections.defaultdict(float)
  for e in events:
    groups[bench_profile.kernel_group(e.name)] += (e.end - e.start) / rounds / 1e3
  return dict(groups)


def table_round(target, draft, rows: int, context: int, args) -> dict:
  """The round table's round for `rows` greedy rows verifying γ + 1 tokens each: its seconds
  (`profile._samples`) and its trace reduced per round."""
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = nnx.split(draft)
  width = args.gamma + 1
  call = profile._timed_rounds(target_def, target_state, draft_def, draft_state, rows,
                               packing.token_buckets(rows, width), context, 0.0)
  counts = np.full(rows, width, np.int32)
  steps = 8
  seconds = profile._samples(lambda n: call(n, counts), steps, args.repeats, args.warmup)
  directory = os.path.join(args.out, "table")
  bench_profile.trace_call(lambda: call(steps, counts)["anchor"], directory, 3)
  events = bench_profile.read_trace(directory)["events"]
  return {"round_s": float(np.median(seconds)) / steps, "events": events, "rounds": 3 * steps}


def queue_rounds(target, draft, prompts, params, kv: str, rpc: int, args) -> dict:
  """The queue's chunk seconds per round, and a traced run's kernels in its chunk programs."""
  engine = dj.Engine(target, draft, max_batch_size=args.slots, kv=kv,
                     schedule=dj.schedules.fixed(), rounds_per_call=rpc)
  key = jax.random.key(0)
  engine.generate(prompts, params, key, max_new_tokens=args.new)       # compiles
  timed = engine.generate(prompts, params, key, max_new_tokens=args.new)
  directory = os.path.join(args.out, f"queue_{kv}_{rpc}")
  bench_profile.trace_call(
      lambda: engine.generate(prompts, params, key, max_new_tokens=args.new).lengths,
      directory, 1)
  trace = bench_profile.read_trace(directory)
  events = [e for e in trace["events"] if e.module and "chunk" in e.module]
  if not events:   # no module names on these events: every event of the run
    events = trace["events"]
  return {"round_s": timed.chunk_seconds / max(timed.rounds, 1), "rounds": timed.rounds,
          "events": events, "host_s": timed.host_seconds, "refill_s": timed.refill_seconds}


def compare(table: dict, queue: dict, top: int) -> tuple[dict, list[str]]:
  """The two traces per round: totals, the chunks' timeline, the groups that differ most."""
  t_groups = kernel_groups(table["events"], table["rounds"])
  q_groups = kernel_groups(queue["events"], queue["rounds"])
  summary = {"table_kernel_us": sum(t_groups.values()), "queue_kernel_us": sum(q_groups.values())}
  for name, run in (("queue", queue), ("table", table)):   # both traced alike (no command buffers)
    timeline = bench_profile.call_timeline(run["events"], 5e3) if run["events"] else None
    per_round = lambda ns, run=run: ns / max(run["rounds"], 1) / 1e3
    summary.update({
        f"{name}_busy_pct": (100 * timeline["busy_ns"] / timeline["span_ns"]
                             if timeline and timeline["span_ns"] else None),
        f"{name}_gaps_us": per_round(timeline["gaps_ns"]) if timeline else None,
        f"{name}_big_gaps_us": per_round(timeline["big_gaps_ns"]) if timeline else None})
  names = sorted(set(t_groups) | set(q_groups),
                 key=lambda k: -abs(q_groups.get(k, 0.0) - t_groups.get(k, 0.0)))[:top]
  summary["groups"] = [{"group": k, "queue_us": q_groups.get(k, 0.0),
                        "table_us": t_groups.get(k, 0.0)} for k in names]
  lines = [f"  {'kernel group':58s} {'chunks µs/round':>15s} {'table':>8s} {'diff':>8s}"]
  lines += [f"  {g['group'][:58]:58s} {g['queue_us']:15.1f} {g['table_us']:8.1f} "
            f"{g['queue_us'] - g['table_us']:8.1f}" for g in summary["groups"]]
  return summary, lines


def main(argv=None) -> int:
  args = parse_args(argv)
  meta, _ = harness.start_run(args, slots=args.slots, kv=args.kv,
                              rounds_per_call=args.rounds_per_call, prompt=args.prompt,
                              new=args.new, gamma=args.gamma)
  target, draft = bench_decode.build_models(args.small, args.gamma)
  vocab = target.config.vocab_size
  rng = np.random.default_rng(0)
  count = 2 * args.slots
  prompts = [rng.integers(0, vocab - 1, args.prompt).tolist() for _ in range(count)]
  params = dj.SamplingParams(temperature=np.zeros(count, np.float32))
  context = args.prompt + args.new // 2
  start = time.perf_counter()
  table = table_round(target, draft, args.slots, context, args)
  gc.collect()
  print(f"table: a round of {args.slots} rows at context {context}: "
        f"{table['round_s'] * 1e3:.3f} ms ({time.perf_counter() - start:.0f} s)", flush=True)
  results, rows = [], []
  for kv in args.kv:
    for rpc in args.rounds_per_call:
      queue = queue_rounds(target, draft, prompts, params, kv, rpc, args)
      gc.collect()
      summary, lines = compare(table, queue, args.top)
      ratio = queue["round_s"] / table["round_s"]
      kernels = (summary["queue_kernel_us"], summary["table_kernel_us"])
      print(f"queue ({kv}, R = {rpc}): {queue['rounds']} rounds, {queue['round_s'] * 1e3:.3f} ms "
            f"a round in its chunks, {ratio:.2f}x the table's; kernels {kernels[0]:.1f} µs a "
            f"round against {kernels[1]:.1f}", flush=True)
      print("\n".join(lines), flush=True)
      results.append({"kv": kv, "rounds_per_call": rpc, "table_round_s": table["round_s"],
                      "queue_round_s": queue["round_s"], "rounds": queue["rounds"],
                      "host_s": queue["host_s"], "refill_s": queue["refill_s"],
                      **summary})
      cell = lambda v, f: "n/a" if v is None else f.format(v)
      rows.append([kv, str(rpc), f"{table['round_s'] * 1e3:.3f}",
                   f"{queue['round_s'] * 1e3:.3f}", f"{ratio:.2f}",
                   f"{summary['table_kernel_us']:.1f}", f"{summary['queue_kernel_us']:.1f}",
                   cell(summary["queue_busy_pct"], "{:.1f}"),
                   cell(summary["queue_gaps_us"], "{:.1f}"),
                   cell(summary["table_busy_pct"], "{:.1f}"),
                   cell(summary["table_gaps_us"], "{:.1f}")])
  header = ["kv", "R", "table round ms", "chunks ms/round", "ratio", "table kernels µs",
            "chunks kernels µs", "chunks busy %", "chunks gaps µs/round", "table busy %",
            "table gaps µs/round"]
  title = (f"bench_loop ({meta['device_kind']}, {'small' if args.small else 'Qwen3-4B'}, "
           f"c = {args.slots}, prompts {args.prompt} + {args.new} new, γ = {args.gamma}, "
           f"greedy, fixed; traces in {args.out}):")
  harness.finish(title, header, rows, meta=meta, results=results, json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
