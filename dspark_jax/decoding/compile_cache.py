"""The compile cache of the decode programs: each compiled once per process and shape.

This module owns `_COMPILED` and `compiled`: a program (the fixed batch's decode, the queue's
refill and chunk) compiled ahead of time for its arguments' shapes and dtypes and its static
keywords, so calls in the same padding buckets never recompile (a schedule is part of the key by
identity: reuse the object), `compiled_programs`, their count (for compile guards), and
`compile_log`, what each compilation cost.

It also owns compiling in the background (`compiling_ahead`, `Deferred`): a caller that will
meet several programs (`Engine.warm_up`) first runs each call only until its first new program,
which is lowered and queued on a pool of threads (XLA compiles without Python's lock), then runs
them for real, each waiting for its own program only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import Any

import jax
import numpy as np

_COMPILED: dict[tuple, Any] = {}
"""Compiled decode programs of this process, keyed by everything that fixes their shape."""

_LOG: list[tuple[str, float]] = []
"""(program name, seconds) of every compilation of this process, in order."""

_PENDING: dict[tuple, concurrent.futures.Future] = {}
"""Programs queued by `compiling_ahead` and not yet asked for: signature -> (program, seconds)."""

_AHEAD: list[concurrent.futures.ThreadPoolExecutor] = []
"""The pool of the innermost `compiling_ahead` block, if one is open."""


class Deferred(Exception):  # noqa: N818 - a signal, not an error
  """Raised by `compiled` inside `compiling_ahead` for a program it has queued for compilation:
  the call that needed it stops there, and a later call (outside the block) gets the program."""


@contextlib.contextmanager
def compiling_ahead(workers: int):
  """Inside this block, `compiled` meeting a program neither compiled nor queued lowers it here,
  queues its compilation on a pool of `workers` threads and raises `Deferred`.

  The compilations go on after the block. A later `compiled` call for a queued program waits for
  that one only, and counts its wait as its compile seconds (the log has each program's own);
  `wait_ahead` waits for all. Lowering (tracing) stays on the calling thread; compiler options
  are the process's (jax's thread-local configuration contexts do not reach the pool).
  """
  if workers < 1:
    raise ValueError(f"workers: expected at least 1, got {workers}")
  pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile-ahead")
  _AHEAD.append(pool)
  try:
    yield
  finally:
    _AHEAD.remove(pool)
    pool.shutdown(wait=False)


def wait_ahead() -> None:
  """Waits for every program `compiling_ahead` queued and stores it (raising the first error)."""
  for signature in list(_PENDING):
    _take_pending(signature)


def _compile(lowered) -> tuple[Any, float]:
  start = time.perf_counter()
  program = lowered.compile()
  return program, time.perf_counter() - start


def _take_pending(signature: tuple) -> Any:
  """The queued program of `signature`, waited for, stored and logged."""
  future = _PENDING[signature]
  try:
    program, seconds = future.result()
  finally:
    del _PENDING[signature]
  _COMPILED[signature] = program
  _LOG.append((signature[0], seconds))
  return program


def compiled(fn, args: tuple, statics: dict, donate: tuple[int, ...] = ()) -> tuple[Any, float]:
  """`fn` compiled ahead of time for `args`' shapes and dtypes and the `statics` keywords, from
  `_COMPILED` when it holds that program; and the seconds spent compiling it here (0 when cached).
  `donate`: positions of arguments whose buffers the program may reuse for its outputs."""
  # The tree structure (hashable) and each leaf's shape and dtype: the host computes this at
  # every refill and chunk of the queue, so it avoids printing the tree (7x faster at Qwen3-4B).
  leaves, structure = jax.tree_util.tree_flatten(args)
  signature = (getattr(fn, "__qualname__", repr(fn)), structure,
               tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves),
               tuple(statics.items()), donate)
  program = _COMPILED.get(signature)
  if program is not None:
    return program, 0.0
  start = time.perf_counter()
  if signature in _PENDING and not _AHEAD:
    program = _take_pending(signature)
    return program, time.perf_counter() - start
  if _AHEAD:
    if signature not in _PENDING:
      lowered = jax.jit(fn, static_argnames=tuple(statics), donate_argnums=donate).lower(
          *args, **statics)
      _PENDING[signature] = _AHEAD[-1].submit(_compile, lowered)
    raise Deferred(signature[0])
  program = jax.jit(fn, static_argnames=tuple(statics), donate_argnums=donate).lower(
      *args, **statics).compile()
  _COMPILED[signature] = program
  seconds = time.perf_counter() - start
  _LOG.append((signature[0], seconds))
  return program, seconds


def compiled_programs() -> int:
  """How many decode programs this process has compiled or queued (for compile guards)."""
  return len(_COMPILED) + len(_PENDING)


def compile_log() -> list[tuple[str, float]]:
  """(program name, seconds) of every decode program this process compiled, in order (a copy)."""
  return list(_LOG)
