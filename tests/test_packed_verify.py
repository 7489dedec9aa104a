"""The packed verify forward (`TargetModel.packed`, `layers.Packing`, `tm.verify_sizes`): the
valid slots of a ragged [B, T] batch computed as a packed batch give the unpacked call's logits,
features and cache (float32, within a few ulps of the largest value); invalid slots are zeros and
the cache before each row's start is untouched; the size chosen holds the round's tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import layers
from dspark_jax.models import target as tm


def test_packing_maps_valid_slots_in_row_major_order():
  packing = layers.packing(jnp.array([2, 0, 3]), 4, size=8)
  np.testing.assert_array_equal(packing.to_packed, [0, 1, 8, 8, 8, 8, 8, 8, 2, 3, 4, 8])
  np.testing.assert_array_equal(packing.to_slot[:5], [0, 1, 8, 9, 10])
  a = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2) + 1
  packed = packing.pack(a)
  assert packed.shape == (1, 8, 2)
  np.testing.assert_array_equal(packed[0, :5], a.reshape(12, 2)[np.array([0, 1, 8, 9, 10])])
  back = np.asarray(packing.unpack(packed))
  valid = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
  np.testing.assert_array_equal(back[valid], np.asarray(a)[valid])
  assert np.all(back[~valid] == 0)


def test_verify_sizes_and_the_size_chosen():
  assert tm.verify_sizes(1, 8) == (8,)
  assert tm.verify_sizes(4, 8) == (8, 16, 24, 32)
  assert tm.verify_sizes(64, 8) == (128, 256, 384, 512)
  assert tm.verify_sizes(3, 4) == (8, 12)
  sizes = tm.verify_sizes(4, 8)
  for lens, want in [([1, 1, 1, 1], 0), ([2, 2, 2, 2], 0), ([3, 2, 2, 2], 1), ([8, 8, 0, 0], 1),
                     ([8, 8, 8, 0], 2), ([8, 8, 8, 1], 3), ([8, 8, 8, 8], 3), ([0, 0, 0, 0], 0)]:
    index = int(tm.verify_size_index(jnp.array(lens, jnp.int32), sizes))
    assert index == want, lens
    assert sizes[index] >= sum(lens) and (index == 0 or sizes[index - 1] < sum(lens))


@pytest.fixture(scope="module")
def target():
  shape = layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64)
  config = tm.TargetConfig(vocab_size=50, num_layers=2, layer=shape, tie_embeddings=False,
                           feature_layers=(-1, 0, 1))
  return tm.TargetModel(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("lens,size", [([3, 8, 0, 5], 16), ([1, 1, 1, 1], 8), ([8, 8, 8, 8], 32)])
def test_packed_call_equals_the_call_on_valid_slots(target, lens, size):
  batch, width, slots = 4, 8, 32
  tokens = jax.random.randint(jax.random.key(1), (batch, width), 0, 50)
  start = jnp.array([3, 5, 0, 9])
  positions = start[:, None] + jnp.arange(width)[None, :]
  cache = jax.tree.map(lambda a: jax.random.normal(jax.random.key(2), a.shape),
                       tm.init_cache(target.config, batch, slots))
  before = jax.tree.map(np.asarray, cache)
  full = target(tokens, positions, cache)
  packed = target.packed(tokens, positions, cache, jnp.array(lens, jnp.int32), size=size)
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, cache))  # not mutated
  valid = np.arange(width)[None, :] < np.array(lens)[:, None]
  for a, b in zip(full[:2], packed[:2]):  # logits, features
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b[valid], a[valid], rtol=0, atol=64 * np.finfo(np.float32).eps
                               * np.abs(a).max())
    assert np.all(b[~valid] == 0)
  for name in ("k", "v"):
    for layer, (a, b) in enumerate(zip(full[2][name], packed[2][name])):
      a, b = np.asarray(a), np.asarray(b)
      for row in range(batch):
        s, n = int(start[row]), lens[row]
        np.testing.assert_array_equal(b[row, :s], before[name][layer][row, :s])
        np.testing.assert_allclose(b[row, s:s + n], a[row, s:s + n], rtol=0,
                                   atol=64 * np.finfo(np.float32).eps * np.abs(a).max())
        assert np.all(b[row, s + n:s + width] == 0)


@pytest.mark.parametrize("lens,packed", [([1, 2, 0, 3], True), ([8, 8, 8, 1], False)])
def test_verify_packs_to_the_smallest_size_that_holds_the_tokens(target, lens, packed):
  # (4 rows x 8: sizes 8, 16, 24, 32.) A packed size leaves zeros in the invalid slots, the full
  # size (the plain call) does not; the valid slots equal the call's.
  tokens = jax.random.randint(jax.random.key(3), (4, 8), 0, 50)
  positions = jnp.array([2, 0, 4, 1])[:, None] + jnp.arange(8)[None, :]
  cache = tm.init_cache(target.config, 4, 16)
  lens = jnp.array(lens, jnp.int32)
  logits, _, _ = jax.jit(lambda t, p, c, n: target.verify(t, p, c, n))(tokens, positions, cache, lens)
  full, _, _ = target(tokens, positions, cache)
  logits, full = np.asarray(logits), np.asarray(full)
  valid = np.arange(8)[None, :] < np.asarray(lens)[:, None]
  np.testing.assert_allclose(logits[valid], full[valid], rtol=0,
                             atol=64 * np.finfo(np.float32).eps * np.abs(full).max())
  assert np.all(logits[~valid] == 0) == packed
  np.testing.assert_array_equal(target.verify(tokens, positions, cache)[0], full)
