"""The folded draft-block sampler against its memory floor and the eager path (SPEC §9).

For every (V, B) it builds a vanilla Markov head with random weights and a `DraftSampler`
(``mode="force"``, ``max_batch_size=B``: the variants compiled at bucket B, nothing padded; backend
from ``--backend``; an explicit backend that the sampler's smaller buckets cannot run, e.g. Hopper's
multiples of 64 rows, gets the variants compiled alone and no propose column), checks the variants
against the eager loop once, then times side by side (`benchmarks.harness`; arguments on the
device, median of ``--repeats`` samples after ``--warmup`` calls):

* sampling: the compiled sampling variant on a mixed batch (even rows greedy, odd rows T = 0.8;
  B = 1: one sampled row), back to back (``--calls`` per sample: device time), and once per sample
  ("sync": with its launch and sync latency);
* greedy: the compiled greedy-only variant on an all-greedy batch, the same two ways;
* propose: `DraftSampler.propose` end to end on the mixed batch (host routing and transfers);
* eager: `dspark_jax.sample_block_eager` (γ step programs called from Python);
* torch: where torch has CUDA, the same loop in PyTorch captured in a CUDA graph
  (`benchmarks.torch_reference`, SGLang's approach), per replay of back-to-back replays.

Floor: ``γ·(r·V + 2·B·V)·itemsize / bandwidth`` (per step read W2 and the base logits, write the
corrected logits; `harness.floor_bandwidth`). The check ("check" column; the exit status is 1 if
any shape fails it): on the XLA backend the folded sampling variant's tokens and corrected logits
equal the eager path's bit for bit, and so do the greedy-only variant's tokens (eager with all rows
greedy); on a kernel backend the corrected logits are within one ulp of the eager ones at
positions whose earlier tokens agree, and token agreement is only reported
(`harness.compare_blocks`); ``propose`` must return the sampling variant's tokens exactly.

  python -m benchmarks.bench_sampler --small                    # CPU smoke check, seconds
  python -m benchmarks.bench_sampler                            # GPU: V = 129280, 151936; B = 1, 8, 64, 128
  python -m benchmarks.bench_sampler --vocab 129280 --batch 8,128 --backend triton --json out.json
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import harness
from benchmarks import torch_reference
from dspark_jax.draft import block as block_lib
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block

SAMPLED_TEMPERATURE = 0.8


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_block_arguments(parser, calls=harness.PIPELINE_CALLS, small_calls=5)
  parser.add_argument("--no-torch", action="store_true",
                      help="skip the PyTorch CUDA-graph reference even where torch has CUDA")
  harness.add_common_arguments(parser, repeats=30, warmup=5)
  return harness.finish_arguments(parser, parser.parse_args(argv))


def mixed_params(batch: int) -> dj.SamplingParams:
  """Even rows greedy, odd rows sampled; a lone row is sampled, so there is always a sampled row."""
  if batch == 1:
    temperature = np.array([SAMPLED_TEMPERATURE])
  else:
    temperature = np.where(np.arange(batch) % 2 == 0, 0.0, SAMPLED_TEMPERATURE)
  return dj.SamplingParams(temperature=temperature, seed=np.arange(batch))


def greedy_params(batch: int) -> dj.SamplingParams:
  return dj.SamplingParams(temperature=np.zeros(batch), seed=np.arange(batch))


def random_logits(batch: int, gamma: int, vocab: int, dtype) -> jax.Array:
  """[B, γ, V] normal·3 logits in `dtype` (drawn in float32 inside one program)."""
  draw = jax.jit(lambda k: (3.0 * jax.random.normal(k, (batch, gamma, vocab), jnp.float32)
                            ).astype(dtype))
  return draw(jax.random.key(1))


def variant_args(arrays, base_logits, anchor, params, positions, key) -> tuple:
  """A compiled variant's arguments (vanilla head, no confidence head, no hidden), on the device."""
  rows = block_lib.block_arrays(params, anchor, positions)
  return harness.on_device((arrays, None, base_logits, rows["anchor"], None, rows["greedy"],
                            rows["temperature"], rows["seeds"], rows["positions"], key))


def bench_shape(vocab: int, batch: int, args, bandwidth: float) -> dict:
  """Builds, checks and times one (V, B); returns its result row."""
  gamma, rank, dtype = args.gamma, args.rank, harness.DTYPES[args.dtype]
  head = dj.MarkovHead.random("vanilla", vocab_size=vocab, rank=rank, rngs=nnx.Rngs(0), dtype=dtype)
  base_logits = harness.on_device(random_logits(batch, gamma, vocab, dtype))
  anchor = jnp.asarray(np.arange(batch) % vocab, jnp.int32)
  positions = jnp.full((batch,), 1000, jnp.int32)
  key = jax.random.key(0)
  mixed, greedy = mixed_params(batch), greedy_params(batch)

  start = time.perf_counter()
  try:
    sampler = dj.build_draft_sampler(head, max_batch_size=batch, vocab_size=vocab, gamma=gamma,
                                     logits_dtype=dtype, mode="force", backend=args.backend,
                                     config=args.backend_config)
    choices = {g: sampler.choice(g, batch) for g in (False, True)}
    every_choice = list(sampler.backends.values())  # the arrays the sampler compiled for
  except ValueError as exc:
    # An explicit backend that a smaller padding bucket of the sampler cannot run (the Hopper
    # kernels take multiples of 64 rows): the variants alone, at this batch, without propose.
    print(f"  no DraftSampler ({exc}); timing the variants without propose", flush=True)
    sampler = None
    choices = {g: block_lib.choose_backend(head.arrays(), base_logits, kind="vanilla",
                                           greedy_only=g, backend=args.backend,
                                           config=args.backend_config) for g in (False, True)}
    every_choice = list(choices.values())
  arrays = pallas_block.head_arrays_for(head.arrays(), every_choice)
  args_of = {g: variant_args(arrays, base_logits, anchor, greedy if g else mixed, positions, key)
             for g in (False, True)}
  executables = {g: sampler.compile_variant(g, batch) if sampler is not None else
                 block_lib.folded_block.lower(*args_of[g], kind="vanilla", greedy_only=g,
                                              backend=choices[g]).compile()
                 for g in (False, True)}
  build_s = time.perf_counter() - start
  sampling_choice, greedy_choice = choices[False], choices[True]
  (sampling_exe, mixed_args), (greedy_exe, greedy_args) = (
      (executables[g], args_of[g]) for g in (False, True))

  # The checks, once: the folded variants against the eager reference, propose against the variant.
  tokens, corrected, _ = jax.block_until_ready(sampling_exe(*mixed_args))
  eager = dj.sample_block_eager(head, base_logits, anchor, None, mixed, key, positions)
  check = harness.compare_blocks(eager.tokens, eager.corrected_logits, tokens, corrected,
                                 exact=sampling_choice.backend is dispatch.Backend.XLA)
  greedy_tokens, _, _ = greedy_exe(*greedy_args)
  eager_greedy = dj.sample_block_eager(head, base_logits, anchor, None, greedy, key, positions)
  greedy_check = harness.compare_blocks(eager_greedy.tokens, None, greedy_tokens, None,
                                        exact=greedy_choice.backend is dispatch.Backend.XLA)
  propose = lambda: sampler.propose(base_logits, anchor, None, mixed, key, positions)
  propose_equal = None
  if sampler is not None:
    propose_equal = bool(np.array_equal(np.asarray(propose().tokens), np.asarray(tokens)))
  del tokens, corrected, eager, eager_greedy, greedy_tokens

  b2b = harness.time_side_by_side({
      "sampling": lambda: sampling_exe(*mixed_args),
      "greedy": lambda: greedy_exe(*greedy_args),
      **({} if sampler is None else {"propose": propose}),
      "eager": lambda: dj.sample_block_eager(head, base_logits, anchor, None, mixed, key, positions),
  }, repeats=args.repeats, warmup=args.warmup, calls=args.calls)
  sync = harness.time_side_by_side({
      "sampling": lambda: sampling_exe(*mixed_args),
      "greedy": lambda: greedy_exe(*greedy_args),
  }, repeats=args.repeats, warmup=args.warmup, calls=1)

  torch_s = None
  if not args.no_torch and torch_reference.available():
    w = head.arrays()
    torch_s = 1e-6 * torch_reference.time_cuda_graph(
        np.asarray(w["w1"], np.float32), np.asarray(w["w2"], np.float32),
        np.asarray(base_logits.astype(jnp.float32)), np.asarray(anchor),
        np.asarray(mixed.temperature), repeats=args.repeats, warmup=args.warmup,
        replays_per_sample=args.calls)["us"]

  floor_s = harness.sampler_floor_seconds(vocab, batch, gamma, rank, jnp.dtype(dtype).itemsize,
                                          bandwidth)
  us = lambda s: None if s is None else 1e6 * s
  over = lambda s: None if s is None else s / floor_s
  result = {
      "vocab": vocab, "batch": batch, "gamma": gamma, "rank": rank, "dtype": args.dtype,
      "sampling_backend": sampling_choice.name, "sampling_reason": sampling_choice.reason,
      "greedy_backend": greedy_choice.name, "greedy_reason": greedy_choice.reason,
      "build_s": build_s,
      "gate": None if sampler is None else sampler.decision.summary(),
      "floor_us": us(floor_s),
      "sampling_us": us(b2b["sampling"]), "sampling_x_floor": over(b2b["sampling"]),
      "greedy_us": us(b2b["greedy"]), "greedy_x_floor": over(b2b["greedy"]),
      "sampling_sync_us": us(sync["sampling"]), "greedy_sync_us": us(sync["greedy"]),
      "propose_us": us(b2b.get("propose")), "eager_us": us(b2b["eager"]),
      "eager_over_sampling": b2b["eager"] / b2b["sampling"],
      "torch_cuda_graph_us": us(torch_s), "torch_x_floor": over(torch_s),
      "torch_over_sampling": None if torch_s is None else torch_s / b2b["sampling"],
      "check": check, "greedy_check": greedy_check, "propose_tokens_equal": propose_equal,
      "ok": check["ok"] and greedy_check["ok"] and propose_equal is not False,
  }
  print(f"V={vocab} B={batch}: sampling on {harness.describe_choice(sampling_choice)}; greedy on "
        f"{harness.describe_choice(greedy_choice)}; built in {build_s:.1f} s", flush=True)
  print(f"  check vs eager ({check['mode']}): tokens {check['tokens_equal']:.4f} equal, logits "
        f"{harness.cell(check['logits_equal'], 4)} equal, max |Δ| "
        f"{harness.cell(check['max_abs_diff'], 4)}; greedy tokens "
        f"{greedy_check['tokens_equal']:.4f} equal; propose == folded {propose_equal}", flush=True)
  print(f"  µs: floor {us(floor_s):.1f}, sampling {result['sampling_us']:.1f} (sync "
        f"{result['sampling_sync_us']:.1f}), greedy {result['greedy_us']:.1f} (sync "
        f"{result['greedy_sync_us']:.1f}), propose {harness.cell(result['propose_us'])}, eager "
        f"{result['eager_us']:.1f}, torch {harness.cell(result['torch_cuda_graph_us'])}", flush=True)
  return result


HEADER = ("V", "B", "backend", "floor µs", "sampling µs", "×floor", "greedy µs", "×floor",
          "sync µs", "propose µs", "eager µs", "eager/samp", "torch µs", "×floor", "check")


def table_row(r: dict) -> list[str]:
  if "error" in r:
    return [str(r["vocab"]), str(r["batch"]), "FAILED"] + [""] * (len(HEADER) - 4) + [r["error"][:40]]
  c = harness.cell
  return [str(r["vocab"]), str(r["batch"]), f"{r['sampling_backend']}/{r['greedy_backend']}",
          c(r["floor_us"]), c(r["sampling_us"]), c(r["sampling_x_floor"], 2), c(r["greedy_us"]),
          c(r["greedy_x_floor"], 2), c(r["sampling_sync_us"]), c(r["propose_us"]), c(r["eager_us"]),
          c(r["eager_over_sampling"], 2), c(r["torch_cuda_graph_us"]), c(r["torch_x_floor"], 2),
          check_cell(r)]


def check_cell(r: dict) -> str:
  """The sampling variant's check against eager, or which other check failed."""
  if not r["greedy_check"]["ok"]:
    return "NO:greedy"
  if r["propose_tokens_equal"] is False:
    return "NO:propose"
  return harness.check_text(r["check"])


def main(argv=None) -> int:
  return harness.run_block_benchmark(
      parse_args(argv), "bench_sampler", bench_shape, HEADER, table_row,
      "backend of sampling/greedy; µs per call back to back, sync: one call with its sync")


if __name__ == "__main__":
  raise SystemExit(main())
