"""Argument checks shared by the public functions: every bad input named, with its first bad element.

This module owns the rules that more than one public function applies to what a user passes in:

* `as_array`: lists and tuples become arrays; anything else that is not array-like is refused;
* `check_batch`: a [B] vector (of integers, by default);
* `check_range`: integer values in [low, high), checked after widening to int64, so that a value
  that would wrap when narrowed (2**32 + 3 as int32 is 3) is refused rather than wrapped;
* `check_key`: one PRNG key, typed (``jax.random.key``) or raw (``jax.random.PRNGKey``: uint32 [2]);
* `check_positive_int` / `check_nonnegative_int`: static sizes (batch sizes, γ, vocabularies);
* `check_path`: a file or directory argument (str or ``os.PathLike``);
* `check_dtype`: a model's compute and storage dtype (`COMPUTE_DTYPES`).

Values that are being traced (inside the user's ``jit`` or ``vmap``) cannot be inspected: only their
shapes and dtypes are checked, and the caller's documentation says what a bad value then does.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

POSITION_LIMIT = 2**31
"""Absolute positions lie in [0, 2**31): they index int32 arrays and feed the row streams."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes the models' layers compute and store their weights in."""


def is_traced(x: Any) -> bool:
  """Whether `x` is a tracer (its values are unknown until the program runs)."""
  return isinstance(x, jax.core.Tracer)


def as_array(name: str, value: Any) -> Any:
  """`value` as an array: arrays pass through, lists and tuples of numbers are converted.

  Raises:
    TypeError: `value` is None, a string, a mapping or anything else that is not array-like.
  """
  if isinstance(value, (np.ndarray, jax.Array)) or is_traced(value):
    return value
  if isinstance(value, (list, tuple, numbers.Number, np.generic)):
    try:
      array = np.asarray(value)
    except ValueError as error:  # ragged nesting
      raise TypeError(f"{name}: expected an array or a (nested) list of numbers of one shape, "
                      f"got a ragged {type(value).__name__}{_ragged_entry(value)}") from error
    if array.dtype.kind not in "biuf":
      raise TypeError(f"{name}: expected numbers, got {type(value).__name__} of {array.dtype}")
    return array
  raise TypeError(f"{name}: expected an array, got {type(value).__name__}")


def _ragged_entry(value) -> str:
  """Where a ragged nesting first breaks: ", entry i has shape s, entry 0 has t" (or "")."""
  shapes = []
  for entry in value:
    try:
      shapes.append(np.shape(entry))
    except ValueError:
      return f" (entry {len(shapes)} is itself ragged)"
    if shapes[-1] != shapes[0]:
      return f" (entry {len(shapes) - 1} has shape {shapes[-1]}, entry 0 has {shapes[0]})"
  return ""


def first_index(bad: np.ndarray) -> tuple[int, ...]:
  """The index of the first true element of the boolean array `bad` (C order)."""
  return tuple(int(i) for i in np.argwhere(bad)[0])


def _where(index: tuple) -> str:
  return f"element {list(index)}" if len(index) > 1 else f"row {index[0]}"


def check_batch(name: str, value, batch: int, *, integer: bool = True) -> None:
  """Raises ValueError unless `value` is a [batch] array (of integers when `integer`)."""
  shape = np.shape(value)
  if shape != (batch,):
    raise ValueError(f"{name}: expected shape ({batch},), got {shape}")
  dtype = np.result_type(value) if not hasattr(value, "dtype") else value.dtype
  if integer and not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name}: expected integers, got dtype {dtype}")


def check_range(name: str, value, low: int, high: int, *, what: str | None = None) -> None:
  """Raises ValueError naming the first element of `value` outside [low, high) (concrete values
  only; a traced value is not checked). Integers are compared as int64, before any narrowing."""
  if is_traced(value):
    return
  array = np.asarray(value)
  if array.size == 0:
    return
  if array.dtype.kind == "u":
    wide = array.astype(np.uint64)
    bad = (wide >= np.uint64(high)) if high > 0 else np.ones(array.shape, bool)
    bad |= wide < np.uint64(max(low, 0))
  else:
    wide = array.astype(np.int64)
    bad = (wide < low) | (wide >= high)
  if bad.any():
    index = first_index(bad)
    rule = what or f"must be in [{low}, {high})"
    raise ValueError(f"{name}: {_where(index)} is {array[index]}; {rule}")


def check_key(name: str, key) -> None:
  """Raises ValueError unless `key` is one PRNG key: a typed key of shape () or a raw uint32 [2].

  A batch of keys, an integer, a float array or a key of another shape is refused: the library
  derives every row's stream from one base key (`dspark_jax.sampling.sampler.row_keys`).
  """
  dtype = getattr(key, "dtype", None)
  if dtype is None:
    raise ValueError(f"{name}: expected a PRNG key (jax.random.key(seed)), got "
                     f"{type(key).__name__}")
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise ValueError(f"{name}: expected one key, got a batch of keys of shape {np.shape(key)}")
    return
  if dtype != np.uint32 or np.shape(key) != (2,):
    raise ValueError(f"{name}: expected a typed key (jax.random.key) or a raw uint32 [2] key, "
                     f"got dtype {dtype} and shape {np.shape(key)}")


def _int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
    raise ValueError(f"{name}: expected an integer, got {value!r}")
  return int(value)


def check_positive_int(name: str, value) -> int:
  """`value` as an int, or ValueError unless it is an integer >= 1."""
  value = _int(name, value)
  if value < 1:
    raise ValueError(f"{name}: must be >= 1, got {value}")
  return value


def check_nonnegative_int(name: str, value) -> int:
  """`value` as an int, or ValueError unless it is an integer >= 0."""
  value = _int(name, value)
  if value < 0:
    raise ValueError(f"{name}: must be >= 0, got {value}")
  return value


def check_path(name: str, value) -> str:
  """`value` as a str path, or TypeError naming `name` unless it is a str or ``os.PathLike``."""
  if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
    raise TypeError(f"{name}: expected a path (str or os.PathLike), got {type(value).__name__} "
                    f"{value!r}")
  return os.fspath(value)


def check_dtype(name: str, value) -> np.dtype:
  """`value` as a dtype, or ValueError naming `name` unless it is one of `COMPUTE_DTYPES` (a name
  such as "bfloat16", a NumPy / JAX dtype or scalar type)."""
  try:
    dtype = jnp.dtype(value.removeprefix("torch.") if isinstance(value, str) else value)
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or dtype.name not in COMPUTE_DTYPES:
    shown = value if dtype is None else dtype.name
    raise ValueError(f"{name}: {shown!r} is not supported; the layers compute in "
                     f"{', '.join(COMPUTE_DTYPES)}")
  return dtype
