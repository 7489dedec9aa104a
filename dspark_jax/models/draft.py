"""The DSpark draft (docs/design.md): a parallel block backbone over target context, plus its heads.

This module owns the draft model, as flax nnx modules:

* **Context.** Hidden states of the configured target layers (`DraftConfig.target_layer_ids`,
  concatenated on the feature axis) go through ``fc`` (no bias) and an RMSNorm, then through each draft
  layer's own k/v projections (with k-norm and RoPE at the context positions). These context keys and
  values are cached per draft layer by absolute position (`DSparkDraft.extend_context`); only slots
  before the current anchor are ever attended to, so entries of rejected positions need no rollback.
  Training's many blocks per sequence read the sequence's one context in place, each up to its own
  anchor (`DSparkDraft.shared_blocks`).
* **Block.** The input is the target's (frozen, shared) embedding of ``[anchor, MASK, ..., MASK]``
  (γ tokens) at positions ``anchor_pos .. anchor_pos + γ - 1``. Each draft layer is a Qwen3 layer whose
  queries come from the block and whose keys/values are ``[context; block]``: the block sees every
  context position before the anchor and itself bidirectionally.
* **Output.** Final RMSNorm, then the target's (frozen, shared) LM head: base logits U [B, γ, V] (row k
  predicts draft token k + 1) and the hidden states h [B, γ, E] that the gated/rnn sequential heads and
  the confidence head read.
* **Heads.** The sequential head (`heads.MarkovHead`, any kind; kind "none" with rank 0 is a
  DFlash-style parallel drafter whose tokens come from the base logits) and optionally the
  confidence head, which reads ``h_k`` (after the final norm) and, "with markov", ``W1[x_{k-1}]``;
  block sampling itself belongs to `dspark_jax.draft.block`.

This is the math of DeepSpec's ``Qwen3DSparkModel`` at inference (``_forward_backbone`` and
``deepspec/eval/dspark``): the context states get no ``input_layernorm`` (only ``hidden_norm``), keys
of context and block both get ``k_norm`` and RoPE at their absolute positions, and there is no mask
inside the block. `dspark_jax.formats.deepspec` converts its checkpoints.

The draft does not own the embedding or the LM head: every call takes the `TargetModel` whose weights
it shares, and reads them through ``stop_gradient``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import validation
from dspark_jax.draft import heads
from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.models import target as tm
from dspark_jax.paging import cache as paging


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """Sizes and choices of a DSpark draft.

  Attributes:
    gamma: block size γ (drafts per round).
    num_layers: draft decoder layers.
    target_layer_ids: target layers read as context (-1 = embedding output); the target must be
      built with these as its `TargetConfig.feature_layers`.
    mask_token_id: the reserved id filling the block after the anchor (< V).
    head_kind: "vanilla", "gated", "rnn", or "none" (no sequential head: DeepSpec's
      ``markov_rank = 0``, a DFlash-style drafter). rank: the sequential head's rank r (0 exactly
      when head_kind is "none").
    confidence: build a confidence head; confidence_with_markov: it also reads W1[x_{k-1}] (needs a
      sequential head).
    layer: shape of each draft layer (None: the target's layer shape).
    num_anchors: training only: anchor blocks sampled per sequence (DeepSpec's field, kept so that
      a checkpoint round trip says it again).
    dtype, param_dtype: as for the target.
  """

  gamma: int = 7
  num_layers: int = 1
  target_layer_ids: tuple[int, ...] = (-1,)
  mask_token_id: int = 0
  head_kind: str = "vanilla"
  rank: int = 256
  confidence: bool = True
  confidence_with_markov: bool = True
  layer: layers.LayerShape | None = None
  num_anchors: int = 512
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    validation.check_positive_int("gamma", self.gamma)
    validation.check_nonnegative_int("num_layers", self.num_layers)
    validation.check_nonnegative_int("rank", self.rank)
    validation.check_nonnegative_int("mask_token_id", self.mask_token_id)
    validation.check_positive_int("num_anchors", self.num_anchors)
    if self.head_kind not in heads.HEAD_KINDS:
      raise ValueError(f"head_kind: expected 'vanilla', 'gated', 'rnn' or 'none', got "
                       f"{self.head_kind!r}")
    if (self.rank == 0) != (self.head_kind == "none"):
      raise ValueError(f"rank: {self.rank} with head_kind {self.head_kind!r}; rank is 0 exactly "
                       f"when head_kind is 'none' (no sequential head)")
    if self.confidence and self.confidence_with_markov and self.head_kind == "none":
      raise ValueError("confidence_with_markov: the confidence head reads W1[x_{k-1}] of the "
                       "sequential head, and head_kind 'none' has none")
    if self.layer is not None and not isinstance(self.layer, layers.LayerShape):
      raise ValueError(f"layer: expected a LayerShape or None, got {type(self.layer).__name__}")

  def check_against(self, target: tm.TargetConfig) -> None:
    """Raises ValueError unless this draft can run on `target`."""
    if self.gamma < 1:
      raise ValueError(f"gamma: must be >= 1, got {self.gamma}")
    if tuple(self.target_layer_ids) != tuple(target.feature_layers):
      raise ValueError(f"target_layer_ids: {self.target_layer_ids} differ from the target's "
                       f"feature_layers {target.feature_layers}")
    if not 0 <= self.mask_token_id < target.vocab_size:
      raise ValueError(f"mask_token_id: {self.mask_token_id} is not in [0, {target.vocab_size})")
    if self.layer is not None and self.layer.hidden_size != target.hidden_size:
      raise ValueError(f"layer: hidden_size {self.layer.hidden_size} differs from the target's "
                       f"{target.hidden_size} (the draft shares its embedding and LM head)")


class DSparkDraft(nnx.Module):
  """The draft. ``draft(target, anchor, anchor_pos, context) -> (base_logits, hidden)``;
  `shared_blocks`: many blocks per sequence over one context (training).

  `plan`: as `TargetModel.plan` (its context cache is kept sharded by KV head).
  """

  plan = None

  def __init__(self, config: DraftConfig, target_config: tm.TargetConfig, *, rngs: nnx.Rngs):
    config.check_against(target_config)
    shape = config.layer or target_config.layer
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    hidden = target_config.hidden_size
    self.config = config
    self.shape = shape
    self.fc = nnx.Linear(len(config.target_layer_ids) * hidden, hidden, use_bias=False, **kw)
    self.context_norm = nnx.RMSNorm(hidden, epsilon=shape.rms_eps, **kw)
    self.layers = nnx.List([layers.DecoderLayer(shape, **kw) for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(hidden, epsilon=shape.rms_eps, **kw)
    self.head = heads.MarkovHead.random(config.head_kind, vocab_size=target_config.vocab_size,
                                        rank=config.rank, hidden_size=hidden, rngs=rngs,
                                        dtype=config.param_dtype)
    width = hidden + (config.rank if config.confidence_with_markov else 0)
    self.confidence = nnx.data(heads.ConfidenceHead.random(width=width, rngs=rngs)
                               if config.confidence else None)

  def init_context(self, batch: int, length: int) -> dict[str, tuple[jax.Array, ...]]:
    """A zeroed context cache: per draft layer, head-major keys and values [B, K, S, D]."""
    shape = (batch, self.shape.num_kv_heads, length, self.shape.head_dim)
    return {name: tuple(jnp.zeros(shape, self.config.dtype) for _ in self.layers)
            for name in ("k", "v")}

  def context_inputs(self, features: jax.Array) -> jax.Array:
    """[B, T, F] target features -> [B, T, E] projected, normalised context states."""
    return self.context_norm(self.fc(features))

  def extend_context(self, features: jax.Array, positions: jax.Array, context: dict,
                     rows: jax.Array | None = None) -> dict:
    """Writes the context keys/values of [B, T] consecutive `positions` into the cache.

    Args:
      features: [B, T, F] target features at those positions (`TargetModel.__call__`).
      positions: [B, T] int absolute positions, consecutive within a row.
      context: the cache from `init_context` or a previous call, or a paged context
        (`dspark_jax.paging.cache.paged_context`: written through its block table).
      rows: None, or packed tokens (`TargetModel.packed_prefill`): then `features` is [N, F],
        `positions` [N] and token i is written at (``rows[i]``, ``positions[i]``); a row out of
        range (a padding token) writes nothing.
    """
    packed = rows is not None
    if packed:
      features, positions = features[None], positions[None]
    states = self.context_inputs(features)
    start = positions[:, 0]
    paged = isinstance(context, paging.PagedKV)
    if not packed:
      rows = jnp.broadcast_to(jnp.arange(positions.shape[0], dtype=jnp.int32)[:, None],
                              positions.shape)
    out = {"k": [], "v": []}
    for i, layer in enumerate(self.layers):
      kv = dict(zip("kv", layer.attention.keys_values(states, positions)))
      for name in "kv":
        pools = getattr(context, name) if paged else context[name]
        if paged:
          new = paging.write(pools[i], context.table, rows, positions[0] if packed else positions,
                             kv[name][0] if packed else kv[name])
          out[name].append(layout.constrain_pool(new, self.plan))
        elif packed:
          new = pools[i].at[rows, :, positions[0]].set(kv[name][0].astype(pools[i].dtype),
                                                       mode="drop")
          out[name].append(layout.constrain_cache(new, self.plan))
        else:
          out[name].append(layout.constrain_cache(layers.write_heads(pools[i], kv[name], start),
                                                  self.plan))
    if paged:
      return dataclasses.replace(context, k=tuple(out["k"]), v=tuple(out["v"]))
    return {name: tuple(arrays) for name, arrays in out.items()}

  def __call__(self, target: tm.TargetModel, anchor: jax.Array, anchor_pos: jax.Array,
               context: dict) -> tuple[jax.Array, jax.Array]:
    """Base logits and hidden states of one block.

    Args:
      target: the target whose embedding and LM head the draft shares.
      anchor: [B] int, the last committed token. anchor_pos: [B] int, its absolute position.
      context: the context cache (or a paged one, `dspark_jax.paging.cache.PagedKV`); slots
        before `anchor_pos` must hold the committed context.

    Returns:
      base_logits [B, γ, V] (compute dtype) and hidden [B, γ, E].
    """
    def source(i, block_mask):
      if isinstance(context, paging.PagedKV):
        return layers.PagedPrefix(context.k[i], context.v[i], anchor_pos, block_mask,
                                  context.table)
      return layers.CachePrefix(context["k"][i], context["v"][i], anchor_pos, block_mask)
    return self._backbone(target, anchor, anchor_pos, source)

  def shared_blocks(self, target: tm.TargetModel, anchor: jax.Array, anchor_pos: jax.Array,
                    context: dict) -> tuple[jax.Array, jax.Array]:
    """Base logits and hidden states of A blocks per sequence over the sequence's one context
    (training): the blocks of row n read row n of `context` in place, each up to its own anchor
    (`layers.SharedPrefix`), never a per-block copy of it.

    Args:
      target: the target whose embedding and LM head the draft shares.
      anchor: [N, A] int, each block's anchor token. anchor_pos: [N, A] int, its position.
      context: the context cache of the N sequences (`init_context(N, S)`, then
        `extend_context`); slots before each anchor must hold the context.

    Returns:
      base_logits [N·A, γ, V] and hidden [N·A, γ, E], row ``n·A + a`` block a of sequence n: the
      same as `__call__` on the flattened anchors over the context repeated A times per row.
    """
    group = anchor.shape[1]
    flat_pos = anchor_pos.reshape(-1)
    return self._backbone(target, anchor.reshape(-1), flat_pos, lambda i, block_mask:
                          layers.SharedPrefix(context["k"][i], context["v"][i], flat_pos,
                                              block_mask, group))

  def _backbone(self, target, anchor, anchor_pos, source):
    """The block backbone of [B] anchors at [B] positions, layer i attending to
    ``source(i, block_mask)`` -> (base_logits, hidden)."""
    gamma = self.config.gamma
    batch = anchor.shape[0]
    block = jnp.concatenate(
        [anchor[:, None].astype(jnp.int32),
         jnp.full((batch, gamma - 1), self.config.mask_token_id, jnp.int32)], axis=1)
    x = jax.lax.stop_gradient(target.embed(block)).astype(self.config.dtype)
    positions = anchor_pos[:, None] + jnp.arange(gamma)[None, :]
    block_mask = jnp.ones((batch, gamma, gamma), bool)                  # bidirectional
    for i, layer in enumerate(self.layers):
      x, _ = layer(x, positions, lambda k, v, i=i: (source(i, block_mask), None))
    hidden = self.final_norm(x)
    return _shared_logits(target, hidden), hidden


def _shared_logits(target: tm.TargetModel, hidden: jax.Array) -> jax.Array:
  """The target's LM head applied to draft hidden states, the shared weights frozen."""
  if target.config.tie_embeddings:
    table = jax.lax.stop_gradient(target.embed.embedding[...])
    return jnp.einsum("bte,ve->btv", hidden.astype(table.dtype), table).astype(hidden.dtype)
  kernel = jax.lax.stop_gradient(target.lm_head.kernel[...])
  return jnp.einsum("bte,ev->btv", hidden.astype(kernel.dtype), kernel).astype(hidden.dtype)
