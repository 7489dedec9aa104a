"""A layer's residual adds and the RMSNorms after them in one kernel, at a few tokens.

A decoder layer ends each half with a projection added to the residual stream, and the next half
starts with an RMSNorm of the sum: ``h = x + o_proj(a)``, ``post_norm(h)``; ``h' = h + down(m)``,
the next layer's ``input_norm(h')``. At 1–16 tokens XLA runs each as two or three small kernels
(the projection's split-K reduction with its rounding, the add, the norm's sum of squares), each a
few kilobytes of work at a launch's cost, four to six a layer. `residual_norm` does one of them in
one Pallas kernel (Triton lowering on GPUs, Pallas' interpreter on the CPU), one instance per
token:

* it sums the projection's S split-K partial products ([S, M, E] float32, `split_product`) in
  float32 and rounds the sum to the compute dtype, as the projection itself rounds its output;
* adds the residual row in float32 and rounds (a bf16 add);
* normalises the sum as `flax.nnx.RMSNorm` does: ``h · rsqrt(mean(h²) + eps) · scale`` in
  float32, rounded to the dtype;
* stores both: the new residual stream ``h`` and the next projection's input.

The row is walked in chunks of C columns (the largest power of two up to 1024 dividing E), kept
in registers between the sum of squares and the normalisation.

Wherever `choose` does not take it, the model computes the same in XLA (`reference`, the layer's
own ``x + linear(a)`` and norm). Values equal XLA's within bf16 rounding: the partial products
are summed in another order than XLA's own split-K, and the mean of squares too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.kernels import dispatch

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
NUM_WARPS = 4
MAX_ROWS = 16
"""`choose`'s ``auto`` takes the kernel up to this many tokens a call (where a launch costs more
than the work); more tokens stay with XLA, whose GEMMs then do not split K."""
SPLITS = 8
"""Split-K partial products the model computes for the kernel (`split_product`) where the
projection's input width allows (else one)."""
MAX_CHUNKS = 64


def chunk_width(hidden: int) -> int | None:
  """C: the largest power of two up to 1024 dividing `hidden`, at least 16; None if there is
  none or the row needs more than `MAX_CHUNKS` chunks."""
  for width in (1024, 512, 256, 128, 64, 32, 16):
    if hidden % width == 0:
      return width if hidden // width <= MAX_CHUNKS else None
  return None


def precondition(partials, residual, scale) -> str | None:
  """The first failed precondition of `residual_norm`, in words, or None.

  partials [S, M, E] float32 (split-K partial products) or [M, E] (the projection's output, in
  the residual's dtype); residual [M, E] and scale [E]. Requires: those ranks and matching
  sizes; the residual's dtype among bfloat16, float16, float32; E with a chunk width
  (`chunk_width`).
  """
  if residual.ndim != 2 or scale.ndim != 1:
    return f"residual must be [M, E] and scale [E], got shapes {residual.shape} and {scale.shape}"
  m, e = residual.shape
  if partials.ndim == 3:
    if partials.shape[1:] != (m, e):
      return f"partials {partials.shape} are not [S, M={m}, E={e}]"
    if jnp.dtype(partials.dtype) != jnp.dtype(jnp.float32):
      return f"partials are {jnp.dtype(partials.dtype).name}, not float32"
  elif partials.shape != (m, e):
    return f"the projection {partials.shape} is not [M={m}, E={e}] (or [S, M, E] partials)"
  elif jnp.dtype(partials.dtype) != jnp.dtype(residual.dtype):
    return (f"the projection ({jnp.dtype(partials.dtype).name}) and the residual "
            f"({jnp.dtype(residual.dtype).name}) differ")
  if scale.shape[0] != e:
    return f"scale has {scale.shape[0]} entries, not E={e}"
  if jnp.dtype(residual.dtype) not in [jnp.dtype(x) for x in DTYPES]:
    return f"dtype {jnp.dtype(residual.dtype).name} is not bfloat16, float16 or float32"
  if chunk_width(e) is None:
    return (f"E={e} is not a multiple of a power of two in 16..1024 with at most "
            f"{MAX_CHUNKS} chunks")
  return None


def split_product(a: jax.Array, kernel: jax.Array, splits: int | None = None) -> jax.Array:
  """[M, K] @ [K, E] as S float32 partial products [S, M, E] over S slices of K (S = `splits`,
  default `SPLITS`, where it divides K, else 1): what `residual_norm` sums."""
  m, k = a.shape
  splits = SPLITS if splits is None else splits
  s = splits if k % splits == 0 else 1
  with jax.named_scope("split_k"):  # a projection, not a batched product, to bench_profile
    return jnp.einsum("msk,ske->sme", a.reshape(m, s, k // s), kernel.reshape(s, k // s, -1),
                      preferred_element_type=jnp.float32)


def reference(partials, residual, scale, *, eps: float):
  """`residual_norm` in XLA: the projection's sum rounded, the residual added, the sum
  normalised as `flax.nnx.RMSNorm` -> ``(h, normed)``."""
  y = partials.sum(0).astype(residual.dtype) if partials.ndim == 3 else partials
  h = residual + y
  x = h.astype(jnp.float32)
  mul = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return h, (x * (mul * scale.astype(jnp.float32))).astype(residual.dtype)


def _kernel(partials_ref, residual_ref, scale_ref, h_ref, normed_ref, *, splits: int,
            width: int, eps: float):
  """One token m: partials_ref [S, M, E] float32 (S = `splits`) or [M, E], residual_ref [M, E],
  scale_ref [E]; writes row m of h_ref and normed_ref [M, E]."""
  m = pl.program_id(0)
  hidden = residual_ref.shape[1]
  dtype = residual_ref.dtype
  rows, squares = [], jnp.zeros((), jnp.float32)
  for c in range(hidden // width):
    cols = pl.ds(c * width, width)
    if splits:
      total = partials_ref[0, m, cols]
      for s in range(1, splits):
        total = total + partials_ref[s, m, cols]
      y = total.astype(dtype)
    else:
      y = partials_ref[m, cols]
    h = (y.astype(jnp.float32) + residual_ref[m, cols].astype(jnp.float32)).astype(dtype)
    h_ref[m, cols] = h
    x = h.astype(jnp.float32)
    squares = squares + jnp.sum(x * x)
    rows.append(x)
  mul = jax.lax.rsqrt(squares / hidden + eps)
  for c, x in enumerate(rows):
    cols = pl.ds(c * width, width)
    normed_ref[m, cols] = (x * (mul * scale_ref[cols].astype(jnp.float32))).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def residual_norm(partials, residual, scale, *, eps: float, interpret: bool = False):
  """The residual stream after a projection, and its RMSNorm, for M tokens.

  Args:
    partials: [S, M, E] float32 split-K partial products of the projection (`split_product`), or
      its [M, E] output in the residual's dtype.
    residual: [M, E], the stream the projection is added to.
    scale: [E], the norm's scale. eps: its epsilon.
    interpret: run in Pallas' interpreter (CPU).

  Returns:
    ``(h, normed)``, both [M, E] in the residual's dtype: ``h = residual + round(Σ partials)``
    and ``normed = RMSNorm(h)`` (`reference`).

  Raises:
    ValueError: naming the failed precondition (`precondition`).
  """
  failed = precondition(partials, residual, scale)
  if failed:
    raise ValueError(f"residual_norm: precondition failed: {failed}")
  m, e = residual.shape
  kernel = functools.partial(_kernel, splits=partials.shape[0] if partials.ndim == 3 else 0,
                             width=chunk_width(e), eps=float(eps))
  out = jax.ShapeDtypeStruct((m, e), residual.dtype)
  return tuple(pl.pallas_call(
      kernel,
      grid=(m,),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=[pl.no_block_spec] * 2,
      out_shape=[out, out],
      name="residual_norm",
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
  )(partials, residual, scale))


ENV_VAR = "DSPARK_JAX_RESIDUAL_NORM"


def choose(rows: int, residual, implementation: str | None = None,
           platform: str | None = None) -> str:
  """``"pallas"`` (the kernel, compiled), ``"interpret"`` (in Pallas' interpreter) or ``"xla"``
  for `rows` tokens of a `residual` stream [..., E] (shape and dtype only).

  ``auto`` (the default; ``$DSPARK_JAX_RESIDUAL_NORM`` or `implementation` overrides it) takes
  the compiled kernel on a GPU up to `MAX_ROWS` tokens where `precondition` holds, else ``xla``.
  An explicit ``pallas`` runs the kernel at any number of tokens where the precondition holds, in
  the interpreter off the GPU (slowly: for tests), and raises where it fails.

  Raises:
    ValueError: an unknown implementation, or ``pallas`` where the precondition fails.
  """
  e = residual.shape[-1]
  row = jax.ShapeDtypeStruct((rows, e), residual.dtype)
  return dispatch.choose_layer_kernel(
      "residual norm", ENV_VAR, implementation,
      lambda: precondition(row, row, jax.ShapeDtypeStruct((e,), residual.dtype)),
      auto=rows <= MAX_ROWS, platform=platform)
