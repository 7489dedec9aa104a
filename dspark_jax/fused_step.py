"""A draft step in Pallas: the corrected logits and their tile statistics in one pass (`step_stats`),
and optionally the token choice as a second kernel (`choose_tokens`).

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

`choose_tokens` (opt-in, not yet measured on a GPU) does that token choice in a kernel: per row block
it reduces the statistics in chunks of 128 tiles, draws the tile from noise drawn up front, reads
the chosen tile of the stored logits again, draws the token, and gathers ``W1[token]`` for the next
step's `step_stats`; so a vanilla head's step is two kernels and nothing else. It is bit-identical to
`sampling.tokens_from_tile_stats` in the interpreter (tested).

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


_BIG_INDEX = np.iinfo(np.int32).max


def _row_first_max(values, indices):
  """Per row of [R, C]: (max, index of its first occurrence), a NaN beating everything (its first).

  `sampling.argmax_last`'s semantics, in operations the Triton lowering has.
  """
  big = jnp.int32(_BIG_INDEX)
  is_nan = jnp.isnan(values)
  any_nan = jnp.max(is_nan.astype(jnp.int32), axis=1) > 0
  clean = jnp.where(is_nan, -jnp.inf, values)
  best = jnp.max(clean, axis=1)
  first_best = jnp.min(jnp.where(clean == best[:, None], indices, big), axis=1)
  first_nan = jnp.min(jnp.where(is_nan, indices, big), axis=1)
  return jnp.where(any_nan, jnp.nan, best), jnp.where(any_nan, first_nan, first_best)


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
  tile_max, tile_arg = _row_first_max(x, columns)
  # Statistics are [rows, tiles]: row-major, so the reduction over tiles reads contiguous memory.
  max_ref[row_slice, j] = tile_max
  arg_ref[row_slice, j] = tile_arg
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
                                             "batch", "keep_padding", "interpret"))
def step_stats(v, w2, base_logits, temperature, corrected, *, step, greedy_only, rows=None,
               num_warps=None, num_stages=3, k_chunk=64, tiles_per_program=1, batch=None,
               keep_padding=False, interpret=False):
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
    batch: static B when `v` carries padding rows past it (`choose_tokens`' output); default
      ``v.shape[0]``. keep_padding: return the statistics with their padding rows ([P, V/c]).
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    ``(corrected [B, γ, V] | None, tile_max [B, V/c], tile_argmax [B, V/c], tile_mass [B, V/c] | None)``.
  """
  rank = v.shape[1]
  batch = batch or v.shape[0]
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
  cut = (lambda x: x) if keep_padding else (lambda x: x[:batch])
  if greedy_only:
    tile_max, tile_arg = outs
    return None, cut(tile_max), cut(tile_arg), None
  corrected, tile_max, tile_arg, mass = outs
  return corrected, cut(tile_max), cut(tile_arg), cut(mass)


# ---- the token choice as a kernel (opt-in: ``pallas_options=(("fused_choice", True),)``) ----------

CHOICE_CHUNK = 128  # tiles reduced per loop iteration of the choice kernel


def _choice_kernel(max_ref, arg_ref, mass_ref, noise_ref, greedy_ref, temp_ref, corrected_ref,
                   w1_ref, tokens_ref, e_ref, *, step, batch, rows, gamma, tile, greedy_only):
  """One row block: reduce the tile statistics, draw tile and token, gather the next W1 rows."""
  row0 = pl.program_id(0) * rows
  row_slice = pl.ds(row0, rows)
  row_ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  valid = row_ids < batch
  tiles = max_ref.shape[1]
  vocab = tiles * tile

  def chunk(c, carry):
    g_val, g_idx, s_val, s_idx = carry
    cols = c * CHOICE_CHUNK + jax.lax.broadcasted_iota(jnp.int32, (rows, CHOICE_CHUNK), 1)
    inside = cols < tiles
    window = (row_slice, pl.ds(c * CHOICE_CHUNK, CHOICE_CHUNK))
    tile_max = plgpu.load(max_ref.at[window], mask=inside, other=-jnp.inf)
    tile_arg = plgpu.load(arg_ref.at[window], mask=inside, other=_BIG_INDEX)
    # Masked columns carry -inf and the largest index, so they never win over a real column.
    val, idx = _row_first_max(tile_max, jnp.where(inside, tile_arg, _BIG_INDEX))
    g_val, g_idx = sampling.first_max_merge((g_val, g_idx), (val, idx))
    if not greedy_only:
      noise_mask = inside & valid[:, None]
      score = (plgpu.load(mass_ref.at[window], mask=inside, other=-jnp.inf)
               + plgpu.load(noise_ref.at[window], mask=noise_mask, other=0.0))
      val, idx = _row_first_max(score, jnp.where(inside, cols, _BIG_INDEX))
      s_val, s_idx = sampling.first_max_merge((s_val, s_idx), (val, idx))
    return g_val, g_idx, s_val, s_idx

  start = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.full((rows,), _BIG_INDEX, jnp.int32))
  _, tokens, _, chosen = jax.lax.fori_loop(0, -(-tiles // CHOICE_CHUNK), chunk, start + start)
  if not greedy_only:
    # Inside the chosen tile: Gumbel-max over its logits (read again: one tile per row).
    lanes = jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 1)
    first = jnp.where(valid, chosen, 0) * tile
    flat = (jnp.where(valid, row_ids, 0) * gamma + step) * vocab
    logits = plgpu.load(corrected_ref.at[flat[:, None] + first[:, None] + lanes],
                        mask=valid[:, None], other=0.0)
    temperature = plgpu.load(temp_ref.at[row_slice], mask=valid, other=1.0)
    noise = plgpu.load(noise_ref.at[row_slice, pl.ds(tiles, tile)], mask=valid[:, None], other=0.0)
    _, within = _row_first_max(logits.astype(jnp.float32) / temperature[:, None] + noise, lanes)
    greedy = plgpu.load(greedy_ref.at[row_slice], mask=valid, other=1) != 0
    tokens = jnp.where(greedy, tokens, first + within)
  tokens = jnp.where(valid, tokens, 0)
  tokens_ref[row_slice] = tokens
  rank = w1_ref.shape[1]
  # A gather: every index an array of one shape (the interpreter has no mixed array/slice loads).
  token_rows = jnp.broadcast_to(tokens[:, None], (rows, rank))
  e_ref[row_slice, :] = plgpu.load(
      w1_ref.at[token_rows, jax.lax.broadcasted_iota(jnp.int32, (rows, rank), 1)])


@functools.partial(jax.jit, static_argnames=("step", "greedy_only", "rows", "batch", "interpret"))
def choose_tokens(tile_max, tile_arg, tile_mass, noise, greedy, temperature, corrected, w1, *,
                  step, greedy_only, batch, rows=None, interpret=False):
  """`sampling.tokens_from_tile_stats` (and the greedy reduction) as one kernel, plus ``W1[tokens]``.

  Args:
    tile_max, tile_arg, tile_mass: [P, V/c] from `step_stats` (P >= B padded rows; `tile_mass`
      ignored when `greedy_only`). noise: [B, V/c + c] (`sampling.tile_noise`).
    greedy: [B] bool. temperature: [B] float32. corrected: [B, γ, V] (slice `step` is read).
    w1: [V, r] the head's first matrix. step: static position. batch: static B.

  Returns:
    ``(tokens [P] int32 (rows past B are 0), e [P, r] = W1[tokens] in W1's dtype)``.
  """
  padded, tiles = tile_max.shape
  rows = rows or row_block(batch)
  vocab = w1.shape[0]
  tile = vocab // tiles
  gamma = 1 if greedy_only else corrected.shape[1]
  unused = jnp.zeros((1, 1), jnp.float32)  # greedy-only reads no masses, noise or logits
  unblocked = [pl.no_block_spec] * 8
  inputs = (tile_max, tile_arg, unused if greedy_only else tile_mass,
            unused if greedy_only else noise, greedy.astype(jnp.int32),
            temperature.astype(jnp.float32), unused.reshape(-1) if greedy_only
            else corrected.reshape(-1), w1)
  return pl.pallas_call(
      functools.partial(_choice_kernel, step=step, batch=batch, rows=rows, gamma=gamma, tile=tile,
                        greedy_only=greedy_only),
      grid=(padded // rows,),
      in_specs=unblocked,
      out_specs=[pl.no_block_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((padded,), jnp.int32),
                 jax.ShapeDtypeStruct((padded, w1.shape[1]), w1.dtype)],
      interpret=interpret,
  )(*inputs)
