"""EXPERIMENTAL (issue 6): one fused Pallas kernel per draft step, and the noise it can share with XLA.

Not used by the library yet: it is here to be measured on the GPU against the XLA program
(`proposal.folded_block`). What it owns:

* `threefry2x32`: the Threefry-2x32 block cipher (20 rounds, Salmon et al. 2011) in plain uint32
  arithmetic (add, rotate, xor). It equals ``jax.extend.random.threefry_2x32`` bit for bit (tested),
  and because it is only elementwise integer ops it runs unchanged inside a Pallas kernel and inside
  any XLA fusion. `gumbel_noise` turns its bits into Gumbel(0, 1) noise for (row key, column).
* `fused_step`: per vocabulary tile, one kernel reads ``W2[:, tile]`` once for all rows, computes
  ``bias = W1[x_prev] @ W2`` in float32, adds the step's base logits, rounds to the logits dtype,
  writes the corrected logits, adds Gumbel noise to ``L / T`` (sampled rows) and reduces the tile to
  a (max, first index) pair per row; a small second reduction over tiles picks each row's token.
  That is the floor's traffic: W2, the base logits and the corrected logits, each once.
* `reference_step`: the same math in plain XLA, the oracle for the kernel's tests.

Semantics match `sampling.argmax_last`: ties go to the smallest index and NaN wins (its first index).
Runs in Pallas interpret mode on the CPU (tests) and through Pallas' GPU lowering elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dspark_jax import sampling

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
MIN_ROWS = 16  # GPU matrix units want at least 16 rows per dot


def _rotl(x, r):
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def threefry2x32(key0, key1, x0, x1):
  """Threefry-2x32 with 20 rounds on uint32 arrays (broadcast together); returns two uint32 words."""
  key0, key1 = jnp.asarray(key0, jnp.uint32), jnp.asarray(key1, jnp.uint32)
  ks = (key0, key1, key0 ^ key1 ^ jnp.uint32(_PARITY))
  x0 = jnp.asarray(x0, jnp.uint32) + ks[0]
  x1 = jnp.asarray(x1, jnp.uint32) + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + jnp.uint32(group + 1)
  return x0, x1


def gumbel_noise(key0, key1, columns):
  """Gumbel(0, 1) float32 noise for row keys (key0, key1) [B, 1] and columns [1, C] (uint32)."""
  bits, _ = threefry2x32(key0, key1, columns, jnp.zeros_like(columns))
  # 23 random mantissa bits -> uniform in [1, 2) -> [0, 1); clamp away from 0 as jax.random does.
  uniform = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000),
                                         jnp.float32) - 1.0
  uniform = jnp.maximum(uniform, jnp.finfo(jnp.float32).tiny)
  return -jnp.log(-jnp.log(uniform))


def row_key_words(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two uint32 words per row from [B] typed keys (`sampling.row_keys`)."""
  bits = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
  return bits[:, 0], bits[:, 1]


def _tile_first_max(scores, columns):
  """Per row of [R, C] `scores`: (max value, its first column), NaN winning (first NaN)."""
  big = jnp.int32(np.iinfo(np.int32).max)
  is_nan = jnp.isnan(scores)
  any_nan = jnp.any(is_nan, axis=1, keepdims=True)
  clean = jnp.where(is_nan, -jnp.inf, scores)
  best = jnp.max(clean, axis=1, keepdims=True)
  first_best = jnp.min(jnp.where(clean == best, columns, big), axis=1)
  first_nan = jnp.min(jnp.where(is_nan, columns, big), axis=1)
  value = jnp.where(any_nan[:, 0], jnp.nan, best[:, 0])
  return value, jnp.where(any_nan[:, 0], first_nan, first_best)


def _step_math(e, w2, base, temperature, greedy, key0, key1, columns, logits_dtype):
  """Corrected logits (logits dtype) and sampling scores of one vocabulary slice."""
  bias = jnp.dot(e, w2, preferred_element_type=jnp.float32)
  corrected = (base.astype(jnp.float32) + bias).astype(logits_dtype)
  rounded = corrected.astype(jnp.float32)
  noisy = rounded / temperature + gumbel_noise(key0, key1, columns)
  return corrected, jnp.where(greedy, rounded, noisy)


def _kernel(e_ref, w2_ref, base_ref, temp_ref, greedy_ref, k0_ref, k1_ref,
            corrected_ref, value_ref, index_ref, *, tile):
  start = pl.program_id(0) * tile
  columns = start + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
  corrected, scores = _step_math(
      e_ref[...], w2_ref[...], base_ref[...], temp_ref[...], greedy_ref[...] != 0, k0_ref[...],
      k1_ref[...], columns.astype(jnp.uint32), corrected_ref.dtype)
  corrected_ref[...] = corrected
  value, index = _tile_first_max(scores, columns)
  value_ref[...] = value[None, :]
  index_ref[...] = index[None, :]


def vocab_tile(vocab: int, limit: int = 512) -> int:
  """The largest power of two <= `limit` dividing V (Pallas GPU blocks are powers of two)."""
  tile = limit
  while tile > 1 and vocab % tile:
    tile //= 2
  return tile


@functools.partial(jax.jit, static_argnames=("interpret",))
def fused_step(e, w2, base, temperature, greedy, key0, key1, *, interpret=False):
  """One draft step in one kernel (+ a tiny reduction over tiles).

  Args:
    e: [B, r] ``W1[x_prev]`` in the weights' dtype. w2: [r, V]. base: [B, V] the step's base logits.
    temperature: [B] float32 (clamped). greedy: [B] bool. key0, key1: [B] uint32 row key words.
    interpret: run the kernel in Pallas' interpreter (CPU tests).

  Returns:
    (tokens [B] int32, corrected [B, V] in base's dtype).
  """
  batch, rank = e.shape
  vocab = w2.shape[1]
  rows = max(MIN_ROWS, 1 << (batch - 1).bit_length())
  pad = rows - batch
  col = lambda x, dtype: jnp.pad(x.astype(dtype), (0, pad))[:, None]
  e_p = jnp.pad(e, ((0, pad), (0, 0)))
  base_p = jnp.pad(base, ((0, pad), (0, 0)))
  tile = vocab_tile(vocab)
  tiles = vocab // tile
  whole = lambda shape: pl.BlockSpec(shape, lambda j: (0, 0))
  corrected, values, indices = pl.pallas_call(
      functools.partial(_kernel, tile=tile),
      grid=(tiles,),
      in_specs=[whole((rows, rank)), pl.BlockSpec((rank, tile), lambda j: (0, j)),
                pl.BlockSpec((rows, tile), lambda j: (0, j)), whole((rows, 1)), whole((rows, 1)),
                whole((rows, 1)), whole((rows, 1))],
      out_specs=[pl.BlockSpec((rows, tile), lambda j: (0, j)),
                 pl.BlockSpec((1, rows), lambda j: (j, 0)), pl.BlockSpec((1, rows), lambda j: (j, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, vocab), base.dtype),
                 jax.ShapeDtypeStruct((tiles, rows), jnp.float32),
                 jax.ShapeDtypeStruct((tiles, rows), jnp.int32)],
      interpret=interpret,
  )(e_p, w2, base_p, col(temperature, jnp.float32), col(greedy, jnp.int32),
    col(key0, jnp.uint32), col(key1, jnp.uint32))
  _, tokens = sampling._reduce_first_max(values.T, indices.T, 1)
  return tokens[:batch], corrected[:batch]


def reference_step(e, w2, base, temperature, greedy, key0, key1):
  """`fused_step` in plain XLA (no kernel): the oracle for tests."""
  columns = jnp.arange(w2.shape[1], dtype=jnp.uint32)[None, :]
  corrected, scores = _step_math(e, w2, base, temperature[:, None], greedy[:, None],
                                 key0[:, None], key1[:, None], columns, base.dtype)
  return sampling.argmax_last(scores), corrected


@functools.partial(jax.jit, static_argnames=("interpret",))
def fused_block(w1, w2, base_logits, anchor, greedy, temperature, seeds, positions, key, *,
                interpret=False):
  """The γ-step block of a vanilla head with `fused_step` per step (unrolled).

  Same inputs as `proposal.folded_block` (vanilla head, no confidence); the per-row keys are the
  draft stream's (`sampling.row_keys` at ``positions + k + 1``), turned into Threefry words, so the
  tokens are exact samples but not the same draws as `proposal.folded_block`'s Philox noise.

  Returns:
    (tokens [B, γ] int32, corrected [B, γ, V]).
  """
  gamma = base_logits.shape[1]
  prev = anchor.astype(jnp.int32)
  tokens, corrected = [], []
  for k in range(gamma):
    keys = sampling.row_keys(key, seeds, positions + k + 1, sampling.Stream.DRAFT)
    key0, key1 = row_key_words(keys)
    prev, logits = fused_step(jnp.take(w1, prev, axis=0).astype(w2.dtype), w2, base_logits[:, k],
                              temperature, greedy, key0, key1, interpret=interpret)
    tokens.append(prev)
    corrected.append(logits)
  return jnp.stack(tokens, axis=1), jnp.stack(corrected, axis=1)
