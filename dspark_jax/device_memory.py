"""Free device memory: how many bytes the device (or, for the CPU backend, the host) has left.

This module owns the probe that the memory gate (`draft.memory_gate`) and the paged pool's sizing
(`paging.allocator.pool_pages`) both read, and the headroom they leave by default:

Free memory: ``bytes_limit - bytes_in_use`` from the device's memory statistics (with fallbacks,
`free_bytes_from_stats`). Devices that report nothing: the CPU backend allocates from host RAM, so its
free memory is the host's available memory (``MemAvailable``); on any other device with no statistics
the free memory is unknown (None).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

import jax

DEFAULT_HEADROOM_BYTES = 2**30
"""The margin the gate and the pool sizing leave free by default (1 GiB)."""


def _stat(stats: Mapping[str, Any], name: str) -> int:
  """One memory statistic: a finite number >= 0, or ValueError naming it."""
  value = stats[name]
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"memory_stats: {name} is {value!r}; expected a number of bytes") from None
  if not math.isfinite(number) or number < 0:
    raise ValueError(f"memory_stats: {name} is {value!r}; expected a finite number >= 0")
  return int(number)


def free_bytes_from_stats(stats: Mapping[str, Any] | None) -> int | None:
  """Free device memory from a ``jax.Device.memory_stats()``-shaped mapping, or None if unknowable.

  limit: ``bytes_limit``, else ``bytes_reservable_limit``; in use: ``bytes_in_use``, else
  ``bytes_reserved``, else 0. With no limit at all, ``largest_free_block_bytes`` if present.

  Raises:
    ValueError: `stats` is not a mapping, or a statistic it uses is not a finite number >= 0.
  """
  if stats is None:
    return None
  if not isinstance(stats, Mapping):
    raise ValueError(f"memory_stats: expected a mapping like jax.Device.memory_stats(), got "
                     f"{type(stats).__name__}")
  if not stats:
    return None
  limit_name = next((n for n in ("bytes_limit", "bytes_reservable_limit") if n in stats), None)
  if limit_name is None:
    if "largest_free_block_bytes" not in stats:
      return None
    return _stat(stats, "largest_free_block_bytes")
  limit = _stat(stats, limit_name)
  use_name = next((n for n in ("bytes_in_use", "bytes_reserved") if n in stats), None)
  in_use = 0 if use_name is None else _stat(stats, use_name)
  return max(limit - in_use, 0)


def host_available_bytes() -> int | None:
  """The host's available memory (``MemAvailable``, else free pages), or None."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def probe_free_bytes(memory_stats: Mapping[str, Any] | Callable[[], Any] | None = None,
                     device: jax.Device | None = None) -> tuple[int | None, str]:
  """Free memory (for the gate, or the pool) and where the number came from.

  Args:
    memory_stats: a mapping shaped like ``jax.Device.memory_stats()``, or a callable returning one (or
      None); when None, the device's own statistics are read.
    device: the device to probe (default: the first local device).
  """
  if callable(memory_stats):
    memory_stats = memory_stats()
    source = "memory_stats callable"
  elif memory_stats is not None:
    source = "memory_stats mapping"
  else:
    device = device or jax.local_devices()[0]
    memory_stats = device.memory_stats()
    source = f"{device.platform} device memory_stats()"
    if not memory_stats and device.platform == "cpu":
      return host_available_bytes(), "host MemAvailable (the CPU backend allocates host RAM)"
  free = free_bytes_from_stats(memory_stats)
  return free, source if free is not None else f"{source}: reported nothing usable"
