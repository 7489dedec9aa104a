"""Trains the shipped model pair on Python sources, one resumable stage at a time or all in one call.

Stages (``--stage all`` runs them back to back, each within its time budget, and prints a summary
table last):

  data        the corpus (`dspark_jax.train.data.collect_corpus`): the running interpreter's standard
              library plus the ``*.py`` files of the installed scientific packages, deduplicated by
              content, capped at ``--max-corpus-mb``; the deterministic split by file (held out iff
              crc32(key) % 20 == 0; calibration files crc32(key) % 100 == 1 among the train files); a
              byte-level BPE tokenizer (vocab ``--vocab``, <|endoftext|> = 0, <|mask|> = 1) trained on
              ``--tokenizer-mb`` of train files in sha256(key) order; token arrays; held-out prompts.
  target      a Qwen3-style target LM (12 layers of width 384, 22 M parameters) on the train
              tokens; held-out CE on all held-out files and on the standard-library ones, and nats
              per byte.
  draft-data  the drafter's data: target continuations of train-split prompts outside the
              calibration files (as DeepSpec regenerates answers with the target): 64-token prompts,
              192 generated tokens, half the rows greedy and half sampled at T = 1.
  draft       the DSpark drafter (block 7, vanilla sequential head, confidence head), SPEC §8 loss
              (0.1·CE + 0.9·TV + 1.0·BCE, position weights exp(-(k-1)/4)), trained by ``dspark-jax
              train``'s function (`dspark_jax.train.drafter.train_drafter`) from the target written
              as a Hugging Face directory (``hf_target/``) and the draft-data sequences as token
              rows (``draft_rows.npz``: the loss on the continuation); the run resumes from
              ``draft/``. It reads target layers spread like Qwen3-4B's (1, 9, 17, 25, 33) of 36,
              never the final one.
  ablation    the same drafter without the sequential head (head "none": a DFlash-style parallel
              drafter), same data, seed and learning-rate schedule (the drafter's horizon).
  calibrate   speculative decoding (fixed schedule: every position verified) of prompts from the
              calibration files, half greedy and half T = 1 (``--calibration-temperatures``), with
              ``trace=True``; Sequential Temperature Scaling of the draft's confidence head
              (`dspark_jax.calibration.fit_sts`), the temperatures stored in the head (rounded to
              bf16, as exported); ECE and AUC per position before and after. Greedy continuations
              of held-out prompts in the same batch check that the target does not loop.
  export      bf16 safetensors of target, (calibrated) drafter and ablation + tokenizer + held-out
              prompts + manifest.json into ``--export`` (default ``dspark_jax/assets``), each weight
              file split into parts of at most 15 MiB (`dspark_jax.formats.shipped.save_parts`).
  export-hf   the exported pair through `dspark_jax.save_pretrained` into ``--hf-dir``: a Hugging
              Face Qwen3 target (with the tokenizer) and DeepSpec drafts (``draft``, ``ablation``),
              read back with `dspark_jax.load_pretrained` as a check. Part of ``all`` when
              ``--hf-dir`` is given.

Time. The target and drafter stages measure their step rate after compiling (a short probe inside
the warm-up, whose learning rates do not depend on the horizon) and fit their step count to the
stage's budget, then set the cosine schedule's horizon to it (`Trainer`'s ``fit_horizon``; the
command's ``--fit-budget``); the fitted count is logged, so ``--target-steps N`` without a budget
repeats a run. The ablation takes the drafter's horizon and is cut by its own budget. With
``--stage all`` each stage's budget is its share of ``--total-seconds`` (``--budgets`` overrides
the shares); a single stage uses ``--max-seconds`` (none: no limit, no fitting).

Usage (from the repository root; ``--work`` holds everything between stages, default runs/pycorpus):
  PYTHONPATH=. python3 scripts/train_pair.py --stage all --work /tmp/pair --export $OUT/assets \
      --logs $OUT/logs
  PYTHONPATH=. python3 scripts/train_pair.py --stage target --max-seconds 200
  PYTHONPATH=. python3 scripts/train_pair.py --stage export-hf --export dspark_jax/assets \
      --hf-dir /tmp/pair_hf
Add ``--tiny`` for a CPU smoke run with toy sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dspark_jax as dj  # noqa: E402
from dspark_jax.draft import heads  # noqa: E402
from dspark_jax.formats import shipped  # noqa: E402
from dspark_jax.models import layers  # noqa: E402
from dspark_jax.models import target as tm  # noqa: E402
from dspark_jax.scheduling import calibration  # noqa: E402
from dspark_jax.formats import checkpoints  # noqa: E402
from dspark_jax.text import byte_bpe  # noqa: E402
from dspark_jax.train import data  # noqa: E402
from dspark_jax.train import drafter  # noqa: E402
from dspark_jax.train.drafter import spread_layers  # noqa: E402,F401
from dspark_jax.train import trainer as training  # noqa: E402

PROMPT_TOKENS, CONTINUATION_TOKENS = 64, 192
GAMMA = 7
CALIBRATION_MODULUS = 100
MAX_PROMPTS = 96
PROMPT_LINES, PROMPT_MIN_LINES = 12, 40
ASSET_BYTES = 60 * 10**6
STAGES = ("data", "target", "draft-data", "draft", "ablation", "calibrate", "export", "export-hf")
BUDGETS = {"data": 50.0, "target": 190.0, "draft-data": 35.0, "draft": 80.0, "ablation": 70.0,
           "calibrate": 45.0, "export": 15.0, "export-hf": 10.0}
"""Default seconds per stage under ``--stage all`` (shares of ``--total-seconds``)."""
FITTED = ("target", "draft")
"""Stages whose step count is fitted to their budget (they may use up to 1.3x their share)."""
PROBE_STEPS = 30
RECIPE = {
    "corpus": "the interpreter's standard library and the installed scientific packages' .py files "
              "(corpus.sources), deduplicated by content; split by file key (corpus.split_rule)",
    "schedule": "AdamW (b1 0.9, b2 0.95, wd 0.01, grad-norm 1.0), linear warm-up over 100 steps, "
                "cosine to 10 % at a horizon fitted to the stage's time budget after a 30-step "
                "probe of the step rate (files.*.run.horizon)",
    "target": "next-token cross-entropy on random 512-token windows of the train split, batch 64",
    "draft_data": "64-token prompts from train files outside the calibration files, continued by "
                  "the target for 192 tokens, half greedy, half T = 1",
    "draft": "docs/design.md: 0.1 CE + 0.9 TV + 1.0 BCE(confidence), position weights "
             "exp(-(k-1)/4), block 7, 8 random anchors per sequence in the generated part, batch "
             "32 sequences, vanilla sequential head; trained by dspark-jax train's function "
             "(dspark_jax.train.drafter.train_drafter) on the continuations as token rows",
    "ablation": "the same without the sequential head (head 'none': a DFlash-style parallel "
                "drafter), same data, seed and schedule (the drafter's horizon)",
    "calibration": "STS (dspark_jax.calibration.fit_sts) on fixed-schedule speculative decodes "
                   "(every position verified) of 64-token calibration-file prompts; temperatures "
                   "rounded to bf16 and stored in the draft's confidence head; ECE and AUC per "
                   "position before and after, in sample and with temperatures fitted on half the "
                   "prompts (out_of_sample)",
}


# ---- configurations -------------------------------------------------------------------------------


def target_config(tiny: bool, vocab: int) -> tm.TargetConfig:
  if tiny:
    return tm.TargetConfig(vocab_size=vocab, num_layers=2, feature_layers=spread_layers(2),
                           layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                   head_dim=8, intermediate_size=64))
  # float32 weights; bf16 arithmetic on an accelerator (the CPU has no fast bf16).
  compute = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return tm.TargetConfig(vocab_size=vocab, num_layers=12, feature_layers=spread_layers(12),
                         layer=layers.LayerShape(hidden_size=384, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, intermediate_size=1024,
                                                 rope_theta=10_000.0),
                         dtype=compute)


def gamma(tiny: bool) -> int:
  return 3 if tiny else GAMMA


def draft_choices(tiny: bool, markov: bool, target: tm.TargetConfig) -> dict:
  """`train_drafter`'s ``draft_config`` for the drafter (`markov`) or its ablation (no head)."""
  head = (dict(head_kind="vanilla", rank=16 if tiny else 128, confidence_with_markov=True)
          if markov else dict(head_kind="none", rank=0, confidence_with_markov=False))
  return dict(num_layers=1, gamma=gamma(tiny), confidence=True,
              target_layer_ids=target.feature_layers, mask_token_id=byte_bpe.MASK_ID, **head)


# ---- training within a stage's budget -----------------------------------------------------------


def train_fitted(trainer: training.Trainer, batches, steps: int, seconds: float | None, *,
                 reserve: float = 0.0) -> dict:
  """`trainer` trained to `steps`, its step count and schedule fitted to `seconds` less `reserve`
  (the stage's work after training) when a budget is given (`Trainer`'s ``fit_horizon``)."""
  start = time.perf_counter()
  trainer.max_seconds = None if seconds is None else max(seconds - reserve, 0.0)
  trainer.fit_horizon, trainer.probe_steps = True, PROBE_STEPS
  trainer.train(batches, steps)
  jax.block_until_ready(trainer.params)
  horizon = training.horizon(trainer.opt_state)
  return dict(trainer.fitted or {}, requested_steps=steps, budget_s=trainer.max_seconds,
              horizon=horizon, steps=trainer.step, cut=trainer.step < horizon,
              seconds=time.perf_counter() - start)


# ---- helpers --------------------------------------------------------------------------------------


def path(args, name):
  return os.path.join(args.work, name)


def log_json(args, name, payload):
  with open(path(args, name), "w") as f:
    json.dump(payload, f, indent=2)
  print(json.dumps(payload)[:1500], flush=True)


def read_json(args, name):
  with open(path(args, name)) as f:
    return json.load(f)


def round_to(model, dtype=jnp.bfloat16):
  """Rounds a model's floating parameters to `dtype` in place (keeping their dtype): the values the
  exported bf16 files hold."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(
      lambda x: x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      state))
  return model


def repetition(tokens) -> dict:
  """Repetition of a continuation: the share of its 4-grams seen earlier in it, and whether its
  last 48 tokens repeat with a period of at most 24 tokens (a loop)."""
  t = [int(x) for x in tokens if x >= 0]
  grams = [tuple(t[i:i + 4]) for i in range(len(t) - 3)]
  repeated = len(grams) - len(set(grams))
  tail = 48
  loop = len(t) >= tail + 24 and any(t[-tail:] == t[-tail - p:-p] for p in range(1, 25))
  return {"repeated_4grams": repeated / max(len(grams), 1), "loop": bool(loop)}


# ---- stages ---------------------------------------------------------------------------------------


def stage_data(args, budget):
  start = time.perf_counter()
  deadline = None if budget is None else start + budget
  if args.tiny:  # a small corner of the library plus one package
    corpus = data.collect_corpus(("optax",), max_bytes=400_000,
                                 stdlib_root_dir=os.path.join(data.stdlib_root(), "email"))
  else:
    max_bytes = None if args.max_corpus_mb is None else int(args.max_corpus_mb * 1e6)
    corpus = data.collect_corpus(args.packages, max_bytes=max_bytes)
  read_seconds = time.perf_counter() - start
  modulus = 10 if args.tiny else CALIBRATION_MODULUS
  train_idx, held_idx = corpus.split()
  calib_idx = [i for i in train_idx if data.is_calibration(corpus.files[i].key, modulus)]
  calib_set = set(calib_idx)
  main_idx = [i for i in train_idx if i not in calib_set]
  if not main_idx or not calib_idx or not held_idx:
    raise ValueError(f"corpus: {len(main_idx)} train, {len(calib_idx)} calibration and "
                     f"{len(held_idx)} held-out files; each needs at least one")

  if os.path.exists(path(args, "tokenizer.json")):  # keep a tokenizer trained before
    tokenizer = byte_bpe.load_tokenizer(path(args, "tokenizer.json"))
  else:
    sample, sample_bytes = [], 0
    for i in sorted(train_idx, key=lambda i: data.priority(corpus.files[i])[1]):  # all mixed
      if sample_bytes >= args.tokenizer_mb * 1e6:
        break
      sample.append(corpus.texts[i])
      sample_bytes += corpus.files[i].size
    tokenizer = data.train_tokenizer(sample, vocab_size=512 if args.tiny else args.vocab)
    tokenizer.save(path(args, "tokenizer.json"))
    with open(path(args, "tokenizer_sample.json"), "w") as f:
      json.dump({"files": len(sample), "bytes": sample_bytes}, f)
  tokenizer_seconds = time.perf_counter() - start - read_seconds

  def encode(indices):
    return data.encode_each(tokenizer, [corpus.texts[i] for i in indices])

  held = encode(held_idx)
  calib = encode(calib_idx)
  train, used, chunk, chunk_bytes = [], 0, [], 0
  for n, i in enumerate(main_idx):  # in chunks, so that a time budget can cut the train split
    chunk.append(i)
    chunk_bytes += corpus.files[i].size
    if chunk_bytes >= 8e6 or n == len(main_idx) - 1:
      train.extend(encode(chunk))
      used += len(chunk)
      chunk, chunk_bytes = [], 0
      if deadline is not None and time.perf_counter() > deadline:
        break
  nbytes = lambda indices: sum(corpus.files[i].size for i in indices)
  stdlib_held = [a for a, i in zip(held, held_idx) if corpus.files[i].source == data.STDLIB]
  streams = {"train_tokens": data.join(train + calib), "heldout_tokens": data.join(held),
             "heldout_stdlib_tokens": data.join(stdlib_held)}
  for name, stream in streams.items():
    np.save(path(args, f"{name}.npy"), stream)

  # Held-out prompts: the opening lines of held-out files with enough lines, in sha256(key) order.
  prompts, prompt_keys = [], []
  for i in sorted(held_idx, key=lambda i: data.priority(corpus.files[i])[1]):
    lines = corpus.texts[i].splitlines(keepends=True)
    if len(lines) >= PROMPT_MIN_LINES and len(prompts) < MAX_PROMPTS:
      prompts.append("".join(lines[:PROMPT_LINES]))
      prompt_keys.append(corpus.files[i].key)
  with open(path(args, "heldout_prompts.json"), "w") as f:
    json.dump(prompts, f)

  info = dict(corpus.info)
  info.update(
      train_tokens=int(streams["train_tokens"].size),
      train_files_encoded=used + len(calib_idx), train_files_cut=len(main_idx) - used,
      train_bytes_encoded=nbytes(main_idx[:used]) + nbytes(calib_idx),
      calibration_rule=f"train files with crc32(key) % {modulus} == 1; the draft's prompts come "
                       "from the other train files",
      calibration_files=len(calib_idx), calibration_start=int(sum(a.size for a in train)),
      heldout_tokens=int(streams["heldout_tokens"].size),
      heldout_stdlib_tokens=int(streams["heldout_stdlib_tokens"].size),
      vocab_size=tokenizer.get_vocab_size(),
      tokenizer_sample=(read_json(args, "tokenizer_sample.json")
                        if os.path.exists(path(args, "tokenizer_sample.json")) else None),
      prompts=len(prompts), prompt_keys=prompt_keys,
      seconds={"read": read_seconds, "tokenizer": tokenizer_seconds,
               "total": time.perf_counter() - start})
  info["bytes_per_token"] = {
      "train": info["train_bytes_encoded"] / max(info["train_tokens"], 1),
      "heldout": info["held_out_bytes"] / max(info["heldout_tokens"], 1),
      "heldout_stdlib": info["held_out_stdlib_bytes"] / max(info["heldout_stdlib_tokens"], 1)}
  log_json(args, "corpus.json", info)
  mb = info["bytes"] / 1e6
  return (f"{mb:.1f} MB in {info['files']} files ({len(info['sources'])} sources), "
          f"{info['train_tokens'] / 1e6:.2f} M train tokens"
          + (f", {info['train_files_cut']} files cut" if info["train_files_cut"] else ""))


def make_target(args, vocab):
  return tm.TargetModel(target_config(args.tiny, vocab), rngs=nnx.Rngs(0))


def evaluate_lm(model, streams: dict, length: int, windows: int, batch: int) -> dict:
  """Mean next-token CE on `windows` random [length + 1] windows of each stream (seed 123); None
  for a stream too short."""
  graphdef, state = nnx.split(model)
  loss = jax.jit(lambda s, w: training.lm_loss(nnx.merge(graphdef, s), w)[0])
  out = {}
  for name, stream in streams.items():
    if len(stream) < length + 2:
      out[name] = None
      continue
    batches = training.lm_batches(stream, batch, length, seed=123)
    out[name] = float(np.mean([float(loss(state, batches(i)))
                               for i in range(max(1, windows // batch))]))
  return out


def stage_target(args, budget):
  stream = np.load(path(args, "train_tokens.npy"))
  corpus = read_json(args, "corpus.json")
  model = make_target(args, corpus["vocab_size"])
  steps = args.target_steps or (40 if args.tiny else 100_000)
  batch, length = (8, 64) if args.tiny else (64, 512)
  warmup = 3 if args.tiny else 100
  trainer = training.Trainer(
      model, lambda m, _, b: training.lm_loss(m, b),
      training.make_optimizer(args.target_lr, steps, warmup_steps=warmup),
      checkpoint_path=path(args, "target_train.safetensors"), checkpoint_every=args.checkpoint_every)
  run = train_fitted(trainer, training.lm_batches(stream, batch, length, seed=0), steps, budget,
                     reserve=15.0)
  streams = {"heldout": np.load(path(args, "heldout_tokens.npy")),
             "heldout_stdlib": np.load(path(args, "heldout_stdlib_tokens.npy"))}
  ce = evaluate_lm(model, streams, length, windows=16 if args.tiny else 256, batch=batch)
  per_byte = {k: (None if v is None else v / corpus["bytes_per_token"][k]) for k, v in ce.items()}
  log = {"steps": trainer.step, "run": run, "heldout_ce": ce["heldout"],
         "heldout_stdlib_ce": ce["heldout_stdlib"], "heldout_nats_per_byte": per_byte,
         "batch": batch, "length": length, "lr": args.target_lr, "warmup": warmup,
         "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
         "history": trainer.history}
  checkpoints.save_model(path(args, "target.safetensors"), model,
                         metadata={"steps": trainer.step, "history": trainer.history[-5:],
                                   "heldout_ce": ce["heldout"],
                                   "heldout_stdlib_ce": ce["heldout_stdlib"]})
  log_json(args, "target_log.json", log)
  fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
  return (f"{trainer.step} steps ({run.get('steps_per_second', 0):.1f}/s), held-out CE "
          f"{fmt(ce['heldout'])} (stdlib {fmt(ce['heldout_stdlib'])}; "
          f"{fmt(per_byte['heldout_stdlib'])} nats/byte)")


def stage_draft_data(args, budget):
  start = time.perf_counter()
  target = checkpoints.load_target(path(args, "target.safetensors"))
  stream = np.load(path(args, "train_tokens.npy"))
  limit = read_json(args, "corpus.json")["calibration_start"] - PROMPT_TOKENS
  if limit < 1:
    raise ValueError("train_tokens: no room for prompts before the calibration files")
  out_path = path(args, "draft_sequences.npy")
  done = list(np.load(out_path)) if os.path.exists(out_path) else []
  batch = 16 if args.tiny else 1024
  wanted = args.sequences or (32 if args.tiny else 32768)
  while len(done) < wanted:
    rng = np.random.default_rng(len(done) + 1)
    starts = rng.integers(0, limit, batch)
    prompts = np.stack([stream[s:s + PROMPT_TOKENS] for s in starts]).astype(np.int32)
    params = dj.SamplingParams(temperature=np.where(np.arange(batch) % 2, 1.0, 0.0),
                               seed=rng.integers(0, 2**31, batch))
    result = dj.generate(target, None, prompts, params, jax.random.key(len(done)),
                         max_new_tokens=CONTINUATION_TOKENS, spec=False)
    rows = np.concatenate([prompts, result.tokens[:, :CONTINUATION_TOKENS]], axis=1)
    done.extend(rows.astype(np.uint16))
    np.save(out_path, np.stack(done))
    print(f"draft-data: {len(done)} sequences, {time.perf_counter() - start:.0f} s", flush=True)
    if budget is not None and time.perf_counter() - start > budget:
      break
  log_json(args, "draft_data_log.json", {"sequences": len(done), "wanted": wanted,
                                         "seconds": time.perf_counter() - start})
  return f"{len(done)} sequences of {PROMPT_TOKENS} + {CONTINUATION_TOKENS} tokens"


def draft_rows(args) -> str:
  """The draft-data sequences as token rows for `train_drafter` (``draft_rows.npz``: the tokens
  and a loss mask on the continuation, so that every block starts in the generated part)."""
  sequences = np.load(path(args, "draft_sequences.npy")).astype(np.int32)
  mask = np.zeros(sequences.shape, bool)
  mask[:, PROMPT_TOKENS:] = True
  rows = path(args, "draft_rows.npz")
  np.savez(rows, tokens=sequences, loss_mask=mask)
  return rows


def stage_draft(args, budget, markov: bool):
  """The drafter (``markov``) or its ablation through ``dspark-jax train``'s function, from the
  target written as a Hugging Face directory (``hf_target/``) and the draft-data rows; the
  trained weights also go to ``draft.safetensors`` / ``ablation.safetensors`` for the later
  stages."""
  name = "draft" if markov else "ablation"
  target = checkpoints.load_target(path(args, "target.safetensors"))
  hf_dir = path(args, "hf_target")
  write_hf_target(target, hf_dir, path(args, "tokenizer.json"))
  if markov:
    steps, fit = args.draft_steps or (30 if args.tiny else 100_000), budget is not None
  else:  # the drafter's horizon and schedule, so that the two differ only in the head
    steps, fit = read_json(args, "draft_log.json")["run"]["horizon"], False
  options = drafter.TrainOptions(
      steps=steps, batch_size=8 if args.tiny else 32, anchors=8, learning_rate=args.draft_lr,
      warmup_steps=3 if args.tiny else 100, final_lr_fraction=0.1, weight_decay=0.01,
      adam_b2=0.95, accumulate=1, seed=2, heldout=0, eval_every=0, log_every=50,
      checkpoint_every=min(args.checkpoint_every, steps),
      max_seconds=None if budget is None else max(budget - 3.0, 0.0), fit_to_budget=fit)
  result = drafter.train_drafter(
      hf_dir, draft_rows(args), path(args, name), options=options, progress=False,
      dtype=target.config.dtype,
      draft_config=draft_choices(args.tiny, markov, target.config))
  with open(os.path.join(path(args, name), drafter.TRAINING_DIR, "history.json")) as f:
    fitted = json.load(f).get("fitted") or {}
  run = dict(fitted, horizon=result.horizon, steps=result.step, cut=result.step < result.horizon)
  checkpoints.save_model(path(args, f"{name}.safetensors"), result.draft,
                         metadata={"steps": result.step, "markov": markov,
                                   "history": result.history[-5:]})
  log_json(args, f"{name}_log.json", {"steps": result.step, "run": run, "lr": args.draft_lr,
                                      "warmup": options.warmup_steps, "history": result.history,
                                      "options": dataclasses.asdict(options)})
  last = result.history[-1] if result.history else {}
  return (f"{result.step} steps" + (" (CUT by the budget)" if run["cut"] else "")
          + f", loss {last.get('loss', float('nan')):.3f}, TV {last.get('tv', float('nan')):.3f}")


def _metrics(confidence, accept_len, temperatures):
  """ECE and AUC per position, raw and with `temperatures`, as JSON lists."""
  out = {}
  for label, t in (("before", None), ("after", temperatures)):
    out[f"ece_{label}"] = calibration.ece(confidence, accept_len, t).tolist()
    out[f"auc_{label}"] = [None if np.isnan(v) else float(v)
                           for v in calibration.auc(confidence, accept_len, t)]
  return out


def stage_calibrate(args, budget):
  del budget  # one decode; nothing to cut
  start = time.perf_counter()
  target = round_to(checkpoints.load_target(path(args, "target.safetensors")))
  draft = round_to(checkpoints.load_draft(path(args, "draft.safetensors"), target.config))
  corpus = read_json(args, "corpus.json")
  stream = np.load(path(args, "train_tokens.npy"))
  lo, hi = corpus["calibration_start"], len(stream) - PROMPT_TOKENS
  if hi <= lo:
    raise ValueError("train_tokens: the calibration files are shorter than one prompt")
  n_cal = 8 if args.tiny else args.calibration_prompts
  rng = np.random.default_rng(7)
  cal_prompts = [stream[s:s + PROMPT_TOKENS].astype(np.int32)
                 for s in rng.integers(lo, hi, n_cal)]
  tokenizer = byte_bpe.load_tokenizer(path(args, "tokenizer.json"))
  with open(path(args, "heldout_prompts.json")) as f:
    texts = json.load(f)[:2 if args.tiny else 16]
  sample_prompts = [np.asarray(tokenizer.encode(t, add_special_tokens=False).ids[-512:], np.int32)
                    for t in texts]
  temps = np.asarray(args.calibration_temperatures, np.float64)
  row_temperature = np.concatenate([temps[np.arange(n_cal) % len(temps)],
                                    np.zeros(len(sample_prompts))])
  params = dj.SamplingParams(temperature=row_temperature,
                             seed=np.arange(len(row_temperature)) + 1000)
  new_tokens = 16 if args.tiny else 128
  # XLA draft blocks: one decode, where the GPU kernels would add compile time and nothing else.
  result = dj.generate(target, draft, cal_prompts + sample_prompts, params, jax.random.key(11),
                       max_new_tokens=new_tokens, trace=True, backend="xla")
  trace = result.trace
  rows = np.broadcast_to(np.arange(len(row_temperature)), trace.active.shape)
  keep = trace.active & (trace.verify_lens == draft.config.gamma + 1) & (rows < n_cal)
  confidence = np.asarray(trace.confidence)[keep].astype(np.float64)
  accept_len = np.asarray(trace.accept_len)[keep]
  round_row = rows[keep]
  round_temperature = row_temperature[round_row]
  as_stored = lambda t: np.asarray(jnp.asarray(t, jnp.bfloat16).astype(jnp.float32), np.float64)
  fitted = calibration.fit_sts(confidence, accept_len)
  stored = as_stored(fitted)
  # An out-of-sample check: temperatures fitted on half the prompts, measured on the other half
  # (prompts in pairs, so that both halves hold every row temperature).
  first = (round_row // len(temps)) % 2 == 0
  check = None
  if first.any() and (~first).any():
    half = as_stored(calibration.fit_sts(confidence[first], accept_len[first]))
    check = dict(fit_rounds=int(first.sum()), eval_rounds=int((~first).sum()),
                 temperatures=half.tolist(),
                 **_metrics(confidence[~first], accept_len[~first], half))
  np.savez(path(args, "calibration.npz"), confidence=confidence, accept_len=accept_len,
           temperature=round_temperature, fitted=fitted, stored=stored)

  head = draft.confidence.arrays()
  head["temperatures"] = jnp.asarray(stored, head["w"].dtype)
  draft.confidence = nnx.data(heads.ConfidenceHead(head))
  meta = checkpoints.read_metadata(path(args, "draft.safetensors"))
  checkpoints.save_model(path(args, "draft_calibrated.safetensors"), draft,
                         metadata={k: v for k, v in meta.items() if k not in ("config", "kind")})

  groups = {"all": np.ones(len(accept_len), bool)}
  groups.update({f"T={t:g}": round_temperature == t for t in temps})
  by_group = {}
  for name, mask in groups.items():
    if mask.sum() == 0:
      continue
    by_group[name] = dict(rounds=int(mask.sum()), tau=float(1 + accept_len[mask].mean()),
                          **_metrics(confidence[mask], accept_len[mask], stored))
  samples = []
  for j, text in enumerate(texts):
    row = n_cal + j
    tokens = result.tokens[row][:result.lengths[row]]
    samples.append(dict(prompt_tail=text[-200:], continuation=tokenizer.decode(
        [int(t) for t in tokens]), **repetition(tokens)))
  log = {"prompts": n_cal, "max_new_tokens": new_tokens,
         "temperatures_of_rows": [float(t) for t in temps], "rounds": int(keep.sum()),
         "fitted_temperatures": fitted.tolist(), "stored_temperatures": stored.tolist(),
         "groups": by_group, "out_of_sample": check,
         "greedy_samples": {"count": len(samples),
                            "loops": int(sum(s["loop"] for s in samples)),
                            "mean_repeated_4grams": float(np.mean(
                                [s["repeated_4grams"] for s in samples])) if samples else None,
                            "examples": samples[:4]},
         "seconds": time.perf_counter() - start}
  log_json(args, "calibration_log.json", log)
  whole = by_group["all"]
  held = "" if check is None else (f" (out of sample {np.mean(check['ece_before']):.3f} -> "
                                   f"{np.mean(check['ece_after']):.3f})")
  return (f"{log['rounds']} rounds, tau {whole['tau']:.2f}, ECE mean "
          f"{np.mean(whole['ece_before']):.3f} -> {np.mean(whole['ece_after']):.3f}{held}; greedy "
          f"samples: {log['greedy_samples']['loops']}/{len(samples)} loop, repeated 4-grams "
          f"{log['greedy_samples']['mean_repeated_4grams']:.2f}")


def stage_export(args, budget):
  del budget
  os.makedirs(args.export, exist_ok=True)
  for name in ("target", "draft", "ablation"):  # no stale parts of an earlier export
    for old in glob.glob(os.path.join(args.export, f"{name}.part*.safetensors")):
      os.remove(old)
  corpus = read_json(args, "corpus.json")
  calibrated = os.path.exists(path(args, "draft_calibrated.safetensors"))
  manifest = {"corpus": corpus, "files": {}}
  target_config = checkpoints.load_target(path(args, "target.safetensors")).config
  sources = {"target": "target", "draft": "draft_calibrated" if calibrated else "draft",
             "ablation": "ablation"}
  for name, source in sources.items():
    file = path(args, f"{source}.safetensors")
    meta = checkpoints.read_metadata(file)
    model = (checkpoints.load_target(file) if name == "target" else
             checkpoints.load_draft(file, target_config))
    parts = shipped.save_parts(os.path.join(args.export, name), model, dtype=jnp.bfloat16,
                               metadata={"training": {k: v for k, v in meta.items()
                                                      if k not in ("config", "kind")}})
    log = read_json(args, f"{name}_log.json")
    entry = {"parts": parts, "steps": log["steps"], "run": log.get("run"),
             "final_metrics": log["history"][-1] if log["history"] else None}
    if name == "target":
      entry.update({k: log[k] for k in ("heldout_ce", "heldout_stdlib_ce", "heldout_nats_per_byte",
                                        "params", "batch", "length", "lr", "warmup")})
    manifest["files"][name] = entry
  for extra in ("tokenizer.json", "heldout_prompts.json"):
    shutil.copyfile(path(args, extra), os.path.join(args.export, extra))
  if calibrated:
    cal = read_json(args, "calibration_log.json")
    manifest["calibration"] = {k: cal[k] for k in (
        "prompts", "max_new_tokens", "temperatures_of_rows", "rounds", "fitted_temperatures",
        "stored_temperatures", "groups", "out_of_sample", "greedy_samples")}
  else:
    manifest["calibration"] = None
  manifest["training"] = RECIPE
  with open(os.path.join(args.export, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
  total = sum(os.path.getsize(os.path.join(args.export, f)) for f in os.listdir(args.export))
  over = f" -- OVER the {ASSET_BYTES / 1e6:.0f} MB limit" if total > ASSET_BYTES else ""
  return f"{total / 1e6:.1f} MB in {len(os.listdir(args.export))} files{over}"


def write_hf_target(target, directory: str, tokenizer_json: str) -> list[str]:
  """The target as a Hugging Face Qwen3 directory with the byte-level tokenizer beside it."""
  written = dj.save_pretrained(target, directory)
  shutil.copyfile(tokenizer_json, os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": byte_bpe.END_OF_TEXT,
               "pad_token": byte_bpe.END_OF_TEXT, "mask_token": byte_bpe.MASK,
               "clean_up_tokenization_spaces": False}, f, indent=2)
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": byte_bpe.END_OF_TEXT_ID,
               "pad_token_id": byte_bpe.END_OF_TEXT_ID}, f, indent=2)
  return written


def stage_export_hf(args, budget):
  del budget
  if not args.hf_dir:
    raise ValueError("--hf-dir: export-hf needs a directory")
  pair = shipped.load_shipped(args.export)
  written = {}
  for name, model in (("target", pair.target), ("draft", pair.draft),
                      ("ablation", pair.ablation)):
    directory = os.path.join(args.hf_dir, name)
    if name == "target":
      written[name] = write_hf_target(model, directory,
                                      os.path.join(args.export, "tokenizer.json"))
    else:
      written[name] = dj.save_pretrained(model, directory, target=pair.target)
  # Read back: the pair loads, with the calibrated temperatures.
  target, draft = dj.load_pretrained(os.path.join(args.hf_dir, "target"),
                                     os.path.join(args.hf_dir, "draft"))
  if pair.draft.confidence.temperatures is not None:
    np.testing.assert_allclose(np.asarray(draft.confidence.temperatures[...], np.float32),
                               np.asarray(pair.draft.confidence.temperatures[...], np.float32))
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.hf_dir) for f in fs)
  return f"{size / 1e6:.1f} MB: target (with tokenizer), draft, ablation; reloads"


RUNNERS = {"data": stage_data, "target": stage_target, "draft-data": stage_draft_data,
           "draft": lambda a, b: stage_draft(a, b, True),
           "ablation": lambda a, b: stage_draft(a, b, False),
           "calibrate": stage_calibrate, "export": stage_export, "export-hf": stage_export_hf}


# ---- driver ---------------------------------------------------------------------------------------


def parse_budgets(text: str | None) -> dict[str, float]:
  budgets = dict(BUDGETS)
  for item in (text or "").split(","):
    if not item.strip():
      continue
    name, _, value = item.partition("=")
    if name.strip() not in BUDGETS:
      raise SystemExit(f"--budgets: unknown stage {name.strip()!r} (stages: {', '.join(STAGES)})")
    try:
      budgets[name.strip()] = float(value)
    except ValueError:
      raise SystemExit(f"--budgets: {item!r} is not stage=seconds") from None
  return budgets


def budget_for(stage: str, remaining: float, stages: list[str], budgets: dict) -> float:
  """The stage's share of the `remaining` seconds among the `stages` still to run."""
  scale = remaining / sum(budgets[s] for s in stages)
  return max(0.0, budgets[stage] * min(scale, 1.3 if stage in FITTED else 1.0))


def summary(rows, total_seconds, total_budget) -> str:
  lines = [f"{'stage':11s} {'seconds':>8s} {'budget':>7s}  result"]
  for stage, seconds, budget, result in rows:
    shown = "-" if budget is None else f"{budget:.0f}"
    lines.append(f"{stage:11s} {seconds:8.1f} {shown:>7s}  {result}")
  shown = "-" if total_budget is None else f"{total_budget:.0f}"
  lines.append(f"{'total':11s} {total_seconds:8.1f} {shown:>7s}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stage", required=True, choices=("all",) + STAGES)
  parser.add_argument("--work", default=os.path.join("runs", "pycorpus"))
  parser.add_argument("--export", default=os.path.join("dspark_jax", "assets"))
  parser.add_argument("--hf-dir", default=None,
                      help="export-hf: write the HF Qwen3 target and DeepSpec drafts here")
  parser.add_argument("--logs", default=None, help="copy the stage logs and calibration data here")
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--packages", default=",".join(data.DEFAULT_PACKAGES),
                      help="comma-separated import names of the packages in the corpus")
  parser.add_argument("--max-corpus-mb", type=float, default=320.0,
                      help="cap on the corpus (MB of source text; 0: no cap)")
  parser.add_argument("--tokenizer-mb", type=float, default=40.0,
                      help="MB of train text the tokenizer learns from")
  parser.add_argument("--vocab", type=int, default=data.DEFAULT_VOCAB_SIZE)
  parser.add_argument("--target-steps", type=int, default=None,
                      help="steps (an upper bound when a budget applies)")
  parser.add_argument("--target-lr", type=float, default=1.5e-3)
  parser.add_argument("--draft-steps", type=int, default=None)
  parser.add_argument("--draft-lr", type=float, default=6e-4)
  parser.add_argument("--sequences", type=int, default=None, help="drafter data sequences")
  parser.add_argument("--calibration-prompts", type=int, default=512)
  parser.add_argument("--calibration-temperatures", default="0,1",
                      help="comma-separated temperatures that the calibration rows cycle through")
  parser.add_argument("--checkpoint-every", type=int, default=10**9,
                      help="resumable training checkpoints every so many steps (and at the end)")
  parser.add_argument("--max-seconds", type=float, default=None, help="budget of a single stage")
  parser.add_argument("--total-seconds", type=float, default=450.0,
                      help="--stage all: seconds for every stage together")
  parser.add_argument("--budgets", default=None,
                      help="--stage all: stage=seconds shares replacing the defaults "
                           f"({', '.join(f'{k}={v:g}' for k, v in BUDGETS.items())})")
  args = parser.parse_args(argv)
  if args.stage == "export-hf" and not args.hf_dir:
    parser.error("--stage export-hf needs --hf-dir")
  args.packages = [p.strip() for p in args.packages.split(",") if p.strip()]
  args.max_corpus_mb = args.max_corpus_mb or None
  try:
    args.calibration_temperatures = [float(t) for t in args.calibration_temperatures.split(",")]
  except ValueError:
    raise SystemExit("--calibration-temperatures: expected comma-separated numbers") from None
  budgets = parse_budgets(args.budgets)
  os.makedirs(args.work, exist_ok=True)
  print(f"train_pair {args.stage} on {jax.devices()[0].device_kind}, jax {jax.__version__}",
        flush=True)

  start = time.perf_counter()
  if args.stage == "all":
    stages = [s for s in STAGES if s != "export-hf" or args.hf_dir]
    total_budget = args.total_seconds
  else:
    stages, total_budget = [args.stage], args.max_seconds
  rows = []
  try:
    for i, stage in enumerate(stages):
      if args.stage == "all":
        budget = budget_for(stage, total_budget - (time.perf_counter() - start), stages[i:],
                            budgets)
      else:
        budget = args.max_seconds
      print(f"== stage {stage} (budget {'none' if budget is None else f'{budget:.0f} s'})",
            flush=True)
      stage_start = time.perf_counter()
      result = RUNNERS[stage](args, budget)
      rows.append((stage, time.perf_counter() - stage_start, budget, result))
      print(f"== stage {stage} done in {rows[-1][1]:.1f} s: {result}", flush=True)
  except BaseException as error:
    rows.append((stages[len(rows)], 0.0, None,
                 f"FAILED: {type(error).__name__}: {str(error)[:300]} (traceback below)"))
    raise
  finally:
    elapsed = time.perf_counter() - start
    with open(path(args, f"timings_{args.stage}.json"), "w") as f:
      json.dump({"rows": rows, "seconds": elapsed}, f, indent=2)
    if args.logs:
      os.makedirs(args.logs, exist_ok=True)
      for name in sorted(os.listdir(args.work)):
        if name.endswith(".json") or name == "calibration.npz":
          shutil.copyfile(path(args, name), os.path.join(args.logs, name))
    print(summary(rows, elapsed, total_budget), flush=True)


if __name__ == "__main__":
  main()
