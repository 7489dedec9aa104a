"""The sampling block storing its corrected logits against ``store_logits=False``, side by side.

For each (V, B) it times, in one side-by-side run (`benchmarks.harness`: arguments on the device,
``--calls`` back-to-back calls per sample, median of ``--repeats`` samples after ``--warmup``):

* stored: the folded sampling block (`dspark_jax.draft.block.folded_block`), which writes the
  [B, γ, V] corrected logits;
* compact: the same block with ``store_logits=False`` (`CompactLogits`: per step B floats of log q
  instead of B·V logits);
* stored+verify, compact+verify: the block and `verification.verify_arrays` in one program, given
  target logits [B, γ+1, V]: the verifier reads the stored logits, or recomputes one row per request
  (one more pass over W2).

Each program's backend is resolved from ``--backend`` on its own (`draft.block.choose_backend`);
the Hopper kernels store their logits, so with ``--backend hopper`` the compact programs fail their
precondition and are reported as n/a. Checked once per shape (`harness.compare_blocks`): the
compact block's tokens and recomputed rows against the stored block's, bit for bit where both run
on the same backend, within one ulp otherwise. Floor: the block's,
``γ·(r·V + 2·B·V)·itemsize / bandwidth`` (the verifier's own traffic is not in it).

  python -m benchmarks.bench_compact --small      # CPU smoke check
  python -m benchmarks.bench_compact              # GPU: V = 129280, 151936; B = 1, 8, 64, 128
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as dj
from benchmarks import harness
from benchmarks.bench_sampler import mixed_params, random_logits
from dspark_jax import verification
from dspark_jax.draft import block as block_lib
from dspark_jax.kernels import pallas_block

NAMES = ("stored", "compact", "stored+verify", "compact+verify")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_block_arguments(parser, calls=10, small_calls=3)
  harness.add_common_arguments(parser, repeats=20, warmup=3)
  return harness.finish_arguments(parser, parser.parse_args(argv))


def round_program(store_logits: bool, verify: bool, choice):
  """One jitted program: the sampling block on `choice`, then (with `verify`) its verification."""
  def run(head_arrays, base, anchor, greedy, temperature, seeds, positions, key, target, top_k,
          top_p, lens, stop_ids):
    tokens, law, _ = block_lib.folded_block(
        head_arrays, None, base, anchor, None, greedy, temperature, seeds, positions, key,
        kind="vanilla", greedy_only=False, store_logits=store_logits, backend=choice)
    if not verify:
      return tokens, law  # a CompactLogits leaves without its inputs: they are not copied
    if isinstance(law, block_lib.CompactLogits):
      law = law.with_inputs(base, head_arrays["w2"])
    result = verification.verify_arrays(target, tokens, law, temperature, greedy, temperature,
                                        top_k, top_p, seeds, positions, lens, stop_ids, key,
                                        greedy_only=False)
    return tokens, result.committed
  return jax.jit(run)


def bench_shape(vocab: int, batch: int, args, bandwidth: float) -> dict:
  gamma, dtype = args.gamma, harness.DTYPES[args.dtype]
  head = dj.MarkovHead.random("vanilla", vocab_size=vocab, rank=args.rank, rngs=nnx.Rngs(0),
                              dtype=dtype)
  base = random_logits(batch, gamma, vocab, dtype)
  target = (3.0 * jax.random.normal(jax.random.key(2), (batch, gamma + 1, vocab))).astype(dtype)
  params = mixed_params(batch)
  choices = {}
  for store in (True, False):
    try:
      choices[store] = block_lib.choose_backend(
          head.arrays(), base, kind="vanilla", greedy_only=False, store_logits=store,
          backend=args.backend, config=args.backend_config)
    except ValueError as exc:  # e.g. the Hopper kernels store their logits
      print(f"  store_logits={store}: {exc}", flush=True)
  arrays = pallas_block.head_arrays_for(head.arrays(), list(choices.values()))
  r = block_lib.block_arrays(params, np.arange(batch) % vocab, np.full(batch, 1000))
  call_args = harness.on_device((
      arrays, base, r["anchor"], r["greedy"], r["temperature"], r["seeds"], r["positions"],
      jax.random.key(0), target, np.asarray(params.top_k), np.asarray(params.top_p),
      np.full(batch, gamma + 1, np.int32), np.full((batch, 1), -1, np.int32)))
  programs = {name: round_program(not name.startswith("compact"), name.endswith("verify"),
                                  choices[not name.startswith("compact")])
              for name in NAMES if (not name.startswith("compact")) in choices}
  row = {"vocab": vocab, "batch": batch, "stored_backend": harness.describe_choice(choices.get(True)),
         "compact_backend": harness.describe_choice(choices.get(False)),
         "floor_s": harness.sampler_floor_seconds(vocab, batch, gamma, args.rank,
                                                  jnp.dtype(dtype).itemsize, bandwidth)}
  check = None
  if "stored" in programs and "compact" in programs:
    stored = jax.block_until_ready(programs["stored"](*call_args))
    compact = jax.block_until_ready(programs["compact"](*call_args))
    law = compact[1].with_inputs(call_args[1], call_args[0]["w2"])
    rows = jax.jit(lambda law: law.dense())(law)
    check = harness.compare_blocks(stored[0], stored[1], compact[0], rows,
                                   exact=choices[True].backend is choices[False].backend)
  row["check"] = check
  row["ok"] = check is None or check["ok"]
  seconds = harness.time_side_by_side(
      {name: (lambda p=program: p(*call_args)) for name, program in programs.items()},
      repeats=args.repeats, warmup=args.warmup, calls=args.calls)
  row.update({f"{name}_s": seconds.get(name) for name in NAMES})
  print(f"V={vocab} B={batch}: stored on {row['stored_backend']}; compact on "
        f"{row['compact_backend']}; " + ", ".join(f"{n} {s * 1e6:.1f} µs" for n, s in seconds.items())
        + ("" if check is None else f"; check {harness.check_text(check)}"), flush=True)
  return row


def table_row(r: dict) -> list[str]:
  if "error" in r:
    return [str(r["vocab"]), str(r["batch"]), "FAILED", r["error"][:40]] + [""] * (len(NAMES) + 2)
  floor, c = r["floor_s"], harness.cell
  cells = [str(r["vocab"]), str(r["batch"]), r["stored_backend"].split(":")[0] + "/" +
           r["compact_backend"].split(":")[0], c(1e6 * floor)]
  for name in NAMES:
    s = r[f"{name}_s"]
    cells.append("n/a" if s is None else f"{1e6 * s:.1f} ({s / floor:.2f})")
  ratio = (None if r["compact_s"] is None or r["stored_s"] is None
           else r["compact_s"] / r["stored_s"])
  return cells + [c(ratio, 2), "n/a" if r["check"] is None else harness.check_text(r["check"])]


def main(argv=None) -> int:
  return harness.run_block_benchmark(
      parse_args(argv), "bench_compact", bench_shape,
      ("V", "B", "backend", "floor µs") + tuple(f"{n} µs (×floor)" for n in NAMES)
      + ("compact/stored", "check"), table_row,
      "backend of stored/compact; µs per call back to back, × the block's floor")


if __name__ == "__main__":
  raise SystemExit(main())
