"""A small batch's whole sampling block as one persistent Hopper kernel (experimental, slow).

`scripts/resident_probe.py` (BENCHMARKS.md, issue 6, version 38) measured that one instance per
multiprocessor running all γ steps on the same W2 parts streams W2 in 0.84-0.90× its DRAM floor (L2
serves most of it), where one kernel per step streams it in ~1.06×. Below 64 rows W2 is nearly all
of a step's bytes, so this kernel runs a vanilla head's whole sampling block that way:

* the rows padded to 64 in shared memory (`hopper_step.ROW_BLOCK`), B a multiple of 8;
* each instance walks the same 128-column tiles at every step (odd steps backwards), each as two
  64-column parts through a ring of `stages` TMA copies (W2 part by part and the U_k part) that
  runs on from one step into the next;
* per tile the corrected logits are stored, and each row's pair is formed with the tile's own draw
  (`fused_step`'s per-tile draws): a greedy row's (max, first argmax), a sampled row's (log-mass
  plus the tile's Gumbel draw, argmax of ``x / T`` plus the column noise);
* at a step's end every instance publishes its rows' best pair, waits at a grid-wide barrier
  (global semaphores), reduces all instances' pairs to the tokens, gathers their ``W1`` rows by TMA
  and makes them the next step's vectors.

Its tokens are `sampling.tokens_from_tile_stats`' for the same noise (a tile's log-mass is summed
in base 2 here, as in `hopper_step`). The CPU interpreter runs it with one instance (the barrier,
whose semaphores the interpreter lacks, is then not needed).

On an H200 (BENCHMARKS.md, issue 6, version 39) its tokens and logits equal the default path's, but
it takes 515 / 599 µs at B = 8 (V = 129280 / 151936), 3.3× the Triton chain: the per-tile draws
run on all 64 padded rows on one warpgroup (~320 µs of the 515), two ring stages leave the copies
exposed (150 µs with neither draws nor token round trips), and the round trips cost 7–13 µs a step.
It stays opt-in, for the record and as the base of a kernel that would transpose the product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax import fused_step
from dspark_jax import hopper_step
from dspark_jax import sampling

ROWS = hopper_step.ROW_BLOCK  # the rows the kernel computes
PART = hopper_step.PART
GPU_PROGRAMS = 128  # instances on a GPU: the pairs' reduction reads [128, 64] without masking


def grid_barrier(arrive, programs, passes):
  """All `programs` instances reach this point before any leaves it: each adds 1 to `arrive` and
  waits until it holds ``programs · passes`` (this barrier's 1-based count in the call); then the
  warpgroup waits for its one thread that spun."""
  plgpu.semaphore_signal(arrive, 1, memory_scope="gpu")
  plgpu.semaphore_wait(arrive, programs * passes, decrement=False, memory_scope="gpu")
  plgpu.commit_smem()


def reset_barrier(arrive, done, program, programs, passes):
  """Leaves both semaphores at 0 for the next call, once every instance passed the last barrier."""
  plgpu.semaphore_signal(done, 1, memory_scope="gpu")

  @pl.when(program == 0)
  def _():
    plgpu.semaphore_wait(done, programs, decrement=False, memory_scope="gpu")
    plgpu.semaphore_signal(arrive, -programs * passes, memory_scope="gpu")
    plgpu.semaphore_signal(done, -programs, memory_scope="gpu")


@functools.partial(jax.jit, static_argnames=("programs", "stages", "interpret"))
def block_tokens(anchor, w1, w2, base_logits, temperature, noise, *, greedy, programs=None,
                 stages=2, interpret=False):
  """All γ draft tokens of a vanilla head's sampling block, and the corrected logits.

  Args:
    anchor: [B] int x_0 of each row; B a multiple of 8, at most 64.
    w1: [V, r] and w2: [r, V] or part by part [V/64, r, 64] (`hopper_step.w2_parts`).
    base_logits: [B, γ, V] the backbone's logits (bf16 on a GPU).
    temperature: [B] float32 clamped draft temperatures. greedy: [B] bool or int (nonzero: greedy).
    noise: [γ, B, V/c + c] float32 `sampling.tile_noise` of the rows' keys at each step.
    programs: static instances (None: 128 on a GPU, 1 when interpreting); on a GPU a multiple of
      64, all resident at once (one per multiprocessor).
    stages: static parts whose copies are in flight at once.
    interpret: Mosaic GPU's CPU interpreter (one instance).

  Returns:
    ``(tokens [B, γ] int32, corrected [B, γ, V])``.
  """
  batch, gamma, vocab = base_logits.shape
  rank = w1.shape[1]
  tile = sampling.vocab_tile(vocab)
  if batch % hopper_step.PAD_ROWS or not 0 < batch <= ROWS:
    raise ValueError(f"base_logits: expected a batch that is a multiple of "
                     f"{hopper_step.PAD_ROWS} up to {ROWS}, got {batch}")
  if tile != 2 * PART:
    raise ValueError(f"base_logits: V = {vocab} has {tile}-column tiles; the kernel needs "
                     f"{2 * PART}")
  hopper_step._check_w2(w2, rank, vocab, PART)
  programs = 1 if interpret else (programs or GPU_PROGRAMS)
  if not interpret and programs % ROWS:
    raise ValueError(f"programs: expected a multiple of {ROWS} on a GPU, got {programs}")
  tiles = vocab // tile
  per_program = -(-tiles // programs)
  per_step = per_program * 2  # parts an instance visits per step
  total = gamma * per_step
  dtype = base_logits.dtype

  # Once per block, in XLA: the first vectors, the row inputs padded to 64 rows (a copy moves a
  # multiple of 128 bytes), the tiles' noise tile-major and padded, the column noise per step.
  v0 = jnp.take(w1, anchor.astype(jnp.int32), axis=0).astype(w2.dtype)
  pad = lambda x, value: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, ROWS - batch)],
                                 constant_values=value)
  temp = pad(temperature.astype(jnp.float32), 1.0)
  greedy_rows = pad((greedy != 0).astype(jnp.int32), 1)
  outer = pad(jnp.swapaxes(noise[:, :, :tiles], 1, 2), 0.0)   # [γ, V/c, 64]
  inner = noise[:, :, tiles:]                                  # [γ, B, c]

  def kernel(v0_gmem, w1_gmem, w2_gmem, base_gmem, temp_gmem, greedy_gmem, outer_gmem, inner_gmem,
             tokens_gmem, corrected_gmem, pair_keys, pair_tokens, v_copy,
             v_smem, w2_smem, u_smem, inner_smem, outer_smem, temp_smem, greedy_smem, key_stage,
             token_stage, keys_smem, tokens_smem, rows_smem,
             setup_barrier, ring_barriers, noise_barrier, pairs_barrier, rows_barrier, v_barrier):
    program = lax.axis_index("program")
    filled = lambda ref: ref if batch == ROWS else ref.at[pl.ds(0, batch)]
    if not interpret:
      arrive = pl.get_global(plgpu.SemaphoreType.REGULAR)
      done = pl.get_global(plgpu.SemaphoreType.REGULAR)

    forward = hopper_step._tile_walk(program, programs, tiles, False)
    backward = hopper_step._tile_walk(program, programs, tiles, True)

    def tile_of(k, i):  # instance `program`'s i-th tile at step k: odd steps walk backwards
      return jnp.where(lax.rem(k, 2) == 1, backward(i), forward(i))

    def start(t):  # the first column of the instance's t-th part of the block
      k, n = t // per_step, lax.rem(t, per_step)
      return tile_of(k, n // 2) * tile + lax.rem(n, 2) * PART

    def fetch(t):  # part t's W2 and U_k parts, into slot t % stages
      slot = lax.rem(t, stages)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's logits are stored from it
      plgpu.copy_gmem_to_smem(hopper_step._w2_part(w2_gmem, start(t)), w2_smem.at[slot],
                              ring_barriers.at[slot])
      plgpu.copy_gmem_to_smem(base_gmem.at[:, t // per_step, pl.ds(start(t), PART)],
                              filled(u_smem.at[slot]), ring_barriers.at[slot])

    def fetch_noise(k):  # step k's column noise (two parts) and its tiles' noise
      for h in range(2):
        plgpu.copy_gmem_to_smem(inner_gmem.at[k, :, pl.ds(h * PART, PART)],
                                filled(inner_smem.at[h]), noise_barrier.at[0])
      for i in range(per_program):
        plgpu.copy_gmem_to_smem(outer_gmem.at[k, tile_of(k, i)], outer_smem.at[i],
                                noise_barrier.at[0])

    def load(ref, layout):
      return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    row_layout = None if interpret else plgpu.Layout.WGMMA.reduce(1)
    wgmma_layout = None if interpret else plgpu.Layout.WGMMA
    by_row = lambda x, shape: lax.broadcast_in_dim(x, shape, (0,))

    def part_logits(t):
      """Part t's corrected logits, [64, 64] float32: written over its U_k part and stored."""
      slot = hopper_step._next_slot(t, stages, total, fetch, ring_barriers)

      def with_accumulator(acc_ref):
        plgpu.wgmma(acc_ref, v_smem, w2_smem.at[slot])
        u_part = u_smem.at[slot]
        logits = hopper_step._rounded_sum(acc_ref, u_part, dtype, interpret)
        u_part[...] = logits
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(filled(u_part),
                                corrected_gmem.at[:, t // per_step, pl.ds(start(t), PART)])
        return logits.astype(jnp.float32)
      return pl.run_scoped(with_accumulator, plgpu.ACC((ROWS, PART), jnp.float32))

    def tile_pair(k, i, temp, greedy_row):
      """Tile i's (integer key, token) per row at step k, with the tile's own draw."""
      xs, pairs = [], []
      for h in range(2):
        x = part_logits((k * per_program + i) * 2 + h)
        column_noise = load(inner_smem.at[h], wgmma_layout)
        scores = jnp.where(by_row(greedy_row, x.shape) != 0, x,
                           x / by_row(temp, x.shape) + column_noise)
        pairs.append(hopper_step._first_max(scores, tile_of(k, i) * tile + h * PART, interpret))
        xs.append(x)
      best_score, token = hopper_step._first_of_parts(pairs)
      tile_max = jnp.maximum(hopper_step._row_max(xs[0], interpret),
                             hopper_step._row_max(xs[1], interpret))
      draw = hopper_step._tile_log_mass(xs, tile_max, temp) + load(outer_smem.at[i], row_layout)
      key = jnp.where(greedy_row != 0, fused_step.key_value(best_score), draw)
      return fused_step.order_keys(key), token

    def choose(k):
      """Every instance's pairs of step k reduced to each row's token, in `token_stage`."""
      plgpu.copy_gmem_to_smem(pair_keys.at[k], keys_smem, pairs_barrier.at[0])
      plgpu.copy_gmem_to_smem(pair_tokens.at[k], tokens_smem, pairs_barrier.at[0])
      plgpu.barrier_wait(pairs_barrier.at[0])
      keys = fused_step.order_keys(load(keys_smem, wgmma_layout))
      tokens = load(tokens_smem, wgmma_layout)
      best = jnp.max(keys, axis=0)
      at_best = keys == lax.broadcast_in_dim(best, keys.shape, (1,))
      token_stage[...] = jnp.min(jnp.where(at_best, tokens, hopper_step._NO_TOKEN), axis=0)
      plgpu.commit_smem()

    def next_vectors():
      """The rows' ``W1[token]`` as the next step's v, through the instance's copy in GMEM (a
      one-row copy into the swizzled v is refused)."""
      for b in range(batch):
        plgpu.copy_gmem_to_smem(w1_gmem.at[pl.ds(token_stage[b], 1)], rows_smem.at[pl.ds(b, 1)],
                                rows_barrier.at[0])
      plgpu.barrier_wait(rows_barrier.at[0])
      plgpu.copy_smem_to_gmem(rows_smem, v_copy.at[program])
      plgpu.wait_smem_to_gmem(0)
      plgpu.copy_gmem_to_smem(v_copy.at[program], filled(v_smem), v_barrier.at[0])
      plgpu.barrier_wait(v_barrier.at[0])

    plgpu.copy_gmem_to_smem(v0_gmem, filled(v_smem), setup_barrier.at[0])
    plgpu.copy_gmem_to_smem(temp_gmem, temp_smem, setup_barrier.at[0])
    plgpu.copy_gmem_to_smem(greedy_gmem, greedy_smem, setup_barrier.at[0])
    fetch_noise(0)
    for t in range(min(stages - 1, total)):
      fetch(t)
    plgpu.barrier_wait(setup_barrier.at[0])
    temp = load(temp_smem, row_layout)
    greedy_row = load(greedy_smem, row_layout)

    def step(k, backwards):  # `backwards` (odd k) is static: Mosaic GPU selects no [B] rows
      plgpu.barrier_wait(noise_barrier.at[0])         # by a traced scalar (jax 0.11)
      best, token = hopper_step._best_over_tiles(
          per_program, lambda i: tile_pair(k, i, temp, greedy_row), reverse=backwards)
      hopper_step._store_pairs(best, token, key_stage, token_stage, pair_keys.at[k],
                               pair_tokens.at[k], program)

      @pl.when(k + 1 < gamma)
      def _():
        fetch_noise(k + 1)  # the noise buffers are free: this step's epilogues have run
      if not interpret:  # the pairs are stored (`_store_pairs` waited)
        grid_barrier(arrive, programs, k + 1)
      choose(k)

      @pl.when(program == 0)
      def _():
        plgpu.copy_smem_to_gmem(token_stage, tokens_gmem.at[k])

      @pl.when(k + 1 < gamma)
      def _():
        next_vectors()
      plgpu.wait_smem_to_gmem(0)

    def step_pair(j, carry):
      step(2 * j, False)

      @pl.when(2 * j + 1 < gamma)
      def _():
        step(2 * j + 1, True)
      return carry

    lax.fori_loop(0, (gamma + 1) // 2, step_pair, 0)
    if not interpret:
      reset_barrier(arrive, done, program, programs, gamma)

  swizzled = lambda width, itemsize: hopper_step._swizzled(width, itemsize, interpret)
  scratch = [
      plgpu.SMEM((ROWS, rank), w2.dtype, transforms=swizzled(rank, 2)),
      plgpu.SMEM((stages, rank, PART), w2.dtype, transforms=swizzled(PART, 2)),
      plgpu.SMEM((stages, ROWS, PART), dtype, transforms=swizzled(PART, 2)),
      plgpu.SMEM((2, ROWS, PART), jnp.float32, transforms=swizzled(PART, 4)),
      plgpu.SMEM((per_program, ROWS), jnp.float32),
      plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((programs, ROWS), jnp.float32, transforms=swizzled(ROWS, 4)),
      plgpu.SMEM((programs, ROWS), jnp.int32, transforms=swizzled(ROWS, 4)),
      plgpu.SMEM((batch, rank), w1.dtype),
      plgpu.Barrier(num_arrivals=3, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2 + per_program, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=1),
      plgpu.Barrier(num_arrivals=batch, num_barriers=1),
      plgpu.Barrier(num_arrivals=1, num_barriers=1),
  ]
  out_type = [jax.ShapeDtypeStruct((gamma, ROWS), jnp.int32),
              jax.ShapeDtypeStruct((batch, gamma, vocab), dtype),
              jax.ShapeDtypeStruct((gamma, programs, ROWS), jnp.float32),
              jax.ShapeDtypeStruct((gamma, programs, ROWS), jnp.int32),
              jax.ShapeDtypeStruct((programs, batch, rank), w1.dtype)]
  run = plgpu.kernel(kernel, out_type=out_type, grid=(programs,), grid_names=("program",),
                     scratch_types=scratch,
                     **({"interpret": hopper_step._interpret_params()} if interpret else {}))
  tokens, corrected, *_ = run(v0, w1, w2, base_logits, temp, greedy_rows, outer, inner)
  return tokens[:, :batch].T, corrected
