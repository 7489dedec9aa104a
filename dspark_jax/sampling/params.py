"""Per-request sampling parameters: the `SamplingParams` pytree, its validation and normalisation.

This module owns what a *row* of a batch asks for (temperature, top-k, top-p, seed) and the rules that
turn those numbers into the two facts the samplers need (docs/exactness.md):

* a row is **greedy** iff ``temperature < GREEDY_TEMPERATURE`` or ``top_k == 1``;
* the **draft temperature** of a row is its temperature clamped to ``>= GREEDY_TEMPERATURE``.

``top_k <= 0`` means "no top-k truncation" and ``top_p == 1`` means "no top-p truncation" (SGLang spells
"off" as a huge top-k, which is why its greedy rule reads ``top_k <= 1``; ours reads ``top_k == 1``).
Draft sampling ignores top-k and top-p; the verifier applies them to the target.

Values given on the host are validated when the object is built: a bad value raises `ValueError` naming
the field and the first bad row. Inside ``jit`` (traced values) only shapes are checked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import validation

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy; draft temperatures are clamped to at least this."""

_FIELDS = ("temperature", "top_k", "top_p", "seed")
_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}
_HOST_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.uint32}


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _first_bad_row(bad: np.ndarray) -> int:
  return int(np.flatnonzero(bad)[0])


def _check_values(name: str, values: np.ndarray) -> np.ndarray:
  """Validates one host-side field and returns it in its canonical dtype."""
  if name in ("top_k", "seed"):
    if values.dtype.kind == "f":
      bad = ~np.isfinite(values) | (values != np.round(values))
      if bad.any():
        row = _first_bad_row(bad)
        raise ValueError(f"SamplingParams.{name}: row {row} is {values[row]}; must be an integer")
    elif values.dtype.kind not in "iub":
      raise ValueError(f"SamplingParams.{name}: expected integers, got dtype {values.dtype}")
    wide = values.astype(np.int64)
    if name == "seed":
      bad = (wide < 0) | (wide >= 2**32)
      if bad.any():
        row = _first_bad_row(bad)
        raise ValueError(f"SamplingParams.seed: row {row} is {wide[row]}; must be in [0, 2**32)")
    else:
      bad = (wide < np.iinfo(np.int32).min) | (wide > np.iinfo(np.int32).max)
      if bad.any():
        row = _first_bad_row(bad)
        raise ValueError(f"SamplingParams.top_k: row {row} is {wide[row]}; does not fit in int32")
    return wide.astype(_HOST_DTYPES[name])

  if values.dtype.kind not in "fiub":
    raise ValueError(f"SamplingParams.{name}: expected numbers, got dtype {values.dtype}")
  values = values.astype(np.float64)
  if name == "temperature":
    bad = ~np.isfinite(values) | (values < 0)
    rule = "must be finite and >= 0"
  else:  # top_p
    bad = ~np.isfinite(values) | (values <= 0) | (values > 1)
    rule = "must be in (0, 1]"
  if bad.any():
    row = _first_bad_row(bad)
    raise ValueError(f"SamplingParams.{name}: row {row} is {values[row]}; {rule}")
  with np.errstate(over="ignore"):  # the value the samplers see: check it too
    stored = values.astype(_HOST_DTYPES[name])
  if name == "temperature":
    bad = ~np.isfinite(stored)
  else:
    bad = ~(stored > 0) | (stored > 1)
  if bad.any():
    row = _first_bad_row(bad)
    raise ValueError(f"SamplingParams.{name}: row {row} is {values[row]}, which is {stored[row]} "
                     f"as float32; {rule} as float32")
  return stored


@jax.tree_util.register_pytree_node_class
class SamplingParams:
  """Sampling parameters of a batch of B requests, one row per request (a pytree of four [B] arrays).

  Args:
    temperature: [B] or scalar, float. ``< 1e-5`` means greedy. Default 1.0.
    top_k: [B] or scalar, int. ``<= 0`` = off, ``1`` = greedy. Default 0 (off).
    top_p: [B] or scalar, float in (0, 1]. ``1`` = off. Default 1.0.
    seed: [B] or scalar, int in [0, 2**32): the request's seed. A row's random stream depends only on
      (key, seed, position, stream), never on the other rows. Default: the row index, so the rows of
      one batch are independent; pass explicit seeds when a request must keep its stream across
      batches of different composition.
    batch_size: needed only when every given field is a scalar.

  Scalars are broadcast to [B]. Host values (Python, NumPy, concrete JAX arrays) are validated as the
  float32 / int32 / uint32 values the samplers will see and kept as read-only NumPy copies (the
  caller's arrays are neither kept nor changed), so `all_greedy` can be answered without touching
  the device. The fields are read-only: writing into one (``params.temperature[0] = 1.0``) raises
  NumPy's ``ValueError: assignment destination is read-only``, and assigning one raises
  ``AttributeError: SamplingParams is immutable``; build a new `SamplingParams` to change a value,
  so that it is validated again.

  Raises:
    ValueError: a field with a bad value (naming the field and the first bad row), a field that is not
      a scalar or a 1-D array, or fields of different lengths.
  """

  temperature: Any
  top_k: Any
  top_p: Any
  seed: Any

  def __init__(self, temperature=None, top_k=None, top_p=None, seed=None, *, batch_size=None):
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    lengths = {}
    for name, value in given.items():
      if value is None:
        continue
      ndim = np.ndim(value)
      if ndim > 1:
        raise ValueError(f"SamplingParams.{name}: expected a scalar or a [B] array, got shape "
                         f"{np.shape(value)}")
      if ndim == 1:
        lengths[name] = np.shape(value)[0]
    if batch_size is not None:
      lengths["batch_size"] = validation.check_positive_int("SamplingParams.batch_size",
                                                           batch_size)
    if len(set(lengths.values())) > 1:
      raise ValueError(f"SamplingParams: fields have different batch sizes {lengths}")
    if not lengths:
      raise ValueError("SamplingParams: cannot infer the batch size from scalars alone; "
                       "pass a [B] array or batch_size=B")
    (size,) = set(lengths.values())

    for name in _FIELDS:
      value = given[name]
      if value is None:
        value = np.arange(size, dtype=np.uint32) if name == "seed" else _DEFAULTS[name]
      if _is_traced(value):
        value = jnp.broadcast_to(jnp.asarray(value).astype(_HOST_DTYPES[name]), (size,))
      else:
        value = _check_values(name, np.broadcast_to(np.asarray(value), (size,)).copy())
        value.setflags(write=False)  # validated once: nobody changes it after
      object.__setattr__(self, name, value)

  # ---- pytree protocol -------------------------------------------------------------------------
  def tree_flatten(self):
    return tuple(getattr(self, f) for f in _FIELDS), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    obj = object.__new__(cls)
    for name, value in zip(_FIELDS, children):
      object.__setattr__(obj, name, value)
    return obj

  def __setattr__(self, name, value):
    raise AttributeError("SamplingParams is immutable; build a new one")

  def __repr__(self):
    body = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS)
    return f"SamplingParams({body})"

  # ---- derived quantities ------------------------------------------------------------------------
  @property
  def batch_size(self) -> int:
    return int(np.shape(self.temperature)[0])

  @property
  def greedy_mask(self) -> jax.Array:
    """[B] bool: rows decoded by argmax (temperature < 1e-5 or top_k == 1)."""
    return greedy_mask(self.temperature, self.top_k)

  @property
  def draft_temperature(self) -> jax.Array:
    """[B] float32: temperature clamped to >= 1e-5 (the temperature the draft samples at)."""
    return draft_temperature(self.temperature)

  def all_greedy(self) -> bool:
    """True iff every row is greedy. Host-side: needs concrete values (raises under jit)."""
    if any(_is_traced(getattr(self, f)) for f in _FIELDS):
      raise TypeError("SamplingParams.all_greedy() needs concrete values, not traced ones")
    temperature = np.asarray(self.temperature)
    top_k = np.asarray(self.top_k)
    return bool(np.all((temperature < GREEDY_TEMPERATURE) | (top_k == 1)))

  def padded(self, size: int) -> "SamplingParams":
    """Appends greedy rows (temperature 0, seed 0) up to `size` rows: the filler of a padding bucket."""
    extra = size - self.batch_size
    if extra < 0:
      raise ValueError(f"padded: size {size} is smaller than the batch ({self.batch_size} rows)")
    if extra == 0:
      return self
    fill = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    xp = jnp if any(_is_traced(getattr(self, f)) for f in _FIELDS) else np
    values = [xp.concatenate([getattr(self, f), xp.full((extra,), fill[f], dtype=_HOST_DTYPES[f])])
              for f in _FIELDS]
    if xp is np:
      for value in values:
        value.setflags(write=False)
    return SamplingParams.tree_unflatten(None, values)


def _xp(*values):
  """NumPy for host values (no device dispatch, nothing to compile), jax.numpy otherwise."""
  return np if all(isinstance(v, np.ndarray) for v in values) else jnp


def greedy_mask(temperature: jax.Array, top_k: jax.Array) -> jax.Array:
  """[B] bool: the greedy rule, ``temperature < 1e-5`` or ``top_k == 1``."""
  xp = _xp(temperature, top_k)
  return (xp.asarray(temperature) < GREEDY_TEMPERATURE) | (xp.asarray(top_k) == 1)


def draft_temperature(temperature: jax.Array) -> jax.Array:
  """[B] float32: ``max(temperature, 1e-5)``."""
  xp = _xp(temperature)
  return xp.maximum(xp.asarray(temperature, xp.float32), xp.float32(GREEDY_TEMPERATURE))
