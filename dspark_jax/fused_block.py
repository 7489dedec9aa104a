"""The whole draft block in one persistent Pallas kernel: γ steps without leaving the GPU program.

`fused_step` runs one kernel per block position, and XLA chooses the token between kernels. At
small batches each step is one read of W2 (r·V, 66 MB at V = 129280), and a kernel that streams
66 MB spends a large part of its ~20 µs starting and draining (BENCHMARKS.md, issue 6). Here a
fixed grid of `programs` instances (at most what the GPU holds at once) runs all γ steps of a
vanilla head (``bias = W1[x_{k-1}] @ W2``):

* step k: instance p walks the vocabulary tiles p, p + P, p + 2P, ... (odd steps backwards, so
  they start on the W2 tiles still in L2), computes each tile exactly as `fused_step` does
  (`fused_step.one_tile`: corrected logits written, one (key, token) pair per row and tile, the
  sampled rows' tokens drawn in every tile) and keeps each row's best pair over its tiles;
* it publishes that pair in slot ``[k, row, p]`` and arrives at a grid-wide counter;
* before step k + 1 every instance waits for all P arrivals, reduces the P published pairs of each
  row to x_k (the same pair order as `sampling.tokens_from_tile_choices`: the largest key, NaN
  first, ties to the smaller token, which is the earlier tile) and gathers ``W1[x_k]``.

So x_k is the token the per-step path chooses, bit for bit, and no step waits for a kernel launch,
a kernel's tail or an XLA reduction. Instance 0 writes the tokens. Measured on an H200
(BENCHMARKS.md, issue 6, version 18), that did not pay enough: greedy-only 8-9 % faster at
V = 129280 and B = 1, 8 but not at V = 151936, sampling 7-28 % slower. Each instance walks its
tiles one after another, and only 2-3 instances fit per multiprocessor (the per-step kernels run
5-6), which probably leaves fewer bytes in flight. So the kernel is opt-in
(``pallas_options=(("persistent", True),)`` in `proposal.folded_block`).

The counter is a grid-wide barrier, which needs every instance resident at once, or the kernel
never ends: `programs` defaults to what fitted on an H200 at r = 256 in bf16 (two per
multiprocessor for sampling, three greedy-only; a larger rank, float32 weights or more warps may fit
fewer, and a grid that does not fit hangs the GPU until the process is killed), and nothing else
may occupy the GPU's multiprocessors while the kernel runs (XLA runs one kernel at a time on its
stream; another process under MPS with a multiprocessor limit could deadlock it). Visibility follows the usual
grid-sync recipe: a block-wide barrier, then one acquire-release atomic per instance; published
pairs are read with volatile loads (not from L1). Pallas' interpreter (CPU tests) runs instances
one after another, so there the grid is one instance (the barrier passes at once).

One row block of at most `MAX_ROWS` rows (the batch is masked, not padded).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax import fused_step
from dspark_jax import sampling

MAX_ROWS = 64
_NO_KEY = np.int32(np.iinfo(np.int32).min)  # below every `fused_step.order_keys` value
_NO_TOKEN = np.int32(np.iinfo(np.int32).max)


PROGRAMS_PER_MULTIPROCESSOR = {"sampling": 2, "greedy_only": 3}
"""Instances per multiprocessor, the most that ran on an H200 at r = 256, bf16, 4 warps
(BENCHMARKS.md, issue 6, version 18): one more never finished (probably not all instances were
resident; the sampling kernel's draws need more registers). One per multiprocessor was
1.26-1.40x slower than two."""


def default_programs(greedy_only: bool) -> int:
  """Instances of the persistent grid: `PROGRAMS_PER_MULTIPROCESSOR` times the default device's
  multiprocessors (1 off GPUs)."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return 1
  per = PROGRAMS_PER_MULTIPROCESSOR["greedy_only" if greedy_only else "sampling"]
  return per * int(getattr(device, "core_count", 0) or 1)


def _better(key, token, best_key, best_token):
  """Whether pair (key, token) beats the best so far: a larger key, or the same and a smaller token."""
  return (key > best_key) | ((key == best_key) & (token < best_token))


def _arrive(counter_ref, interpret):
  # The barrier orders every warp's stores of this instance before the release of the atomic.
  if not interpret:
    plgpu.debug_barrier()
  plgpu.atomic_add(counter_ref, (jnp.int32(0),), jnp.int32(1))


def _wait(counter_ref, arrivals, interpret):
  """Spins until the counter reaches `arrivals` (acquire: the published pairs are then visible).

  The interpreter runs a grid of one instance, which has always arrived (and its state discharge
  has no rule for an atomic inside a loop): there this is a no-op.
  """
  if interpret:
    return
  poll = lambda _: plgpu.atomic_add(counter_ref, (jnp.int32(0),), jnp.int32(0))
  jax.lax.while_loop(lambda seen: seen < arrivals, poll, poll(None))
  plgpu.debug_barrier()


def _kernel(anchor_ref, w1_ref, w2_ref, base_ref, temp_ref, *refs, gamma, programs, width,
            per_program, serpentine, greedy_only, interpret, **static):
  if greedy_only:
    noise_ref = greedy_ref = corrected_ref = None
    _, tokens_ref, keys_ref, picks_ref, counter_ref = refs
  else:
    noise_ref, greedy_ref, _, corrected_ref, tokens_ref, keys_ref, picks_ref, counter_ref = refs
  rows, batch, tiles = static["rows"], static["batch"], static["tiles"]
  program = pl.program_id(0)
  row_ids = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  valid = row_ids < batch
  lanes = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
  published = jnp.broadcast_to(valid[:, None], (rows, width)) & (lanes < programs)

  def agreed_tokens(step):
    """x_{step+1} of every row, from all instances' published pairs of `step`."""
    _wait(counter_ref, (step + 1) * programs, interpret)
    window = (jnp.int32(step), pl.ds(0, rows), pl.ds(0, width))
    keys = plgpu.load(keys_ref.at[window], mask=published, other=_NO_KEY, volatile=True)
    picks = plgpu.load(picks_ref.at[window], mask=published, other=_NO_TOKEN, volatile=True)
    best = jnp.max(keys, axis=1)
    token = jnp.min(jnp.where(keys == best[:, None], picks, _NO_TOKEN), axis=1)
    token = jnp.where(valid, token, 0)

    @pl.when(program == 0)
    def _():
      plgpu.store(tokens_ref.at[pl.ds(0, rows), jnp.int32(step)], token, mask=valid)
    return token

  prev = plgpu.load(anchor_ref.at[pl.ds(0, rows)], mask=valid, other=0)
  for step in range(gamma):
    if step:
      prev = agreed_tokens(step - 1)
    backwards = serpentine and step % 2 == 1

    def visit(i, best, prev=prev, step=step, backwards=backwards):
      j = program + (per_program - 1 - i if backwards else i) * programs

      def tile(best):
        key, token = fused_step.one_tile(
            j, prev, w1_ref, w2_ref, base_ref, temp_ref, noise_ref, greedy_ref, corrected_ref,
            row0=0, step=step, draws=not greedy_only, late_base=False, **static)
        key = fused_step.order_keys(key)
        wins = _better(key, token, *best)
        return jnp.where(wins, key, best[0]), jnp.where(wins, token, best[1])
      return jax.lax.cond(j < tiles, tile, lambda best: best, best)

    start = (jnp.full((rows,), _NO_KEY), jnp.full((rows,), _NO_TOKEN))
    best_key, best_token = jax.lax.fori_loop(0, per_program, visit, start)
    slot = (jnp.int32(step), pl.ds(0, rows), program)
    plgpu.store(keys_ref.at[slot], best_key)
    plgpu.store(picks_ref.at[slot], best_token)
    _arrive(counter_ref, interpret)

  @pl.when(program == 0)
  def _():
    agreed_tokens(gamma - 1)


@functools.partial(jax.jit, static_argnames=("greedy_only", "programs", "num_warps", "num_stages",
                                             "k_chunk", "serpentine", "cache_hints", "interpret"))
def block_tokens(anchor, w1, w2, base_logits, temperature, noise, *, greedy=None, greedy_only,
                 programs=None, num_warps=None, num_stages=3, k_chunk=64, serpentine=True,
                 cache_hints=True, interpret=False):
  """All γ draft tokens of a vanilla head, and the corrected logits, from one persistent kernel.

  Args:
    anchor: [B] int x_0 of each row, B <= `MAX_ROWS`.
    w1: [V, r] and w2: [r, V], the vanilla head (``bias_k = W1[x_{k-1}] @ W2``).
    base_logits: [B, γ, V] the backbone's logits.
    temperature: [B] float32 clamped draft temperatures (read by sampled rows).
    noise: [γ, B, V/c + c] float32 tile noise (`sampling.tile_noise`), or None (greedy-only).
    greedy: [B] bool or int, nonzero for greedy rows; needed unless `greedy_only`.
    greedy_only: argmax on every row; no corrected logits.
    programs: static instances in the grid (None: `default_programs`; 1 when interpreting). Each
      walks every `programs`-th vocabulary tile; all must be resident at once on the GPU, or the
      kernel never ends.
    num_warps, num_stages, k_chunk, serpentine, cache_hints: as in `fused_step.step_stats`.
    interpret: run in Pallas' interpreter (CPU); the grid is then one instance.

  Returns:
    ``(tokens [B, γ] int32, corrected [B, γ, V] | None)``: the tokens `fused_step.step_stats` with
    per-tile draws and `sampling.tokens_from_tile_choices` give step by step.
  """
  batch, gamma, vocab = base_logits.shape
  rank = w2.shape[0]
  if batch > MAX_ROWS:
    raise ValueError(f"base_logits: the persistent kernel takes at most {MAX_ROWS} rows, got {batch}")
  tile = sampling.vocab_tile(vocab)
  if tile < fused_step.MIN_TILE:
    raise ValueError(f"w2: vocab {vocab} has no power-of-two tile >= {fused_step.MIN_TILE}")
  if not greedy_only and noise is None:
    raise ValueError("noise: the sampling variant needs every step's tile noise")
  if not greedy_only and greedy is None:
    raise ValueError("greedy: the sampling variant needs the rows' greedy mask")
  programs = 1 if interpret else (programs or default_programs(greedy_only))
  if programs < 1:
    raise ValueError(f"programs: expected >= 1, got {programs}")
  tiles = vocab // tile
  programs = min(programs, tiles)
  width = max(2, 1 << (programs - 1).bit_length())  # a power of two, as Triton's shapes must be
  rows = fused_step.row_block(batch, MAX_ROWS)
  if k_chunk is not None and (rank % k_chunk or k_chunk < fused_step.MIN_TILE):
    k_chunk = None
  inputs = [anchor.astype(jnp.int32), w1, w2, base_logits, temperature.astype(jnp.float32)]
  out_shape = []
  if not greedy_only:
    inputs += [noise, greedy.astype(jnp.int32)]
    out_shape.append(jax.ShapeDtypeStruct(base_logits.shape, base_logits.dtype))
  inputs.append(jnp.zeros((1,), jnp.int32))  # the arrival counter, aliased to the last output
  slots = jax.ShapeDtypeStruct((gamma, rows, width), jnp.int32)
  out_shape += [jax.ShapeDtypeStruct((batch, gamma), jnp.int32), slots, slots,
                jax.ShapeDtypeStruct((1,), jnp.int32)]
  params = {name: value for name, value in (("num_warps", num_warps),
                                             ("num_stages", num_stages)) if value}
  outs = pl.pallas_call(
      functools.partial(_kernel, gamma=gamma, programs=programs, width=width,
                        per_program=-(-tiles // programs), serpentine=serpentine,
                        greedy_only=greedy_only, interpret=interpret, batch=batch, rows=rows,
                        tile=tile, tiles=tiles, k_chunk=k_chunk, cache_hints=cache_hints),
      grid=(programs,),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases={len(inputs) - 1: len(out_shape) - 1},
      compiler_params=plgpu.CompilerParams(**params) if params else None,
      interpret=interpret,
  )(*inputs)
  if greedy_only:
    return outs[0], None
  return outs[1], outs[0]
