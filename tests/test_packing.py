"""The packed verify (`decoding.packing`, `TargetModel.packed`): the bucket layout, and that a packed
verify of each row's first tokens gives the dense forward's logits, features and cache writes for
those tokens (zeros and an untouched cache elsewhere), with one compiled program for every mix of
counts. Tiny f32 models on the CPU; the law and token-equality tests run it inside `generate`
(tests/test_generate_schedules.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding import packing
from dspark_jax.kernels import attention
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from tests.test_decoding import make_target


def test_token_buckets_end_at_the_dense_verify_and_round_to_eight():
  assert packing.token_buckets(64, 8) == (64, 128, 192, 256, 384, 512)
  assert packing.token_buckets(5, 8) == (5, 10, 15, 20, 30, 40)
  assert packing.token_buckets(16, 4)[-1] == 64
  assert packing.token_buckets(1, 8) == (8,) and packing.token_buckets(4, 8) == (32,)  # few tokens


def test_pack_lays_rows_out_one_after_the_other_with_padding_rows_past_the_tokens():
  rows, slots, total = packing.pack(jnp.asarray([2, 0, 3, 1]), 8)
  np.testing.assert_array_equal(rows, [0, 0, 2, 2, 2, 3, 4, 4])
  np.testing.assert_array_equal(slots, [0, 1, 0, 1, 2, 0, 0, 0])
  assert int(total) == 6


def test_packed_verify_equals_the_dense_forward_on_each_rows_tokens():
  _check_packed_against_dense(make_target(), slots=24)


@pytest.mark.gpu
def test_packed_verify_equals_the_dense_forward_through_the_ragged_kernel():
  # Head size 16 and 64 slots: the ragged kernel's preconditions hold, so both forwards attend
  # through it.
  target = kernel_sized_target()
  probe = jax.ShapeDtypeStruct((4, 4, 4, 16), jnp.float32)
  assert attention.choose_cached(probe, jax.ShapeDtypeStruct((4, 2, 64, 16), jnp.float32)) == (
      "ragged")
  _check_packed_against_dense(target, slots=64)


def kernel_sized_target():
  """A tiny float32 target whose attention meets the ragged kernel's preconditions (head size
  16), its features read by `tests.test_decoding.make_draft`'s drafts."""
  shape = layers.LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128)
  return tm.TargetModel(tm.TargetConfig(vocab_size=32, num_layers=2, layer=shape,
                                        feature_layers=(-1, 1)), rngs=nnx.Rngs(0))


def _check_packed_against_dense(target, slots):
  config = target.config
  rng = np.random.default_rng(0)
  batch, width = 4, 4
  start = jnp.asarray([3, 9, 0, 15], jnp.int32)
  positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, width)), jnp.int32)
  # A cache with real context before each row's block (written by a dense call) and garbage after.
  cache = tm.init_cache(config, batch, slots)
  cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), cache)
  dense_logits, dense_features, dense_cache = target(tokens, positions, cache)
  calls = []

  @jax.jit
  def packed(counts, cache):
    calls.append(1)
    return packing.packed_verify(target, tokens, positions, counts, cache, (4, 8, 12, 16))

  for counts in ([1, 4, 0, 2], [4, 4, 4, 4], [0, 0, 0, 1], [3, 1, 2, 0]):
    logits, features, new_cache = packed(jnp.asarray(counts, jnp.int32), cache)
    live = np.arange(width)[None] < np.asarray(counts)[:, None]           # [B, W]
    for got, want in ((logits, dense_logits), (features, dense_features)):
      got, want = np.asarray(got), np.asarray(want)
      np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
      assert np.all(got[~live] == 0)
    written = np.zeros((batch, slots), bool)
    for b in range(batch):
      written[b, int(start[b]):int(start[b]) + counts[b]] = True
    for name in ("k", "v"):
      for got, want, old in zip(new_cache[name], dense_cache[name], cache[name]):
        got, want, old = (np.swapaxes(np.asarray(x), 1, 2) for x in (got, want, old))
        np.testing.assert_allclose(got[written], want[written], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[~written], old[~written])
  assert len(calls) == 1
