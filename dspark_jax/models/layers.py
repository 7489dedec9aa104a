"""Transformer building blocks shared by the target and the draft (Qwen3 layer shape).

This module owns the pieces both models are made of, as flax nnx modules:

* `RopeScaling`, `rope_frequencies`, `rope`: rotary position embedding (rotate-half form, per-row
  absolute positions) and the frequency variants of Hugging Face checkpoints ("default", "linear",
  "yarn", "llama3"), each computed as transformers' ``modeling_rope_utils`` computes it;
* `Attention`: q/k/v/o projections without bias, per-head RMSNorm on queries and keys, RoPE, grouped-
  query attention (``num_heads`` query heads share ``num_kv_heads`` key/value heads). It exposes its
  halves (`Attention.project`, `Attention.keys_values`, `Attention.attend`,
  `Attention.attend_cached`) because the draft feeds keys and values from two sources (context
  and block) into one attention;
* `MLP`: the SwiGLU feed-forward block;
* `write_rows`, `write_heads`: write a contiguous run of per-row entries into a static-size
  buffer; `write_heads` into a head-major [B, K, S, D] key/value cache, the layout attention reads;
* `group_columns`, `ungroup_columns`, `split_columns`: the column order of a fused projection.
  Stored whole, a fused matrix is its parts side by side (``[q | k | v]``, ``[gate | up]``). Split
  over g devices (`dspark_jax.parallel`), it is stored in g column groups, group j holding the j-th
  g-th of every part (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), so that each device's columns are
  whole heads (whole SwiGLU columns) of every part and no product needs another device's columns.
  `Attention.column_groups` / `MLP.column_groups` say which order a layer's matrices are in.

Shapes: B batch, T tokens, S cache slots, N query heads, K key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax.kernels import attention
from dspark_jax.kernels import attention_inputs
from dspark_jax.kernels import paged_attention


ROPE_TYPES = ("default", "linear", "yarn", "llama3")
"""The RoPE variants implemented (``rope_type`` of a Hugging Face config)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE frequency variant, fully resolved (no field depends on another config value).

  With ``inv_freq_i = theta ** (-2i / D)`` (i < D/2) the variants change the frequencies as follows;
  `attention_factor` multiplies cos and sin (so q·k by its square):

  * "default": unchanged (the other fields are ignored).
  * "linear": ``inv_freq / factor``.
  * "yarn": frequencies blended between ``inv_freq / factor`` (interpolated) and ``inv_freq``
    (extrapolated) by a linear ramp over the dimensions whose rotation count within
    `original_max_position_embeddings` lies between `beta_slow` and `beta_fast` (bounds floored and
    ceiled when `truncate`); cos and sin scaled by `attention_factor`.
  * "llama3": long wavelengths (> original / low_freq_factor) divided by `factor`, short ones
    (< original / high_freq_factor) kept, smooth interpolation between.

  Attributes:
    rope_type: one of `ROPE_TYPES`. factor: the context extension factor (>= 1 in practice).
    original_max_position_embeddings: the pre-extension context ("yarn", "llama3").
    low_freq_factor, high_freq_factor: "llama3" only. beta_fast, beta_slow, truncate: "yarn" only.
    attention_factor: the cos/sin scale ("yarn"; 1.0 for the others).
  """

  rope_type: str = "default"
  factor: float = 1.0
  original_max_position_embeddings: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 1.0

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type: {self.rope_type!r} is not implemented (implemented: "
                       f"{', '.join(ROPE_TYPES)})")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor"):
      value = getattr(self, name)
      if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                         and value > 0):
        raise ValueError(f"rope_scaling.{name}: must be a finite number > 0, got {value!r}")
    if not isinstance(self.truncate, bool):
      raise ValueError(f"rope_scaling.truncate: must be true or false, got {self.truncate!r}")
    if self.rope_type in ("yarn", "llama3"):
      validation.check_positive_int("rope_scaling.original_max_position_embeddings",
                                    self.original_max_position_embeddings)
    if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor: {self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}")
    if self.rope_type != "yarn" and self.attention_factor != 1.0:
      raise ValueError(f"rope_scaling.attention_factor: only \"yarn\" scales cos and sin, got "
                       f"{self.attention_factor} for {self.rope_type!r}")


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """The sizes of one Qwen3-style decoder layer.

  Attributes:
    hidden_size: E. num_heads: N. num_kv_heads: K (divides N). head_dim: D.
    intermediate_size: the SwiGLU width. rope_theta: RoPE base. rms_eps: RMSNorm epsilon.
    rope_scaling: the RoPE frequency variant (`RopeScaling`; a dict of its fields is converted,
      which is how a config comes back from JSON).
  """

  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 1_000_000.0
  rms_eps: float = 1e-6
  rope_scaling: RopeScaling = RopeScaling()

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      names = {f.name for f in dataclasses.fields(RopeScaling)}
      unknown = sorted(set(self.rope_scaling) - names)
      if unknown:
        raise ValueError(f"rope_scaling: unknown field {unknown[0]!r} (a RopeScaling has "
                         f"{sorted(names)})")
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling: expected a RopeScaling, got "
                       f"{type(self.rope_scaling).__name__}")
    for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
      validation.check_positive_int(name, getattr(self, name))
    for name in ("rope_theta", "rms_eps"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                     ) -> tuple[jax.Array, float]:
  """The [D/2] float32 inverse frequencies of a RoPE variant, and its cos/sin scale.

  Float32 arithmetic in the order transformers' ``modeling_rope_utils`` uses, so the frequencies
  agree with a Hugging Face model's to float32 rounding.
  """
  scaling = scaling or RopeScaling()
  half = head_dim // 2
  exponents = jnp.arange(half, dtype=jnp.float32) / half                  # 2i / D
  inv_freq = 1.0 / (theta ** exponents)
  kind, factor = scaling.rope_type, scaling.factor
  if kind == "linear":
    inv_freq = inv_freq / factor
  elif kind == "llama3":
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original / low
    divided = jnp.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * divided / factor + smooth * divided
    medium = ~(wavelen < original / high) & ~long_wave
    inv_freq = jnp.where(medium, smoothed, divided)
  elif kind == "yarn":
    def correction_dim(rotations):  # the dimension that turns `rotations` times in `original`
      original = scaling.original_max_position_embeddings
      return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001
    pos_freqs = theta ** exponents
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp                       # 1: extrapolate (original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
  return inv_freq, float(scaling.attention_factor)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding of [B, T, heads, D] `x` at [B, T] absolute `positions` (rotate-half form).

  `scaling` picks the frequency variant (`RopeScaling`; None is "default"). Computed in float32.
  """
  inv_freq, attention_factor = rope_frequencies(x.shape[-1], theta, scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq            # [B, T, D/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if attention_factor != 1.0:
    cos, sin = cos * attention_factor, sin * attention_factor
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def write_rows(cache: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
  """Writes [B, T, ...] `values` into [B, S, ...] `cache` at slots ``start_b .. start_b + T - 1``."""
  return jax.vmap(lambda c, v, s: jax.lax.dynamic_update_slice_in_dim(c, v, s, axis=0))(
      cache, values.astype(cache.dtype), start)


def heads_first(x: jax.Array) -> jax.Array:
  """Token-major keys or values [B, T, K, D] -> head-major [B, K, T, D] (attention's layout)."""
  return jnp.swapaxes(x, 1, 2)


def write_heads(cache: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
  """Writes token-major [B, T, K, D] `values` into a head-major [B, K, S, D] `cache` at slots
  ``start_b .. start_b + T - 1``."""
  return jax.vmap(lambda c, v, s: jax.lax.dynamic_update_slice_in_dim(c, v, s, axis=1))(
      cache, heads_first(values).astype(cache.dtype), start)


FUSED = {
    "attention.qkv_proj.kernel": ("attention.q_proj.kernel", "attention.k_proj.kernel",
                                  "attention.v_proj.kernel"),
    "mlp.gate_up_proj.kernel": ("mlp.gate_proj.kernel", "mlp.up_proj.kernel"),
}
"""A fused parameter's path suffix -> the names of its column blocks, in order (the names
checkpoints give the parts: `dspark_jax.formats.checkpoints`)."""


def group_columns(x, widths: tuple[int, ...], groups: int):
  """Fused columns ``[part_0 | part_1 | ...]`` (widths `widths`, on the last axis) -> `groups`
  column groups, group j the j-th `groups`-th of every part in order. NumPy or JAX arrays;
  ``groups = 1`` returns `x` unchanged. Each width must be a multiple of `groups`."""
  if groups == 1:
    return x
  lead, out, start = x.shape[:-1], [], 0
  for width in widths:
    out.append(x[..., start:start + width].reshape(*lead, groups, width // groups))
    start += width
  xp = jnp if isinstance(x, jax.Array) else np
  return xp.concatenate(out, axis=-1).reshape(*lead, start)


def split_columns(y, widths: tuple[int, ...], groups: int) -> list:
  """The parts (each ``[..., width]``, in canonical column order) of fused columns `y` stored in
  `groups` column groups (`group_columns`); ``groups = 1`` slices them off side by side."""
  lead, parts, start = y.shape[:-1], [], 0
  grouped = y.reshape(*lead, groups, -1)
  for width in widths:
    step = width // groups
    parts.append(grouped[..., start:start + step].reshape(*lead, width))
    start += step
  return parts


def ungroup_columns(x, widths: tuple[int, ...], groups: int):
  """The inverse of `group_columns`: `groups` column groups -> ``[part_0 | part_1 | ...]``."""
  if groups == 1:
    return x
  xp = jnp if isinstance(x, jax.Array) else np
  return xp.concatenate(split_columns(x, widths, groups), axis=-1)


def _linear(fan_in, fan_out, dtype, param_dtype, rngs):
  return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query attention with q/k RMSNorm and RoPE (Qwen3).

  The query, key and value projections are one matrix, ``qkv_proj`` [E, (N + 2K)·D] (columns:
  queries, keys, values), so a layer reads its inputs' projections in one product. Checkpoints
  name its parts ``q_proj``, ``k_proj`` and ``v_proj`` (`dspark_jax.formats.checkpoints`).
  `column_groups` (1 unless `dspark_jax.parallel` placed the layer on a mesh) is the column order
  of ``qkv_proj`` (module docstring); the outputs do not depend on it.
  """

  column_groups = 1

  def __init__(self, shape: LayerShape, *, dtype, param_dtype, rngs: nnx.Rngs):
    e, n, k, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    self.shape = shape
    self.qkv_proj = _linear(e, (n + 2 * k) * d, dtype, param_dtype, rngs)
    self.o_proj = _linear(n * d, e, dtype, param_dtype, rngs)
    self.q_norm = nnx.RMSNorm(d, epsilon=shape.rms_eps, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.k_norm = nnx.RMSNorm(d, epsilon=shape.rms_eps, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)

  def _heads(self, x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(*x.shape[:2], heads, self.shape.head_dim)

  def _keys_values(self, k: jax.Array, v: jax.Array, positions: jax.Array):
    k = self.k_norm(self._heads(k, self.shape.num_kv_heads))
    v = self._heads(v, self.shape.num_kv_heads)
    return rope(k, positions, self.shape.rope_theta, self.shape.rope_scaling), v

  @property
  def widths(self) -> tuple[int, int, int]:
    """The column widths of ``qkv_proj``'s parts: (N·D, K·D, K·D)."""
    nk = self.shape.num_kv_heads * self.shape.head_dim
    return (self.shape.num_heads * self.shape.head_dim, nk, nk)

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, T, E] -> queries [B, T, N, D] and keys, values [B, T, K, D] (queries and keys
    normalised and rotated), from one product."""
    q, k, v = split_columns(self.qkv_proj(x), self.widths, self.column_groups)
    q = self.q_norm(self._heads(q, self.shape.num_heads))
    q = rope(q, positions, self.shape.rope_theta, self.shape.rope_scaling)
    k, v = self._keys_values(k, v, positions)
    return q, k, v

  def project_write(self, x: jax.Array, positions: jax.Array, write: "WriteKV"):
    """[B, T, E] -> queries [B, T, N, D] (normalised and rotated) and `write`'s
    ``then(keys, values)`` once this call's keys/values are in `write`'s cache: in one kernel
    (`kernels.attention_inputs`) where it applies, else `project` and ``write.xla``."""
    shape = self.shape
    b, t = x.shape[:2]
    n, k, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    probe = jax.ShapeDtypeStruct((b * t, (n + 2 * k) * d), self.qkv_proj.dtype or x.dtype)
    chosen = "xla" if self.column_groups != 1 else attention_inputs.choose(
        probe, write.keys, heads=n, kv_heads=k, head_dim=d, table=write.table)
    if chosen == "xla":
      q, k_new, v_new = self.project(x, positions)
      return q, write.then(*write.xla(k_new, v_new))
    inv_freq, factor = rope_frequencies(d, shape.rope_theta, shape.rope_scaling)
    qkv = self.qkv_proj(x).reshape(b * t, -1)
    q, keys, values = attention_inputs.attention_inputs(
        qkv, positions.reshape(-1), write.rows.reshape(-1), self.q_norm.scale[...],
        self.k_norm.scale[...], inv_freq, write.keys, write.values, heads=n, kv_heads=k,
        eps=shape.rms_eps, factor=factor, table=write.table, interpret=chosen == "interpret")
    return q.reshape(b, t, n, d), write.then(keys, values)

  def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T, E] -> keys and values [B, T, K, D] (keys normalised and rotated), without the
    queries (the draft's context)."""
    nq, nk, _ = self.widths
    groups = self.column_groups
    proj = self.qkv_proj
    kernel = proj.kernel[...]
    kernel = kernel.reshape(kernel.shape[0], groups, -1)[:, :, nq // groups:].reshape(
        kernel.shape[0], -1)                                 # each group's keys and values
    x, kernel, _ = proj.promote_dtype((x, kernel, None), dtype=proj.dtype)
    kv = proj.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=proj.precision)
    k, v = split_columns(kv, (nk, nk), groups)
    return self._keys_values(k, v, positions)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of [B, T, N, D] queries over head-major [B, K, S, D] keys/values; `mask`
    [B, T, S] bool.

    Softmax in float32; cuDNN's fused form on GPUs where it applies (`kernels.attention`). A query
    whose mask is all False gets zeros (never NaN).
    """
    b, t, n, d = q.shape
    return self.o_proj(attention.attend(q, k, v, mask).reshape(b, t, n * d))

  def attend_limited(self, q: jax.Array, k: jax.Array, v: jax.Array,
                     limits: jax.Array) -> jax.Array:
    """Attention of [B, T, N, D] queries over head-major [B, K, S, D] keys/values, query (b, t)
    seeing slots ``s < limits[b, t]``: the work follows the rows' real context, not S
    (`kernels.attention.attend_limited`)."""
    b, t, n, d = q.shape
    return self.o_proj(attention.attend_limited(q, k, v, limits).reshape(b, t, n * d))

  def attend_causal(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of [B, T, N, D] queries at positions 0..T-1 over their own token-major
    [B, T, K, D] keys/values (`kernels.attention.attend_causal`)."""
    b, t, n, d = q.shape
    return self.o_proj(attention.attend_causal(q, heads_first(k), heads_first(v)).reshape(
        b, t, n * d))

  def attend_chunk(self, q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                   cache_v: jax.Array, start: jax.Array) -> jax.Array:
    """[B, T, N, D] queries at positions start_b .. start_b + T - 1 over slots before start_b of
    a head-major [B, K, S, D] cache and, causally, over their own token-major [B, T, K, D]
    keys/values (`kernels.attention.attend_chunk`)."""
    b, t, n, d = q.shape
    out = attention.attend_chunk(q, heads_first(k), heads_first(v), cache_k, cache_v, start)
    return self.o_proj(out.reshape(b, t, n * d))

  def attend_packed(self, q: jax.Array, source: "PackedCache") -> jax.Array:
    """Attention of packed [1, N, N_heads, D] queries (`PackedCache`): in place through the
    ragged kernel where it applies (`kernels.attention.attend_packed`), else laid out per row as
    [B, width] queries, attended as `attend_limited`, and gathered back."""
    _, n, heads, d = q.shape
    out = attention.attend_packed(q[0], source.keys, source.values, source.limits, source.tokens)
    if out is not None:
      return self.o_proj(out.reshape(1, n, heads * d))
    attend = lambda dense: attention.attend_limited(dense, source.keys, source.values,
                                                    source.limits)
    return self.o_proj(_per_row(attend, q, source.rows, source.slots, source.limits.shape))

  def attend_segments(self, q: jax.Array, k: jax.Array, v: jax.Array,
                      source: "Segments") -> jax.Array:
    """Causal attention of packed [1, N, N_heads, D] queries over their own token-major
    [1, N, K, D] keys/values within `source`'s segments (`kernels.attention.attend_segments`)."""
    _, t, n, d = q.shape
    out = attention.attend_segments(q, k, v, source.lengths)
    return self.o_proj(out.reshape(1, t, n * d))

  def attend_paged(self, q: jax.Array, source: "PagedUpTo") -> jax.Array:
    """Attention of [B, T, N, D] queries (or packed [1, N', N, D] ones, when `source` has rows)
    over a paged cache read through its block table (`kernels.paged_attention.attend_paged`)."""
    attend = lambda dense: paged_attention.attend_paged(dense, source.keys, source.values,
                                                        source.table, source.limits)
    if source.rows is None:
      b, t, n, d = q.shape
      return self.o_proj(attend(q).reshape(b, t, n * d))
    _, n, heads, d = q.shape
    out = paged_attention.attend_packed_paged(q[0], source.keys, source.values, source.table,
                                              source.limits, source.tokens)
    if out is not None:
      return self.o_proj(out.reshape(1, n, heads * d))
    return self.o_proj(_per_row(attend, q, source.rows, source.slots, source.limits.shape))

  def attend_cached(self, q: jax.Array, source: "CachePrefix", k: jax.Array,
                    v: jax.Array) -> jax.Array:
    """Attention of [B, T, N, D] queries over `source`'s cache prefix and this call's own
    token-major keys/values [B, T, K, D] (`kernels.attention.attend_cached`; a `SharedPrefix`:
    `kernels.attention.attend_shared`)."""
    b, t, n, d = q.shape
    if isinstance(source, PagedPrefix):
      out = paged_attention.attend_cached_paged(q, source.cache_k, source.cache_v, source.table,
                                                source.prefix_len, k, v, source.block_mask)
    elif isinstance(source, SharedPrefix):
      out = attention.attend_shared(q, source.cache_k, source.cache_v, source.prefix_len, k, v,
                                    source.block_mask, source.group)
    else:
      out = attention.attend_cached(q, source.cache_k, source.cache_v, source.prefix_len, k, v,
                                    source.block_mask)
    return self.o_proj(out.reshape(b, t, n * d))


def _per_row(attend, q: jax.Array, rows: jax.Array, slots: jax.Array, shape) -> jax.Array:
  """Packed [1, N, heads, D] queries laid out per row as [B, width] = `shape` queries (token i at
  (``rows[i]``, ``slots[i]``); row B drops it), attended by ``attend(dense)``, and gathered back
  -> [1, N, heads·D] (zeros for dropped tokens)."""
  _, n, heads, d = q.shape
  dense = jnp.zeros((*shape, heads, d), q.dtype).at[rows, slots].set(q[0], mode="drop")
  out = attend(dense).at[rows, slots].get(mode="fill", fill_value=0)
  return out.reshape(1, n, heads * d)


@dataclasses.dataclass(frozen=True)
class Full:
  """What a layer attends to, given whole: head-major keys/values [B, K, S, D], mask [B, T, S]."""

  keys: jax.Array
  values: jax.Array
  mask: jax.Array


@dataclasses.dataclass(frozen=True)
class WriteKV:
  """Where a layer writes this call's keys/values before it attends, for the calls whose
  attention reads them back from the cache (a decode step, a verify, packed verify tokens), in
  place of a ``gather_kv`` function.

  `keys` / `values`: this layer's cache, contiguous [B, K, S, D], or page pools
  [num_pages, K, page_size, D] read through `table` ([B, P] int; None for a contiguous cache);
  `rows`: the cache row of each token, shaped as the layer's positions (row B or more, or a
  position or page out of range: nothing written); each token is written at its own position.
  ``xla(k, v) -> (keys, values)`` writes token-major [B, T, K, D] keys/values in XLA, and
  ``then(keys, values) -> (source, aux)`` says what the layer attends to once they are written and
  what it returns (as a ``gather_kv`` function does). The layer writes through
  `kernels.attention_inputs`, which also normalises and rotates the queries and keys, where that
  kernel applies (`Attention.project_write`), else through `xla`."""

  keys: jax.Array
  values: jax.Array
  rows: jax.Array
  table: jax.Array | None
  xla: Callable
  then: Callable


@dataclasses.dataclass(frozen=True)
class CacheUpTo:
  """What a layer attends to in a contiguous cache: head-major keys/values [B, K, S, D], query
  (b, t) seeing slots ``s < limits[b, t]`` ([B, T] int); later slots are never read into a result.

  `start` ([B] int, or None): the queries are positions start_b .. start_b + T - 1 of row b,
  ``limits[b, t] = start_b + t + 1``, and slots start_b .. start_b + T - 1 hold the layer's own
  keys/values of this call; then the layer may attend to the cache before start_b and to its own
  keys as two parts (`kernels.attention.attend_chunk`, where `kernels.attention.choose_causal`
  holds). `fresh` (static): moreover every start is 0 (a one-pass prefill), so the layer attends
  to its own keys only (`kernels.attention.attend_causal`); it needs no `start`."""

  keys: jax.Array
  values: jax.Array
  limits: jax.Array
  fresh: bool = False
  start: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Segments:
  """What packed prompts attend to in a fresh prefill (`TargetModel.packed_prefill`): each token
  the tokens of its own segment up to itself, segment m being ``lengths[m]`` ([M] int) consecutive
  packed tokens, one segment after another from token 0. The layer's keys/values are also written
  to a cache (`aux`), which this attention does not read."""

  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class PackedCache:
  """What packed tokens attend to (`TargetModel.packed`): token i, of row ``rows[i]`` (B: none)
  and slot ``slots[i]``, attends like slot ``slots[i]`` of a `CacheUpTo` with [B, width]
  `limits` over head-major [B, K, S, D] `keys` / `values`; `tokens` [B, width] is the inverse
  map, the token at (b, t) (N where none: `packed_tokens`)."""

  keys: jax.Array
  values: jax.Array
  limits: jax.Array
  rows: jax.Array
  slots: jax.Array
  tokens: jax.Array


def packed_tokens(rows: jax.Array, slots: jax.Array, shape) -> jax.Array:
  """[B, width] = `shape` int32: the packed token at (row b, slot t), N where none (N tokens
  ``rows[i]``, ``slots[i]``; row B or more drops a token)."""
  n = rows.shape[0]
  return jnp.full(shape, n, jnp.int32).at[rows, slots].set(jnp.arange(n, dtype=jnp.int32),
                                                           mode="drop")


@dataclasses.dataclass(frozen=True)
class PagedUpTo:
  """What a layer attends to in a paged cache (`dspark_jax.paging.cache`): page pools
  [num_pages, K, page_size, D] `keys` / `values` read through the block table [B, M] `table`,
  query (b, t) seeing logical positions ``p < limits[b, t]`` ([B, T] int), as `CacheUpTo`. With
  `rows`, `slots` ([N] int) and `tokens` ([B, width]), the queries are packed tokens as
  `PackedCache`'s ([B, width] `limits`)."""

  keys: jax.Array
  values: jax.Array
  table: jax.Array
  limits: jax.Array
  rows: jax.Array | None = None
  slots: jax.Array | None = None
  tokens: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CachePrefix:
  """What a layer attends to, in two parts that are never concatenated: slots
  ``0 .. prefix_len_b - 1`` of a head-major [B, K, S, D] cache `cache_k` / `cache_v` ([B]
  `prefix_len`), and the layer's own new keys/values where `block_mask` [B, T, T] holds."""

  cache_k: jax.Array
  cache_v: jax.Array
  prefix_len: jax.Array
  block_mask: jax.Array


@dataclasses.dataclass(frozen=True)
class PagedPrefix(CachePrefix):
  """`CachePrefix` with the cache in page pools [num_pages, K, page_size, D] (`cache_k`,
  `cache_v`) read through the block table [B, M] `table` (the draft's paged context)."""

  table: jax.Array = None


@dataclasses.dataclass(frozen=True)
class SharedPrefix(CachePrefix):
  """`CachePrefix` whose cache rows are shared: query row b (of B) reads the prefix of row
  ``b // group`` of a head-major [B / group, K, S, D] cache, `group` (static) rows per cache row
  (the draft's training blocks, `group` anchors per sequence, over one context per sequence)."""

  group: int = 1


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one matrix ``gate_up_proj`` [E, 2I]
  (checkpoints name its halves ``gate_proj`` and ``up_proj``; `column_groups`: their column
  order, as `Attention.column_groups`)."""

  column_groups = 1

  def __init__(self, shape: LayerShape, *, dtype, param_dtype, rngs: nnx.Rngs):
    e, i = shape.hidden_size, shape.intermediate_size
    self.gate_up_proj = _linear(e, 2 * i, dtype, param_dtype, rngs)
    self.down_proj = _linear(i, e, dtype, param_dtype, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.gate_up_proj(x)
    i = h.shape[-1] // 2
    gate, up = split_columns(h, (i, i), self.column_groups)
    return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  """RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU -> residual.

  The caller says what to attend to (`__call__` takes a function that maps this layer's own
  keys/values to a `Full`, `CacheUpTo`, `PackedCache`, `Segments`, `PagedUpTo` or
  `CachePrefix` (or `PagedPrefix`, `SharedPrefix`) source), so the same layer serves the target
  (causal attention over its KV cache, `CacheUpTo`; packed verify tokens, `PackedCache`; packed
  fresh prompts, `Segments`; a paged cache, `PagedUpTo`; without a cache, `Full`) and the draft
  (its context cache read in place plus the bidirectional block, `CachePrefix`, `PagedPrefix`
  over a paged context, or `SharedPrefix` for training's blocks sharing their sequence's
  context).
  """

  def __init__(self, shape: LayerShape, *, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.input_norm = nnx.RMSNorm(shape.hidden_size, epsilon=shape.rms_eps, **kw)
    self.attention = Attention(shape, **kw)
    self.post_norm = nnx.RMSNorm(shape.hidden_size, epsilon=shape.rms_eps, **kw)
    self.mlp = MLP(shape, **kw)

  def __call__(self, x: jax.Array, positions: jax.Array, gather_kv) -> tuple[jax.Array, object]:
    """Runs the layer. ``gather_kv(k, v) -> (source, aux)`` says what to attend to, a `Full`,
    `CacheUpTo` or `CachePrefix`, given this call's own token-major keys/values [B, T, K, D]; `aux` is returned
    (e.g. the updated cache)."""
    normed = self.input_norm(x)
    if isinstance(gather_kv, WriteKV):
      q, (source, aux) = self.attention.project_write(normed, positions, gather_kv)
    else:
      q, k, v = self.attention.project(normed, positions)
      source, aux = gather_kv(k, v)
    if isinstance(source, CachePrefix):
      x = x + self.attention.attend_cached(q, source, k, v)
    elif (isinstance(source, CacheUpTo) and (source.fresh or source.start is not None)
          and attention.choose_causal(q)):
      x = x + (self.attention.attend_causal(q, k, v) if source.fresh else
               self.attention.attend_chunk(q, k, v, source.keys, source.values, source.start))
    elif isinstance(source, CacheUpTo):
      x = x + self.attention.attend_limited(q, source.keys, source.values, source.limits)
    elif isinstance(source, PackedCache):
      x = x + self.attention.attend_packed(q, source)
    elif isinstance(source, Segments):
      x = x + self.attention.attend_segments(q, k, v, source)
    elif isinstance(source, PagedUpTo):
      x = x + self.attention.attend_paged(q, source)
    else:
      x = x + self.attention.attend(q, source.keys, source.values, source.mask)
    return x + self.mlp(self.post_norm(x)), aux
