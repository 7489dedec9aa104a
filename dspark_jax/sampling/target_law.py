"""The target's per-row sampling law (docs/exactness.md): temperature, then top-k, then top-p.

This module owns the distribution a request asks the *target* to sample from, and exact sampling from
it (the autoregressive baseline and the verifier's bonus tokens both draw from this law):

* scale the logits by ``1 / T`` (T clamped to ``>= 1e-5``);
* **top-k** (``top_k > 0``): keep the k most likely tokens;
* **top-p** (``top_p < 1``): on the renormalised top-k distribution, keep the smallest set of most
  likely tokens whose mass reaches ``top_p``;
* renormalise over the kept set.

"Most likely" is the order of the scaled logits, ties broken by the smaller token id, so the kept set
is always a prefix of one total order and is never ambiguous. The truncation sorts the vocabulary, so
it runs (under `lax.cond`) only when some row of the batch truncates.

Greedy rows (docs/exactness.md) are not this module's business: their law is the point mass on
``argmax(logits)``; `sample_target` handles both kinds of row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import validation
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import params as sp


def _truncation_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """[N, V] bool: the tokens each row keeps after top-k then top-p (see the module docstring)."""
  rows, vocab = scaled.shape
  token_ids = jax.lax.broadcasted_iota(jnp.int32, (rows, vocab), 1)
  # Ascending sort of (-scaled, id): most likely first, ties -> smaller id first.
  neg_sorted, sorted_ids = jax.lax.sort((-scaled, token_ids), dimension=1, num_keys=2)
  sorted_scaled = -neg_sorted
  rank = token_ids  # position in the sorted order
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k = rank < k[:, None]
  probs = jnp.where(in_top_k, jax.nn.softmax(sorted_scaled, axis=1), 0.0)
  mass_before = jnp.cumsum(probs, axis=1) - probs
  total = probs.sum(axis=1, keepdims=True)
  # top_p == 1 means "off" exactly: rounding in the cumulative sum must not drop a tail token.
  in_top_p = (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None] * total)
  kept = jnp.sum(in_top_k & in_top_p, axis=1)  # a prefix of the order, at least one token
  last = jnp.maximum(kept, 1)[:, None] - 1
  threshold = jnp.take_along_axis(sorted_scaled, last, axis=1)
  threshold_id = jnp.take_along_axis(sorted_ids, last, axis=1)
  return (scaled > threshold) | ((scaled == threshold) & (token_ids <= threshold_id))


def target_log_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> jax.Array:
  """Log-probabilities of the target law of each row; pure and jittable.

  Args:
    logits: [B, ..., V] target logits, any float dtype (read as float32).
    temperature: [B] float32, already clamped to ``>= 1e-5``.
    top_k: [B] int32, ``<= 0`` = off.
    top_p: [B] float32 in (0, 1], ``1`` = off.

  Returns:
    [B, ..., V] float32 log-probabilities; ``-inf`` outside the kept set. A row whose logits are all
    ``-inf`` (or contain NaN) gives NaN: no law exists; callers map it to a defined token.
  """
  shape = logits.shape
  batch, vocab = shape[0], shape[-1]
  inner = int(np.prod(shape[1:-1], dtype=np.int64))
  scaled = logits.astype(jnp.float32).reshape(batch, inner, vocab) / temperature[:, None, None]
  scaled = scaled.reshape(batch * inner, vocab)

  def truncate(scaled):
    mask = _truncation_mask(scaled, jnp.repeat(top_k, inner), jnp.repeat(top_p, inner))
    return jnp.where(mask, scaled, -jnp.inf)

  truncating = jnp.any((top_k > 0) | (top_p < 1.0))
  scaled = jax.lax.cond(truncating, truncate, lambda s: s, scaled)
  return jax.nn.log_softmax(scaled, axis=-1).reshape(shape)


def sample_from_log_weights(log_weights: jax.Array, keys: jax.Array) -> jax.Array:
  """[B] int32 exact samples of ``softmax(log_weights)`` (Gumbel-max); NaN rows give their first NaN."""
  ones = jnp.ones(log_weights.shape[:1], jnp.float32)
  return sampling.argmax_last(sampling.gumbel_scores(log_weights, ones, keys))


def sample_target_tokens(logits: jax.Array, greedy: jax.Array, temperature: jax.Array,
                         top_k: jax.Array, top_p: jax.Array, keys: jax.Array) -> jax.Array:
  """One token per row from the target law (greedy rows: argmax). Pure; no input checks.

  Args:
    logits: [B, V] target logits.
    greedy, temperature, top_k, top_p: [B] per-row parameters (temperature clamped).
    keys: [B] per-row keys (`sampling.row_keys`).

  Returns:
    [B] int32 tokens in [0, V). A sampled row of all ``-inf`` or with any NaN (no law) returns 0; a
    greedy row with NaN returns its first NaN's index.
  """
  log_probs = target_log_probs(logits, temperature, top_k, top_p)
  sampled = sample_from_log_weights(log_probs, keys)
  return jnp.where(greedy, sampling.greedy_tokens(logits), sampled)


@functools.partial(jax.jit, static_argnames=("stream",))
def _sample_target(logits, params, key, positions, stream):
  keys = sampling.row_keys(key, params.seed, positions, stream)
  return sample_target_tokens(logits, params.greedy_mask, params.draft_temperature, params.top_k,
                              params.top_p, keys)


def sample_target(logits: jax.Array, params: sp.SamplingParams, key: jax.Array,
                  positions: jax.Array, *, stream: int = sampling.Stream.TARGET) -> jax.Array:
  """Samples one token per row from the target law, in one compiled program.

  Greedy rows take ``argmax(logits)`` (ties -> smallest index); sampled rows draw exactly from the
  law of the module docstring. Row b's randomness depends on ``(key, seed_b, positions_b, stream)``.

  Args:
    logits: [B, V] float target logits.
    params: `SamplingParams` with B rows.
    key: base PRNG key.
    positions: [B] int absolute positions of the tokens being sampled.
    stream: stream id, default `Stream.TARGET` (autoregressive decoding).

  Returns:
    [B] int32 tokens in [0, V).
  """
  sampling.check_logits(logits, params)
  validation.check_batch("positions", positions, logits.shape[0])
  validation.check_key("key", key)
  return _sample_target(logits, params, key, jnp.asarray(positions), int(stream))
