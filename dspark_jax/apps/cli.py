"""The ``dspark-jax`` command line: ``demo`` (the default), ``generate``, ``eval``, ``calibrate``,
``train``, ``regenerate``, ``sampler-demo``, ``probe``.

* ``dspark-jax demo``: the shipped trained pair decoding held-out prompts (`dspark_jax.apps.demo`).
* ``dspark-jax generate --target DIR [--draft DIR] --prompt TEXT [--chat] [--temperature T --top-p P
  --top-k K --max-new-tokens N --seed S --stop STR ...]``: completes the prompt (repeat ``--prompt``
  for a batch) with a Hugging Face Qwen3 target and a DeepSpec DSpark drafter
  (`dspark_jax.load_pretrained`) and the target directory's tokenizer (or ``--tokenizer DIR``),
  and prints each completion, its finish reason, τ and tokens/s. Without ``--draft`` it decodes
  autoregressively; without ``--target`` it uses the shipped pair and its tokenizer.
* ``dspark-jax eval``: without ``--target`` and ``--dataset``, the shipped pair's acceptance study,
  DSpark drafter vs parallel ablation at T = 0 and 1, with the plain decode's tokens/s beside them
  (``--concurrency`` slots, refilled from the prompt queue as rows finish; default one per prompt). With ``--target DIR --draft DIR --dataset
  FILE.jsonl`` (DeepSpec's eval format; the first turn is the prompt; ``--chat`` applies the chat
  template), the pair's τ with its 95 % interval, per-position acceptance with Wilson intervals and
  tokens/s at each ``--temperature`` (default 1, ``--max-new-tokens`` 2048, ``--concurrency`` 1: the
  paper's Table 1 protocol; ``--batch-size`` is its deprecated alias). ``--dataset`` alone evaluates
  the shipped pair on it. Each writes a table, a PNG plot and a JSON file
  (`dspark_jax.apps.evaluation`); with ``--out FILE.jsonl`` each prompt's result is appended there
  as it finishes and a rerun resumes from it (the plot and JSON beside it). ``--kv paged``
  (``--num-pages N``) keeps the slots' caches in pages of one pool (`decoding.Engine`).
  With ``--schedule fixed,threshold:0.5,prefix,top_k[:lag]`` (either pair), the schedule study
  instead (`dspark_jax.apps.schedule_study`): per schedule and temperature, τ with its interval,
  verify tokens per round, acceptance rate (accepted / verified drafts), per-position acceptance
  and tokens/s, decoded through ``--concurrency`` slots of the queue (default 8; ``--batch-size`` is
  its deprecated alias). ``prefix``/``top_k`` read
  ``--sps FILE.json`` (`schedules.save_sps`), else a table measured now by ``profile_sps`` on the
  current device (saved in ``--out``). ``--calibration FILE.json`` (from ``calibrate``) sets the
  draft's confidence temperatures first; ``--throughput-concurrency 1,16,64`` adds tokens/s per
  concurrency and its plot. ``--json`` prints the JSON document instead of the table.
* ``dspark-jax calibrate --out FILE.json [--target DIR --draft DIR --dataset FILE]``: decodes a
  calibration set (the shipped pair: held-out prompts from ``--first-prompt``, default 42; the
  schedule study evaluates on the first 42) with the fixed schedule and ``trace=True`` through
  ``--concurrency`` slots of the queue (default 8; ``--batch-size`` is a deprecated alias), fits the
  confidence head's STS temperatures, prints ECE and AUC per position before/after, writes the
  temperatures (JSON) and a reliability diagram; ``--save-draft DIR`` writes a pretrained draft
  with them (``confidence_temperatures`` in its DeepSpec config).
* ``dspark-jax train`` / ``dspark-jax regenerate``: a DSpark drafter for a Qwen3 target from
  conversation jsonl, and the target's own answers to a prompt file
  (`dspark_jax.apps.train_commands`).
* ``dspark-jax sampler-demo``: the draft sampler alone on random weights (`dspark_jax.apps.sampler_demo`).
* ``dspark-jax probe --max-batch-size N --vocab V --gamma G --dtype bf16``: builds a draft sampler of
  those shapes on the current device and prints the memory gate's decision, the backend of every
  variant and padding bucket, and the dispatch table (`dspark_jax.kernels.dispatch`).

This module owns the parser, ``probe``, ``generate``, ``eval`` without ``--schedule`` and `main`;
the flags' value types and the model flags are in `dspark_jax.apps.flags`, ``eval --schedule``
and ``calibrate`` in `dspark_jax.apps.schedule_commands`, ``train`` and ``regenerate`` in
`dspark_jax.apps.train_commands`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dspark_jax.apps import flags
from dspark_jax.apps import train_commands


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="dspark-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command")

  demo = sub.add_parser("demo", help="decode held-out prompts with the shipped trained pair")
  demo.add_argument("--prompts", type=flags.positive, default=3)
  demo.add_argument("--first-prompt", type=flags.nonnegative, default=0)
  demo.add_argument("--max-new-tokens", type=flags.positive, default=64)
  demo.add_argument("--temperature", type=float, default=0.0)
  demo.add_argument("--seed", type=int, default=0)

  generate = sub.add_parser("generate", help="complete prompts with a pretrained pair")
  flags.add_model_flags(generate)
  generate.add_argument("--prompt", action="append", required=True, type=flags.nonempty,
                        help="the prompt (repeat for a batch)")
  generate.add_argument("--system", default=None, help="with --chat: a system message first")
  generate.add_argument("--temperature", type=flags.finite_nonnegative, default=0.0)
  generate.add_argument("--top-p", type=flags.probability, default=1.0)
  generate.add_argument("--top-k", type=flags.nonnegative, default=0, help="0: no top-k")
  generate.add_argument("--max-new-tokens", type=flags.positive, default=128)
  generate.add_argument("--seed", type=flags.seed, default=0)
  generate.add_argument("--stop", action="append", default=[], type=flags.stop_string,
                        help="a stop string (repeatable; backslash escapes such as \\n are read)")

  evaluate = sub.add_parser("eval", help="acceptance: the shipped study, or a pair on a dataset")
  flags.add_model_flags(evaluate)
  evaluate.add_argument("--dataset", default=None,
                        help="DeepSpec eval file (.jsonl, one {\"turns\": [...]} per line)")
  evaluate.add_argument("--prompts", "--num-prompts", dest="prompts", type=flags.positive,
                        default=None, help="number of prompts (default: all)")
  evaluate.add_argument("--first-prompt", type=flags.nonnegative, default=0,
                        help="skip the first N prompts (e.g. those calibrate used)")
  evaluate.add_argument("--concurrency", type=flags.positive, default=None,
                        help="slots decoding at once, each taking the next prompt as its row "
                             "finishes (default: all prompts for the shipped study; 1 with "
                             "--dataset; 8 with --schedule)")
  evaluate.add_argument("--batch-size", type=flags.positive, default=None,
                        help="deprecated alias of --concurrency")
  evaluate.add_argument("--max-new-tokens", type=flags.positive, default=None,
                        help="default: 128 for the shipped study, 2048 for a dataset")
  evaluate.add_argument("--kv", choices=("contiguous", "paged"), default="contiguous",
                        help="the slots' caches: each slot holds its whole capacity (default), or "
                             "pages of one pool handed out as rows grow (docs/serving.md)")
  evaluate.add_argument("--num-pages", type=flags.positive, default=None,
                        help="with --kv paged: the pool's pages (default: what fits in free "
                             "device memory)")
  evaluate.add_argument("--temperatures", "--temperature", dest="temperatures",
                        type=flags.temperatures, default=None,
                        help="comma-separated, e.g. 0,1 (default: 0,1 for the shipped study, 1 for "
                             "a dataset)")
  evaluate.add_argument("--baseline", action="store_true",
                        help="with --dataset: also decode autoregressively for the plain tokens/s")
  evaluate.add_argument("--seed", type=flags.seed, default=0)
  evaluate.add_argument("--out", default="dspark_eval",
                        help="directory for the PNG and JSON; or, with --dataset, FILE.jsonl: each "
                             "prompt's result appended as it finishes (a rerun resumes, skipping "
                             "the prompts there), the PNG and JSON beside it as FILE.png/.json")
  evaluate.add_argument("--schedule", type=flags.schedules, default=None,
                        help="compare verify schedules: fixed,threshold:T,prefix,top_k[:LAG]")
  evaluate.add_argument("--sps", default=None,
                        help="with --schedule: throughput table JSON for prefix/top_k (default: "
                             "measured now with profile_sps)")
  evaluate.add_argument("--calibration", default=None,
                        help="with --schedule: temperatures JSON from calibrate, set on the draft")
  evaluate.add_argument("--throughput-concurrency", "--throughput-batches",
                        dest="throughput_batches", type=flags.batch_sizes, default=None,
                        help="with --schedule: also tokens/s at these concurrencies, e.g. 1,16,64")
  evaluate.add_argument("--json", action="store_true",
                        help="print the JSON document instead of the table")

  calibrate = sub.add_parser("calibrate", help="fit the confidence head's STS temperatures")
  flags.add_model_flags(calibrate)
  calibrate.add_argument("--dataset", default=None,
                         help="DeepSpec eval file (.jsonl) of calibration prompts")
  calibrate.add_argument("--prompts", "--num-prompts", dest="prompts", type=flags.positive,
                         default=None, help="number of prompts (default: all from --first-prompt)")
  calibrate.add_argument("--first-prompt", type=flags.nonnegative, default=None,
                         help="skip the first N prompts (default: 42 for the shipped pair, else 0)")
  calibrate.add_argument("--concurrency", type=flags.positive, default=None,
                         help="slots decoding at once (the queue; default 8)")
  calibrate.add_argument("--batch-size", type=flags.positive, default=None,
                         help="deprecated alias of --concurrency")
  calibrate.add_argument("--max-new-tokens", type=flags.positive, default=None,
                         help="default: 128 for the shipped pair, 512 for a dataset")
  calibrate.add_argument("--temperatures", "--temperature", dest="temperatures",
                         type=flags.temperatures, default=None,
                         help="sampling temperatures pooled (default: 0,1 for the shipped pair, "
                              "1 for a dataset)")
  calibrate.add_argument("--bins", type=flags.positive, default=15, help="ECE bins")
  calibrate.add_argument("--seed", type=flags.seed, default=0)
  calibrate.add_argument("--out", required=True, help="the temperatures JSON to write")
  calibrate.add_argument("--plot", default=None,
                         help="reliability diagram PNG (default: beside --out)")
  calibrate.add_argument("--save-draft", default=None,
                         help="with --target/--draft: write the calibrated draft there")
  calibrate.add_argument("--json", action="store_true",
                         help="print the JSON document instead of the table")

  train_commands.add_parsers(sub)

  sampler = sub.add_parser("sampler-demo", help="propose a mixed batch on every path (random weights)")
  sampler.add_argument("--batch-size", type=flags.positive, default=8)
  sampler.add_argument("--vocab", type=flags.positive, default=32768)
  sampler.add_argument("--gamma", type=flags.positive, default=7)
  sampler.add_argument("--rank", type=flags.positive, default=256)
  sampler.add_argument("--hidden", type=flags.positive, default=512)
  sampler.add_argument("--head", choices=("vanilla", "gated", "rnn"), default="vanilla")
  sampler.add_argument("--dtype", type=flags.dtype, default=None,
                    help="logits/weights dtype (default: bf16 on GPU, f32 on CPU, which lacks bf16 math)")
  sampler.add_argument("--repeats", type=flags.positive, default=20)
  sampler.add_argument("--mode", choices=("off", "auto", "force"), default=None,
                    help="folded sampling mode (default: $DSPARK_JAX_FOLDED_SAMPLING, else auto)")

  probe = sub.add_parser("probe", help="print the memory gate's decision for the current device")
  probe.add_argument("--max-batch-size", type=flags.positive, required=True)
  probe.add_argument("--vocab", type=flags.positive, required=True)
  probe.add_argument("--gamma", type=flags.positive, required=True)
  probe.add_argument("--dtype", type=flags.dtype, default="bfloat16")
  probe.add_argument("--rank", type=flags.positive, default=256)
  probe.add_argument("--mode", choices=("off", "auto", "force"), default=None)
  probe.add_argument("--headroom-gib", type=flags.finite_nonnegative, default=1.0)
  probe.add_argument("--backend", choices=("auto", "xla", "triton", "hopper"), default=None,
                     help="draft block backend (default: $DSPARK_JAX_BACKEND, else auto)")
  return parser


class _ShapeHead:
  """What a draft sampler reads of a vanilla head, as shapes: `probe` compiles from these alone."""

  kind, needs_hidden, hidden_size = "vanilla", False, None

  def __init__(self, vocab: int, rank: int, dtype):
    import jax
    self.vocab_size, self.rank = vocab, rank
    self._arrays = {"w1": jax.ShapeDtypeStruct((vocab, rank), dtype),
                    "w2": jax.ShapeDtypeStruct((rank, vocab), dtype)}

  def arrays(self) -> dict:
    return dict(self._arrays)


def probe(args) -> int:
  import jax

  from dspark_jax.draft import proposer as draft_sampler
  from dspark_jax.kernels import dispatch

  # The gate and the dispatch read shapes only: an abstract head, no weights allocated.
  head = _ShapeHead(args.vocab, args.rank, args.dtype)
  sampler = draft_sampler.build_draft_sampler(
      head, max_batch_size=args.max_batch_size, vocab_size=args.vocab, gamma=args.gamma,
      logits_dtype=args.dtype, mode=args.mode, headroom_bytes=int(args.headroom_gib * 2**30),
      backend=args.backend)
  device = jax.local_devices()[0]
  print(f"device: {device.device_kind} ({device.platform})")
  print(f"shapes: max_batch_size={args.max_batch_size} vocab={args.vocab} gamma={args.gamma} "
        f"dtype={args.dtype} rank={args.rank}")
  print(sampler.decision.summary())
  print("backend per variant and padding bucket:")
  for (variant, bucket), choice in sampler.backends.items():
    print(f"  {variant:8s} B={bucket:<5d} {choice.name:7s} {choice.reason}")
  print(dispatch.table())
  return 0


def generate(args) -> int:
  import jax
  import numpy as np

  from dspark_jax.sampling import params as sp
  from dspark_jax.text import generation

  if args.system is not None and not args.chat:
    flags.fail("generate", "--system", "needs --chat")
  target, draft, tokenizer, name = flags.load_models(args, "generate", need_draft=False)
  prompts = args.prompt
  if args.chat:
    head = [] if args.system is None else [{"role": "system", "content": args.system}]
    prompts = [head + [{"role": "user", "content": p}] for p in prompts]
  batch = len(prompts)
  if args.seed + batch > 2**32:
    flags.fail("generate", "--seed", f"prompt i takes seed {args.seed} + i, past 2**32 - 1")
  params = sp.SamplingParams(temperature=np.full(batch, args.temperature),
                             top_p=np.full(batch, args.top_p), top_k=np.full(batch, args.top_k),
                             seed=np.arange(batch) + args.seed)
  try:
    results = generation.generate_text(
        target, draft, tokenizer, prompts, params, jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens, stop=args.stop, chat=args.chat,
        chat_kwargs=args.chat_kwargs, spec=draft is not None)
  except ValueError as error:
    raise SystemExit(f"dspark-jax generate: error: {error}") from None
  for i, result in enumerate(results):
    if batch > 1:
      print(f"--- prompt {i + 1} ---")
    print(result.text)
    stop = f" {result.stop!r}" if result.stop is not None else ""
    rounds = f"; τ = {result.tau:.2f} over {result.rounds} rounds" if draft is not None else ""
    print(f"[finish: {result.finish_reason}{stop}; {len(result.token_ids)} tokens{rounds}]")
  batch_result = results[0].batch
  if draft is not None:
    acceptance = " ".join("–" if np.isnan(a) else f"{a:.2f}" for a in batch_result.acceptance)
    print(f"τ = {batch_result.tau:.2f} (accepted drafts + 1 per round; {name}); acceptance "
          f"k = 1..{len(batch_result.acceptance)}: {acceptance}")
  else:
    print(f"τ = 1 (autoregressive; {name})")
  print(f"{batch_result.tokens_per_second:.1f} tokens/s (compiled in "
        f"{batch_result.compile_seconds:.1f} s)")
  return 0


def evaluate(args) -> int:
  import json
  import os

  from dspark_jax.apps import evaluation

  flags.concurrency_alias(args, "eval")
  if args.schedule is not None:
    if args.kv != "contiguous":
      flags.fail("eval", "--kv", "the schedule comparison decodes through contiguous caches; "
                                 "drop --kv or --schedule")
    from dspark_jax.apps import schedule_commands
    return schedule_commands.evaluate_schedules(args)
  for flag, name in (("sps", "sps"), ("calibration", "calibration"),
                     ("throughput_batches", "throughput-concurrency")):
    if getattr(args, flag) is not None:
      flags.fail("eval", "--" + name, "needs --schedule")
  if args.num_pages is not None and args.kv != "paged":
    flags.fail("eval", "--num-pages", "needs --kv paged")
  results_file = args.out if args.out.endswith(".jsonl") else None
  if results_file is not None and args.dataset is None:
    flags.fail("eval", "--out", "a .jsonl results file needs --dataset")
  if args.target is None and args.dataset is None:
    import dataclasses

    from dspark_jax.formats import shipped
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        flags.fail("eval", f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      flags.fail("eval", "--chat", "needs --dataset (the shipped study reads held-out code)")
    pair = shipped.load_shipped()
    if args.first_prompt:
      if args.first_prompt >= len(pair.prompts):
        flags.fail("eval", "--first-prompt", f"{args.first_prompt}: the shipped pair has "
                                             f"{len(pair.prompts)} held-out prompts")
      pair = dataclasses.replace(pair, prompts=pair.prompts[args.first_prompt:])
    temperatures = args.temperatures or [0.0, 1.0]
    max_new_tokens = args.max_new_tokens or 128
    count = len(pair.prompts[:args.prompts] if args.prompts else pair.prompts)
    concurrency = args.concurrency or count
    rows = evaluation.acceptance_study(pair, num_prompts=args.prompts,
                                       max_new_tokens=max_new_tokens,
                                       temperatures=temperatures, concurrency=concurrency,
                                       seed=args.seed, progress=not args.json, kv=args.kv,
                                       num_pages=args.num_pages)
    about = {"first_prompt": args.first_prompt, "concurrency": concurrency, "kv": args.kv}
    if not args.json:
      print(f"shipped pair: {count} held-out prompts, concurrency {concurrency}, "
            f"max {max_new_tokens} new tokens")
  else:
    if args.dataset is None:
      flags.fail("eval", "--dataset", "required with --target")
    first = args.first_prompt
    try:
      prompts = evaluation.read_eval_dataset(
          args.dataset, first + args.prompts if args.prompts else None)[first:]
    except ValueError as error:
      flags.fail("eval", "--dataset", str(error))
    if not prompts:
      flags.fail("eval", "--first-prompt", f"{first}: {args.dataset} has no prompts from there")
    target, draft, tokenizer, name = flags.load_models(args, "eval", need_draft=True)
    temperatures = args.temperatures or [1.0]
    max_new_tokens = args.max_new_tokens or 2048
    concurrency = args.concurrency or 1
    try:
      rows = evaluation.evaluate_pair(
          target, draft, tokenizer, prompts, temperatures=temperatures,
          max_new_tokens=max_new_tokens, concurrency=concurrency, chat=args.chat,
          chat_kwargs=args.chat_kwargs, seed=args.seed, baseline=args.baseline,
          name=os.path.basename(os.path.normpath(args.draft)) if args.draft else "dspark",
          progress=not args.json, results=results_file, kv=args.kv, num_pages=args.num_pages)
    except (ValueError, RuntimeError) as error:  # RuntimeError: out of device memory
      raise SystemExit(f"dspark-jax eval: error: {error}") from None
    count = len(prompts)
    about = {"target": args.target, "draft": args.draft, "dataset": args.dataset,
             "first_prompt": first, "concurrency": concurrency, "kv": args.kv, "chat": args.chat,
             "seed": args.seed, "results": results_file}
    if not args.json:
      print(f"{name} on {args.dataset}: {count} prompts, concurrency {concurrency}, "
            f"max {max_new_tokens} new tokens")
  if results_file is None:
    os.makedirs(args.out, exist_ok=True)
    png_path = os.path.join(args.out, "acceptance.png")
    json_path = os.path.join(args.out, "acceptance.json")
  else:
    stem = results_file[:-len(".jsonl")]
    png_path, json_path = stem + ".png", stem + ".json"
  png = evaluation.plot_acceptance(rows, png_path)
  document = {**about, "prompts": count, "max_new_tokens": max_new_tokens,
              "rows": [row.as_dict() for row in rows]}
  with open(json_path, "w") as f:
    json.dump(document, f, indent=2)
  if args.json:
    print(json.dumps(document, indent=2))
    return 0
  print(evaluation.format_table(rows))
  for row in rows:
    lo, hi = row.tau_interval
    print(f"T = {row.temperature:g}: τ = {row.tau:.2f} [95 %: {lo:.2f}, {hi:.2f}]; "
          f"{row.tokens_per_second:.1f} tokens/s")
  print(f"plot: {png}; data: {json_path}")
  return 0


def main(argv=None) -> int:
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
  args = _parser().parse_args(argv)
  if args.command is None:
    args = _parser().parse_args(["demo"])
  if args.command == "probe":
    return probe(args)
  if args.command == "eval":
    return evaluate(args)
  if args.command == "calibrate":
    from dspark_jax.apps import schedule_commands
    return schedule_commands.calibrate(args)
  if args.command == "generate":
    return generate(args)
  if args.command == "train":
    return train_commands.train(args)
  if args.command == "regenerate":
    return train_commands.regenerate(args)
  if args.command == "sampler-demo":
    from dspark_jax.apps import sampler_demo
    return sampler_demo.run(args)
  from dspark_jax.apps import demo
  return demo.run(args)


if __name__ == "__main__":
  sys.exit(main())
