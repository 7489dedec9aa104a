"""Packed tokens: the verify of the tokens a schedule chose, and the prefill of prompts of different
lengths, each packed into one of a few static token counts.

This module owns how tokens are packed. A round's verify tokens: with a verify-length schedule
each row r sends its anchor and ℓ_r drafts, ``count_r = 1 + ℓ_r`` tokens (0 for a finished row),
instead of γ + 1. The N = Σ_r count_r tokens are packed row after row into the smallest of a few
static token buckets (`token_buckets`), one compiled branch each (`lax.switch`), so the forward's
token-wise work (projections, MLP, LM head) follows N and no N recompiles. Each packed token
carries its row and position: it attends to its row's cache up to its own position (the row's
earlier verify tokens included) and writes its keys/values at that position only
(`TargetModel.packed`). The largest bucket, every row whole, is the dense forward itself (it
writes every row's W slots; those past a row's count lie past its committed length, so later
rounds overwrite them before they are read). The logits and target features come back in the
dense [B, γ + 1] layout that verification and the draft's context read; slots past a row's count
hold zeros, which verification never reads (a row's accepted run is capped at its verify length)
and the context cache overwrites before it reads.

`pack` is the layout: packed slot i belongs to the row whose run of counts covers it; padding
slots past N carry row B, which every scatter drops and every gather fills with zeros.

Prompts (`pack_prompts`): B prompts one after another, padded to `prompt_size` tokens, prefilled in
one pass in which each attends to itself only (`rounds._packed_prefill_forward`,
`TargetModel.packed_prefill`), so a prefill's work follows the prompts' tokens rather than B times
the longest. `packs` says whether the packed attention runs for a size, `prompt_limit` how many
tokens one pass may take; the callers (`generate`'s fixed batch, the queue's refills) pad where
either says no.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.kernels import attention
from dspark_jax.models import target as tm

BUCKET_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1)
"""Default token buckets, as fractions of a dense verify's B·(γ + 1) tokens."""
MIN_PACKED = 32
"""A verify of at most this many tokens has one bucket, all of them: so few tokens cost what the
weights' read costs, and a batched (``vmap``-ed) bucket choice would run every bucket."""


def token_buckets(batch: int, width: int) -> tuple[int, ...]:
  """The static token counts a verify of `batch` rows of up to `width` tokens packs into,
  ascending; the last is ``batch · width`` (every row whole), the only one up to `MIN_PACKED`
  tokens. Each is rounded up to a multiple of ``min(8, batch)``."""
  full = batch * width
  if full <= MIN_PACKED:
    return (full,)
  step = min(8, batch)
  sizes = {min(full, step * math.ceil(full * f / step)) for f in BUCKET_FRACTIONS}
  return tuple(sorted(s for s in sizes if s >= 1))


PROMPT_UNIT = 256
"""Packed prompts come in sizes of this many tokens times 1, 2, 3, 4, 6, 8, ... (`prompt_size`)."""


def prompt_size(total: int, unit: int = PROMPT_UNIT) -> int:
  """The static token count `total` packed prompt tokens are padded to: the smallest
  ``unit · m`` >= `total` with m a power of two or three times one (1, 2, 3, 4, 6, 8, 12, ...),
  so a packed prefill wastes at most a third of its tokens and few sizes (programs) occur."""
  power = 1
  while True:
    for m in (power, 3 * power // 2):
      if unit * m >= total and m >= 1:
        return unit * m
    power *= 2


PACKED_PROMPT_LIMIT = 8192
"""Most tokens a packed prefill takes in its one pass, unless B rows of ``prefill_chunk``
positions, what a padded prefill's pass holds, are more (`prompt_limit`)."""


def prompt_limit(batch: int, chunk: int | None, cache_len: int) -> int:
  """The most tokens `batch` prompts may pack into (`PACKED_PROMPT_LIMIT`, or what `batch` rows of
  a padded pass of `chunk` positions, or of the whole `cache_len` without a chunk, hold)."""
  return max(PACKED_PROMPT_LIMIT, batch * (chunk or cache_len))


def pack_prompts(rows, limit: int):
  """`rows` (1-D int token arrays, each of at least one token) one after another in
  `prompt_size`(their total) tokens, zeros after them: ``(tokens [N] int32, lengths [B] int32)``,
  or None where N would be over `limit`."""
  lengths = np.asarray([r.size for r in rows], np.int32)
  size = prompt_size(int(lengths.sum()))
  if size > limit:
    return None
  tokens = np.zeros((size,), np.int32)
  flat = np.concatenate(rows)
  tokens[:flat.size] = flat
  return tokens, lengths


def packs(config: tm.TargetConfig, size: int) -> bool:
  """Whether a packed prefill of `size` tokens runs for a target of `config` (its attention,
  `kernels.attention.choose_segments`), rather than a padded one."""
  probe = jax.ShapeDtypeStruct((1, size, config.layer.num_heads, config.layer.head_dim),
                               config.dtype)
  return attention.choose_segments(probe) is not None


def pack(counts: jax.Array, size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The layout of [B] `counts` tokens (each row's first slots) in `size` packed slots.

  Returns:
    rows [size] int32 (B where a slot is padding), slots [size] int32 (the token's slot in its row),
    and the number of tokens N = Σ counts (its slots are the first N).
  """
  counts = counts.astype(jnp.int32)
  batch = counts.shape[0]
  ends = jnp.cumsum(counts)
  index = jnp.arange(size, dtype=jnp.int32)
  rows = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)  # B past the last token
  starts = ends - counts
  slots = index - jnp.take(starts, jnp.minimum(rows, batch - 1))
  return rows, jnp.where(rows < batch, slots, 0), ends[-1]


def packed_verify(target: tm.TargetModel, tokens: jax.Array, positions: jax.Array,
                  counts: jax.Array, cache: dict, buckets: tuple[int, ...] | None = None
                  ) -> tuple[jax.Array, jax.Array, dict]:
  """The target on each row's first ``counts[r]`` tokens, packed (module docstring).

  Args:
    tokens, positions: [B, W] int, the dense verify block (positions consecutive within a row).
    counts: [B] int in 0..W: tokens row r verifies.
    cache: the target's KV cache. buckets: static token counts, ascending (default
      `token_buckets(B, W)`); the last must cover the largest Σ counts that can occur.

  Returns:
    logits [B, W, V] and features [B, W, F] (zeros past each row's count), the updated cache.
  """
  batch, width = tokens.shape
  buckets = buckets or token_buckets(batch, width)
  counts = jnp.clip(counts.astype(jnp.int32), 0, width)

  def run(size, tokens, positions, counts, cache):
    if size == batch * width:  # every row whole: the dense forward, with no packing overhead
      logits, features, cache = target(tokens, positions, cache)
      keep = jnp.arange(width)[None, :] < counts[:, None]
      zero = lambda x: jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, 0)
      return zero(logits), zero(features), cache
    rows, slots, _ = pack(counts, size)
    at = lambda x: x.at[rows, slots].get(mode="fill", fill_value=0)
    logits, features, cache = target.packed(at(tokens), rows, slots, at(positions), cache, width)
    dense = lambda x: jnp.zeros((batch, width) + x.shape[1:], x.dtype).at[rows, slots].set(
        x, mode="drop")
    return dense(logits), dense(features), cache

  if len(buckets) == 1:
    return run(buckets[0], tokens, positions, counts, cache)
  total = jnp.sum(counts)
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), total), len(buckets) - 1)
  branches = [lambda *args, size=size: run(size, *args) for size in buckets]
  return jax.lax.switch(index, branches, tokens, positions, counts, cache)
