"""Issue 6 exploration: candidate forms of the folded block sampler, timed side by side on one device.

Lean on purpose (one device call should cover every shape): for each (V, B) it compiles
`proposal.folded_block` in each requested form and variant and reports the median per-call time of
back-to-back calls against the HBM floor ``γ·(r·V + 2·B·V)·2 bytes / bandwidth`` (bandwidth measured
here), plus the PyTorch CUDA-graph loop (`torch_reference`) when torch has CUDA. Forms:

* ``loop``: `lax.fori_loop` with outputs written in place (the library default);
* ``unrolled``: the γ steps traced one after another, outputs stacked (no loop condition on the
  device, no zero-initialised buffers);
* ``pallas``: `fused_step.fused_block`, one Pallas kernel per step (experimental; sampling variant
  only, Threefry noise, so its tokens are other draws: only its corrected logits are compared).

Each form is checked once against the ``loop`` form (tokens equal where the corrected logits are
bit-identical). XLA flags are process-wide: run the script again under another ``XLA_FLAGS`` to
compare them (the flags in effect are printed).

  PYTHONPATH=. python3 scripts/explore_sampler.py                # GPU, the issue's shapes
  PYTHONPATH=. python3 scripts/explore_sampler.py --small        # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import fused_step, heads, proposal
from dspark_jax import sampling_params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402
import torch_reference  # noqa: E402


def b2b_seconds(fn, args, repeats=20, warmup=3, calls=10):
  """Median per-call seconds of back-to-back calls (bench_sampler's "b2b" measure)."""
  return bench_sampler.pipelined_seconds(fn, args, repeats, warmup, calls)


def bandwidth(nbytes):
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  return 2 * nbytes / b2b_seconds(jax.jit(lambda a: a + 1), (x,), calls=5)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--forms", default="loop,unrolled,pallas")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  vocabs, batches = ([4096], [1, 8]) if args.small else ([129280, 151936], [1, 8, 64, 128])
  gamma, rank, dtype = 7, 256, jnp.bfloat16
  forms = args.forms.split(",")
  bw = bandwidth(64 * 2**20 if args.small else 2**30)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}, copy {bw / 1e12:.2f} TB/s", flush=True)
  rows = []
  for vocab in vocabs:
    head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                   dtype=dtype)
    for batch in batches:
      base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(dtype)
      temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
      mixed = sp.SamplingParams(temperature=temperature)
      r = proposal.block_arrays(mixed, np.arange(batch) % vocab, np.full(batch, 1000))
      call_args = (head.arrays(), None, base, r["anchor"], None, r["greedy"], r["temperature"],
                   r["seeds"], r["positions"], jax.random.key(0))
      floor = gamma * (rank * vocab + 2 * batch * vocab) * 2 / bw
      row = {"V": vocab, "B": batch, "floor": floor}
      reference = None
      for form in forms:
        if form == "pallas":
          w = head.arrays()
          pallas_args = (w["w1"], w["w2"], base, r["anchor"], r["greedy"], r["temperature"],
                         r["seeds"], r["positions"], jax.random.key(0))
          try:
            compiled = fused_step.fused_block.lower(
                *pallas_args, interpret=jax.default_backend() == "cpu").compile()
            out = jax.block_until_ready(compiled(*pallas_args))
            row["pallas corrected ok"] = bool(np.mean(np.asarray(out[1]) == np.asarray(reference[1]))
                                              > 0.999) if reference is not None else None
            row["pallas sampling"] = b2b_seconds(compiled, pallas_args, repeats=args.repeats)
          except Exception as error:  # an experiment: report and go on
            row["pallas error"] = f"{type(error).__name__}: {str(error)[:200]}"
          continue
        for greedy_only in (False, True):
          compiled = proposal.folded_block.lower(
              *call_args, kind="vanilla", greedy_only=greedy_only,
              unroll=form == "unrolled").compile()
          out = jax.block_until_ready(compiled(*call_args))
          if not greedy_only:
            if reference is None:
              reference = out
            else:
              same = np.all(np.asarray(out[1]) == np.asarray(reference[1]), axis=(1, 2))
              row[f"{form} tokens ok"] = bool(np.array_equal(np.asarray(out[0])[same],
                                                             np.asarray(reference[0])[same]))
          name = f"{form} {'greedy' if greedy_only else 'sampling'}"
          row[name] = b2b_seconds(compiled, call_args, repeats=args.repeats)
      if torch_reference.available():
        run = torch_reference.time_cuda_graph(
            np.asarray(head.arrays()["w1"], np.float32), np.asarray(head.arrays()["w2"], np.float32),
            np.asarray(base.astype(jnp.float32)), np.asarray(r["anchor"]), temperature,
            repeats=args.repeats)
        row["torch graph"] = run["us"] * 1e-6
      rows.append(row)
      print({k: (f"{v * 1e6:.1f}us" if isinstance(v, float) else v) for k, v in row.items()},
            flush=True)
  names = [k for k in rows[0] if k not in ("V", "B", "floor") and not k.endswith("ok")
           and not k.endswith("error")]
  print("\n| V | B | floor µs | " + " | ".join(f"{n} µs (×floor)" for n in names) + " |")
  print("|---:|---:|---:|" + "---:|" * len(names))
  for row in rows:
    cells = " | ".join(f"{row[n] * 1e6:.1f} ({row[n] / row['floor']:.2f})" if n in row else "n/a"
                       for n in names)
    print(f"| {row['V']} | {row['B']} | {row['floor'] * 1e6:.1f} | {cells} |")


if __name__ == "__main__":
  main()
