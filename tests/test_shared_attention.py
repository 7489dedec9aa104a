"""Training's context attention through the ragged kernel (`kernels.shared_attention`).

The kernel form must equal `attention.limited_part` and its gradients (the XLA form it replaces on
a GPU), and the drafter loss must not change when `attention.shared_limited_part` takes it. On the
CPU the kernel runs in Pallas' interpreter; on a GPU host (``DSPARK_TEST_GPU=1``) compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.kernels import attention
from dspark_jax.kernels import ragged_attention
from dspark_jax.kernels import shared_attention
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from dspark_jax.train import trainer as training

INTERPRET = jax.default_backend() != "gpu"
B, T, N, K, D, S = 2, 45, 4, 2, 16, 64


def _inputs(seed, dtype):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
             for shape in ((B, T, N, D), (B, K, S, D), (B, K, S, D)))
  limits = rng.integers(1, S + 1, (B, T))
  limits[0, :3] = (0, 1, S)                       # nothing, one slot, the whole context
  weights = (jnp.asarray(rng.normal(size=(B, K, N // K, T)), jnp.float32),
             jnp.asarray(rng.normal(size=(B, K, N // K, T, D)), jnp.float32))
  return q, k, v, jnp.asarray(limits, jnp.int32), weights


def _objective(part, weights):
  """A scalar reading both outputs of a softmax part (lse where finite, and out)."""
  def f(q, k, v, limits):
    lse, out = part(q, k, v, limits)
    return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights[0]) + jnp.sum(out * weights[1])
  return f


def _kernel(q, k, v, limits):
  """The kernel form in `attention.limited_part`'s layout, as `shared_limited_part` takes it."""
  return attention.kernel_part(
      *shared_attention.limited_part_kernel(q, k, v, limits, interpret=INTERPRET), k.shape[1])


def _relative(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  finite = np.isfinite(ref)
  assert np.array_equal(finite, np.isfinite(x))
  return np.max(np.abs(x[finite] - ref[finite])) / np.max(np.abs(ref[finite]))


@pytest.mark.kernel
def test_values_and_gradients_equal_the_xla_part_in_float32():
  q, k, v, limits, weights = _inputs(0, jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = attention.limited_part(q, k, v, limits)
    got = _kernel(q, k, v, limits)
    ref_grads = jax.grad(_objective(attention.limited_part, weights), (0, 1, 2))(q, k, v, limits)
    grads = jax.grad(_objective(_kernel, weights), (0, 1, 2))(q, k, v, limits)
  for x, r in zip(got, ref):
    assert x.dtype == jnp.float32 and x.shape == r.shape
    assert _relative(x, r) < 1e-5
  assert np.all(np.isneginf(np.asarray(got[0])[0, :, :, 0]))   # limit 0: lse -inf, zeros
  assert not np.any(np.asarray(got[1])[0, :, :, 0])
  for name, g, r in zip("qkv", grads, ref_grads):
    assert g.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(g))), name
    assert _relative(g, r) < 1e-5, (name, _relative(g, r))
  assert not np.any(np.asarray(grads[0])[0, 0])                 # the query that saw nothing


@pytest.mark.kernel
def test_bfloat16_inputs_stay_within_bf16_rounding_of_float32():
  q, k, v, limits, weights = _inputs(1, jnp.bfloat16)
  up = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = attention.limited_part(up(q), up(k), up(v), limits)
    ref_grads = jax.grad(_objective(attention.limited_part, weights), (0, 1, 2))(
        up(q), up(k), up(v), limits)
  got = _kernel(q, k, v, limits)
  grads = jax.grad(_objective(_kernel, weights), (0, 1, 2))(q, k, v, limits)
  assert _relative(got[0], ref[0]) < 2 ** -8 and _relative(got[1], ref[1]) < 2 ** -6
  for name, g, r in zip("qkv", grads, ref_grads):
    assert g.dtype == jnp.bfloat16, name
    assert _relative(g, r) < 2 ** -5, (name, _relative(g, r))


TARGET = tm.TargetConfig(vocab_size=64, num_layers=1, feature_layers=(0,),
                         layer=layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2,
                                                 head_dim=16, intermediate_size=32))


@pytest.mark.kernel
@pytest.mark.slow
def test_the_drafter_loss_and_gradients_do_not_change_through_the_kernel(monkeypatch):
  target = tm.TargetModel(TARGET, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(0,),
                                        mask_token_id=63, rank=4), TARGET, rngs=nnx.Rngs(1))
  graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
  rng = np.random.default_rng(2)
  batch = (jnp.asarray(rng.integers(0, 63, (1, 64)), jnp.int32),
           jnp.asarray(rng.integers(1, 60, (1, 8)), jnp.int32),
           jnp.asarray(rng.random((1, 64)) < 0.8))

  def run():
    def objective(params):
      return training.dspark_loss(nnx.merge(graphdef, params, rest), target, *batch)
    with jax.default_matmul_precision("highest"):
      return jax.value_and_grad(objective, has_aux=True)(params)

  (loss, _), grads = run()
  calls = []
  kernel, backward = ragged_attention.ragged_attention, shared_attention.backward_kernels
  monkeypatch.setattr(ragged_attention, "ragged_attention", lambda *a, **kw: calls.append(1) or
                      kernel(*a, **{**kw, "interpret": INTERPRET}))
  monkeypatch.setattr(shared_attention, "backward_kernels", lambda *a, **kw: calls.append(2) or
                      backward(*a, **{**kw, "interpret": INTERPRET}))
  monkeypatch.setattr(attention, "_platform", lambda: "gpu")   # the preconditions hold here
  monkeypatch.setenv(attention.SHARED_ENV_VAR, "ragged")
  (kernel_loss, _), kernel_grads = run()
  assert set(calls) == {1, 2}                      # the kernel forward and backward ran
  np.testing.assert_allclose(kernel_loss, loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(kernel_grads), jax.tree.leaves(grads)):
    scale = float(np.max(np.abs(r))) or 1.0
    np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(r) / scale, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_the_choice_is_ragged_where_it_may_run_and_bad_requests_are_named(monkeypatch):
  q, k = jnp.zeros((1, 8, 4, 16), jnp.bfloat16), jnp.zeros((1, 2, 64, 16), jnp.float32)
  monkeypatch.delenv(attention.SHARED_ENV_VAR, raising=False)
  assert attention.choose_shared(q, k, platform="gpu") == "ragged"    # auto, the default
  assert attention.choose_shared(q, k, platform="cpu") == "xla"
  assert attention.choose_shared(q, jnp.zeros((1, 2, 60, 16)), platform="gpu") == "xla"
  monkeypatch.setenv(attention.SHARED_ENV_VAR, "xla")
  assert attention.choose_shared(q, k, platform="gpu") == "xla"
  monkeypatch.setenv(attention.SHARED_ENV_VAR, "ragged")
  assert attention.choose_shared(q, k, platform="gpu") == "ragged"   # k read in q's dtype
  with pytest.raises(ValueError, match="DSPARK_JAX_SHARED_ATTENTION=ragged: .*'cpu'"):
    attention.choose_shared(q, k, platform="cpu")
  with pytest.raises(ValueError, match="S=60 are not a multiple"):
    attention.choose_shared(q, jnp.zeros((1, 2, 60, 16)), platform="gpu")
  monkeypatch.setenv(attention.SHARED_ENV_VAR, "cudnn")
  with pytest.raises(ValueError, match="expected one of auto, xla, ragged, got 'cudnn'"):
    attention.choose_shared(q, k)


@pytest.mark.kernel
def test_backward_kernels_skip_the_blocks_past_ascending_limits_and_stay_exact():
  # Ascending limits (anchors in order) over blocks of 16 slots: the dK/dV instances of the early
  # blocks see every query tile, the late ones skip most; T = 70 queries x G = 4 heads make three
  # query tiles of 32, the last short.
  rng = np.random.default_rng(3)
  b, t, n, heads, d, slots = 1, 70, 8, 2, 16, 128
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, heads, slots, d)), jnp.float32) for _ in range(2))
  limits = jnp.asarray(np.sort(rng.integers(0, slots + 1, (b, t)), axis=1), jnp.int32)
  weights = (jnp.asarray(rng.normal(size=(b, heads, n // heads, t)), jnp.float32),
             jnp.asarray(rng.normal(size=(b, heads, n // heads, t, d)), jnp.float32))
  with jax.default_matmul_precision("highest"):
    ref = jax.grad(_objective(attention.limited_part, weights), (0, 1, 2))(q, k, v, limits)
    out, lse = ragged_attention.ragged_attention(q, k, v, limits, interpret=INTERPRET)
    tokens = lambda x: jnp.moveaxis(x, 3, 1).reshape(b, t, n, *x.shape[4:])
    do, d_lse = tokens(weights[1]), jnp.where(jnp.isfinite(lse), tokens(weights[0]), 0.0)
    grads = shared_attention.backward_kernels(q, k, v, limits, do, lse,
                                              jnp.sum(do * out, axis=-1) - d_lse, block_kv=16,
                                              interpret=INTERPRET)
  for name, g, r in zip("qkv", grads, ref):
    assert _relative(g, r) < 1e-5, (name, _relative(g, r))


@pytest.mark.kernel
def test_under_a_data_parallel_mesh_the_kernel_runs_on_each_shard_of_the_batch(monkeypatch):
  # jit does not partition a Pallas kernel: inside `batch_sharded` (the Trainer's step with a
  # mesh) the kernel must see a device's rows only, and the values and gradients stay exact.
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 CPU devices)")
  from dspark_jax.parallel import placement
  rng = np.random.default_rng(5)
  b = 4
  q = jnp.asarray(rng.normal(size=(b, T, N, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, K, S, D)), jnp.float32) for _ in range(2))
  limits = jnp.asarray(rng.integers(0, S + 1, (b, T)), jnp.int32)
  weights = (jnp.asarray(rng.normal(size=(b, K, N // K, T)), jnp.float32),
             jnp.asarray(rng.normal(size=(b, K, N // K, T, D)), jnp.float32))
  rows = []
  kernel, backward = ragged_attention.ragged_attention, shared_attention.backward_kernels
  monkeypatch.setattr(ragged_attention, "ragged_attention", lambda q, *a, **kw: rows.append(
      q.shape[0]) or kernel(q, *a, **{**kw, "interpret": INTERPRET}))
  monkeypatch.setattr(shared_attention, "backward_kernels", lambda q, *a, **kw: rows.append(
      q.shape[0]) or backward(q, *a, **{**kw, "interpret": INTERPRET}))
  monkeypatch.setattr(attention, "_platform", lambda: "gpu")
  monkeypatch.setenv(attention.SHARED_ENV_VAR, "ragged")
  mesh = placement.make_mesh(1, 4)
  sharded = jax.device_put((q, k, v, limits),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
  step = jax.jit(jax.value_and_grad(_objective(attention.shared_limited_part, weights),
                                    (0, 1, 2)))
  with jax.default_matmul_precision("highest"), attention.batch_sharded(mesh, "dp"):
    value, grads = step(*sharded)
    ref_value, ref_grads = jax.value_and_grad(_objective(attention.limited_part, weights),
                                              (0, 1, 2))(q, k, v, limits)
  assert rows and set(rows) == {b // 4}            # forward and backward: one row a device
  assert float(value) == pytest.approx(float(ref_value), rel=1e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    assert _relative(g, r) < 1e-5, (name, _relative(g, r))
