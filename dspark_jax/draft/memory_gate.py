"""The memory gate: whether the folded *sampling* variant is built, decided once at build time.

Modes (`FoldedSampling`), chosen by argument or by the environment variable
``DSPARK_JAX_FOLDED_SAMPLING`` (``off`` | ``auto`` | ``force``, any case; default ``auto``):

* ``OFF``: only the greedy-only variant is folded; mixed batches run eagerly.
* ``FORCE``: the sampling variant is always built.
* ``AUTO``: built iff ``free - need >= headroom`` (headroom 1 GiB by default), where
  ``need = max_bs * V * 4 + max_bs * γ * V * itemsize(logits dtype)``: SGLang's estimate of its float32
  exponential-noise buffer plus the corrected-logits buffer. Our program needs no noise buffer (the
  Gumbel noise is generated inside the argmax), so the formula over-counts by ``max_bs * V * 4``; we
  keep it for parity with the reference decision and record XLA's own memory analysis of the compiled
  variant (``compiled_bytes`` = outputs + temporaries) beside it.

Free memory: ``bytes_limit - bytes_in_use`` from the device's memory statistics (with fallbacks,
`free_bytes_from_stats`). Devices that report nothing: the CPU backend allocates from host RAM, so its
free memory is the host's available memory (``MemAvailable``); on any other device with no statistics
the free memory is unknown and AUTO keeps the greedy-only folding (it cannot prove the buffers fit), with
the usual warning that names FORCE.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np

ENV_VAR = "DSPARK_JAX_FOLDED_SAMPLING"
DEFAULT_HEADROOM_BYTES = 2**30
logger = logging.getLogger("dspark_jax")


class FoldedSampling(enum.Enum):
  """Whether the folded draft proposal also covers sampled rows."""

  OFF = "off"
  AUTO = "auto"
  FORCE = "force"


def resolve_mode(mode: "FoldedSampling | str | None" = None,
                 environ: Mapping[str, str] | None = None) -> FoldedSampling:
  """The mode from the argument, else from ``$DSPARK_JAX_FOLDED_SAMPLING``, else AUTO.

  Raises:
    ValueError: an unknown mode string (from the argument or the environment variable).
  """
  if isinstance(mode, FoldedSampling):
    return mode
  source = "mode"
  if mode is None:
    environ = os.environ if environ is None else environ
    mode = environ.get(ENV_VAR)
    source = f"${ENV_VAR}"
    if mode is None or mode.strip() == "":
      return FoldedSampling.AUTO
  if not isinstance(mode, str):
    raise ValueError(f"{source}: expected a FoldedSampling or one of off|auto|force, got {mode!r}")
  try:
    return FoldedSampling(mode.strip().lower())
  except ValueError:
    raise ValueError(f"{source}: expected one of off|auto|force (any case), got {mode!r}") from None


def sampling_need_bytes(max_batch_size: int, vocab_size: int, gamma: int, logits_dtype, *,
                        store_logits: bool = True, rank: int = 0) -> int:
  """The estimate: float32 noise [max_bs, V] + corrected logits [max_bs, γ, V].

  With ``store_logits=False`` (`proposal.CompactLogits`) the logits term becomes what the block
  keeps instead: float32 log q [max_bs, γ] and the head's vectors [max_bs, γ, `rank`] (counted at
  the logits' itemsize).
  """
  itemsize = np.dtype(logits_dtype).itemsize
  kept = vocab_size * itemsize if store_logits else 4 + rank * itemsize
  return max_batch_size * vocab_size * 4 + max_batch_size * gamma * kept


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
  """Free memory for the gate and where the number came from.

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


@dataclasses.dataclass(frozen=True)
class GateDecision:
  """Why the folded sampling variant is on or off.

  Attributes:
    mode: the resolved `FoldedSampling` mode.
    folded_sampling: whether the sampling variant is built and used for mixed batches.
    need_bytes: the estimate for the sampling buffers.
    free_bytes: free memory seen at build time (None if unknown or not probed).
    headroom_bytes: the margin AUTO demands beyond `need_bytes`.
    compiled_bytes: XLA's memory analysis of the compiled sampling variant at the largest bucket
      (outputs + temporaries), or None when it was not compiled.
    reason: one sentence a person can read.
  """

  mode: FoldedSampling
  folded_sampling: bool
  need_bytes: int
  free_bytes: int | None
  headroom_bytes: int
  compiled_bytes: int | None
  reason: str

  def summary(self) -> str:
    def mib(n):
      return "unknown" if n is None else f"{n / 2**20:,.1f} MiB"
    return (f"mode={self.mode.name} folded_sampling={self.folded_sampling} "
            f"need={mib(self.need_bytes)} free={mib(self.free_bytes)} "
            f"headroom={mib(self.headroom_bytes)} compiled={mib(self.compiled_bytes)}\n"
            f"  reason: {self.reason}")


def decide(mode: FoldedSampling, need_bytes: int, free_bytes: int | None, headroom_bytes: int,
           free_source: str = "") -> tuple[bool, str]:
  """The gate's rule. Returns ``(folded_sampling, reason)``."""
  if mode is FoldedSampling.OFF:
    return False, "mode OFF: mixed batches use the eager proposal"
  if mode is FoldedSampling.FORCE:
    return True, "mode FORCE: sampling variant built without a memory check"
  if free_bytes is None:
    return False, (f"AUTO: free memory unknown ({free_source}); keeping greedy-only folding. "
                   f"Set {ENV_VAR}=force (or mode=FoldedSampling.FORCE) to fold sampling anyway")
  spare = free_bytes - need_bytes
  if spare >= headroom_bytes:
    return True, (f"AUTO: free - need = {spare / 2**20:,.0f} MiB >= headroom "
                  f"{headroom_bytes / 2**20:,.0f} MiB ({free_source})")
  return False, (f"AUTO: free - need = {spare / 2**20:,.0f} MiB < headroom "
                 f"{headroom_bytes / 2**20:,.0f} MiB ({free_source}); keeping greedy-only folding. "
                 f"Set {ENV_VAR}=force (or mode=FoldedSampling.FORCE) to fold sampling anyway")
