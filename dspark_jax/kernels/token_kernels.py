"""The per-row kernels of a Pallas sampling block besides its step kernels (`fused_step`).

Each runs one instance per row and takes part in the step kernels' chain by programmatic
dependent launch (``pdl``, `fused_step.step_stats`), where XLA's own reductions and elementwise
kernels cannot (they neither let the next kernel launch early nor wait for the one before):

* `choose_tokens`: the token choice over a step's per-tile (key, token) pairs
  (`sampling.tokens_from_tile_choices`), for greedy-only steps and steps whose tiles drew;
* `draw_tokens`: the token choice that draws: it derives the row's key, adds each tile's Gumbel
  draw to the tiles' log-masses, chooses the tile and draws inside it from the stored corrected
  logits (`sampling.tokens_from_tile_stats`), the noise first, so that it overlaps the step kernel
  before; the default from `proposal.TILE_DRAWS_BELOW_BATCH` rows; after the Hopper sampling
  kernel it also writes a vanilla head's next vector ``W1[x]`` (no XLA gather between the steps);
* `block_noise`: every step's `sampling.tile_noise` for steps whose tiles draw, as the chain's
  first kernel (the first step kernel waits for it only before its epilogue, ``pdl="late"``).

The token kernels can also write the block's [B, γ] tokens in place, column by column, so that
the block needs no stacking kernel after the chain. Their noise is `sampling.counter_gumbel`'s,
bit for bit the values XLA draws for the same keys (tested in Pallas' interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.sampling import sampler as sampling


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
  lanes = fused_step.early_lanes(width, pdl, interpret)
  present = lanes < tiles
  key = plgpu.load(key_ref.at[row, lanes], mask=present, other=-jnp.inf)
  token = plgpu.load(token_ref.at[row, lanes], mask=present, other=fused_step.BIG_INDEX)
  _, first = fused_step.row_first_max(key[None, :], token[None, :])
  _write_token(refs, row, step, first, blocks)


def _call_with_tokens(kernel, inputs, batch, block, gamma, interpret, vectors=None):
  """The per-row token kernel over `inputs`: [B] tokens and, with `gamma`, the block's [B, γ]
  tokens too, written in place into `block` when it is given; with `vectors` (a shape and dtype)
  a first output, the [B, r] rows the kernel writes (`draw_tokens`' ``w1``), returned last."""
  shapes = [] if vectors is None else [vectors]
  shapes.append(jax.ShapeDtypeStruct((batch,), jnp.int32))
  if gamma is not None:
    shapes.append(jax.ShapeDtypeStruct((batch, gamma), jnp.int32))
  extra = [block] if gamma is not None and block is not None else []
  outs = pl.pallas_call(
      functools.partial(kernel, blocks=gamma is not None),
      grid=(batch,),
      in_specs=[pl.no_block_spec] * (len(inputs) + len(extra)),
      out_specs=[pl.no_block_spec] * len(shapes),
      out_shape=shapes,
      input_output_aliases={len(inputs): len(shapes) - 1} if extra else {},
      compiler_params=fused_step.compiler_params(4, None),
      interpret=interpret,
  )(*inputs, *extra)
  outs = list(outs)
  if vectors is not None:
    outs.append(outs.pop(0))
  return outs[0] if len(outs) == 1 else tuple(outs)


@functools.partial(jax.jit, static_argnames=("batch", "pdl", "step", "gamma", "interpret"))
def choose_tokens(tile_key, tile_token, block=None, *, batch=None, pdl=False, step=0, gamma=None,
                  interpret=False):
  """`sampling.tokens_from_tile_choices` as a Pallas kernel, one instance per row: the token of
  the tile with the largest key (ties: the smaller token; NaN first), [B] int32, for the first
  `batch` rows of the [rows, V/c] pairs (None: all).

  It exists for `pdl` (see `fused_step.step_stats`): XLA's own reduction cannot let the next step's kernel
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
  """`fused_step.row_first_max` over the union of two [1, n] halves: (max, its first token)."""
  even, odd = fused_step.order_keys(key_even), fused_step.order_keys(key_odd)
  best = jnp.maximum(jnp.max(even, axis=1), jnp.max(odd, axis=1))
  first = lambda keys, tokens: jnp.min(
      jnp.where(keys == best[:, None], tokens, jnp.int32(fused_step.BIG_INDEX)), axis=1)
  return fused_step.key_value(best), jnp.minimum(first(even, token_even), first(odd, token_odd))


def _pair_gumbels(k0, k1, domain, pairs):
  """Draws ``2p`` and ``2p + 1`` of `domain` (`sampling.counter_gumbel`) for int32 [n] `pairs`,
  as two [1, n] halves: one Threefry block gives both."""
  y0, y1 = sampling.threefry2x32((k0, k1), (pairs.astype(jnp.uint32), jnp.uint32(domain)))
  return sampling.gumbel_of_bits(y0)[None, :], sampling.gumbel_of_bits(y1)[None, :]


def _draw_kernel(key_ref, token_ref, corrected_ref, greedy_ref, temp_ref, words_ref, seed_ref,
                 position_ref, *refs, tiles, half, tile, step, pdl, tile_major, reversed_tiles,
                 vectors, greedy_in_tile, interpret, blocks):
  row = pl.program_id(0)
  one = pl.ds(row, 1)
  pairs = jax.lax.broadcasted_iota(jnp.int32, (half,), 0)
  if pdl:
    pairs = fused_step.launch_control("launch_dependents", pairs, interpret)
  # The row's noise first: it depends on no kernel before, so it overlaps them under pdl.
  base = (words_ref[pl.ds(0, 1)], words_ref[pl.ds(1, 1)])
  k0, k1 = sampling.row_key_words(base, sampling.Stream.DRAFT, seed_ref[one],
                                  position_ref[one] + (step + 1))
  tile_even, tile_odd = _pair_gumbels(k0, k1, sampling.TILE_DOMAIN, pairs)
  columns = jax.lax.broadcasted_iota(jnp.int32, (tile // 2,), 0)
  column_even, column_odd = _pair_gumbels(k0, k1, sampling.COLUMN_DOMAIN, columns)
  greedy = fused_step.load_greedy(greedy_ref, one, None)
  temperature = temp_ref[one]
  if pdl:  # through the noise, so that it is computed before the wait (a Gumbel is finite)
    gate = jnp.where(tile_even[0] == jnp.inf, 1, 0)
    pairs = fused_step.launch_control("wait", pairs + gate, interpret)
  lanes = [2 * pairs, 2 * pairs + 1]
  if tile_major:  # tile t's pair is row t, or row V/c - 1 - t when the tiles came reversed
    at = ((lambda t: (jnp.maximum(tiles - 1 - t, 0), row)) if reversed_tiles
          else (lambda t: (t, row)))
  else:
    at = lambda t: (row, t)
  keys = [plgpu.load(key_ref.at[at(t)], mask=t < tiles, other=-jnp.inf)[None, :] for t in lanes]
  if greedy_in_tile:  # every tile's token is its first column
    tokens = [jnp.where(t < tiles, t * tile, fused_step.BIG_INDEX)[None, :] for t in lanes]
  else:
    tokens = [plgpu.load(token_ref.at[at(t)], mask=t < tiles, other=fused_step.BIG_INDEX)[None, :]
              for t in lanes]
  # A sampled row's key is its tile's log-mass: with the tile's draw added, the max is the tile.
  keys = [jnp.where(greedy[:, None], k, k + g) for k, g in zip(keys, (tile_even, tile_odd))]
  _, token = _first_max_of_halves(keys[0], tokens[0], keys[1], tokens[1])
  # The draw inside the chosen tile (a sampled row's token is the tile's first column); with
  # `greedy_in_tile` a greedy row's too, and its column is the tile's first max.
  sampled = jnp.broadcast_to(greedy_in_tile | ~greedy[:, None], (1, tile // 2))
  within = [2 * columns[None, :], 2 * columns[None, :] + 1]
  logits = [plgpu.load(corrected_ref.at[row, jnp.int32(step), token[:, None] + c], mask=sampled,
                       other=0.0).astype(jnp.float32) for c in within]
  scores = [x / temperature[:, None] + g for x, g in zip(logits, (column_even, column_odd))]
  if greedy_in_tile:
    scores = [jnp.where(greedy[:, None], x, score) for x, score in zip(logits, scores)]
  _, column = _first_max_of_halves(scores[0], within[0], scores[1], within[1])
  token = token + column if greedy_in_tile else jnp.where(greedy, token, token + column)
  _write_token(refs, row, step, token, blocks)
  if vectors:  # the next step's Markov vector W1[token] (a vanilla head): refs[0] is W1
    w1_ref, rank = refs[0], refs[0].shape[1]
    ranks = jax.lax.broadcasted_iota(jnp.int32, (1, rank), 1)
    refs[-3 if blocks else -2][pl.ds(row, 1), pl.ds(0, rank)] = plgpu.load(
        w1_ref.at[jnp.broadcast_to(token[:, None], (1, rank)), ranks])


@functools.partial(jax.jit, static_argnames=("step", "batch", "pdl", "gamma", "tile_major",
                                             "reversed_tiles", "greedy_in_tile", "interpret"))
def draw_tokens(tile_key, tile_token, corrected, greedy, temperature, key_words, seeds, positions,
                block=None, w1=None, *, step, batch=None, pdl=False, gamma=None, tile_major=False,
                reversed_tiles=False, greedy_in_tile=False, interpret=False):
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
    tile_key, tile_token: [rows, V/c] float32 and int32 pairs of the step kernel (rows >= B),
      or tile-major (`tile_major`).
    corrected: [B, γ, V] the stored corrected logits (slice `step` is read).
    greedy: [B] bool or int (nonzero: greedy row). temperature: [B] float32 (clamped).
    key_words: [2] uint32 `sampling.key_words` of the block's key. seeds: [B] uint32.
    positions: [B] int32 the anchors' positions.
    step: static block position. batch: rows to choose for (None: all of `tile_key`'s).
    pdl: programmatic dependent launch (`step_stats`): let the next kernel launch at once, and
      wait for the kernels before only once the noise is drawn.
    block, gamma: as in `choose_tokens` (the block's [B, γ] tokens, written in place).
    tile_major: the pairs are [T, rows] with T >= V/c, row t < V/c tile t (rows after it
      ignored): `hopper_step.sampling_partials`' pairs.
    reversed_tiles: with `tile_major`, row t < V/c is tile V/c - 1 - t (``sampling_partials(...,
      reverse=True)``).
    greedy_in_tile: with `tile_major`, every row's tile token is the tile's first column
      (`tile_token` is None: ``sampling_partials(argmax=False)``), a greedy row's key its tile's
      max: a greedy row's token is then the first maximum of the stored logits in the chosen
      tile, found here (NaN first).
    w1: [V, r] a vanilla head's first matrix, r a power of two: each row's next Markov vector
      ``W1[token]`` is written too, so that the next step kernel (`hopper_step.sampling_partials`)
      reads it without an XLA gather between the two.

  Returns:
    [B] int32 tokens; with `gamma`, ``(tokens, block)``; with `w1`, the [B, r] vectors in W1's
    dtype after them.
  """
  if tile_major:
    rows, tile = tile_key.shape[1], sampling.vocab_tile(corrected.shape[2])
    tiles = corrected.shape[2] // tile
  else:
    rows, tiles = tile_key.shape
    tile = corrected.shape[2] // tiles
  batch = rows if batch is None else batch
  half = max(16, 1 << (-(-tiles // 2) - 1).bit_length())  # a power of two for the lanes
  kernel = functools.partial(_draw_kernel, tiles=tiles, half=half, tile=tile, step=step, pdl=pdl,
                             tile_major=tile_major, reversed_tiles=reversed_tiles,
                             vectors=w1 is not None, greedy_in_tile=greedy_in_tile,
                             interpret=interpret)
  if greedy_in_tile != (tile_token is None) or (greedy_in_tile and not tile_major):
    raise ValueError("tile_token: None exactly when greedy_in_tile, which needs tile_major")
  if tile_token is None:  # a placeholder the kernel does not read
    tile_token = jnp.zeros((1, 1), jnp.int32)
  inputs = [tile_key, tile_token, corrected, fused_step.greedy_mask(greedy),
            temperature.astype(jnp.float32), key_words.astype(jnp.uint32),
            seeds.astype(jnp.uint32), positions.astype(jnp.int32)]
  vectors = None
  if w1 is not None:
    rank = w1.shape[1]
    if rank & (rank - 1):
      raise ValueError(f"w1: the kernel's rank must be a power of two, got {w1.shape}")
    inputs.append(w1)
    vectors = jax.ShapeDtypeStruct((batch, rank), w1.dtype)
  return _call_with_tokens(kernel, inputs, batch, block, gamma, interpret, vectors)


def _noise_kernel(words_ref, seed_ref, position_ref, noise_ref, *, tiles, tile, half, pdl,
                  interpret):
  step, row = pl.program_id(0), pl.program_id(1)
  pairs = jax.lax.broadcasted_iota(jnp.int32, (half,), 0)
  if pdl:  # the chain's first kernel: the step kernel launches at once and waits late
    pairs = fused_step.launch_control("launch_dependents", pairs, interpret)
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
      compiler_params=fused_step.compiler_params(4, None),
      interpret=interpret,
  )(key_words.astype(jnp.uint32), seeds.astype(jnp.uint32), positions.astype(jnp.int32))
