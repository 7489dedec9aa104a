"""The ``dspark-jax`` command line: ``demo`` (the default), ``generate``, ``eval``, ``sampler-demo``,
``probe``.

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
  evaluate.add_argument("--batch-size", type=_positive, default=1)
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


def evaluate(args) -> int:
  import json
  import os

  from dspark_jax.apps import evaluation

  if args.target is None and args.dataset is None:
    from dspark_jax.models import shipped
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        _fail("eval", f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      _fail("eval", "--chat", "needs --dataset (the shipped study reads held-out code)")
    pair = shipped.load_shipped()
    temperatures = args.temperatures or [0.0, 1.0]
    max_new_tokens = args.max_new_tokens or 128
    rows = evaluation.acceptance_study(pair, num_prompts=args.prompts,
                                       max_new_tokens=max_new_tokens,
                                       temperatures=temperatures, seed=args.seed)
    count = args.prompts or len(pair.prompts)
    about = {}
  else:
    if args.dataset is None:
      _fail("eval", "--dataset", "required with --target")
    try:
      prompts = evaluation.read_eval_dataset(args.dataset, args.prompts)
    except ValueError as error:
      _fail("eval", "--dataset", str(error))
    target, draft, tokenizer, name = _load(args, "eval", need_draft=True)
    temperatures = args.temperatures or [1.0]
    max_new_tokens = args.max_new_tokens or 2048
    try:
      rows = evaluation.evaluate_pair(
          target, draft, tokenizer, prompts, temperatures=temperatures,
          max_new_tokens=max_new_tokens, batch_size=args.batch_size, chat=args.chat,
          chat_kwargs=args.chat_kwargs, seed=args.seed, baseline=args.baseline,
          name=os.path.basename(os.path.normpath(args.draft)) if args.draft else "dspark")
    except ValueError as error:
      raise SystemExit(f"dspark-jax eval: error: {error}") from None
    count = len(prompts)
    about = {"target": args.target, "draft": args.draft, "dataset": args.dataset,
             "batch_size": args.batch_size, "chat": args.chat, "seed": args.seed}
    print(f"{name} on {args.dataset}: {count} prompts, batch size {args.batch_size}, "
          f"max {max_new_tokens} new tokens")
  os.makedirs(args.out, exist_ok=True)
  png = evaluation.plot_acceptance(rows, os.path.join(args.out, "acceptance.png"))
  with open(os.path.join(args.out, "acceptance.json"), "w") as f:
    json.dump({**about, "prompts": count, "max_new_tokens": max_new_tokens,
               "rows": [row.as_dict() for row in rows]}, f, indent=2)
  print(evaluation.format_table(rows))
  for row in rows:
    lo, hi = row.tau_interval
    print(f"T = {row.temperature:g}: τ = {row.tau:.2f} [95 %: {lo:.2f}, {hi:.2f}]; "
          f"{row.tokens_per_second:.1f} tokens/s")
  print(f"plot: {png}; data: {os.path.join(args.out, 'acceptance.json')}")
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
  if args.command == "generate":
    return generate(args)
  if args.command == "sampler-demo":
    from dspark_jax.apps import sampler_demo
    return sampler_demo.run(args)
  from dspark_jax.apps import demo
  return demo.run(args)


if __name__ == "__main__":
  sys.exit(main())
