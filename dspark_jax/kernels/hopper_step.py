"""Draft steps as Hopper kernels (Pallas' Mosaic GPU backend), for batches of 64 rows and more.

The Triton step kernel (`triton_step`) re-reads the Markov vectors ``v`` and, with several row
blocks, W2 from L2 with plain per-thread loads. These kernels are the other design:

* a fixed grid of `programs` instances (one per multiprocessor), each keeping all B rows of ``v``
  [B, r] in shared memory for the whole step (loaded once, by the tensor memory accelerator, TMA);
* each instance walks the vocabulary tiles p, p + P, ... in increasing order (odd steps of a
  block the same walk from the last tile down: they start on the tiles the step before left in
  L2), with `stages` TMA copies of the next tiles' W2 block [r, tile] and base logits [B, tile]
  in flight while it works on the current one;
* per tile: ``v @ W2`` on the tensor cores (WGMMA, float32 accumulator), ``+ U_k``, rounded to the
  logits dtype, then each row's (key, token) pair for the tile.

`greedy_partials` is the greedy-only step (64-column tiles): it keeps each row's pair as a running
best over the instance's tiles, so one pair per instance and row leaves the kernel ([P, B]), and XLA
reduces the P pairs (`tokens`). `sampling_partials` is the sampling variant's: 128-column tiles
(`sampling.vocab_tile`, the two-level sampler's) computed as 64-column parts, the corrected logits
written in place into a [B, γ, V] buffer through shared memory and TMA (a mutable ``jax.Ref``,
`new_corrected`), and every tile's key (a sampled row's the tile's log-mass, a greedy row's the
tile's max) stored tile-major, so that `token_kernels.draw_tokens` adds the tiles' noise, chooses
the tile and draws inside it, and finds a greedy row's first max in its chosen tile. With 128 rows
and more two warpgroups split the rows, running one copy of the code.

Preconditions (checked by `dspark_jax.kernels.dispatch` before either is chosen): a Hopper GPU (or
Mosaic GPU's CPU interpreter), bfloat16 W2 and logits, B a multiple of 64 (the tensor cores' row
block), r and V multiples of 64, and buffers that fit shared memory (`sampling_smem_bytes`). Both
read W2 as [r, V] or part by part (`w2_parts`: each 64-column part one run of memory).

Exactness: maxima are float maxima that a NaN wins, compared across tiles as integer keys (NaN
first, -0 = +0), so tokens follow the other backends' rules; ``v @ W2`` is summed in the tensor
cores' order, so a corrected logit can differ from XLA's in its last bit. A tile's log-mass is
summed in base 2 (`_tile_log_mass`) with the GPU's approximate ``ex2``, so it can differ from XLA's
in the last bits. The law is the same: the tokens are exact draws from the logits the kernel stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.sampling import sampler as sampling

ROW_BLOCK = 64  # rows of one WGMMA instruction
_NO_TOKEN = np.int32(np.iinfo(np.int32).max)
_LOG2_E = float(np.log2(np.e))  # exp(y) = 2^(y · log2(e))


def _interpret_params():
  # Mosaic GPU's CPU interpreter; its parameters are not exported by every jax version.
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _swizzled(width: int, itemsize: int, interpret: bool):
  """Shared-memory transforms for a [*, width] tile (none in the interpreter, which needs none)."""
  if interpret:
    return ()
  swizzle = plgpu.find_swizzle(width * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _grid(v, base_logits, tile, stages, programs, interpret):
  """Checks the shapes both kernels need; returns (tiles, instances, tiles per instance)."""
  rows = v.shape[0]
  batch, _, vocab = base_logits.shape
  if rows != batch or rows % ROW_BLOCK:
    raise ValueError(f"v: expected [{batch}, r] with the batch a multiple of {ROW_BLOCK}, "
                     f"got {v.shape}")
  if vocab % tile:
    raise ValueError(f"tile: {tile} does not divide V = {vocab}")
  if stages < 1:
    raise ValueError(f"stages: expected >= 1, got {stages}")
  tiles = vocab // tile
  if programs is None:
    programs = 4 if interpret else jax.devices()[0].core_count
  programs = min(programs, tiles)
  return tiles, programs, -(-tiles // programs)


def _next_slot(i, stages, per_program, fetch, in_barriers):
  """Starts tile ``i + stages - 1``'s copies (into the slot tile i - 1 used, which is done with
  it), then waits for tile i's: returns tile i's slot."""
  @pl.when(i + stages - 1 < per_program)
  def _():
    fetch(i + stages - 1)
  slot = lax.rem(i, stages)
  plgpu.barrier_wait(in_barriers.at[slot])
  return slot


def _rounded_sum(acc_ref, u_tile, dtype, interpret, later_products=0):
  """The accumulator's ``v @ W2`` plus the tile's U_k in shared memory, rounded to `dtype`:
  [B, tile] registers, once the product is done (`later_products` started after it may still
  run)."""
  acc = (acc_ref[...] if interpret else
         plgpu.wgmma_accumulator_load(acc_ref, wait_n=later_products))
  u = u_tile[...] if interpret else plgpu.load(u_tile, (), layout=plgpu.Layout.WGMMA)
  return (acc + u.astype(jnp.float32)).astype(dtype)


def _corrected_tile(acc_ref, v_smem, w2_tile, u_tile, dtype, interpret):
  """``v @ W2 + U`` for one tile on the tensor cores, rounded to `dtype`: [B, tile] registers."""
  plgpu.wgmma(acc_ref, v_smem, w2_tile)
  return _rounded_sum(acc_ref, u_tile, dtype, interpret)


def _row_max(x, interpret, axis=1):
  """Per row of float32 [B, tile] registers: the max, NaN if any is (``max.NaN.f32``). With
  ``axis=0`` the registers are [tile, B]."""
  best = jnp.max(x, axis=axis)
  if interpret:  # the interpreter's max is XLA's on the CPU, which skips NaN: the GPU's does not
    best = jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, best)
  return best


def _by_row(rows, shape, axis=1):
  """A per-row vector broadcast over [B, tile] registers (``axis=1``) or [tile, B] (``axis=0``)."""
  return lax.broadcast_in_dim(rows, shape, (1 - axis,))


def _part_pair(x, col0, interpret, argmax):
  """A part's per-row (max integer key, first column at it) (`_first_max`), or without `argmax`
  (max integer key, None): the token choice finds a greedy row's column in its chosen tile."""
  if argmax:
    return _first_max(x, col0, interpret)
  return fused_step.order_keys(_row_max(x, interpret)), None


def _first_max(x, col0, interpret, axis=1):
  """Per row of float32 [B, tile] registers (or [tile, B] with ``axis=0``): (max integer key,
  first column at it, from `col0`); NaN first and -0 = +0, as in `fused_step`.

  The max is a float max that a NaN wins (Mosaic GPU's is ``max.NaN.f32``), one instruction per
  element where `fused_step.order_keys` costs seven; only the rows' maxima become keys. Equal to
  a max is ``x == max`` (-0 and +0 alike) or, when the max is NaN, ``x`` NaN.
  """
  best = _row_max(x, interpret, axis)
  lanes = (lax.broadcasted_iota(jnp.int32, x.shape, axis) if interpret else
           plgpu.broadcasted_iota(jnp.int32, x.shape, axis, layout=plgpu.Layout.WGMMA))
  at_best = (x == _by_row(best, x.shape, axis)) | jnp.isnan(x)
  # Some column is at the max (a NaN max: a NaN column), so the min is a lane: col0 added per row.
  return (fused_step.order_keys(best),
          jnp.min(jnp.where(at_best, lanes, _NO_TOKEN), axis=axis) + col0)


def _tile_walk(program, programs, tiles, reverse):
  """Instance `program`'s i-th tile: p + i·P, in increasing order, or with `reverse` the same
  walk from the last tile down (V/c - 1 - p - i·P). Past the end it visits the last tile of its
  walk again (a pair another instance also holds; it keeps every loop static)."""
  if reverse:
    return lambda i: jnp.maximum(tiles - 1 - program - i * programs, 0)
  return lambda i: jnp.minimum(program + i * programs, tiles - 1)


def _best_over_tiles(per_program, tile_pair, reverse=False):
  """Each row's best (integer key, token) over the instance's tiles 0 .. per_program - 1, given
  `tile_pair(i)`: tiles come in column order, so a later tile wins only with a larger key and
  ties keep the earlier (smaller) token; with `reverse` they come in decreasing column order, and
  a later tile wins ties too (`reverse` is static: Mosaic GPU lowers no select of [B] rows by a
  traced scalar)."""
  def visit(i, carry):
    best, token = carry
    tile_key, tile_token = tile_pair(i)
    later_wins = (tile_key >= best) if reverse else (tile_key > best)
    return jnp.where(later_wins, tile_key, best), jnp.where(later_wins, tile_token, token)
  return lax.fori_loop(1, per_program, visit, tile_pair(0))


def _store_pairs(best, token, key_smem, token_smem, key_gmem, token_gmem, program):
  """Writes an instance's [B] pairs (keys as float32 values) to row `program` of the outputs."""
  key_smem[...] = fused_step.key_value(best)
  token_smem[...] = token
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(key_smem, key_gmem.at[program])
  plgpu.copy_smem_to_gmem(token_smem, token_gmem.at[program])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("step", "tile", "programs", "stages", "reverse",
                                             "interpret"))
def greedy_partials(v, w2, base_logits, *, step, tile=64, programs=None, stages=2, reverse=False,
                    interpret=False):
  """Per instance and row: the max and first argmax of step `step`'s corrected logits over the
  instance's vocabulary tiles.

  Instance p of the `programs` visits tiles p, p + P, ... (`tile` columns each) in increasing
  order (or, with `reverse`, the same walk from the last tile down: `_tile_walk`) and keeps, per
  row, the best (integer key, column) pair it has seen, the column the first of equal maxima
  (`_best_over_tiles`). One pair per
  instance and row leaves the kernel, [P, B], which XLA reduces cheaply (per-tile pairs, [V/64, B],
  would cost a reduction several times longer).

  Args:
    v: [B, r] the Markov vectors (cast to W2's dtype); B a multiple of 64.
    w2: [r, V] the head's second matrix, or with 64-column tiles [V / 64, r, 64] (`w2_parts`).
      base_logits: [B, γ, V] (slice `step` is read).
    step: static block position. tile: static vocabulary columns per tile (divides V).
    programs: static grid size (None: the device's multiprocessor count; 4 when interpreting).
    stages: static tiles whose TMA copies are in flight at once (shared memory per instance:
      B·r + stages·(r + B)·tile elements).
    reverse: static, walk the tiles from the last one down (odd steps of a serpentine block,
      whose first tiles are the ones the step before left in L2).
    interpret: run in Mosaic GPU's interpreter (CPU).

  Returns:
    ``(program_max [P, B] float32, program_argmax [P, B] int32)``, the argmax as a column of V,
    with P = min(programs, V / tile).
  """
  rows, rank = v.shape
  tiles, programs, per_program = _grid(v, base_logits, tile, stages, programs, interpret)
  _check_w2(w2, rank, base_logits.shape[2], tile)
  v = v.astype(w2.dtype)

  def kernel(v_gmem, w2_gmem, base_gmem, max_gmem, arg_gmem,
             v_smem, w2_smem, u_smem, max_smem, arg_smem, v_barrier, in_barriers):
    program = lax.axis_index("program")
    tile_of = _tile_walk(program, programs, tiles, reverse)

    def fetch(i):
      slot, cols = lax.rem(i, stages), pl.ds(tile_of(i) * tile, tile)
      plgpu.copy_gmem_to_smem(_w2_part(w2_gmem, tile_of(i) * tile, tile), w2_smem.at[slot],
                              in_barriers.at[slot])
      plgpu.copy_gmem_to_smem(base_gmem.at[:, step, cols], u_smem.at[slot], in_barriers.at[slot])

    def tile_best(i):
      """Tile i's (key, first column) per row, once its copies have landed."""
      slot = _next_slot(i, stages, per_program, fetch, in_barriers)

      def with_accumulator(acc_ref):
        logits = _corrected_tile(acc_ref, v_smem, w2_smem.at[slot], u_smem.at[slot],
                                 base_gmem.dtype, interpret)
        return _first_max(logits.astype(jnp.float32), tile_of(i) * tile, interpret)
      return pl.run_scoped(with_accumulator, plgpu.ACC((rows, tile), jnp.float32))

    plgpu.copy_gmem_to_smem(v_gmem, v_smem, v_barrier.at[0])
    for i in range(min(stages - 1, per_program)):
      fetch(i)
    plgpu.barrier_wait(v_barrier.at[0])
    best, first = _best_over_tiles(per_program, tile_best, reverse)
    _store_pairs(best, first, max_smem, arg_smem, max_gmem, arg_gmem, program)

  itemsize = jnp.dtype(w2.dtype).itemsize
  scratch = [
      plgpu.SMEM((rows, rank), w2.dtype, transforms=_swizzled(rank, itemsize, interpret)),
      plgpu.SMEM((stages, rank, tile), w2.dtype, transforms=_swizzled(tile, itemsize, interpret)),
      plgpu.SMEM((stages, rows, tile), base_logits.dtype,
                 transforms=_swizzled(tile, jnp.dtype(base_logits.dtype).itemsize, interpret)),
      plgpu.SMEM((rows,), jnp.float32), plgpu.SMEM((rows,), jnp.int32),
      plgpu.Barrier(num_arrivals=1, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  ]
  out_type = [jax.ShapeDtypeStruct((programs, rows), jnp.float32),
              jax.ShapeDtypeStruct((programs, rows), jnp.int32)]
  run = plgpu.kernel(kernel, out_type=out_type, grid=(programs,), grid_names=("program",),
                     scratch_types=scratch,
                     **({"interpret": _interpret_params()} if interpret else {}))
  return tuple(run(v, w2, base_logits))


def tokens(program_max, program_argmax):
  """[B] int32 greedy tokens from `greedy_partials`' [P, B] pairs: the first maximum, NaN first
  (`sampling.tokens_from_tile_choices` over the instances)."""
  return sampling.tokens_from_tile_choices(program_max.T, program_argmax.T)


SMEM_BYTES = 227 * 1024  # shared memory one instance may use on an H100 / H200
PART = 64  # columns per WGMMA of the sampling kernel: a sampler tile is 1 or 2 parts


def sampling_smem_bytes(batch: int, rank: int, stages: int, tiles_per_instance: int = 8,
                        itemsize: int = 2) -> int:
  """Shared memory `sampling_partials` needs: v, `stages` W2 and U_k parts, the rows'
  temperatures and greedy flags, and the instance's per-tile pairs, each buffer rounded up to 1 KB
  as Mosaic GPU places them, plus 1 KB for barriers."""
  buffers = [batch * rank * itemsize, stages * rank * PART * itemsize,
             stages * batch * PART * itemsize, batch * 4, batch * 4,
             tiles_per_instance * batch * 4, tiles_per_instance * batch * 4]
  return sum(-(-b // 1024) * 1024 for b in buffers) + 1024


def sampling_stages(batch: int, rank: int, tiles_per_instance: int = 8, itemsize: int = 2,
                    most: int = 4) -> int:
  """The most pipeline stages (up to `most`) whose shared memory fits (0: none does)."""
  fits = [n for n in range(1, most + 1)
          if sampling_smem_bytes(batch, rank, n, tiles_per_instance, itemsize) <= SMEM_BYTES]
  return max(fits, default=0)


def sampling_partials(v, w2, base_logits, corrected, temperature, greedy, *, step, programs=None,
                      stages=None, consumers=None, reread=False, reverse=False, overlap=None,
                      argmax=True, interpret=False):
  """One sampling-variant step: writes step `step`'s corrected logits into `corrected` and returns
  each vocabulary tile's (key, token) pair per row, as `fused_step.step_stats` without draws.

  The tiles are `sampling.vocab_tile(V)` columns wide (the two-level sampler's tiles, so a row's
  noise does not depend on the batch), each computed as `PART`-column parts: the pipeline stages
  hold parts, so that 128 rows and three stages fit shared memory. Per tile and row: a greedy
  row's key is the tile's max and its token the first argmax; a sampled row's key is the tile's
  log-mass ``logsumexp(x / T)`` (`sampling.tile_log_mass`, its sum taken part by part) and its
  token the tile's first column. `token_kernels.draw_tokens` (``tile_major=True``) then adds the
  tiles' noise, chooses and draws inside the chosen tile. A part's corrected logits are written
  back over its U_k part in shared memory and stored from there by TMA; an instance keeps its
  tiles' pairs in shared memory and stores them once at its end.

  One consumer warpgroup (`consumers` = 1) does all of an instance's work, one part after the other:
  at part n it waits for the previous part's store to have read its slot, refills that slot with
  part n + stages - 1 (W2 and U_k on one barrier) and waits for part n (with `overlap` it starts a
  tile's products together, so that the second runs during the first's epilogue). Two (`consumers` =
  2, B a multiple of 128) split the rows, 64 each, over shared W2 parts: a W2 slot is refilled once
  both have multiplied with it; each consumer has its own U_k slots, refilled after the part's store
  and the tile's statistics are done with them (the store just issued is not waited for), and its
  own stores. The epilogue (rounding, integer keys, exp) runs on 128 threads per consumer, so the
  second halves its per-thread work at B = 128.

  Args:
    v: [B, r] the Markov vectors (cast to W2's dtype); B a multiple of 64 that shared memory holds
      (`sampling_stages`: up to 128 rows at r = 256).
    w2: [r, V], or part by part [V / 64, r, 64] (`w2_parts`, faster).
      base_logits: [B, γ, V] (slice `step` is read).
    corrected: a ``jax.Ref`` [B, γ, V] of the logits' dtype in GPU global memory
      (`new_corrected`); slice `step` is written in place.
    temperature: [B] float32 (clamped). greedy: [B] int32, nonzero for greedy rows.
    step, programs, interpret: as in `greedy_partials`. stages: static parts whose copies are in
      flight at once (None: the most that fit, up to 4; two consumers need >= 2 and a tile's
      parts).
    consumers: static warpgroups splitting the rows, 1 or 2 (None: 2 where B is a multiple of
      128, except in the interpreter, whose threads can stall one another on a small host).
    reread: static, two consumers: the tile's exp sum reads the parts' rounded logits back from
      shared memory (else, the default, the first part's stay in registers while the second is
      computed: faster).
    reverse: static, walk the tiles from the last one down (`greedy_partials`); the pairs' rows
      then come in that order too.
    overlap: static, a tile's parts' products start together (two accumulators; `stages` >= the
      tile's parts + 1), so that the tensor cores work on the second during the first part's
      epilogue (None: with one consumer, where it was faster; with two it was slower).
    argmax: static, greedy rows' tokens are their tiles' first argmax (else the tile's first
      column, as a sampled row's: ``draw_tokens(greedy_in_tile=True)`` finds the first max in
      the chosen tile; the kernel then skips five instructions per element and stores no tokens).

  Returns:
    ``(tile_key [T, R] float32, tile_token [T, R] int32)``, tile-major, T = P · (tiles per
    instance) >= V / c, R = max(B, 64) (columns past B are padding, not to be read): row t < V / c
    is tile t (with `reverse`, tile V/c - 1 - t); the rows after it repeat the last tile (with
    `reverse`, tile 0). Without `argmax`, ``tile_token`` is None.
  """
  batch, rank = v.shape
  vocab = base_logits.shape[2]
  tile = sampling.vocab_tile(vocab)
  _check_w2(w2, rank, vocab, PART)
  if tile < PART:
    raise ValueError(f"base_logits: V = {vocab} has {tile}-column tiles; the kernel needs >= {PART}")
  itemsize = jnp.dtype(w2.dtype).itemsize
  tiles, programs, per_program = _grid(v, base_logits, tile, 1, programs, interpret)
  rows = batch
  if stages is None:
    stages = max(sampling_stages(rows, rank, per_program, itemsize), 1)
  if stages < 1:
    raise ValueError(f"stages: expected >= 1, got {stages}")
  if consumers is None:
    consumers = 2 if batch % (2 * ROW_BLOCK) == 0 and not interpret else 1
  if consumers not in (1, 2) or (consumers == 2 and batch % (2 * ROW_BLOCK)):
    raise ValueError(f"consumers: expected 1, or 2 with B a multiple of {2 * ROW_BLOCK}, got "
                     f"{consumers} for B = {batch}")
  need = sampling_smem_bytes(rows, rank, stages, per_program, itemsize)
  if need > SMEM_BYTES:
    raise ValueError(f"v: {batch} rows with r = {rank} and {stages} stages need {need} bytes of "
                     f"shared memory, more than {SMEM_BYTES}")
  parts = tile // PART
  if consumers == 2 and stages < max(parts, 2):  # a slot is refilled after the next part's store
    raise ValueError(f"stages: two consumers need >= {max(parts, 2)} for {tile}-column tiles, "
                     f"got {stages}")
  if overlap is None:  # measured: faster with one consumer, slower with two
    overlap = consumers == 1 and stages >= parts + 1
  if overlap and stages < parts + 1:  # a tile's parts all in shared memory, the next one coming
    raise ValueError(f"stages: overlap needs >= {parts + 1} for {tile}-column tiles, got {stages}")
  geometry = dict(rows=rows, tile=tile, parts=parts, tiles=tiles, programs=programs,
                  per_program=per_program, stages=stages, step=step, reverse=reverse,
                  interpret=interpret, overlap=overlap, argmax=argmax,
                  row_layout=None if interpret else plgpu.Layout.WGMMA.reduce(1))
  if consumers == 1:
    kernel, barriers = _one_consumer(batch=batch, **geometry)
  else:
    kernel, barriers = _two_consumers(reread=reread, **geometry)
  scratch = _sampling_scratch(rows, rank, stages, per_program, consumers, w2.dtype,
                              base_logits.dtype, interpret) + barriers
  # Instance p's i-th tile is tile p + i·P: row (i, p) of the pairs, stored in one copy per
  # consumer, and row i·P + p once reshaped.
  out_type = [jax.ShapeDtypeStruct((per_program, programs, rows), jnp.float32),
              jax.ShapeDtypeStruct((per_program, programs, rows), jnp.int32)]
  threads = {"num_threads": consumers, "thread_name": "consumer"} if consumers > 1 else {}

  def body(corrected_ref, *refs):  # scratch as in plgpu.kernel, which takes no refs
    pl.run_scoped(functools.partial(kernel, corrected_ref, *refs), *scratch,
                  collective_axes="consumer" if consumers > 1 else ())

  run = pl.kernel(body, out_type=out_type,
                  mesh=plgpu.Mesh(grid=(programs,), grid_names=("program",), **threads),
                  **({"interpret": _interpret_params()} if interpret else {}))
  keys, tokens = run(corrected, v.astype(w2.dtype), w2, base_logits,
                     temperature.astype(jnp.float32), greedy.astype(jnp.int32))
  return keys.reshape(-1, rows), tokens.reshape(-1, rows) if argmax else None


def _sampling_scratch(rows, rank, stages, per_program, consumers, w2_dtype, logits_dtype,
                      interpret):
  """The sampling kernels' shared memory, each consumer's buffers on a leading axis of size
  `consumers` (index ``c``), the W2 parts shared; a barrier for v, temperatures and greedy flags."""
  share, itemsize = rows // consumers, jnp.dtype(w2_dtype).itemsize
  mine = lambda *shape: (consumers, *shape)
  return [
      plgpu.SMEM(mine(share, rank), w2_dtype, transforms=_swizzled(rank, itemsize, interpret)),
      plgpu.SMEM(mine(share), jnp.float32), plgpu.SMEM(mine(share), jnp.int32),
      plgpu.SMEM((stages, rank, PART), w2_dtype, transforms=_swizzled(PART, itemsize, interpret)),
      plgpu.SMEM(mine(stages, share, PART), logits_dtype,
                 transforms=_swizzled(PART, jnp.dtype(logits_dtype).itemsize, interpret)),
      plgpu.SMEM(mine(per_program, share), jnp.float32),
      plgpu.SMEM(mine(per_program, share), jnp.int32),
      plgpu.Barrier(num_arrivals=3 * consumers, num_barriers=1),
  ]


def w2_parts(w2):
  """W2 [r, V] stored part by part: [V / 64, r, 64], each 64-column part (`PART`) one contiguous
  32 KB block at r = 256 where [r, V] spreads it over r rows 2·V bytes apart. Both kernels take
  either form; from parts the copies read DRAM in long runs (faster).
  `pallas_block.prepare_head_arrays` adds it to a head's arrays."""
  rank, vocab = w2.shape
  if vocab % PART:
    raise ValueError(f"w2: V = {vocab} is not a multiple of {PART}")
  return w2.reshape(rank, vocab // PART, PART).transpose(1, 0, 2)


def _check_w2(w2, rank, vocab, width):
  """W2 as a kernel whose copies take `width` columns takes it: [r, V], or part by part
  (`w2_parts`) where `width` is `PART`."""
  parts = (vocab // PART, rank, PART)
  if w2.shape == (rank, vocab) or (w2.shape == parts and width == PART):
    return
  also = f" or {list(parts)} (`w2_parts`)" if width == PART else f" ({width}-column copies)"
  raise ValueError(f"w2: expected [{rank}, {vocab}]{also}, got {list(w2.shape)}")


def _w2_part(w2_gmem, column0, width=PART):
  """W2's columns `column0` .. `column0` + `width` as [r, width]: a slice of [r, V], or with W2
  part by part (`w2_parts`; `width` = `PART`) one block."""
  if len(w2_gmem.shape) == 3:
    return w2_gmem.at[column0 // PART]
  return w2_gmem.at[:, pl.ds(column0, width)]


def _load_rows(ref, row_layout, interpret):
  """A [rows] vector in the layout of a row reduction of the accumulator."""
  return ref[...] if interpret else plgpu.load(ref, (), layout=row_layout)


def _tile_log_mass(xs, tile_max, temp, axis=1):
  """`sampling.tile_log_mass` of a tile from its parts' float32 logits `xs` and its max m, the sum
  taken part by part and in base 2: ``exp((x - m) / T) = 2^((x - m) · log2(e) / T)``, a subtraction,
  a multiply by a per-row constant and ``ex2`` per element, where the division and ``exp`` cost
  several instructions more (the max's own term is still exactly 1).
  ``axis=0``: the parts are [tile, B]."""
  shift = jnp.where(jnp.abs(tile_max) < jnp.inf, tile_max, 0.0)  # isfinite
  scale = _LOG2_E / temp
  mass = sum(jnp.sum(jnp.exp2((x - _by_row(shift, x.shape, axis))
                              * _by_row(scale, x.shape, axis)), axis=axis)
             for x in xs)
  return shift / temp + jnp.log(mass)


def _first_of_parts(pairs):
  """A tile's (max key, first column) from its parts' pairs in column order (ties: the earlier);
  (max key, None) from `_part_pair`'s pairs without columns."""
  best, first = pairs[0]
  for part_best, part_first in pairs[1:]:
    if first is None:
      best = jnp.maximum(best, part_best)
      continue
    later = part_best > best
    best, first = jnp.where(later, part_best, best), jnp.where(later, part_first, first)
  return best, first


def _tile_pair(pairs, xs, col0, temp, greedy_rows):
  """A tile's (key, token) per row from its parts' pairs and float32 logits (`xs()`): a greedy
  row's (max, first argmax), a sampled row's (log-mass, first column); (key, None) when the
  pairs have no columns (`_part_pair`: every row's token is then the tile's first column)."""
  best, first = _first_of_parts(pairs)
  tile_max = fused_step.key_value(best)
  greedy_row = greedy_rows != 0
  key = jnp.where(greedy_row, tile_max, _tile_log_mass(xs(), tile_max, temp))
  if first is None:  # no tokens: each row's is the tile's first column
    return key, None
  return key, jnp.where(greedy_row, first, col0)


def _visit_tiles(per_program, tile_pair, key_stage, token_stage):
  """Writes `tile_pair(i)` for the instance's tiles i = 0 .. per_program - 1 to row i of the
  shared-memory staging buffers, made visible to the TMA copies that store them (the caller's)."""
  def visit(i, carry):
    key, token = tile_pair(i)
    key_stage.at[i][...] = key
    if token is not None:
      token_stage.at[i][...] = token
    return carry
  lax.fori_loop(0, per_program, visit, 0)
  plgpu.commit_smem()


def _one_consumer(*, batch, rows, tile, parts, tiles, programs, per_program, stages, step, reverse,
                  interpret, row_layout, overlap, argmax):
  """`sampling_partials`' kernel for one warpgroup, and its barriers. A `batch` below the kernel's
  `rows` (64) fills and stores only the first `batch` rows of its shared-memory buffers: the
  others hold whatever they held, and their pairs are never read."""
  filled = (lambda ref: ref) if batch == rows else (lambda ref: ref.at[pl.ds(0, batch)])

  def kernel(corrected_gmem, v_gmem, w2_gmem, base_gmem, temp_gmem, greedy_gmem, key_gmem,
             token_gmem, v_smem, temp_smem, greedy_smem, w2_smem, u_smem, key_stage, token_stage,
             v_barrier, in_barriers):
    program = lax.axis_index("program")
    tile_of = _tile_walk(program, programs, tiles, reverse)
    start = lambda n: tile_of(n // parts) * tile + lax.rem(n, parts) * PART
    columns = lambda n: pl.ds(start(n), PART)

    def fetch(n):  # part n of the instance's parts, into slot n % stages
      slot = lax.rem(n, stages)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's logits are stored from it
      plgpu.copy_gmem_to_smem(_w2_part(w2_gmem, start(n)), w2_smem.at[slot],
                              in_barriers.at[slot])
      plgpu.copy_gmem_to_smem(base_gmem.at[:, step, columns(n)], filled(u_smem.at[0, slot]),
                              in_barriers.at[slot])

    total = per_program * parts

    def start_product(n, acc_ref, refill):
      """Waits for part n's copies (with `refill`, first starts part n + stages - 1's, into the
      slot part n - 1 used) and starts its ``v @ W2`` on the tensor cores."""
      if refill:
        slot = _next_slot(n, stages, total, fetch, in_barriers)
      else:
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(in_barriers.at[slot])
      plgpu.wgmma(acc_ref, v_smem.at[0], w2_smem.at[slot])

    def finish_part(n, acc_ref, later_products):
      """Part n's corrected logits, [B, PART] float32, once its product is done (`later_products`
      started after it may still run); they are written over the U_k part and stored."""
      u_part = u_smem.at[0, lax.rem(n, stages)]
      logits = _rounded_sum(acc_ref, u_part, base_gmem.dtype, interpret, later_products)
      u_part[...] = logits  # over the U_k part, which is in registers now
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(filled(u_part), corrected_gmem.at[:, step, columns(n)])
      return logits.astype(jnp.float32)

    def tile_logits(i):
      """The tile's parts' logits. With `overlap` every part's product is started first (the
      later parts' copies were started a tile before), so that the next product runs on the
      tensor cores while a part's epilogue runs; the slot a part leaves is refilled after it."""
      def run(accs):
        xs = []
        for h in range(parts):
          n = i * parts + h
          if not overlap:
            start_product(n, accs[h], refill=True)
          elif h == 0:
            for later in range(parts):
              start_product(n + later, accs[later], refill=later == 0)
          xs.append(finish_part(n, accs[h], parts - 1 - h if overlap else 0))
          if overlap and h + 1 < parts:
            @pl.when(n + stages < total)
            def _():
              fetch(n + stages)  # into part n's slot
        return xs
      return pl.run_scoped(lambda *accs: run(accs),
                           *[plgpu.ACC((rows, PART), jnp.float32)] * parts)

    def tile_pair(i, temp, greedy_rows):
      xs = tile_logits(i)
      pairs = [_part_pair(x, tile_of(i) * tile + h * PART, interpret, argmax)
               for h, x in enumerate(xs)]
      return _tile_pair(pairs, lambda: xs, tile_of(i) * tile, temp, greedy_rows)

    plgpu.copy_gmem_to_smem(v_gmem, filled(v_smem.at[0]), v_barrier.at[0])
    plgpu.copy_gmem_to_smem(temp_gmem, temp_smem.at[0], v_barrier.at[0])
    plgpu.copy_gmem_to_smem(greedy_gmem, greedy_smem.at[0], v_barrier.at[0])
    for n in range(min(stages - 1, per_program * parts)):
      fetch(n)
    plgpu.barrier_wait(v_barrier.at[0])
    temp = _load_rows(temp_smem.at[0], row_layout, interpret)
    greedy_rows = _load_rows(greedy_smem.at[0], row_layout, interpret)
    _visit_tiles(per_program, lambda i: tile_pair(i, temp, greedy_rows), key_stage.at[0],
                 token_stage.at[0])
    plgpu.copy_smem_to_gmem(key_stage.at[0], key_gmem.at[:, program])
    if argmax:
      plgpu.copy_smem_to_gmem(token_stage.at[0], token_gmem.at[:, program])
    plgpu.wait_smem_to_gmem(0)

  return kernel, [plgpu.Barrier(num_arrivals=2, num_barriers=stages)]


def _two_consumers(*, rows, tile, parts, tiles, programs, per_program, stages, step, reverse,
                   interpret, row_layout, reread, overlap, argmax):
  """`sampling_partials`' kernel for two warpgroups splitting the rows, and its barriers.

  Both warpgroups run one copy of the code, with their index ``c`` a traced value: each has its
  own buffers on a leading axis of the shared-memory scratch (`_sampling_scratch`), and only
  consumer 0 refills the W2 slots. (A copy of the code per consumer, as before, doubled the
  kernel's code: warps then spent much of their time waiting for instructions.)
  """
  total = per_program * parts  # parts an instance visits
  share = rows // 2            # rows per consumer

  def kernel(corrected_gmem, v_gmem, w2_gmem, base_gmem, temp_gmem, greedy_gmem, key_gmem,
             token_gmem, v_smem, temp_smem, greedy_smem, w2_smem, u_smem, key_stage, token_stage,
             v_barrier, w2_barriers, u_barriers, w2_free):
    program = lax.axis_index("program")
    c = lax.axis_index("consumer")
    mine = pl.ds(c * share, share)  # the consumer's rows of the global arrays
    tile_of = _tile_walk(program, programs, tiles, reverse)
    start = lambda n: tile_of(n // parts) * tile + lax.rem(n, parts) * PART
    columns = lambda n: pl.ds(start(n), PART)

    def fetch_w2(n):  # part n's W2 columns, into slot n % stages
      slot = lax.rem(n, stages)
      plgpu.copy_gmem_to_smem(_w2_part(w2_gmem, start(n)), w2_smem.at[slot],
                              w2_barriers.at[slot])

    def fetch_u(n):  # the consumer's rows of part n's U_k
      slot = lax.rem(n, stages)
      plgpu.copy_gmem_to_smem(base_gmem.at[mine, step, columns(n)], u_smem.at[c, slot],
                              u_barriers.at[c * stages + slot])

    def load_part(ref):  # [share, PART] of the logits' dtype, in the accumulator's layout
      return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

    def refill_u(m):
      """Part m's U_k slot takes part m + stages: all stores but the last issued have read."""
      @pl.when(m + stages < total)
      def _():
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        fetch_u(m + stages)

    def start_product(n, acc_ref):
      """Waits for part n's copies and starts its ``v @ W2`` on the tensor cores."""
      slot = lax.rem(n, stages)
      plgpu.barrier_wait(w2_barriers.at[slot])
      plgpu.barrier_wait(u_barriers.at[c * stages + slot])
      plgpu.wgmma(acc_ref, v_smem.at[c], w2_smem.at[slot])

    def finish_part(n, col0, acc_ref, later_products):
      """Part n's (max key, first column) per row and float32 logits, once its product is done
      (`later_products` products started after it may still run); the logits are written over
      the U_k part and their store issued."""
      slot = lax.rem(n, stages)
      acc = (acc_ref[...] if interpret else  # the product is done: its W2 slot is free
             plgpu.wgmma_accumulator_load(acc_ref, wait_n=later_products))
      plgpu.barrier_arrive(w2_free.at[slot])

      # Consumer 0 refills the part before's W2 slot, which both are (nearly) done with.
      @pl.when((c == 0) & (n >= 1) & (n - 1 + stages < total))
      def _():
        plgpu.barrier_wait(w2_free.at[lax.rem(n - 1, stages)])
        fetch_w2(n - 1 + stages)
      u_part = u_smem.at[c, slot]
      logits = (acc + load_part(u_part).astype(jnp.float32)).astype(base_gmem.dtype)
      u_part[...] = logits  # over the U_k part, which is in registers now
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(u_part, corrected_gmem.at[mine, step, columns(n)])
      x = logits.astype(jnp.float32)
      return _part_pair(x, col0, interpret, argmax) + (x,)

    def tile_parts(i):
      """The tile's parts, `finish_part`'s results; with `overlap` every part's product is
      started first, so that the next one runs on the tensor cores while a part's epilogue runs."""
      def run(accs):
        if overlap:
          for h in range(parts):
            start_product(i * parts + h, accs[h])
        results = []
        for h in range(parts):
          n = i * parts + h
          if not overlap:
            start_product(n, accs[h])
          results.append(finish_part(n, tile_of(i) * tile + h * PART, accs[h],
                                     parts - 1 - h if overlap else 0))
          if h == 0:
            @pl.when(i >= 1)  # the tile before's last part: its slot is done with
            def _():
              refill_u(n - 1)
        return results
      return pl.run_scoped(lambda *accs: run(accs),
                           *[plgpu.ACC((share, PART), jnp.float32)] * parts)

    def tile_pair(i, temp, greedy_rows):
      xs, pairs = [], []
      for part_best, part_first, x in tile_parts(i):
        pairs.append((part_best, part_first))
        xs.append(x)

      def logits():
        if not reread:
          return xs
        return [load_part(u_smem.at[c, lax.rem(i * parts + h, stages)]).astype(jnp.float32)
                for h in range(parts)]  # the rounded logits, in shared memory over U_k
      pair = _tile_pair(pairs, logits, tile_of(i) * tile, temp, greedy_rows)
      for h in range(parts - 1):  # the tile's other parts' slots are done with
        refill_u(i * parts + h)
      return pair

    @pl.when(c == 0)
    def _():
      for half in range(2):
        rows_of = pl.ds(half * share, share)
        plgpu.copy_gmem_to_smem(v_gmem.at[rows_of], v_smem.at[half], v_barrier.at[0])
        plgpu.copy_gmem_to_smem(temp_gmem.at[rows_of], temp_smem.at[half], v_barrier.at[0])
        plgpu.copy_gmem_to_smem(greedy_gmem.at[rows_of], greedy_smem.at[half], v_barrier.at[0])
      for n in range(min(stages, total)):
        fetch_w2(n)
    for n in range(min(stages, total)):
      fetch_u(n)
    plgpu.barrier_wait(v_barrier.at[0])
    temp = _load_rows(temp_smem.at[c], row_layout, interpret)
    greedy_rows = _load_rows(greedy_smem.at[c], row_layout, interpret)
    _visit_tiles(per_program, lambda i: tile_pair(i, temp, greedy_rows), key_stage.at[c],
                 token_stage.at[c])

    @pl.when(c == 0)
    def _():  # observe the W2 slots' last releases, which no refill waited for
      for m in range(max(total - stages, 0), total):
        plgpu.barrier_wait(w2_free.at[m % stages])
    plgpu.copy_smem_to_gmem(key_stage.at[c], key_gmem.at[:, program, mine])
    if argmax:
      plgpu.copy_smem_to_gmem(token_stage.at[c], token_gmem.at[:, program, mine])
    plgpu.wait_smem_to_gmem(0)

  return kernel, [plgpu.Barrier(num_arrivals=1, num_barriers=stages),       # W2 parts
                  plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),   # U_k parts
                  plgpu.Barrier(num_arrivals=2, num_barriers=stages)]       # W2 slots used


def new_corrected(shape, dtype):
  """An uninitialised [B, γ, V] buffer in GPU global memory for `sampling_partials` to fill in
  place (on the CPU, zeros), as a ``jax.Ref``; ``jax.freeze`` it once the block is done."""
  return jax.new_ref(lax.empty(shape, dtype), memory_space=plgpu.GMEM)
