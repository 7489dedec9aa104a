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

Free memory is `dspark_jax.device_memory.probe_free_bytes` (imported here with the other probe
functions, shared with `paging.allocator`); where it is unknown AUTO keeps the greedy-only folding (it
cannot prove the buffers fit), with the usual warning that names FORCE.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from typing import Mapping

import numpy as np

from dspark_jax.device_memory import (DEFAULT_HEADROOM_BYTES, free_bytes_from_stats,  # noqa: F401
                                      host_available_bytes, probe_free_bytes)

ENV_VAR = "DSPARK_JAX_FOLDED_SAMPLING"
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
