"""The ``dspark-jax`` command line: ``demo`` (the default), ``eval``, ``sampler-demo``, ``probe``.

* ``dspark-jax demo``: the shipped trained pair decoding held-out prompts (`dspark_jax.apps.demo`).
* ``dspark-jax eval``: the acceptance study, DSpark drafter vs parallel ablation at T = 0 and 1: a
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


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="dspark-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command")

  demo = sub.add_parser("demo", help="decode held-out prompts with the shipped trained pair")
  demo.add_argument("--prompts", type=_positive, default=3)
  demo.add_argument("--first-prompt", type=_nonnegative, default=0)
  demo.add_argument("--max-new-tokens", type=_positive, default=64)
  demo.add_argument("--temperature", type=float, default=0.0)
  demo.add_argument("--seed", type=int, default=0)

  evaluate = sub.add_parser("eval", help="acceptance study: DSpark drafter vs parallel ablation")
  evaluate.add_argument("--prompts", type=_positive, default=None,
                        help="number of held-out prompts (default: all)")
  evaluate.add_argument("--max-new-tokens", type=_positive, default=128)
  evaluate.add_argument("--temperatures", type=_temperatures, default=[0.0, 1.0],
                        help="comma-separated, e.g. 0,1")
  evaluate.add_argument("--seed", type=int, default=0)
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


def evaluate(args) -> int:
  import json
  import os

  from dspark_jax.apps import evaluation
  from dspark_jax.models import shipped

  pair = shipped.load_shipped()
  temperatures = args.temperatures
  rows = evaluation.acceptance_study(pair, num_prompts=args.prompts,
                                     max_new_tokens=args.max_new_tokens,
                                     temperatures=temperatures, seed=args.seed)
  os.makedirs(args.out, exist_ok=True)
  png = evaluation.plot_acceptance(rows, os.path.join(args.out, "acceptance.png"))
  with open(os.path.join(args.out, "acceptance.json"), "w") as f:
    json.dump({"prompts": args.prompts or len(pair.prompts), "max_new_tokens": args.max_new_tokens,
               "rows": [row.as_dict() for row in rows]}, f, indent=2)
  print(evaluation.format_table(rows))
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
  if args.command == "sampler-demo":
    from dspark_jax.apps import sampler_demo
    return sampler_demo.run(args)
  from dspark_jax.apps import demo
  return demo.run(args)


if __name__ == "__main__":
  sys.exit(main())
