"""The training subcommands: ``dspark-jax train`` (`train`) and ``dspark-jax regenerate``
(`regenerate`), and their flags (`add_parsers`).

* ``dspark-jax train --target DIR --data FILE.jsonl --out DIR [--layers N --gamma G --rank R
  --head vanilla|gated|rnn|none --no-confidence --target-layers 1,9,17 --mask-token-id ID
  --steps N --epochs E --batch-size B --seq-len L --anchors A --lr LR --warmup F --warmup-steps N
  --final-lr F --weight-decay W --accumulate K --dp N --tp N --seed S
  --thinking on|off --heldout N --eval-every N --eval-tokens N --checkpoint-every N
  --format deepspec|speculators --dtype D --max-seconds S --fit-budget]``:
  `dspark_jax.train.drafter.train_drafter`; prints a one-line summary. Rerunning with the same ``--out`` resumes.
* ``dspark-jax regenerate --target DIR [--draft DIR] --prompts FILE.jsonl --out FILE.jsonl
  [--max-new-tokens N --temperature T --concurrency S --thinking on|off --seed S]``: the target's
  own answers (`dspark_jax.train.regenerate.regenerate`); rerunning resumes.

Bad flags, files and data exit naming the flag (`flags.fail`), or the file, line and field.
"""

from __future__ import annotations

import argparse

from dspark_jax.apps import flags


def _thinking(text: str) -> bool:
  if text not in ("on", "off"):
    raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {text!r}")
  return text == "on"


def _layer_ids(text: str) -> list[int]:
  try:
    ids = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None
  if not ids:
    raise argparse.ArgumentTypeError("expected at least one layer id")
  return ids


def add_parsers(sub) -> None:
  """Adds ``train`` and ``regenerate`` to the subparsers `sub`."""
  train = sub.add_parser("train", help="train a DSpark drafter for a Qwen3 target")
  train.add_argument("--target", required=True, help="Hugging Face Qwen3 directory (+ tokenizer)")
  train.add_argument("--data", required=True,
                     help="conversation jsonl (turns or messages), or an .npz of token rows "
                          "(tokens, loss_mask: [N, L])")
  train.add_argument("--out", required=True, help="the drafter's directory (rerun: resumes)")
  train.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
  train.add_argument("--dtype", type=flags.dtype, default=None,
                     help="compute and storage dtype (default: the target checkpoint's)")
  model = train.add_argument_group("drafter (defaults: DeepSpec's)")
  model.add_argument("--layers", type=flags.positive, default=5, help="draft layers")
  model.add_argument("--gamma", type=flags.positive, default=7, help="block size γ")
  model.add_argument("--rank", type=flags.nonnegative, default=256, help="Markov head rank r")
  model.add_argument("--head", choices=("vanilla", "gated", "rnn", "none"), default="vanilla",
                     help="Markov head type (none: DFlash-style, no head)")
  model.add_argument("--no-confidence", action="store_true", help="no confidence head")
  model.add_argument("--target-layers", type=_layer_ids, default=None,
                     help="target layers read, e.g. 1,9,17,25,33 (default: spread like Qwen3-4B's)")
  model.add_argument("--mask-token-id", type=flags.nonnegative, default=None,
                     help="the block filler id (default: the first id past the tokenizer's)")
  run = train.add_argument_group("training (defaults: DeepSpec's recipe)")
  run.add_argument("--steps", type=flags.positive, default=None,
                   help="optimizer steps (default: --epochs over the packed rows)")
  run.add_argument("--epochs", type=flags.positive, default=10,
                   help="passes over the data (default 10)")
  run.add_argument("--batch-size", type=flags.positive, default=512,
                   help="sequences per step (default 512)")
  run.add_argument("--seq-len", type=flags.positive, default=4096,
                   help="tokens per packed row (default 4096)")
  run.add_argument("--anchors", type=flags.positive, default=512,
                   help="blocks per sequence (default 512)")
  run.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
  run.add_argument("--warmup", type=float, default=0.04,
                   help="the warm-up's share of the steps (default 0.04)")
  run.add_argument("--warmup-steps", type=flags.nonnegative, default=None,
                   help="the warm-up in steps (instead of --warmup)")
  run.add_argument("--final-lr", type=float, default=0.0,
                   help="the last step's rate as a fraction of the peak (default 0)")
  run.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (default 0)")
  run.add_argument("--accumulate", type=flags.positive, default=None,
                   help="micro-batches per step (default: one sequence per device at a time)")
  run.add_argument("--dp", type=flags.positive, default=1, help="data-parallel devices")
  run.add_argument("--tp", type=flags.positive, default=1,
                   help="devices the target is split over (tensor parallel), for a target too "
                        "large for one device; the run uses dp * tp devices")
  run.add_argument("--seed", type=flags.seed, default=0)
  run.add_argument("--thinking", type=_thinking, default=None,
                   help="the chat template's enable_thinking: on or off (default: the template's)")
  run.add_argument("--heldout", type=flags.nonnegative, default=8,
                   help="conversations kept out for the held-out τ")
  run.add_argument("--eval-every", type=flags.nonnegative, default=500)
  run.add_argument("--eval-tokens", type=flags.positive, default=128)
  run.add_argument("--checkpoint-every", type=flags.positive, default=500)
  run.add_argument("--log-every", type=flags.positive, default=10)
  run.add_argument("--format", choices=("deepspec", "speculators"), default="deepspec")
  run.add_argument("--max-seconds", type=flags.finite_nonnegative, default=None,
                   help="stop (saving the state) after this much wall time; rerun to resume")
  run.add_argument("--fit-budget", action="store_true",
                   help="with --max-seconds: fit the step count and the learning-rate schedule "
                        "to the budget (measured after the first steps) instead of cutting it")

  regen = sub.add_parser("regenerate", help="the target's own answers to a prompt file")
  regen.add_argument("--target", required=True, help="Hugging Face Qwen3 directory (+ tokenizer)")
  regen.add_argument("--draft", default=None, help="a drafter to decode speculatively with")
  regen.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
  regen.add_argument("--dtype", type=flags.dtype, default=None)
  regen.add_argument("--prompts", required=True, help="jsonl of prompts (turns or messages)")
  regen.add_argument("--out", required=True, help="conversation jsonl to append to (resumes)")
  regen.add_argument("--max-new-tokens", type=flags.positive, default=2048)
  regen.add_argument("--temperature", type=flags.finite_nonnegative, default=0.0)
  regen.add_argument("--concurrency", type=flags.positive, default=8)
  regen.add_argument("--thinking", type=_thinking, default=None)
  regen.add_argument("--seed", type=flags.seed, default=0)


def _check_paths(args, command: str, dirs=(), files=()) -> None:
  import os

  for flag in dirs:
    path = getattr(args, flag.lstrip("-").replace("-", "_"))
    if path is not None and not os.path.isdir(path):
      flags.fail(command, flag, f"{path} is not a directory")
  for flag in files:
    path = getattr(args, flag.lstrip("-").replace("-", "_"))
    if not os.path.isfile(path):
      flags.fail(command, flag, f"{path} is not a file")


def train(args) -> int:
  from dspark_jax.train import conversations
  from dspark_jax.train import drafter

  _check_paths(args, "train", dirs=("--target", "--tokenizer"), files=("--data",))
  try:
    options = drafter.TrainOptions(
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, seq_len=args.seq_len,
        anchors=args.anchors, learning_rate=args.lr, warmup_fraction=args.warmup,
        warmup_steps=args.warmup_steps, final_lr_fraction=args.final_lr,
        weight_decay=args.weight_decay, accumulate=args.accumulate, dp=args.dp, tp=args.tp,
        seed=args.seed,
        thinking=args.thinking, heldout=args.heldout, eval_every=args.eval_every,
        eval_tokens=args.eval_tokens, checkpoint_every=args.checkpoint_every,
        log_every=args.log_every, format=args.format, max_seconds=args.max_seconds,
        fit_to_budget=args.fit_budget)
  except ValueError as error:
    name = str(error).split(":")[0].replace("_", "-")
    flag = {"learning-rate": "lr", "final-lr-fraction": "final-lr", "warmup-fraction": "warmup",
            "fit-to-budget": "fit-budget"}.get(name, name)
    flags.fail("train", f"--{flag}", str(error))
  choices = dict(num_layers=args.layers, gamma=args.gamma, rank=args.rank, head_kind=args.head,
                 confidence=not args.no_confidence, target_layer_ids=args.target_layers,
                 mask_token_id=args.mask_token_id)
  try:
    result = drafter.train_drafter(args.target, args.data, args.out, options=options,
                                   draft_config=choices, dtype=args.dtype,
                                   tokenizer_dir=args.tokenizer)
  except conversations.DataError as error:
    raise SystemExit(f"dspark-jax train: error: {error}") from None
  except ValueError as error:
    raise SystemExit(f"dspark-jax train: error: {error}") from None
  print(drafter.describe(result))
  return 0


def regenerate(args) -> int:
  import jax.numpy as jnp

  import dspark_jax
  from dspark_jax.text import load_tokenizer
  from dspark_jax.train import conversations
  from dspark_jax.train import regenerate as regen

  _check_paths(args, "regenerate", dirs=("--target", "--draft", "--tokenizer"),
               files=("--prompts",))
  try:
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    conversations.check_chat_template(tokenizer, f"{args.tokenizer or args.target}: tokenizer")
    target, draft = dspark_jax.load_pretrained(
        args.target, args.draft, dtype=None if args.dtype is None else jnp.dtype(args.dtype))
    written = regen.regenerate(target, draft, tokenizer, args.prompts, args.out,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               concurrency=args.concurrency, thinking=args.thinking,
                               seed=args.seed)
  except (ValueError, OSError) as error:
    raise SystemExit(f"dspark-jax regenerate: error: {error}") from None
  print(f"{written} answers appended to {args.out}")
  return 0
