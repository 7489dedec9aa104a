"""One draft step as one Pallas kernel: the corrected logits and their tile statistics in one pass.

Step k of the block (SPEC §3) needs ``L_k = U_k + v_k @ W2`` (v_k from the Markov head), stored in the
logits dtype, and then a token sampled from the stored values. Written in XLA, the bias ``v @ W2``
leaves cuBLAS as a float32 [B, V] array that the add, the store and the sampler read back; here one
kernel per (row block, vocabulary tile) does it all while the tile is in registers:

* ``bias = v[rows] @ W2[:, tile]`` in float32 (``W2[:, tile]`` is read once for the whole row block);
* ``corrected = round(U_k[rows, tile] + bias)`` written straight into slice k of the [B, γ, V] output
  (sampling variant only);
* per row: the tile's max, its first argmax (NaN first) and its log-mass ``logsumexp(corrected / T)``
  (`sampling.tile_log_mass`, the same expression).

The statistics are all `sampling.tokens_from_tile_stats` needs: greedy rows reduce the (max, argmax)
pairs, sampled rows draw a tile from the log-masses and then a token inside it (two-level Gumbel-max,
see `sampling`). So HBM sees W2, U_k and the corrected logits once each per step: the floor's traffic
(row blocks after the first find their W2 tile in L2: they run next to each other). Measured on an
H200, the γ kernels alone run at 1.45-2.2x that floor and the whole folded program at 2-5x
(BENCHMARKS.md, issue 6): the small XLA programs that pick each token cost the difference.

Rows are masked, not padded (no copy of U for a batch below the block height); the vocabulary tile is
`sampling.vocab_tile(V)`, which must be at least 16 (the matrix unit's minimum), so V must be a
multiple of 16. Runs through Pallas' Triton lowering on GPUs and in its interpreter on the CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax import sampling

MIN_ROWS = 16  # a dot on the matrix units needs at least 16 rows
MIN_TILE = 16


def supports(vocab: int) -> bool:
  """Whether the kernel can run at vocabulary size `vocab` (a tile of >= 16 columns divides it)."""
  return sampling.vocab_tile(vocab) >= MIN_TILE


def row_block(batch: int, limit: int = 64) -> int:
  """Rows per kernel instance: the batch rounded up to a power of two, within [16, `limit`]."""
  return max(MIN_ROWS, min(limit, 1 << max(batch - 1, 0).bit_length()))


def _one_tile(j, v_ref, w2_ref, base_ref, temp_ref, corrected_ref, max_ref, arg_ref, mass_ref, *,
              row0, step, batch, rows, tile, k_chunk):
  """Vocabulary tile `j` for rows ``row0 .. row0 + rows``: corrected logits and their statistics."""
  col0 = j * tile
  cols, row_slice = pl.ds(col0, tile), pl.ds(row0, rows)
  row_ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 0)
  in_batch = row_ids < batch
  window = (row_slice, jnp.int32(step), cols)

  def load_v(columns, width):  # rows past the batch read as zeros: v is not padded
    mask = (row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0)) < batch
    return plgpu.load(v_ref.at[row_slice, columns], mask=mask, other=0.0)

  base = plgpu.load(base_ref.at[window], mask=in_batch, other=0.0)
  precision = jax.lax.Precision.HIGHEST if w2_ref.dtype == jnp.float32 else None  # no TF32
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
  if k_chunk is None:
    bias = dot(load_v(pl.ds(0, w2_ref.shape[0]), w2_ref.shape[0]), w2_ref[:, cols])
  else:  # a loop over rank chunks lets Triton pipeline the W2 loads
    def partial_bias(kk, acc):
      chunk = pl.ds(kk * k_chunk, k_chunk)
      return acc + dot(load_v(chunk, k_chunk), w2_ref[chunk, cols])
    bias = jax.lax.fori_loop(0, w2_ref.shape[0] // k_chunk, partial_bias,
                             jnp.zeros((rows, tile), jnp.float32))
  corrected = (base.astype(jnp.float32) + bias).astype(base_ref.dtype)
  if corrected_ref is not None:
    plgpu.store(corrected_ref.at[window], corrected, mask=in_batch)
  x = corrected.astype(jnp.float32)
  columns = col0 + jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 1)
  big = jnp.int32(np.iinfo(np.int32).max)
  is_nan = jnp.isnan(x)
  any_nan = jnp.max(is_nan.astype(jnp.int32), axis=1) > 0
  clean = jnp.where(is_nan, -jnp.inf, x)
  best = jnp.max(clean, axis=1)
  first_best = jnp.min(jnp.where(clean == best[:, None], columns, big), axis=1)
  first_nan = jnp.min(jnp.where(is_nan, columns, big), axis=1)
  tile_max = jnp.where(any_nan, jnp.nan, best)
  # Statistics are [rows, tiles]: row-major, so the reduction over tiles reads contiguous memory.
  max_ref[row_slice, j] = tile_max
  arg_ref[row_slice, j] = jnp.where(any_nan, first_nan, first_best)
  if mass_ref is not None:
    valid = (row0 + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)) < batch
    temperature = plgpu.load(temp_ref.at[row_slice], mask=valid, other=1.0)
    mass_ref[row_slice, j] = sampling.tile_log_mass(x, tile_max, temperature)


def _kernel(v_ref, w2_ref, base_ref, temp_ref, *refs, tiles, tiles_per_program, greedy_only,
            **static):
  if greedy_only:
    (max_ref, arg_ref), corrected_ref, mass_ref = refs, None, None
  else:
    *_, corrected_ref, max_ref, arg_ref, mass_ref = refs  # an aliased input may come first
  block, group = pl.program_id(0), pl.program_id(1)
  run = functools.partial(_one_tile, v_ref=v_ref, w2_ref=w2_ref, base_ref=base_ref,
                          temp_ref=temp_ref, corrected_ref=corrected_ref, max_ref=max_ref,
                          arg_ref=arg_ref, mass_ref=mass_ref, row0=block * static["rows"],
                          **static)
  if tiles_per_program == 1:
    run(group)
    return

  def body(t, carry):
    j = group * tiles_per_program + t

    @pl.when(j < tiles)
    def _():
      run(j)
    return carry

  jax.lax.fori_loop(0, tiles_per_program, body, 0)


@functools.partial(jax.jit, static_argnames=("step", "greedy_only", "rows", "num_warps",
                                             "num_stages", "k_chunk", "tiles_per_program",
                                             "interpret"))
def step_stats(v, w2, base_logits, temperature, corrected, *, step, greedy_only, rows=None,
               num_warps=None, num_stages=3, k_chunk=64, tiles_per_program=1,
               interpret=False):
  """Runs the kernel for block position `step`.

  Args:
    v: [B, r] the Markov head's vector for this step (``W1[x_prev]`` for a vanilla head); cast to
      W2's dtype. w2: [r, V].
    base_logits: [B, γ, V] the backbone's logits (row `step` is read).
    temperature: [B] float32 clamped draft temperatures.
    corrected: [B, γ, V] the buffer to write slice `step` of (aliased in place), or None to allocate
      it (its other slices are then unwritten); ignored by the greedy-only variant.
    step: static block position. greedy_only: no corrected logits, no log-masses.
    rows: static rows per kernel instance (default `row_block(B)`).
    num_warps, num_stages: Triton's (None: its default); 3 stages pipeline the W2 loads.
    k_chunk: static rank chunk of the in-kernel loop over r (None: one dot over all of r). 64
      with 3 stages measured fastest on an H200 (BENCHMARKS.md); a rank it does not divide falls
      back to one dot.
    tiles_per_program: vocabulary tiles one kernel instance walks through (a smaller grid).
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    ``(corrected [B, γ, V] | None, tile_max [B, V/c], tile_argmax [B, V/c], tile_mass [B, V/c] | None)``.
  """
  batch, rank = v.shape
  vocab = w2.shape[1]
  tile = sampling.vocab_tile(vocab)
  if tile < MIN_TILE:
    raise ValueError(f"w2: vocab {vocab} has no power-of-two tile >= {MIN_TILE}; use the XLA form")
  rows = rows or row_block(batch)
  if k_chunk is not None and (rank % k_chunk or k_chunk < MIN_TILE):
    k_chunk = None
  blocks = -(-batch // rows)
  padded = blocks * rows
  v = v.astype(w2.dtype)
  temperature = temperature.astype(jnp.float32)
  stat = lambda dtype: jax.ShapeDtypeStruct((padded, vocab // tile), dtype)
  out_shape = [stat(jnp.float32), stat(jnp.int32)]
  inputs = [v, w2, base_logits, temperature]
  aliases = {}
  if not greedy_only:
    out_shape = [jax.ShapeDtypeStruct(base_logits.shape, base_logits.dtype), *out_shape,
                 stat(jnp.float32)]
    if corrected is not None:
      inputs.append(corrected)
      aliases = {len(inputs) - 1: 0}
  tiles = vocab // tile
  groups = -(-tiles // tiles_per_program)
  params = {name: value for name, value in (("num_warps", num_warps),
                                             ("num_stages", num_stages)) if value}
  outs = pl.pallas_call(
      functools.partial(_kernel, step=step, batch=batch, rows=rows, tile=tile, k_chunk=k_chunk,
                        tiles=tiles, tiles_per_program=tiles_per_program,
                        greedy_only=greedy_only),
      grid=(blocks, groups),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(**params) if params else None,
      interpret=interpret,
  )(*inputs)
  if greedy_only:
    tile_max, tile_arg = outs
    return None, tile_max[:batch], tile_arg[:batch], None
  corrected, tile_max, tile_arg, mass = outs
  return corrected, tile_max[:batch], tile_arg[:batch], mass[:batch]
