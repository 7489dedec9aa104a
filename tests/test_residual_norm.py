"""The residual-norm kernel (`kernels.residual_norm`) against the XLA operations it replaces: a
layer's ``x + linear(a)`` and the `flax.nnx.RMSNorm` after it, alone and through a tiny target's
decode step, verify and packed verify, over contiguous and paged caches.

On the CPU the kernel runs in Pallas' interpreter; on a GPU host (``DSPARK_TEST_GPU=1``) the same
tests run the compiled Triton kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.kernels import residual_norm as rn
from tests import helpers

pytestmark = pytest.mark.kernel
INTERPRET = jax.default_backend() != "gpu"
BF16_ULP = 2.0 ** -8


def _layer_parts(seed, m, k, e, dtype):
  """a [M, K], a residual [M, E], an nnx.Linear K -> E and an nnx.RMSNorm(E) with random
  weights and scale."""
  rng = np.random.default_rng(seed)
  linear = nnx.Linear(k, e, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  linear.kernel[...] = jnp.asarray(rng.normal(size=(k, e)) / np.sqrt(k), dtype)
  norm = nnx.RMSNorm(e, epsilon=1e-6, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  norm.scale[...] = jnp.asarray(1 + 0.2 * rng.normal(size=e), dtype)
  a = jnp.asarray(rng.normal(size=(m, k)), dtype)
  residual = jnp.asarray(4 * rng.normal(size=(m, e)), dtype)
  return a, residual, linear, norm


def _close(got, want, dtype, units: int = 2):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  # bf16: a rounding may land one unit apart (the partial products and the squares are summed
  # in another order); float32: a few units of float32 rounding.
  tol = units * BF16_ULP if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.max(np.abs(want)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,e", [(3, 64, 48), (5, 4096, 2560)])
@pytest.mark.parametrize("form", ["partials", "projection"])
def test_kernel_equals_the_layers_own_add_and_norm(dtype, m, k, e, form):
  a, residual, linear, norm = _layer_parts(0, m, k, e, dtype)
  with jax.default_matmul_precision("highest"):            # a GPU's TF32 would blur float32
    h_want = residual + linear(a)
    normed_want = norm(h_want)
    y = rn.split_product(a, linear.kernel[...]) if form == "partials" else linear(a)
    h, normed = rn.residual_norm(y, residual, norm.scale[...], eps=norm.epsilon,
                                 interpret=INTERPRET)
    h_ref, normed_ref = rn.reference(y, residual, norm.scale[...], eps=norm.epsilon)
  assert h.shape == normed.shape == (m, e) and h.dtype == normed.dtype == jnp.dtype(dtype)
  _close(h, h_want, dtype)
  _close(normed, normed_want, dtype)
  _close(h_ref, h_want, dtype)
  _close(normed_ref, normed_want, dtype)


def test_a_planted_wrong_norm_is_caught():
  """Power check of the comparison above: a kernel whose epsilon is off by 1 (the norm of a row
  of unit scale then shrinks visibly) fails it."""
  a, residual, linear, norm = _layer_parts(1, 2, 64, 48, jnp.float32)
  residual = residual / 8
  y = rn.split_product(a, linear.kernel[...])
  _, normed = rn.residual_norm(y, residual, norm.scale[...], eps=1.0, interpret=INTERPRET)
  with pytest.raises(AssertionError):
    _close(normed, norm(residual + linear(a)), jnp.float32)


def test_split_product_sums_to_the_product():
  a, _, linear, _ = _layer_parts(2, 4, 96, 32, jnp.float32)
  for splits, parts in ((8, 8), (5, 1)):                   # 5 does not divide 96: one part
    p = rn.split_product(a, linear.kernel[...], splits)
    assert p.shape == (parts, 4, 32) and p.dtype == jnp.float32
    with jax.default_matmul_precision("highest"):
      np.testing.assert_allclose(p.sum(0), a @ linear.kernel[...], rtol=1e-5, atol=1e-5)


def test_preconditions_and_choose(monkeypatch):
  monkeypatch.delenv(rn.ENV_VAR, raising=False)
  row = jax.ShapeDtypeStruct((4, 2560), jnp.bfloat16)
  assert rn.choose(4, row, platform="gpu") == "pallas"
  assert rn.choose(rn.MAX_ROWS + 1, row, platform="gpu") == "xla"
  assert rn.choose(4, row, platform="cpu") == "xla"
  assert rn.choose(64, row, implementation="pallas", platform="cpu") == "interpret"
  assert rn.choose(4, row, implementation="xla", platform="gpu") == "xla"
  odd = jax.ShapeDtypeStruct((4, 2570), jnp.bfloat16)      # 2570 = 2 · 5 · 257: no chunk width
  assert rn.choose(4, odd, platform="gpu") == "xla"
  with pytest.raises(ValueError, match="E=2570 is not a multiple of a power of two"):
    rn.choose(4, odd, implementation="pallas", platform="gpu")
  monkeypatch.setenv(rn.ENV_VAR, "fused")
  with pytest.raises(ValueError, match="DSPARK_JAX_RESIDUAL_NORM"):
    rn.choose(4, row)
  residual = jnp.zeros((2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"partials are bfloat16, not float32"):
    rn.residual_norm(jnp.zeros((8, 2, 32), jnp.bfloat16), residual, jnp.ones(32), eps=1e-6)
  with pytest.raises(ValueError, match=r"partials \(8, 3, 32\) are not \[S, M=2, E=32\]"):
    rn.residual_norm(jnp.zeros((8, 3, 32)), residual, jnp.ones(32), eps=1e-6)
  with pytest.raises(ValueError, match="scale has 16 entries, not E=32"):
    rn.residual_norm(jnp.zeros((8, 2, 32)), residual, jnp.ones(16), eps=1e-6)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_target_through_the_kernel_equals_xla(monkeypatch, paged, dtype):
  """A decode step, a verify block and a packed verify of a tiny target over a cache of random
  context, through XLA and with the kernel forced: the same logits, features and caches."""
  target, cache, paged_cache, calls, rng = helpers.tiny_target_calls(dtype)
  cache = paged_cache if paged else cache
  b = 3
  packed = (jnp.asarray(rng.integers(0, 32, 8), jnp.int32),          # 2 + 1 + 3 tokens in 8
            jnp.asarray([0, 0, 1, 2, 2, 2, b, b], jnp.int32),
            jnp.asarray([0, 1, 0, 0, 1, 2, 0, 0], jnp.int32),
            jnp.asarray([5, 6, 20, 11, 12, 13, 0, 0], jnp.int32))
  outs = {}
  for implementation in ("xla", "pallas"):
    monkeypatch.setenv(rn.ENV_VAR, implementation)
    run = jax.jit(lambda tokens, positions, cache: target(tokens, positions, cache))
    run_packed = jax.jit(lambda args, cache: target.packed(*args, cache, 4))
    program = str(jax.make_jaxpr(run)(*calls[0], cache))
    assert ("name=residual_norm" in program) == (implementation == "pallas")
    with jax.default_matmul_precision("highest"):
      outs[implementation] = ([run(tokens, positions, cache) for tokens, positions in calls]
                              + [run_packed(packed, cache)])
  for got, want in zip(outs["pallas"], outs["xla"], strict=True):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      # bf16: a unit apart in one layer's rounding moves the next projections' sums by a few
      # units of the largest entry (two layers and the LM head here).
      _close(g, w, dtype, units=8)
