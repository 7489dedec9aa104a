"""A greedy draft step as a Hopper kernel (Pallas' Mosaic GPU backend), for large batches.

From 64 rows `fused_step`'s Triton kernel keeps L2 busy while DRAM runs at half its peak on an
H200 (BENCHMARKS.md, issue 6): every instance re-reads the Markov vectors ``v`` and, with two row
blocks, W2 from L2, and its loads are plain per-thread loads. This kernel is the other design:

* a fixed grid of `programs` instances (one per multiprocessor), each keeping all B rows of ``v``
  [B, r] in shared memory for the whole step (loaded once, by the tensor memory accelerator, TMA);
* each instance walks the vocabulary tiles p, p + P, ... (a tile is `tile` columns), with `stages`
  TMA copies of the next tiles' W2 block [r, tile] and base logits [B, tile] in flight while it
  works on the current one;
* per tile: ``v @ W2`` on the tensor cores (WGMMA, float32 accumulator), ``+ U_k``, rounded to the
  logits dtype, then each row's max and first argmax, kept as a running best over the instance's
  tiles: one pair per instance and row leaves the kernel ([P, B]), and XLA reduces the P pairs.

Greedy-only, vectors given (gather ``W1[x]`` in XLA: [B, r] is 64 KB at B = 128). The batch must be
a multiple of 64 (the tensor cores' row block) and V of `tile`. Maxima use `fused_step`'s integer
keys (NaN first, -0 = +0), so the tokens are the argmax the other forms give, up to the order in
which ``v @ W2`` is summed (in the benchmark runs they equalled the Triton kernel's everywhere).

On an H200 the greedy-only block at B = 128 took 300 µs instead of the Triton kernel's 336 µs
(V = 129280) and 311 instead of 366 µs (V = 151936); at B = 64 it was no faster (BENCHMARKS.md,
issue 6, version 19). So `proposal.folded_block` takes it by default for greedy-only blocks from
`proposal.HOPPER_FROM_BATCH` rows on a Hopper GPU (`proposal.hopper_by_default`);
``pallas_options=(("hopper", False),)`` keeps the Triton kernel, ``(("hopper", True),)`` forces it.
Tests run it in Mosaic GPU's CPU interpreter, where it is exact. `scripts/hopper_probe.py` times it.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax import fused_step
from dspark_jax import sampling

ROW_BLOCK = 64  # rows of one WGMMA instruction
_NO_TOKEN = np.int32(np.iinfo(np.int32).max)


def _interpret_params():
  # Mosaic GPU's CPU interpreter; its parameters are not exported by every jax version.
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _swizzled(width: int, itemsize: int, interpret: bool):
  """Shared-memory transforms for a [*, width] tile (none in the interpreter, which needs none)."""
  if interpret:
    return ()
  swizzle = plgpu.find_swizzle(width * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("step", "tile", "programs", "stages", "interpret"))
def greedy_partials(v, w2, base_logits, *, step, tile=64, programs=None, stages=2,
                    interpret=False):
  """Per instance and row: the max and first argmax of step `step`'s corrected logits over the
  instance's vocabulary tiles.

  Instance p of the `programs` visits tiles p, p + P, ... (`tile` columns each) in increasing
  order and keeps, per row, the best (integer key, column) pair it has seen: a later tile replaces
  it only with a strictly larger key, so the column is the first of equal maxima. One pair per
  instance and row leaves the kernel, [P, B], which XLA reduces in ~2 µs (per-tile pairs, [V/64, B],
  took 15 µs to reduce on an H200).

  Args:
    v: [B, r] the Markov vectors (cast to W2's dtype); B a multiple of 64.
    w2: [r, V] the head's second matrix. base_logits: [B, γ, V] (slice `step` is read).
    step: static block position. tile: static vocabulary columns per tile (divides V).
    programs: static grid size (None: the device's multiprocessor count; 4 when interpreting).
    stages: static tiles whose TMA copies are in flight at once (shared memory per instance:
      B·r + stages·(r + B)·tile elements).
    interpret: run in Mosaic GPU's interpreter (CPU).

  Returns:
    ``(program_max [P, B] float32, program_argmax [P, B] int32)``, the argmax as a column of V,
    with P = min(programs, V / tile).
  """
  rows, rank = v.shape
  batch, _, vocab = base_logits.shape
  if rows != batch or rows % ROW_BLOCK:
    raise ValueError(f"v: expected [{batch}, r] with the batch a multiple of {ROW_BLOCK}, got "
                     f"{v.shape}")
  if vocab % tile:
    raise ValueError(f"tile: {tile} does not divide V = {vocab}")
  if stages < 1:
    raise ValueError(f"stages: expected >= 1, got {stages}")
  tiles = vocab // tile
  if programs is None:
    programs = 4 if interpret else jax.devices()[0].core_count
  programs = min(programs, tiles)
  per_program = -(-tiles // programs)
  v = v.astype(w2.dtype)

  def kernel(v_gmem, w2_gmem, base_gmem, max_gmem, arg_gmem,
             v_smem, w2_smem, u_smem, max_smem, arg_smem, v_barrier, in_barriers):
    program = lax.axis_index("program")
    # Past the last tile an instance visits the last tile again (a pair another instance also
    # holds; it keeps every loop static).
    tile_of = lambda i: jnp.minimum(program + i * programs, tiles - 1)

    def fetch(i):
      slot, cols = lax.rem(i, stages), pl.ds(tile_of(i) * tile, tile)
      plgpu.copy_gmem_to_smem(w2_gmem.at[:, cols], w2_smem.at[slot], in_barriers.at[slot])
      plgpu.copy_gmem_to_smem(base_gmem.at[:, step, cols], u_smem.at[slot], in_barriers.at[slot])

    def tile_best(i):
      """Tile i's (key, first column) per row, once its copies have landed."""
      @pl.when(i + stages - 1 < per_program)
      def _():
        fetch(i + stages - 1)  # into the slot tile i - 1 used, which is done with it
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(in_barriers.at[slot])

      def with_accumulator(acc_ref):
        plgpu.wgmma(acc_ref, v_smem, w2_smem.at[slot])
        plgpu.wgmma_wait(0)
        u_ref = u_smem.at[slot]
        u = u_ref[...] if interpret else plgpu.load(u_ref, (), layout=plgpu.Layout.WGMMA)
        x = (acc_ref[...] + u.astype(jnp.float32)).astype(base_gmem.dtype).astype(jnp.float32)
        keys = fused_step.order_keys(x)  # NaN first, -0 = +0, as in `fused_step`
        best = jnp.max(keys, axis=1)
        lanes = (lax.broadcasted_iota(jnp.int32, x.shape, 1) if interpret else
                 plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA))
        at_best = keys == lax.broadcast_in_dim(best, x.shape, (0,))
        first = jnp.min(jnp.where(at_best, lanes + tile_of(i) * tile, _NO_TOKEN), axis=1)
        return best, first
      return pl.run_scoped(with_accumulator, plgpu.ACC((rows, tile), jnp.float32))

    def visit(i, carry):
      best, first = carry
      tile_key, tile_first = tile_best(i)
      later_wins = tile_key > best  # tiles come in column order: ties keep the earlier column
      return jnp.where(later_wins, tile_key, best), jnp.where(later_wins, tile_first, first)

    plgpu.copy_gmem_to_smem(v_gmem, v_smem, v_barrier.at[0])
    for i in range(min(stages - 1, per_program)):
      fetch(i)
    plgpu.barrier_wait(v_barrier.at[0])
    best, first = lax.fori_loop(1, per_program, visit, tile_best(0))
    max_smem[...] = fused_step.key_value(best)
    arg_smem[...] = first
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(max_smem, max_gmem.at[program])
    plgpu.copy_smem_to_gmem(arg_smem, arg_gmem.at[program])
    plgpu.wait_smem_to_gmem(0)

  itemsize = jnp.dtype(w2.dtype).itemsize
  scratch = [
      plgpu.SMEM((rows, rank), w2.dtype, transforms=_swizzled(rank, itemsize, interpret)),
      plgpu.SMEM((stages, rank, tile), w2.dtype, transforms=_swizzled(tile, itemsize, interpret)),
      plgpu.SMEM((stages, rows, tile), base_logits.dtype,
                 transforms=_swizzled(tile, jnp.dtype(base_logits.dtype).itemsize, interpret)),
      plgpu.SMEM((rows,), jnp.float32), plgpu.SMEM((rows,), jnp.int32),
      plgpu.Barrier(num_arrivals=1, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  ]
  out_type = [jax.ShapeDtypeStruct((programs, rows), jnp.float32),
              jax.ShapeDtypeStruct((programs, rows), jnp.int32)]
  run = plgpu.kernel(kernel, out_type=out_type, grid=(programs,), grid_names=("program",),
                     scratch_types=scratch,
                     **({"interpret": _interpret_params()} if interpret else {}))
  return tuple(run(v, w2, base_logits))


def tokens(program_max, program_argmax):
  """[B] int32 greedy tokens from `greedy_partials`' [P, B] pairs: the first maximum, NaN first
  (`sampling.tokens_from_tile_choices` over the instances)."""
  return sampling.tokens_from_tile_choices(program_max.T, program_argmax.T)
