"""The target: a Qwen3-style decoder with a static-size KV cache (flax nnx).

This module owns the target language model: token embedding, a stack of `layers.DecoderLayer`s with
causal attention over a per-layer KV cache, the final RMSNorm and the LM head (tied to the embedding or
its own matrix). One call processes T new tokens per row at given absolute positions: it writes their
keys/values into the cache at those positions, and each query attends to every cache slot at or before
its own position. The cache is contiguous (`init_cache`) or paged (`dspark_jax.paging.cache.PagedKV`,
read and written through its block table). Validity is purely positional, so rolling back rejected
tokens needs no work: their slots lie beyond the committed length and are overwritten before any
query can see them.

The call also returns the hidden states of configured layers (`TargetConfig.feature_layers`; index -1
is the embedding output, i >= 0 the output of decoder layer i), concatenated on the feature axis: the
context features a DSpark draft reads (docs/design.md).

`TargetModel.forward` and `logits` run the same layers without a cache: causal attention among the
given tokens only (the counterpart of a Hugging Face ``model(input_ids)``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax.kernels import attention
from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.paging import cache as paging


@dataclasses.dataclass(frozen=True)
class TargetConfig:
  """Sizes of the target.

  Attributes:
    vocab_size: V. num_layers: decoder layers. layer: the `layers.LayerShape` of every layer.
    tie_embeddings: the LM head is the embedding matrix (transposed).
    feature_layers: layers whose hidden states the call returns as draft context features.
    dtype: compute dtype; param_dtype: storage dtype of the weights.
    max_position_embeddings: the context length the model was trained for (a Hugging Face
      config's field, kept so that a saved config says it again); None if unknown. Not enforced.
  """

  vocab_size: int
  num_layers: int
  layer: layers.LayerShape
  tie_embeddings: bool = True
  feature_layers: tuple[int, ...] = (-1,)
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  max_position_embeddings: int | None = None

  def __post_init__(self):
    validation.check_positive_int("vocab_size", self.vocab_size)
    if self.max_position_embeddings is not None:
      validation.check_positive_int("max_position_embeddings", self.max_position_embeddings)
    validation.check_positive_int("num_layers", self.num_layers)
    if not isinstance(self.layer, layers.LayerShape):
      raise ValueError(f"layer: expected a LayerShape, got {type(self.layer).__name__}")
    bad = [i for i in self.feature_layers if not -1 <= i < self.num_layers]
    if bad:
      raise ValueError(f"feature_layers: {bad[0]} is not -1 (embeddings) or a layer in "
                       f"0..{self.num_layers - 1}")

  @property
  def hidden_size(self) -> int:
    return self.layer.hidden_size


def qwen3_4b_shape(**overrides) -> TargetConfig:
  """The Qwen3-4B shape (36 layers, E 2560, 32/8 heads of 128, SwiGLU 9728, V 151936), bf16."""
  values = dict(vocab_size=151936, num_layers=36, tie_embeddings=True,
                layer=layers.LayerShape(hidden_size=2560, num_heads=32, num_kv_heads=8, head_dim=128,
                                        intermediate_size=9728),
                feature_layers=(1, 9, 17, 25, 33), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  values.update(overrides)
  return TargetConfig(**values)


CACHE_MULTIPLE = 128
"""On GPUs the decoding loops allocate caches in multiples of this: the ragged attention kernel
reads the cache in blocks of 64 slots, and a prefill's query tiles in blocks of 128
(`kernels.ragged_attention.default_block`)."""


def cache_slots(needed: int, platform: str | None = None) -> int:
  """The cache size the decoding loops allocate for `needed` slots: on a GPU (`platform`, default
  JAX's default backend) rounded up to `CACHE_MULTIPLE`, where the ragged kernel reads it; elsewhere
  exactly `needed` (the einsums would only read the padding)."""
  if (platform or jax.default_backend()) != "gpu":
    return needed
  return -(-needed // CACHE_MULTIPLE) * CACHE_MULTIPLE


def init_cache(config: TargetConfig, batch: int, length: int) -> dict[str, tuple[jax.Array, ...]]:
  """A zeroed KV cache: ``{"k": (...), "v": (...)}``, one head-major [B, K, S, D] array per layer.

  One array per layer (not one stacked array) so that each layer's write is an in-place update of
  its own buffer inside a compiled loop. Head-major so that attention reads each head's keys
  contiguously, in place (`kernels.attention`).
  """
  shape = (batch, config.layer.num_kv_heads, length, config.layer.head_dim)
  return {name: tuple(jnp.zeros(shape, config.dtype) for _ in range(config.num_layers))
          for name in ("k", "v")}


class TargetModel(nnx.Module):
  """Qwen3-style decoder. ``model(tokens, positions, cache) -> (logits, features, cache)``.

  `plan` is None, or the `models.layout.Plan` a sharded copy (`dspark_jax.shard`) runs under:
  its caches (contiguous, or a paged cache's pools) are then kept sharded by KV head.
  """

  plan = None

  def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.hidden_size, **kw)
    self.layers = nnx.List([layers.DecoderLayer(config.layer, **kw)
                            for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.layer.rms_eps, **kw)
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, **kw)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """LM head on final-normed hidden states [..., E] -> [..., V] in the compute dtype."""
    if self.config.tie_embeddings:
      return self.embed.attend(hidden)
    return self.lm_head(hidden)

  def forward(self, tokens: jax.Array, positions: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """Runs [B, T] `tokens` without a cache: each token attends to the given tokens at or before
    its own position.

    Args:
      tokens: [B, T] int token ids (not checked here: see `logits`).
      positions: [B, T] int absolute positions, increasing within a row; default ``0 .. T-1``.

    Returns:
      logits [B, T, V] (compute dtype) and features [B, T, len(feature_layers) * E].
    """
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    mask = positions[:, None, :] <= positions[:, :, None]                # [B, T, T] causal
    x = self.embed(tokens)
    saved = {-1: x}
    for i, layer in enumerate(self.layers):
      x, _ = layer(x, positions, lambda k, v: (
          layers.Full(layers.heads_first(k), layers.heads_first(v), mask), None))
      saved[i] = x
    features = jnp.concatenate([saved[i] for i in self.config.feature_layers], axis=-1)
    return self.logits(self.final_norm(x)), features

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict, *, head: bool = True,
               fresh: bool = False) -> tuple[jax.Array, jax.Array, dict]:
    """Runs T new tokens per row.

    Args:
      tokens: [B, T] int token ids.
      positions: [B, T] int absolute positions; consecutive within a row (``start_b + t``).
      cache: from `init_cache` (S slots; slot s holds the keys/values of position s), or a paged
        cache (`dspark_jax.paging.cache.PagedKV` with B table rows: keys/values written and read
        through its block table; a row without a page for a position writes nothing there).
      head: False returns the final-normed hidden states [B, T, E] in place of the logits, for a
        caller that needs the logits of a few positions only (`logits` of those).
      fresh: (static) every row's positions are 0..T-1 and its cache holds nothing before them (a
        one-pass prefill): each layer may attend over the call's own keys, on a GPU through
        cuDNN's causal flash attention (`kernels.attention.choose_causal`). The same function;
        checked when `positions` is concrete. A paged cache ignores it. Without it, a call of
        T >= 64 queries (a prefill chunk) may attend to the cache before ``start_b`` and to its
        own keys as two cuDNN parts (`kernels.attention.attend_chunk`), which relies on the
        positions being consecutive.

    Returns:
      logits [B, T, V] (compute dtype), features [B, T, len(feature_layers) * E], the updated cache.
    """
    start = positions[:, 0]
    limits = positions + 1                                              # causal: slots <= position
    if fresh and not validation.is_traced(positions):
      expected = np.arange(tokens.shape[1])
      bad = np.flatnonzero(np.any(np.asarray(positions) != expected, axis=1))
      if bad.size:
        raise ValueError(f"positions: fresh=True needs positions 0..T-1 in every row; row "
                         f"{int(bad[0])} starts at {int(np.asarray(positions)[bad[0], 0])}")
    if isinstance(cache, paging.PagedKV):
      rows = jnp.broadcast_to(jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None], tokens.shape)
      return self._paged(tokens, positions, cache, rows, positions, limits, None, head)

    def write(i, k, v):
      return (layout.constrain_cache(layers.write_heads(cache["k"][i], k, start), self.plan),
              layout.constrain_cache(layers.write_heads(cache["v"][i], v, start), self.plan))

    def then(keys, values):
      return layers.CacheUpTo(keys, values, limits, bool(fresh), start), (keys, values)

    shape = self.config.layer
    probe = jax.ShapeDtypeStruct((*tokens.shape, shape.num_heads, shape.head_dim),
                                 self.config.dtype)
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None], tokens.shape)
    # A prefill whose attention takes this call's keys directly needs them as they are.
    source = self._sources(cache["k"], cache["v"], rows, None, write, then,
                           direct=fresh or bool(attention.choose_causal(probe)))
    logits, features, kv = self._run(tokens, positions, source, head)
    return logits, features, {"k": kv[0], "v": kv[1]}

  def _sources(self, keys, values, rows, table, write, then, direct: bool = False):
    """``source(i)`` for `_run`: a `layers.WriteKV` for layer i (its cache ``keys[i]`` /
    ``values[i]``, token rows `rows` shaped as the layer's positions, `table` or None; the XLA
    write ``write(i, k, v)`` and ``then(keys, values)``), so that the layer writes its keys first,
    through a kernel where one applies; or, under a sharding plan or where `direct`, the
    ``gather_kv`` function ``then(*write(i, k, v))`` of the keys themselves."""
    if direct or self.plan is not None:
      return lambda i: lambda k, v: then(*write(i, k, v))
    return lambda i: layers.WriteKV(keys[i], values[i], rows, table,
                                    functools.partial(write, i), then)

  def _run(self, tokens: jax.Array, positions: jax.Array, source, head: bool = True):
    """The layers over [B, T] `tokens`, layer i attending to ``source(i)`` (a ``gather_kv``
    function of its keys/values, or a `layers.WriteKV`) -> logits (with ``head=False`` the
    final-normed hidden states), features and the per-layer caches ``(keys, values)`` (tuples) it
    returned."""
    x = self.embed(tokens)
    saved = {-1: x}
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      x, (keys, values) = layer(x, positions, source(i))
      new_k.append(keys)
      new_v.append(values)
      saved[i] = x
    features = jnp.concatenate([saved[i] for i in self.config.feature_layers], axis=-1)
    x = self.final_norm(x)
    return self.logits(x) if head else x, features, (tuple(new_k), tuple(new_v))

  def _paged(self, tokens, positions, cache, rows, write_positions, limits, slots, head=True):
    """`__call__` / `packed` over a paged cache: keys/values written at (`rows`,
    `write_positions`) through the block table, attention through it (`layers.PagedUpTo`)."""
    if slots is None and cache.slots != tokens.shape[0]:
      raise ValueError(f"cache: a paged cache of {cache.slots} slots (block table rows) for "
                       f"{tokens.shape[0]} rows of tokens")

    flat = slots is not None                      # packed: k [1, N, K, D] -> [N, K, D]

    def write(i, k, v):
      return tuple(layout.constrain_pool(paging.write(
          pool[i], cache.table, rows, write_positions, x[0] if flat else x), self.plan)
          for pool, x in ((cache.k, k), (cache.v, v)))

    index = layers.packed_tokens(rows, slots, limits.shape) if flat else None

    def then(keys, values):
      source = layers.PagedUpTo(keys, values, cache.table, limits,
                                rows if flat else None, slots, index)
      return source, (keys, values)

    # Every caller writes at the positions it attends from (`write_positions` = `positions`).
    source = self._sources(cache.k, cache.v, rows.reshape(positions.shape), cache.table, write,
                           then)
    logits, features, kv = self._run(tokens, positions, source, head)
    return logits, features, dataclasses.replace(cache, k=kv[0], v=kv[1])


  def packed(self, tokens: jax.Array, rows: jax.Array, slots: jax.Array, positions: jax.Array,
             cache: dict, width: int) -> tuple[jax.Array, jax.Array, dict]:
    """Runs N packed tokens of a [B, width] block, each with its own row: the verify whose cost
    follows the tokens it checks (`dspark_jax.decoding.packing`).

    Token i is slot ``slots[i]`` (0 .. width - 1) of row ``rows[i]`` at absolute position
    ``positions[i]``; ``rows[i] = B`` marks a padding token (nothing read or written for it). A
    row's tokens are its first slots, at consecutive positions. Each token attends to its row's
    cache slots at or before its position (its row's earlier tokens of this call included); the
    keys/values are written at its (row, position) only. The projections, the MLP and the LM head
    run on the N tokens; attention reads each row's cache up to its last token
    (`kernels.attention.attend_limited`, queries laid out per row).

    Args:
      tokens, rows, slots, positions: [N] int. cache: from `init_cache`, or a paged cache
        (`dspark_jax.paging.cache.PagedKV`, B table rows). width: static slots per row.

    Returns:
      logits [N, V], features [N, len(feature_layers) * E], the updated cache.
    """
    paged = isinstance(cache, paging.PagedKV)
    batch = cache.slots if paged else cache["k"][0].shape[0]
    limits = jnp.zeros((batch, width), jnp.int32).at[rows, slots].set(positions + 1, mode="drop")
    if paged:
      logits, features, cache = self._paged(tokens[None], positions[None], cache, rows, positions,
                                            limits, slots)
      return logits[0], features[0], cache

    def write(i, k, v):
      return tuple(layout.constrain_cache(pool[i].at[rows, :, positions].set(
          x[0].astype(pool[i].dtype), mode="drop"), self.plan)
          for pool, x in ((cache["k"], k), (cache["v"], v)))

    index = layers.packed_tokens(rows, slots, limits.shape)

    def then(keys, values):
      return layers.PackedCache(keys, values, limits, rows, slots, index), (keys, values)

    source = self._sources(cache["k"], cache["v"], rows[None], None, write, then)
    logits, features, kv = self._run(tokens[None], positions[None], source)
    return logits[0], features[0], {"k": kv[0], "v": kv[1]}

  def packed_prefill(self, tokens: jax.Array, rows: jax.Array, positions: jax.Array,
                     lengths: jax.Array, cache) -> tuple[jax.Array, jax.Array, object]:
    """Prefills B prompts packed one after another into one row of N tokens: the refill whose
    work follows the prompts' tokens, not B times the longest (`decoding.slots`).

    Prompt b is ``lengths[b]`` consecutive packed tokens, the prompts in row order from token 0;
    token i is position ``positions[i]`` (0-based) of row ``rows[i]`` (B marks a padding token past
    the prompts: nothing is written for it). Each token attends to its own prompt's tokens up to
    itself (`layers.Segments`; nothing of the cache is read), so every row's result is that of a
    fresh prefill of its prompt alone (`__call__` with ``fresh=True``), and its keys/values are
    written at (row, position) of `cache`.

    Args:
      tokens, rows, positions: [N] int. lengths: [B] int, each >= 1, summing to at most N.
      cache: from `init_cache` (B rows), or a paged cache (`dspark_jax.paging.cache.PagedKV` with
        B table rows).

    Returns:
      final-normed hidden states [N, E], features [N, len(feature_layers) * E], the updated
      cache.
    """
    source = layers.Segments(lengths.astype(jnp.int32))
    paged = isinstance(cache, paging.PagedKV)

    def gather_kv(i, k, v):
      if paged:
        kv = tuple(layout.constrain_pool(paging.write(pool[i], cache.table, rows, positions, x[0]),
                                         self.plan) for pool, x in ((cache.k, k), (cache.v, v)))
      else:
        kv = tuple(layout.constrain_cache(pool[i].at[rows, :, positions].set(
            x[0].astype(pool[i].dtype), mode="drop"), self.plan)
            for pool, x in ((cache["k"], k), (cache["v"], v)))
      return source, kv
    hidden, features, kv = self._run(tokens[None], positions[None],
                                     lambda i: functools.partial(gather_kv, i), head=False)
    cache = (dataclasses.replace(cache, k=kv[0], v=kv[1]) if paged
             else {"k": kv[0], "v": kv[1]})
    return hidden[0], features[0], cache


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits_program(state, tokens, *, graphdef):
  return nnx.merge(graphdef, state).forward(tokens)[0]


def logits(target: TargetModel, tokens) -> jax.Array:
  """The target's logits after every prefix of `tokens`: a cache-free forward at positions
  ``0 .. T-1`` (the counterpart of a Hugging Face ``model(input_ids).logits``).

  Args:
    target: the target model.
    tokens: [B, T] integer token ids in [0, V), T >= 1 (an array or nested lists).

  Returns:
    [B, T, V] logits in the target's compute dtype; row b, column t is the next-token logits after
    ``tokens[b, :t+1]``. No rows (B = 0) give an empty [0, T, V] array.

  Raises:
    ValueError: `tokens` is not 2-D, not integer, has no columns, or (when concrete) holds an id
      outside [0, V) (naming the first bad element). Traced tokens are checked for shape and dtype
      only; an out-of-range traced id reads a clipped embedding row.

  Eager calls run one compiled program per (target structure, shape); inside the caller's
  ``jax.jit`` (target closed over, or via ``nnx.jit``) the forward is traced in place.
  """
  if not isinstance(target, TargetModel):
    raise ValueError(f"target: expected a TargetModel, got {type(target).__name__}")
  tokens = validation.as_array("tokens", tokens)
  if np.ndim(tokens) != 2:
    raise ValueError(f"tokens: expected a [B, T] array, got shape {np.shape(tokens)}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens: expected integers, got dtype {tokens.dtype}")
  if tokens.shape[1] == 0:
    raise ValueError("tokens: expected at least one token per row, got shape "
                     f"{tuple(tokens.shape)}")
  vocab = target.config.vocab_size
  validation.check_range("tokens", tokens, 0, vocab, what=f"token ids must be in [0, {vocab})")
  if tokens.shape[0] == 0:  # no rows: nothing to run (a [0, T] reshape would divide by zero)
    return jnp.zeros((0, tokens.shape[1], vocab), target.config.dtype)
  if validation.is_traced(tokens):
    return target.forward(tokens.astype(jnp.int32))[0]
  graphdef, state = nnx.split(target)
  return _logits_program(state, jnp.asarray(tokens, jnp.int32), graphdef=graphdef)
