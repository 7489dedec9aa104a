"""Per-row token sampling for a mixed greedy/sampled batch, and the row-keyed random streams.

This module owns two things:

* **Random streams.** A row's randomness is a pure function of ``(key, seed, position, stream)``
  (`row_keys`): the base key's words key a Threefry block with the stream id, whose output keys
  one more block with the request's seed and the absolute position of the token being drawn.
  Nothing about the other rows enters, so adding, removing, reordering or padding rows never
  changes a request's samples. The two-level sampler's noise is counter-based under the row's
  key (`tile_noise`, `counter_gumbel`): Threefry-2x32 (`threefry2x32`) written in uint32
  arithmetic, which XLA fuses and a Pallas kernel can run (`token_kernels`' `block_noise` and
  `draw_tokens` draw the same values on the GPU).
* **One sampling step** (`sample_tokens`, and the validated public entry point `sample_step`): greedy
  rows take ``argmax(logits)`` (ties -> smallest index); sampled rows take an exact sample of
  ``softmax(logits / T)`` by *two-level Gumbel-max* over vocabulary tiles of ``c`` columns
  (`vocab_tile`, c = 128 for the usual vocabularies):

  1. per tile t, its log-mass ``S_t = logsumexp(logits[t] / T)`` (`tile_stats`);
  2. the tile ``t* = argmax_t(S_t + G_t)``, G i.i.d. Gumbel(0, 1): ``P(t*) = e^{S_t} / Σ e^{S_u}``;
  3. the token ``argmax_{i in t*}(logits_i / T + G'_i)`` with fresh Gumbel noise G':
     ``P(i | t*) = e^{logits_i/T - S_t*}``.

  The product is ``softmax(logits / T)_i`` exactly: the Gumbel-max trick applied twice. It needs
  ``V/c + c`` noise draws per row instead of ``V``. Per-logit noise would cost a 20-round
  Threefry block per two logits, about 45 integer operations per logit, which at B = 128 is as
  much integer work per step as the step's whole memory floor allows for. The tile statistics
  cost one ``exp`` per logit, and a kernel can compute them while it produces the logits
  (`fused_step` does, in Pallas). Greedy rows reduce per-tile ``(max, first argmax)`` pairs.

Edge cases, defined here and tested:

* a row whose logits are all ``-inf`` returns token 0 (as SGLang does), greedy or sampled;
* ``NaN`` logits: ``argmax`` treats NaN as the maximum, so the row returns the index of its first NaN,
  always a valid token id; NaN never propagates into an out-of-range id;
* a ``+inf`` logit is certain (the first ``+inf`` if there are several).
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import validation
from dspark_jax.sampling import params as sp

NOISE_PRNG_IMPL = "philox4x32"
"""The implementation `row_keys` wraps its words as (for `jax.random` on the verifier's side)."""

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


class Stream(enum.IntEnum):
  """Stream ids: independent random streams for the different consumers of randomness."""

  DRAFT = 0          # draft block sampling (one draw per drafted position)
  VERIFY_ACCEPT = 1  # the verifier's accept/reject uniforms
  VERIFY_BONUS = 2   # the verifier's bonus/residual token
  TARGET = 3         # plain autoregressive sampling from the target (the baseline)


def threefry2x32(key, counter):
  """Threefry-2x32, 20 rounds (Salmon et al. 2011; JAX's default PRNG's block function).

  Written in uint32 additions, shifts and xors only, so that it runs wherever those do: fused into
  XLA's elementwise kernels, and inside a Pallas kernel (which has no PRNG primitive). Bit for bit
  ``jax.extend.random.threefry_2x32`` (tested).

  Args:
    key: a pair ``(k0, k1)`` of uint32 arrays (broadcast against the counter).
    counter: a pair ``(x0, x1)`` of uint32 arrays.

  Returns:
    The pair of uint32 output words, broadcast shape.
  """
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  x0, x1 = (jnp.asarray(x, jnp.uint32) for x in counter)
  schedule = (k0, k1, k0 ^ k1 ^ jnp.uint32(_THREEFRY_PARITY))
  x0, x1 = x0 + schedule[0], x1 + schedule[1]
  for block in range(5):
    for rotation in _THREEFRY_ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = (x1 << rotation) | (x1 >> (32 - rotation))
      x1 = x1 ^ x0
    x0 = x0 + schedule[(block + 1) % 3]
    x1 = x1 + schedule[(block + 2) % 3] + jnp.uint32(block + 1)
  return x0, x1


def key_words(key: jax.Array) -> jax.Array:
  """[2] uint32: a base key's data as one pair of words (longer key data folded in pair by pair).

  `key` is a typed key or a raw uint32 key of any implementation."""
  if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = jnp.asarray(key, jnp.uint32).reshape(-1)
  if words.shape[0] == 2:  # a Threefry key: its data as it is
    return words
  if words.shape[0] % 2:
    words = jnp.concatenate([words, jnp.zeros((1,), jnp.uint32)])
  pair = (words[0], words[1])
  for i in range(2, words.shape[0], 2):
    pair = threefry2x32(pair, (words[i], words[i + 1]))
  return jnp.stack(pair)


def row_key_words(base, stream, seeds, positions):
  """The pair of uint32 words of `row_keys`, from the base key's `key_words` ``(w0, w1)``:
  ``threefry2x32(threefry2x32(base, (stream, 0)), (seed, position))``, elementwise (a kernel
  derives its rows' keys so)."""
  stream_key = threefry2x32(base, (jnp.asarray(stream).astype(jnp.uint32), jnp.uint32(0)))
  return threefry2x32(stream_key, (jnp.asarray(seeds).astype(jnp.uint32),
                                   jnp.asarray(positions).astype(jnp.uint32)))


def row_keys(key: jax.Array, seeds: jax.Array, positions: jax.Array, stream: int | jax.Array
             ) -> jax.Array:
  """Derives one key per row from ``(key, seed, position, stream)`` only.

  The base key's words, through `threefry2x32` with the counter ``(stream, 0)``, key the block
  function once more with the counter ``(seed, position)``: two blocks of plain integer
  arithmetic, which a kernel can compute itself (`row_key_words`).

  Args:
    key: base PRNG key, a typed key (``jax.random.key``) or a raw uint32 key (``jax.random.PRNGKey``)
      of any implementation.
    seeds: [B] integer request seeds.
    positions: [B] integer absolute positions of the tokens being drawn.
    stream: stream id (`Stream`).

  Returns:
    [B] typed keys of implementation `NOISE_PRNG_IMPL` (for `jax.random`); `tile_noise` reads
    their two words directly.
  """
  base = key_words(key)
  words = row_key_words((base[0], base[1]), stream, seeds, positions)
  return jax.random.wrap_key_data(jnp.stack(words, axis=-1), impl=NOISE_PRNG_IMPL)


def gumbel_scores(logits: jax.Array, temperature: jax.Array, keys: jax.Array) -> jax.Array:
  """[B, V] float32 ``logits / T + G``: the scores whose argmax is an exact softmax(logits/T) sample.

  One Gumbel draw per logit (the one-level form; `sample_tokens` uses the two-level form). Meant to be
  consumed by a reduction in the same program (XLA fuses it; nothing is materialised).
  """
  vocab = logits.shape[-1]
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
  return logits.astype(jnp.float32) / temperature[:, None] + noise


def _chunk_size(vocab: int, limit: int = 2048) -> int:
  """The largest divisor of `vocab` that is <= `limit` (1 if `vocab` has none above 1)."""
  for size in range(min(vocab, limit), 0, -1):
    if vocab % size == 0:
      return size
  return 1


def _first_max(a, b):
  """Reducer over (value, index) pairs: the larger value; on ties the smaller index; NaN beats all."""
  (a_val, a_idx), (b_val, b_idx) = a, b
  a_nan, b_nan = jnp.isnan(a_val), jnp.isnan(b_val)
  earlier = a_idx < b_idx
  take_a = jnp.where(a_nan | b_nan, a_nan & (~b_nan | earlier),
                     (a_val > b_val) | ((a_val == b_val) & earlier))
  return jnp.where(take_a, a_val, b_val), jnp.where(take_a, a_idx, b_idx)


def _reduce_first_max(values, indices, axis):
  init = (jnp.array(-jnp.inf, values.dtype), jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32))
  return jax.lax.reduce((values, indices), init, _first_max, (axis,))


def argmax_last(scores: jax.Array) -> jax.Array:
  """[B] int32 argmax over the last axis of [B, V] `scores`; ties -> smallest index, NaN wins.

  Done in two stages over a [B, V / c, c] view, with c the largest divisor of V up to 2048: each
  stage is one (value, index) reduction, so XLA fuses the producer of `scores` (the Gumbel noise
  included) into the first stage without padding V, where a one-stage argmax over an awkward V (e.g.
  151936) makes it materialise a padded [B, V] float32 copy of the scores. The result equals
  ``jnp.argmax(scores, -1)`` exactly, ties and NaNs included.
  """
  batch, vocab = scores.shape
  chunk = _chunk_size(vocab)
  if chunk in (1, vocab):
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)
  shape = (batch, vocab // chunk, chunk)
  flat_index = (jax.lax.broadcasted_iota(jnp.int32, shape, 1) * chunk
                + jax.lax.broadcasted_iota(jnp.int32, shape, 2))
  values, indices = _reduce_first_max(scores.reshape(shape), flat_index, 2)   # [B, V/c]
  _, index = _reduce_first_max(values, indices, 1)                            # [B]
  return index


MAX_TILE = 128
"""Widest vocabulary tile of the two-level sampler (a Pallas block: a power of two)."""


def vocab_tile(vocab: int, limit: int = MAX_TILE) -> int:
  """The tile width c: the largest power of two <= `limit` dividing `vocab` (1 for odd V)."""
  tile = limit
  while tile > 1 and vocab % tile:
    tile //= 2
  return tile


def tile_log_mass(x: jax.Array, tile_max: jax.Array, temperature: jax.Array) -> jax.Array:
  """Per tile ``logsumexp(x / T)`` from float32 `x` [..., c] and its max [...] (the last axis goes).

  The max is taken out before the exp; a tile of only ``-inf`` gives ``-inf``, a NaN gives NaN and a
  ``+inf`` gives ``+inf``. `fused_step`'s kernel evaluates this same expression; `hopper_step`'s
  the same sum in base 2 (``2^((x - m) · log2(e) / T)``, fewer instructions there; slower in the
  Triton kernel: BENCHMARKS.md).
  """
  shift = jnp.where(jnp.isfinite(tile_max), tile_max, 0.0) / temperature
  mass = jnp.sum(jnp.exp(x / temperature[..., None] - shift[..., None]), axis=-1)
  return shift + jnp.log(mass)


def tile_stats(logits: jax.Array, temperature: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-tile statistics of [B, V] `logits` read as float32, tiles of `vocab_tile(V)` columns.

  Returns:
    ``(tile_max [B, V/c] f32, tile_argmax [B, V/c] int32 (a column of the whole row, the first
    maximum; the first NaN if any), tile_log_mass [B, V/c] f32 = logsumexp(logits[tile] / T))``.
  """
  batch, vocab = logits.shape
  tile = vocab_tile(vocab)
  x = logits.astype(jnp.float32).reshape(batch, vocab // tile, tile)
  column = (jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) * tile
            + jax.lax.broadcasted_iota(jnp.int32, x.shape, 2))
  tile_max, tile_argmax = _reduce_first_max(x, column, 2)
  return tile_max, tile_argmax, tile_log_mass(x, tile_max, temperature[:, None])


TILE_DOMAIN, COLUMN_DOMAIN = 0, 1
"""The counters' second words: the tile-choice noise and the in-tile (column) noise."""


def gumbel_of_bits(bits: jax.Array) -> jax.Array:
  """float32 Gumbel(0, 1) from uniform uint32 `bits`: ``-log(-log(u))`` with u the bits' top 23
  as ``(2m + 1) / 2^24``, strictly inside (0, 1) and exact in float32."""
  odd = ((bits >> 9) << 1 | 1).astype(jnp.int32).astype(jnp.float32)
  return -jnp.log(-jnp.log(odd * np.float32(2.0**-24)))


def counter_gumbel(k0: jax.Array, k1: jax.Array, domain, index: jax.Array) -> jax.Array:
  """The Gumbel draw number `index` (integers >= 0) of `domain` under the key words ``(k0, k1)``,
  elementwise: word ``index % 2`` of ``threefry2x32(k, (index // 2, domain))``."""
  index = jnp.asarray(index).astype(jnp.uint32)
  y0, y1 = threefry2x32((k0, k1), (index >> 1, jnp.asarray(domain).astype(jnp.uint32)))
  return gumbel_of_bits(jnp.where((index & 1) == 1, y1, y0))


def tile_noise(keys: jax.Array, tiles: int, tile: int) -> jax.Array:
  """[..., tiles + tile] float32 Gumbel(0, 1) noise of the two-level sampler, per key of [...] keys.

  The first `tiles` values choose the tile (draws 0 .. tiles-1 of `TILE_DOMAIN`), the last `tile`
  the column inside it (draws 0 .. tile-1 of `COLUMN_DOMAIN`), by `counter_gumbel` from the keys'
  two words: one elementwise expression, so that XLA fuses it (each value computes its Threefry
  block and keeps one of the two words; the GPU's sampling blocks draw the noise in
  `token_kernels` instead, a block per two values).
  """
  words = jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
  index = jnp.arange(tiles + tile, dtype=jnp.int32)
  column = index >= tiles
  return counter_gumbel(words[..., 0, None], words[..., 1, None],
                        jnp.where(column, COLUMN_DOMAIN, TILE_DOMAIN),
                        jnp.where(column, index - tiles, index))


def tokens_from_tile_stats(logits: jax.Array, tile_max: jax.Array, tile_argmax: jax.Array,
                           tile_mass: jax.Array, greedy: jax.Array, temperature: jax.Array,
                           noise: jax.Array, *, step: int | None = None) -> jax.Array:
  """Steps 2-3 of the two-level sampler (module docstring), and the greedy rows' argmax.

  Args:
    logits: [B, V] the logits the statistics were taken of, or [B, γ, V] with `step` naming the
      row's slice (only the chosen tile of a sampled row is read again, so no slice is copied).
    tile_max, tile_argmax, tile_mass: [B, V/c] from `tile_stats`.
    greedy: [B] bool. temperature: [B] float32 (clamped).
    noise: [B, V/c + c] from `tile_noise` with the rows' keys (`row_keys`).

  Returns:
    [B] int32 tokens.
  """
  tiles = tile_max.shape[1]
  tile = logits.shape[-1] // tiles
  starts = jnp.broadcast_to(jnp.arange(tiles, dtype=jnp.int32) * tile, tile_max.shape)
  chosen = tokens_from_tile_choices(*tile_choices(tile_max, tile_argmax,
                                                  tile_mass + noise[:, :tiles], starts, greedy))
  return tokens_in_chosen_tiles(logits, chosen, greedy, temperature, noise, step=step)


def tokens_in_chosen_tiles(logits: jax.Array, chosen: jax.Array, greedy: jax.Array,
                           temperature: jax.Array, noise: jax.Array, *,
                           step: int | None = None) -> jax.Array:
  """Step 3 of the two-level sampler, after one reduction over (key, token) pairs chose per row.

  With a sampled row's pair per tile (``S_t + G_t``, the tile's first column) and a greedy row's
  (max, first argmax), `tokens_from_tile_choices` gives a greedy row's token and a sampled row's
  chosen tile, as its first column (the tie rule "smaller token" is then "smaller tile"); this draws
  the sampled rows' tokens inside their tiles.

  Args:
    logits: as in `tokens_from_tile_stats`. chosen: [B] int32 from `tokens_from_tile_choices`.
    greedy, temperature, noise: as in `tokens_from_tile_stats`.

  Returns:
    [B] int32 tokens.
  """
  tile = vocab_tile(logits.shape[-1])
  tiles = logits.shape[-1] // tile
  if step is None:  # a greedy row reads some window too (clamped), and ignores it
    window = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (tile,)))(logits, chosen)
  else:
    window = jax.vmap(lambda rows, s: jax.lax.dynamic_slice(rows, (step, s), (1, tile))[0])(
        logits, chosen)
  within = argmax_last(window.astype(jnp.float32) / temperature[:, None] + noise[:, tiles:])
  return jnp.where(greedy, chosen, chosen + within)


def tile_choices(tile_max: jax.Array, tile_argmax: jax.Array, tile_score: jax.Array,
                 tile_draw: jax.Array, greedy: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per row and tile, the (key, token) pair the token choice maximises over the tiles.

  Args:
    tile_max, tile_argmax: [B, V/c] per-tile max and first argmax (a greedy row's pair).
    tile_score: [B, V/c] ``S_t + G_t``: the tile's log-mass plus its Gumbel draw (noise[:, :V/c]).
    tile_draw: [B, V/c] int32, a sampled row's token per tile: the tile's own draw
      ``argmax(logits[tile] / T + G')`` with the row's inner noise ``G' = noise[:, V/c:]`` (the same
      for every tile), or the tile's first column (then `tokens_in_chosen_tiles` draws in it).
    greedy: [B] bool.

  Returns:
    ``(key, token)``, [B, V/c] each; `fused_step`'s kernel forms the same pairs. A row's tokens
    increase with the tile, so `tokens_from_tile_choices`' tie rule "smaller token" is the rule
    "smaller tile", and one reduction serves both kinds of row: with per-tile draws it gives the
    token `tokens_from_tile_stats` gives for the same noise.
  """
  choose = greedy[:, None]
  return jnp.where(choose, tile_max, tile_score), jnp.where(choose, tile_argmax, tile_draw)


def tokens_from_tile_choices(tile_key: jax.Array, tile_token: jax.Array) -> jax.Array:
  """[B] int32: the token of the tile with the largest key (ties: the smaller token; NaN first).

  One (value, index) reduction over the tiles, for greedy and sampled rows alike; with the tiles'
  (max, first argmax) pairs it is the rows' argmax.
  """
  return _reduce_first_max(tile_key, tile_token, 1)[1]


def sample_tokens(logits: jax.Array, greedy: jax.Array, temperature: jax.Array, keys: jax.Array
                  ) -> jax.Array:
  """Samples one token per row of a mixed batch (two-level Gumbel-max). Pure, jittable, unchecked.

  Args:
    logits: [B, V] any float dtype; read as float32.
    greedy: [B] bool, rows decoded by argmax.
    temperature: [B] float32 draft temperatures (already clamped >= 1e-5).
    keys: [B] per-row keys from `row_keys`.

  Returns:
    [B] int32 tokens.
  """
  stats = tile_stats(logits, temperature)
  noise = tile_noise(keys, stats[0].shape[1], logits.shape[1] // stats[0].shape[1])
  return tokens_from_tile_stats(logits, *stats, greedy, temperature, noise)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """[B] int32 ``argmax`` over the last axis (ties -> smallest index)."""
  return argmax_last(logits)


@functools.partial(jax.jit, static_argnames=("stream",))
def _sample_step(logits, params, key, positions, stream):
  keys = row_keys(key, params.seed, positions, stream)
  return sample_tokens(logits, params.greedy_mask, params.draft_temperature, keys)





def check_logits(logits, params: sp.SamplingParams) -> None:
  """Raises ValueError unless `logits` is a float [B, V] array and `params` has B rows."""
  if np.ndim(logits) != 2:
    raise ValueError(f"logits: expected [B, V], got shape {np.shape(logits)}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits: expected a float dtype, got {logits.dtype}")
  if np.shape(logits)[1] < 1:
    raise ValueError(f"logits: expected V >= 1 columns (one per token id), got shape "
                     f"{np.shape(logits)}")
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != logits.shape[0]:
    raise ValueError(f"params: has {params.batch_size} rows but logits has {logits.shape[0]}")


def sample_step(logits: jax.Array, params: sp.SamplingParams, key: jax.Array, positions: jax.Array,
                *, stream: int = Stream.DRAFT) -> jax.Array:
  """Samples one token per row of a mixed greedy/sampled batch in one compiled program.

  Greedy rows return ``argmax(logits)`` (ties -> smallest index). Every other row returns an
  exact sample of ``softmax(logits / T)``, T clamped to ``>= 1e-5``; top-k and top-p are not applied
  (draft sampling ignores them). Row b's randomness depends on ``(key, params.seed[b], positions[b],
  stream)`` only.

  Args:
    logits: [B, V] float logits (bf16, f16 or f32).
    params: `SamplingParams` with B rows.
    key: base PRNG key (typed or raw).
    positions: [B] int absolute positions of the tokens being sampled.
    stream: stream id, default `Stream.DRAFT`.

  Returns:
    [B] int32 token ids in [0, V).

  Raises:
    ValueError: wrong ranks or batch sizes, non-float logits, non-integer positions or positions
      outside [0, 2**31), a key that is not one PRNG key, an unknown stream.
    TypeError: logits or positions that are not arrays (lists of numbers are converted).
  """
  logits = validation.as_array("logits", logits)
  positions = validation.as_array("positions", positions)
  check_logits(logits, params)
  validation.check_batch("positions", positions, logits.shape[0])
  check_positions("positions", positions)
  validation.check_key("key", key)
  return _sample_step(logits, params, key, jnp.asarray(positions, jnp.int32), check_stream(stream))


def check_positions(name: str, positions) -> None:
  """Raises ValueError naming the first position outside [0, 2**31) (concrete values only)."""
  validation.check_range(name, positions, 0, validation.POSITION_LIMIT,
                         what="must be in [0, 2**31)")


def check_stream(stream) -> int:
  """`stream` as an int, or ValueError unless it is a `Stream` (or its integer value)."""
  valid = isinstance(stream, (int, np.integer)) and not isinstance(stream, bool)
  if not valid or int(stream) not in {s.value for s in Stream}:
    raise ValueError(f"stream: expected a Stream ({', '.join(s.name for s in Stream)}), got "
                     f"{stream!r}")
  return int(stream)
