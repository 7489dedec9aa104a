"""Schedules by name: what ``dspark-jax eval --schedule`` and the schedule study call a schedule.

`parse_schedules` reads ``fixed,threshold:0.5,prefix,top_k[:lag]`` into `ScheduleSpec` values;
`ScheduleSpec.build` makes the `schedules.Schedule` (``fixed`` builds None: `generate`'s default
program, the same decisions). Built schedules are kept per (spec, table) so that `generate`, which
keys its compiled programs by the schedule's identity, compiles each once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.scheduling import schedules

SCHEDULE_KINDS = ("fixed", "threshold", "prefix", "top_k")


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
  """A schedule named on the command line.

  Attributes:
    kind: "fixed", "threshold", "prefix" or "top_k".
    value: the threshold t in [0, 1] for "threshold", the lag (int ≥ 0) for "top_k", else None.
  """

  kind: str
  value: float | int | None = None

  @property
  def label(self) -> str:
    """``fixed``, ``threshold:0.5``, ``prefix``, ``top_k:2``."""
    return self.kind if self.value is None else f"{self.kind}:{self.value:g}"

  @property
  def needs_sps(self) -> bool:
    """Whether the schedule reads a throughput table (prefix, top_k)."""
    return self.kind in ("prefix", "top_k")

  @property
  def lossless(self) -> bool:
    """False only for ``top_k:0``, the anticipating search (`schedules.top_k`)."""
    return not (self.kind == "top_k" and self.value == 0)

  def build(self, sps=None) -> schedules.Schedule | None:
    """The `Schedule` (None for ``fixed``: `generate`'s default program makes its decisions).

    The same object is returned for an equal spec and table, so `generate` reuses its program.

    Raises:
      ValueError: prefix or top_k without `sps`, or a bad table.
    """
    if self.kind == "fixed":
      return None
    if self.needs_sps and sps is None:
      raise ValueError(f"sps: {self.label} needs a throughput table (schedules.load_sps or "
                       "profile_sps)")
    table = None if sps is None else np.asarray(sps, np.float64)
    key = (self, None if table is None or not self.needs_sps else table.tobytes())
    if key not in _BUILT:
      if self.kind == "threshold":
        _BUILT[key] = schedules.threshold(float(self.value))
      elif self.kind == "prefix":
        _BUILT[key] = schedules.prefix(table)
      else:
        _BUILT[key] = schedules.top_k(table, lag=int(self.value))
    return _BUILT[key]


_BUILT: dict[tuple, schedules.Schedule] = {}
"""Schedules built by `ScheduleSpec.build`, by (spec, table bytes): one compiled program each."""


def parse_schedules(text: str) -> list[ScheduleSpec]:
  """``fixed,threshold:0.5,prefix,top_k[:lag]`` as `ScheduleSpec` values, in order.

  ``threshold`` needs a value in [0, 1]; ``top_k``'s lag defaults to 2 and must be an integer ≥ 0;
  ``fixed`` and ``prefix`` take none.

  Raises:
    ValueError: an empty entry, an unknown name, a bad value or a schedule given twice (each named).
  """
  specs: list[ScheduleSpec] = []
  for item in str(text).split(","):
    item = item.strip()
    name, colon, value = item.partition(":")
    name, value = name.strip(), value.strip()
    if not name:
      raise ValueError(f"empty schedule in {text!r}; use e.g. fixed,threshold:0.5,prefix,top_k")
    if name in ("fixed", "prefix"):
      if colon:
        raise ValueError(f"{item!r}: {name} takes no value")
      spec = ScheduleSpec(name)
    elif name == "threshold":
      try:
        t = float(value)
      except ValueError:
        raise ValueError(f"{item!r}: the threshold must be a number in [0, 1], e.g. "
                         "threshold:0.5") from None
      if not 0.0 <= t <= 1.0:
        raise ValueError(f"{item!r}: the threshold must be in [0, 1], got {t}")
      spec = ScheduleSpec(name, t)
    elif name == "top_k":
      lag = 2
      if colon:
        try:
          lag = int(value)
        except ValueError:
          raise ValueError(f"{item!r}: the lag must be an integer >= 0, e.g. top_k:2") from None
        if lag < 0:
          raise ValueError(f"{item!r}: the lag must be an integer >= 0, got {lag}")
      spec = ScheduleSpec(name, lag)
    else:
      raise ValueError(f"unknown schedule {name!r}; use fixed, threshold:T, prefix or top_k[:LAG]")
    if spec in specs:
      raise ValueError(f"{spec.label} is given twice")
    specs.append(spec)
  return specs
