"""The experimental Hopper (Mosaic GPU) greedy step: exact in the interpreter, lowers for CUDA."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax import hopper_step, proposal
from tests import helpers

CPU = jax.default_backend() == "cpu"  # there the kernel runs in Mosaic GPU's interpreter


def _inputs(batch, rank, vocab, gamma=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  v = jax.random.normal(keys[0], (batch, rank)).astype(jnp.bfloat16)
  w2 = (0.3 * jax.random.normal(keys[1], (rank, vocab))).astype(jnp.bfloat16)
  base = jax.random.normal(keys[2], (batch, gamma, vocab)).astype(jnp.bfloat16)
  return v, w2, base


@pytest.mark.parametrize("batch,stages", [(64, 1), (64, 2), (128, 3)])
def test_partials_are_the_rounded_logits_max_and_first_argmax_per_instance(batch, stages):
  # V = 640 = ten 64-column tiles over 4 instances: instance p visits tiles p, p + 4, p + 8, the
  # last tile (9) standing in for those past it. Rows 0-1 tie exactly across two tiles of one instance and within
  # one tile: the first column must win. Exact in the interpreter (CPU); on a GPU, to the tensor
  # cores' summation order.
  rank, vocab, programs = 64, 640, 4
  v, w2, base = _inputs(batch, rank, vocab)
  v = v.at[:2].set(0)                        # rows 0-1: corrected = base exactly
  base = base.at[:2, 1].set(0).at[0, 1, [70, 585]].set(5.0).at[1, 1, [3, 9, 259]].set(2.0)
  program_max, program_argmax = hopper_step.greedy_partials(
      v, w2, base, step=1, stages=stages, programs=programs, interpret=CPU)
  assert program_max.shape == program_argmax.shape == (programs, batch)
  x = (base[:, 1].astype(jnp.float32) + jnp.dot(v, w2, preferred_element_type=jnp.float32))
  x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  tokens = np.asarray(hopper_step.tokens(program_max, program_argmax))
  assert tokens[0] == 70 and tokens[1] == 3
  columns = [np.concatenate([np.arange(64 * min(t, 9), 64 * min(t, 9) + 64)
                             for t in range(p, 12, programs)])
             for p in range(programs)]           # instance p's columns, in its visiting order
  want_max = np.stack([x[:, c].max(-1) for c in columns])
  want_argmax = np.stack([c[x[:, c].argmax(-1)] for c in columns])
  if not CPU:  # the tensor cores sum v @ W2 in another order: one bf16 ulp, rare near-tie flips
    np.testing.assert_allclose(np.asarray(program_max), want_max, rtol=2**-7)
    assert np.mean(tokens == x.argmax(-1)) >= 0.9
    return
  np.testing.assert_array_equal(np.asarray(program_max), want_max)
  np.testing.assert_array_equal(np.asarray(program_argmax), want_argmax)
  np.testing.assert_array_equal(tokens, x.argmax(-1))


def test_rejects_shapes_it_cannot_run():
  v, w2, base = _inputs(64, 64, 640)
  with pytest.raises(ValueError, match="^v: "):
    hopper_step.greedy_partials(v[:32], w2, base[:32], step=0, interpret=CPU)
  with pytest.raises(ValueError, match="^tile: "):
    hopper_step.greedy_partials(v, w2, base, step=0, tile=96, interpret=CPU)


def test_lowers_for_cuda_at_the_benchmark_shape():
  # B = 128, r = 256, V = 129280, bf16: the kernel must trace and lower for a GPU (no GPU needed).
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  lowered = jax.jit(hopper_step.greedy_partials, static_argnames=("step", "programs")).trace(
      spec((128, 256), jnp.bfloat16), spec((256, 129280), jnp.bfloat16),
      spec((128, 7, 129280), jnp.bfloat16), step=3, programs=132).lower(
          lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_hopper_form_equals_the_loop(kind):
  # Greedy-only blocks through `proposal.folded_block(pallas_options=hopper)`, B = 64, V = 640:
  # tokens and confidence equal the loop form's bit for bit in the interpreter (on a GPU the two
  # sum v @ W2 in different orders: the edge rows must agree, the rest nearly all), with rows of
  # NaN, -inf and an exact tie across tiles (the kernel's integer keys).
  batch, gamma, vocab, rank, hidden = 64, 2, 640, 64, 6
  head = helpers.make_head(kind, vocab, rank, hidden)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  rng = np.random.default_rng(4)
  base = rng.normal(0, 2, (batch, gamma, vocab)).astype(np.float32)
  base[0] = -np.inf
  base[1, :, [100, 500]] = np.nan
  base[2:4] = 0.0
  base[2:4, :, [70, 630]] = 60.0          # an exact tie between the second and the last tile ...
  w2 = 0.1 * head.arrays()["w2"]
  arrays = dict(head.arrays(), w2=w2.at[:, 630].set(w2[:, 70]))  # ... with the same bias
  h = jnp.asarray(rng.normal(0, 1, (batch, gamma, hidden)), jnp.float32)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.zeros(batch)), np.arange(batch),
                               np.arange(batch) * 3)
  outs = [proposal.folded_block(
      arrays, conf.arrays(), jnp.asarray(base).astype(jnp.bfloat16), rows["anchor"], h,
      rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(0),
      kind=kind, greedy_only=True, form=form, pallas_options=options)
      for form, options in (("loop", ()), ("pallas", (("hopper", True),)))]
  loop_tokens, tokens = np.asarray(outs[0][0]), np.asarray(outs[1][0])
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(loop_tokens, tokens)
    np.testing.assert_array_equal(np.asarray(outs[0][2]), np.asarray(outs[1][2]))
  else:
    assert np.mean(loop_tokens == tokens) >= 0.9
  assert np.all(tokens[0] == 0) and np.all(tokens[1] == 100) and np.all(tokens[2:4] == 70)


def test_hopper_form_is_greedy_only():
  head = helpers.make_head("vanilla", 640, 64, 3)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.ones(64)), np.arange(64),
                               np.zeros(64))
  with pytest.raises(ValueError, match="hopper is a greedy-only kernel"):
    proposal.folded_block(head.arrays(), None, jnp.zeros((64, 2, 640)), rows["anchor"], None,
                          rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"],
                          jax.random.key(0), kind="vanilla", greedy_only=False, form="pallas",
                          pallas_options=(("hopper", True),))


def test_hopper_by_default_only_where_it_was_measured_to_win():
  hopper_gpu = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
  bf16 = jnp.bfloat16
  assert proposal.hopper_by_default(128, 129280, bf16, bf16, hopper_gpu)
  assert proposal.hopper_by_default(256, 151936, bf16, bf16, hopper_gpu)
  assert not proposal.hopper_by_default(64, 129280, bf16, bf16, hopper_gpu)   # slower at 64 rows
  assert not proposal.hopper_by_default(160, 129280, bf16, bf16, hopper_gpu)  # not 64-row blocks
  assert not proposal.hopper_by_default(128, 129281, bf16, bf16, hopper_gpu)  # no 64-column tiles
  assert not proposal.hopper_by_default(128, 129280, jnp.float32, bf16, hopper_gpu)  # TF32 WGMMA
  assert not proposal.hopper_by_default(128, 129280, bf16, jnp.float32, hopper_gpu)
  ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
  assert not proposal.hopper_by_default(128, 129280, bf16, bf16, ampere)
  assert not proposal.hopper_by_default(128, 129280, bf16, bf16, jax.devices("cpu")[0])
