"""Calibrating a draft's confidence head for the schedule study (``dspark-jax calibrate``).

This module owns the data and the fit behind the STS temperatures of SPEC §7:

* **Drafts and traces.** `with_temperatures` returns a copy of a draft whose `ConfidenceHead`
  applies given temperatures (``None``: the raw head). `decode_queue` runs the queue-driven
  `generate` over prompts through ``concurrency`` slots (`decoding.queue`; prompt i seeded
  ``seed + i``), the decoding every study shares. `trace_rounds` decodes prompts with ``trace=True``
  and the fixed schedule (the queue's trace: per slot and iteration); `full_rounds` keeps the active
  rounds that verified every position, as the data of `calibration.fit_sts`: the head's confidence
  [N, γ] and the accepted run [N]. Without a schedule each prompt's rounds are those of decoding it
  alone, so the data do not depend on the concurrency (on the CPU, exactly).
* **The fit.** `fit_calibration` fits the STS temperatures and reports ECE and AUC per position
  before and after (`Calibration`); `calibrate` does both for a pair, always starting from the raw
  head. `save_calibration` / `load_temperatures` write and read them as JSON;
  `format_calibration_table` prints them.

`dspark_jax.apps.schedule_study` replays the traces under schedules; `dspark_jax.apps.study_figures`
draws the reliability diagrams.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from dspark_jax import decoding
from dspark_jax.draft import heads
from dspark_jax.sampling import params as sp
from dspark_jax.scheduling import calibration


# ---- drafts and traces ----------------------------------------------------------------------------


def with_temperatures(draft, temperatures):
  """A copy of `draft` whose confidence head applies `temperatures` [γ] (None: the raw head).

  The input draft is not changed; the temperatures are stored as float32.

  Raises:
    ValueError: a draft without a confidence head, or temperatures that are not γ finite values > 0.
  """
  if getattr(draft, "confidence", None) is None:
    raise ValueError("draft: has no confidence head (nothing to calibrate or schedule on)")
  gamma = draft.config.gamma
  arrays = {k: v for k, v in draft.confidence.arrays().items() if k != "temperatures"}
  if temperatures is not None:
    t = np.asarray(temperatures)
    if t.shape != (gamma,):
      raise ValueError(f"temperatures: expected {gamma} values (one per draft position), got shape "
                       f"{t.shape}")
    arrays["temperatures"] = t.astype(np.float32)
  head = heads.confidence_head_from_arrays(arrays)
  copy = nnx.clone(draft)
  copy.confidence = head
  return copy


def _stop_ids(stop_token_ids) -> list[int]:
  return [int(i) for i in stop_token_ids]


def concurrency_of(concurrency, batch_size, default: int = 8) -> int:
  """`concurrency`, or the deprecated `batch_size` alias (a `DeprecationWarning`), or `default`.

  Raises:
    ValueError: both given, or the value not an integer >= 1 (naming the argument).
  """
  if batch_size is not None:
    if concurrency is not None:
      raise ValueError("batch_size: a deprecated alias of concurrency; pass one of them")
    import warnings
    warnings.warn("batch_size is deprecated: the studies decode through the queue; pass "
                  "concurrency", DeprecationWarning, stacklevel=3)
    concurrency, name = batch_size, "batch_size"
  else:
    concurrency, name = (default if concurrency is None else concurrency), "concurrency"
  if isinstance(concurrency, bool) or not isinstance(concurrency, (int, np.integer)) \
      or concurrency < 1:
    raise ValueError(f"{name}: must be an integer >= 1, got {concurrency!r}")
  return int(concurrency)


def decode_queue(target, draft, prompts: Sequence[Sequence[int]], *, temperature: float,
                 concurrency: int, max_new_tokens: int, stop_token_ids, seed: int, schedule,
                 trace: bool) -> decoding.QueueResult:
  """The queue-driven `generate` over `prompts` through min(`concurrency`, N) slots.

  Every row samples at `temperature`; prompt i has seed ``seed + i``, every prompt the key
  ``jax.random.key(seed)``. `schedule` (None: the fixed schedule) and `trace` go to `generate`.

  Raises:
    ValueError: `concurrency` not an integer >= 1, no prompts, and `generate`'s own errors.
  """
  concurrency = concurrency_of(concurrency, None)
  if not prompts:
    raise ValueError("prompts: empty")
  params = sp.SamplingParams(temperature=np.full(len(prompts), float(temperature)),
                             seed=np.arange(len(prompts)) + seed)
  return decoding.generate(
      target, draft, [list(p) for p in prompts], params, jax.random.key(seed),
      max_new_tokens=max_new_tokens, stop_token_ids=_stop_ids(stop_token_ids), schedule=schedule,
      trace=trace, max_batch_size=min(concurrency, len(prompts)))


def trace_rounds(target, draft, prompts: Sequence[Sequence[int]], *,
                 temperatures: Sequence[float] = (0.0,), concurrency: int | None = None,
                 max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                 seed: int = 0, batch_size: int | None = None) -> list[decoding.RoundTrace]:
  """Per-round traces of fixed-schedule decodes of `prompts` at each sampling temperature.

  The prompts go through `concurrency` slots (default 8; `batch_size` is its deprecated alias).
  One `RoundTrace` per temperature: confidence [R, S, γ] as `draft`'s head emits it, verify_lens,
  accept_len, active [R, S], over the iterations run and the slots (`QueueResult.trace`).
  """
  concurrency = concurrency_of(concurrency, batch_size)
  return [decode_queue(target, draft, prompts, temperature=temperature, concurrency=concurrency,
                       max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
                       schedule=None, trace=True).trace
          for temperature in temperatures]


def full_rounds(traces: Sequence[decoding.RoundTrace]) -> tuple[np.ndarray, np.ndarray]:
  """(confidence [N, γ] float64, accept_len [N] int64) of the active rounds that verified every
  position, pooled over `traces`: `calibration.fit_sts`'s data.

  Raises:
    ValueError: no traces, traces of different γ, a NaN confidence (a draft without a confidence
      head), or no such round.
  """
  if not traces:
    raise ValueError("traces: empty")
  gamma = traces[0].confidence.shape[-1]
  confidence, accept_len = [], []
  for i, trace in enumerate(traces):
    c = np.asarray(trace.confidence, np.float64)
    if c.shape[-1] != gamma:
      raise ValueError(f"traces: trace {i} has γ = {c.shape[-1]}, trace 0 has {gamma}")
    keep = np.asarray(trace.active) & (np.asarray(trace.verify_lens) == gamma + 1)
    confidence.append(c[keep])
    accept_len.append(np.asarray(trace.accept_len)[keep].astype(np.int64))
  confidence, accept_len = np.concatenate(confidence), np.concatenate(accept_len)
  if confidence.shape[0] == 0:
    raise ValueError("traces: no active round verified every position")
  if np.isnan(confidence).any():
    raise ValueError("traces: NaN confidences (the draft has no confidence head)")
  return confidence, accept_len


# ---- calibration ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Calibration:
  """An STS fit and its diagnostics.

  Attributes:
    temperatures: [γ] fitted temperatures (`calibration.fit_sts`).
    ece_before, ece_after, auc_before, auc_after: [γ] of the cumulative survival per position, with
      the raw head and with the temperatures.
    confidence: [N, γ] the raw confidences fitted on; accept_len: [N] their labels.
    bins: ECE and reliability bins.
    traces: the decodes' `RoundTrace` values (raw head), for `replay` and `threshold_sweep`.
  """

  temperatures: np.ndarray
  ece_before: np.ndarray
  ece_after: np.ndarray
  auc_before: np.ndarray
  auc_after: np.ndarray
  confidence: np.ndarray
  accept_len: np.ndarray
  bins: int = 15
  traces: list = dataclasses.field(default_factory=list)

  @property
  def rounds(self) -> int:
    return int(self.accept_len.shape[0])

  def as_dict(self) -> dict:
    """The temperatures and diagnostics as JSON values (NaN as None), without the data."""
    clean = lambda a: [None if math.isnan(x) else float(x) for x in np.asarray(a, np.float64)]
    return {"temperatures": clean(self.temperatures), "ece_before": clean(self.ece_before),
            "ece_after": clean(self.ece_after), "auc_before": clean(self.auc_before),
            "auc_after": clean(self.auc_after), "rounds": self.rounds, "bins": self.bins}


def fit_calibration(confidence, accept_len, *, bins: int = 15, traces=()) -> Calibration:
  """`calibration.fit_sts` on raw confidences [N, γ] and labels [N], with ECE and AUC before/after."""
  temperatures = calibration.fit_sts(confidence, accept_len, bins=bins)
  return Calibration(
      temperatures=temperatures,
      ece_before=calibration.ece(confidence, accept_len, bins=bins),
      ece_after=calibration.ece(confidence, accept_len, temperatures, bins=bins),
      auc_before=calibration.auc(confidence, accept_len),
      auc_after=calibration.auc(confidence, accept_len, temperatures),
      confidence=np.asarray(confidence, np.float64), accept_len=np.asarray(accept_len, np.int64),
      bins=bins, traces=list(traces))


def calibrate(target, draft, prompts: Sequence[Sequence[int]], *,
              temperatures: Sequence[float] = (0.0,), concurrency: int | None = None,
              max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (), seed: int = 0,
              bins: int = 15, batch_size: int | None = None) -> Calibration:
  """Decodes `prompts` with the draft's raw confidence head (its own temperatures set aside),
  fixed schedule, ``trace=True``, through `concurrency` slots (default 8; `batch_size` is its
  deprecated alias), and fits STS on every round (`fit_calibration`)."""
  raw = with_temperatures(draft, None)
  concurrency = concurrency_of(concurrency, batch_size)
  traces = trace_rounds(target, raw, prompts, temperatures=temperatures, concurrency=concurrency,
                        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed)
  confidence, accept_len = full_rounds(traces)
  return fit_calibration(confidence, accept_len, bins=bins, traces=traces)


def save_calibration(path: str | os.PathLike, result: Calibration,
                     meta: Mapping[str, Any] | None = None) -> str:
  """Writes ``{"temperatures": [...], "ece_before": ..., ..., **meta}`` as JSON; returns `path`."""
  document = {**result.as_dict(), **dict(meta or {})}
  document.setdefault("date", datetime.datetime.now(datetime.timezone.utc)
                      .isoformat(timespec="seconds"))
  with open(path, "w", encoding="utf-8") as f:
    json.dump(document, f, indent=1)
    f.write("\n")
  return str(path)


def load_temperatures(path: str | os.PathLike) -> np.ndarray:
  """The ``temperatures`` [γ] float64 of a `save_calibration` file.

  Raises:
    ValueError: an unreadable file, or no list of finite temperatures > 0 in it (naming the file).
  """
  try:
    with open(path, encoding="utf-8") as f:
      document = json.load(f)
  except (OSError, UnicodeDecodeError) as error:
    raise ValueError(f"{path}: cannot read it ({error})") from None
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}: not valid JSON ({error.msg})") from None
  values = document.get("temperatures") if isinstance(document, dict) else None
  if not isinstance(values, list) or not values:
    raise ValueError(f"{path}: expected an object with a non-empty 'temperatures' list")
  for i, t in enumerate(values):
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
      raise ValueError(f"{path}: temperatures[{i}] is {t!r}; must be a finite number > 0")
  return np.asarray(values, np.float64)


# ---- the table ------------------------------------------------------------------------------------


def format_calibration_table(result: Calibration) -> str:
  """A markdown table per position: T_k, ECE and AUC before and after STS."""
  lines = ["| k | T_k | ECE before | ECE after | AUC before | AUC after |",
           "|---:|---:|---:|---:|---:|---:|"]
  fmt = lambda a, spec: "–" if math.isnan(a) else format(a, spec)
  for k in range(len(result.temperatures)):
    lines.append(f"| {k + 1} | {result.temperatures[k]:.3g} | {fmt(result.ece_before[k], '.4f')} | "
                 f"{fmt(result.ece_after[k], '.4f')} | {fmt(result.auc_before[k], '.3f')} | "
                 f"{fmt(result.auc_after[k], '.3f')} |")
  return "\n".join(lines)
