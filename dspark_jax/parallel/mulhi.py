"""A lowering of ``lax.mulhi`` for programs that span several devices (a JAX workaround).

This module owns `partitionable_mulhi`, registered when ``dspark_jax.parallel`` is imported, on the
JAX versions that need it (its docstring says which and why): the verifier's Philox noise calls
``lax.mulhi``, whose JAX lowering fails to compile in programs over two or more devices. Programs
over several devices get an exact multiply of half-width parts; one-device programs keep JAX's own
lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _mulhi_by_halves(x, y):
  """The high half of the product of two same-shape integer arrays, exactly, in their own dtype:
  each operand split into halves of ``bits / 2`` so no partial product overflows."""
  dtype = np.dtype(x.dtype)
  bits = 8 * dtype.itemsize
  unsigned = np.dtype(f"u{dtype.itemsize}")
  half, mask = unsigned.type(bits // 2), unsigned.type((1 << (bits // 2)) - 1)
  ux, uy = (jax.lax.bitcast_convert_type(v, unsigned) for v in (x, y))
  xh, xl, yh, yl = ux >> half, ux & mask, uy >> half, uy & mask
  low, cross1, cross2 = xl * yl, xh * yl, xl * yh
  carry = ((low >> half) + (cross1 & mask) + (cross2 & mask)) >> half
  high = xh * yh + (cross1 >> half) + (cross2 >> half) + carry
  if dtype.kind == "i":       # two's complement: subtract y where x < 0 and x where y < 0
    zero = unsigned.type(0)
    high = high - jnp.where(x < 0, uy, zero) - jnp.where(y < 0, ux, zero)
  return jax.lax.bitcast_convert_type(high, dtype)


def _needs_partitionable_mulhi() -> bool:
  """JAX from 0.10.2 on: ``lax.mulhi`` lowers to ``chlo.mulhi`` (jax-ml/jax commit 84624e9,
  "Add `mulhi` primitive"; Philox built on it in 93f7106), which XLA's sharding pipeline fails
  to convert back once a program spans several devices."""
  return hasattr(jax.lax, "mulhi_p") and jax.__version_info__ >= (0, 10, 2)


def partitionable_mulhi() -> bool:
  """Registers a lowering of ``lax.mulhi`` that lowers programs over several devices exactly, as
  a multiply of half-width parts (`_mulhi_by_halves`: the same integers), and one-device programs
  as before (JAX's ``chlo.mulhi``). Returns whether it is registered.

  The bug it works around (jax 0.10.2 with jaxlib 0.10.2, Shardy on): a jitted program over a
  mesh of two or more devices that calls ``lax.mulhi`` (Philox: ``jax.random`` with the
  ``philox4x32`` implementation, the verifier's noise, `sampling.sampler.NOISE_PRNG_IMPL`) fails
  to compile with ``failed to legalize operation 'mhlo.unknown'`` / ``INTERNAL: Unable to convert
  MHLO to StableHLO``; the same program on one device compiles. JAX's own lowering is unchanged at
  jax v0.11.0 (and its repository's head of 2026-08-08), so no release is known to fix it: the
  rule is registered on every JAX that has ``lax.mulhi`` (`_needs_partitionable_mulhi`).
  Idempotent; JAX's rule stays where its internals differ from those read here.
  """
  global _MULHI_RULE
  if _MULHI_RULE is not None:
    return _MULHI_RULE is not False
  _MULHI_RULE = False
  if not _needs_partitionable_mulhi():
    return False
  try:
    from jax._src.interpreters import mlir
    primitive = jax.lax.mulhi_p
    entry = mlir._lowerings[primitive]
    own, inline = entry.rule, entry.inline
  except (ImportError, AttributeError, KeyError):
    return False
  by_halves = mlir.lower_fun(_mulhi_by_halves, multiple_results=False)

  def rule(ctx, *args, **params):
    context = ctx.module_context.axis_context
    if getattr(context, "num_devices", None) == 1:
      return own(ctx, *args, **params)
    return by_halves(ctx, *args, **params)

  mlir.register_lowering(primitive, rule, inline=inline)
  _MULHI_RULE = rule
  return True


_MULHI_RULE = None
partitionable_mulhi()
