"""Issue 6 exploration: the forms of the folded block sampler, timed side by side on one device.

Lean on purpose (one device call covers every shape): for each (V, B) it compiles
`proposal.folded_block` in each requested form (`proposal.FORMS`: loop, unrolled, pallas; and the
Pallas form under other kernel options, `PALLAS_VARIANTS`) and variant (sampling, greedy-only) and
reports the median per-call time of back-to-back calls against
the HBM floor ``γ·(r·V + 2·B·V)·2 bytes / 4.27 TB/s`` (SPEC §9; the copy rate measured here is
printed too), plus the PyTorch CUDA-graph loop (`torch_reference`) when torch has CUDA. Each
sampling form is checked once against the first one run (``loop`` by default): corrected logits and
tokens. Arguments are put on the device first, as inside a decoding loop.

``--tune`` instead times the pallas form under the kernel settings it is given (rows per instance,
warps, stages, rank chunks, tiles per instance); ``--parts`` times the kernels alone against whole
programs (``--part-options`` names the kernel settings).
XLA flags are process-wide: run again under another ``XLA_FLAGS`` to compare them.

  PYTHONPATH=. python3 scripts/explore_sampler.py                # GPU, the issue's shapes
  PYTHONPATH=. python3 scripts/explore_sampler.py --tune 'num_warps=2;num_stages=2'  # settings
  PYTHONPATH=. python3 scripts/explore_sampler.py --small        # CPU smoke check
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import params as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402
import torch_reference  # noqa: E402


CALLS = bench_sampler.PIPELINE_CALLS  # back-to-back calls per timed burst (--calls)


def b2b_seconds(fn, args, repeats=20, warmup=3, calls=None):
  """Median per-call seconds of back-to-back calls (bench_sampler's "b2b" measure)."""
  return bench_sampler.pipelined_seconds(fn, args, repeats, warmup, calls or CALLS)


def chained_program(calls, **block_options):
  """One program of `calls` folded-block calls in a row, each drafting from the last one's final
  token at positions γ further on (as a decoding loop would): per-call time without the host's
  per-call dispatch, the way the sampler runs inside `decoding.generate`'s compiled loop."""
  def run(head_arrays, conf, base, anchor, hidden, greedy, temperature, seeds, positions, key):
    outs = []
    for i in range(calls):
      tokens, corrected, _ = proposal.folded_block(
          head_arrays, conf, base, anchor, hidden, greedy, temperature, seeds,
          positions + i * base.shape[1], key, kind="vanilla", **block_options)
      anchor = tokens[:, -1]
      outs.append((tokens, corrected))
    return outs
  return jax.jit(run)


def bandwidth(nbytes):
  """Copy rate (bytes read + written per second); runs ~2 s of copies first so clocks settle."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + 1)
  for _ in range(2000 if jax.default_backend() == "gpu" else 1):
    y = copy(x)
  jax.block_until_ready(y)
  return 2 * nbytes / b2b_seconds(copy, (x,), calls=20)


PART_OPTIONS = {  # kernel options for --parts, by name
    "default": (), "xc": (("draws", False),),
    "plain": (("serpentine", False), ("cache_hints", False)),  # tiles in order, no cache hints
    "xc-plain": (("draws", False), ("serpentine", False), ("cache_hints", False)),
}


def parts(vocabs, batches, gamma, rank, dtype, repeats, option_names=("default", "xc")):
  """Per (V, B): the γ kernels alone under several settings (no token choice in between, so no
  glue), then whole programs (pallas, unrolled, loop forms): the difference is the glue's cost."""
  from dspark_jax.kernels import triton_step as fused_step
  interpret = jax.default_backend() == "cpu"
  for vocab in vocabs:
    head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                   dtype=dtype)
    w2 = head.arrays()["w2"]
    for batch in batches:
      base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(dtype)
      vs = jax.random.normal(jax.random.key(2), (gamma, batch, rank), jnp.float32)
      temperature = jnp.full((batch,), 0.8, jnp.float32)
      floor = gamma * (rank * vocab + 2 * batch * vocab) * 2 / bench_sampler.SPEC_COPY_RATE
      cells = []

      tiles = vocab // sampling.vocab_tile(vocab)
      noise = jax.random.gumbel(jax.random.key(3), (gamma, batch, tiles + vocab // tiles))

      greedy = (jnp.arange(batch) % 2 == 0).astype(jnp.int32)

      def kernels(vs, w2, base, temperature, noise, greedy, greedy_only, options):
        corrected, acc = None, 0.0
        for k in range(gamma):  # a different v per step: nothing for XLA to share between steps
          corrected, tile_key, *_ = fused_step.step_stats(
              vs[k], w2, base, temperature, noise, corrected, greedy=greedy, step=k,
              greedy_only=greedy_only, interpret=interpret, **dict(options))
          acc = acc + tile_key[0, 0]
        return acc, corrected

      for name in option_names:
        options = PART_OPTIONS[name]
        for greedy_only in (True, False):
          fn = jax.jit(functools.partial(kernels, greedy_only=greedy_only, options=options))
          fargs = (vs, w2, base, temperature, noise, greedy)
          try:
            seconds = b2b_seconds(fn.lower(*fargs).compile(), fargs, repeats=repeats)
            cells.append(f"kern {'g' if greedy_only else 's'} {name} {seconds * 1e6:.1f} "
                         f"({seconds / floor:.2f})")
          except Exception as error:
            cells.append(f"kern {name} error {type(error).__name__}: {str(error)[:150]}")
      temp = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
      r = proposal.block_arrays(sp.SamplingParams(temperature=temp), np.arange(batch) % vocab,
                                np.full(batch, 1000))
      # On the device before timing: a numpy argument is copied to the GPU on every call, and
      # those copies, not the GPU, then set the pace of back-to-back calls.
      call_args = jax.device_put((head.arrays(), None, base, r["anchor"], None, r["greedy"],
                                  r["temperature"], r["seeds"], r["positions"], jax.random.key(0)))
      for form, greedy_only in (("pallas", False), ("pallas", True), ("loop", False),
                                ("unrolled", True)):
        try:
          compiled = proposal.folded_block.lower(*call_args, kind="vanilla",
                                                 greedy_only=greedy_only, form=form).compile()
          seconds = b2b_seconds(compiled, call_args, repeats=repeats)
        except Exception as error:
          cells.append(f"{form} error {type(error).__name__}: {str(error)[:150]}")
          continue
        cells.append(f"{form} {'greedy' if greedy_only else 'sampling'} {seconds * 1e6:.1f} "
                     f"({seconds / floor:.2f})")
      print(f"V={vocab} B={batch} floor {floor * 1e6:.1f}: " + " | ".join(cells), flush=True)


PALLAS_VARIANTS = {  # the Pallas form under other `pallas_options`, by name
    "pallas-xg": (("w1_in_kernel", False),),              # W1 rows gathered in XLA
    "pallas-triton": (("hopper", False),),                # never the Hopper kernels
    "pallas-hopper": (("hopper", True),),                 # the Hopper kernels (B a multiple of 64)
    "pallas-hopper-fwd": (("hopper", True), ("serpentine", False)),  # every step walks forward
    "pallas-hopper-xv": (("hopper", True), ("vectors", False)),  # sampling: W1[x] gathered in XLA
    "pallas-r128": (("rows", 128), ("num_warps", 8)),      # one row block up to 128 rows
    "pallas-w8": (("num_warps", 8),),
    "pallas-r32": (("rows", 32),),                        # more, smaller row blocks: occupancy
    "pallas-r32w8": (("rows", 32), ("num_warps", 8)),
    "pallas-r16": (("rows", 16),),
    "pallas-s4": (("num_stages", 4),),
    "pallas-plain": (("serpentine", False), ("cache_hints", False)),  # tiles in order, no hints
    "pallas-pdl": (("pdl", True),),                       # step kernels chained by PDL
    "pallas-pdlp": (("pdl", True), ("prefetch", True)),   # ... each W2 tile's first chunk early
    "pallas-nopdl": (("pdl", False),),  # the steps not chained (a Triton setting: no Hopper kernel)
    "pallas-choice": (("choice", True),),   # the token choice draws (`token_kernels.draw_tokens`)
    "pallas-choice-pdl": (("choice", True), ("pdl", True)),
    "pallas-xladraw": (("draws", False), ("choice", False)),  # XLA draws in the chosen tile
    "pallas-lateb": (("late_base", True),),  # the U_k tile loaded after the rank loop
}

def main(argv=None):
  global CALLS
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--tune", metavar="SETTINGS",
                      help="time the pallas form under kernel settings against its defaults, e.g. "
                           "'num_warps=2,num_stages=2;tiles_per_program=2'")
  parser.add_argument("--parts", action="store_true",
                      help="time the parts of a step instead: 7 kernels alone, 7 cuBLAS products")
  parser.add_argument("--forms", default="loop,unrolled,pallas,pallas-xg",
                      help=f"comma-separated: {', '.join(proposal.FORMS)} or one of "
                           f"{', '.join(PALLAS_VARIANTS)}")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--only", help="comma-separated variant names to keep, e.g. 'loop sampling'")
  parser.add_argument("--batches", help="comma-separated batch sizes (default: the issue's)")
  parser.add_argument("--vocabs", help="comma-separated vocabulary sizes (default: the issue's)")
  parser.add_argument("--part-options", default="default,xc",
                      help=f"--parts: comma-separated names from {', '.join(PART_OPTIONS)}")
  parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch CUDA graph")
  parser.add_argument("--in-program", type=int, default=0, metavar="N",
                      help="also time N calls chained inside one program (per call)")
  parser.add_argument("--calls", type=int, default=CALLS,
                      help="back-to-back calls per timed burst (default %(default)s; see "
                           "bench_sampler.PIPELINE_CALLS)")
  args = parser.parse_args(argv)
  CALLS = args.calls
  vocabs, batches = ([4096], [1, 8]) if args.small else ([129280, 151936], [1, 8, 64, 128])
  gamma, rank, dtype = 7, 256, jnp.bfloat16
  if args.tune:
    settings = [()] + [tuple((name, int(value)) for name, value in
                             (pair.split("=") for pair in setting.split(",")))
                       for setting in args.tune.split(";")]
    variants = [("pallas " + ("+".join(f"{k[:5]}{v}" for k, v in o) or "default")
                 + (" greedy" if g else " sampling"), "pallas", o, g)
                for o in settings for g in (False, True)]
  else:
    variants = [(f"{form} {'greedy' if g else 'sampling'}", form.split("-")[0],
                 PALLAS_VARIANTS.get(form, ()), g)
                for form in args.forms.split(",") for g in (False, True)]
  if args.batches:
    batches = [int(b) for b in args.batches.split(",")]
  if args.vocabs:
    vocabs = [int(v) for v in args.vocabs.split(",")]
  if args.only:
    variants = [v for v in variants if v[0] in args.only.split(",")]
  bw = bandwidth(64 * 2**20 if args.small else 2**30)
  if args.parts:
    return parts(vocabs[:1], batches, gamma, rank, dtype, args.repeats,
                 args.part_options.split(","))
  floor_bw = bw if args.small else bench_sampler.SPEC_COPY_RATE
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}, copy {bw / 1e12:.2f} TB/s measured, floor at "
        f"{floor_bw / 1e12:.2f} TB/s", flush=True)
  rows = []
  for vocab in vocabs:
    head = heads.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0),
                                   dtype=dtype)
    for batch in batches:
      base = (3.0 * jax.random.normal(jax.random.key(1), (batch, gamma, vocab))).astype(dtype)
      temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.8) if batch > 1 else np.array([0.8])
      mixed = sp.SamplingParams(temperature=temperature)
      r = proposal.block_arrays(mixed, np.arange(batch) % vocab, np.full(batch, 1000))
      # On the device before timing: a numpy argument is copied to the GPU on every call, and
      # those copies, not the GPU, then set the pace of back-to-back calls. The head's arrays
      # prepared as `DraftSampler` and `generate` prepare them (``("w2_parts", 0)``: not;
      # ``("w2_parts", 1)``: prepared at any B, e.g. for the Hopper kernel below 64 rows).
      call_args = bench_sampler.folded_args(head, base, np.arange(batch) % vocab, mixed,
                                            np.full(batch, 1000), jax.random.key(0))
      plain_args = (jax.device_put(head.arrays()), *call_args[1:])
      parts_args = (jax.device_put(proposal.prepare_head_arrays(head.arrays())), *call_args[1:])
      floor = gamma * (rank * vocab + 2 * batch * vocab) * 2 / floor_bw
      row = {"V": vocab, "B": batch, "floor": floor}
      reference = None
      for name, form, options, greedy_only in variants:
        run_args = {None: call_args, 0: plain_args, 1: parts_args}[dict(options).get("w2_parts")]
        options = tuple(o for o in options if o[0] != "w2_parts")
        try:
          compiled = proposal.folded_block.lower(
              *run_args, kind="vanilla", greedy_only=greedy_only, form=form,
              pallas_options=options).compile()
          out = jax.block_until_ready(compiled(*run_args))
          if not greedy_only:
            if reference is None:
              reference = out
            else:
              same = np.asarray(out[1]) == np.asarray(reference[1])
              row[f"{name} corrected equal"] = float(np.mean(same))
              row[f"{name} tokens equal"] = float(np.mean(np.asarray(out[0])
                                                          == np.asarray(reference[0])))
          row[name] = b2b_seconds(compiled, run_args, repeats=args.repeats)
          if args.in_program:
            chain = chained_program(args.in_program, greedy_only=greedy_only, form=form,
                                    pallas_options=options).lower(*run_args).compile()
            bursts = max(1, CALLS // args.in_program)  # about CALLS sampler calls per burst
            row[f"{name} in-program"] = b2b_seconds(chain, run_args, repeats=args.repeats,
                                                    calls=bursts) / args.in_program
        except Exception as error:  # an experiment: report and go on
          row[f"{name} error"] = f"{type(error).__name__}: {str(error)[:300]}"
      print({k: (f"{v * 1e6:.1f}us" if isinstance(v, float) and k not in ("V", "B")
                 and "equal" not in k else v) for k, v in row.items()}, flush=True)
      if torch_reference.available() and not (args.tune or args.no_torch):
        try:
          run = torch_reference.time_cuda_graph(
              np.asarray(head.arrays()["w1"], np.float32),
              np.asarray(head.arrays()["w2"], np.float32), np.asarray(base.astype(jnp.float32)),
              np.asarray(r["anchor"]), temperature, repeats=args.repeats,
              replays_per_sample=CALLS)
          row["torch graph"] = run["us"] * 1e-6
        except Exception as error:
          row["torch error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print({k: v for k, v in row.items() if k.startswith("torch")}, flush=True)
      rows.append(row)
  names = [m for n, *_ in variants for m in ([n, f"{n} in-program"] if args.in_program else [n])]
  names += (["torch graph"] if any("torch graph" in r for r in rows)
                                       else [])
  print("\n" + "\n".join(bench_sampler.ratio_table(rows, names)))


if __name__ == "__main__":
  main()
