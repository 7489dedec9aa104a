"""A draft step in Pallas: the corrected logits and everything the token choice needs, in one pass.

Step k of the block (SPEC §3) needs ``L_k = U_k + v_k @ W2`` (v_k from the Markov head), stored in the
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
  `sampling.tile_log_mass`, plus the tile's Gumbel draw) and, with ``draws``, the tile's *draw*
  ``argmax(corrected / T + G_inner)``, the token the tile would give if chosen, or else the tile's
  first column. Every tile uses the row's same inner noise, so drawing in every tile and keeping the
  chosen tile's draw is the same draw as reading the chosen tile afterwards (`sampling` explains the
  two-level draw).

The token choice left to XLA is one reduction over the tiles (`sampling.tokens_from_tile_choices`);
without draws, XLA then draws inside each sampled row's chosen tile, rereading it
(`sampling.tokens_in_chosen_tiles`). The draws cost arithmetic on every logit, so they pay at small
batches only. HBM sees W2, U_k and the corrected logits once each per step, the floor's traffic (row
blocks after the first find their W2 tile in L2: they run next to each other). W2 is larger than an
H200's L2, so odd steps walk the tiles backwards (``serpentine``) and start on the tiles the step
before left in L2, and loads carry cache hints that keep W2 and stream the rest. On an H200
(BENCHMARKS.md, issue 6) whole programs run at 1.15-1.25x that floor for greedy-only and 1.4-2.2x
for sampling; at large batches the kernels are latency-bound (128-204 registers per thread leave
8-12 warps per SM, and L2 is 70 % busy). Row maxima use integer keys that
order like the floats (`order_keys`): Triton's float max drops NaN, and the keys need two
reductions where explicit NaN handling needs four.

On sm_90+ GPUs the step kernels can form a chain by programmatic dependent launch (``pdl``):
each lets the stream's next kernel launch while it runs and waits on the GPU before it reads its
rows' tokens, and `choose_tokens` is the token choice as a kernel of that chain.

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


def _launch_control(instruction, lanes, interpret):
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


def _early_lanes(count, pdl, interpret):
  """iota(`count`), after letting the next kernel launch and, unless `pdl` is "first" or "late",
  waiting for the kernels before (see `step_stats`)."""
  lanes = jax.lax.broadcasted_iota(jnp.int32, (count,), 0)
  if not pdl:
    return lanes
  lanes = _launch_control("launch_dependents", lanes, interpret)
  return lanes if pdl in ("first", "late") else _launch_control("wait", lanes, interpret)


def _row_first_max(values, indices):
  """Per row of [R, C]: (max, index of its first occurrence), a NaN beating everything (its first).

  `sampling.argmax_last`'s semantics, in operations the Triton lowering has.
  """
  keys = order_keys(values)
  best = jnp.max(keys, axis=1)
  first = jnp.min(jnp.where(keys == best[:, None], indices, jnp.int32(_BIG_INDEX)), axis=1)
  return key_value(best), first


def one_tile(j, v, w1_ref, w2_ref, base_ref, temp_ref, noise_ref, greedy_ref, corrected_ref, *,
             row0, step, batch, rows, tile, tiles, k_chunk, cache_hints, late_base, draws,
             with_law=False, w2_first=None, wait_late=False, interpret=False):
  """Vocabulary tile `j` for rows ``row0 .. row0 + rows``: writes the corrected logits (sampling
  variant) and returns each row's (key, token) pair for the tile, [rows] float32 and int32.
  The body of this module's kernel and of `fused_block`'s persistent one (inside a Pallas kernel).

  `v` is the [rows] int32 tokens whose ``W1`` rows to gather when `w1_ref` is given (rows past the
  batch read token 0), else the ref of the [B, r] vectors. `with_law` (sampling variant): also
  return each row's tile log-mass and, with `draws`, its draw's corrected logit (else None): the
  draft law without the logits (`step_stats(store_logits=False)`). `w2_first`: the tile's first
  rank chunk of W2, loaded before the kernel waited (`step_stats(prefetch=True)`).
  """
  col0 = j * tile
  cols, row_slice = pl.ds(col0, tile), pl.ds(row0, rows)
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
  key, token = _row_first_max(x, columns)
  if greedy_ref is not None:  # sampled rows keep (score, draw or first column) (`tile_choices`)
    if wait_late:  # the noise comes from the kernel before (`block_noise`): read it after it ends
      valid = _launch_control("wait", row_ids, interpret) < batch
      in_batch = jnp.broadcast_to(valid[:, None], (rows, tile))
    temperature = plgpu.load(temp_ref.at[row_slice], mask=valid, other=1.0)
    log_mass = sampling.tile_log_mass(x, key, temperature)
    score = log_mass  # without noise: `draw_tokens` adds the tile's Gumbel draw
    if noise_ref is not None:
      score = log_mass + plgpu.load(noise_ref.at[jnp.int32(step), row_slice, j], mask=valid,
                                    other=0.0)
    if draws:  # the token this tile would give if chosen
      inner = plgpu.load(noise_ref.at[jnp.int32(step), row_slice, pl.ds(tiles, tile)],
                         mask=in_batch, other=0.0)
      sampled = _row_first_max(x / temperature[:, None] + inner, columns)[1]
    else:  # XLA draws inside the chosen tile (`sampling.tokens_in_chosen_tiles`)
      sampled = jnp.full((rows,), col0, jnp.int32)
    greedy = plgpu.load(greedy_ref.at[row_slice], mask=valid, other=1) != 0
    if with_law:  # one nonzero term: exact, and a NaN or -inf logit passes through
      draw_logit = (jnp.sum(jnp.where(columns == sampled[:, None], x, 0.0), axis=1) if draws
                    else None)
      law = (log_mass, draw_logit)
    key = jnp.where(greedy, key, score)
    token = jnp.where(greedy, token, sampled)
  return (key, token, *law) if with_law else (key, token)


def _w2_chunk(w2_ref, start, width, j, tile, cache_hints):
  """W2[start : start + width, tile j]; with cache hints marked evict-last (every step reads W2)."""
  return plgpu.load(w2_ref.at[pl.ds(start, width), pl.ds(j * tile, tile)],
                    eviction_policy="evict_last" if cache_hints else None)


def _block_vectors(v_ref, block, gathers, rows, batch, pdl=False, interpret=False):
  """What `one_tile` takes as `v` for row block `block`: the ref of the vectors, or the block's
  tokens whose W1 rows it gathers (rows past the batch read token 0). With `pdl` the tokens are
  read after the kernels before have finished (`_early_lanes`)."""
  if not gathers:
    return v_ref
  row_ids = block * rows + _early_lanes(rows, pdl, interpret)
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
  v = _block_vectors(v_ref, block, gathers, rows, static["batch"], pdl, interpret)

  def run(j):
    key, token, *law = one_tile(j, v, w1_ref, w2_ref, base_ref, temp_ref, noise_ref, greedy_ref,
                                corrected_ref, row0=block * rows, draws=draws, tiles=tiles,
                                with_law=bool(law_refs), w2_first=w2_first,
                                wait_late=pdl == "late", interpret=interpret, **static)
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


def _compiler_params(num_warps, num_stages):
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
      slice `step` is read), or None (greedy-only).
    corrected: [B, γ, V] the buffer to write slice `step` of (aliased in place), or None to allocate
      it (its other slices are then unwritten); ignored by the greedy-only variant.
    greedy: [B] bool or int (nonzero: greedy row); needed by the sampling variant. Pass it as
      int32 to spare a conversion per step.
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
    pdl: programmatic dependent launch (`_launch_control`): True lets the stream's next kernel
      launch as soon as this one's instances have started, and reads the tokens only after the
      kernels before have finished; "first" only lets the next one launch (the chain's first
      kernel). Needs `w1`. Before its wait an instance reads W2, the base logits, the noise, the
      temperatures and the greedy mask, so these must come from before the chain's first kernel
      (which is launched normally), and it writes nothing; `choose_tokens(pdl=True)` is the
      token choice that takes part in such a chain.
    prefetch: with ``pdl=True``, each instance loads its tile's first rank chunk of W2 before it
      waits (one tile per instance and a rank loop only).
    padded_pairs: keep the padded rows of ``tile_key`` and ``tile_token`` also without `pdl`
      (for a kernel that reads the first B rows in place, such as `draw_tokens`).
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    A `StepStats`; with `pdl` or `padded_pairs`, ``tile_key`` and ``tile_token`` keep the kernel's padded rows
    ([row blocks · rows, V/c]; `choose_tokens` reads the first B in place).
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
                     "stores the logits without draws (then `draw_tokens` draws)")
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
    inputs += [greedy.astype(jnp.int32)] if noise is None else [noise, greedy.astype(jnp.int32)]
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
      compiler_params=_compiler_params(num_warps, num_stages),
      interpret=interpret,
  )(*inputs)
  cut = lambda x: x[:batch]
  # With pdl the pairs keep the padded rows: a slice before `choose_tokens` would be a copy.
  cut_pair = (lambda x: x) if pdl or padded_pairs else cut
  if greedy_only:
    return StepStats(None, cut_pair(outs[0]), cut_pair(outs[1]))
  if not store_logits:
    return StepStats(None, cut_pair(outs[0]), cut_pair(outs[1]), *map(cut, outs[2:]),
                     *([None] if len(outs) == 3 else []))
  return StepStats(outs[0], cut_pair(outs[1]), cut_pair(outs[2]))


def _write_token(refs, row, step, token, blocks):
  """Writes a row's [1] token to the [B] output and, with `blocks`, to column `step` of the
  [B, γ] block (the last two refs are the outputs; an aliased block input comes before them)."""
  if not blocks:
    refs[-1][pl.ds(row, 1)] = token
    return
  refs[-2][pl.ds(row, 1)] = token
  refs[-1][pl.ds(row, 1), jnp.int32(step)] = token


def _choice_kernel(key_ref, token_ref, *refs, tiles, width, step, pdl, interpret, blocks):
  row = pl.program_id(0)
  lanes = _early_lanes(width, pdl, interpret)
  present = lanes < tiles
  key = plgpu.load(key_ref.at[row, lanes], mask=present, other=-jnp.inf)
  token = plgpu.load(token_ref.at[row, lanes], mask=present, other=_BIG_INDEX)
  _, first = _row_first_max(key[None, :], token[None, :])
  _write_token(refs, row, step, first, blocks)


def _token_outputs(batch, block, gamma):
  """Out shapes, inputs and aliases for the [B] tokens and, with `gamma`, the [B, γ] block."""
  if gamma is None:
    return [jax.ShapeDtypeStruct((batch,), jnp.int32)], [], {}
  shapes = [jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, gamma), jnp.int32)]
  return (shapes, [], {}) if block is None else (shapes, [block], {"block": 1})


def _call_with_tokens(kernel, inputs, batch, block, gamma, interpret):
  """The per-row token kernel over `inputs`, writing into `block` [B, γ] in place when given."""
  shapes, extra, alias = _token_outputs(batch, block, gamma)
  outs = pl.pallas_call(
      functools.partial(kernel, blocks=gamma is not None),
      grid=(batch,),
      in_specs=[pl.no_block_spec] * (len(inputs) + len(extra)),
      out_specs=[pl.no_block_spec] * len(shapes),
      out_shape=shapes,
      input_output_aliases={len(inputs): alias["block"]} if alias else {},
      compiler_params=_compiler_params(4, None),
      interpret=interpret,
  )(*inputs, *extra)
  return outs[0] if gamma is None else tuple(outs)


@functools.partial(jax.jit, static_argnames=("batch", "pdl", "step", "gamma", "interpret"))
def choose_tokens(tile_key, tile_token, block=None, *, batch=None, pdl=False, step=0, gamma=None,
                  interpret=False):
  """`sampling.tokens_from_tile_choices` as a Pallas kernel, one instance per row: the token of
  the tile with the largest key (ties: the smaller token; NaN first), [B] int32, for the first
  `batch` rows of the [rows, V/c] pairs (None: all).

  It exists for `pdl` (see `step_stats`): XLA's own reduction cannot let the next step's kernel
  launch early or wait for this one, so a chain of step kernels with PDL needs its token choice
  to take part. With `gamma` it also writes the tokens into column `step` of the block's
  [B, γ] tokens, in place into `block` (None: a new buffer whose other columns are unwritten),
  and returns ``(tokens [B], block [B, γ])``: the block then needs no stacking after the chain.
  """
  rows, tiles = tile_key.shape
  batch = rows if batch is None else batch
  width = max(16, 1 << (tiles - 1).bit_length())  # a power of two for the lanes
  kernel = functools.partial(_choice_kernel, tiles=tiles, width=width, step=step, pdl=pdl,
                             interpret=interpret)
  return _call_with_tokens(kernel, [tile_key, tile_token], batch, block, gamma, interpret)


def _first_max_of_halves(key_even, token_even, key_odd, token_odd):
  """`_row_first_max` over the union of two [1, n] halves: (max, its smallest token), [1]."""
  even, odd = order_keys(key_even), order_keys(key_odd)
  best = jnp.maximum(jnp.max(even, axis=1), jnp.max(odd, axis=1))
  first = lambda keys, tokens: jnp.min(
      jnp.where(keys == best[:, None], tokens, jnp.int32(_BIG_INDEX)), axis=1)
  return key_value(best), jnp.minimum(first(even, token_even), first(odd, token_odd))


def _pair_gumbels(k0, k1, domain, pairs):
  """Draws ``2p`` and ``2p + 1`` of `domain` (`sampling.counter_gumbel`) for int32 [n] `pairs`,
  as two [1, n] halves: one Threefry block gives both."""
  y0, y1 = sampling.threefry2x32((k0, k1), (pairs.astype(jnp.uint32), jnp.uint32(domain)))
  return sampling.gumbel_of_bits(y0)[None, :], sampling.gumbel_of_bits(y1)[None, :]


def _draw_kernel(key_ref, token_ref, corrected_ref, greedy_ref, temp_ref, words_ref, seed_ref,
                 position_ref, *refs, tiles, half, tile, step, pdl, interpret, blocks):
  row = pl.program_id(0)
  one = pl.ds(row, 1)
  pairs = jax.lax.broadcasted_iota(jnp.int32, (half,), 0)
  if pdl:
    pairs = _launch_control("launch_dependents", pairs, interpret)
  # The row's noise first: it depends on no kernel before, so it overlaps them under pdl.
  base = (words_ref[pl.ds(0, 1)], words_ref[pl.ds(1, 1)])
  k0, k1 = sampling.row_key_words(base, sampling.Stream.DRAFT, seed_ref[one],
                                  position_ref[one] + (step + 1))
  tile_even, tile_odd = _pair_gumbels(k0, k1, sampling.TILE_DOMAIN, pairs)
  columns = jax.lax.broadcasted_iota(jnp.int32, (tile // 2,), 0)
  column_even, column_odd = _pair_gumbels(k0, k1, sampling.COLUMN_DOMAIN, columns)
  greedy = greedy_ref[one] != 0
  temperature = temp_ref[one]
  if pdl:  # through the noise, so that it is computed before the wait (a Gumbel is finite)
    pairs = _launch_control("wait", pairs + jnp.where(tile_even[0] == jnp.inf, 1, 0), interpret)
  lanes = [2 * pairs, 2 * pairs + 1]
  keys = [plgpu.load(key_ref.at[row, t], mask=t < tiles, other=-jnp.inf)[None, :] for t in lanes]
  tokens = [plgpu.load(token_ref.at[row, t], mask=t < tiles, other=_BIG_INDEX)[None, :]
            for t in lanes]
  # A sampled row's key is its tile's log-mass: with the tile's draw added, the max is the tile.
  keys = [jnp.where(greedy[:, None], k, k + g) for k, g in zip(keys, (tile_even, tile_odd))]
  _, token = _first_max_of_halves(keys[0], tokens[0], keys[1], tokens[1])
  # The draw inside the chosen tile (a sampled row's token is the tile's first column).
  sampled = jnp.broadcast_to(~greedy[:, None], (1, tile // 2))
  within = [2 * columns[None, :], 2 * columns[None, :] + 1]
  logits = [plgpu.load(corrected_ref.at[row, jnp.int32(step), token[:, None] + c], mask=sampled,
                       other=0.0).astype(jnp.float32) for c in within]
  scores = [x / temperature[:, None] + g for x, g in zip(logits, (column_even, column_odd))]
  _, column = _first_max_of_halves(scores[0], within[0], scores[1], within[1])
  _write_token(refs, row, step, jnp.where(greedy, token, token + column), blocks)


@functools.partial(jax.jit, static_argnames=("step", "batch", "pdl", "gamma", "interpret"))
def draw_tokens(tile_key, tile_token, corrected, greedy, temperature, key_words, seeds, positions,
                block=None, *, step, batch=None, pdl=False, gamma=None, interpret=False):
  """The token choice of a sampling step that draws: `choose_tokens` plus the two-level sampler's
  noise and in-tile draw (`sampling`), one kernel instance per row.

  It takes the step kernel's pairs without noise (``step_stats(noise=None, draws=False)``: a
  sampled row's key per tile is the tile's log-mass, its token the tile's first column), derives
  the row's key (`sampling.row_key_words` of ``(key, seed, position + step + 1, Stream.DRAFT)``),
  adds each tile's Gumbel draw, chooses the tile, and draws inside it from the stored corrected
  logits: the noise `sampling.tile_noise` gives these keys, so the token is the one
  `sampling.tokens_from_tile_stats` gives. The noise comes first: under `pdl` it overlaps the
  step kernel before, and the sampling block draws none up front.

  Args:
    tile_key, tile_token: [rows, V/c] float32 and int32 pairs of the step kernel (rows >= B).
    corrected: [B, γ, V] the stored corrected logits (slice `step` is read).
    greedy: [B] int32 (nonzero: greedy row). temperature: [B] float32 (clamped).
    key_words: [2] uint32 `sampling.key_words` of the block's key. seeds: [B] uint32.
    positions: [B] int32 the anchors' positions.
    step: static block position. batch: rows to choose for (None: all of `tile_key`'s).
    pdl: programmatic dependent launch (`step_stats`): let the next kernel launch at once, and
      wait for the kernels before only once the noise is drawn.
    block, gamma: as in `choose_tokens` (the block's [B, γ] tokens, written in place).

  Returns:
    [B] int32 tokens; with `gamma`, ``(tokens, block)``.
  """
  rows, tiles = tile_key.shape
  batch = rows if batch is None else batch
  tile = corrected.shape[2] // tiles
  half = max(16, 1 << (-(-tiles // 2) - 1).bit_length())  # a power of two for the lanes
  kernel = functools.partial(_draw_kernel, tiles=tiles, half=half, tile=tile, step=step, pdl=pdl,
                             interpret=interpret)
  inputs = [tile_key, tile_token, corrected, greedy.astype(jnp.int32),
            temperature.astype(jnp.float32), key_words.astype(jnp.uint32),
            seeds.astype(jnp.uint32), positions.astype(jnp.int32)]
  return _call_with_tokens(kernel, inputs, batch, block, gamma, interpret)


def _noise_kernel(words_ref, seed_ref, position_ref, noise_ref, *, tiles, tile, half, pdl,
                  interpret):
  step, row = pl.program_id(0), pl.program_id(1)
  pairs = jax.lax.broadcasted_iota(jnp.int32, (half,), 0)
  if pdl:  # the chain's first kernel: the step kernel launches at once and waits late
    pairs = _launch_control("launch_dependents", pairs, interpret)
  one = pl.ds(row, 1)
  base = (words_ref[pl.ds(0, 1)], words_ref[pl.ds(1, 1)])
  k0, k1 = sampling.row_key_words(base, sampling.Stream.DRAFT, seed_ref[one],
                                  position_ref[one] + (step + 1))
  columns = jax.lax.broadcasted_iota(jnp.int32, (tile // 2,), 0)
  for domain, lanes, start, count in ((sampling.TILE_DOMAIN, pairs, 0, tiles),
                                      (sampling.COLUMN_DOMAIN, columns, tiles, tile)):
    for parity, values in enumerate(_pair_gumbels(k0, k1, domain, lanes)):
      index = 2 * lanes + parity
      plgpu.store(noise_ref.at[step, row, start + index], values[0], mask=index < count)


@functools.partial(jax.jit, static_argnames=("gamma", "tiles", "tile", "pdl", "interpret"))
def block_noise(key_words, seeds, positions, *, gamma, tiles, tile, pdl=False, interpret=False):
  """[γ, B, V/c + c] float32: every step's `sampling.tile_noise` of the draft rows' keys, as one
  Pallas kernel (one instance per step and row, a Threefry block per two draws).

  The same values as ``tile_noise(row_keys(key, seeds, positions + k + 1, Stream.DRAFT))`` for
  step k; with `pdl` the kernel first lets the next one launch, so that the first step kernel
  (``step_stats(pdl="late")``) streams its W2 tiles while the noise is drawn.

  Args:
    key_words: [2] uint32 `sampling.key_words` of the block's key. seeds: [B] uint32.
    positions: [B] int32 the anchors' positions. gamma, tiles, tile: static sizes.
  """
  batch = seeds.shape[0]
  half = max(16, 1 << (-(-tiles // 2) - 1).bit_length())  # a power of two for the lanes
  return pl.pallas_call(
      functools.partial(_noise_kernel, tiles=tiles, tile=tile, half=half, pdl=pdl,
                        interpret=interpret),
      grid=(gamma, batch),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct((gamma, batch, tiles + tile), jnp.float32),
      compiler_params=_compiler_params(4, None),
      interpret=interpret,
  )(key_words.astype(jnp.uint32), seeds.astype(jnp.uint32), positions.astype(jnp.int32))


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
      j, _block_vectors(v_ref, block, gathers, rows, static["batch"]), w1_ref, w2_ref, base_ref,
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
      compiler_params=_compiler_params(num_warps, num_stages),
      interpret=interpret,
  )(*inputs)
  lane = jnp.arange(batch) % rows  # row b is lane b mod rows of its block
  return (jnp.take_along_axis(token, lane[:, None], axis=1)[:, 0],
          jnp.take_along_axis(logit, lane[:, None], axis=1)[:, 0])
