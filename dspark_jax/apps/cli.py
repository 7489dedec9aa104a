"""The ``dspark-jax`` command line: ``demo`` (the default), ``generate``, ``eval``, ``calibrate``,
``sampler-demo``, ``probe``.

* ``dspark-jax demo``: the shipped trained pair decoding held-out prompts (`dspark_jax.apps.demo`).
* ``dspark-jax generate --target DIR [--draft DIR] --prompt TEXT [--chat] [--temperature T --top-p P
  --top-k K --max-new-tokens N --seed S --stop STR ...]``: completes the prompt (repeat ``--prompt``
  for a batch) with a Hugging Face Qwen3 target and a DeepSpec DSpark drafter
  (`dspark_jax.load_pretrained`) and the target directory's tokenizer (or ``--tokenizer DIR``),
  and prints each completion, its finish reason, τ and tokens/s. Without ``--draft`` it decodes
  autoregressively; without ``--target`` it uses the shipped pair and its tokenizer.
* ``dspark-jax eval``: without ``--target`` and ``--dataset``, the shipped pair's acceptance study,
  DSpark drafter vs parallel ablation at T = 0 and 1. With ``--target DIR --draft DIR --dataset
  FILE.jsonl`` (DeepSpec's eval format; the first turn is the prompt; ``--chat`` applies the chat
  template), the pair's τ with its 95 % interval, per-position acceptance with Wilson intervals and
  tokens/s at each ``--temperature`` (default 1, ``--max-new-tokens`` 2048, ``--batch-size`` 1: the
  paper's Table 1 protocol). ``--dataset`` alone evaluates the shipped pair on it. Each writes a
  table, a PNG plot and a JSON file (`dspark_jax.apps.evaluation`).
  With ``--schedule fixed,threshold:0.5,prefix,top_k[:lag]`` (either pair), the schedule study
  instead (`dspark_jax.apps.schedule_study`): per schedule and temperature, τ with its interval,
  verify tokens per round, acceptance rate (accepted / verified drafts), per-position acceptance
  and tokens/s, decoded ``--batch-size`` rows at a time (default 8). ``prefix``/``top_k`` read
  ``--sps FILE.json`` (`schedules.save_sps`), else a table measured now by ``profile_sps`` on the
  current device (saved in ``--out``). ``--calibration FILE.json`` (from ``calibrate``) sets the
  draft's confidence temperatures first; ``--throughput-batches 1,16,64`` adds tokens/s per batch
  size and its plot. ``--json`` prints the JSON document instead of the table.
* ``dspark-jax calibrate --out FILE.json [--target DIR --draft DIR --dataset FILE]``: decodes a
  calibration set (the shipped pair: held-out prompts from ``--first-prompt``, default 42, the
  second half) with the fixed schedule and ``trace=True``, fits the confidence head's STS
  temperatures, prints ECE and AUC per position before/after, writes the temperatures (JSON) and a
  reliability diagram; ``--save-draft DIR`` writes a pretrained draft with them
  (``confidence_temperatures`` in its DeepSpec config).
* ``dspark-jax sampler-demo``: the draft sampler alone on random weights (`dspark_jax.apps.sampler_demo`).
* ``dspark-jax probe --max-batch-size N --vocab V --gamma G --dtype bf16``: builds a draft sampler of
  those shapes on the current device and prints the memory gate's decision, the backend of every
  variant and padding bucket, and the dispatch table (`dspark_jax.kernels.dispatch`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
          "fp16": "float16", "f32": "float32", "float32": "float32", "fp32": "float32"}


def _dtype(name: str) -> str:
  try:
    return DTYPES[name.lower()]
  except KeyError:
    raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _nonnegative(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _finite_nonnegative(text: str) -> float:
  value = float(text)
  if not math.isfinite(value) or value < 0:
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
  return value


def _temperatures(text: str) -> list[float]:
  try:
    values = [float(t) for t in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
  bad = [t for t in values if not math.isfinite(t) or t < 0]
  if bad:
    raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {bad[0]}")
  return values


def _probability(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
  return value


def _seed(text: str) -> int:
  value = int(text)
  if not 0 <= value < 2**32:
    raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {value}")
  return value


def _nonempty(text: str) -> str:
  if not text:
    raise argparse.ArgumentTypeError("must not be empty")
  return text


def _stop_string(text: str) -> str:
  """A stop string with backslash escapes read (``\\n`` is a newline); non-ASCII kept as is."""
  try:
    text = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
  except UnicodeDecodeError as error:
    raise argparse.ArgumentTypeError(f"bad escape in {text!r} ({error.reason})") from None
  return _nonempty(text)


def _schedules(text: str) -> list:
  from dspark_jax.apps import schedule_study
  try:
    return schedule_study.parse_schedules(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(str(error)) from None


def _batch_sizes(text: str) -> list[int]:
  try:
    values = [int(b) for b in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  bad = [b for b in values if b < 1]
  if bad:
    raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {bad[0]}")
  return values


def _json_object(text: str) -> dict:
  import json
  try:
    value = json.loads(text)
  except json.JSONDecodeError as error:
    raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
  return value


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--target", default=None,
                      help="Hugging Face Qwen3 directory (default: the shipped pair)")
  parser.add_argument("--draft", default=None, help="DeepSpec DSpark drafter directory")
  parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
  parser.add_argument("--dtype", type=_dtype, default=None,
                      help="compute and storage dtype (default: the checkpoint's)")
  parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
  parser.add_argument("--chat-kwargs", type=_json_object, default=None,
                      help='template variables as JSON, e.g. \'{"enable_thinking": false}\'')


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="dspark-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command")

  demo = sub.add_parser("demo", help="decode held-out prompts with the shipped trained pair")
  demo.add_argument("--prompts", type=_positive, default=3)
  demo.add_argument("--first-prompt", type=_nonnegative, default=0)
  demo.add_argument("--max-new-tokens", type=_positive, default=64)
  demo.add_argument("--temperature", type=float, default=0.0)
  demo.add_argument("--seed", type=int, default=0)

  generate = sub.add_parser("generate", help="complete prompts with a pretrained pair")
  _add_model_flags(generate)
  generate.add_argument("--prompt", action="append", required=True, type=_nonempty,
                        help="the prompt (repeat for a batch)")
  generate.add_argument("--system", default=None, help="with --chat: a system message first")
  generate.add_argument("--temperature", type=_finite_nonnegative, default=0.0)
  generate.add_argument("--top-p", type=_probability, default=1.0)
  generate.add_argument("--top-k", type=_nonnegative, default=0, help="0: no top-k")
  generate.add_argument("--max-new-tokens", type=_positive, default=128)
  generate.add_argument("--seed", type=_seed, default=0)
  generate.add_argument("--stop", action="append", default=[], type=_stop_string,
                        help="a stop string (repeatable; backslash escapes such as \\n are read)")

  evaluate = sub.add_parser("eval", help="acceptance: the shipped study, or a pair on a dataset")
  _add_model_flags(evaluate)
  evaluate.add_argument("--dataset", default=None,
                        help="DeepSpec eval file (.jsonl, one {\"turns\": [...]} per line)")
  evaluate.add_argument("--prompts", "--num-prompts", dest="prompts", type=_positive, default=None,
                        help="number of prompts (default: all)")
  evaluate.add_argument("--first-prompt", type=_nonnegative, default=0,
                        help="skip the first N prompts (e.g. those calibrate used)")
  evaluate.add_argument("--batch-size", type=_positive, default=None,
                        help="rows per decode (default: 1; 8 with --schedule)")
  evaluate.add_argument("--max-new-tokens", type=_positive, default=None,
                        help="default: 128 for the shipped study, 2048 for a dataset")
  evaluate.add_argument("--temperatures", "--temperature", dest="temperatures",
                        type=_temperatures, default=None,
                        help="comma-separated, e.g. 0,1 (default: 0,1 for the shipped study, 1 for "
                             "a dataset)")
  evaluate.add_argument("--baseline", action="store_true",
                        help="with --dataset: also decode autoregressively for the plain tokens/s")
  evaluate.add_argument("--seed", type=_seed, default=0)
  evaluate.add_argument("--out", default="dspark_eval", help="directory for the PNG and JSON")
  evaluate.add_argument("--schedule", type=_schedules, default=None,
                        help="compare verify schedules: fixed,threshold:T,prefix,top_k[:LAG]")
  evaluate.add_argument("--sps", default=None,
                        help="with --schedule: throughput table JSON for prefix/top_k (default: "
                             "measured now with profile_sps)")
  evaluate.add_argument("--calibration", default=None,
                        help="with --schedule: temperatures JSON from calibrate, set on the draft")
  evaluate.add_argument("--throughput-batches", type=_batch_sizes, default=None,
                        help="with --schedule: also tokens/s at these batch sizes, e.g. 1,16,64")
  evaluate.add_argument("--json", action="store_true",
                        help="print the JSON document instead of the table")

  calibrate = sub.add_parser("calibrate", help="fit the confidence head's STS temperatures")
  _add_model_flags(calibrate)
  calibrate.add_argument("--dataset", default=None,
                         help="DeepSpec eval file (.jsonl) of calibration prompts")
  calibrate.add_argument("--prompts", "--num-prompts", dest="prompts", type=_positive,
                         default=None, help="number of prompts (default: all from --first-prompt)")
  calibrate.add_argument("--first-prompt", type=_nonnegative, default=None,
                         help="skip the first N prompts (default: 42 for the shipped pair, else 0)")
  calibrate.add_argument("--batch-size", type=_positive, default=8)
  calibrate.add_argument("--max-new-tokens", type=_positive, default=None,
                         help="default: 128 for the shipped pair, 512 for a dataset")
  calibrate.add_argument("--temperatures", "--temperature", dest="temperatures",
                         type=_temperatures, default=None,
                         help="sampling temperatures pooled (default: 0,1 for the shipped pair, "
                              "1 for a dataset)")
  calibrate.add_argument("--bins", type=_positive, default=15, help="ECE bins")
  calibrate.add_argument("--seed", type=_seed, default=0)
  calibrate.add_argument("--out", required=True, help="the temperatures JSON to write")
  calibrate.add_argument("--plot", default=None,
                         help="reliability diagram PNG (default: beside --out)")
  calibrate.add_argument("--save-draft", default=None,
                         help="with --target/--draft: write the calibrated draft there")
  calibrate.add_argument("--json", action="store_true",
                         help="print the JSON document instead of the table")

  sampler = sub.add_parser("sampler-demo", help="propose a mixed batch on every path (random weights)")
  sampler.add_argument("--batch-size", type=_positive, default=8)
  sampler.add_argument("--vocab", type=_positive, default=32768)
  sampler.add_argument("--gamma", type=_positive, default=7)
  sampler.add_argument("--rank", type=_positive, default=256)
  sampler.add_argument("--hidden", type=_positive, default=512)
  sampler.add_argument("--head", choices=("vanilla", "gated", "rnn"), default="vanilla")
  sampler.add_argument("--dtype", type=_dtype, default=None,
                    help="logits/weights dtype (default: bf16 on GPU, f32 on CPU, which lacks bf16 math)")
  sampler.add_argument("--repeats", type=_positive, default=20)
  sampler.add_argument("--mode", choices=("off", "auto", "force"), default=None,
                    help="folded sampling mode (default: $DSPARK_JAX_FOLDED_SAMPLING, else auto)")

  probe = sub.add_parser("probe", help="print the memory gate's decision for the current device")
  probe.add_argument("--max-batch-size", type=_positive, required=True)
  probe.add_argument("--vocab", type=_positive, required=True)
  probe.add_argument("--gamma", type=_positive, required=True)
  probe.add_argument("--dtype", type=_dtype, default="bfloat16")
  probe.add_argument("--rank", type=_positive, default=256)
  probe.add_argument("--mode", choices=("off", "auto", "force"), default=None)
  probe.add_argument("--headroom-gib", type=_finite_nonnegative, default=1.0)
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


def _fail(command: str, flag: str, message: str):
  raise SystemExit(f"dspark-jax {command}: error: argument {flag}: {message}")


def _load(args, command: str, *, need_draft: bool):
  """(target, draft or None, tokenizer, description) from the model flags; exits naming the flag."""
  import os

  from dspark_jax.models import shipped
  from dspark_jax.text import load_tokenizer

  if args.chat_kwargs is not None and not args.chat:
    _fail(command, "--chat-kwargs", "needs --chat")
  if args.target is None:
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        _fail(command, f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      _fail(command, "--chat", "the shipped tokenizer has no chat template (its models continue "
                               "Python code)")
    pair = shipped.load_shipped()
    return pair.target, pair.draft, pair.tokenizer, "shipped pair"
  if need_draft and args.draft is None:
    _fail(command, "--draft", "required with --target")
  for flag in ("target", "draft", "tokenizer"):
    path = getattr(args, flag)
    if path is not None and not os.path.isdir(path):
      _fail(command, f"--{flag}", f"{path} is not a directory")
  import jax.numpy as jnp

  import dspark_jax

  tokenizer_flag = "--tokenizer" if args.tokenizer is not None else "--target"
  try:  # the tokenizer first: its errors come before the weights are read
    tokenizer = load_tokenizer(args.tokenizer or args.target)
  except ValueError as error:
    _fail(command, tokenizer_flag, str(error))
  if args.chat and tokenizer.chat_template is None:
    _fail(command, "--chat", f"the tokenizer of {args.tokenizer or args.target} has no chat "
                             "template")
  try:
    target, draft = dspark_jax.load_pretrained(
        args.target, args.draft, dtype=None if args.dtype is None else jnp.dtype(args.dtype))
  except (ValueError, OSError) as error:
    draft_error = args.draft is not None and (args.draft in str(error)
                                              or os.path.abspath(args.draft) in str(error))
    _fail(command, "--draft" if draft_error else "--target", str(error))
  return target, draft, tokenizer, f"{args.target} + {args.draft or 'no drafter'}"


def generate(args) -> int:
  import jax
  import numpy as np

  from dspark_jax.sampling import params as sp
  from dspark_jax.text import generation

  if args.system is not None and not args.chat:
    _fail("generate", "--system", "needs --chat")
  target, draft, tokenizer, name = _load(args, "generate", need_draft=False)
  prompts = args.prompt
  if args.chat:
    head = [] if args.system is None else [{"role": "system", "content": args.system}]
    prompts = [head + [{"role": "user", "content": p}] for p in prompts]
  batch = len(prompts)
  if args.seed + batch > 2**32:
    _fail("generate", "--seed", f"prompt i takes seed {args.seed} + i, past 2**32 - 1")
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


def _pair_and_prompts(args, command: str, *, first: int):
  """(target, draft, prompt ids, stop ids, name, about) for the schedule study and calibrate: the
  shipped pair's held-out prompts without ``--target``/``--dataset``, else the dataset's prompts
  (``--prompts`` of them from ``--first-prompt``); exits naming the flag."""
  from dspark_jax.apps import evaluation

  if args.target is None and args.dataset is None:
    from dspark_jax.models import shipped
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        _fail(command, f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      _fail(command, "--chat", "needs --dataset (the shipped prompts are held-out code)")
    if args.chat_kwargs is not None:
      _fail(command, "--chat-kwargs", "needs --chat")
    pair = shipped.load_shipped()
    texts = pair.prompts[first:first + args.prompts if args.prompts else None]
    if not texts:
      _fail(command, "--first-prompt", f"{first}: the shipped pair has {len(pair.prompts)} "
                                       "held-out prompts")
    ids = [pair.encode(t) for t in texts]
    about = {"prompts_from": "shipped held-out", "first_prompt": first, "prompts": len(ids)}
    return pair.target, pair.draft, ids, list(pair.tokenizer.stop_token_ids), "shipped pair", about
  if args.dataset is None:
    _fail(command, "--dataset", "required with --target")
  try:
    texts = evaluation.read_eval_dataset(args.dataset, first + args.prompts if args.prompts
                                         else None)[first:]
  except ValueError as error:
    _fail(command, "--dataset", str(error))
  if not texts:
    _fail(command, "--first-prompt", f"{first}: {args.dataset} has no prompts from there")
  target, draft, tokenizer, name = _load(args, command, need_draft=True)
  from dspark_jax.text import generation
  try:
    ids = generation.encode_prompts(tokenizer, texts, chat=args.chat, chat_kwargs=args.chat_kwargs)
  except ValueError as error:
    _fail(command, "--dataset", str(error))
  stop_ids = [i for i in tokenizer.stop_token_ids if i < target.config.vocab_size]
  about = {"target": args.target, "draft": args.draft, "dataset": args.dataset,
           "first_prompt": first, "prompts": len(ids), "chat": args.chat}
  return target, draft, ids, stop_ids, name, about


def _device() -> str:
  import jax
  device = jax.devices()[0]
  kind = device.device_kind
  return device.platform if kind.lower() == device.platform else f"{device.platform}: {kind}"


def _evaluate_schedules(args) -> int:
  """``eval --schedule``: the schedule study (module docstring)."""
  import json
  import os

  import numpy as np

  from dspark_jax.apps import schedule_study
  from dspark_jax.scheduling import schedules

  specs = args.schedule
  needs_sps = [s.label for s in specs if s.needs_sps]
  sps, sps_about = None, None
  if args.sps is not None:
    if not needs_sps:
      _fail("eval", "--sps", "no schedule in --schedule reads a table (prefix and top_k do)")
    if not os.path.isfile(args.sps):
      _fail("eval", "--sps", f"{args.sps}: no such file")
    try:
      sps = schedules.load_sps(args.sps)
      with open(args.sps, encoding="utf-8") as f:
        meta = json.load(f)
    except (ValueError, OSError) as error:
      _fail("eval", "--sps", str(error))
    sps_about = {"source": args.sps, "device": meta.get("device"), "date": meta.get("date")}
  temperatures_file = None
  if args.calibration is not None:
    try:
      temperatures_file = schedule_study.load_temperatures(args.calibration)
    except ValueError as error:
      _fail("eval", "--calibration", str(error))
  held_out = args.dataset is None
  target, draft, ids, stop_ids, name, about = _pair_and_prompts(args, "eval", first=args.first_prompt)
  reads_confidence = [s.label for s in specs if s.kind != "fixed"]
  if reads_confidence and draft.confidence is None:
    _fail("eval", "--draft", f"has no confidence head, which {', '.join(reads_confidence)} read")
  if temperatures_file is not None:
    try:
      draft = schedule_study.with_temperatures(draft, temperatures_file)
    except ValueError as error:
      _fail("eval", "--calibration", str(error))
  batch_size = args.batch_size or 8
  temperatures = args.temperatures or ([0.0, 1.0] if held_out else [1.0])
  max_new_tokens = args.max_new_tokens or (128 if held_out else 2048)
  os.makedirs(args.out, exist_ok=True)
  gamma = draft.config.gamma
  largest = max([batch_size] + list(args.throughput_batches or []))
  if needs_sps and sps is None:
    context = int(round(np.mean([len(p) for p in ids]) + max_new_tokens / 2))
    path = os.path.join(args.out, "sps.json")
    print(f"measuring the throughput table on {_device()} (profile_sps, context {context}, up to "
          f"{largest} rows of {gamma + 1} tokens) ...", file=sys.stderr)
    profile = schedule_study.measure_sps(target, draft, max_batch=largest, context=context,
                                         path=path)
    sps = schedules.dense_sps(profile.batch_tokens, profile.steps_per_second)
    sps_about = {"source": "measured now with profile_sps", "path": path,
                 "device": profile.device, "date": profile.date, "context": context}
  notes = []
  if sps is not None and len(sps) - 1 < largest * (gamma + 1):
    notes.append(f"the throughput table ends at {len(sps) - 1} batch tokens, below {largest} rows "
                 f"x {gamma + 1}: prefix/top_k admit nothing past it")
  notes += [f"{s.label} is the anticipating search: NOT lossless (shown for comparison)"
            for s in specs if not s.lossless]
  notes.append("the verify forward keeps its static [B, γ + 1] shape, so a shorter verify length "
               "saves no compute here (that needs a packed verify batch): tokens/s cannot show a "
               "schedule's savings")
  try:
    rows = schedule_study.compare_schedules(
        target, draft, ids, specs, sps=sps, temperatures=temperatures, batch_size=batch_size,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=args.seed,
        progress=not args.json)
    throughput = []
    if args.throughput_batches:
      throughput = schedule_study.throughput_sweep(
          target, draft, ids, specs, args.throughput_batches, sps=sps,
          temperature=temperatures[0], max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
          seed=args.seed, progress=not args.json)
  except ValueError as error:
    raise SystemExit(f"dspark-jax eval: error: {error}") from None
  document = {"pair": name, **about, "device": _device(), "batch_size": batch_size,
              "max_new_tokens": max_new_tokens, "temperatures": temperatures, "seed": args.seed,
              "schedules": [s.label for s in specs], "sps": sps_about,
              "calibration": None if args.calibration is None else {
                  "path": args.calibration, "temperatures": temperatures_file.tolist()},
              "notes": notes, "rows": [row.as_dict() for row in rows],
              "throughput": [row.as_dict() for row in throughput]}
  data = os.path.join(args.out, "schedules.json")
  plot = None
  if throughput:
    plot = schedule_study.plot_throughput(throughput, os.path.join(args.out, "throughput.png"),
                                          sps=sps)
    document["throughput_plot"] = plot
  with open(data, "w") as f:
    json.dump(document, f, indent=1)
  if args.json:
    print(json.dumps(document, indent=1))
    return 0
  print(f"{name}: {len(ids)} prompts, batch size {batch_size}, max {max_new_tokens} new tokens, "
        f"on {_device()}")
  if sps_about is not None:
    print(f"throughput table: {sps_about['source']} (device {sps_about['device']}, "
          f"{sps_about['date']})")
  if args.calibration is not None:
    print(f"confidence temperatures from {args.calibration}: "
          + " ".join(f"{t:.3g}" for t in temperatures_file))
  print(schedule_study.format_schedule_table(rows))
  if throughput:
    print(f"tokens/s by batch size (T = {temperatures[0]:g}):")
    print(schedule_study.format_schedule_table(throughput))
  for note in notes:
    print(f"note: {note}")
  print(f"data: {data}" + (f"; plot: {plot}" if plot else ""))
  return 0


def evaluate(args) -> int:
  import json
  import os

  from dspark_jax.apps import evaluation

  if args.schedule is not None:
    return _evaluate_schedules(args)
  for flag in ("sps", "calibration", "throughput_batches"):
    if getattr(args, flag) is not None:
      _fail("eval", "--" + flag.replace("_", "-"), "needs --schedule")
  if args.target is None and args.dataset is None:
    import dataclasses

    from dspark_jax.models import shipped
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        _fail("eval", f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      _fail("eval", "--chat", "needs --dataset (the shipped study reads held-out code)")
    pair = shipped.load_shipped()
    if args.first_prompt:
      if args.first_prompt >= len(pair.prompts):
        _fail("eval", "--first-prompt", f"{args.first_prompt}: the shipped pair has "
                                        f"{len(pair.prompts)} held-out prompts")
      pair = dataclasses.replace(pair, prompts=pair.prompts[args.first_prompt:])
    temperatures = args.temperatures or [0.0, 1.0]
    max_new_tokens = args.max_new_tokens or 128
    rows = evaluation.acceptance_study(pair, num_prompts=args.prompts,
                                       max_new_tokens=max_new_tokens,
                                       temperatures=temperatures, seed=args.seed,
                                       progress=not args.json)
    count = len(pair.prompts[:args.prompts] if args.prompts else pair.prompts)
    about = {"first_prompt": args.first_prompt}
  else:
    if args.dataset is None:
      _fail("eval", "--dataset", "required with --target")
    first = args.first_prompt
    try:
      prompts = evaluation.read_eval_dataset(
          args.dataset, first + args.prompts if args.prompts else None)[first:]
    except ValueError as error:
      _fail("eval", "--dataset", str(error))
    if not prompts:
      _fail("eval", "--first-prompt", f"{first}: {args.dataset} has no prompts from there")
    target, draft, tokenizer, name = _load(args, "eval", need_draft=True)
    temperatures = args.temperatures or [1.0]
    max_new_tokens = args.max_new_tokens or 2048
    batch_size = args.batch_size or 1
    try:
      rows = evaluation.evaluate_pair(
          target, draft, tokenizer, prompts, temperatures=temperatures,
          max_new_tokens=max_new_tokens, batch_size=batch_size, chat=args.chat,
          chat_kwargs=args.chat_kwargs, seed=args.seed, baseline=args.baseline,
          name=os.path.basename(os.path.normpath(args.draft)) if args.draft else "dspark",
          progress=not args.json)
    except ValueError as error:
      raise SystemExit(f"dspark-jax eval: error: {error}") from None
    count = len(prompts)
    about = {"target": args.target, "draft": args.draft, "dataset": args.dataset,
             "first_prompt": first, "batch_size": batch_size, "chat": args.chat,
             "seed": args.seed}
    if not args.json:
      print(f"{name} on {args.dataset}: {count} prompts, batch size {batch_size}, "
            f"max {max_new_tokens} new tokens")
  os.makedirs(args.out, exist_ok=True)
  png = evaluation.plot_acceptance(rows, os.path.join(args.out, "acceptance.png"))
  document = {**about, "prompts": count, "max_new_tokens": max_new_tokens,
              "rows": [row.as_dict() for row in rows]}
  with open(os.path.join(args.out, "acceptance.json"), "w") as f:
    json.dump(document, f, indent=2)
  if args.json:
    print(json.dumps(document, indent=2))
    return 0
  print(evaluation.format_table(rows))
  for row in rows:
    lo, hi = row.tau_interval
    print(f"T = {row.temperature:g}: τ = {row.tau:.2f} [95 %: {lo:.2f}, {hi:.2f}]; "
          f"{row.tokens_per_second:.1f} tokens/s")
  print(f"plot: {png}; data: {os.path.join(args.out, 'acceptance.json')}")
  return 0


def calibrate(args) -> int:
  """``calibrate``: STS temperatures of the draft's confidence head (module docstring)."""
  import json
  import os

  from dspark_jax.apps import schedule_study

  if args.save_draft is not None and args.target is None:
    _fail("calibrate", "--save-draft", "needs --target and --draft (the shipped pair is read from "
                                       "the package: pass --out's file to eval --calibration)")
  folder = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(folder):
    _fail("calibrate", "--out", f"{folder} is not a directory")
  held_out = args.dataset is None
  first = args.first_prompt if args.first_prompt is not None else (42 if held_out else 0)
  target, draft, ids, stop_ids, name, about = _pair_and_prompts(args, "calibrate", first=first)
  if draft.confidence is None:
    _fail("calibrate", "--draft", "has no confidence head (nothing to calibrate)")
  previous = draft.confidence.temperatures
  temperatures = args.temperatures or ([0.0, 1.0] if held_out else [1.0])
  max_new_tokens = args.max_new_tokens or (128 if held_out else 512)
  try:
    result = schedule_study.calibrate(
        target, draft, ids, temperatures=temperatures, batch_size=args.batch_size,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=args.seed, bins=args.bins)
  except ValueError as error:
    raise SystemExit(f"dspark-jax calibrate: error: {error}") from None
  meta = {"pair": name, **about, "device": _device(), "sampling_temperatures": temperatures,
          "max_new_tokens": max_new_tokens, "batch_size": args.batch_size, "seed": args.seed,
          "grid": "41 log-spaced temperatures in [0.1, 10] (calibration.DEFAULT_GRID)",
          "replaced_temperatures": None if previous is None else
          [float(t) for t in previous[...].tolist()]}
  schedule_study.save_calibration(args.out, result, meta)
  plot = schedule_study.plot_reliability(
      result, args.plot or os.path.splitext(args.out)[0] + "_reliability.png")
  saved = None
  if args.save_draft is not None:
    import dspark_jax
    try:
      dspark_jax.save_pretrained(schedule_study.with_temperatures(draft, result.temperatures),
                                 args.save_draft, target=target)
    except (ValueError, OSError) as error:
      _fail("calibrate", "--save-draft", str(error))
    saved = args.save_draft
  if args.json:
    print(json.dumps({**result.as_dict(), **meta, "plot": plot, "saved_draft": saved}, indent=1))
    return 0
  print(f"{name}: {len(ids)} calibration prompts from {first}, T = "
        f"{','.join(f'{t:g}' for t in temperatures)}, max {max_new_tokens} new tokens; "
        f"{result.rounds} rounds verified every position")
  if previous is not None:
    print("the draft's own temperatures were set aside: the fit starts from the raw head")
  print(schedule_study.format_calibration_table(result))
  print(f"temperatures: {args.out}; reliability diagram: {plot}"
        + (f"; calibrated draft: {saved}" if saved else ""))
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
    return calibrate(args)
  if args.command == "generate":
    return generate(args)
  if args.command == "sampler-demo":
    from dspark_jax.apps import sampler_demo
    return sampler_demo.run(args)
  from dspark_jax.apps import demo
  return demo.run(args)


if __name__ == "__main__":
  sys.exit(main())
