"""Issue 6 experiment: what one persistent kernel for all γ steps of a block would be worth.

Every step kernel so far streams all of W2 (66 MB at V = 129280, r = 256) from DRAM at every step,
as SPEC §9's floor counts, and ends, so that a separate kernel can choose the step's tokens. Here
one instance per multiprocessor runs all γ steps of ``v @ W2`` part by part on the tensor cores
(v fixed, B rows, each row's max kept so that the work is used), with

* the same parts at every step (instance p: parts p, p + P, ...; odd steps walk them backwards),
  so that a step starts on the parts the step before left in L2, and `keep` of them held in
  shared memory for the whole block (the rest through a ring of `stages` TMA copies that runs on
  across the steps);
* a grid-wide barrier between the steps (`hopper_block.grid_barrier`: a global semaphore
  counting arrivals; every instance must be resident, one per multiprocessor);
* optionally (``--io``) each part's U_k read and ``round(v @ W2 + U_k)`` written, as a sampling
  step does, in the block's [B, γ, V] layout or tiled [γ, V/64, B, 64] (``--tiled``);
* optionally (``--choice``) the round trip a token choice inside the kernel needs at each step's
  end: every instance publishes its [B] row maxima, passes the barrier, loads all instances'
  maxima, reduces them, turns 8 rows' maxima into stand-in tokens and gathers those rows of W1
  into its v by TMA;
* for comparison (``--split``) the same work as one kernel per step, without the barrier.

No sampling epilogue and no real token choice: it bounds what a persistent sampling block could
reach. BENCHMARKS.md (issue 6, version 38) has the H200's numbers. Needs a Hopper GPU (the
semaphores do not run in the CPU interpreter); ``--lower`` only lowers the kernels for CUDA (a
CPU host can do that).

  PYTHONPATH=. python3 scripts/resident_probe.py --variants '0,5;2,3' --barrier both --split
  PYTHONPATH=. python3 scripts/resident_probe.py --io --rows 128 --variants '0,3' --choice

A variant is ``keep,stages`` (shared memory: (B + (keep + stages) · 64) · r bf16 values, within
227 KB: keep + stages <= 5 at 64 rows); ``--io``, ``--choice`` and ``--split`` need keep = 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax.kernels import hopper_step
from dspark_jax.hopper_block import grid_barrier, reset_barrier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402

GAMMA, RANK, PART = 7, 256, hopper_step.PART


def resident_steps(v, w2_parts, base=None, *, keep, stages, programs, gamma=GAMMA,
                   serpentine=True, barrier=True, step0=0, corrected_ref=None, w1=None):
  """[P, B] each row's max of ``v @ W2`` over the instance's parts and all steps (v fixed).

  With `base` [B, γ, V] (and `keep` = 0) each streamed part also reads its U_k part and writes
  ``round(v @ W2 + U_k)`` to a [B, γ, V] output, as a sampling step does (returned second), or
  in place into `corrected_ref` (a GMEM ``jax.Ref``). `step0` is the block position of the first
  of the `gamma` steps (one kernel per step: `split_steps`).

  `base` may also come tiled, [γ, V/64, B, 64] (each part's rows one run of memory), and the
  corrected logits are then written in that layout.

  With `w1` [V, r] each step ends as a block's step would, with stand-in tokens: every instance
  stores its rows' maxima ([B] float32) to a [γ, P', B] buffer, passes the grid-wide barrier,
  loads all instances' maxima back ([P', B], P' = P rounded up to 64), reduces them over the
  instances, turns the first 8 rows' maxima into tokens, gathers those rows of `w1` by TMA and
  makes them rows 0-7 of its v (through its own [B, r] buffer in global memory): the round trip
  a token choice inside the kernel needs."""
  io = base is not None
  tiled = io and base.ndim == 4  # [γ, V/64, B, 64]
  choice = w1 is not None
  if choice and not barrier:
    raise ValueError("w1: the token round trip needs the barrier")
  if io and keep:
    raise ValueError("base: only with keep = 0")
  rows, rank = v.shape
  parts = w2_parts.shape[0]
  if tiled and base.shape[1:] != (parts, rows, PART):
    raise ValueError(f"base: tiled as [γ, {parts}, {rows}, {PART}], got {base.shape}")
  per_program = -(-parts // programs)
  streamed = per_program - keep
  if streamed < 1 or stages < 1:
    raise ValueError(f"keep={keep}, stages={stages}: {per_program} parts per instance")
  total = gamma * streamed

  padded_programs = -(-programs // 64) * 64

  def kernel(*refs):
    refs = list(refs)
    take = lambda flag: refs.pop(0) if flag else None
    v_gmem, w2_gmem, base_gmem, w1_gmem = take(1), take(1), take(io), take(choice)
    out_gmem, corrected_gmem, pairs_gmem, v_scratch = take(1), take(io), take(choice), take(choice)
    v_smem, kept_smem, ring_smem, u_smem, out_smem = take(1), take(1), take(1), take(io), take(1)
    pairs_smem, token_smem, stage_smem = take(choice), take(choice), take(choice)
    v_barrier, kept_barriers, ring_barriers = take(1), take(1), take(1)
    choice_barriers, row_barrier = take(choice), take(choice)
    assert not refs
    program = lax.axis_index("program")
    arrive = pl.get_global(plgpu.SemaphoreType.REGULAR)
    done = pl.get_global(plgpu.SemaphoreType.REGULAR)
    part_of = lambda j: jnp.minimum(program + j * programs, parts - 1)

    def streamed_part(t):
      """The part the t-th streamed copy of the block fetches (odd steps walk backwards)."""
      step, j = step0 + t // streamed, lax.rem(t, streamed)
      if serpentine:
        j = jnp.where(lax.rem(step, 2) == 1, streamed - 1 - j, j)
      return part_of(keep + j)

    def logits_part(ref, t):
      """The t-th streamed part's [B, 64] block of [B, γ, V] logits, or of tiled [γ, V/64, B, 64]
      ones (one run of memory)."""
      step, part = step0 + t // streamed, streamed_part(t)
      if tiled:
        return ref.at[step, part]
      return ref.at[:, step, pl.ds(part * PART, PART)]

    def fetch(t):
      slot = lax.rem(t, stages)
      plgpu.copy_gmem_to_smem(w2_gmem.at[streamed_part(t)], ring_smem.at[slot],
                              ring_barriers.at[slot])
      if io:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's logits are stored from it
        plgpu.copy_gmem_to_smem(logits_part(base_gmem, t), u_smem.at[slot], ring_barriers.at[slot])

    def product_corrected(t, slot):
      """Part t's ``round(v @ W2 + U_k)``, written over its U_k part and stored; its row max."""
      def with_accumulator(acc_ref):
        plgpu.wgmma(acc_ref, v_smem, ring_smem.at[slot])
        acc = plgpu.wgmma_accumulator_load(acc_ref)
        u_part = u_smem.at[slot]
        u = plgpu.load(u_part, (), layout=plgpu.Layout.WGMMA)
        logits = (acc + u.astype(jnp.float32)).astype(base_gmem.dtype)
        u_part[...] = logits
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(u_part, logits_part(corrected_gmem, t))
        return jnp.max(logits.astype(jnp.float32), axis=1)
      return pl.run_scoped(with_accumulator, plgpu.ACC((rows, PART), jnp.float32))

    def product_max(w_ref):
      def with_accumulator(acc_ref):
        plgpu.wgmma(acc_ref, v_smem, w_ref)
        return jnp.max(plgpu.wgmma_accumulator_load(acc_ref), axis=1)
      return pl.run_scoped(with_accumulator, plgpu.ACC((rows, PART), jnp.float32))

    plgpu.copy_gmem_to_smem(v_gmem, v_smem, v_barrier.at[0])
    for j in range(keep):
      plgpu.copy_gmem_to_smem(w2_gmem.at[part_of(j)], kept_smem.at[j], kept_barriers.at[j])
    for t in range(min(stages - 1, total)):
      fetch(t)
    plgpu.barrier_wait(v_barrier.at[0])
    for j in range(keep):
      plgpu.barrier_wait(kept_barriers.at[j])
    if choice:  # the instance's own copy of v, whose first 8 rows each step replaces
      plgpu.copy_smem_to_gmem(v_smem, v_scratch.at[program])
      plgpu.wait_smem_to_gmem(0)

    def token_round_trip(k, best):
      """Publish, barrier, reduce over the instances, gather W1 rows into v (see the docstring)."""
      out_smem[...] = best
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, pairs_gmem.at[k, program])
      plgpu.wait_smem_to_gmem(0)
      grid_barrier(arrive, programs, k + 1)
      plgpu.copy_gmem_to_smem(pairs_gmem.at[k], pairs_smem, choice_barriers.at[0])
      plgpu.barrier_wait(choice_barriers.at[0])
      maxima = plgpu.load(pairs_smem, (), layout=plgpu.Layout.WGMMA)
      instance = plgpu.broadcasted_iota(jnp.int32, maxima.shape, 0, layout=plgpu.Layout.WGMMA)
      maxima = jnp.max(jnp.where(instance < programs, maxima, -jnp.inf), axis=0)
      token_smem[...] = lax.rem(jnp.abs(maxima * 1000.0).astype(jnp.int32), w1_gmem.shape[0])
      plgpu.commit_smem()
      for b in range(8):
        plgpu.copy_gmem_to_smem(w1_gmem.at[pl.ds(token_smem[b], 1)], stage_smem.at[pl.ds(b, 1)],
                                row_barrier.at[0])
      plgpu.barrier_wait(row_barrier.at[0])
      plgpu.copy_smem_to_gmem(stage_smem, v_scratch.at[program, pl.ds(0, 8)])
      plgpu.wait_smem_to_gmem(0)
      plgpu.copy_gmem_to_smem(v_scratch.at[program], v_smem, choice_barriers.at[1])
      plgpu.barrier_wait(choice_barriers.at[1])

    def step(k, best):
      def one_streamed(j, best):
        t = k * streamed + j

        @pl.when(t + stages - 1 < total)
        def _():
          fetch(t + stages - 1)
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(ring_barriers.at[slot])
        if io:
          return jnp.maximum(best, product_corrected(t, slot))
        return jnp.maximum(best, product_max(ring_smem.at[slot]))
      best = lax.fori_loop(0, streamed, one_streamed, best)
      for j in range(keep):
        best = jnp.maximum(best, product_max(kept_smem.at[j]))
      if choice:
        token_round_trip(k, best)
      elif barrier:
        grid_barrier(arrive, programs, k + 1)
      return best

    first = jnp.full((rows,), -jnp.inf, jnp.float32)
    first = plgpu.layout_cast(first, plgpu.Layout.WGMMA.reduce(1))
    best = lax.fori_loop(0, gamma, step, first)
    if barrier:
      reset_barrier(arrive, done, program, programs, gamma)
    out_smem[...] = best
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[program])
    plgpu.wait_smem_to_gmem(0)

  swizzled = lambda width: hopper_step._swizzled(width, 2, False)
  scratch = [
      plgpu.SMEM((rows, rank), v.dtype, transforms=swizzled(rank)),
      plgpu.SMEM((keep, rank, PART) if keep else (1, 8, PART), w2_parts.dtype,
                 transforms=swizzled(PART)),
      plgpu.SMEM((stages, rank, PART), w2_parts.dtype, transforms=swizzled(PART)),
      *([plgpu.SMEM((stages, rows, PART), base.dtype, transforms=swizzled(PART))] if io else []),
      plgpu.SMEM((rows,), jnp.float32),
      *([plgpu.SMEM((padded_programs, rows), jnp.float32,
                    transforms=hopper_step._swizzled(rows, 4, False)),
         plgpu.SMEM((rows,), jnp.int32), plgpu.SMEM((8, rank), v.dtype)] if choice else []),
      plgpu.Barrier(num_arrivals=1, num_barriers=1),
      plgpu.Barrier(num_arrivals=1, num_barriers=max(keep, 1)),
      plgpu.Barrier(num_arrivals=2 if io else 1, num_barriers=stages),
      *([plgpu.Barrier(num_arrivals=1, num_barriers=2),
         plgpu.Barrier(num_arrivals=8, num_barriers=1)] if choice else []),
  ]
  out_type = [jax.ShapeDtypeStruct((programs, rows), jnp.float32)]
  if choice:
    extra_out = [jax.ShapeDtypeStruct((gamma, padded_programs, rows), jnp.float32),
                 jax.ShapeDtypeStruct((programs, rows, rank), v.dtype)]
  if corrected_ref is not None:  # written in place, as hopper_step.sampling_partials does
    if choice:
      raise ValueError("corrected_ref: not with w1")

    def body(corrected, v_gmem, w2_gmem, base_gmem, out_gmem):
      pl.run_scoped(lambda *scratch_refs: kernel(v_gmem, w2_gmem, base_gmem, out_gmem, corrected,
                                                 *scratch_refs), *scratch)
    run = pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(grid=(programs,),
                                                             grid_names=("program",)))
    return tuple(run(corrected_ref, v, w2_parts, base))
  if io:
    out_type.append(jax.ShapeDtypeStruct(base.shape, base.dtype))
  if choice:
    out_type.extend(extra_out)
  run = plgpu.kernel(kernel, out_type=out_type, grid=(programs,), grid_names=("program",),
                     scratch_types=scratch)
  return tuple(run(v, w2_parts, *([base] if io else []), *([w1] if choice else [])))


def split_steps(v, w2_parts, base=None, *, stages, programs, gamma=GAMMA):
  """The same work as `resident_steps` with keep = 0, as one kernel per step (no barrier): what
  persistence itself is worth."""
  corrected = None if base is None else hopper_step.new_corrected(base.shape, base.dtype)
  best = []
  for k in range(gamma):
    outs = resident_steps(v, w2_parts, base, keep=0, stages=stages, programs=programs, gamma=1,
                          barrier=False, step0=k, corrected_ref=corrected)
    best.append(outs[0])
  best = jnp.max(jnp.stack(best), axis=0)
  return (best,) if base is None else (best, jax.freeze(corrected))


def corrected(v, w2_parts, base):
  """[B, γ, V] ``round(v @ W2 + U_k)`` at every step (v fixed), in XLA (tiled `base`: tiled)."""
  if base.ndim == 4:
    gamma, parts, rows, part = base.shape
    flat = base.transpose(2, 0, 1, 3).reshape(rows, gamma, parts * part)
    return corrected(v, w2_parts, flat).reshape(rows, gamma, parts, part).transpose(1, 2, 0, 3)
  product = jnp.einsum("br,prc->bpc", v.astype(jnp.float32), w2_parts.astype(jnp.float32))
  product = product.reshape(v.shape[0], 1, -1)
  return (product + base.astype(jnp.float32)).astype(base.dtype)


def reference(v, w2_parts, base=None):
  """Each row's max of ``v @ W2`` (with `base`: of the corrected logits, over all steps) over all
  parts, in float32 (the probe's answer, reduced)."""
  if base is not None:
    out = corrected(v, w2_parts, base).astype(jnp.float32)
    return out.max(axis=(0, 1, 3)) if out.ndim == 4 else out.max(axis=(1, 2))
  products = jnp.einsum("br,prc->bpc", v.astype(jnp.float32), w2_parts.astype(jnp.float32))
  return products.max(axis=(1, 2))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", default="0,4;4,2;5,1")
  parser.add_argument("--vocabs", default="129280,151936")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--lower", action="store_true", help="only lower for CUDA (CPU host)")
  parser.add_argument("--io", action="store_true",
                      help="also read U_k and write the corrected logits per part (keep = 0)")
  parser.add_argument("--tiled", action="store_true",
                      help="with --io: U_k and the corrected logits tiled, [γ, V/64, B, 64]")
  parser.add_argument("--choice", action="store_true",
                      help="also time the token round trip at each step's end (keep = 0)")
  parser.add_argument("--split", action="store_true",
                      help="also time keep = 0 as one kernel per step (no barrier)")
  parser.add_argument("--programs", type=int, default=None, help="instances (default: one per SM)")
  parser.add_argument("--barrier", choices=("on", "off", "both"), default="both")
  args = parser.parse_args(argv)
  variants = [tuple(int(x) for x in item.split(",")) for item in args.variants.split(";")]
  programs = args.programs or (132 if args.lower else jax.devices()[0].core_count)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, programs {programs}",
        flush=True)
  table = []
  for vocab in (int(x) for x in args.vocabs.split(",")):
    w2 = (0.05 * jax.random.normal(jax.random.key(0), (RANK, vocab))).astype(jnp.bfloat16)
    w2p = hopper_step.w2_parts(w2)
    v = jax.random.normal(jax.random.key(1), (args.rows, RANK)).astype(jnp.bfloat16)
    base = ((3 * jax.random.normal(jax.random.key(2), (args.rows, GAMMA, vocab))).astype(
        jnp.bfloat16) if args.io else None)
    if args.tiled:  # the same values, tiled: [γ, V/64, B, 64]
      base = base.reshape(args.rows, GAMMA, vocab // PART, PART).transpose(1, 2, 0, 3)
    floor_us = GAMMA * (RANK + (2 * args.rows if args.io else 0)) * vocab * 2 / 4.27e12 * 1e6
    want = None if args.lower else np.asarray(reference(v, w2p, base))
    for keep, stages in variants:
      forms = {"on": (True,), "off": (False,), "both": (False, True)}[args.barrier]
      if args.split and keep == 0:
        forms = forms + ("split",)
      if args.choice and keep == 0:
        forms = forms + ("choice",)
      for barrier in forms:
        name = f"keep={keep},stages={stages}" + {True: "", False: ",nobarrier",
                                                 "split": ",per-step", "choice": ",choice"}[barrier]
        if barrier == "choice":
          w1 = (0.05 * jax.random.normal(jax.random.key(3), (vocab, RANK))).astype(jnp.bfloat16)
          fn = jax.jit(lambda v, w, b, stages=stages, w1=w1: resident_steps(
              v, w, b, keep=0, stages=stages, programs=programs, w1=w1))
        elif barrier == "split":
          fn = jax.jit(lambda v, w, b, stages=stages: split_steps(v, w, b, stages=stages,
                                                                  programs=programs))
        else:
          fn = jax.jit(lambda v, w, b, keep=keep, stages=stages, barrier=barrier: resident_steps(
              v, w, b, keep=keep, stages=stages, programs=programs, barrier=barrier))
        if args.lower:
          fn.trace(v, w2p, base).lower(lowering_platforms=("cuda",))
          print(f"V={vocab} {name}: lowered", flush=True)
          continue
        outs = fn(v, w2p, base)
        got = np.asarray(outs[0]).max(axis=0)
        # with the round trip v changes from step to step: only finite maxima are checked
        ok = (np.isfinite(got).all() if barrier == "choice" else
              np.allclose(got, want, rtol=1e-2, atol=1e-2))
        if args.io and barrier != "choice":  # the corrected logits, against XLA's
          ok &= bool(np.allclose(np.asarray(outs[1], np.float32), np.asarray(corrected(v, w2p, base),
                                 np.float32), rtol=2e-2, atol=5e-2))
        seconds = bench_sampler.pipelined_seconds(fn, (v, w2p, base), args.repeats, 3)
        table.append((vocab, name, seconds * 1e6, floor_us, ok))
        print(f"V={vocab} {name}: {seconds * 1e6:.1f} us (floor {floor_us:.1f}), "
              f"equal={ok}", flush=True)
  print("\nV        variant                      us    x floor  equal")
  for vocab, name, us, floor_us, ok in table:
    print(f"{vocab:<8} {name:<28} {us:7.1f} {us / floor_us:6.2f}     {ok}")


if __name__ == "__main__":
  main()
