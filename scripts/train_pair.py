"""Trains the shipped model pair on the Python standard library, one resumable stage at a time.

Stages (each resumable, each fits a device call of at most ten minutes with ``--max-seconds``):

  data        corpus of the running interpreter's stdlib, deterministic split by file, a byte-level BPE
              tokenizer (vocab 8192, <|endoftext|> = 0, <|mask|> = 1) on the train split, token arrays,
              and a few held-out prompts.
  target      a Qwen3-style target LM (~13 M parameters) on the train tokens.
  draft-data  the drafter's data: target-generated continuations of train-split prompts (as DeepSpec
              regenerates answers with the target): 64-token prompts, 192 generated tokens, half the
              rows greedy and half sampled at T = 1.
  draft       the DSpark drafter (block 7, vanilla sequential head r = 128, confidence head), SPEC §8
              loss (0.1·CE + 0.9·TV + 1.0·BCE, position weights exp(-(k-1)/4)).
  ablation    the same drafter without the sequential head (DFlash-style parallel drafter), same data,
              same steps, same seed.
  export      bf16 safetensors of target, drafter and ablation + tokenizer + held-out prompts +
              manifest.json into ``--export`` (default ``dspark_jax/assets``), each weight file split
              into parts of at most 15 MiB (the device tool returns files up to 16 MiB; `merge` joins).

Usage (from the repository root; ``--work`` holds everything between stages, default runs/stdlib):
  PYTHONPATH=. python3 scripts/train_pair.py --stage data
  PYTHONPATH=. python3 scripts/train_pair.py --stage target --steps 6000 --max-seconds 480
  ...
  PYTHONPATH=. python3 scripts/train_pair.py --stage export --export $OUT
Add ``--tiny`` for a CPU smoke run with toy sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dspark_jax as dj  # noqa: E402
from dspark_jax.models import draft as dm  # noqa: E402
from dspark_jax.models import layers, shipped  # noqa: E402
from dspark_jax.models import target as tm  # noqa: E402
from dspark_jax.train import checkpoints, data  # noqa: E402
from dspark_jax.train import trainer as training  # noqa: E402

PROMPT_TOKENS, CONTINUATION_TOKENS = 64, 192
GAMMA = 7


def target_config(tiny: bool) -> tm.TargetConfig:
  if tiny:
    return tm.TargetConfig(vocab_size=512, num_layers=2, feature_layers=(-1, 1),
                           layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                   head_dim=8, intermediate_size=64))
  # float32 weights; bf16 arithmetic on an accelerator (the CPU has no fast bf16).
  compute = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return tm.TargetConfig(vocab_size=data.DEFAULT_VOCAB_SIZE, num_layers=8, feature_layers=(1, 4, 7),
                         layer=layers.LayerShape(hidden_size=384, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, intermediate_size=1024,
                                                 rope_theta=10_000.0),
                         dtype=compute)


def draft_config(tiny: bool, markov: bool, target: tm.TargetConfig) -> dm.DraftConfig:
  return dm.DraftConfig(gamma=GAMMA, num_layers=1, target_layer_ids=target.feature_layers,
                        mask_token_id=data.MASK_ID, head_kind="vanilla",
                        rank=(16 if tiny else 128) if markov else 1, confidence=True,
                        confidence_with_markov=markov, dtype=target.dtype)


def path(args, name):
  return os.path.join(args.work, name)


def log_json(args, name, payload):
  with open(path(args, name), "w") as f:
    json.dump(payload, f, indent=2)
  print(json.dumps(payload)[:2000], flush=True)


def stage_data(args):
  info = data.corpus_info()
  files = data.stdlib_files()
  train, held = data.split_files(files)
  if args.tiny:
    train, held = train[:40], held[:5]
  start = time.perf_counter()
  train_texts, held_texts = data.read_texts(train), data.read_texts(held)
  if os.path.exists(path(args, "tokenizer.json")):  # keep a tokenizer trained before
    tokenizer = data.load_tokenizer(path(args, "tokenizer.json"))
  else:
    tokenizer = data.train_tokenizer(train_texts, vocab_size=512 if args.tiny else args.vocab)
    tokenizer.save(path(args, "tokenizer.json"))
  train_ids, held_ids = data.encode_files(tokenizer, train_texts), data.encode_files(tokenizer, held_texts)
  np.save(path(args, "train_tokens.npy"), train_ids)
  np.save(path(args, "heldout_tokens.npy"), held_ids)
  # Held-out prompts: the opening of held-out files with at least 40 lines, cut at a line end.
  prompts = []
  for text in held_texts:
    lines = text.splitlines(keepends=True)
    if len(lines) >= 40:
      prompts.append("".join(lines[:12]))
  info.update(train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
              vocab_size=tokenizer.get_vocab_size(), seconds=time.perf_counter() - start)
  log_json(args, "corpus.json", info)
  with open(path(args, "heldout_prompts.json"), "w") as f:
    json.dump(prompts, f)


def make_target(args):
  return tm.TargetModel(target_config(args.tiny), rngs=nnx.Rngs(0))


def stage_target(args):
  stream = np.load(path(args, "train_tokens.npy"))
  model = make_target(args)
  trainer = training.Trainer(
      model, lambda m, _, b: training.lm_loss(m, b),
      training.make_optimizer(args.lr or 1e-3, args.steps),
      checkpoint_path=path(args, "target_train.safetensors"), checkpoint_every=500,
      max_seconds=args.max_seconds)
  trainer.train(training.lm_batches(stream, args.batch or 64, args.length or 512, seed=0), args.steps)
  held = np.load(path(args, "heldout_tokens.npy"))
  held_loss = evaluate_lm(model, held, args)
  checkpoints.save_model(path(args, "target.safetensors"), model,
                         metadata={"steps": trainer.step, "history": trainer.history[-5:],
                                   "heldout_ce": held_loss})
  log_json(args, "target_log.json", {"steps": trainer.step, "heldout_ce": held_loss,
                                      "history": trainer.history})
  if args.parts_to:
    os.makedirs(args.parts_to, exist_ok=True)
    shipped.save_parts(os.path.join(args.parts_to, "target"), model, dtype=jnp.bfloat16)


def evaluate_lm(model, stream, args, windows=64):
  length = args.length or 512
  batches = training.lm_batches(stream, min(windows, 16), length, seed=123)
  loss = jax.jit(lambda s, w: training.lm_loss(nnx.merge(graphdef, s), w)[0])
  graphdef, state = nnx.split(model)
  values = [float(loss(state, batches(i))) for i in range(max(1, windows // 16))]
  return float(np.mean(values))


def stage_draft_data(args):
  target = checkpoints.load_target(path(args, "target.safetensors"))
  stream = np.load(path(args, "train_tokens.npy"))
  out_path = path(args, "draft_sequences.npy")
  done = list(np.load(out_path)) if os.path.exists(out_path) else []
  rng = np.random.default_rng(len(done) + 1)
  batch = 16 if args.tiny else 512
  start = time.perf_counter()
  while len(done) < args.sequences:
    starts = rng.integers(0, len(stream) - PROMPT_TOKENS, batch)
    prompts = [stream[s:s + PROMPT_TOKENS].astype(np.int32) for s in starts]
    params = dj.SamplingParams(temperature=np.where(np.arange(batch) % 2, 1.0, 0.0),
                               seed=rng.integers(0, 2**31, batch))
    result = dj.generate(target, None, prompts, params, jax.random.key(len(done)),
                         max_new_tokens=CONTINUATION_TOKENS, spec=False)
    rows = np.concatenate([np.stack(prompts), result.tokens[:, :CONTINUATION_TOKENS]], axis=1)
    done.extend(rows.astype(np.uint16))
    np.save(out_path, np.stack(done))
    print(f"draft-data: {len(done)} sequences, {time.perf_counter() - start:.0f} s", flush=True)
    if args.max_seconds and time.perf_counter() - start > args.max_seconds:
      break


def stage_draft(args, markov: bool):
  name = "draft" if markov else "ablation"
  target = checkpoints.load_target(path(args, "target.safetensors"))
  sequences = np.load(path(args, "draft_sequences.npy"))
  draft = dm.DSparkDraft(draft_config(args.tiny, markov, target.config), target.config,
                         rngs=nnx.Rngs(1))
  if not markov:  # the ablation's head contributes nothing: bias = W1[x] @ 0
    draft.head.w2[...] = jnp.zeros_like(draft.head.w2[...])
  trainer = training.Trainer(
      draft, lambda m, t, b: training.dspark_loss(m, t, *b, use_markov=markov),
      training.make_optimizer(args.lr or 6e-4, args.steps), frozen=target,
      checkpoint_path=path(args, f"{name}_train.safetensors"), checkpoint_every=500,
      max_seconds=args.max_seconds)
  trainer.train(training.draft_batches(sequences, args.batch or 32, 8, GAMMA,
                                       first_anchor=PROMPT_TOKENS - 1, seed=2), args.steps)
  checkpoints.save_model(path(args, f"{name}.safetensors"), draft,
                         metadata={"steps": trainer.step, "markov": markov,
                                   "history": trainer.history[-5:]})
  log_json(args, f"{name}_log.json", {"steps": trainer.step, "history": trainer.history})


def stage_export(args):
  os.makedirs(args.export, exist_ok=True)
  corpus = json.load(open(path(args, "corpus.json")))
  manifest = {"corpus": corpus, "files": {}}
  for name in ("target", "draft", "ablation"):
    source = path(args, f"{name}.safetensors")
    meta = checkpoints.read_metadata(source)
    model = (checkpoints.load_target(source) if name == "target" else
             checkpoints.load_draft(source, checkpoints.load_target(path(args, "target.safetensors")).config))
    parts = shipped.save_parts(os.path.join(args.export, name), model, dtype=jnp.bfloat16,
                               metadata={"training": {k: v for k, v in meta.items()
                                                      if k not in ("config", "kind")}})
    log = json.load(open(path(args, f"{name}_log.json")))
    manifest["files"][name] = {"parts": parts, "steps": log["steps"],
                               "final_metrics": log["history"][-1] if log["history"] else None}
  for extra in ("tokenizer.json", "heldout_prompts.json"):
    with open(path(args, extra), "rb") as src, open(os.path.join(args.export, extra), "wb") as dst:
      dst.write(src.read())
  manifest["training"] = shipped.RECIPE
  with open(os.path.join(args.export, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
  print(json.dumps(manifest)[:3000])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stage", required=True,
                      choices=["data", "target", "draft-data", "draft", "ablation", "export"])
  parser.add_argument("--work", default="runs/stdlib")
  parser.add_argument("--export", default=os.path.join("dspark_jax", "assets"))
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--steps", type=int, default=4000)
  parser.add_argument("--lr", type=float, default=None)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--length", type=int, default=None)
  parser.add_argument("--vocab", type=int, default=data.DEFAULT_VOCAB_SIZE)
  parser.add_argument("--sequences", type=int, default=20000)
  parser.add_argument("--max-seconds", type=float, default=None)
  parser.add_argument("--parts-to", default=None,
                      help="after the target stage, also write its bf16 parts here (for transport)")
  args = parser.parse_args(argv)
  os.makedirs(args.work, exist_ok=True)
  print(f"stage {args.stage} on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  start = time.perf_counter()
  {"data": stage_data, "target": stage_target, "draft-data": stage_draft_data,
   "draft": lambda a: stage_draft(a, True), "ablation": lambda a: stage_draft(a, False),
   "export": stage_export}[args.stage](args)
  print(f"stage {args.stage} done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
