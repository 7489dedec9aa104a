"""How the distribution checks compile their compute-bound programs.

The test suite compiles its many small programs at XLA's lowest backend optimisation level
(``--xla_backend_optimization_level=0`` in ``XLA_FLAGS``, set by ``tests/conftest.py``): they run
once and compile faster that way. A law check's program is the opposite: it runs hundreds of
thousands of rows, and at level 0 its generated code is several times slower. `compute_bound_jit`
compiles such a program at level 1 where the environment asks for less, and at XLA's defaults
otherwise. The level changes how the code is generated, not its arithmetic.
"""

from __future__ import annotations

import os
from typing import Callable

import jax


def compute_bound_options() -> dict:
  """XLA compile options for a compute-bound program: ``{"xla_backend_optimization_level": 1}``
  where ``XLA_FLAGS`` sets the backend's level below 1, else ``{}`` (XLA's defaults)."""
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    if name == "--xla_backend_optimization_level" and value.isdigit() and int(value) < 1:
      return {"xla_backend_optimization_level": 1}
  return {}


def compute_bound_jit(fn: Callable, **jit_kwargs) -> Callable:
  """``jax.jit(fn, **jit_kwargs)`` compiled with `compute_bound_options`. Every jitted function
  that `fn` calls is inlined into the one program, so the options reach all of it."""
  return jax.jit(fn, compiler_options=compute_bound_options(), **jit_kwargs)
