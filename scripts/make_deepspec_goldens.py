"""Writes tests/golden/deepspec/: tiny DeepSpec drafts and what DeepSpec's own code makes of them.

Usage::

  # --deepspec: a DeepSpec checkout, or a bare git directory of it
  python scripts/make_deepspec_goldens.py --deepspec /path/to/DeepSpec

Needs torch and transformers (the ``test`` extra) and a copy of github.com/deepseek-ai/DeepSpec.
A bare git directory is exported (``git archive HEAD deepspec``) to a temporary directory first. No
DeepSpec module is stubbed: the classes and functions used are DeepSpec's own, imported as they are.
One shim, of transformers: DeepSpec (which pins transformers 5.10.2) calls
``DynamicCache.crop(n)`` with a positive n, meaning "keep the first n positions"; newer
transformers refuse a positive n, so where they do, `legacy_crop` restores that meaning.

What it writes (float32 everywhere, so that the tests compare to float32 rounding):

* ``target_untied/``, ``target_tied/``: tiny random ``Qwen3ForCausalLM`` checkpoints
  (``save_pretrained``), with weights scaled so that the logits are far from ties.
* ``draft_<case>/``: tiny random ``Qwen3DSparkModel`` drafts, one per head kind (vanilla, gated,
  rnn, markov_rank 0 with and without a confidence head; confidence heads with and without the
  Markov features), built by DeepSpec's ``build_draft_config``, their embedding and LM head copied
  from the target by ``initialize_embeddings_and_head``, saved by ``save_pretrained``.
* ``outputs.npz``: for each case, DeepSpec's evaluator path (``generate_decoding_sample`` with the
  ``Qwen3DSparkEvaluator`` context, propose and update steps; greedy, confidence threshold 0) after
  a fixed prompt: every round's proposal (tokens, the corrected logits from
  ``sample_draft_tokens``, the confidence logits) and its accepted lengths; the same first proposal
  of the draft as dspark_jax's ``save_pretrained`` writes it, loaded by
  ``Qwen3DSparkModel.from_pretrained``; and transformers' greedy ``generate`` of each target.
* ``manifest.json``: the DeepSpec commit, library versions, the cases and the smallest top-1/top-2
  margin of every recorded greedy choice (the tests compare tokens exactly only because no choice
  is within float32 rounding of a tie); and ``recipe``, DeepSpec's Qwen3-4B DSpark configuration
  (``config/dspark/dspark_qwen3_4b.py``: model, train and data settings) with the defaults of the
  optimizer and learning-rate schedule it builds (torch's ``AdamW``, DeepSpec's
  ``CosineAnnealingWarmupLR``), which ``dspark-jax train``'s defaults are tested against.
  ``--recipe-only`` refreshes that entry alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "golden", "deepspec")

VOCAB = 96
MASK_ID = VOCAB - 1
TARGET = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
              rms_norm_eps=1e-6)
PROMPT = [17, 3, 58, 41, 9, 76, 30]
NEW_TOKENS = 8          # DeepSpec's speculative greedy decode and transformers' greedy generate
MIN_MARGIN = 1e-3       # the smallest top-1 - top-2 logit gap allowed in a recorded greedy choice

CASES = (
    dict(name="vanilla", seed=10, target="untied", num_draft_layers=2,
         target_layer_ids=[-1, 1], markov_rank=8, markov_head_type="vanilla", confidence=True,
         with_markov=True, block_size=4),
    dict(name="gated", seed=11, target="tied", num_draft_layers=1, target_layer_ids=[0, 1],
         markov_rank=8, markov_head_type="gated", confidence=True, with_markov=False,
         block_size=4),
    dict(name="rnn", seed=20, target="untied", num_draft_layers=1, target_layer_ids=[1],
         markov_rank=8, markov_head_type="rnn", confidence=True, with_markov=True, block_size=5),
    dict(name="dflash", seed=13, target="tied", num_draft_layers=1, target_layer_ids=[-1, 0, 1],
         markov_rank=0, confidence=False, block_size=4),
    dict(name="dflash_confidence", seed=14, target="untied", num_draft_layers=1,
         target_layer_ids=[0], markov_rank=0, confidence=True, with_markov=False, block_size=3),
)


def export_deepspec(source: str, workdir: str) -> tuple[str, str]:
  """(directory to put on sys.path, commit hash) of a DeepSpec checkout or bare git directory."""
  source = os.path.abspath(source)
  if os.path.isdir(os.path.join(source, "deepspec")):
    try:
      commit = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      commit = "unknown (not a git checkout)"
    return source, commit
  git = ["git", f"--git-dir={source}"]
  commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
  archive = subprocess.run(git + ["archive", "--format=tar", "HEAD", "deepspec", "config"],
                           check=True, capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", workdir], input=archive, check=True)
  return workdir, commit


def legacy_crop(torch, transformers) -> bool:
  """Makes ``DynamicCache.crop(n)``, n > 0, keep the first n positions (transformers <= 5.10's
  meaning, which DeepSpec relies on) where this transformers refuses it; True if patched."""
  cache_class = transformers.DynamicCache
  probe = cache_class()
  probe.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 0)
  try:
    probe.crop(1)
    return False
  except ValueError:
    pass
  crop = cache_class.crop

  def crop_to(self, length):
    if length > 0:
      length = min(length - self.get_seq_length(), 0)
    return crop(self, length)

  cache_class.crop = crop_to
  return True


def reinit(module, torch, generator, skip=()):
  """Every parameter redrawn: norms 1 + N(0, 0.1), biases N(0, 0.5), embeddings N(0, 1), other
  matrices N(0, 1/fan_in) (logits of O(1) spread, far from ties)."""
  with torch.no_grad():
    for name, p in module.named_parameters():
      if any(name.startswith(s) for s in skip):
        continue
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
      elif name.endswith(".bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=generator))
      elif "embed" in name or "markov_w1" in name:
        p.copy_(torch.randn(p.shape, generator=generator))
      else:
        p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def margin(logits: np.ndarray) -> float:
  """The smallest top-1 - top-2 gap over the rows of [..., V] logits."""
  top = np.sort(logits.reshape(-1, logits.shape[-1]), axis=-1)
  return float((top[:, -1] - top[:, -2]).min())


def make_target(torch, transformers, directory: str, tie: bool, seed: int):
  config = transformers.Qwen3Config(tie_word_embeddings=tie, **TARGET)
  torch.manual_seed(seed)
  model = transformers.Qwen3ForCausalLM(config)
  reinit(model, torch, torch.Generator().manual_seed(seed))
  model.save_pretrained(directory)


def make_draft(torch, ds, target, case: dict, directory: str, seed: int):
  args = dict(num_draft_layers=case["num_draft_layers"], target_layer_ids=case["target_layer_ids"],
              confidence_head_alpha=1.0 if case["confidence"] else 0.0,
              markov_rank=case["markov_rank"], block_size=case["block_size"],
              mask_token_id=MASK_ID, num_anchors=64)
  if case["confidence"]:
    args["confidence_head_with_markov"] = case["with_markov"]
  if case["markov_rank"]:
    args["markov_head_type"] = case["markov_head_type"]
  config = ds.build_draft_config(target.config, _Args(args))
  torch.manual_seed(seed)
  draft = ds.Qwen3DSparkModel(config)
  reinit(draft, torch, torch.Generator().manual_seed(seed), skip=("embed_tokens", "lm_head"))
  draft.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens,
                                       lm_head=target.lm_head)
  draft.save_pretrained(directory)


class _Args(dict):
  """The attribute-and-``in`` access DeepSpec's config builder uses on its model arguments."""

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


def run_evaluator(torch, ds, target, draft_dir: str, prompt, new_tokens: int) -> dict:
  """DeepSpec's evaluator path (greedy) on `draft_dir`: every proposal and the decode."""
  draft = ds.Qwen3DSparkModel.from_pretrained(draft_dir, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
  evaluator = SimpleNamespace(draft_model=draft, max_proposal_tokens=int(draft.block_size),
                              args=SimpleNamespace(temperature=0.0, confidence_threshold=0.0))
  rounds = []
  sample = draft.sample_draft_tokens

  def recording_sample(*args, **kwargs):
    tokens, corrected = sample(*args, **kwargs)
    rounds.append({"corrected": corrected.float().numpy().copy(), "tokens": tokens.numpy().copy()})
    return tokens, corrected

  draft.sample_draft_tokens = recording_sample

  def propose(**kwargs):
    proposal = ds.Qwen3DSparkEvaluator._propose(evaluator, **kwargs)
    rounds[-1]["start"] = kwargs["start"]
    rounds[-1]["confidence"] = (None if proposal.confidence_logits is None
                                else proposal.confidence_logits.float().numpy().copy())
    return proposal

  out = ds.generate_decoding_sample(
      target_model=target, input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
      max_proposal_tokens=int(draft.block_size), temperature=0.0, stop_token_ids=None,
      init_context=functools.partial(ds.Qwen3DSparkEvaluator._init_context, evaluator),
      propose=propose, update=functools.partial(ds.Qwen3DSparkEvaluator._update, evaluator))
  return {"rounds": rounds, "output_ids": out.output_ids.numpy()[0],
          "accepted": np.asarray(out.accepted_draft_lengths, np.int64)}


RECIPE_CONFIG = "config/dspark/dspark_qwen3_4b.py"


def read_recipe(path: str, torch) -> dict:
  """DeepSpec's Qwen3-4B DSpark recipe from the exported checkout at `path` (module docstring).
  The configuration file is read, not imported (importing it loads DeepSpec's trainer and its
  logging dependencies): its ``model``, ``train`` and ``data`` ``dict(...)`` calls, literal
  arguments only."""
  import ast
  import inspect

  from deepspec.utils.optim import CosineAnnealingWarmupLR

  with open(os.path.join(path, RECIPE_CONFIG)) as f:
    tree = ast.parse(f.read())
  sections = {}
  for node in tree.body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)
        and node.targets[0].id in ("model", "train", "data")):
      values = {}
      for keyword in node.value.keywords:
        try:
          values[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
          pass                        # a class or expression (trainer_cls): not a setting
      sections[node.targets[0].id] = values
  adamw = inspect.signature(torch.optim.AdamW).parameters
  schedule = inspect.signature(CosineAnnealingWarmupLR).parameters
  return {"config": RECIPE_CONFIG, **sections,
          "adamw": {"betas": list(adamw["betas"].default), "eps": adamw["eps"].default},
          "schedule": {"eta_min": schedule["eta_min"].default}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--deepspec", required=True,
                      help="a DeepSpec checkout or bare git directory (deepseek-ai/DeepSpec)")
  parser.add_argument("--out", default=OUT, help=f"output directory (default {OUT})")
  parser.add_argument("--recipe-only", action="store_true",
                      help="refresh manifest.json's recipe alone (the DeepSpec commit must match)")
  args = parser.parse_args(argv)

  import torch
  import transformers

  patched = legacy_crop(torch, transformers)
  workdir = tempfile.mkdtemp(prefix="deepspec_")
  try:
    path, commit = export_deepspec(args.deepspec, workdir)
    sys.path.insert(0, path)
    if args.recipe_only:
      name = os.path.join(os.path.abspath(args.out), "manifest.json")
      with open(name) as f:
        manifest = json.load(f)
      if manifest["deepspec_commit"] != commit:
        raise SystemExit(f"--recipe-only: the goldens are of DeepSpec {manifest['deepspec_commit']}"
                         f", this checkout is {commit}; regenerate them all")
      manifest["recipe"] = read_recipe(path, torch)
      with open(name, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
      print(f"wrote the recipe of DeepSpec {commit} into {name}")
      return 0
    from deepspec.eval.base_evaluator import generate_decoding_sample
    from deepspec.eval.dspark.evaluator import Qwen3DSparkEvaluator
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config
    ds = SimpleNamespace(generate_decoding_sample=generate_decoding_sample,
                         Qwen3DSparkEvaluator=Qwen3DSparkEvaluator,
                         Qwen3DSparkModel=Qwen3DSparkModel, build_draft_config=build_draft_config)
    import dspark_jax as dj

    torch.set_grad_enabled(False)
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
      shutil.rmtree(out)
    os.makedirs(out)
    arrays: dict[str, np.ndarray] = {"prompt": np.asarray(PROMPT, np.int64)}
    margins: dict[str, float] = {}
    targets = {}
    for seed, kind in enumerate(("untied", "tied")):
      directory = os.path.join(out, f"target_{kind}")
      make_target(torch, transformers, directory, kind == "tied", seed)
      model = transformers.Qwen3ForCausalLM.from_pretrained(
          directory, dtype=torch.float32, attn_implementation="sdpa").eval()
      targets[kind] = model
      gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)
      arrays[f"target_{kind}.greedy"] = gen.sequences.numpy()[0, len(PROMPT):]
      margins[f"target_{kind}.greedy"] = margin(torch.stack(gen.scores).float().numpy())

    cases = []
    for case in CASES:
      name, seed, target = case["name"], case["seed"], targets[case["target"]]
      directory = os.path.join(out, f"draft_{name}")
      make_draft(torch, ds, target, case, directory, seed)
      theirs = run_evaluator(torch, ds, target, directory, PROMPT, NEW_TOKENS)
      first = theirs["rounds"][0]
      start = first["start"]
      prefix = f"{name}."
      arrays[prefix + "tokens"] = theirs["output_ids"][:start + 1][None]   # context + anchor
      arrays[prefix + "draft_tokens"] = first["tokens"]
      arrays[prefix + "corrected_logits"] = first["corrected"]
      if first["confidence"] is not None:
        arrays[prefix + "confidence_logits"] = first["confidence"]
      arrays[prefix + "decode"] = theirs["output_ids"][len(PROMPT):]
      arrays[prefix + "accepted"] = theirs["accepted"]
      second = theirs["rounds"][1]
      arrays[prefix + "second_tokens"] = theirs["output_ids"][:second["start"] + 1][None]
      arrays[prefix + "second_draft_tokens"] = second["tokens"]
      arrays[prefix + "second_corrected_logits"] = second["corrected"]
      if second["confidence"] is not None:
        arrays[prefix + "second_confidence_logits"] = second["confidence"]
      margins[prefix + "rounds"] = min(margin(r["corrected"]) for r in theirs["rounds"])

      # The same draft through dspark_jax: loaded, saved, and loaded back by DeepSpec.
      ours_dir = os.path.join(workdir, f"ours_{name}")
      jax_target, jax_draft = dj.load_pretrained(os.path.join(out, f"target_{case['target']}"),
                                                 directory)
      dj.save_pretrained(jax_draft, ours_dir, target=jax_target)
      again = run_evaluator(torch, ds, target, ours_dir, PROMPT, NEW_TOKENS)["rounds"][0]
      arrays[prefix + "ours_draft_tokens"] = again["tokens"]
      arrays[prefix + "ours_corrected_logits"] = again["corrected"]
      if again["confidence"] is not None:
        arrays[prefix + "ours_confidence_logits"] = again["confidence"]
      same = (np.array_equal(again["tokens"], first["tokens"])
              and np.array_equal(again["corrected"], first["corrected"]))
      cases.append(dict(case, draft_dir=f"draft_{name}", target_dir=f"target_{case['target']}",
                        rounds=len(theirs["rounds"]), ours_save_equal=bool(same)))
      print(f"{name}: {len(theirs['rounds'])} rounds, accepted {theirs['accepted'].tolist()}, "
            f"our save -> DeepSpec {'identical' if same else 'DIFFERENT'}")
      if not same:
        raise SystemExit(f"{name}: the draft saved by dspark_jax gives other outputs in DeepSpec")

    low = {k: v for k, v in margins.items() if v < MIN_MARGIN}
    if low:
      raise SystemExit(f"greedy choices within {MIN_MARGIN} of a tie: {low}; change the seeds")
    np.savez_compressed(os.path.join(out, "outputs.npz"), **arrays)
    manifest = {
        "deepspec_commit": commit,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": np.__version__, "dtype": "float32", "prompt": PROMPT,
        "shims": (["transformers DynamicCache.crop(n > 0) keeps the first n positions (as in "
                   "transformers 5.10.2, which DeepSpec pins)"] if patched else []),
        "new_tokens": NEW_TOKENS,
        "mask_token_id": MASK_ID, "target": TARGET, "cases": cases, "min_margins": margins,
        "recipe": read_recipe(path, torch),
        "generator": "scripts/make_deepspec_goldens.py",
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
      json.dump(manifest, f, indent=2, sort_keys=True)
      f.write("\n")
    total = sum(os.path.getsize(os.path.join(root, f))
                for root, _, files in os.walk(out) for f in files)
    print(f"wrote {out} ({total / 1e6:.2f} MB), DeepSpec {commit}")
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
