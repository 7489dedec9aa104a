"""Serving throughput of the queue-driven decode (`dspark_jax.decoding.queue`): occupancy against
static batches, and tokens/s per GPU against tokens/s per user.

Work: ``--prompts`` prompts whose output lengths are drawn log-uniformly from ``--lengths LO,HI``
(default 16..1024, ``numpy.random.default_rng(--seed)``), each enforced by its own
``max_new_tokens``, with no stop token, so every prompt decodes exactly its drawn length. The pair
is the Qwen3-4B-shaped random pair of `bench_decode.build_models` (random prompts of
``--prompt-len`` tokens; random weights accept almost nothing, τ ≈ 1), or with ``--shipped`` the
shipped trained pair (`formats.shipped`) on its held-out prompts
(``dspark_jax/assets/heldout_prompts.json``, cycled), which accepts as trained. Rows sample at
``--temperature`` (default 0).

* **Occupancy** (``occupancy`` in ``--studies``): the prompts through S = ``--slots`` slots of a
  `dj.Engine` (``--refill-at``, default the engine's 'auto'; ``--rounds-per-call``, default 16;
  every engine's slots hold the longest possible prompt + ``HI``), against today's static
  batches: consecutive `dj.generate` calls of S prompts each (a batch runs until its longest row
  ends), in the same run on the same prompts. Reported: occupancy (busy slot-iterations over all
  slot-iterations; for the static batches, Σ rounds per row over S × the batch's rounds), tokens/s
  of each (compilation excluded), and their ratio; the occupancy of an ideal queue on the same
  work (`ideal_occupancy`: the drain at the end, where the last long rows run alone, bounds every
  queue) and the queue's share of it; and the queue's occupancy while saturated (the same prompts
  with ``drain=False``: the run ends when the queue has emptied and a row finished).
* **Memory** (``memory``): concurrent rows in one KV budget. ``--memory-prompts`` prompts (default
  16 per contiguous slot) with output lengths log-uniform in ``--memory-lengths`` (default 32..8192,
  mean ~1.47k; the issue's rows of up to 8k averaging 1.5k) through ``--memory-rows`` contiguous
  slots (each sized for the longest prompt + HI), then through a paged engine whose pool holds the
  same positions (``--page-size``, default 64) behind ``--memory-factor`` (8) times as many slots,
  rows admitted by free pages. Reported: the mean concurrent rows while prompts wait
  (`QueueResult.saturated_rows`: the drain at the end is left out) of each and their ratio,
  tokens/s, peak pages and preemptions. Its warm-up decodes 2 × ``--memory-rows`` prompts with
  outputs cut short (`warm_budgets`); programs first met later compile outside the queue's clock.
* **Throughput** (``throughput``): at each concurrency c of ``--concurrency`` (default 1, 4, 16,
  64, 128, 256), ``--per-slot`` × c prompts (at least ``--min-prompts``) of the same length law
  through c slots (``--kv paged``: in one page pool), under each of ``--schedules``: ``plain``
  (no speculation), ``fixed``, ``threshold`` (``--threshold``), ``top_k`` and ``prefix`` with the
  round table ``dj.profile_sps(target, draft, batch_size=c, draft_cost=True)`` measured at that c
  (at `steady_context`, the mean context of a running row in the steady state; the schedules
  pack into its buckets). ``fixed``
  and the schedules run as options of one compiled program (`SharedSchedules`; ``fixed`` packs
  every row's γ + 1 tokens into the largest bucket, the dense verify's tokens), ``plain`` in its
  own. Each run measures the **steady state**: it ends when the slots stop being saturated (the
  queue has emptied and a row finished: `dj.Engine.generate(drain=False)`), so the drain at the
  end, where a few long rows run alone, is left out; ``--drain`` runs every prompt to its end.
  Reported: tokens/s per GPU (all tokens over the run's seconds), tokens/s per user (the mean over
  prompts of a prompt's tokens over its seconds in a slot, admission to end), τ, verify tokens per
  row and round, occupancy, the mean time to first token (from the start of the run, queueing
  included), the wall split into chunks, refills (prefills) and the host's work between them,
  tokens/s without the refills that filled the empty slots at the start (``fill_s``: the start-up
  transient, which a queue in its steady state does not pay),
  the cost model's tokens/s (the tokens over the rounds at the round table's rate for busy rows ×
  verify tokens, interpolated between its buckets, plus the measured refills and host work;
  measured / model in the table; `model_tokens_per_s`), a round's milliseconds as the chunks ran
  it (chunk seconds over rounds) beside the table's round at the run's mean (`table_rate`), and the
  compilation's seconds apart (the warm-up's and any in the measured runs, which the queue's
  clock leaves out).

Each measurement runs once untimed first (warm-up: the programs compile; the queue's clock also
excludes compilation) and then ``--repeats`` times; the table shows the median repeat (by
tokens/s). In the throughput study the warm-up is c prompts with outputs cut to 2 ·
``--rounds-per-call`` · (γ + 1) tokens (the chunk program and the first refill compile), then,
with ``--refill-rows``, `dj.Engine.warm_up` over the prompts' lengths: every refill program the
run can meet runs once before the clock starts (a first run pays one-time costs, on a GPU likely
loading kernels and capturing command buffers); without it, refills of other sizes compile when
first met, outside the clock. ``--budget-s`` bounds the study: past it no new cell starts.

* **Synthetic acceptance** (``--synthetic [c_1,...,c_γ]``, default `synthetic.DEFAULT_RATES`, τ ≈ 3.66
  at a full verify): the random pair with the target's greedy choices after drafted tokens drawn
  from that law (`benchmarks.synthetic`; every forward still runs, so the costs are the Qwen3-4B
  shape's), and the schedules deciding on confidences c_k: the paper's serving regime on random
  weights. Greedy rows only (``--temperature 0``). ``--spread σ`` makes rows differ (row r accepts
  with c_{r,k} = sigmoid(logit c_k + σ·z_{r,k}), `synthetic.row_rates`), the regime where a
  schedule can choose: with equal rows no verify length beats the full one on the H100's tables.

  python -m benchmarks.bench_serving --small                       # CPU smoke check (< 2 min)
  python -m benchmarks.bench_serving --studies occupancy --slots 64 --json occupancy.json
  python -m benchmarks.bench_serving --shipped --studies throughput --json serving.json
  python -m benchmarks.bench_serving --synthetic --studies throughput --json synthetic.json
  python -m benchmarks.bench_serving --synthetic --studies throughput --kv paged \
      --concurrency 256,128,64,16,1 --prompt-lengths 128,1024 --lengths 64,2048 --per-slot 2 \
      --spread 2 --repeats 1 --json sweep.json                       # the serving sweep
"""

from __future__ import annotations

import argparse
import heapq
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax as dj
from benchmarks import bench_decode
from benchmarks import harness
from benchmarks import synthetic
from dspark_jax.decoding import compile_cache
from dspark_jax.decoding.queue import auto_refill_at
from dspark_jax.models import target as tm

STUDIES = ("occupancy", "memory", "throughput")
SCHEDULES = ("plain", "fixed", "threshold", "top_k", "prefix")
"""The throughput study's runs: plain decoding (no speculation), then the verify schedules."""
TABLE_SCHEDULES = ("top_k", "prefix")


def _refill_at(text: str):
  """``--refill-at``: an integer >= 1 or 'auto'."""
  if text == "auto":
    return text
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text}")
  return value


def refill_at(args, slots: int) -> int:
  """The engine's `refill_at` at `slots` slots (``--refill-at``; 'auto': the engine's default,
  `dspark_jax.decoding.queue.auto_refill_at`)."""
  return auto_refill_at(slots) if args.refill_at == "auto" else args.refill_at


def refill_rows(args, slots: int) -> int | None:
  """The engine's `refill_rows` at `slots` slots (``--refill-rows``; 'auto': its `refill_at`)."""
  if args.refill_rows == "auto":
    return min(refill_at(args, slots), slots)
  return None if args.refill_rows is None else min(args.refill_rows, slots)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shipped", action="store_true",
                      help="the shipped trained pair on its held-out prompts (default: the "
                           "Qwen3-4B-shaped random pair; --small: its tiny version)")
  parser.add_argument("--synthetic", nargs="?", default=None,
                      const=",".join(map(str, synthetic.DEFAULT_RATES)),
                      help="the random pair with synthetic acceptance: comma list of c_1..c_γ "
                           "(default, without a value: the paper-like law, τ ≈ 3.66)")
  parser.add_argument("--spread", type=float, default=0.0,
                      help="with --synthetic: σ, rows' rates spread in logit space "
                           "(`synthetic.row_rates`; default 0: every row the same law)")
  parser.add_argument("--studies", default=",".join(STUDIES),
                      help=f"comma list of {', '.join(STUDIES)} (default all)")
  parser.add_argument("--prompts", type=int, default=None,
                      help="prompts of the occupancy run (default 512; --small: 24)")
  parser.add_argument("--lengths", type=harness.int_list, default=None,
                      help="LO,HI: output lengths log-uniform in [LO, HI] (default 16,1024; "
                           "--small: 2,24)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and prompts")
  parser.add_argument("--prompt-len", type=int, default=None,
                      help="random pair: prompt tokens, each prompt drawn in [len/2, len] "
                           "(default 128; --small: 8)")
  parser.add_argument("--prompt-lengths", type=harness.int_list, default=None,
                      help="random pair: LO,HI: prompt lengths uniform in [LO, HI] instead "
                           "(the serving sweep: 128,1024)")
  parser.add_argument("--kv", choices=("contiguous", "paged"), default="contiguous",
                      help="throughput study: the slots' caches (paged: 256 rows of the 4B "
                           "shape fit an 80 GB card)")
  parser.add_argument("--threshold", type=float, default=0.7,
                      help="throughput study: t of the threshold schedule (default 0.7)")
  parser.add_argument("--slots", type=int, default=None,
                      help="S of the occupancy run (default 64; --small: 4)")
  parser.add_argument("--memory-rows", type=int, default=None,
                      help="memory study: the contiguous slots whose KV memory the paged pool gets "
                           "(default 16; --small: 2)")
  parser.add_argument("--memory-lengths", type=harness.int_list, default=None,
                      help="memory study: LO,HI of its log-uniform output lengths (default "
                           "32,8192: mean ~1.47k; --small: 4,256)")
  parser.add_argument("--memory-prompts", type=int, default=None,
                      help="memory study: prompts (default 16 per contiguous slot)")
  parser.add_argument("--memory-factor", type=int, default=8,
                      help="memory study: the paged engine's slots, as a multiple of "
                           "--memory-rows (default 8)")
  parser.add_argument("--page-size", type=int, default=None,
                      help="memory study: positions per page (default 64; --small: 16)")
  parser.add_argument("--concurrency", type=harness.int_list, default=None,
                      help="throughput study concurrencies (default 1,4,16,64,128,256; --small: "
                           "4)")
  parser.add_argument("--per-slot", type=int, default=4,
                      help="throughput study: prompts per slot at each concurrency (default 4)")
  parser.add_argument("--min-prompts", type=int, default=None,
                      help="throughput study: at least this many prompts (default 32; --small: 4)")
  parser.add_argument("--schedules", default=None,
                      help=f"comma list of {', '.join(SCHEDULES)} (default all; --small: "
                           "plain,fixed,top_k)")
  parser.add_argument("--refill-at", type=_refill_at, default="auto",
                      help="the engine returns to the host once this many slots are free "
                           "(`dj.Engine.refill_at`); 'auto' (default, the engine's): S // 32 "
                           "slots at S slots, at least 1 (fewer host round trips and refills, "
                           "about 1.5 %% of the slots idle while waiting)")
  parser.add_argument("--refill-rows", type=_refill_at, default=None,
                      help="throughput study: rows per refill program (`dj.Engine.refill_rows`; "
                           "default: one refill of the admitted count's bucket); 'auto': the "
                           "engine's refill_at, so each engine compiles one refill program")
  parser.add_argument("--rounds-per-call", type=int, default=16,
                      help="iterations per chunk at most (`dj.Engine.rounds_per_call`, default 16)")
  parser.add_argument("--headroom-gib", type=float, default=16.0,
                      help="throughput study with --kv paged: device memory the page pool leaves "
                           "free for the programs' temporaries (`dj.Engine.headroom_bytes`; "
                           "default 16)")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="throughput study: start no new cell past this many seconds (the "
                           "skipped cells are listed; default: no limit)")
  parser.add_argument("--prefill-chunk", type=int, default=None,
                      help="throughput study: the engines' prompt positions per prefill pass "
                           "(`dj.Engine.prefill_chunk`; default its own, 512): a refill of longer "
                           "prompts runs whole passes, one program per row count")
  parser.add_argument("--pack-prompts", action=argparse.BooleanOptionalAction, default=True,
                      help="throughput study: refills pack their prompts into one pass "
                           "(`dj.Engine.pack_prompts`, default) or pad them (--no-pack-prompts)")
  parser.add_argument("--compilation-cache", default=None, metavar="DIR",
                      help="JAX's persistent compilation cache directory: programs compiled by "
                           "an earlier run with the same shapes load from it (docs/serving.md)")
  parser.add_argument("--drain", action=argparse.BooleanOptionalAction, default=False,
                      help="throughput study: run every prompt to its end (--drain), or end each "
                           "run when the slots stop being saturated (default: the steady state; "
                           "`dj.Engine.generate(drain=False)`)")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--gamma", type=int, default=None,
                      help="random pair: γ (default 7; with --synthetic, the number of rates)")
  harness.add_common_arguments(parser, repeats=3, warmup=1, backend=False)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  small = args.small
  args.prompts = args.prompts or (16 if small else 512)
  args.lengths = args.lengths or ([2, 24] if small else [16, 1024])
  args.prompt_len = args.prompt_len or (8 if small else 128)
  args.slots = args.slots or (4 if small else 64)
  args.concurrency = args.concurrency or ([4] if small else [1, 4, 16, 64, 128, 256])
  args.min_prompts = args.min_prompts or (4 if small else 32)
  args.memory_rows = args.memory_rows or (2 if small else 16)
  args.memory_lengths = args.memory_lengths or ([4, 256] if small else [32, 8192])
  args.memory_prompts = args.memory_prompts or 16 * args.memory_rows
  args.page_size = args.page_size or (16 if small else 64)
  if small and args.repeats == 3:
    args.repeats = 1
  args.studies = [s.strip() for s in args.studies.split(",") if s.strip()]
  args.schedules = [s.strip() for s in (args.schedules or ("plain,fixed,top_k" if small else
                                                           ",".join(SCHEDULES))).split(",")
                    if s.strip()]
  for flag, values, known in (("--studies", args.studies, STUDIES),
                              ("--schedules", args.schedules, SCHEDULES)):
    bad = [v for v in values if v not in known]
    if bad or not values:
      parser.error(f"{flag}: unknown {bad[0] if bad else values!r}; known: {', '.join(known)}")
  for flag, pair in (("--lengths", args.lengths), ("--memory-lengths", args.memory_lengths),
                     ("--prompt-lengths", args.prompt_lengths or [1, 1])):
    if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
      parser.error(f"{flag}: expected LO,HI with 1 <= LO <= HI, got {pair}")
  if args.spread and args.synthetic is None:
    parser.error("--spread: spreads the synthetic law's rows; pass --synthetic too")
  if args.synthetic is not None:
    try:
      args.synthetic = synthetic.check_rates(float(r) for r in args.synthetic.split(","))
    except ValueError as error:
      parser.error(f"--synthetic: {error}")
    if args.shipped:
      parser.error("--synthetic: the synthetic law replaces a random pair's acceptance; drop "
                   "--shipped")
    if args.temperature != 0:
      parser.error(f"--synthetic: only greedy rows follow the law; pass --temperature 0, got "
                   f"{args.temperature}")
    if not args.spread >= 0:
      parser.error(f"--spread: must be >= 0, got {args.spread}")
    if args.gamma not in (None, len(args.synthetic)):
      parser.error(f"--gamma: {args.gamma}, but --synthetic gives {len(args.synthetic)} rates")
    args.gamma = len(args.synthetic)
  args.gamma = 7 if args.gamma is None else args.gamma
  if args.prefill_chunk is not None and args.prefill_chunk < 1:
    parser.error(f"--prefill-chunk: must be >= 1, got {args.prefill_chunk}")
  for flag in ("prompts", "prompt_len", "slots", "per_slot", "min_prompts", "gamma",
               "rounds_per_call", "memory_rows", "memory_prompts", "memory_factor", "page_size"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')}: must be >= 1")
  if min(args.concurrency) < 1:
    parser.error(f"--concurrency: each must be >= 1, got {args.concurrency}")
  if not args.temperature >= 0:
    parser.error(f"--temperature: must be >= 0, got {args.temperature}")
  return args


# ---- the work ----------------------------------------------------------------------------------


def output_lengths(count: int, low: int, high: int, seed: int) -> np.ndarray:
  """[count] int32 lengths log-uniform in [low, high]: exp(U(log low, log(high + 1))), floored."""
  rng = np.random.default_rng(seed)
  drawn = np.exp(rng.uniform(np.log(low), np.log(high + 1), count))
  return np.clip(np.floor(drawn), low, high).astype(np.int32)


class Workload:
  """The pair and a prompt source: `prompts(count, seed)` returns token-id lists."""

  def __init__(self, args):
    if args.shipped:
      from dspark_jax.formats import shipped
      pair = shipped.load_shipped()
      self.target, self.draft = pair.target, pair.draft
      self.held_out = [pair.encode(t) for t in pair.prompts]
      self.name = "shipped pair, held-out prompts"
    else:
      self.target, self.draft = bench_decode.build_models(args.small, args.gamma)
      self.held_out = None
      self.name = "Qwen3-4B-shaped random pair" if not args.small else "tiny random pair"
    self.rates, self.spread = args.synthetic, args.spread
    if self.rates is not None:
      self.target = synthetic.synthetic_target(self.target, self.rates, self.spread)
      self.name += (f", synthetic acceptance c = {','.join(map(str, self.rates))} "
                    + (f"spread σ = {self.spread:g} " if self.spread else "")
                    + f"(τ {synthetic.mean_tau(self.rates, self.spread, 256):.2f} at a full "
                    "verify)")
    self.prompt_lengths = args.prompt_lengths or [max(args.prompt_len // 2, 1), args.prompt_len]
    self.vocab = self.target.config.vocab_size
    # The longest possible prompt + HI for every engine: engines of equal S share their programs.
    self.longest = max(map(len, self.held_out)) if self.held_out else self.prompt_lengths[1]
    self.max_seq_len = self.longest + args.lengths[1]

  def schedule(self, schedule):
    """`schedule`, deciding on the law's confidences with synthetic acceptance."""
    return (schedule if self.rates is None else
            synthetic.law_confidence(schedule, self.rates, self.spread))

  def prompts(self, count: int, seed: int) -> list[list[int]]:
    if self.held_out is not None:
      return [self.held_out[i % len(self.held_out)] for i in range(count)]
    rng = np.random.default_rng(seed + 1)
    lens = rng.integers(self.prompt_lengths[0], self.prompt_lengths[1] + 1, count)
    return [rng.integers(0, self.vocab - 1, n).tolist() for n in lens]


def _params(count: int, temperature: float, offset: int = 0):
  return dj.SamplingParams(temperature=np.full(count, float(temperature)),
                           seed=np.arange(count) + offset)


def _median_by_rate(runs: list[dict]) -> dict:
  """The run whose tokens/s is the median (the lower middle for an even count)."""
  order = sorted(runs, key=lambda r: r["tokens_per_s"])
  return order[(len(order) - 1) // 2]


# ---- occupancy ---------------------------------------------------------------------------------


def queue_run(engine, prompts, budgets, temperature, drain: bool = True) -> dict:
  return queue_stats(engine.generate(prompts, _params(len(prompts), temperature),
                                     jax.random.key(0), max_new_tokens=budgets, drain=drain))


def queue_stats(out) -> dict:
  """The figures of a `QueueResult` the studies report."""
  per_user = [r.tokens_per_second for r in out.results]
  return {"tokens": int(out.lengths.sum()), "seconds": out.wall_seconds,
          "compile_s": out.compile_seconds, "refill_s": out.refill_seconds,
          "chunk_s": out.chunk_seconds, "host_s": out.host_seconds, "fill_s": out.fill_seconds,
          "unfinished": sum(r == "unfinished" for r in out.finish_reason),
          "tokens_per_s": out.tokens_per_second, "occupancy": out.occupancy,
          "steady_tokens_per_s": float(out.lengths.sum()) / max(
              out.wall_seconds - out.fill_seconds, 1e-12),
          "per_user_tokens_per_s": float(np.mean(per_user)), "tau": out.tau,
          "verify_tokens": out.verify_tokens, "rounds": out.rounds, "chunks": out.chunks,
          "mean_ttft_s": float(np.mean([r.ttft_seconds for r in out.results]))}


def static_run(target, draft, prompts, budgets, temperature, slots: int) -> dict:
  """Consecutive `generate` calls of `slots` prompts each (the last may hold fewer)."""
  tokens, seconds, busy, held, rounds = 0, 0.0, 0, 0, 0
  for start in range(0, len(prompts), slots):
    rows = range(start, min(start + slots, len(prompts)))
    out = dj.generate(target, draft, [prompts[i] for i in rows], _params(len(rows), temperature,
                                                                         start),
                      jax.random.key(0), max_new_tokens=budgets[start:start + slots])
    tokens += int(out.lengths.sum())
    seconds += out.wall_seconds
    busy += int(out.row_rounds.sum())
    held += slots * int(out.rounds)
    rounds += int(out.rounds)
  return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-12),
          "occupancy": busy / held if held else 1.0, "rounds": rounds}


def ideal_occupancy(budgets: np.ndarray, slots: int, tau: float) -> float:
  """The occupancy of a queue with no overhead on this work: prompts in order, each into the
  first slot to free, busy for ceil(length / τ) rounds; busy slot-rounds over slots × the
  makespan. Below 1 only by the drain at the end (fewer prompts left than slots)."""
  rounds = np.ceil(np.asarray(budgets, np.float64) / max(float(tau), 1e-9)).astype(np.int64)
  free = [0] * slots
  heapq.heapify(free)
  end = 0
  for r in rounds:
    start = heapq.heappop(free)
    heapq.heappush(free, start + int(r))
    end = max(end, start + int(r))
  return float(rounds.sum() / (slots * max(end, 1)))


def occupancy_study(work: Workload, args) -> dict:
  low, high = args.lengths
  budgets = output_lengths(args.prompts, low, high, args.seed)
  prompts = work.prompts(args.prompts, args.seed)
  engine = dj.Engine(work.target, work.draft, max_batch_size=args.slots,
                     max_seq_len=work.max_seq_len, refill_at=refill_at(args, args.slots),
                     rounds_per_call=args.rounds_per_call)
  warm = min(len(prompts), 2 * args.slots)
  for _ in range(args.warmup):
    queue_run(engine, prompts[:warm], budgets[:warm], args.temperature)
    static_run(work.target, work.draft, prompts[:warm], budgets[:warm], args.temperature,
               args.slots)
  queue, static, steady = [], [], []
  for _ in range(args.repeats):   # interleaved, so all see the same machine state
    queue.append(queue_run(engine, prompts, budgets, args.temperature))
    static.append(static_run(work.target, work.draft, prompts, budgets, args.temperature,
                             args.slots))
    steady.append(queue_run(engine, prompts, budgets, args.temperature, drain=False))
  q, s, st = _median_by_rate(queue), _median_by_rate(static), _median_by_rate(steady)
  bound = ideal_occupancy(budgets, args.slots, q.get("tau") or 1.0)
  print(f"occupancy, S={args.slots}: queue {q['occupancy']:.3f} at {q['tokens_per_s']:.0f} "
        f"tokens/s (an ideal queue: {bound:.3f}, so {q['occupancy'] / bound:.3f} of it; "
        f"while saturated {st['occupancy']:.3f} at {st['tokens_per_s']:.0f} tokens/s); static "
        f"batches {s['occupancy']:.3f} at {s['tokens_per_s']:.0f} tokens/s", flush=True)
  return {"slots": args.slots, "prompts": args.prompts, "lengths": [low, high],
          "mean_length": float(budgets.mean()), "queue": q, "static": s, "ideal_occupancy": bound,
          "of_ideal": q["occupancy"] / bound, "steady": st,
          "speedup": q["tokens_per_s"] / max(s["tokens_per_s"], 1e-12),
          "queue_repeats": queue, "static_repeats": static, "steady_repeats": steady}


# ---- concurrent rows in the same memory -------------------------------------------------------


def memory_study(work: Workload, args) -> dict:
  """Mean concurrent rows in one KV budget: `--memory-rows` contiguous slots (each holding the
  longest prompt + HI) against a paged pool of the same positions behind `--memory-factor` times
  as many slots, on the same prompts and lengths."""
  low, high = args.memory_lengths
  budgets = output_lengths(args.memory_prompts, low, high, args.seed)
  prompts = work.prompts(args.memory_prompts, args.seed)
  max_seq_len = work.longest + high
  gamma = work.draft.config.gamma
  capacity = tm.cache_slots(max_seq_len + 2 * (gamma + 1))   # what a contiguous slot allocates
  pages = args.memory_rows * capacity // args.page_size
  engines = {
      "contiguous": dj.Engine(work.target, work.draft, max_batch_size=args.memory_rows,
                              max_seq_len=max_seq_len,
                              refill_at=refill_at(args, args.memory_rows),
                              rounds_per_call=args.rounds_per_call),
      "paged": dj.Engine(work.target, work.draft,
                         max_batch_size=args.memory_factor * args.memory_rows,
                         max_seq_len=max_seq_len,
                         refill_at=refill_at(args, args.memory_factor * args.memory_rows),
                         rounds_per_call=args.rounds_per_call, kv="paged", num_pages=pages,
                         page_size=args.page_size)}
  out = {"memory_rows": args.memory_rows, "capacity": capacity, "pages": pages,
         "page_size": args.page_size, "prompts": args.memory_prompts, "lengths": [low, high],
         "mean_length": float(budgets.mean())}
  runs = {name: [] for name in engines}
  warm = min(len(prompts), 2 * args.memory_rows)
  short = warm_budgets(budgets[:warm], gamma, args.rounds_per_call)  # compiles, in a few chunks
  for _ in range(args.warmup):
    for engine in engines.values():
      engine.generate(prompts[:warm], _params(warm, args.temperature), jax.random.key(0),
                      max_new_tokens=short)
  for _ in range(args.repeats):
    for name, engine in engines.items():
      result = engine.generate(prompts, _params(len(prompts), args.temperature),
                               jax.random.key(0), max_new_tokens=budgets)
      r = queue_stats(result)
      r.update(rows=result.saturated_rows, pages_peak=result.pages_peak,
               pages_mean=result.pages_mean, preemptions=result.preemptions)
      runs[name].append(r)
      print(f"  memory, {name}: {r['rows']:.1f} concurrent rows, {r['tokens_per_s']:.0f} tokens/s, "
            f"{r['preemptions']} preemptions, compiling {r['compile_s']:.0f} s", flush=True)
  for name in engines:
    out[name] = _median_by_rate(runs[name])
  out["rows_ratio"] = out["paged"]["rows"] / max(out["contiguous"]["rows"], 1e-12)
  print(f"memory: {pages} pages of {args.page_size} = {args.memory_rows} contiguous slots of "
        f"{capacity}; mean concurrent rows {out['contiguous']['rows']:.1f} contiguous, "
        f"{out['paged']['rows']:.1f} paged ({out['rows_ratio']:.2f}x), "
        f"{out['paged']['preemptions']} preemptions", flush=True)
  return out


# ---- tokens/s per GPU against per user -----------------------------------------------------------


def model_tokens_per_s(r: dict, concurrency: int, table) -> float | None:
  """The cost model's tokens/s for a run: its tokens over the rounds' modelled seconds plus its
  measured refills (prefills) and host work between chunks. The rounds make busy rows × τ tokens
  each (busy rows = occupancy × c) and verify busy rows × verify tokens per row on average. A
  round runs in the bucket that holds its own tokens, and rounds spread around the mean, so their
  mean rate lies between the rates of the buckets around it: the model takes the rate
  interpolated linearly at the mean. `table`: (bucket sizes ascending, their rounds/s), the rate
  of a bucket being that of the fastest size at least as large (`ProfileResult.dense`); None
  (plain decoding): None."""
  rate = table_rate(r, concurrency, table)
  if rate is None:
    return None
  rounds_s = r["tokens"] / (max(r["occupancy"] * concurrency, 1e-9) * r["tau"] * rate)
  return r["tokens"] / (rounds_s + r.get("refill_s", 0.0) + r.get("host_s", 0.0))


def table_rate(r: dict, concurrency: int, table) -> float | None:
  """The round table's rounds/s for a run's mean round (`model_tokens_per_s`): interpolated at its
  busy rows × verify tokens per row; None without a table (plain decoding)."""
  if table is None:
    return None
  sizes, rates = (np.asarray(a, np.float64) for a in table)
  rows = max(r["occupancy"] * concurrency, 1e-9)
  return float(np.interp(rows * r["verify_tokens"], sizes, rates))


class SharedSchedules:
  """The verify schedules of one concurrency in one compiled program.

  `schedule` is a `Schedule` whose state is ``(index, (state of each option))``; its update runs
  the option at ``index`` (`jax.lax.switch`) and packs into `buckets`. The queue calls a
  schedule's ``init`` on the host for every `Engine.generate` (`decoding.slots._empty_state`) and
  keys its compiled programs by the schedule object, so `select` switches the schedule of the
  next call with no recompilation. Every option gets fresh draft noise each round (the state has
  leaves), which keeps each of them lossless.
  """

  def __init__(self, options: dict, buckets):
    self.names = list(options)
    self.pick = 0
    members = list(options.values())

    def init(batch_size, gamma):
      return (np.int32(self.pick), tuple(m.init(batch_size, gamma) for m in members))

    def update(confidence, active, state):
      index, states = state

      def branch(i):
        def run(confidence, active, states):
          lens, new = members[i].update(confidence, active, states[i])
          return jnp.asarray(lens, jnp.int32), states[:i] + (new,) + states[i + 1:]
        return run

      lens, states = jax.lax.switch(index, [branch(i) for i in range(len(members))],
                                    confidence, active, states)
      return lens, (index, states)

    self.schedule = dj.schedules.Schedule(init, update, buckets)

  def select(self, name: str) -> None:
    self.pick = self.names.index(name)


def compile_summary(log: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
  """{program name: (compilations, seconds)} of a `compile_cache.compile_log` slice."""
  out: dict[str, tuple[int, float]] = {}
  for name, seconds in log:
    key = name.strip("_").replace("_program", "")
    count, total = out.get(key, (0, 0.0))
    out[key] = (count + 1, total + seconds)
  return out


def steady_context(prompt_lens, budgets) -> int:
  """The mean context a busy slot's row has in the steady state: its prompt plus the tokens it
  has made so far. A slot spends time in proportion to each row's length L, and a row is on
  average halfway through, so the second part is E[L²] / (2 E[L]) (log-uniform 64..2048: about
  530, against a mean length of about 570)."""
  lengths = np.asarray(budgets, np.float64)
  return int(round(np.mean(prompt_lens) + np.mean(lengths ** 2) / (2 * np.mean(lengths))))


def warm_budgets(budgets: np.ndarray, gamma: int, rounds_per_call: int) -> np.ndarray:
  """The warm-up's output lengths: short enough to finish in a few chunks, long enough that the
  chunk program runs after refills (so it and the refills compile)."""
  return np.minimum(budgets, 2 * rounds_per_call * (gamma + 1)).astype(budgets.dtype)


def throughput_study(work: Workload, args) -> list[dict]:
  """Tokens/s per GPU and per user at each concurrency, for plain decoding and each schedule
  (module docstring). The scheduled runs of a concurrency share one program (`SharedSchedules`);
  each engine's first call (its compilation) runs on short outputs and is timed apart. Past
  ``--budget-s`` seconds the remaining cells are skipped (and listed)."""
  low, high = args.lengths
  gamma = work.draft.config.gamma
  results, skipped = [], []
  prefill = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
  prefill["pack_prompts"] = args.pack_prompts
  began = time.perf_counter()
  for c in args.concurrency:
    if args.budget_s and time.perf_counter() - began > args.budget_s:
      skipped.append(c)
      continue
    count = max(args.per_slot * c, args.min_prompts)
    budgets = output_lengths(count, low, high, args.seed + c)
    prompts = work.prompts(count, args.seed + c)
    profile = table = shared = None
    if any(s != "plain" for s in args.schedules):
      # The round table (whole decoding rounds, the paper's engine steps): the schedules'
      # table and the cost model of every speculative run.
      context = steady_context([len(p) for p in prompts], budgets)
      start = time.perf_counter()
      profile = dj.profile_sps(work.target, work.draft, batch_size=c, context=context,
                               repeats=args.repeats, steps=4, draft_cost=True)
      sizes = profile.batch_tokens.astype(np.int64)
      table = (sizes, profile.dense()[sizes])   # each bucket at its fastest packing's rate
      print(f"c={c}: rounds/s per verify bucket {profile.table()} "
            f"({time.perf_counter() - start:.1f} s)", flush=True)
      options = {"fixed": dj.schedules.fixed,
                 "threshold": lambda: dj.schedules.threshold(args.threshold),
                 "top_k": lambda: dj.schedules.top_k(profile),   # its table and its buckets
                 "prefix": lambda: dj.schedules.prefix(profile)}
      chosen = {n: make() for n, make in options.items() if n in args.schedules}
      if chosen:
        shared = SharedSchedules(chosen, profile.buckets())
        shared_schedule = work.schedule(shared.schedule)
    engines, warmed = {}, set()      # this c's engines, and those warm_up ran on
    for name in args.schedules:
      if args.budget_s and time.perf_counter() - began > args.budget_s:
        skipped.append(f"{c}/{name}")
        continue
      if name == "plain":
        engines[name] = dj.Engine(work.target, None, max_batch_size=c,
                                  max_seq_len=work.max_seq_len, spec=False,
                                  refill_at=refill_at(args, c),
                                  refill_rows=refill_rows(args, c), **prefill,
                                  rounds_per_call=args.rounds_per_call, kv=args.kv,
                                  headroom_bytes=int(args.headroom_gib * 2**30))
        engine = engines[name]
      else:
        shared.select(name)
        if "shared" not in engines:
          engines["shared"] = dj.Engine(work.target, work.draft, max_batch_size=c,
                                        max_seq_len=work.max_seq_len, schedule=shared_schedule,
                                        refill_at=refill_at(args, c),
                                        refill_rows=refill_rows(args, c), **prefill,
                                        rounds_per_call=args.rounds_per_call, kv=args.kv,
                                        headroom_bytes=int(args.headroom_gib * 2**30))
        engine = engines["shared"]
      warm = min(count, c)
      short = warm_budgets(budgets[:warm], gamma, args.rounds_per_call)
      logged = len(compile_cache.compile_log())
      start = time.perf_counter()
      for _ in range(args.warmup):
        queue_run(engine, prompts[:warm], short, args.temperature)
      if args.warmup and engine.refill_rows is not None and id(engine) not in warmed:
        warmed.add(id(engine))      # engines[...] holds it for this c: its id is not reused
        lengths = [len(p) for p in prompts]
        groups = engine.warm_up((min(lengths), max(lengths)), sampled=args.temperature > 0)
        print(f"  c={c} {name}: warmed {groups} refill programs", flush=True)
      first_s = time.perf_counter() - start
      runs = [queue_run(engine, prompts, budgets, args.temperature, drain=args.drain)
              for _ in range(args.repeats)]
      r = dict(_median_by_rate(runs), concurrency=c, schedule=name, prompts=count,
               repeats=[x["tokens_per_s"] for x in runs], warmup_s=first_s,
               compile_s=first_s + sum(x["compile_s"] for x in runs),
               compiled=compile_summary(compile_cache.compile_log()[logged:]))
      r["model_tokens_per_s"] = model_tokens_per_s(r, c, None if name == "plain" else table)
      # A round (or step) as the chunks ran it, against the table's round at the run's mean.
      r["round_ms"] = 1e3 * r["chunk_s"] / max(r["rounds"], 1)
      rate = table_rate(r, c, None if name == "plain" else table)
      r["table_round_ms"] = None if rate is None else 1e3 / rate
      results.append(r)
      model = r["model_tokens_per_s"]
      table_ms = "" if rate is None else f" (table {r['table_round_ms']:.2f})"
      print(f"  c={c} {name}: {r['tokens_per_s']:.0f} tokens/s per GPU, "
            f"{r['per_user_tokens_per_s']:.1f} per user, τ {r['tau']:.2f}, verify "
            f"{r['verify_tokens']:.2f}/row, occupancy {r['occupancy']:.3f}, model "
            f"{'-' if model is None else f'{model:.0f}'}, round {r['round_ms']:.2f} ms{table_ms}, "
            f"{r['unfinished']} unfinished, "
            f"wall {r['seconds']:.2f} s = chunks {r['chunk_s']:.2f} + refills "
            f"{r['refill_s']:.2f} (filling the slots {r['fill_s']:.2f}) + host {r['host_s']:.2f}; "
            f"without the fill {r['steady_tokens_per_s']:.0f} tokens/s, "
            f"warm-up {first_s:.1f} s, compiling in all {r['compile_s']:.1f} s "
            f"({', '.join(f'{n} {k}: {t:.0f} s' for n, (k, t) in r['compiled'].items())}) "
            f"[{time.perf_counter() - began:.0f} s]", flush=True)
  if skipped:
    print(f"skipped past --budget-s {args.budget_s:g}: {skipped}", flush=True)
  return results


# ---- main --------------------------------------------------------------------------------------


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
  low, high = args.lengths
  meta, _ = harness.start_run(args, pair="shipped" if args.shipped else "random",
                              synthetic=args.synthetic,
                              studies=args.studies, prompts=args.prompts, lengths=[low, high],
                              length_law="log-uniform", seed=args.seed, slots=args.slots,
                              concurrency=args.concurrency, schedules=args.schedules,
                              temperature=args.temperature, per_slot=args.per_slot,
                              refill_at=args.refill_at, refill_rows=args.refill_rows,
                              rounds_per_call=args.rounds_per_call,
                              pack_prompts=args.pack_prompts,
                              compilation_cache=args.compilation_cache)
  work = Workload(args)
  results: dict = {"pair": work.name}
  header = ["study", "S or c", "schedule", "tokens/s (GPU)", "tokens/s (user)", "τ", "occupancy",
            "vs baseline"]
  rows = []
  if "occupancy" in args.studies:
    occ = occupancy_study(work, args)
    results["occupancy"] = occ
    for label, r, ratio in (("queue", occ["queue"], f"{occ['speedup']:.2f}x"),
                            ("queue, saturated", occ["steady"], "–"),
                            ("static", occ["static"], "1.00x")):
      rows.append([f"occupancy ({label})", str(occ["slots"]), "fixed", f"{r['tokens_per_s']:.0f}",
                   harness.cell(r.get("per_user_tokens_per_s")), harness.cell(r.get("tau"), 2),
                   f"{r['occupancy']:.3f}", ratio])
  if "memory" in args.studies:
    mem = results["memory"] = memory_study(work, args)
    for name, slots, ratio in (("paged", args.memory_factor * args.memory_rows, mem["rows_ratio"]),
                               ("contiguous", args.memory_rows, 1.0)):
      r = mem[name]
      rows.append([f"memory ({name})", str(slots), "fixed", f"{r['tokens_per_s']:.0f}",
                   f"{r['per_user_tokens_per_s']:.1f}", f"{r['tau']:.2f}",
                   f"{r['occupancy']:.3f}", f"{r['rows']:.1f}_rows_({ratio:.2f}x)"])
  if "throughput" in args.studies:
    results["throughput"] = throughput_study(work, args)
    for r in results["throughput"]:
      model = r.get("model_tokens_per_s")
      rows.append(["throughput", str(r["concurrency"]), r["schedule"], f"{r['tokens_per_s']:.0f}",
                   f"{r['per_user_tokens_per_s']:.1f}", f"{r['tau']:.2f}",
                   f"{r['occupancy']:.3f}",
                   f"verify {r['verify_tokens']:.2f}/row, model "
                   + ("-" if model is None else f"{model:.0f} ({r['tokens_per_s'] / model:.2f})")])
  title = (f"bench_serving ({meta['device_kind']}, {work.name}, output lengths log-uniform "
           f"{low}..{high}, no stop token, T = {args.temperature:g}; median of {args.repeats} "
           f"after {args.warmup} warm-up)")
  harness.finish(title, header, rows, meta=meta, results=results, json_path=args.json)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
