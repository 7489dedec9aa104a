"""`dspark_loss` reads each sequence's context once for all its blocks (`DSparkDraft.shared_blocks`).

The reference is the form it replaced: the context repeated once per anchor and the decode-time
``draft(target, anchor, anchor_pos, context)`` over the flattened blocks. The loss, its metrics
and its gradients must agree to float32 rounding, and the compiled loss-and-gradient must need far
less scratch memory than the copying form at many anchors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.kernels import attention
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.train import trainer as training


TARGET = tm.TargetConfig(vocab_size=64, num_layers=1, feature_layers=(0,),
                         layer=layers.LayerShape(hidden_size=16, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, intermediate_size=32))
LENGTH, ANCHORS, GAMMA = 512, 250, 3
"""750 block queries per sequence: two tiles of `kernels.attention.SHARED_QUERY_TILE` = 512,
the second padded, with a block straddling the tiles; wide context heads, so that a context copy
per block is large next to the blocks' own activations."""


def _copied_blocks(self, target, anchor, anchor_pos, context):
  """The replaced form: every block reads its own copy of its sequence's context."""
  repeated = jax.tree.map(lambda x: jnp.repeat(x, anchor.shape[1], axis=0), context)
  return self(target, anchor.reshape(-1), anchor_pos.reshape(-1), repeated)


def _compiled(draft, target, copied: bool):
  """The jitted masked loss, its metrics and gradients, compiled for one [1, LENGTH] sequence
  with ANCHORS blocks, in the shared form or (`copied`) the per-anchor copy form."""
  graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

  def objective(params, tokens, where, mask):
    return training.dspark_loss(nnx.merge(graphdef, params, rest), target, tokens, where, mask)
  shapes = (jax.ShapeDtypeStruct((1, LENGTH), jnp.int32),
            jax.ShapeDtypeStruct((1, ANCHORS), jnp.int32), jax.ShapeDtypeStruct((1, LENGTH), bool))
  with pytest.MonkeyPatch.context() as patch:
    if copied:
      patch.setattr(dm.DSparkDraft, "shared_blocks", _copied_blocks)
    return jax.jit(jax.value_and_grad(objective, has_aux=True)).lower(params, *shapes).compile()


@pytest.fixture(scope="module")
def programs():
  assert attention.SHARED_QUERY_TILE < ANCHORS * GAMMA < 2 * attention.SHARED_QUERY_TILE
  target = tm.TargetModel(TARGET, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(dm.DraftConfig(gamma=GAMMA, num_layers=1, target_layer_ids=(0,),
                                        mask_token_id=63, rank=4), TARGET, rngs=nnx.Rngs(1))
  params = nnx.state(draft, nnx.Param)
  return params, _compiled(draft, target, False), _compiled(draft, target, True)


def test_loss_metrics_and_gradients_equal_the_per_anchor_copies(programs):
  params, shared, copied = programs
  rng = np.random.default_rng(0)
  anchors = rng.integers(1, LENGTH - GAMMA, (1, ANCHORS))
  anchors[0, :2] = (1, LENGTH - GAMMA - 1)                 # the shortest and longest contexts
  batch = (jnp.asarray(rng.integers(0, 63, (1, LENGTH)), jnp.int32),
           jnp.asarray(anchors, jnp.int32), jnp.asarray(rng.random((1, LENGTH)) < 0.7))
  (loss, metrics), grads = shared(params, *batch)
  (ref_loss, ref_metrics), ref_grads = copied(params, *batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert set(metrics) == set(ref_metrics)
  for name in ref_metrics:
    np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, err_msg=name)
  flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat)
  for (path, g), r in zip(flat, ref_flat):
    scale = float(np.max(np.abs(r))) or 1.0
    np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(r) / scale, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  assert float(np.max(np.abs(ref_grads["layers"][0]["attention"]["qkv_proj"]["kernel"][...]))) > 0


def test_scratch_memory_follows_context_plus_blocks_not_their_product(programs):
  _, shared, copied = programs
  shared_bytes = shared.memory_analysis().temp_size_in_bytes
  copied_bytes = copied.memory_analysis().temp_size_in_bytes
  heads, dim = TARGET.layer.num_kv_heads, TARGET.layer.head_dim
  copy_bytes = ANCHORS * 2 * LENGTH * heads * dim * 4       # keys and values, a copy per block
  assert copied_bytes > copy_bytes
  assert shared_bytes < min(copied_bytes / 4, copy_bytes / 2), (shared_bytes, copied_bytes)
  print(f"scratch bytes: shared context {shared_bytes}, per-anchor copies {copied_bytes}")
