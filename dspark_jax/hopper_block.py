"""A small batch's whole sampling block as one persistent Hopper kernel (experimental, slow).

`scripts/resident_probe.py` (BENCHMARKS.md, issue 6, version 38) measured that one instance per
multiprocessor running all γ steps on the same W2 parts streams W2 in 0.84-0.90× its DRAM floor (L2
serves most of it), where one kernel per step streams it in ~1.06×. Below 64 rows W2 is nearly all
of a step's bytes, so this kernel runs a vanilla head's whole sampling block that way:

* the product transposed, ``W2_partᵀ vᵀ`` ([64 columns, B rows] on the tensor cores, the
  vocabulary as M), so no row is padded: B a multiple of 8 up to 64;
* each instance walks the same 128-column tiles at every step (odd steps backwards), each as two
  64-column parts through a ring of `stages` TMA copies (W2 part by part and the U_k part) that
  runs on from one step into the next;
* per part U_k is loaded and the corrected logits stored transposed (Mosaic GPU's
  ``WGMMA_TRANSPOSED`` layout through a transposed shared-memory view);
* per tile each row's pair is formed with the tile's own draw (`fused_step`'s per-tile draws): a
  greedy row's (max, first argmax), a sampled row's (log-mass plus the tile's Gumbel draw, argmax
  of ``x / T`` plus the column noise), reduced over axis 0;
* at a step's end every instance publishes its rows' best pair, waits at a grid-wide barrier
  (global semaphores), reduces all instances' pairs to the tokens, gathers their ``W1`` rows by TMA
  and makes them the next step's vectors.

Its tokens are `sampling.tokens_from_tile_stats`' for the same noise (a tile's log-mass is summed
in base 2 here, as in `hopper_step`). The CPU interpreter runs it with one instance (the barrier,
whose semaphores the interpreter lacks, is then not needed).

Measured on an H200 (BENCHMARKS.md, issue 6, version 39): its tokens and logits equal the default
path's, but it is slower than the per-step Triton chain it would replace: 195–201 / 234–250 µs at
B = 8 (V = 129280 / 151936) against 157 / 182. Without the draws, the publishing and the round
trips it streams the block in 131 µs (1.13× the floor); the epilogue's reductions over axis 0
(across the warpgroup's four warps) add ~40 µs, publishing ~16 and the round trips ~28. The first
form, rows padded to 64, took 515 / 599 µs. It stays opt-in, for the record.
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

PART = hopper_step.PART
GPU_PROGRAMS = 128  # instances on a GPU: the pairs' reduction reads [128, width] without masking
MAX_BATCH = 64
VECTOR = 32  # a [B] vector's entries in memory: a copy moves a multiple of 128 bytes
MAX_STAGES = 5
SMEM_BUDGET = 220 * 1024  # of the H200's 227 KB per block


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


def smem_bytes(batch, rank, stages, per_program, programs=GPU_PROGRAMS):
  """Shared memory of one instance: v and the gathered rows [B, r], a ring of `stages` W2 and U_k
  parts, the column noise of a tile, the tiles' noise, the published pairs of every instance, and
  the [B] row vectors (padded to `VECTOR` entries: a copy moves a multiple of 128 bytes)."""
  width = max(batch, VECTOR)
  return (2 * batch * rank * 2 + stages * (rank + batch) * PART * 2 + 2 * batch * PART * 4
          + per_program * width * 4 + 2 * programs * width * 4 + 4 * width * 4 + 1024)


@functools.partial(jax.jit, static_argnames=("programs", "stages", "interpret"))
def block_tokens(anchor, w1, w2, base_logits, temperature, noise, *, greedy, programs=None,
                 stages=None, interpret=False):
  """All γ draft tokens of a vanilla head's sampling block, and the corrected logits.

  Args:
    anchor: [B] int x_0 of each row; B a multiple of 8, at most 64.
    w1: [V, r] and w2: [r, V] or part by part [V/64, r, 64] (`hopper_step.w2_parts`).
    base_logits: [B, γ, V] the backbone's logits (bf16 on a GPU).
    temperature: [B] float32 clamped draft temperatures. greedy: [B] bool or int (nonzero: greedy).
    noise: [γ, B, V/c + c] float32 `sampling.tile_noise` of the rows' keys at each step.
    programs: static instances (None: 128 on a GPU, 1 when interpreting); on a GPU a multiple of
      64, all resident at once (one per multiprocessor).
    stages: static parts whose copies are in flight at once (None: as many as fit, up to 5).
    interpret: Mosaic GPU's CPU interpreter (one instance).

  Returns:
    ``(tokens [B, γ] int32, corrected [B, γ, V])``.
  """
  batch, gamma, vocab = base_logits.shape
  rank = w1.shape[1]
  tile = sampling.vocab_tile(vocab)
  if batch % hopper_step.PAD_ROWS or not 0 < batch <= MAX_BATCH:
    raise ValueError(f"base_logits: expected a batch that is a multiple of "
                     f"{hopper_step.PAD_ROWS} up to {MAX_BATCH}, got {batch}")
  if tile != 2 * PART:
    raise ValueError(f"base_logits: V = {vocab} has {tile}-column tiles; the kernel needs "
                     f"{2 * PART}")
  hopper_step._check_w2(w2, rank, vocab, PART)
  programs = 1 if interpret else (programs or GPU_PROGRAMS)
  if not interpret and programs % hopper_step.ROW_BLOCK:
    raise ValueError(f"programs: expected a multiple of {hopper_step.ROW_BLOCK} on a GPU, got "
                     f"{programs}")
  tiles = vocab // tile
  per_program = -(-tiles // programs)
  if stages is None:
    stages = max([s for s in range(1, MAX_STAGES + 1)
                  if smem_bytes(batch, rank, s, per_program, programs) <= SMEM_BUDGET] or [1])
  per_step = per_program * 2  # parts an instance visits per step
  total = gamma * per_step
  dtype = base_logits.dtype
  width = max(batch, VECTOR)  # a [B] vector padded for its copies

  # Once per block, in XLA: the first vectors, the [B] row inputs padded, the tiles' noise
  # tile-major and padded, the column noise per step.
  v0 = jnp.take(w1, anchor.astype(jnp.int32), axis=0).astype(w2.dtype)
  pad = lambda x, value: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - batch)],
                                 constant_values=value)
  temp = pad(temperature.astype(jnp.float32), 1.0)
  greedy_rows = pad((greedy != 0).astype(jnp.int32), 1)
  outer = pad(jnp.swapaxes(noise[:, :, :tiles], 1, 2), 0.0)   # [γ, V/c, width]
  inner = noise[:, :, tiles:]                                  # [γ, B, c]

  def kernel(v0_gmem, w1_gmem, w2_gmem, base_gmem, temp_gmem, greedy_gmem, outer_gmem, inner_gmem,
             tokens_gmem, corrected_gmem, pair_keys, pair_tokens, v_copy,
             v_smem, w2_smem, u_smem, inner_smem, outer_smem, temp_smem, greedy_smem, key_stage,
             token_stage, keys_smem, tokens_smem, rows_smem,
             setup_barrier, ring_barriers, noise_barrier, pairs_barrier, rows_barrier, v_barrier):
    program = lax.axis_index("program")
    rows = pl.ds(0, batch)
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
      plgpu.copy_gmem_to_smem(hopper_step._w2_part(w2_gmem, start(t)), w2_smem.at[slot],
                              ring_barriers.at[slot])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's logits are stored from it
      plgpu.copy_gmem_to_smem(base_gmem.at[:, t // per_step, pl.ds(start(t), PART)],
                              u_smem.at[slot], ring_barriers.at[slot])

    def fetch_noise(k):  # step k's column noise (two parts) and its tiles' noise
      for h in range(2):
        plgpu.copy_gmem_to_smem(inner_gmem.at[k, :, pl.ds(h * PART, PART)], inner_smem.at[h],
                                noise_barrier.at[0])
      for i in range(per_program):
        plgpu.copy_gmem_to_smem(outer_gmem.at[k, tile_of(k, i)], outer_smem.at[i],
                                noise_barrier.at[0])

    # Registers hold a part transposed, [64 columns, B rows] (the product's M is the vocabulary,
    # so no row is padded): a row's reductions run over axis 0, its vectors in `row_layout`.
    row_layout = None if interpret else plgpu.Layout.WGMMA.reduce(0)
    by_row = lambda x, shape: hopper_step._by_row(x, shape, axis=0)

    def load_rows(ref):  # a [B] vector of a [width] one
      return ref[rows] if interpret else plgpu.load(ref.at[rows], (), layout=row_layout)

    def load_transposed(ref):  # [B, 64] in shared memory as [64, B] registers
      if interpret:
        return ref[...].T
      value = plgpu.load(ref.T, (), layout=plgpu.Layout.WGMMA_TRANSPOSED)
      return plgpu.layout_cast(value, plgpu.Layout.WGMMA)

    def store_transposed(ref, value):  # [64, B] registers into [B, 64] shared memory
      if interpret:
        ref[...] = value.T
      else:
        ref.T[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)

    def part_logits(t):
      """Part t's corrected logits as [64, B] float32 registers: ``W2_partᵀ vᵀ + U_kᵀ``, rounded,
      written over its U_k part and stored."""
      slot = hopper_step._next_slot(t, stages, total, fetch, ring_barriers)
      u_part = u_smem.at[slot]

      def with_accumulator(acc_ref):
        if interpret:
          acc = jnp.dot(w2_smem[slot].T, v_smem[...].T, preferred_element_type=jnp.float32)
        else:
          plgpu.wgmma(acc_ref, w2_smem.at[slot].T, v_smem.T)
          acc = plgpu.wgmma_accumulator_load(acc_ref)
        logits = (acc + load_transposed(u_part).astype(jnp.float32)).astype(dtype)
        store_transposed(u_part, logits)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(u_part, corrected_gmem.at[:, t // per_step, pl.ds(start(t), PART)])
        return logits.astype(jnp.float32)
      return pl.run_scoped(with_accumulator, plgpu.ACC((PART, batch), jnp.float32))

    def tile_pair(k, i, temp, greedy_row):
      """Tile i's (integer key, token) per row at step k, with the tile's own draw."""
      xs, pairs = [], []
      for h in range(2):
        x = part_logits((k * per_program + i) * 2 + h)
        scores = jnp.where(by_row(greedy_row, x.shape) != 0, x,
                           x / by_row(temp, x.shape) + load_transposed(inner_smem.at[h]))
        pairs.append(hopper_step._first_max(scores, tile_of(k, i) * tile + h * PART, interpret,
                                            axis=0))
        xs.append(x)
      best_score, token = hopper_step._first_of_parts(pairs)
      tile_max = jnp.maximum(hopper_step._row_max(xs[0], interpret, axis=0),
                             hopper_step._row_max(xs[1], interpret, axis=0))
      draw = (hopper_step._tile_log_mass(xs, tile_max, temp, axis=0)
              + load_rows(outer_smem.at[i]))
      key = jnp.where(greedy_row != 0, fused_step.key_value(best_score), draw)
      return fused_step.order_keys(key), token

    def publish(k, best, token):
      """The instance's [B] pairs of step k, as row `program` of step k's [P, width] pairs."""
      key_stage[rows] = fused_step.key_value(best)
      token_stage[rows] = token
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(key_stage, pair_keys.at[k, program])
      plgpu.copy_smem_to_gmem(token_stage, pair_tokens.at[k, program])
      plgpu.wait_smem_to_gmem(0)

    def choose(k):
      """Every instance's pairs of step k reduced to each row's token, in `token_stage`."""
      plgpu.copy_gmem_to_smem(pair_keys.at[k], keys_smem, pairs_barrier.at[0])
      plgpu.copy_gmem_to_smem(pair_tokens.at[k], tokens_smem, pairs_barrier.at[0])
      plgpu.barrier_wait(pairs_barrier.at[0])
      wgmma = None if interpret else plgpu.Layout.WGMMA
      load = lambda ref: ref[...] if interpret else plgpu.load(ref, (), layout=wgmma)
      keys, tokens = fused_step.order_keys(load(keys_smem)), load(tokens_smem)
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
      plgpu.copy_gmem_to_smem(v_copy.at[program], v_smem, v_barrier.at[0])
      plgpu.barrier_wait(v_barrier.at[0])

    plgpu.copy_gmem_to_smem(v0_gmem, v_smem, setup_barrier.at[0])
    plgpu.copy_gmem_to_smem(temp_gmem, temp_smem, setup_barrier.at[0])
    plgpu.copy_gmem_to_smem(greedy_gmem, greedy_smem, setup_barrier.at[0])
    fetch_noise(0)
    for t in range(min(stages - 1, total)):
      fetch(t)
    plgpu.barrier_wait(setup_barrier.at[0])
    temp = load_rows(temp_smem)
    greedy_row = load_rows(greedy_smem)

    def step(k, backwards):  # `backwards` (odd k) is static: Mosaic GPU selects no [B] rows
      plgpu.barrier_wait(noise_barrier.at[0])         # by a traced scalar (jax 0.11)
      best, token = hopper_step._best_over_tiles(
          per_program, lambda i: tile_pair(k, i, temp, greedy_row), reverse=backwards)
      publish(k, best, token)

      @pl.when(k + 1 < gamma)
      def _():
        fetch_noise(k + 1)  # the noise buffers are free: this step's epilogues have run
      if not interpret:  # the pairs are stored (`publish` waited)
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

  swizzled = lambda columns, itemsize: hopper_step._swizzled(columns, itemsize, interpret)
  scratch = [
      plgpu.SMEM((batch, rank), w2.dtype, transforms=swizzled(rank, 2)),
      plgpu.SMEM((stages, rank, PART), w2.dtype, transforms=swizzled(PART, 2)),
      plgpu.SMEM((stages, batch, PART), dtype, transforms=swizzled(PART, 2)),
      plgpu.SMEM((2, batch, PART), jnp.float32, transforms=swizzled(PART, 4)),
      plgpu.SMEM((per_program, width), jnp.float32),
      plgpu.SMEM((width,), jnp.float32), plgpu.SMEM((width,), jnp.int32),
      plgpu.SMEM((width,), jnp.float32), plgpu.SMEM((width,), jnp.int32),
      plgpu.SMEM((programs, width), jnp.float32, transforms=swizzled(width, 4)),
      plgpu.SMEM((programs, width), jnp.int32, transforms=swizzled(width, 4)),
      plgpu.SMEM((batch, rank), w1.dtype),
      plgpu.Barrier(num_arrivals=3, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2 + per_program, num_barriers=1),
      plgpu.Barrier(num_arrivals=2, num_barriers=1),
      plgpu.Barrier(num_arrivals=batch, num_barriers=1),
      plgpu.Barrier(num_arrivals=1, num_barriers=1),
  ]
  out_type = [jax.ShapeDtypeStruct((gamma, width), jnp.int32),
              jax.ShapeDtypeStruct((batch, gamma, vocab), dtype),
              jax.ShapeDtypeStruct((gamma, programs, width), jnp.float32),
              jax.ShapeDtypeStruct((gamma, programs, width), jnp.int32),
              jax.ShapeDtypeStruct((programs, batch, rank), w1.dtype)]
  run = plgpu.kernel(kernel, out_type=out_type, grid=(programs,), grid_names=("program",),
                     scratch_types=scratch,
                     **({"interpret": hopper_step._interpret_params()} if interpret else {}))
  tokens, corrected, *_ = run(v0, w1, w2, base_logits, temp, greedy_rows, outer, inner)
  return tokens[:, :batch].T, corrected
