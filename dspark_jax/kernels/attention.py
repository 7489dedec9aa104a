"""Which implementation computes the models' attention, and the two implementations.

This module owns the attention of the target and the draft layers (`models.layers.Attention`):

* ``xla``: two einsums with the scores and the softmax in float32, written here; runs everywhere.
* ``cudnn``: cuDNN's fused flash attention (no [B, heads, T, S] score tensor in memory) in its
  head-major ``BNTH`` layout, so the keys are read in place from the [B, K, S, D] cache. JAX's
  public `jax.nn.dot_product_attention` takes only the token-major layout, which would copy the
  cache; the head-major call is JAX's own cuDNN entry point,
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, and `cudnn_precondition`
  fails (so ``auto`` takes ``xla``) where this JAX does not have it. Same math; the probabilities
  are rounded to the value dtype before the second product, as in the ``xla`` form.

Keys and values are head-major, [B, K, S, D] (K key/value heads, S slots), the layout of the
target's KV cache and the draft's context cache: each head's keys are contiguous, so neither form
transposes the cache (the token-major [B, S, K, D] layout made XLA copy it in every verify pass).

`choose` decides from the platform, dtype, head size and number of queries; ``auto`` (the default)
takes ``cudnn`` for one query per row (the autoregressive step) wherever its preconditions hold,
else ``xla``: on the H200 cuDNN was faster for one query and slower than the einsums for the 8
queries of a verify pass (BENCHMARKS.md, issue 29). ``DSPARK_JAX_ATTENTION=auto|xla|cudnn``
overrides ``auto``; an explicit ``cudnn`` whose precondition fails raises a `ValueError` naming
it. The choice is made when a model is traced (shapes and dtypes are static), so it costs nothing
at run time.

`attend_causal` is a fresh prefill's attention (positions 0..T-1, nothing before them) over its
own keys: cuDNN's causal flash attention, the fastest exact candidate measured for it
(`benchmarks/bench_flash.py`). `attend_chunk` is a prefill chunk's past slot 0 (positions
start_b .. start_b + T - 1): two cuDNN parts, the chunk's queries over the cache before start_b
(`cudnn_prior_part`, padding mask with per-row ``kv_seqlen``, the cache read in place) and over
the chunk's own keys (`cudnn_self_part`, causal), joined through cuDNN's log-sum-exp statistics
(`cudnn_part`, `_join`); JAX's cuDNN entry point has no per-query limits or bottom-right causal
mask, so one call cannot take the chunk whole. `choose_causal` says where either runs (a GPU,
bf16/fp16, T a power of two of at least 64; the layer adds: a contiguous cache and consecutive
positions, `models.layers.CacheUpTo`); elsewhere the prefill attends over its cache through
`attend_limited` (the ragged kernel's query tiles, or `attend_flash`).
`benchmarks/bench_flash.py --chunk` times the two parts (``cudnn_parts``) against the ragged
kernel over the cache.

`attend_segments` is a packed prefill's attention (`models.target.TargetModel.packed_prefill`:
several fresh prompts one after another in one row, each attending to itself only): cuDNN's flash
attention in its packed layout (per-segment offsets and lengths) on a GPU, the einsum form with a
segment mask elsewhere up to `SEGMENT_XLA_MAX` tokens; `choose_segments` says which, or None
(the caller then pads its prompts instead).

`attend_cached` is the draft block's attention: the γ block queries over the first ``anchor_pos``
slots of the context cache and over the block itself, as two softmax parts joined through their
maxima and sums, so the context cache is read in place rather than concatenated with the block's
keys in every layer and round (BENCHMARKS.md v51). It is einsums only and ignores the
implementation setting.

`attend_shared` is the same attention for training, where many blocks of one sequence read one
context: the blocks' queries are laid out as one row of queries per sequence, each with its
block's prefix length as its limit, and read the sequence's context once (`shared_limited_part`,
in query tiles whose scores are recomputed in the backward pass), so no context is copied per
block and no [blocks, context] score tensor is kept for the gradient. With
``DSPARK_JAX_SHARED_ATTENTION=ragged`` (`choose_shared`; default ``xla``), its forward is the
ragged kernel and its backward Pallas kernels of its own (`kernels.shared_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp

ENV_VAR = "DSPARK_JAX_ATTENTION"
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "ragged")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _platform() -> str:
  return jax.default_backend()


def _cudnn_entry():
  """JAX's head-major cuDNN attention entry point and its mask-type enum, or None if absent."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    return fa.dot_product_attention, fa.MaskType.NO_MASK
  except (ImportError, AttributeError):
    return None


def cudnn_precondition(dtype, head_dim: int, platform: str | None = None) -> str | None:
  """The first failed precondition of the cuDNN form, or None when it may run."""
  platform = platform or _platform()
  if platform != "gpu":
    return f"platform is {platform!r}, not 'gpu'"
  if _cudnn_entry() is None:
    return f"this JAX ({jax.__version__}) has no head-major cuDNN attention entry point"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
    return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
  if head_dim % 8 or head_dim > 128:
    return f"head_dim {head_dim} is not a multiple of 8 in 8..128"
  return None


def _requested(implementation: str | None) -> str:
  requested = implementation or os.environ.get(ENV_VAR, "auto") or "auto"
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation: expected one of {IMPLEMENTATIONS}, got "
                     f"{requested!r} (from {'the argument' if implementation else ENV_VAR})")
  return requested


def ragged_precondition(q, k, platform: str | None = None) -> str | None:
  """The first failed precondition of the ``ragged`` kernel for queries `q` [B, T, N, D] over a
  head-major cache `k` [B, K, S, D] (`kernels.ragged_attention`), or None when it may run."""
  platform = platform or _platform()
  if platform != "gpu":
    return f"platform is {platform!r}, not 'gpu'"
  from dspark_jax.kernels import ragged_attention
  return ragged_attention.precondition(q, k)


def choose_cached(q, k, implementation: str | None = None, platform: str | None = None) -> str:
  """``"ragged"``, ``"cudnn"`` or ``"xla"`` for queries `q` over a cache `k` read up to per-query
  limits (`attend_limited`, the draft's context prefix): ``auto`` takes the ``ragged`` kernel
  wherever its preconditions hold, else `choose`'s answer (cuDNN or einsums over a cut cache).

  Raises:
    ValueError: an unknown implementation, or an explicit one whose precondition fails.
  """
  requested = _requested(implementation)
  if requested in ("auto", "ragged"):
    failed = ragged_precondition(q, k, platform)
    if not failed:
      return "ragged"
    if requested == "ragged":
      raise ValueError(f"attention implementation 'ragged': precondition failed: {failed}")
  return choose(q.dtype, q.shape[-1], "auto" if requested == "ragged" else requested, platform,
                q.shape[1])


def choose(dtype, head_dim: int, implementation: str | None = None,
           platform: str | None = None, queries: int = 1) -> str:
  """``"cudnn"`` or ``"xla"`` for queries of `dtype` and `head_dim`.

  Args:
    dtype: the dtype of queries, keys and values. head_dim: D. queries: T, queries per row
      (``auto`` takes cuDNN only for T = 1).
    implementation: "auto", "xla" or "cudnn"; None reads ``$DSPARK_JAX_ATTENTION`` (default auto).
    platform: the JAX platform (default: the default backend's).

  Raises:
    ValueError: an unknown implementation, or "cudnn" where its precondition fails.
  """
  requested = _requested(implementation)
  if requested == "ragged":  # a whole-mask call has no cache to read up to limits
    requested = "auto"
  failed = cudnn_precondition(dtype, head_dim, platform)
  if requested == "cudnn" and failed:
    raise ValueError(f"attention implementation 'cudnn': precondition failed: {failed}")
  if requested == "xla" or failed or (requested == "auto" and queries != 1):
    return "xla"
  return "cudnn"


def attend_xla(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, T, N, D] queries over [B, K, S, D] keys/values, `mask` [B, T, S] bool -> [B, T, N, D].

  Query head h reads key/value head ``h // (N // K)``. Scores and softmax in float32; a query whose
  mask is all False gets zeros (never NaN).
  """
  scores = _scores(q, k, mask)
  weights = jax.nn.softmax(scores, axis=-1, where=mask[:, None, None])
  weights = jnp.where(mask[:, None, None], weights, 0.0).astype(v.dtype)
  out = jnp.einsum("bkgts,bksd->btkgd", weights, v)
  return out.reshape(q.shape)


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
  """Scaled float32 scores [B, K, G, T, S] of [B, T, N, D] queries (query head h = k·G + g) over
  head-major [B, K, S, D] keys; -inf where `mask` ([B, T, S], or broadcastable to it) is False."""
  b, t, n, d = q.shape
  heads = k.shape[1]
  q = q.reshape(b, t, heads, n // heads, d)
  scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(d))
  return jnp.where(mask[:, None, None], scores, -jnp.inf)


def attend_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """As `attend_xla`, through cuDNN's fused attention (`cudnn_precondition` must hold)."""
  b, t, n, d = q.shape
  fused, no_mask = _cudnn_entry()
  heads_first = q.reshape(b, n, 1, d) if t == 1 else jnp.swapaxes(q, 1, 2)   # [B, N, T, D]
  out = fused(heads_first, k.astype(q.dtype), v.astype(q.dtype), None, mask[:, None, :, :],
              scale=1.0 / float(d) ** 0.5, mask_type=no_mask, qkv_layout="BNTH")
  out = out.reshape(b, t, n, d) if t == 1 else jnp.swapaxes(out, 1, 2)
  return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, jnp.zeros((), out.dtype))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           implementation: str | None = None) -> jax.Array:
  """Grouped-query attention by the implementation `choose` picks for these inputs."""
  if choose(q.dtype, q.shape[-1], implementation, queries=q.shape[1]) == "cudnn":
    return attend_cudnn(q, k, v, mask)
  return attend_xla(q, k, v, mask)




def choose_causal(q, implementation: str | None = None, platform: str | None = None) -> str | None:
  """``"cudnn"`` where a causal chunk of queries `q` [B, T, N, D] at consecutive positions
  start_b .. start_b + T - 1 of each row, over a contiguous cache (`models.layers.CacheUpTo` with
  its ``start``), runs through cuDNN's flash attention: `attend_causal` for a fresh prefill (start
  0 everywhere), `attend_chunk` for a chunk past slot 0. Preconditions: ``auto`` or ``cudnn``
  requested, T a power of two of at least `FLASH_MIN_QUERIES` (the prompt buckets and prefill
  chunks; at T = 200 cuDNN's causal attention differed from the cache form on an H100), and
  `cudnn_precondition` holds. Else None: the caller attends over its cache (`attend_limited`),
  which gives the same result."""
  t = q.shape[1]
  if _requested(implementation) not in ("auto", "cudnn") or t < FLASH_MIN_QUERIES or t & (t - 1):
    return None
  return None if cudnn_precondition(q.dtype, q.shape[-1], platform) else "cudnn"


def attend_causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """[B, T, N, D] queries at positions 0..T-1 over their own head-major [B, K, T, D] keys/values,
  query t seeing keys 0..t -> [B, T, N, D]: cuDNN's fused flash attention with its causal mask, so
  no mask or score tensor exists in memory (`choose_causal` must have returned ``"cudnn"``).

  This is `attend_limited` with ``limits[b, t] = t + 1`` over a cache that holds these keys in
  its first T slots."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  b, t, n, d = q.shape
  out = fa.dot_product_attention(jnp.swapaxes(q, 1, 2), k.astype(q.dtype), v.astype(q.dtype),
                                 scale=1.0 / float(d) ** 0.5, mask_type=fa.MaskType.CAUSAL,
                                 qkv_layout="BNTH")
  return jnp.swapaxes(out, 1, 2)


SEGMENT_XLA_MAX = 2048
"""Most packed tokens the einsum form of `attend_segments` takes: it holds [N, heads, N] float32
scores, so past this a caller packs only where cuDNN runs (`choose_segments`)."""


def choose_segments(q, implementation: str | None = None, platform: str | None = None
                    ) -> str | None:
  """``"cudnn"`` or ``"xla"``: the form of `attend_segments` for packed queries `q` [1, N, H, D],
  or None where neither should run (the caller then pads its prompts instead). cuDNN's packed
  (segment) flash attention where ``auto`` or ``cudnn`` is requested and `cudnn_precondition`
  holds; else the einsum form up to `SEGMENT_XLA_MAX` tokens."""
  requested = _requested(implementation)
  if requested in ("auto", "cudnn", "ragged") and not cudnn_precondition(
      q.dtype, q.shape[-1], platform):
    return "cudnn"
  return "xla" if q.shape[1] <= SEGMENT_XLA_MAX else None


def segment_offsets(lengths: jax.Array) -> jax.Array:
  """[M] segment lengths -> [M + 1] int32 offsets of the segments packed one after another."""
  lengths = lengths.astype(jnp.int32)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)])


def segment_mask(lengths: jax.Array, tokens: int) -> jax.Array:
  """[N, N] bool: packed token i sees token j iff both lie in the same segment and j <= i
  (`lengths` [M] packed one after another from token 0; tokens past them see nothing)."""
  ends = jnp.cumsum(lengths.astype(jnp.int32))
  index = jnp.arange(tokens, dtype=jnp.int32)
  segment = jnp.searchsorted(ends, index, side="right")              # M past the last segment
  inside = segment < lengths.shape[0]
  return ((segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
          & inside[:, None])


def attend_segments(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                    implementation: str | None = None) -> jax.Array:
  """Causal attention within segments of packed tokens: [1, N, H, D] queries over their own
  token-major [1, N, K, D] keys/values, where segment m is ``lengths[m]`` consecutive tokens
  (segments one after another from token 0) and token i sees the tokens of its own segment up to
  itself -> [1, N, H, D]; tokens past the segments get zeros.

  The prefill of several prompts packed into one row (`models.target.TargetModel.packed_prefill`):
  each segment is attended exactly as `attend_causal` attends a prompt alone. On a GPU, cuDNN's
  flash attention in its packed layout (per-segment offsets and lengths, causal mask), whose
  scratch is a tile of scores; elsewhere the einsum form with `segment_mask` ([N, N] scores:
  `choose_segments` keeps it to `SEGMENT_XLA_MAX` tokens). Preconditions: every length >= 1
  and their sum <= N."""
  chosen = choose_segments(q, implementation)
  if chosen == "cudnn":
    return _segments_cudnn(q, k, v, lengths)
  mask = segment_mask(lengths, q.shape[1])
  return attend_xla(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask[None])


def _segments_cudnn(q, k, v, lengths):
  """`attend_segments` through cuDNN. Keys/values are repeated to the queries' head count: JAX
  scales both offset arrays by the query heads' stride."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  _, _, n, d = q.shape
  if k.shape[2] != n:
    k, v = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
  lengths = lengths.astype(jnp.int32)[None]
  offsets = segment_offsets(lengths[0])[None]
  packed = {}
  if lengths.shape[1] > 1:  # one segment from token 0 is plain causal attention (no packing)
    packed = dict(q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets)
  out = fa.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), **packed,
                                 scale=1.0 / float(d) ** 0.5, mask_type=fa.MaskType.CAUSAL,
                                 qkv_layout="BTNH")
  inside = jnp.arange(q.shape[1]) < offsets[0, -1]
  return jnp.where(inside[None, :, None, None], out, jnp.zeros((), out.dtype))


# What cuDNN's softmax statistics are, read in jax 0.10.2's
# jax/_src/cudnn/fused_attention_stablehlo.py (the GPU tests check the claim):
# * `dot_product_attention(..., return_residual=True)` returns (out, stats): `_dot_product_
#   attention_fwd` binds with ``is_training=True`` and returns both outputs; the abstract eval and
#   the lowering give stats the shape ``softmax_stat_shape = (B * max_seg_per_batch, N, T)`` in
#   float32, row-major (`default_layouts`), whatever the qkv layout: [B, N, T] without packing
#   (jax/_src/nn/functions.py: "Regardless of input layout, cudnn always returns residual with
#   (B N T) layout").
# * They are the log-sum-exp of FlashAttention-2 §3.1.1 (the docstring of ``return_residual``),
#   in natural log, of the scaled scores ``scale · q·k`` over the keys the mask admits: JAX's XLA
#   twin (`jax.nn.dot_product_attention(implementation="xla", return_residual=True)`, which stands
#   in for cuDNN) returns ``logsumexp(scale · q·k masked)``. JAX itself never reads them except to
#   hand them back to cuDNN's backward pass.
# * ``q_seqlen`` / ``kv_seqlen`` are int32 of shape [B] (`check_layout`: int32, rank 1 without
#   offsets, batch B) and are required by ``MaskType.PADDING``; their values go to cuDNN
#   unchecked. Nothing in JAX says what cuDNN does with ``kv_seqlen = 0`` (a query that sees no
#   key: XLA's twin would give a uniform softmax over large negative scores), so
#   `cudnn_prior_part` never passes 0.


def cudnn_part(out: jax.Array, stats: jax.Array, heads: int):
  """cuDNN's head-major output [B, N, T, D] and softmax statistics [B, N, T] (the natural-log
  log-sum-exp of the scaled scores) as a softmax part (lse, out) laid out by kv head,
  [B, K, G, T] and [B, K, G, T, D] float32 (`_part`'s layout; query head h = k·G + g)."""
  b, n, t, d = out.shape
  return (stats.astype(jnp.float32).reshape(b, heads, n // heads, t),
          out.astype(jnp.float32).reshape(b, heads, n // heads, t, d))


def cudnn_prior_part(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, start: jax.Array):
  """The softmax part of [B, T, N, D] queries over slots ``0 .. start_b - 1`` of row b of a
  head-major [B, K, S, D] cache (every query of a row the same slots, no causal mask), as (lse,
  out) in `_part`'s layout; a row with ``start_b = 0`` gets (-inf, zeros).

  cuDNN's flash attention with ``MaskType.PADDING``, ``q_seqlen = T`` and ``kv_seqlen = start``
  per row, reading the cache in place (``BNTH``). ``kv_seqlen`` is clamped to at least 1 and such
  rows masked afterwards (see the note above `cudnn_part`). Preconditions: `choose_causal` holds
  for `q`; ``0 <= start_b <= S``; every slot holds finite values. Slots at or past ``start_b``
  never reach the result (cuDNN's padding mask; checked on the GPU with large finite values
  there), but cuDNN multiplies a tile's masked probabilities by its values, so a NaN or inf
  anywhere in a tile that crosses ``start_b`` would (our caches hold zeros or written keys)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  b, t, n, d = q.shape
  start = start.astype(jnp.int32)
  out, stats = fa.dot_product_attention(
      jnp.swapaxes(q, 1, 2), cache_k.astype(q.dtype), cache_v.astype(q.dtype),
      q_seqlen=jnp.full((b,), t, jnp.int32), kv_seqlen=jnp.maximum(start, 1),
      scale=1.0 / float(d) ** 0.5, mask_type=fa.MaskType.PADDING, qkv_layout="BNTH",
      return_residual=True)
  lse, out = cudnn_part(out, stats, cache_k.shape[1])
  some = (start > 0)[:, None, None, None]
  return jnp.where(some, lse, -jnp.inf), jnp.where(some[..., None], out, 0.0)


def cudnn_self_part(q: jax.Array, k: jax.Array, v: jax.Array):
  """The softmax part of [B, T, N, D] queries over their own head-major [B, K, T, D] keys/values,
  query t seeing keys 0..t (causal, top-left), as (lse, out) in `_part`'s layout: cuDNN's flash
  attention with ``MaskType.CAUSAL`` and its statistics (`choose_causal` must hold for `q`)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  d = q.shape[-1]
  out, stats = fa.dot_product_attention(
      jnp.swapaxes(q, 1, 2), k.astype(q.dtype), v.astype(q.dtype), scale=1.0 / float(d) ** 0.5,
      mask_type=fa.MaskType.CAUSAL, qkv_layout="BNTH", return_residual=True)
  return cudnn_part(out, stats, k.shape[1])


def attend_chunk(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                 cache_v: jax.Array, start: jax.Array, *, prior_part=None,
                 self_part=None) -> jax.Array:
  """A prefill chunk's attention: [B, T, N, D] queries at positions start_b .. start_b + T - 1 of
  row b, query t seeing slots ``0 .. start_b - 1`` of the head-major [B, K, S, D] cache and its
  own chunk's head-major [B, K, T, D] keys/values `k` / `v` up to itself -> [B, T, N, D].

  The same function as `attend_limited` with ``limits = start + t + 1`` over a cache that holds
  `k` / `v` in slots start_b .. start_b + T - 1 (up to rounding: each part's output is rounded to
  the dtype before the join), computed as two softmax parts joined through their log-sum-exps
  (`_join`): ``prior_part(q, cache_k, cache_v, start)`` over the cache before the chunk (default
  `cudnn_prior_part`) and ``self_part(q, k, v)`` over the chunk, causal (default
  `cudnn_self_part`). The cache is read in place and only the prior part reads it: nothing at
  or past slot start_b reaches the result, whatever it holds. The defaults need `choose_causal`
  to hold for `q`; the parameters let other forms of the parts (the XLA ones of the CPU tests)
  share the join."""
  prior_part = prior_part or cudnn_prior_part
  self_part = self_part or cudnn_self_part
  return _join(prior_part(q, cache_k, cache_v, start), self_part(q, k, v), q.dtype)


def cut_lengths(slots: int, smallest: int = 128, ratio: float = 2 ** 0.5,
                multiple: int = 64, least: int = 1024) -> tuple[int, ...]:
  """The static cache lengths the XLA form cuts a cache of `slots` slots to, ascending.

  From `smallest`, each length about `ratio` times the one before, rounded up to a multiple of
  `multiple`; the last is `slots` itself. A call reads the smallest one that covers its longest
  row, so the slots it reads are at most `ratio` times what it needs (or `smallest`). A cache of
  fewer than `least` slots is read whole: there the cut saves less than its branches cost to
  compile.
  """
  if slots < least:
    return (slots,)
  lengths = []
  n = smallest
  while n < slots:
    lengths.append(n)
    n = max(n + multiple, -(-int(n * ratio) // multiple) * multiple)
  return tuple(lengths) + (slots,)


def over_cut_cache(fn, q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array):
  """``fn(q, k[:, :, :n], v[:, :, :n], limits)`` for the smallest `cut_lengths` n covering
  ``max(limits)``: one `lax.switch` branch per static length, so the work follows the longest
  row's real length and no length recompiles. `fn` must ignore slots at or past each query's
  limit (then every branch gives the same result)."""
  cuts = cut_lengths(k.shape[2])
  if len(cuts) == 1:
    return fn(q, k, v, limits)
  need = jnp.max(limits).astype(jnp.int32)
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(cuts, jnp.int32), need), len(cuts) - 1)
  branches = [lambda q, k, v, limits, n=n: fn(q, k[:, :, :n], v[:, :, :n], limits) for n in cuts]
  return jax.lax.switch(index, branches, q, k, v, limits)


def _limit_mask(limits: jax.Array, slots: int) -> jax.Array:
  """[B, T] limits -> [B, T, S] mask ``slot < limit``."""
  return jnp.arange(slots, dtype=jnp.int32)[None, None, :] < limits[:, :, None]


def attend_limited(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array,
                   implementation: str | None = None) -> jax.Array:
  """[B, T, N, D] queries over head-major [B, K, S, D] keys/values, query (b, t) seeing slots
  ``s < limits[b, t]`` ([B, T] int) -> [B, T, N, D].

  The same function as `attend` with the mask ``slot < limit``, but the work follows the real
  context, not S: on a GPU the ``ragged`` kernel reads each row's blocks up to its limits (in
  query tiles where T is large: a flash-attention prefill); elsewhere, up to `FLASH_MIN_QUERIES`
  queries per row, the cache is cut to the smallest of a few static lengths covering the longest
  row (`over_cut_cache`), and more queries (a prefill) take `attend_flash`, whose scratch is one
  tile of scores. Slots at or past a query's limit are never read into its result, whatever they
  hold. A query with limit 0 gets zeros.
  """
  limits = limits.astype(jnp.int32)
  chosen = choose_cached(q, k, implementation)
  if chosen == "ragged":
    from dspark_jax.kernels import ragged_attention
    return ragged_attention.ragged_attention(q, k.astype(q.dtype), v.astype(q.dtype), limits)[0]
  form = masked_form(chosen, q.shape[1])
  if form is attend_flash:     # walks the cache up to each tile's limits itself
    return attend_flash(q, k, v, limits)
  return over_cut_cache(form, q, k, v, limits)


def attend_packed(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array,
                  tokens: jax.Array, implementation: str | None = None) -> jax.Array | None:
  """Packed queries [N', N, D] over head-major [B, K, S, D] keys/values, query (b, t) being token
  ``tokens[b, t]`` ([B, T] int; outside 0..N'-1: none) and seeing slots ``s < limits[b, t]``
  -> [N', N, D] through the ``ragged`` kernel, which reads and writes the packed tokens where they
  lie (no [B, T] layout of the queries is built); None where `choose_cached` does not take the
  kernel (the caller then lays the queries out per row and calls `attend_limited`). A token that
  no (b, t) names gets unspecified values."""
  dense = jax.ShapeDtypeStruct((*limits.shape, *q.shape[1:]), q.dtype)
  if choose_cached(dense, k, implementation) != "ragged":
    return None
  from dspark_jax.kernels import ragged_attention
  return ragged_attention.ragged_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                           limits.astype(jnp.int32), tokens=tokens)[0]


FLASH_MIN_QUERIES = 64
"""Queries per row from which the einsum form runs as `attend_flash` (a prefill chunk) rather than
over a cut cache: with more, the [B, N, T, S] scores of the cut form would dominate memory."""
FLASH_QUERY_TILE = 128
"""Queries per tile of `attend_flash`."""
FLASH_KV_CHUNK = 512
"""Cache slots per step of `attend_flash`'s online softmax."""


def masked_form(chosen: str, queries: int):
  """The non-kernel form ``fn(q, k, v, limits)`` of `attend_limited` for `chosen` ("cudnn" or
  "xla") and T = `queries`, over the cache it is given (uncut): `attend_flash` for a long chunk
  of queries on the einsum path, else `attend_cudnn` / `attend_xla` with the mask
  ``slot < limit``."""
  if chosen != "cudnn" and queries > FLASH_MIN_QUERIES:
    return attend_flash
  form = attend_cudnn if chosen == "cudnn" else attend_xla
  return lambda q, k, v, limits: form(q, k, v, _limit_mask(limits, k.shape[2]))


def attend_flash(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array, *,
                 query_tile: int = FLASH_QUERY_TILE, kv_chunk: int = FLASH_KV_CHUNK) -> jax.Array:
  """`attend_limited`'s function in plain XLA with an online softmax: flash attention in einsums.

  The queries run in tiles of `query_tile` (one after another, `lax.map`); each tile walks the
  cache in steps of `kv_chunk` slots up to its own queries' longest limit (a `lax.fori_loop` with
  a dynamic trip count), keeping a running maximum, sum and float32 output. So the scratch memory
  holds one [B, N, query_tile, kv_chunk] tile of float32 scores, never [B, N, T, S], and a causal
  chunk's early tiles stop at their diagonal. Scores and softmax in float32, the probabilities
  rounded to the value dtype before the second product, as in `attend_xla`; slots at or past a
  query's limit never reach its result, whatever they hold; a query with limit 0 gets zeros.

  Args:
    q: [B, T, N, D]. k, v: head-major [B, K, S, D]. limits: [B, T] int.
    query_tile, kv_chunk: tile sizes (static), each clipped to T and S.

  Returns:
    [B, T, N, D] in q's dtype.
  """
  b, t, n, d = q.shape
  heads, slots = k.shape[1], k.shape[2]
  groups = n // heads
  tile = min(query_tile, t)
  tiles = -(-t // tile)
  chunk = min(kv_chunk, slots)
  pad = tiles * tile - t
  limits = jnp.clip(limits.astype(jnp.int32), 0, slots)
  q_tiles = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, tiles, tile, heads, groups, d)
  lim_tiles = jnp.pad(limits, ((0, 0), (0, pad))).reshape(b, tiles, tile)
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  lanes = jnp.arange(chunk, dtype=jnp.int32)

  def one_tile(args):
    qt, lim = args                                   # [B, tile, K, G, D], [B, tile]
    steps = (jnp.max(lim) + chunk - 1) // chunk

    def step(j, carry):
      m, l, acc = carry
      first = jnp.minimum(j * chunk, slots - chunk)  # the last step may overlap the one before
      keys = jax.lax.dynamic_slice_in_dim(k, first, chunk, axis=2)
      values = jax.lax.dynamic_slice_in_dim(v, first, chunk, axis=2)
      where = first + lanes                          # slots of this step
      fresh = where >= j * chunk                     # an overlapped slot was counted already
      seen = fresh[None, None, :] & (where[None, None, :] < lim[:, :, None])   # [B, tile, C]
      scores = jnp.einsum("btkgd,bkcd->bkgtc", qt, keys.astype(qt.dtype),
                          preferred_element_type=jnp.float32) * scale
      scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
      shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.where(seen[:, None, None], jnp.exp(scores - shift[..., None]), 0.0)
      alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - shift), 0.0)
      values = jnp.where(fresh[None, None, :, None], values, jnp.zeros((), values.dtype))
      o = jnp.einsum("bkgtc,bkcd->bkgtd", p.astype(v.dtype), values,
                     preferred_element_type=jnp.float32)
      return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + o

    init = (jnp.full((b, heads, groups, tile), -jnp.inf, jnp.float32),
            jnp.zeros((b, heads, groups, tile), jnp.float32),
            jnp.zeros((b, heads, groups, tile, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, steps, step, init)
    some = l > 0
    out = jnp.where(some[..., None], acc / jnp.where(some, l, 1.0)[..., None], 0.0)
    return jnp.moveaxis(out, 3, 1).reshape(b, tile, n, d).astype(q.dtype)   # [B, tile, N, D]

  out = jax.lax.map(one_tile, (jnp.moveaxis(q_tiles, 1, 0), jnp.moveaxis(lim_tiles, 1, 0)))
  return jnp.moveaxis(out, 0, 1).reshape(b, tiles * tile, n, d)[:, :t]


def _part(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
  """One softmax part of [B, T, N, D] queries over head-major [B, K, S, D] keys/values where
  `mask` holds: (lse, out), the log-sum-exp of the scores [B, K, G, T] (-inf where no key) and
  the normalised output [B, K, G, T, D] (zeros where no key), float32."""
  scores = _scores(q, k, mask)
  m = jnp.max(scores, axis=-1)
  p = jnp.where(mask[:, None, None],
                jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
  o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  total = jnp.sum(p, axis=-1)
  some = total > 0
  lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf)
  return lse, jnp.where(some[..., None], o / jnp.where(some, total, 1.0)[..., None], 0.0)


def _join(first, second, dtype) -> jax.Array:
  """Two softmax parts (lse, out) -> the [B, T, N, D] attention output (zeros where neither has a
  key)."""
  m = jnp.maximum(first[0], second[0])
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w1, w2 = (jnp.where(jnp.isfinite(part[0]), jnp.exp(part[0] - m), 0.0) for part in (first, second))
  den = w1 + w2
  num = w1[..., None] * first[1] + w2[..., None] * second[1]
  out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
  b, heads, groups, t, d = out.shape
  return jnp.moveaxis(out, 3, 1).reshape(b, t, heads * groups, d).astype(dtype)


def attend_cached(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, prefix_len: jax.Array,
                  block_k: jax.Array, block_v: jax.Array, block_mask: jax.Array) -> jax.Array:
  """Attention of [B, T, N, D] queries over a cache prefix and a fresh block, without joining them.

  Every query sees cache slots ``0 .. prefix_len_b - 1`` of head-major [B, K, S, D] `cache_k` /
  `cache_v` (later slots are ignored, whatever they hold) and the block's token-major [B, T', K, D]
  `block_k` / `block_v` where `block_mask` [B, T, T'] holds. The result equals `attend_xla` over
  the concatenated keys with the corresponding mask, up to rounding (the two parts' probabilities
  are rounded to the value dtype separately). Both parts are einsums with float32 scores; nothing
  is concatenated, so a cache is read in place, and the prefix part reads the cache cut to the
  longest prefix (`over_cut_cache`).
  """
  limits = jnp.broadcast_to(prefix_len.astype(jnp.int32)[:, None], q.shape[:2])
  if choose_cached(q, cache_k) == "ragged":
    from dspark_jax.kernels import ragged_attention
    out, lse = ragged_attention.ragged_attention(q, cache_k.astype(q.dtype),
                                                 cache_v.astype(q.dtype), limits)
    prefix = kernel_part(out, lse, cache_k.shape[1])
  else:
    prefix = over_cut_cache(limited_part, q, cache_k, cache_v, limits)
  return join_block(q, prefix, block_k, block_v, block_mask, cache_k.dtype)


def limited_part(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array):
  """`_part` of [B, T, N, D] queries over head-major [B, K, S, D] keys/values, query (b, t)
  seeing slots ``s < limits[b, t]``."""
  return _part(q, k, v, _limit_mask(limits, k.shape[2]))


def kernel_part(out: jax.Array, lse: jax.Array, heads: int):
  """The ragged kernel's (out [B, T, N, D], lse [B, T, N]) as a softmax part (lse, out) laid out
  by kv head, [B, K, G, T] and [B, K, G, T, D] float32 (`_part`'s layout)."""
  b, t, n = lse.shape
  by_head = lambda x: jnp.moveaxis(x.reshape(b, t, heads, n // heads, *x.shape[3:]), 1, 3)
  return by_head(lse), by_head(out.astype(jnp.float32))


def join_block(q: jax.Array, prefix, block_k: jax.Array, block_v: jax.Array,
               block_mask: jax.Array, kv_dtype) -> jax.Array:
  """A cache prefix's softmax part joined with the part of the queries' own block: token-major
  [B, T', K, D] `block_k` / `block_v` (cast to `kv_dtype`) where `block_mask` [B, T, T'] holds
  -> [B, T, N, D] in q's dtype."""
  block = _part(q, jnp.swapaxes(block_k, 1, 2).astype(kv_dtype),
                jnp.swapaxes(block_v, 1, 2).astype(kv_dtype), block_mask)
  return _join(prefix, block, q.dtype)


SHARED_ENV_VAR = "DSPARK_JAX_SHARED_ATTENTION"
SHARED_FORMS = ("auto", "xla", "ragged")


def choose_shared(q, k, platform: str | None = None) -> str:
  """``"xla"`` or ``"ragged"``: the form of training's shared-context attention
  (`shared_limited_part`) for queries `q` [B, T, N, D] over head-major keys `k` [B, K, S, D].
  ``$DSPARK_JAX_SHARED_ATTENTION``: ``auto`` (the default: ``ragged`` wherever its preconditions
  hold, else ``xla``), ``xla`` (einsums in query tiles) or ``ragged``
  (`kernels.shared_attention`: the ragged kernel's forward and Pallas kernels for the backward,
  reading k and v in q's dtype).

  Raises:
    ValueError: an unknown value, or ``ragged`` where the kernel's preconditions fail (naming
      the first).
  """
  requested = os.environ.get(SHARED_ENV_VAR, "auto") or "auto"
  if requested not in SHARED_FORMS:
    raise ValueError(f"{SHARED_ENV_VAR}: expected one of {', '.join(SHARED_FORMS)}, got "
                     f"{requested!r}")
  if requested == "xla":
    return "xla"
  failed = ragged_precondition(q, jax.ShapeDtypeStruct(k.shape, q.dtype), platform)
  if failed and requested == "ragged":
    raise ValueError(f"{SHARED_ENV_VAR}={requested}: precondition failed: {failed}")
  return "xla" if failed else "ragged"


_BATCH_SHARDING = contextvars.ContextVar("dspark_jax_batch_sharding", default=None)


@contextlib.contextmanager
def batch_sharded(mesh, axis: str):
  """While tracing inside it, the kernel form of `shared_limited_part` runs on each shard of the
  batch over `mesh` axis `axis` (`jax.shard_map`): jit does not partition a Pallas kernel, and
  would otherwise gather the batch and run the whole of it on every device. The `Trainer` of a
  data-parallel run traces its step inside it."""
  token = _BATCH_SHARDING.set((mesh, axis))
  try:
    yield
  finally:
    _BATCH_SHARDING.reset(token)


SHARED_QUERY_TILE = 512
"""Queries per tile of `shared_limited_part`: its scratch holds one [B, N, tile, S] tile of float32
scores, in the forward pass and again in the backward pass."""


def shared_limited_part(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array, *,
                        tile: int | None = None):
  """`limited_part` of [B, T, N, D] queries over head-major [B, K, S, D] keys/values (query (b, t)
  seeing slots ``s < limits[b, t]``), computed in tiles of `tile` queries (`lax.map`), each tile
  under `jax.checkpoint`: the backward pass recomputes a tile's scores instead of keeping them, so
  what is kept for the gradient is the queries, keys and values and the (lse, out) part, and the
  scratch is one tile of scores. Every query's softmax is the same reduction as in
  `limited_part`, so the result is identical. `tile` defaults to `SHARED_QUERY_TILE` (read at
  the call). Where `choose_shared` says ``"ragged"``, the forward is the ragged kernel and the
  backward Pallas kernels (`shared_attention.limited_part_kernel`): equal within bf16 rounding.
  Returns (lse [B, K, G, T], out [B, K, G, T, D])."""
  if choose_shared(q, k) == "ragged":
    from dspark_jax.kernels import shared_attention

    def kernel(q, k, v, limits):
      return kernel_part(*shared_attention.limited_part_kernel(
          q, k.astype(q.dtype), v.astype(q.dtype), limits), k.shape[1])
    sharding = _BATCH_SHARDING.get()
    if sharding is not None and sharding[0].shape[sharding[1]] > 1:
      spec = jax.sharding.PartitionSpec(sharding[1])
      kernel = jax.shard_map(kernel, mesh=sharding[0], in_specs=(spec,) * 4,
                             out_specs=(spec, spec), check_vma=False)
    return kernel(q, k, v, limits)
  b, t, n, d = q.shape
  tile = max(1, min(tile or SHARED_QUERY_TILE, t))
  tiles = -(-t // tile)
  pad = tiles * tile - t
  part = jax.checkpoint(limited_part)
  if tiles == 1:
    return part(q, k, v, limits)
  q_tiles = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, tiles, tile, n, d)
  lim_tiles = jnp.pad(limits, ((0, 0), (0, pad))).reshape(b, tiles, tile)   # padding sees nothing
  lse, out = jax.lax.map(lambda args: part(args[0], k, v, args[1]),
                         (jnp.moveaxis(q_tiles, 1, 0), jnp.moveaxis(lim_tiles, 1, 0)))
  heads = k.shape[1]
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, heads, n // heads, tiles * tile)[..., :t]
  out = jnp.moveaxis(out, 0, 3).reshape(b, heads, n // heads, tiles * tile, d)[..., :t, :]
  return lse, out


def attend_shared(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, prefix_len: jax.Array,
                  block_k: jax.Array, block_v: jax.Array, block_mask: jax.Array,
                  group: int) -> jax.Array:
  """`attend_cached` where consecutive groups of `group` rows share one cache row: query row b
  (of B = C·group) sees slots ``0 .. prefix_len_b - 1`` of row ``b // group`` of head-major
  [C, K, S, D] `cache_k` / `cache_v`, and its own block's [B, T', K, D] keys/values where
  `block_mask` [B, T, T'] holds -> [B, T, N, D].

  The same function as `attend_cached` over the cache repeated `group` times (up to rounding),
  without the copies: the group's queries are one row of group·T queries with per-query limits
  over its cache row (`shared_limited_part`). Training's form: the anchor blocks of one sequence
  over its context.
  """
  b, t, n, d = q.shape
  rows = cache_k.shape[0]
  if b != rows * group:
    raise ValueError(f"attend_shared: {b} query rows are not {rows} cache rows x group {group}")
  limits = jnp.repeat(prefix_len.astype(jnp.int32).reshape(rows, group), t, axis=1)
  lse, out = shared_limited_part(q.reshape(rows, group * t, n, d), cache_k, cache_v, limits)
  heads = cache_k.shape[1]
  by_row = lambda x: jnp.moveaxis(x.reshape(rows, heads, n // heads, group, t, *x.shape[4:]),
                                  3, 1).reshape(b, heads, n // heads, t, *x.shape[4:])
  return join_block(q, (by_row(lse), by_row(out)), block_k, block_v, block_mask, cache_k.dtype)
