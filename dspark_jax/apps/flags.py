"""What the ``dspark-jax`` subcommands share about their flags.

* Value types for argparse (``type=``): `dtype` (a name in `DTYPES`), `positive`, `nonnegative`,
  `finite_nonnegative`, `probability`, `seed`, `temperatures` and `batch_sizes` (comma-separated),
  `nonempty`, `stop_string` (backslash escapes read), `schedules`
  (`dspark_jax.apps.schedule_specs.parse_schedules`) and `json_object`. Each raises
  `argparse.ArgumentTypeError` with the reason for a value it refuses.
* The model flags: `add_model_flags` adds ``--target --draft --tokenizer --dtype --chat
  --chat-kwargs`` to a subcommand and `load_models` loads what they name (the shipped pair without
  ``--target``).
* `fail`: the error exit of a flag that parsed but cannot be used, worded as argparse words its own.
* `concurrency_alias`: ``--batch-size``, the deprecated alias of ``--concurrency``, read into it.
"""

from __future__ import annotations

import argparse
import math

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
          "fp16": "float16", "f32": "float32", "float32": "float32", "fp32": "float32"}


def dtype(name: str) -> str:
  try:
    return DTYPES[name.lower()]
  except KeyError:
    raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")


def positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def nonnegative(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def finite_nonnegative(text: str) -> float:
  value = float(text)
  if not math.isfinite(value) or value < 0:
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
  return value


def temperatures(text: str) -> list[float]:
  try:
    values = [float(t) for t in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
  bad = [t for t in values if not math.isfinite(t) or t < 0]
  if bad:
    raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {bad[0]}")
  return values


def probability(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
  return value


def seed(text: str) -> int:
  value = int(text)
  if not 0 <= value < 2**32:
    raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {value}")
  return value


def nonempty(text: str) -> str:
  if not text:
    raise argparse.ArgumentTypeError("must not be empty")
  return text


def stop_string(text: str) -> str:
  """A stop string with backslash escapes read (``\\n`` is a newline); non-ASCII kept as is."""
  try:
    text = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
  except UnicodeDecodeError as error:
    raise argparse.ArgumentTypeError(f"bad escape in {text!r} ({error.reason})") from None
  return nonempty(text)


def schedules(text: str) -> list:
  from dspark_jax.apps import schedule_specs
  try:
    return schedule_specs.parse_schedules(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(str(error)) from None


def batch_sizes(text: str) -> list[int]:
  try:
    values = [int(b) for b in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  bad = [b for b in values if b < 1]
  if bad:
    raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {bad[0]}")
  return values


def json_object(text: str) -> dict:
  import json
  try:
    value = json.loads(text)
  except json.JSONDecodeError as error:
    raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
  return value


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the flags that name a pair and its prompt format (`load_models` reads them)."""
  parser.add_argument("--target", default=None,
                      help="Hugging Face Qwen3 directory (default: the shipped pair)")
  parser.add_argument("--draft", default=None, help="DeepSpec DSpark drafter directory")
  parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
  parser.add_argument("--dtype", type=dtype, default=None,
                      help="compute and storage dtype (default: the checkpoint's)")
  parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
  parser.add_argument("--chat-kwargs", type=json_object, default=None,
                      help='template variables as JSON, e.g. \'{"enable_thinking": false}\'')


def fail(command: str, flag: str, message: str):
  """Exits (SystemExit) with ``dspark-jax COMMAND: error: argument FLAG: MESSAGE``."""
  raise SystemExit(f"dspark-jax {command}: error: argument {flag}: {message}")


def concurrency_alias(args, command: str) -> None:
  """Moves ``--batch-size`` (deprecated: the decodes run through the queue) into
  ``args.concurrency``, with a note on stderr; exits if both are given."""
  import sys

  if args.batch_size is None:
    return
  if args.concurrency is not None:
    fail(command, "--batch-size", "a deprecated alias of --concurrency: pass one of them")
  print(f"dspark-jax {command}: --batch-size is deprecated; use --concurrency", file=sys.stderr)
  args.concurrency, args.batch_size = args.batch_size, None


def load_models(args, command: str, *, need_draft: bool):
  """(target, draft or None, tokenizer, description) from the model flags; exits naming the flag."""
  import os

  from dspark_jax.formats import shipped
  from dspark_jax.text import load_tokenizer

  if args.chat_kwargs is not None and not args.chat:
    fail(command, "--chat-kwargs", "needs --chat")
  if args.target is None:
    for flag in ("draft", "tokenizer", "dtype"):
      if getattr(args, flag) is not None:
        fail(command, f"--{flag}", "needs --target (without it the shipped pair runs)")
    if args.chat:
      fail(command, "--chat", "the shipped tokenizer has no chat template (its models continue "
                              "Python code)")
    pair = shipped.load_shipped()
    return pair.target, pair.draft, pair.tokenizer, "shipped pair"
  if need_draft and args.draft is None:
    fail(command, "--draft", "required with --target")
  for flag in ("target", "draft", "tokenizer"):
    path = getattr(args, flag)
    if path is not None and not os.path.isdir(path):
      fail(command, f"--{flag}", f"{path} is not a directory")
  import jax.numpy as jnp

  import dspark_jax

  tokenizer_flag = "--tokenizer" if args.tokenizer is not None else "--target"
  try:  # the tokenizer first: its errors come before the weights are read
    tokenizer = load_tokenizer(args.tokenizer or args.target)
  except ValueError as error:
    fail(command, tokenizer_flag, str(error))
  if args.chat and tokenizer.chat_template is None:
    fail(command, "--chat", f"the tokenizer of {args.tokenizer or args.target} has no chat "
                            "template")
  try:
    target, draft = dspark_jax.load_pretrained(
        args.target, args.draft, dtype=None if args.dtype is None else jnp.dtype(args.dtype))
  except (ValueError, OSError) as error:
    draft_error = args.draft is not None and (args.draft in str(error)
                                              or os.path.abspath(args.draft) in str(error))
    fail(command, "--draft" if draft_error else "--target", str(error))
  return target, draft, tokenizer, f"{args.target} + {args.draft or 'no drafter'}"
