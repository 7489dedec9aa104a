"""Attention of a few queries per row over a head-major KV cache, reading each row's valid prefix.

This module owns `ragged_attention`, a Pallas kernel (Triton lowering on GPUs, Pallas' interpreter
on the CPU) that computes the same function as `attention.attend_xla` with the mask
``slot < limits[b, t]``, plus the log-sum-exp of each query's scores, but whose cost follows each
row's real length instead of the cache capacity S: a row whose queries see at most ``L_b`` slots
reads ``ceil(L_b / block_kv)`` key/value blocks, and no block past that is ever loaded.

Layout and work split:

* Grouped-query attention: one kernel instance handles one (row b, key/value head k, split) and all
  ``G = N / K`` query heads of that kv head times all T queries of the row at once, as one [P, D]
  query tile (tile row ``p = t·G + g``; P = T·G rounded up to a power of two >= 16, the matrix
  unit's minimum height). The kernel gathers the tile from q [B, T, N, D] and the rows' limits
  from [B, T] itself (no rearranging pass in XLA); a padding row p >= T·G repeats row p mod T·G.
  One pass over a kv head's keys serves the whole group.
* Query tiles (a prefill: many queries per row): where T·G exceeds `MAX_ROWS`, the queries are
  split into tiles of ``MAX_ROWS // G`` queries (`query_tiling`) and the grid is (B, K, tiles),
  one split each. A tile reads the KV blocks up to its own queries' longest limit, so a causal
  prefill (limits = positions + 1) skips the blocks past its diagonal, and no instance holds more
  than one [P, block_kv] tile of scores: flash attention over the cache, read in place.
* Split-K (flash decoding): with one query tile, the grid is (B, K, splits). Split i of row b takes the KV blocks
  ``[i·n_b, (i+1)·n_b) ∩ [0, ceil(L_b / block_kv))`` with ``n_b = ceil(ceil(L_b / block_kv) /
  splits)``, so every split of a row gets an equal share of the row's real blocks whatever S is.
  With one split the kernel normalises and writes out and lse in place; with more, each split
  writes float32 partials (running max m, sum l, unnormalised output acc), joined by a small
  kernel of one instance per tile row where B·K is small (`_combine_rows`), else by XLA
  (`_combine`). A split with nothing to do writes m = -inf, l = 0, acc = 0.
* The KV loop has a dynamic trip count and loads each block from the whole cache by a computed
  address (`_block_address`): (row b, slot ``j·block_kv``) in a contiguous cache, or, with a
  ``block_table`` (paged KV, `dspark_jax.paging`), page ``block_table[b, j·block_kv // page_size]``
  of a page pool [num_pages, K, page_size, D] at offset ``j·block_kv mod page_size``. A contiguous
  cache [B, K, S, D] is the pool of B pages of S slots with the table ``[[0], [1], ...]``; it is
  run without a table (no table load per block).

Scores and the softmax run in float32 with scale 1/sqrt(D); the probabilities are rounded to the
value dtype before the second product, as in `attend_xla`. Slots at or past a row's length are
loaded as zeros (masked loads), so whatever they hold (NaN, inf) never reaches the result; a query
that sees no slot gets zeros and lse = -inf, never NaN.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16       # a dot on the matrix units needs at least 16 rows
MAX_ROWS = 128      # the largest query tile P = T·G (padded) one instance holds
DEFAULT_BLOCK_KV = 64
SMS = 132           # streaming multiprocessors of an H200: the default split count fills them
WAVES = 1           # instances per SM the default split count aims at
DEFAULT_WARPS = 4
TILED_WARPS = 8     # warps of an instance when the queries are split into tiles (a prefill)
TILED_BLOCK_KV = 128  # KV block of query tiles where it divides S (else DEFAULT_BLOCK_KV)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
COMBINE_KERNEL_MAX_ROWS = 32
"""Splits are joined by a kernel (`_combine_rows`) where B·K is at most this, else by XLA
(`_combine`): the kernel's instance per tile row pays where there are few (row, head) pairs."""


def query_rows(t: int, groups: int) -> int:
  """P: the rows of one instance's query tile, T·G rounded up to a power of two >= 16."""
  return max(MIN_ROWS, 1 << max(t * groups - 1, 0).bit_length())


def query_tiling(t: int, groups: int) -> tuple[int, int]:
  """``(queries per tile, tiles)``: all T queries in one tile while ``query_rows(T, G) <=
  MAX_ROWS``, else tiles of ``MAX_ROWS // G`` queries (the last one short)."""
  if query_rows(t, groups) <= MAX_ROWS:
    return t, 1
  per_tile = MAX_ROWS // groups
  return per_tile, -(-t // per_tile)


def default_splits(batch: int, kv_heads: int, slots: int, block_kv: int) -> int:
  """Splits per (row, kv head) so that the grid has about `WAVES` instances per SM of an H200:
  ``clamp(ceil(WAVES·SMS / (B·K)), 1, S / block_kv)``."""
  return max(1, min(-(-WAVES * SMS // (batch * kv_heads)), slots // block_kv))


def paged_block(page_size: int) -> int:
  """The default KV block over pages of `page_size` slots: the largest power of two <= 64
  (`DEFAULT_BLOCK_KV`) dividing it (at least 16 where the page size is a multiple of 16)."""
  return min(DEFAULT_BLOCK_KV, page_size & -page_size)


def default_block(q, k, paged: bool) -> int:
  """The default KV block: `paged_block` of the page size with a table; `TILED_BLOCK_KV` where
  the queries are split into tiles (a prefill: larger blocks keep the matrix units busy) and it
  divides S; else `DEFAULT_BLOCK_KV`."""
  if paged:
    return paged_block(k.shape[2])
  if (q.ndim == 4 and k.ndim == 4 and k.shape[1] and q.shape[2] % k.shape[1] == 0
      and query_tiling(q.shape[1], q.shape[2] // k.shape[1])[1] > 1
      and k.shape[2] % TILED_BLOCK_KV == 0):
    return TILED_BLOCK_KV
  return DEFAULT_BLOCK_KV


def default_stages(block_kv: int) -> int:
  """Software-pipeline depth of the KV loop: 4 blocks in flight of up to 64 slots, else 3 (shared
  memory holds ``stages · block_kv · D`` keys and values)."""
  return 4 if block_kv <= 64 else 3


def precondition(q, k, v=None, *, block_kv: int = DEFAULT_BLOCK_KV,
                 block_table=None) -> str | None:
  """The first failed precondition of `ragged_attention` on these arrays, in words, or None.

  q [B, T, N, D]; k (and v, if given) [B, K, S, D], or with a `block_table` [B, M] (integer)
  page pools [num_pages, K, page_size, D]. Requires: those ranks and matching B and D; v shaped as
  k; N a multiple of K; D a power of two in 16..256; `block_kv` a power of two >= 16 dividing S
  (the page size, with a table); a page pool of fewer than 2^31 elements; q, k, v all of one
  dtype among bfloat16, float16, float32; G = N / K at most `MAX_ROWS` (more queries than one
  tile holds are split into query tiles, `query_tiling`).
  """
  paged = block_table is not None
  if q.ndim != 4 or k.ndim != 4:
    layout = "[num_pages, K, page_size, D]" if paged else "[B, K, S, D]"
    return f"q must be [B, T, N, D] and k {layout}, got shapes {q.shape} and {k.shape}"
  b, t, n, d = q.shape
  kb, heads, slots, kd = k.shape
  if v is not None and v.shape != k.shape:
    return f"v shape {v.shape} differs from k shape {k.shape}"
  if paged:
    if len(block_table.shape) != 2 or block_table.shape[0] != b:
      return f"block_table shape {tuple(block_table.shape)} is not [B, pages] with B={b}"
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
      return f"block_table dtype {jnp.dtype(block_table.dtype).name} is not an integer type"
    if kd != d:
      return f"q {q.shape} and the page pool {k.shape} disagree on the head size"
    if math.prod(k.shape) >= 2 ** 31:
      return f"the page pool {k.shape} has 2^31 elements or more (int32 offsets)"
  elif kb != b or kd != d:
    return f"q {q.shape} and k {k.shape} disagree on the batch or the head size"
  if heads < 1 or n % heads:
    return f"query heads N={n} are not a multiple of kv heads K={heads}"
  if d < 16 or d > 256 or d & (d - 1):
    return f"head size D={d} is not a power of two in 16..256"
  if block_kv < 16 or block_kv & (block_kv - 1):
    return f"block_kv={block_kv} is not a power of two >= 16"
  if slots % block_kv:
    if paged:
      return f"page_size={slots} is not a multiple of block_kv={block_kv}"
    return f"cache slots S={slots} are not a multiple of block_kv={block_kv}"
  dtypes = [jnp.dtype(x.dtype) for x in (q, k) + ((v,) if v is not None else ())]
  if dtypes[0] not in [jnp.dtype(x) for x in DTYPES]:
    return f"dtype {dtypes[0].name} is not bfloat16, float16 or float32"
  if any(x != dtypes[0] for x in dtypes):
    return f"q, k, v dtypes differ: {', '.join(x.name for x in dtypes)}"
  if n // heads > MAX_ROWS:
    return f"G={n // heads} query heads per kv head exceed the query tile's {MAX_ROWS} rows"
  return None


def _block_address(b, j, table_ref, block_kv: int, page_size: int, num_pages: int):
  """(first index, slot) in k_ref / v_ref of row `b`'s logical KV block `j`: ``(b, j·block_kv)``
  in a contiguous cache (no table); with a block table, the block's page (clipped into the pool,
  so no table entry can address memory outside it) and its offset in that page."""
  first = j * block_kv
  if table_ref is None:
    return b, first
  page = table_ref[b, first // page_size]
  return jnp.clip(page, 0, num_pages - 1), first % page_size


def _kernel(*refs, rows: int, groups: int, per_tile: int, block_kv: int, splits: int,
            scale: float, paged: bool, packed: bool = False):
  """One (row b, kv head h, split or query tile) instance.

  Inputs (whole, indexed here): limits_ref [B, T] int32, with `paged` table_ref [B, M] int32,
  then q_ref [B, T, N, D], k_ref and v_ref [B, K, S, D] (with `paged`: page pools
  [num_pages, K, page_size, D], the row's logical capacity being ``M·page_size``). The third grid
  axis is the split (one query tile of all T queries) or, with ``splits == 1``, the query tile i
  of `per_tile` queries. Query row p < per_tile·G of tile i is query ``t = i·per_tile + p // G``
  of head ``h·G + p % G``; rows past per_tile·G, and queries past T in the last tile, are padding,
  computed as a copy of a real row (so a store of the whole tile writes each of those addresses
  with one value).
  Outputs: with one split, out_ref [B, T, N, D] (q's dtype) and lse_ref [B, T, N] float32, final;
  else the float32 partials m_ref, l_ref [B, K, splits, P] and acc_ref [B, K, splits, P, D].
  """
  limits_ref, *refs = refs
  table_ref = refs.pop(0) if paged else None
  tokens_ref = refs.pop(0) if packed else None
  q_ref, k_ref, v_ref, *out_refs = refs
  b, h, third = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  split, tile = (third, 0) if splits > 1 else (0, third)
  t_count, d = limits_ref.shape[1], q_ref.shape[-1]
  page_size, num_pages = k_ref.shape[2], k_ref.shape[0]
  slots_total = table_ref.shape[1] * page_size if paged else page_size
  p = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  source = p % (per_tile * groups)     # a padding row repeats a real row: same inputs, same result
  t = jnp.minimum(tile * per_tile + source // groups, t_count - 1)
  head = h * groups + source % groups
  limits = limits_ref[b, t]
  limits = jnp.clip(limits, 0, slots_total)                  # [P]
  # Gathers take integer indices in every dimension (Pallas' interpreter mixes no slices in).
  tile = lambda x: jnp.broadcast_to(x[:, None], (rows, d))
  columns = jax.lax.broadcasted_iota(jnp.int32, (rows, d), 1)
  if packed:        # query (b, t) is packed query tokens[b, t]; none there: the trash row N
    count = q_ref.shape[0]
    token = tokens_ref[b, t]
    token = jnp.where((token >= 0) & (token < count), token, count)
    q = q_ref[(tile(jnp.minimum(token, count - 1)), tile(head), columns)]
    gather = (tile(token), tile(head), columns)
    lse_at = (token, head)
  else:
    gather = (b, tile(t), tile(head), columns)
    q = q_ref[gather]                                        # [P, D]
    lse_at = (b, t, head)
  length = jnp.max(limits)                                   # slots the row's queries see at most
  blocks = (length + block_kv - 1) // block_kv
  per_split = (blocks + splits - 1) // splits
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, blocks)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32
  lanes = jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)

  def body(j, carry):
    m, l, acc = carry
    first, start = _block_address(b, j, table_ref, block_kv, page_size, num_pages)
    slots = j * block_kv + lanes                             # logical slots of the block
    inside = jnp.broadcast_to((slots < length)[:, None], (block_kv, d))
    window = (first, h, pl.ds(start, block_kv), slice(None))
    keys = plgpu.load(k_ref.at[window], mask=inside, other=0.0)
    values = plgpu.load(v_ref.at[window], mask=inside, other=0.0)
    scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * scale
    visible = slots[None, :] < limits[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)       # a row with nothing yet: no -inf - -inf
    probs = jnp.exp(scores - shift[:, None])
    alpha = jnp.exp(m - shift)
    l = l * alpha + jnp.sum(probs, axis=1)
    acc = acc * alpha[:, None] + jax.lax.dot_general(
        probs.astype(values.dtype), values, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
  if splits == 1:
    out_ref, lse_ref = out_refs
    some = l > 0
    safe = jnp.where(some, l, 1.0)
    out = jnp.where(some[:, None], acc / safe[:, None], 0.0).astype(out_ref.dtype)
    lse = jnp.where(some, m + jnp.log(safe), -jnp.inf)
    # Padding rows store their real row's value again: no mask (Pallas' interpreter would write
    # the old contents back through a masked-out duplicate address).
    plgpu.store(out_ref.at[gather], out)
    plgpu.store(lse_ref.at[lse_at], lse)
  else:
    m_ref, l_ref, acc_ref = out_refs
    m_ref[b, h, split, :] = m
    l_ref[b, h, split, :] = l
    acc_ref[b, h, split, :, :] = acc


def _combine(m, l, acc):
  """Partials m, l [B, K, splits, P] and acc [B, K, splits, P, D] -> (out [B, K, P, D], lse
  [B, K, P]) float32; zeros and -inf where no split saw a slot."""
  top = jnp.max(m, axis=2)
  shift = jnp.where(top == -jnp.inf, 0.0, top)
  weight = jnp.exp(m - shift[:, :, None])                    # 0 for an empty split
  total = jnp.sum(l * weight, axis=2)
  summed = jnp.sum(acc * weight[..., None], axis=2)
  some = total > 0
  safe = jnp.where(some, total, 1.0)
  out = jnp.where(some[..., None], summed / safe[..., None], 0.0)
  lse = jnp.where(some, shift + jnp.log(safe), -jnp.inf)
  return out, lse


def _combine_kernel(m_ref, l_ref, acc_ref, out_ref, lse_ref, *, groups: int, queries: int):
  """One (row b, kv head h, tile row p) instance joining the splits' partials m, l
  [B, K, splits, P] and acc [B, K, splits, P, D] (float32) of that tile row: weights
  ``exp(m_s - max_s m_s)`` (0 for an empty split), then out = Σ acc_s·w_s / Σ l_s·w_s rounded to
  out_ref's dtype and lse = max + log Σ l_s·w_s (zeros and -inf where no split saw a slot), stored
  at the row's (query, head) address; a padding row (p >= T·G) stores nothing. All splits are
  read at once (indices clipped into range, the rows past `splits` set to m = -inf)."""
  b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  splits, d = acc_ref.shape[2], acc_ref.shape[4]
  padded = 1 << max(splits - 1, 0).bit_length()
  split = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  real = split < splits
  index = jnp.minimum(split, splits - 1)
  scalar = lambda x: jnp.full((padded,), x, jnp.int32)
  m = jnp.where(real, m_ref[(scalar(b), scalar(h), index, scalar(p))], -jnp.inf)
  l = l_ref[(scalar(b), scalar(h), index, scalar(p))]
  tile = lambda x: jnp.broadcast_to(x[:, None], (padded, d))
  acc = acc_ref[(tile(scalar(b)), tile(scalar(h)), tile(index), tile(scalar(p)),
                 jax.lax.broadcasted_iota(jnp.int32, (padded, d), 1))]
  top = jnp.max(m)
  shift = jnp.where(top == -jnp.inf, 0.0, top)
  weight = jnp.exp(m - shift)                                   # 0 for an empty or padding split
  total = jnp.sum(l * weight)
  summed = jnp.sum(acc * weight[:, None], axis=0)               # [D]
  some = total > 0
  safe = jnp.where(some, total, 1.0)
  out = jnp.where(some, summed / safe, 0.0).astype(out_ref.dtype)
  lse = jnp.where(some, shift + jnp.log(safe), -jnp.inf)

  @pl.when(p < queries * groups)
  def _store():
    t, head = p // groups, h * groups + p % groups
    out_ref[b, t, head, :] = out
    lse_ref[b, t, head] = lse


def _combine_rows(m, l, acc, *, t: int, n: int, dtype, interpret: bool):
  """The splits' partials -> (out [B, T, N, D] in `dtype`, lse [B, T, N] float32) in one kernel
  (`_combine_kernel`), grid (B, K, P); `ragged_attention` takes it where B·K <=
  `COMBINE_KERNEL_MAX_ROWS` (the measurements: BENCHMARKS.md)."""
  b, heads, _, rows, d = acc.shape
  return pl.pallas_call(
      functools.partial(_combine_kernel, groups=n // heads, queries=t),
      grid=(b, heads, rows),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=[pl.no_block_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((b, t, n, d), dtype),
                 jax.ShapeDtypeStruct((b, t, n), jnp.float32)],
      compiler_params=_compiler_params(DEFAULT_WARPS, None),
      interpret=interpret,
      name="ragged_combine",
  )(m, l, acc)


def _compiler_params(num_warps, num_stages):
  params = {name: value for name, value in (("num_warps", num_warps),
                                             ("num_stages", num_stages)) if value}
  return plgpu.CompilerParams(**params) if params else None


@functools.partial(jax.jit, static_argnames=("block_kv", "splits", "num_warps", "num_stages",
                                             "interpret"))
def ragged_attention(q, k, v, limits, *, block_table=None, tokens=None, block_kv=None,
                     splits=None, num_warps=None, num_stages=None, interpret=False
                     ) -> tuple[jax.Array, jax.Array]:
  """[B, T, N, D] queries over head-major [B, K, S, D] keys/values, each up to its own limit.

  Args:
    q: [B, T, N, D]; query head h reads kv head ``h // (N // K)``.
    k, v: [B, K, S, D], the dtype of q (`precondition` lists the rest); with `block_table`, page
      pools [num_pages, K, page_size, D].
    limits: [B, T] int: query (b, t) sees cache slots ``s < limits[b, t]`` (clipped to 0..S;
      0 = nothing: zeros). Slots at or past ``max_t limits[b, t]`` are never read.
    block_table: None (a contiguous cache), or [B, M] int: logical slot s of row b lives in page
      ``block_table[b, s // page_size]`` at offset ``s mod page_size`` (S = M·page_size). Only
      the entries of pages holding slots below the row's longest limit are read; an entry outside
      0..num_pages-1 there is clipped into the pool (the caller checks tables:
      `dspark_jax.paging.cache.check_table`).
    tokens: None, or [B, T] int: the queries are packed, q [N', N, D] (N' tokens, each of one
      row), query (b, t) being token ``tokens[b, t]`` (outside 0..N'-1: none; its limit should
      be 0). The kernel reads each token's queries and writes its output where it lies, so no
      [B, T] layout of the queries is built (a packed verify, `models.target.TargetModel.packed`).
    block_kv: slots per KV block (default `default_block`); a power of two >= 16 dividing S
      (the page size, with a table).
    splits: instances per (row, kv head) sharing a row's blocks (default `default_splits`; 1
      where the queries are split into tiles, the only value allowed there).
    num_warps, num_stages: Triton compiler settings (None: `DEFAULT_WARPS` (`TILED_WARPS` with
      query tiles), `default_stages`).
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    ``(out, lse)``: out [B, T, N, D] in q.dtype, equal to `attention.attend_xla` with the mask
    ``slot < limits[b, t]``; lse [B, T, N] float32, the log-sum-exp of the scaled scores over the
    visible slots (-inf where none), so that a caller can join this softmax part with another.
    With `tokens`: out [N', N, D] and lse [N', N], token n's rows (unspecified for a token no
    (b, t) names).

  Raises:
    ValueError: naming the failed precondition.
  """
  paged = block_table is not None
  packed = tokens is not None
  dense = q
  if packed:
    if q.ndim != 3 or tokens.shape != limits.shape or not jnp.issubdtype(tokens.dtype,
                                                                        jnp.integer):
      raise ValueError(f"ragged_attention: packed queries must be [N', N, D] with integer tokens "
                       f"shaped as limits {limits.shape}; got q {q.shape}, tokens "
                       f"{tokens.shape} {tokens.dtype}")
    dense = jax.ShapeDtypeStruct((*limits.shape, *q.shape[1:]), q.dtype)
  block_kv = block_kv or default_block(dense, k, paged)
  failed = precondition(dense, k, v, block_kv=block_kv, block_table=block_table)
  if failed:
    raise ValueError(f"ragged_attention: precondition failed: {failed}")
  b, t, n, d = dense.shape
  heads = k.shape[1]
  slots = block_table.shape[1] * k.shape[2] if paged else k.shape[2]
  if limits.shape != (b, t):
    raise ValueError(f"ragged_attention: limits shape {limits.shape} is not [B, T] = {(b, t)}")
  groups = n // heads
  per_tile, tiles = query_tiling(t, groups)
  rows = query_rows(per_tile, groups)
  if tiles > 1 and splits not in (None, 1):
    raise ValueError(f"ragged_attention: splits={splits} with {tiles} query tiles (T={t} queries "
                     f"x G={groups} heads exceed {MAX_ROWS} rows); tiles take one split")
  splits = 1 if tiles > 1 else splits or default_splits(b, heads, slots, block_kv)
  num_warps = num_warps or (TILED_WARPS if tiles > 1 else DEFAULT_WARPS)
  num_stages = num_stages or default_stages(block_kv)
  if splits < 1:
    raise ValueError(f"ragged_attention: splits={splits} is not positive")
  kernel = functools.partial(_kernel, rows=rows, groups=groups, per_tile=per_tile,
                             block_kv=block_kv, splits=splits, scale=1.0 / math.sqrt(d),
                             paged=paged, packed=packed)
  count = q.shape[0]
  if splits == 1 and packed:                       # row N' takes what no token owns; cut below
    out_shape = [jax.ShapeDtypeStruct((count + 1, n, d), q.dtype),
                 jax.ShapeDtypeStruct((count + 1, n), jnp.float32)]
  elif splits == 1:
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, t, n), jnp.float32)]
  else:
    partial = jax.ShapeDtypeStruct((b, heads, splits, rows), jnp.float32)
    out_shape = [partial, partial, jax.ShapeDtypeStruct((b, heads, splits, rows, d), jnp.float32)]
  outs = pl.pallas_call(
      kernel,
      grid=(b, heads, splits if tiles == 1 else tiles),
      in_specs=[pl.no_block_spec] * (4 + paged + packed),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      compiler_params=_compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="ragged_attention",
  )(limits.astype(jnp.int32), *((block_table.astype(jnp.int32),) if paged else ()),
    *((tokens.astype(jnp.int32),) if packed else ()), q, k, v)
  if splits == 1:
    return (outs[0][:count], outs[1][:count]) if packed else tuple(outs)
  if b * heads <= COMBINE_KERNEL_MAX_ROWS:
    out, lse = _combine_rows(*outs, t=t, n=n, dtype=q.dtype, interpret=interpret)
  else:
    out, lse = _combine(*outs)
    # Query row p = t·G + g of kv head k's tile -> query t, head k·G + g.
    out = out[:, :, :t * groups].reshape(b, heads, t, groups, d)
    lse = lse[:, :, :t * groups].reshape(b, heads, t, groups)
    out = jnp.swapaxes(out, 1, 2).reshape(b, t, n, d).astype(q.dtype)
    lse = jnp.swapaxes(lse, 1, 2).reshape(b, t, n)
  if not packed:
    return out, lse
  token = tokens.astype(jnp.int32).reshape(-1)
  token = jnp.where((token >= 0) & (token < count), token, count)        # none: row N', cut
  return (jnp.zeros((count + 1, n, d), out.dtype).at[token].set(out.reshape(-1, n, d))[:count],
          jnp.full((count + 1, n), -jnp.inf, lse.dtype).at[token].set(lse.reshape(-1, n))[:count])
