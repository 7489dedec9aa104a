"""The schedule study behind ``dspark-jax eval --schedule`` and ``dspark-jax calibrate``.

This module owns measuring what the confidence-scheduled verification of SPEC §7 does for a pair:

* **Schedules by name.** `parse_schedules` reads ``fixed,threshold:0.5,prefix,top_k[:lag]`` into
  `ScheduleSpec` values; `ScheduleSpec.build` makes the `schedules.Schedule` (``fixed`` builds None:
  `generate`'s default program, the same decisions). Built schedules are kept per (spec, table) so
  that `generate`, which keys its compiled programs by the schedule's identity, compiles each once.
* **Calibration.** `trace_rounds` decodes prompts with ``trace=True`` and the fixed schedule;
  `full_rounds` keeps the active rounds, all of which verified every position, as the data of
  `calibration.fit_sts`: the head's confidence [N, γ] and the accepted run [N]. `fit_calibration`
  fits the STS temperatures and reports ECE and AUC per position before and after; `calibrate`
  does both for a pair, always starting from the raw head (`with_temperatures` ``None``).
  `with_temperatures` returns a copy of a draft whose `ConfidenceHead` applies the temperatures;
  `save_calibration` / `load_temperatures` write and read them as JSON.
* **Live comparison.** `compare_schedules` decodes the prompts under each schedule (batches of
  ``batch_size``, row i seeded ``seed + i``) and reports per schedule a `ScheduleRow`: τ (tokens per
  round: accepted drafts + 1) with its interval, the mean verify tokens per round (anchor
  included), the acceptance rate (accepted drafts over drafts placed in the verify batch, i.e.
  Σ accept_len / Σ (verify_len − 1)) with its interval, per-position conditional acceptance and
  tokens/s (compilation excluded). `throughput_sweep` measures tokens/s per schedule at several
  batch sizes on the same prompts.
* **Replay.** `replay` and `threshold_sweep` evaluate a schedule on the rounds of a fixed-schedule
  trace without decoding again: a round whose verify batch holds ℓ drafts accepts min(A, ℓ) of them,
  A being the run the full verification accepted (same draws, same acceptance tests). Each round
  is the one the fixed schedule reached, so the numbers describe the schedule's per-round decisions
  on those contexts (not the trajectory a scheduled decode would have taken). A schedule's decisions
  read the calibrated confidences: give the ``temperatures`` the draft would apply.
* **Throughput table.** `measure_sps` runs `profile_sps` over the verify batch sizes a study of a
  given batch size can reach.
* **Figures** (matplotlib, each on its own `Figure` with an Agg canvas; the global backend is not
  touched): `plot_reliability` (per-position reliability before/after STS with ECE and AUC, the
  paper's Fig. 6), `plot_threshold_sweep` (τ, verify tokens and acceptance rate against the threshold,
  Fig. 5), `plot_throughput` (tokens/s against batch size per schedule). Each returns the saved path.

The decoding loop's verify forward has the static shape [B, γ + 1] (`dspark_jax.decoding.rounds`):
a shorter verify length commits fewer tokens without making the forward cheaper, so the measured
tokens/s cannot show a schedule's savings; `verify_bound_tokens_per_second` gives the rate that a
verify packed to the scheduled tokens would reach by the throughput table (draft cost left out).
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
from dspark_jax.apps import evaluation
from dspark_jax.draft import heads
from dspark_jax.sampling import params as sp
from dspark_jax.scheduling import calibration
from dspark_jax.scheduling import schedules
from dspark_jax.scheduling.profile import SpsProfile, profile_sps

SCHEDULE_KINDS = ("fixed", "threshold", "prefix", "top_k")
DEFAULT_THRESHOLDS = np.round(np.linspace(0.0, 1.0, 21), 10)


# ---- schedules by name ----------------------------------------------------------------------------


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


def _decode_batches(target, draft, prompts: Sequence[Sequence[int]], *, temperature: float,
                    batch_size: int, max_new_tokens: int, stop_token_ids, seed: int, schedule,
                    trace: bool) -> list[decoding.GenerateResult]:
  """`generate` over `prompts` in order, `batch_size` at a time; prompt i has seed ``seed + i``."""
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
  if not prompts:
    raise ValueError("prompts: empty")
  results = []
  for start in range(0, len(prompts), batch_size):
    rows = range(start, min(start + batch_size, len(prompts)))
    params = sp.SamplingParams(temperature=np.full(len(rows), float(temperature)),
                               seed=np.asarray(rows) + seed)
    results.append(decoding.generate(
        target, draft, [list(prompts[i]) for i in rows], params, jax.random.key(seed),
        max_new_tokens=max_new_tokens, stop_token_ids=_stop_ids(stop_token_ids),
        schedule=schedule, trace=trace))
  return results


def trace_rounds(target, draft, prompts: Sequence[Sequence[int]], *,
                 temperatures: Sequence[float] = (0.0,), batch_size: int = 8,
                 max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                 seed: int = 0) -> list[decoding.RoundTrace]:
  """Per-round traces of fixed-schedule decodes of `prompts` at each sampling temperature.

  One `RoundTrace` per (temperature, batch), in that order: confidence [R, b, γ] as `draft`'s head
  emits it, verify_lens, accept_len, active [R, b].
  """
  traces = []
  for temperature in temperatures:
    for result in _decode_batches(target, draft, prompts, temperature=temperature,
                                  batch_size=batch_size, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop_token_ids, seed=seed, schedule=None,
                                  trace=True):
      traces.append(result.trace)
  return traces


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
              temperatures: Sequence[float] = (0.0,), batch_size: int = 8,
              max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (), seed: int = 0,
              bins: int = 15) -> Calibration:
  """Decodes `prompts` with the draft's raw confidence head (its own temperatures set aside),
  fixed schedule, ``trace=True``, and fits STS on every round (`fit_calibration`)."""
  raw = with_temperatures(draft, None)
  traces = trace_rounds(target, raw, prompts, temperatures=temperatures, batch_size=batch_size,
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


# ---- rows of the comparison -----------------------------------------------------------------------


@dataclasses.dataclass
class ScheduleRow:
  """One schedule at one sampling temperature and batch size.

  Attributes:
    schedule: the label (`ScheduleSpec.label`). source: "decode" or "replay".
    temperature, batch_size: the settings.
    tau, tau_interval: tokens per round (accepted drafts + 1) and its 95 % interval (prompts as
      units, `evaluation.ratio_interval`).
    verify_tokens: mean tokens verified per round per active row, anchor included.
    acceptance_rate, acceptance_rate_interval: accepted drafts over drafts in the verify batch.
    acceptance, acceptance_interval: [γ] conditional acceptance per position, [γ, 2] Wilson.
    reached, accepted: [γ] counts behind `acceptance`.
    rounds: row-rounds counted. tokens: tokens generated (decode) or committed (replay).
    tokens_per_second: measured (compilation excluded); NaN for a replay.
  """

  schedule: str
  source: str
  temperature: float
  batch_size: int
  tau: float
  tau_interval: tuple[float, float]
  verify_tokens: float
  acceptance_rate: float
  acceptance_rate_interval: tuple[float, float]
  acceptance: np.ndarray
  acceptance_interval: np.ndarray
  reached: np.ndarray
  accepted: np.ndarray
  rounds: int
  tokens: int
  tokens_per_second: float

  def as_dict(self) -> dict:
    clean = lambda a: None if a is None or math.isnan(a) else float(a)
    out = dataclasses.asdict(self)
    for name in ("tau", "verify_tokens", "acceptance_rate", "tokens_per_second"):
      out[name] = clean(getattr(self, name))
    for name in ("tau_interval", "acceptance_rate_interval"):
      out[name] = [clean(a) for a in getattr(self, name)]
    out["acceptance"] = [clean(a) for a in self.acceptance]
    out["acceptance_interval"] = [[clean(a) for a in pair] for pair in self.acceptance_interval]
    out["reached"] = [int(a) for a in self.reached]
    out["accepted"] = [int(a) for a in self.accepted]
    return out


def _row(label, source, temperature, batch_size, *, row_accepted, row_rounds, row_verified,
         reached, accepted, tokens, tokens_per_second) -> ScheduleRow:
  """A `ScheduleRow` from per-prompt counts (accepted drafts, rounds, verified tokens with
  anchors) and per-position counts."""
  row_accepted = np.asarray(row_accepted, np.int64)
  row_rounds = np.asarray(row_rounds, np.int64)
  row_drafts = np.asarray(row_verified, np.int64) - row_rounds  # drafts in the verify batch
  total_rounds = max(int(row_rounds.sum()), 1)
  drafts = int(row_drafts.sum())
  rate = float(row_accepted.sum()) / drafts if drafts else math.nan
  reached, accepted = np.asarray(reached, np.int64), np.asarray(accepted, np.int64)
  return ScheduleRow(
      schedule=label, source=source, temperature=float(temperature), batch_size=int(batch_size),
      tau=1.0 + float(row_accepted.sum()) / total_rounds,
      tau_interval=evaluation.tau_interval(row_accepted, row_rounds),
      verify_tokens=float(np.asarray(row_verified).sum()) / total_rounds,
      acceptance_rate=rate,
      acceptance_rate_interval=evaluation.ratio_interval(row_accepted, row_drafts),
      acceptance=np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan),
      acceptance_interval=evaluation.wilson_interval(accepted, reached),
      reached=reached, accepted=accepted, rounds=int(row_rounds.sum()), tokens=int(tokens),
      tokens_per_second=float(tokens_per_second))


def _decode_row(label, temperature, batch_size, results) -> ScheduleRow:
  pooled = evaluation.pool(results)
  return _row(label, "decode", temperature, batch_size, row_accepted=pooled.row_accepted,
              row_rounds=pooled.row_rounds,
              row_verified=np.concatenate([r.row_verified for r in results]),
              reached=pooled.reached, accepted=pooled.accepted, tokens=pooled.tokens,
              tokens_per_second=pooled.tokens_per_second)


class _NoBar:
  def update(self, n: int = 1) -> None:
    del n

  def close(self) -> None:
    pass


def _bar(total: int, desc: str, enabled: bool):
  """A tqdm bar on stderr, or a stand-in (tqdm is not imported: no notebook-widget warning)."""
  if not enabled:
    return _NoBar()
  from tqdm.auto import tqdm
  return tqdm(total=total, desc=desc)


def _check_specs(specs, sps) -> list[ScheduleSpec]:
  specs = list(specs)
  if not specs or not all(isinstance(s, ScheduleSpec) for s in specs):
    raise ValueError(f"specs: expected a non-empty list of ScheduleSpec (parse_schedules), got "
                     f"{specs!r}")
  needing = [s.label for s in specs if s.needs_sps]
  if needing and sps is None:
    raise ValueError(f"sps: {', '.join(needing)} need a throughput table")
  return specs


def compare_schedules(target, draft, prompts: Sequence[Sequence[int]],
                      specs: Sequence[ScheduleSpec], *, sps=None,
                      temperatures: Sequence[float] = (0.0,), batch_size: int = 8,
                      max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (), seed: int = 0,
                      progress: bool = False) -> list[ScheduleRow]:
  """Decodes `prompts` under each schedule at each temperature; one `ScheduleRow` per pair.

  Args:
    target, draft: the pair; the draft's confidence head as it is (calibrate it first:
      `with_temperatures`).
    prompts: token-id lists, decoded in order `batch_size` at a time (row i seeded ``seed + i``,
      every batch keyed ``jax.random.key(seed)``).
    specs: the schedules (`parse_schedules`). sps: the dense throughput table prefix/top_k read.
    temperatures: sampling temperatures. max_new_tokens, stop_token_ids: per row.

  Raises:
    ValueError: no specs, prefix/top_k without `sps`, a draft without a confidence head for a
      schedule that reads it, and `generate`'s own errors.
  """
  specs = _check_specs(specs, sps)
  built = {spec: spec.build(sps) for spec in specs}
  rows = []
  bar = _bar(len(specs) * len(temperatures), "schedules", progress)
  for temperature in temperatures:
    for spec in specs:
      results = _decode_batches(target, draft, prompts, temperature=temperature,
                                batch_size=batch_size, max_new_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids, seed=seed, schedule=built[spec],
                                trace=False)
      rows.append(_decode_row(spec.label, temperature, batch_size, results))
      bar.update(1)
  bar.close()
  return rows


def throughput_sweep(target, draft, prompts: Sequence[Sequence[int]],
                     specs: Sequence[ScheduleSpec], batch_sizes: Sequence[int], *, sps=None,
                     temperature: float = 0.0, max_new_tokens: int = 128,
                     stop_token_ids: Sequence[int] = (), seed: int = 0,
                     progress: bool = False) -> list[ScheduleRow]:
  """tokens/s of each schedule at each batch size b, on the same work: `prompts` decoded b at a
  time (cycled up to b rows when there are fewer), compilation excluded; one `ScheduleRow` per
  (b, schedule)."""
  specs = _check_specs(specs, sps)
  if not prompts:
    raise ValueError("prompts: empty")
  for b in batch_sizes:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
      raise ValueError(f"batch_sizes: entry {b!r} must be an integer >= 1")
  built = {spec: spec.build(sps) for spec in specs}
  rows = []
  bar = _bar(len(specs) * len(batch_sizes), "throughput", progress)
  for b in batch_sizes:
    batch = [prompts[i % len(prompts)] for i in range(max(int(b), len(prompts)))]
    for spec in specs:
      results = _decode_batches(target, draft, batch, temperature=temperature, batch_size=int(b),
                                max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                seed=seed, schedule=built[spec], trace=False)
      rows.append(_decode_row(spec.label, temperature, int(b), results))
      bar.update(1)
  bar.close()
  return rows


# ---- replay on traced rounds ----------------------------------------------------------------------


def _calibrated(confidence: np.ndarray, temperatures) -> np.ndarray:
  """float32 confidences as the head with `temperatures` would emit them (module docstring)."""
  if temperatures is None:
    return np.asarray(confidence, np.float32)
  shape = confidence.shape
  flat = np.asarray(confidence, np.float64).reshape(-1, shape[-1])
  return calibration.apply_temperatures(flat, temperatures).reshape(shape).astype(np.float32)


def _full_mask(trace) -> np.ndarray:
  gamma = trace.confidence.shape[-1]
  return np.asarray(trace.active) & (np.asarray(trace.verify_lens) == gamma + 1)


def replay(traces: Sequence[decoding.RoundTrace], spec: ScheduleSpec, *, sps=None,
           temperatures=None, temperature: float = math.nan) -> ScheduleRow:
  """`spec`'s decisions on the rounds of fixed-schedule traces (module docstring): per round, the
  schedule sees the (calibrated) confidences of the rows active in it, verifies ``1 + ℓ`` tokens
  per row and accepts ``min(A, ℓ)``. Each trace is one batch; a stateful schedule's state runs
  through its rounds in order. Rounds that did not verify every position count as inactive.

  Args:
    traces: fixed-schedule traces (`trace_rounds`, `Calibration.traces`).
    spec: the schedule. sps: its throughput table (prefix, top_k).
    temperatures: [γ] temperatures applied to the traced confidences first (None: as traced).
    temperature: the sampling temperature, recorded in the row.
  """
  (spec,) = _check_specs([spec], sps)
  if not traces:
    raise ValueError("traces: empty")
  schedule = spec.build(sps) or schedules.fixed()
  gamma = traces[0].confidence.shape[-1]
  k = np.arange(gamma)[None, :]
  row_accepted, row_rounds, row_verified = [], [], []
  reached = np.zeros(gamma, np.int64)
  accepted = np.zeros(gamma, np.int64)
  for trace in traces:
    confidence = _calibrated(np.nan_to_num(np.asarray(trace.confidence)), temperatures)
    active = _full_mask(trace)
    full = np.asarray(trace.accept_len, np.int64)
    rounds, batch = active.shape
    state = schedule.init(batch, gamma)
    acc_b, rounds_b, verified_b = (np.zeros(batch, np.int64) for _ in range(3))
    for r in range(rounds):
      if not active[r].any():
        continue
      lens, state = schedule.update(confidence[r], active[r], state)
      lens = np.asarray(lens, np.int64)
      run = np.minimum(full[r], lens - 1)
      on = active[r]
      acc_b += np.where(on, run, 0)
      rounds_b += on
      verified_b += np.where(on, lens, 0)
      reached += (on[:, None] & (run[:, None] >= k) & (k + 1 < lens[:, None])).sum(0)
      accepted += (on[:, None] & (run[:, None] >= k + 1)).sum(0)
    row_accepted.append(acc_b)
    row_rounds.append(rounds_b)
    row_verified.append(verified_b)
  row_accepted = np.concatenate(row_accepted)
  row_rounds = np.concatenate(row_rounds)
  batch_size = max(t.active.shape[1] for t in traces)
  return _row(spec.label, "replay", temperature, batch_size, row_accepted=row_accepted,
              row_rounds=row_rounds, row_verified=np.concatenate(row_verified), reached=reached,
              accepted=accepted, tokens=int(row_accepted.sum() + row_rounds.sum()),
              tokens_per_second=math.nan)


@dataclasses.dataclass
class ThresholdSweep:
  """`threshold_sweep`'s result: per threshold t, from the same rounds.

  Attributes:
    thresholds: [n] t values. tau: [n] tokens per round, 1 + mean min(A, ℓ_t).
    verify_tokens: [n] 1 + mean ℓ_t. acceptance_rate: [n] Σ min(A, ℓ_t) / Σ ℓ_t (NaN if Σ ℓ_t = 0).
    rounds: row-rounds used.
  """

  thresholds: np.ndarray
  tau: np.ndarray
  verify_tokens: np.ndarray
  acceptance_rate: np.ndarray
  rounds: int

  def as_dict(self) -> dict:
    clean = lambda a: [None if math.isnan(x) else float(x) for x in np.asarray(a, np.float64)]
    return {"thresholds": clean(self.thresholds), "tau": clean(self.tau),
            "verify_tokens": clean(self.verify_tokens),
            "acceptance_rate": clean(self.acceptance_rate), "rounds": self.rounds}


def threshold_sweep(traces: Sequence[decoding.RoundTrace], thresholds=DEFAULT_THRESHOLDS, *,
                    temperatures=None) -> ThresholdSweep:
  """`schedules.threshold(t)` replayed (`replay`) on the full-verify rounds of `traces` for each t,
  vectorised: ℓ_t = leading positions with c ≥ t (float32, as the schedule compares).

  Args:
    traces: fixed-schedule traces. thresholds: t values in [0, 1].
    temperatures: [γ] applied to the traced confidences first (None: as traced).
  """
  t = np.asarray(thresholds, np.float64).reshape(-1)
  if t.size == 0 or not np.all((t >= 0) & (t <= 1)):
    raise ValueError(f"thresholds: expected values in [0, 1], got {t.tolist()}")
  confidence, accept_len = full_rounds(traces)
  c = _calibrated(confidence, temperatures)
  c = np.where(np.isnan(c), np.float32(0), c)
  passes = c[None, :, :] >= t.astype(np.float32)[:, None, None]            # [n, N, γ]
  lens = np.cumprod(passes, axis=2).sum(axis=2)                            # ℓ_t [n, N]
  run = np.minimum(accept_len[None, :], lens)
  drafts = lens.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    rate = np.where(drafts > 0, run.sum(axis=1) / np.maximum(drafts, 1), np.nan)
  return ThresholdSweep(thresholds=t, tau=1.0 + run.mean(axis=1), verify_tokens=1.0 + lens.mean(axis=1),
                        acceptance_rate=rate, rounds=int(accept_len.shape[0]))


# ---- the throughput table -------------------------------------------------------------------------


def sps_batch_tokens(max_batch: int, gamma: int) -> list[int]:
  """Verify batch sizes to profile for batches of up to `max_batch` rows: (γ + 1) times 1, 2, 4,
  ... rows and `max_batch` rows (the loop verifies whole rows of γ + 1 tokens)."""
  rows = {int(max_batch)}
  r = 1
  while r < max_batch:
    rows.add(r)
    r *= 2
  return sorted(n * (gamma + 1) for n in rows)


def measure_sps(target, draft, *, max_batch: int, context: int, repeats: int = 3, steps: int = 4,
                path: str | os.PathLike | None = None) -> SpsProfile:
  """`profile_sps` over `sps_batch_tokens` (on the current device); saved to `path` if given."""
  return profile_sps(target, draft, batch_tokens=sps_batch_tokens(max_batch, draft.config.gamma),
                     context=context, repeats=repeats, steps=steps, path=path)


def verify_bound_tokens_per_second(row: ScheduleRow, sps) -> float:
  """B · τ · sps[round(B · verify_tokens)]: the tokens/s of `row`'s batch if each round cost one
  verify pass packed to the scheduled tokens (the table's rate) and nothing else; NaN past the
  table."""
  sps = np.asarray(sps, np.float64)
  n = int(round(row.batch_size * row.verify_tokens))
  if not 1 <= n < sps.shape[0]:
    return math.nan
  return row.batch_size * row.tau * float(sps[n])


# ---- tables ---------------------------------------------------------------------------------------


def format_schedule_table(rows: Sequence[ScheduleRow]) -> str:
  """A markdown table: τ, verify tokens per round, acceptance rate (95 %), acc@k, tokens/s."""
  gamma = len(rows[0].acceptance)
  head = ("| schedule | T | B | τ [95 %] | verify tokens | acceptance rate [95 %] | " +
          " | ".join(f"acc@{k + 1}" for k in range(gamma)) + " | tokens/s |")
  lines = [head, "|---|---:|---:|---:|---:|---:|" + "---:|" * gamma + "---:|"]
  fmt = lambda a, spec=".2f": "–" if a is None or math.isnan(a) else format(a, spec)
  for row in rows:
    lo, hi = row.tau_interval
    rlo, rhi = row.acceptance_rate_interval
    acc = " | ".join(fmt(a) for a in row.acceptance)
    tps = "(replay)" if row.source == "replay" else fmt(row.tokens_per_second, ".0f")
    lines.append(f"| {row.schedule} | {row.temperature:g} | {row.batch_size} | {row.tau:.2f} "
                 f"[{fmt(lo)}, {fmt(hi)}] | {row.verify_tokens:.2f} | {fmt(row.acceptance_rate)} "
                 f"[{fmt(rlo)}, {fmt(rhi)}] | {acc} | {tps} |")
  return "\n".join(lines)


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


# ---- figures --------------------------------------------------------------------------------------


def _figure(width: float, height: float, rows: int, cols: int):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig, fig.subplots(rows, cols, squeeze=False)


def _save(fig, path) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return str(path)


def plot_reliability(result: Calibration, path: str | os.PathLike) -> str:
  """Reliability diagrams of the cumulative survival a_k, one panel per position k, raw head and
  after STS, ECE and AUC in the legend (the paper's Fig. 6); saves a PNG at `path`."""
  gamma = len(result.temperatures)
  cols = min(gamma, 4)
  rows = -(-gamma // cols)
  fig, axes = _figure(3.2 * cols, 3.0 * rows, rows, cols)
  curves = (("raw", None, result.ece_before, result.auc_before, "tab:red"),
            ("STS", result.temperatures, result.ece_after, result.auc_after, "tab:blue"))
  diagrams = {name: calibration.reliability(result.confidence, result.accept_len, temps,
                                            bins=result.bins)
              for name, temps, *_ in curves}
  for k in range(rows * cols):
    ax = axes[k // cols][k % cols]
    if k >= gamma:
      ax.axis("off")
      continue
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
    for name, temps, ece, auc, colour in curves:
      diagram = diagrams[name]
      filled = diagram.counts[k] > 0
      extra = "" if temps is None else f", T = {temps[k]:.2g}"
      ax.plot(diagram.confidence[k, filled], diagram.accuracy[k, filled], marker="o", ms=3,
              color=colour, label=f"{name}{extra}: ECE {ece[k]:.3f}, AUC {auc[k]:.2f}")
    ax.set_title(f"position {k + 1}", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted survival a_k", fontsize=8)
    ax.set_ylabel("observed survival", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
  fig.suptitle(f"reliability of a_k = Π c_i before/after STS ({result.rounds} rounds)", fontsize=10)
  return _save(fig, path)


def plot_threshold_sweep(sweeps: ThresholdSweep | Mapping[str, ThresholdSweep],
                         path: str | os.PathLike) -> str:
  """τ and verify tokens per round (left) and acceptance rate (right) against the threshold t (the
  paper's Fig. 5), one line per sweep (e.g. raw and calibrated confidences); saves a PNG."""
  if isinstance(sweeps, ThresholdSweep):
    sweeps = {"": sweeps}
  fig, axes = _figure(10, 3.6, 1, 2)
  left, right = axes[0]
  for i, (name, sweep) in enumerate(sweeps.items()):
    colour = f"C{i}"
    tag = f" ({name})" if name else ""
    left.plot(sweep.thresholds, sweep.tau, marker="o", ms=3, color=colour,
              label=f"τ: tokens per round{tag}")
    left.plot(sweep.thresholds, sweep.verify_tokens, ls="--", color=colour,
              label=f"verify tokens per round{tag}")
    right.plot(sweep.thresholds, sweep.acceptance_rate, marker="o", ms=3, color=colour,
               label=f"acceptance rate{tag}")
  left.set_xlabel("threshold t")
  left.set_ylabel("tokens per round")
  right.set_xlabel("threshold t")
  right.set_ylabel("accepted / verified drafts")
  right.set_ylim(0, 1.02)
  for ax in (left, right):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return _save(fig, path)


def plot_throughput(rows: Sequence[ScheduleRow], path: str | os.PathLike, *, sps=None) -> str:
  """tokens/s against batch size, one line per schedule (decoded rows only); with `sps`, a second
  panel of `verify_bound_tokens_per_second` (a model, labelled as such). Saves a PNG."""
  rows = [r for r in rows if r.source == "decode"]
  if not rows:
    raise ValueError("rows: no decoded rows to plot")
  fig, axes = _figure(10 if sps is not None else 5.5, 3.8, 1, 2 if sps is not None else 1)
  by_schedule: dict[str, list[ScheduleRow]] = {}
  for row in rows:
    by_schedule.setdefault(row.schedule, []).append(row)
  panels = [(axes[0][0], lambda r: r.tokens_per_second, "measured tokens/s")]
  if sps is not None:
    panels.append((axes[0][1], lambda r: verify_bound_tokens_per_second(r, sps),
                   "verify-bound model: B·τ·sps[B·verify tokens]"))
  for ax, value, title in panels:
    for name, items in by_schedule.items():
      items = sorted(items, key=lambda r: r.batch_size)
      ax.plot([r.batch_size for r in items], [value(r) for r in items], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return _save(fig, path)
