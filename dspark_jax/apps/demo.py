"""The demo behind ``dspark-jax demo``: the shipped model pair decoding held-out prompts.

It loads the trained target and DSpark drafter shipped in ``dspark_jax/assets`` (no download), decodes
a few held-out prompts (openings of corpus files the models never saw: the Python standard library
and installed scientific packages) speculatively and plainly with the same target and sampler, and
prints the completions, τ, the per-position conditional acceptance and tokens/s of both. Greedy by
default; ``--temperature`` samples instead. A greedy run also reports how many tokens the
speculative and plain continuations share. Both are exact greedy decodes, but of the logits of
differently shaped forwards (a verify pass over γ + 1 tokens, a plain step over one), whose
low-precision matrix products may round differently on an accelerator: the two can part at a
near-tie, and then continue differently.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from dspark_jax import decoding
from dspark_jax.formats import shipped
from dspark_jax.sampling import params as sp


def _show(text: str, width: int = 96) -> str:
  lines = text.splitlines() or [""]
  return "\n".join("    | " + line[:width] for line in lines)


def run(args) -> int:
  start = time.perf_counter()
  device = jax.local_devices()[0]
  print(f"[1/4] loading the shipped models on {device.device_kind} ({device.platform}) ...",
        flush=True)
  pair = shipped.load_shipped()
  corpus = pair.manifest["corpus"]
  packages = [s["name"] for s in corpus.get("sources", []) if s["name"] != "stdlib"]
  sources = f"the Python {corpus['python_version']} standard library"
  if packages:
    sources += f" and {len(packages)} packages"
  print(f"      target {sum(x.size for x in jax.tree.leaves(nnx.state(pair.target, nnx.Param))) / 1e6:.1f} M params, "
        f"trained on {sources} ({corpus['train_files']} train files); drafter γ = "
        f"{pair.draft.config.gamma}, reading target layers {pair.draft.config.target_layer_ids}")

  if args.first_prompt >= len(pair.prompts):
    raise SystemExit(f"dspark-jax demo: error: argument --first-prompt: {args.first_prompt} is past "
                     f"the last of the {len(pair.prompts)} held-out prompts")
  texts = pair.prompts[args.first_prompt:args.first_prompt + args.prompts]
  prompts = [pair.encode(t) for t in texts]
  params = sp.SamplingParams(temperature=np.full(len(prompts), args.temperature),
                             seed=np.arange(len(prompts)))
  key = jax.random.key(args.seed)
  common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=list(pair.tokenizer.stop_token_ids))

  print(f"[2/4] speculative decoding of {len(prompts)} held-out prompts (T = {args.temperature:g}) "
        "...", flush=True)
  spec = decoding.generate(pair.target, pair.draft, prompts, params, key, **common)
  print(f"      compiled in {spec.compile_seconds:.1f} s, decoded in {spec.wall_seconds:.2f} s "
        f"({spec.path})")
  print("[3/4] plain autoregressive decoding of the same prompts ...", flush=True)
  plain = decoding.generate(pair.target, None, prompts, params, key, spec=False, **common)
  print(f"      compiled in {plain.compile_seconds:.1f} s, decoded in {plain.wall_seconds:.2f} s")

  print("[4/4] completions (prompt tail, then the speculative continuation):")
  for i, text in enumerate(texts):
    print(f"\n  prompt {i + 1}:")
    print(_show("\n".join(text.rstrip("\n").splitlines()[-3:])))
    print("  --> continuation:")
    print(_show(pair.decode(spec.tokens[i, :spec.lengths[i]])))

  acceptance = " ".join("–" if np.isnan(a) else f"{a:.2f}" for a in spec.acceptance)
  print(f"\nτ (tokens per round, accepted drafts + bonus): {spec.tau:.2f} over {spec.rounds} rounds")
  print(f"per-position conditional acceptance k = 1..{len(spec.acceptance)}: {acceptance}")
  print(f"tokens/s: speculative {spec.tokens_per_second:.0f}, plain {plain.tokens_per_second:.0f} "
        f"(x{spec.tokens_per_second / plain.tokens_per_second:.2f}; on a CPU a verify pass costs "
        "about γ+1 plain steps, so speculation pays off on accelerators)")
  if args.temperature == 0:
    shared = [_shared_prefix(spec.tokens[i, :spec.lengths[i]], plain.tokens[i, :plain.lengths[i]])
              for i in range(len(texts))]
    total = int(sum(plain.lengths))
    print(f"greedy speculative and plain outputs share {sum(shared)} of {total} tokens "
          f"(per prompt, up to the first difference: {shared})")
  print(f"done in {time.perf_counter() - start:.1f} s")
  return 0


def _shared_prefix(a, b) -> int:
  """How many leading tokens `a` and `b` share."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  return int(differ[0]) if differ.size else n
