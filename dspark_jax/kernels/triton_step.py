"""A draft step in Pallas: the corrected logits and everything the token choice needs, in one pass.

Step k of the block needs ``L_k = U_k + v_k @ W2`` (v_k from the Markov head), stored in the
logits dtype, and then a token drawn from the stored values. Written in XLA, the bias ``v @ W2``
leaves cuBLAS as a float32 [B, V] array that the add, the store and the sampler read back; here one
kernel per (row block, vocabulary tile) does it all while the tile is in registers:

* ``v`` is given, or gathered in the kernel as ``W1[tokens]`` (a vanilla head: no XLA between steps
  but the token choice);
* ``bias = v[rows] @ W2[:, tile]`` in float32 (``W2[:, tile]`` is read once for the whole row block);
* ``corrected = round(U_k[rows, tile] + bias)`` written straight into slice k of the [B, γ, V] output
  (sampling variant only);
* per row and tile, the (key, token) pair the row's choice maximises over the tiles
  (`sampling.tile_choices`): for a greedy row the max and its first column (NaN first); for a
  sampled row the tile's *score* (its log-mass ``logsumexp(corrected / T)``,
  `sampling.tile_log_mass`, plus the tile's Gumbel draw, or the log-mass alone when the token
  choice adds the draw) and, with ``draws``, the tile's *draw* ``argmax(corrected / T + G_inner)``,
  the token the tile would give if chosen, or else the tile's first column. Every tile uses the
  row's same inner noise, so drawing in every tile and keeping the chosen tile's draw is the same
  draw as reading the chosen tile afterwards (`sampling` explains the two-level draw). One
  first-max serves both kinds of row (a greedy row's over the logits, a sampled row's over
  ``corrected / T + G_inner``).

The token choice is one reduction over the tiles: XLA's (`sampling.tokens_from_tile_choices`), or
a kernel of the chain below (`token_kernels`). Without draws the chosen tile is read again: by
`token_kernels.draw_tokens`, which also adds the tiles' noise (the default from 64 rows), or by
XLA (`sampling.tokens_in_chosen_tiles`). The draws cost arithmetic on every logit, so they pay at
small batches only. HBM sees W2, U_k and the corrected logits once each per step, the floor's traffic (row
blocks after the first find their W2 tile in L2: they run next to each other). W2 is larger than an
H200's L2, so odd steps walk the tiles backwards (``serpentine``) and start on the tiles the step
before left in L2, and loads carry cache hints that keep W2 and stream the rest (BENCHMARKS.md
has the measured × floor). Row maxima use integer keys that
order like the floats (`order_keys`): Triton's float max drops NaN, and the keys need two
reductions where explicit NaN handling needs four.

On sm_90+ GPUs the step kernels can form a chain by programmatic dependent launch (``pdl``):
each lets the stream's next kernel launch while it runs and waits on the GPU before it reads its
rows' tokens (the first step kernel after `token_kernels.block_noise`: before it reads the
noise), and the token kernels of `token_kernels` take part in the chain.

Rows are masked, not padded (no copy of U for a batch below the block height); the vocabulary tile is
`sampling.vocab_tile(V)`, which must be at least 16 (the matrix unit's minimum), so V must be a
multiple of 16. Runs through Pallas' Triton lowering on GPUs and in its interpreter on the CPU (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.sampling import sampler as sampling

MIN_ROWS = 16  # a dot on the matrix units needs at least 16 rows
MIN_TILE = 16


def supports(vocab: int) -> bool:
  """Whether the kernel can run at vocabulary size `vocab` (a tile of >= 16 columns divides it)."""
  return sampling.vocab_tile(vocab) >= MIN_TILE


def row_block(batch: int, limit: int = 64) -> int:
  """Rows per kernel instance: the batch rounded up to a power of two, within [16, `limit`]."""
  return max(MIN_ROWS, min(limit, 1 << max(batch - 1, 0).bit_length()))


BIG_INDEX = np.iinfo(np.int32).max
_SIGN_FREE = np.int32(0x7FFFFFFF)  # every bit but the sign


def order_keys(values):
  """float32 -> int32 keys with the floats' order (-0 = +0), every NaN above +inf.

  A float's bits read as a signed integer are ordered for positives and reversed for negatives;
  flipping the magnitude bits of negatives fixes that. One integer max then replaces a float max
  plus the NaN bookkeeping (Triton's float max ignores NaN).
  """
  bits = jax.lax.bitcast_convert_type(jnp.where(values == 0.0, 0.0, values), jnp.int32)
  keys = bits ^ ((bits >> 31) & _SIGN_FREE)
  return jnp.where(jnp.isnan(values), _SIGN_FREE, keys)


def key_value(keys):
  """The float32 of `order_keys` (NaN for the NaN key)."""
  bits = keys ^ ((keys >> 31) & _SIGN_FREE)
  return jnp.where(keys == _SIGN_FREE, jnp.nan, jax.lax.bitcast_convert_type(bits, jnp.float32))


def pdl_supported() -> bool:
  """Whether the default device runs programmatic dependent launch (an NVIDIA GPU, sm_90+)."""
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not capability:
    return False
  try:
    return float(capability) >= 9.0
  except ValueError:  # not a CUDA capability
    return False


def launch_control(instruction, lanes, interpret):
  """`lanes` unchanged, after the PTX `instruction` (programmatic dependent launch, sm_90+).

  ``griddepcontrol.launch_dependents`` lets the stream's next kernel launch (its instances then
  start as resources free up); ``griddepcontrol.wait`` holds the instance until the kernels
  before it have finished and their writes are visible. XLA launches a kernel that waits so that
  it may start early (`scripts/pdl_probe.py`). Passing the lanes through orders the instruction
  before every load indexed by them. A no-op in the interpreter.
  """
  if interpret:
    return lanes
  [same] = plgpu.elementwise_inline_asm(
      f"griddepcontrol.{instruction}; mov.b32 $0, $1;", args=[lanes], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(lanes.shape, lanes.dtype)])
  return same


def early_lanes(count, pdl, interpret):
  """iota(`count`), after letting the next kernel launch and, unless `pdl` is "first" or "late",
  waiting for the kernels before (see `step_stats`)."""
  lanes = jax.lax.broadcasted_iota(jnp.int32, (count,), 0)
  if not pdl:
    return lanes
  lanes = launch_control("launch_dependents", lanes, interpret)
  return lanes if pdl in ("first", "late") else launch_control("wait", lanes, interpret)


def row_first_max(values, indices):
  """Per row of [R, C]: (max, index of its first occurrence), a NaN beating everything (its first).

  `sampling.argmax_last`'s semantics, in operations the Triton lowering has.
  """
  keys = order_keys(values)
  best = jnp.max(keys, axis=1)
  first = jnp.min(jnp.where(keys == best[:, None], indices, jnp.int32(BIG_INDEX)), axis=1)
  return key_value(best), first


def one_tile(j, v, w1_ref, w2_ref, base_ref, temp_ref, noise_ref, greedy_ref, corrected_ref, *,
             row0, step, batch, rows, tile, tiles, k_chunk, cache_hints, late_base, draws,
             with_law=False, w2_first=None, wait_late=False, row_ids=None, interpret=False):
  """Vocabulary tile `j` for rows ``row0 .. row0 + rows``: writes the corrected logits (sampling
  variant) and returns each row's (key, token) pair for the tile, [rows] float32 and int32.
  The body of this module's kernel and of `fused_block`'s persistent one (inside a Pallas kernel).

  `v` is the [rows] int32 tokens whose ``W1`` rows to gather when `w1_ref` is given (rows past the
  batch read token 0), else the ref of the [B, r] vectors. `with_law` (sampling variant): also
  return each row's tile log-mass and, with `draws`, its draw's corrected logit (else None): the
  draft law without the logits (`step_stats(store_logits=False)`). `w2_first`: the tile's first
  rank chunk of W2, loaded before the kernel waited (`step_stats(prefetch=True)`). `wait_late`:
  wait for the kernels before only once the tile's logits are formed, before reading the noise,
  temperatures and greedy mask (`step_stats(pdl="late")`). `row_ids`: the [rows] row indices,
  ``row0 + iota`` (None), or the same passed through a wait (`early_lanes`): every masked load
  and store then comes after the wait. The sampling variant has `greedy_ref`; with `noise_ref`
  None a sampled row's key is the tile's log-mass alone. (Its row inputs load after the rank
  loop: loaded before it, they held registers through it and were slower on an H200,
  BENCHMARKS.md.)
  """
  col0 = j * tile
  cols, row_slice = pl.ds(col0, tile), pl.ds(row0, rows)
  if row_ids is None:
    row_ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  valid = row_ids < batch
  in_batch = jnp.broadcast_to(valid[:, None], (rows, tile))
  window = (row_slice, jnp.int32(step), cols)
  rank = w2_ref.shape[0]
  # U_k and the corrected logits pass once; W2 is kept (`_w2_chunk`).
  stream = "evict_first" if cache_hints else None

  def load_v(start, width):  # rows past the batch read as zeros: v is not padded
    mask = jnp.broadcast_to(valid[:, None], (rows, width))
    if w1_ref is None:
      return plgpu.load(v.at[row_slice, pl.ds(start, width)], mask=mask, other=0.0)
    lanes = start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    token_rows = jnp.broadcast_to(v[:, None], (rows, width))
    return plgpu.load(w1_ref.at[token_rows, lanes], mask=mask, other=0.0).astype(w2_ref.dtype)

  load_base = lambda: plgpu.load(base_ref.at[window], mask=in_batch, other=0.0,
                                 eviction_policy=stream)

  def load_rows(valid, in_batch):
    """The epilogue's row inputs: temperatures, greedy flags, inner noise, the tile's noise."""
    temperature = plgpu.load(temp_ref.at[row_slice], mask=valid, other=1.0)
    inner = tile_draw = None
    if draws:
      inner = plgpu.load(noise_ref.at[jnp.int32(step), row_slice, pl.ds(tiles, tile)],
                         mask=in_batch, other=0.0)
    if noise_ref is not None:
      tile_draw = plgpu.load(noise_ref.at[jnp.int32(step), row_slice, j], mask=valid, other=0.0)
    return temperature, load_greedy(greedy_ref, row_slice, valid), inner, tile_draw

  if not late_base:  # early: its latency hides behind the rank loop, but it holds registers there
    base = load_base()
  precision = jax.lax.Precision.HIGHEST if w2_ref.dtype == jnp.float32 else None  # no TF32
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
  load_w2 = lambda start, width: _w2_chunk(w2_ref, start, width, j, tile, cache_hints)
  if k_chunk is None:
    bias = dot(load_v(0, rank), load_w2(0, rank))
  else:  # a loop over rank chunks lets Triton pipeline the W2 loads
    def partial_bias(kk, acc):
      return acc + dot(load_v(kk * k_chunk, k_chunk), load_w2(kk * k_chunk, k_chunk))
    bias, first = jnp.zeros((rows, tile), jnp.float32), 0
    if w2_first is not None:  # the same sum, its first term from the chunk loaded before
      bias, first = bias + dot(load_v(0, k_chunk), w2_first), 1
    bias = jax.lax.fori_loop(first, rank // k_chunk, partial_bias, bias)
  if late_base:
    base = load_base()
  corrected = (base.astype(jnp.float32) + bias).astype(base_ref.dtype)
  if corrected_ref is not None:
    plgpu.store(corrected_ref.at[window], corrected, mask=in_batch, eviction_policy=stream)
  x = corrected.astype(jnp.float32)
  columns = col0 + jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 1)
  if greedy_ref is None:  # greedy-only: the tile's max and first argmax
    return row_first_max(x, columns)
  # Sampled rows keep (score, draw or first column), greedy rows (max, first argmax)
  # (`tile_choices`).
  if wait_late:  # the noise comes from the kernel before (`token_kernels.block_noise`)
    valid = launch_control("wait", row_ids, interpret) < batch
    in_batch = jnp.broadcast_to(valid[:, None], (rows, tile))
  temperature, greedy, inner, tile_draw = load_rows(valid, in_batch)
  if draws:  # the token this tile would give if chosen: argmax(x / T + G'), its inner noise G'
    # One first-max serves both kinds of row: a greedy row's argmax and a sampled row's draw.
    best, first = row_first_max(
        jnp.where(greedy[:, None], x, x / temperature[:, None] + inner), columns)
    # The log-mass's shift: a plain max (Triton's drops NaN; a NaN tile's mass is NaN anyway).
    tile_max, sampled = jnp.max(x, axis=1), first
  else:  # `token_kernels.draw_tokens` or XLA draws inside the chosen tile
    best, first = row_first_max(x, columns)
    tile_max, sampled = best, jnp.full((rows,), col0, jnp.int32)
  log_mass = sampling.tile_log_mass(x, tile_max, temperature)
  score = log_mass  # without noise: `token_kernels.draw_tokens` adds the tile's Gumbel draw
  if noise_ref is not None:
    score = log_mass + tile_draw
  if with_law:  # one nonzero term: exact, and a NaN or -inf logit passes through
    draw_logit = (jnp.sum(jnp.where(columns == sampled[:, None], x, 0.0), axis=1) if draws
                  else None)
    law = (log_mass, draw_logit)
  key = jnp.where(greedy, best, score)
  token = jnp.where(greedy, first, sampled)
  return (key, token, *law) if with_law else (key, token)


def load_greedy(greedy_ref, index, mask):
  """The rows' greedy flags as bool (rows outside `mask` read as greedy), from a bool or int mask."""
  flag = greedy_ref.dtype == jnp.bool_
  if mask is None:
    rows = plgpu.load(greedy_ref.at[index])
  else:
    rows = plgpu.load(greedy_ref.at[index], mask=mask, other=True if flag else 1)
  return rows if flag else rows != 0


def greedy_mask(greedy):
  """What the kernels take as the greedy mask: a bool mask as it is (a conversion would be an XLA
  kernel in front of the chain), anything else as int32."""
  return greedy if greedy.dtype == jnp.bool_ else greedy.astype(jnp.int32)


def _w2_chunk(w2_ref, start, width, j, tile, cache_hints):
  """W2[start : start + width, tile j]; with cache hints marked evict-last (every step reads W2)."""
  return plgpu.load(w2_ref.at[pl.ds(start, width), pl.ds(j * tile, tile)],
                    eviction_policy="evict_last" if cache_hints else None)


def _block_vectors(v_ref, row_ids, gathers, batch):
  """What `one_tile` takes as `v` for the rows `row_ids`: the ref of the vectors, or the rows'
  tokens whose W1 rows it gathers (rows past the batch read token 0)."""
  if not gathers:
    return v_ref
  return plgpu.load(v_ref.at[row_ids], mask=row_ids < batch, other=0)


def _kernel(*refs, gathers, greedy_only, draws, store_logits, tiles, tiles_per_program, reverse,
            pdl, prefetch, interpret, has_noise=True, **static):
  refs = list(refs)
  v_ref = refs.pop(0)
  w1_ref = refs.pop(0) if gathers else None
  w2_ref, base_ref, temp_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  noise_ref = greedy_ref = corrected_ref = None
  law_refs = ()
  if greedy_only:
    key_ref, token_ref = refs
  elif store_logits:  # an aliased corrected input may come before the outputs
    noise_ref = refs.pop(0) if has_noise else None
    greedy_ref = refs.pop(0)
    corrected_ref, key_ref, token_ref = refs[-3:]
  else:  # the log-masses, and with draws the draws' logits
    noise_ref, greedy_ref, key_ref, token_ref, *law_refs = refs
  block, group = pl.program_id(0), pl.program_id(1)
  if reverse:  # instances start in program order: the last tiles first
    group = pl.num_programs(1) - 1 - group
  rows = static["rows"]
  row_slice = pl.ds(block * rows, rows)
  w2_first = None
  if prefetch:  # issued before the wait below: W2 does not depend on the kernels before
    w2_first = _w2_chunk(w2_ref, 0, static["k_chunk"], group, static["tile"],
                         static["cache_hints"])
  # With pdl the row indices pass through the wait (`early_lanes`), and with them every masked
  # load and store: only W2 (from before the chain) may be read before it.
  row_ids = block * rows + early_lanes(rows, pdl, interpret)
  v = _block_vectors(v_ref, row_ids, gathers, static["batch"])

  def run(j):
    key, token, *law = one_tile(j, v, w1_ref, w2_ref, base_ref, temp_ref, noise_ref, greedy_ref,
                                corrected_ref, row0=block * rows, draws=draws, tiles=tiles,
                                with_law=bool(law_refs), w2_first=w2_first,
                                wait_late=pdl == "late", row_ids=row_ids, interpret=interpret,
                                **static)
    # Statistics are [rows, tiles]: row-major, so the reduction over tiles reads contiguous memory.
    key_ref[row_slice, j] = key
    token_ref[row_slice, j] = token
    for ref, value in zip(law_refs, law):
      ref[row_slice, j] = value
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


def _usable_chunk(k_chunk, rank):
  """The rank chunk of the kernel's loop over r, or None (one dot) where it does not divide r."""
  return None if k_chunk is None or rank % k_chunk or k_chunk < MIN_TILE else k_chunk


def _head_inputs(v, w1, w2):
  """The kernels' first inputs: the tokens and W1 (gathered in the kernel), or the vectors; W2."""
  if w1 is None:
    return [v.astype(w2.dtype), w2]
  return [v.astype(jnp.int32), w1, w2]


def compiler_params(num_warps, num_stages):
  params = {name: value for name, value in (("num_warps", num_warps),
                                             ("num_stages", num_stages)) if value}
  return plgpu.CompilerParams(**params) if params else None


class StepStats(NamedTuple):
  """What `step_stats` returns: per row and vocabulary tile, [B, V/c] (``corrected`` aside).

  The token choice maximises ``tile_key`` over the tiles and takes that tile's ``tile_token``
  (`sampling.tokens_from_tile_choices`); with ``draws=False`` that is a sampled row's tile, and
  `sampling.tokens_in_chosen_tiles` draws inside it.
  """

  corrected: jax.Array | None   # [B, γ, V] with slice `step` written (sampling variant)
  tile_key: jax.Array           # f32: the tile's max; a sampled row's score
  tile_token: jax.Array         # int32 column: the tile's first argmax; a sampled row's draw, or
                                # the tile's first column without draws
  tile_log_mass: jax.Array | None = None  # f32 logsumexp(corrected[tile] / T) (store_logits=False)
  tile_draw_logit: jax.Array | None = None  # f32 the corrected logit at the tile's draw (same)


@functools.partial(jax.jit, static_argnames=("step", "greedy_only", "draws", "rows", "num_warps",
                                             "num_stages", "k_chunk", "tiles_per_program",
                                             "serpentine", "cache_hints", "late_base",
                                             "store_logits", "pdl", "prefetch", "padded_pairs",
                                             "interpret"))
def step_stats(v, w2, base_logits, temperature, noise, corrected, *, greedy=None, w1=None, step,
               greedy_only, draws=True, rows=None, num_warps=None, num_stages=3, k_chunk=64,
               tiles_per_program=1, serpentine=True, cache_hints=True, late_base=None,
               store_logits=True, pdl=False, prefetch=False, padded_pairs=False,
               interpret=False) -> StepStats:
  """Runs the kernel for block position `step`.

  Args:
    v: [B, r] the Markov head's vector for this step (cast to W2's dtype); or, when `w1` is given,
      [B] int32 tokens, and the kernel uses ``W1[v]`` (a vanilla head). w2: [r, V].
    base_logits: [B, γ, V] the backbone's logits (row `step` is read).
    temperature: [B] float32 clamped draft temperatures.
    noise: [γ, B, V/c + c] float32 Gumbel noise (`sampling.tile_noise` of every step's row keys;
      slice `step` is read), or None: greedy-only, or sampled rows without draws whose scores are
      the tiles' log-masses (`token_kernels.draw_tokens` adds the noise).
    corrected: [B, γ, V] the buffer to write slice `step` of (aliased in place), or None to allocate
      it (its other slices are then unwritten); ignored by the greedy-only variant.
    greedy: [B] bool or int (nonzero: greedy row); needed by the sampling variant. A bool or
      int32 mask is read as it is; other dtypes are converted on every call.
    w1: [V, r] the head's first matrix, or None (then `v` is the vector).
    step: static block position. greedy_only: no corrected logits, scores or draws.
    draws: sampling variant: each tile draws its token, and a sampled row's (key, token) per tile is
      (score, draw), a greedy row's (max, first argmax) (`sampling.tile_choices`); else a sampled
      row's pair is (score, the tile's first column), and the caller draws in the chosen tile.
    rows: static rows per kernel instance (default `row_block(B)`).
    num_warps, num_stages: Triton's (None: its default); 3 stages pipeline the W2 loads.
    k_chunk: static rank chunk of the in-kernel loop over r (None: one dot over all of r). 64
      with 3 stages measured fastest on an H200 (BENCHMARKS.md); a rank it does not divide falls
      back to one dot.
    tiles_per_program: vocabulary tiles one kernel instance walks through (a smaller grid).
    serpentine: odd steps walk the vocabulary tiles last to first, so they start on the W2 tiles
      the step before read last, which may still be in L2 (W2 is larger than L2).
    cache_hints: W2 loads marked evict-last, U_k loads and corrected-logit stores evict-first.
    late_base: load the U_k tile after the rank loop, not before (None: only for the sampling
      variant without draws, where it measured faster on an H200: the tile then does not hold
      registers through the loop, 128 registers per thread instead of 204 at 64 rows).
    store_logits: sampling variant: False writes no corrected logits (`corrected` is ignored) but,
      per row and tile, the tile's log-mass and, with `draws`, its draw's corrected logit, from
      which the caller forms ``log q(x)`` of the row's token (`proposal.CompactLogits`); without
      draws, `chosen_tile_draws` then draws in the chosen tiles.
    pdl: programmatic dependent launch (`launch_control`): True lets the stream's next kernel
      launch as soon as this one's instances have started, and reads the tokens only after the
      kernels before have finished; "first" only lets the next one launch (the chain's first
      kernel); "late" lets it launch and waits only before reading the noise, the temperatures
      and the greedy mask (the first step after `token_kernels.block_noise`, which writes the
      noise). Needs `w1`. Every masked load and store of an instance follows its wait (the row
      indices pass through it); W2, unmasked, may be read before, and with "first" and "late"
      also the tokens, the base logits and (with "first") the noise, temperatures and greedy
      mask, so these must come from before the chain's first kernel (which is launched
      normally). `token_kernels`' kernels (``pdl=True``) take part in such a chain.
    prefetch: with ``pdl=True``, each instance loads its tile's first rank chunk of W2 before it
      waits (one tile per instance and a rank loop only).
    padded_pairs: keep the padded rows of ``tile_key`` and ``tile_token`` also without `pdl`
      (for a kernel that reads the first B rows in place, such as `token_kernels.draw_tokens`).
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    A `StepStats`; with `pdl` or `padded_pairs`, ``tile_key`` and ``tile_token`` keep the
    kernel's padded rows ([row blocks · rows, V/c]; the token kernels read the first B in place).
  """
  batch = v.shape[0]
  rank, vocab = w2.shape
  tile = sampling.vocab_tile(vocab)
  if tile < MIN_TILE:
    raise ValueError(f"w2: vocab {vocab} has no power-of-two tile >= {MIN_TILE}; use the XLA form")
  draws = draws and not greedy_only
  if late_base is None:  # measured: helps the sampling kernel without draws, slows the others
    late_base = not greedy_only and not draws
  if not greedy_only and noise is None and (draws or not store_logits):
    raise ValueError("noise: the sampling variant needs every step's tile noise, unless it "
                     "stores the logits without draws (then `token_kernels.draw_tokens` draws)")
  if not greedy_only and greedy is None:
    raise ValueError("greedy: the sampling variant needs the rows' greedy mask")
  if pdl and w1 is None:
    raise ValueError("pdl: the kernel must gather W1 rows itself (pass w1 and tokens)")
  prefetch = prefetch and pdl is True and tiles_per_program == 1
  store_logits = store_logits or greedy_only
  rows = rows or row_block(batch)
  k_chunk = _usable_chunk(k_chunk, rank)
  blocks = -(-batch // rows)
  tiles = vocab // tile
  stat = lambda dtype: jax.ShapeDtypeStruct((blocks * rows, tiles), dtype)
  out_shape = [stat(jnp.float32), stat(jnp.int32)]
  inputs = _head_inputs(v, w1, w2) + [base_logits, temperature.astype(jnp.float32)]
  aliases = {}
  if not greedy_only:
    inputs += [greedy_mask(greedy)] if noise is None else [noise, greedy_mask(greedy)]
  if not store_logits:  # the tiles' log-masses, and with draws their draws' logits
    out_shape += [stat(jnp.float32)] * (2 if draws else 1)
  elif not greedy_only:
    out_shape = [jax.ShapeDtypeStruct(base_logits.shape, base_logits.dtype), *out_shape]
    if corrected is not None:
      inputs.append(corrected)
      aliases = {len(inputs) - 1: 0}
  groups = -(-tiles // tiles_per_program)
  outs = pl.pallas_call(
      functools.partial(_kernel, gathers=w1 is not None, greedy_only=greedy_only, draws=draws,
                        store_logits=store_logits, step=step, batch=batch, rows=rows, tile=tile,
                        k_chunk=k_chunk, tiles=tiles, tiles_per_program=tiles_per_program,
                        reverse=serpentine and step % 2 == 1, cache_hints=cache_hints,
                        late_base=late_base, pdl=pdl, prefetch=prefetch and bool(k_chunk),
                        interpret=interpret, has_noise=noise is not None),
      grid=(blocks, groups),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
  )(*inputs)
  cut = lambda x: x[:batch]
  # With pdl the pairs keep the padded rows: a slice before the token kernel would be a copy.
  cut_pair = (lambda x: x) if pdl or padded_pairs else cut
  if greedy_only:
    return StepStats(None, cut_pair(outs[0]), cut_pair(outs[1]))
  if not store_logits:
    return StepStats(None, cut_pair(outs[0]), cut_pair(outs[1]), *map(cut, outs[2:]),
                     *([None] if len(outs) == 3 else []))
  return StepStats(outs[0], cut_pair(outs[1]), cut_pair(outs[2]))


def _chosen_tile_kernel(*refs, gathers, rows, tile, **static):
  refs = list(refs)
  v_ref = refs.pop(0)
  w1_ref = refs.pop(0) if gathers else None
  w2_ref, base_ref, temp_ref, noise_ref, greedy_ref, chosen_ref, token_ref, logit_ref = refs
  row = pl.program_id(0)
  block = row // rows
  # The tile row `row` chose, for its whole row block: the same dot as the step's kernel.
  j = jnp.max(chosen_ref[pl.ds(row, 1)]) // tile
  _, token, _, draw_logit = one_tile(
      j, _block_vectors(v_ref, block * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0),
                        gathers, static["batch"]), w1_ref, w2_ref, base_ref,
      temp_ref, noise_ref, greedy_ref, None, row0=block * rows, rows=rows, tile=tile, draws=True,
      with_law=True, **static)
  token_ref[pl.ds(row, 1), :] = token[None, :]
  logit_ref[pl.ds(row, 1), :] = draw_logit[None, :]


@functools.partial(jax.jit, static_argnames=("step", "rows", "num_warps", "num_stages", "k_chunk",
                                             "tiles_per_program", "serpentine", "cache_hints",
                                             "late_base", "interpret"))
def chosen_tile_draws(v, w2, base_logits, temperature, noise, greedy, chosen, *, w1=None, step,
                      rows=None, num_warps=None, num_stages=3, k_chunk=64, tiles_per_program=1,
                      serpentine=True, cache_hints=True, late_base=None, interpret=False):
  """Each sampled row's draw inside the tile it chose, and the draw's corrected logit.

  What `step_stats` with ``store_logits=False`` and without draws leaves to do: the token choice
  gave each sampled row a tile (`chosen`, its first column); one kernel instance per row computes
  that tile for the row's whole row block with `one_tile`, the step kernel's own code and dot
  shape, so the logits are the step kernel's bit for bit, and keeps the row's draw
  ``argmax(corrected / T + G')`` and ``corrected[draw]``. Arguments as in `step_stats` (the same
  kernel settings; the ones that do not apply here are accepted and ignored).

  Returns:
    ``(token [B] int32, draw_logit [B] float32)``; a greedy row's entries are unused.
  """
  del tiles_per_program, serpentine, late_base  # settings of the step kernel's grid and loads
  batch = v.shape[0]
  rank, vocab = w2.shape
  tile = sampling.vocab_tile(vocab)
  rows = rows or row_block(batch)
  k_chunk = _usable_chunk(k_chunk, rank)
  inputs = _head_inputs(v, w1, w2) + [base_logits, temperature.astype(jnp.float32), noise,
                                      greedy.astype(jnp.int32), chosen.astype(jnp.int32)]
  out_shape = [jax.ShapeDtypeStruct((batch, rows), jnp.int32),
               jax.ShapeDtypeStruct((batch, rows), jnp.float32)]
  token, logit = pl.pallas_call(
      functools.partial(_chosen_tile_kernel, gathers=w1 is not None, rows=rows, tile=tile,
                        step=step, batch=batch, tiles=vocab // tile, k_chunk=k_chunk,
                        cache_hints=cache_hints, late_base=False),
      grid=(batch,),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * 2,
      out_shape=out_shape,
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
  )(*inputs)
  lane = jnp.arange(batch) % rows  # row b is lane b mod rows of its block
  return (jnp.take_along_axis(token, lane[:, None], axis=1)[:, 0],
          jnp.take_along_axis(logit, lane[:, None], axis=1)[:, 0])
