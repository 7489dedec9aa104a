"""Writes tests/golden/speculators/: tiny drafts saved by the `speculators` library, and what its
own modules compute from them.

Usage::

  python scripts/make_speculators_goldens.py

Needs the ``speculators`` package (PyPI; it pins transformers <= 5.19 and torch, and pulls
datasets, openai and hs-connectors, so it lives outside the ``test`` extra: install it in a
separate environment) and, for the round trip, this repository's ``dspark_jax`` importable
beside it. No module of the library is stubbed or patched.

The verifiers are the DeepSpec goldens' tiny Qwen3 targets (tests/golden/deepspec/target_*),
referred to by the relative path the library stores as ``speculators_config.verifier.name_or_path``
(``../deepspec/target_*``): the script runs in tests/golden/speculators, so the library's
``from_pretrained`` finds them there to fill the embedding and LM head, as it does for a
verifier on the Hub.

What it writes (float32):

* ``<case>/``: a draft of each case (``DSparkDraftModel`` or ``DFlashDraftModel``), its
  parameters redrawn, saved by the library's ``save_pretrained`` (``config.json`` and
  ``model.safetensors``; the copy of the library's config class source it also writes is dropped).
* ``outputs.npz``: for each case and the fixed prompt, the greedy block the library's own
  modules give: the backbone (``_backbone_forward``, eager attention, one anchor after the prompt),
  then position by position the Markov bias (``markov_head.block_bias``) on the tokens drawn so
  far, and the confidence head's logits; the same block computed from the draft as dspark_jax's
  ``save_pretrained(..., format="speculators")`` writes it, loaded by the library
  (``<case>_roundtrip_*``).
* ``manifest.json``: library versions, the cases, the smallest top-1/top-2 margin of every
  greedy choice.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "golden")
OUT = os.path.join(GOLDEN, "speculators")
PROMPT = [17, 3, 58, 41, 9, 76, 30]
MASK_ID = 95
DRAFT_INTERMEDIATE = 8    # the draft's own MLP width (the target's is 64)
MIN_MARGIN = 1e-3

CASES = (
    dict(name="dspark_vanilla", kind="dspark", seed=40, target="untied", num_layers=2,
         aux=[0, 2], rank=8, head="vanilla", confidence=True, with_markov=True, block_size=4),
    dict(name="dspark_gated", kind="dspark", seed=31, target="tied", num_layers=1, aux=[2],
         rank=8, head="gated", confidence=False, with_markov=False, block_size=3),
    dict(name="dspark_rnn", kind="dspark", seed=32, target="untied", num_layers=1, aux=[1, 2],
         rank=8, head="rnn", confidence=True, with_markov=False, block_size=5),
    dict(name="dflash", kind="dflash", seed=33, target="tied", num_layers=1, aux=[0, 1, 2],
         rank=0, confidence=False, block_size=4),
)


def reinit(module, torch, generator):
  """Every parameter redrawn: norms 1 + N(0, 0.1), biases N(0, 0.5), W1 N(0, 1), other matrices
  N(0, 1/fan_in); the verifier's embedding and LM head are left to the library."""
  with torch.no_grad():
    for name, p in module.named_parameters():
      if name.split(".")[0] in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
        continue
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
      elif name.endswith(".bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=generator))
      elif "markov_w1" in name:
        p.copy_(torch.randn(p.shape, generator=generator))
      else:
        p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def make_draft(torch, transformers, speculators, case: dict, directory: str):
  from speculators.proposals.greedy import GreedyTokenProposalConfig
  verifier = os.path.join("..", "deepspec", f"target_{case['target']}")
  layer_config = transformers.Qwen3Config.from_pretrained(verifier)
  layer_config.num_hidden_layers = case["num_layers"]
  layer_config.layer_types = ["full_attention"] * case["num_layers"]
  layer_config.intermediate_size = DRAFT_INTERMEDIATE
  layer_config.architectures = None
  layer_config._attn_implementation = "eager"
  fields = dict(
      transformer_layer_config=layer_config, draft_vocab_size=layer_config.vocab_size,
      block_size=case["block_size"], aux_hidden_state_layer_ids=case["aux"],
      mask_token_id=MASK_ID, sample_from_anchor=True,
      speculators_config=speculators.SpeculatorsConfig(
          algorithm=case["kind"],
          proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=case["block_size"])],
          default_proposal_method="greedy",
          verifier=speculators.VerifierConfig.from_pretrained(verifier)))
  if case["kind"] == "dspark":
    config = speculators.DSparkSpeculatorConfig(
        **fields, markov_rank=case["rank"], markov_head_type=case.get("head", "vanilla"),
        enable_confidence_head=case["confidence"],
        confidence_head_with_markov=case["with_markov"])
    model = speculators.DSparkDraftModel(config)
  else:
    config = speculators.DFlashSpeculatorConfig(**fields)
    model = speculators.DFlashDraftModel(config)
  reinit(model, torch, torch.Generator().manual_seed(case["seed"]))
  model.load_verifier_weights()
  model.save_pretrained(directory)
  # save_pretrained also copies the library's config class source (config.py, for auto_map and
  # trust_remote_code); the library's own loader does not read it, so it is not kept here.
  os.remove(os.path.join(directory, "config.py"))


def library_block(torch, transformers, speculators, directory: str, prompt) -> dict:
  """The greedy block the library's modules give after `prompt` (context, then the anchor)."""
  config = speculators.SpeculatorModelConfig.from_pretrained(directory)
  config.transformer_layer_config._attn_implementation = "eager"
  model = speculators.SpeculatorModel.from_pretrained(directory, config=config).eval()
  verifier = transformers.Qwen3ForCausalLM.from_pretrained(
      config.speculators_config.verifier.name_or_path, dtype=torch.float32).eval()
  gamma, anchor_pos = model.block_size, len(prompt) - 1
  ids = torch.tensor([list(prompt) + [0] * (gamma + 1)])   # after the anchor: never attended
  length = ids.shape[1]
  with torch.no_grad():
    states = verifier(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i] for i in config.aux_hidden_state_layer_ids], dim=-1)
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchor_pos] = 1                              # the one anchor select_anchors finds
    hidden, base, _, _, _ = model._backbone_forward(
        features, ids, loss_mask, states[-1], torch.zeros(1, length, dtype=torch.long),
        max_anchors=1)
    hidden = hidden.view(1, gamma, -1)
    base = base.view(gamma, -1)
    markov = getattr(model, "markov_head", None)
    previous, rows = [int(prompt[-1])], []
    for k in range(gamma):
      row = base[k]
      if markov is not None:
        prev_ids = torch.tensor([previous + [0] * (gamma - len(previous))])
        row = row + markov.block_bias(prev_token_ids=prev_ids, hidden_states=hidden)[0, k]
      rows.append(row)
      previous.append(int(row.argmax()))
    out = {"tokens": np.array(previous[1:], np.int32),
           "corrected": torch.stack(rows).numpy().astype(np.float32)}
    confidence = getattr(model, "confidence_head", None)
    if confidence is not None:
      features = hidden
      if config.confidence_head_with_markov:
        features = torch.cat([hidden, markov.prev_embeddings(torch.tensor([previous[:-1]]))], -1)
      out["confidence"] = confidence(features)[0].numpy().astype(np.float32)
  return out


def margin(logits: np.ndarray) -> float:
  top = np.sort(logits, axis=-1)
  return float((top[:, -1] - top[:, -2]).min())


def roundtrip(case: dict, directory: str, out_dir: str) -> None:
  """Loads `directory` with dspark_jax and writes it back in the speculators format."""
  sys.path.insert(0, REPO)
  import dspark_jax as dj
  target_dir = os.path.join(GOLDEN, "deepspec", f"target_{case['target']}")
  target, draft = dj.load_pretrained(target_dir, directory)
  dj.save_pretrained(draft, out_dir, target=target, format="speculators",
                     verifier=os.path.join("..", "deepspec", f"target_{case['target']}"))


def main() -> None:
  import torch
  import transformers
  import speculators
  from importlib.metadata import version
  torch.set_grad_enabled(False)
  if os.path.isdir(OUT):
    shutil.rmtree(OUT)
  os.makedirs(OUT)
  os.chdir(OUT)   # the verifiers' relative paths resolve from here
  outputs, manifest = {}, {"speculators": version("speculators"), "torch": torch.__version__,
                           "transformers": transformers.__version__, "prompt": PROMPT,
                           "cases": []}
  for case in CASES:
    name = case["name"]
    make_draft(torch, transformers, speculators, case, name)
    block = library_block(torch, transformers, speculators, name, PROMPT)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
      roundtrip(case, name, tmp)
      again = library_block(torch, transformers, speculators, tmp, PROMPT)
    for key, value in block.items():
      outputs[f"{name}_{key}"] = value
    for key, value in again.items():
      outputs[f"{name}_roundtrip_{key}"] = value
    gap = margin(block["corrected"])
    if gap < MIN_MARGIN:
      raise SystemExit(f"{name}: a greedy choice is within {gap} of a tie; change the seed")
    manifest["cases"].append({**case, "dir": name, "margin": gap,
                              "target_dir": f"../deepspec/target_{case['target']}"})
  np.savez(os.path.join(OUT, "outputs.npz"), **outputs)
  with open(os.path.join(OUT, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
