"""The small-batch persistent Hopper block (`hopper_block`): the loop form's tokens and logits in
Mosaic GPU's CPU interpreter (one instance), and it lowers for CUDA at the benchmark shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax import hopper_block
from dspark_jax.kernels import hopper_step
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from tests import helpers

CPU = jax.default_backend() == "cpu"


@pytest.mark.parametrize("batch,gamma,via_block", [(8, 3, True), (16, 2, False)])
def test_block_equals_the_loop(batch, gamma, via_block):
  # V = 1280 (ten 128-column tiles), r = 64, a float32 head on the CPU (bf16 on a GPU); greedy
  # rows and rows at T = 0.5, 1, 2; rows 0-1 all -inf, rows 2-3 a NaN at column 1100, rows 4-5 an
  # exact tie between columns 70 and 1250 (first and last tile). Odd steps walk the tiles
  # backwards. Tokens equal the loop form's bit for bit in the interpreter, the logits nearly so.
  # `via_block`: through `proposal.folded_block(pallas_options=(("hopper_block", True),))` with the
  # head's arrays prepared (W2 part by part); else the kernel called directly.
  vocab, rank, hidden = 1280, 64, 6
  dtype = jnp.float32 if CPU else jnp.bfloat16
  arrays = {name: jnp.asarray(a, dtype) for name, a in
            helpers.head_arrays("vanilla", vocab, rank, hidden, seed=3, scale=1.0).items()}
  arrays["w2"] = arrays["w2"].at[:, 1250].set(arrays["w2"][:, 70])
  base = jnp.asarray(helpers.edge_rows(batch, gamma, vocab, nan_at=1100, tie_at=(70, 1250),
                                       seed=8, tie_value=60.0), jnp.bfloat16)
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.5, 1.0, 2.0], batch // 4),
                             seed=np.arange(batch))
  rows = proposal.block_arrays(params, np.arange(batch) * 11, np.arange(batch) * 3)
  key = jax.random.key(2)
  loop_tokens, loop_logits, _ = proposal.folded_block(
      arrays, None, base, rows["anchor"], None, rows["greedy"], rows["temperature"],
      rows["seeds"], rows["positions"], key, kind="vanilla", greedy_only=False, form="loop")
  if via_block:
    tokens, logits, _ = proposal.folded_block(
        proposal.prepare_head_arrays(arrays), None, base, rows["anchor"], None, rows["greedy"],
        rows["temperature"], rows["seeds"], rows["positions"], key, kind="vanilla",
        greedy_only=False, form="pallas", pallas_options=(("hopper_block", True),))
    _check(loop_tokens, loop_logits, tokens, logits)
    return
  tile = sampling.vocab_tile(vocab)
  positions = jnp.asarray(rows["positions"])
  steps = positions[None, :] + jnp.arange(1, gamma + 1, dtype=positions.dtype)[:, None]
  keys = sampling.row_keys(key, jnp.broadcast_to(jnp.asarray(rows["seeds"]), steps.shape).reshape(-1),
                           steps.reshape(-1), sampling.Stream.DRAFT).reshape(steps.shape)
  noise = sampling.tile_noise(keys, vocab // tile, tile)
  tokens, logits = hopper_block.block_tokens(
      jnp.asarray(rows["anchor"]), arrays["w1"], hopper_step.w2_parts(arrays["w2"]), base,
      jnp.asarray(rows["temperature"]), noise, greedy=jnp.asarray(rows["greedy"]), interpret=CPU)
  _check(loop_tokens, loop_logits, tokens, logits)


def _check(loop_tokens, loop_logits, tokens, logits):
  """Tokens bit for bit in the interpreter; on a GPU (the tensor cores sum v @ W2 in their own
  order) nearly all, and the logits to bf16 rounding."""
  want, got = np.asarray(loop_logits, np.float32), np.asarray(logits, np.float32)
  if not CPU:
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
    assert np.mean(np.asarray(loop_tokens) == np.asarray(tokens)) >= 0.9
    return
  np.testing.assert_array_equal(np.asarray(loop_tokens), np.asarray(tokens))
  # The logits to one bf16 ulp at a few elements: XLA's CPU dot sums a [64, 64] part's products in
  # another order than the loop form's whole row, and a float32 sum a last bit apart can round to
  # the neighbouring bf16 (2 of 30,720 elements at B = 8, γ = 3).
  np.testing.assert_allclose(got, want, rtol=2**-7, atol=0)
  assert np.mean((got != want) & ~(np.isnan(got) & np.isnan(want))) < 1e-3
  tokens = np.asarray(tokens)
  assert np.all(tokens[0:2] == 0) and np.all(tokens[2:4] == 1100) and np.all(tokens[4] == 70)


def test_lowers_for_cuda_at_the_benchmark_shape_and_refuses_what_it_cannot_run():
  # B = 8, γ = 7, r = 256, V = 129280, bf16, 128 instances: it must trace and lower for a GPU,
  # shared memory included (checked when lowering). Batches it cannot run name the argument.
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  batch, gamma, vocab, rank = 8, 7, 129280, 256
  run = lambda *args: hopper_block.block_tokens(*args[:6], greedy=args[6])
  args = (spec((batch,), jnp.int32), spec((vocab, rank), jnp.bfloat16),
          spec((vocab // 64, rank, 64), jnp.bfloat16), spec((batch, gamma, vocab), jnp.bfloat16),
          spec((batch,), jnp.float32), spec((gamma, batch, vocab // 128 + 128), jnp.float32),
          spec((batch,), jnp.bool_))
  lowered = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  with pytest.raises(ValueError, match="^base_logits: expected a batch that is a multiple of 8"):
    jax.jit(run).trace(spec((12,), jnp.int32), *args[1:3], spec((12, gamma, vocab), jnp.bfloat16),
                       spec((12,), jnp.float32), spec((gamma, 12, vocab // 128 + 128), jnp.float32),
                       spec((12,), jnp.bool_))
