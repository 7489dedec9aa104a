"""The schedule study behind ``dspark-jax eval --schedule``: what the confidence-scheduled
verification of SPEC §7 does for a pair.

Schedules are named by `dspark_jax.apps.schedule_specs` (`ScheduleSpec`, `parse_schedules`); the
traces and the STS fit come from `dspark_jax.apps.calibration_study`; the figures are drawn by
`dspark_jax.apps.study_figures`. This module owns the measurements:

* **Live comparison.** `compare_schedules` decodes the prompts under each schedule (through
  ``concurrency`` slots of the queue-driven decode, `decoding.queue`: a slot takes the next prompt
  as its row finishes; row i seeded ``seed + i``) and reports per schedule a `ScheduleRow`: τ (tokens per
  round: accepted drafts + 1) with its interval, the mean verify tokens per round (anchor
  included), the acceptance rate (accepted drafts over drafts placed in the verify batch, i.e.
  Σ accept_len / Σ (verify_len − 1)) with its interval, per-position conditional acceptance and
  tokens/s (compilation excluded). `throughput_sweep` measures tokens/s per schedule at several
  concurrencies on the same prompts.
* **Replay.** `replay` and `threshold_sweep` evaluate a schedule on the rounds of a fixed-schedule
  trace without decoding again: a round whose verify batch holds ℓ drafts accepts min(A, ℓ) of them,
  A being the run the full verification accepted (same draws, same acceptance tests). Each round
  is the one the fixed schedule reached, so the numbers describe the schedule's per-round decisions
  on those contexts (not the trajectory a scheduled decode would have taken). A schedule's decisions
  read the calibrated confidences: give the ``temperatures`` the draft would apply.
* **Throughput table.** `measure_sps` runs `profile_sps` over the verify batch sizes a study of a
  given batch size can reach.
* **Table.** `format_schedule_table` prints `ScheduleRow` values as markdown.

With a schedule the decoding loop's verify runs only the scheduled tokens, packed into a static
token bucket (`dspark_jax.decoding.packing`), so the measured tokens/s show a schedule's savings;
`verify_bound_tokens_per_second` is the cost model's prediction from the throughput table (draft
cost left out).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np

from dspark_jax import decoding
from dspark_jax.apps import calibration_study
from dspark_jax.apps import evaluation
from dspark_jax.apps.schedule_specs import ScheduleSpec
from dspark_jax.scheduling import calibration
from dspark_jax.scheduling import schedules
from dspark_jax.scheduling.profile import SpsProfile, profile_sps

DEFAULT_THRESHOLDS = np.round(np.linspace(0.0, 1.0, 21), 10)


# ---- rows of the comparison -----------------------------------------------------------------------


@dataclasses.dataclass
class ScheduleRow:
  """One schedule at one sampling temperature and batch size.

  Attributes:
    schedule: the label (`ScheduleSpec.label`). source: "decode" or "replay".
    temperature, batch_size: the settings (`batch_size`: the concurrency, slots decoding at once).
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


def _decode_row(label, temperature, batch_size, result) -> ScheduleRow:
  pooled = evaluation.pool([result])
  return _row(label, "decode", temperature, batch_size, row_accepted=pooled.row_accepted,
              row_rounds=pooled.row_rounds, row_verified=result.row_verified,
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
                      temperatures: Sequence[float] = (0.0,), concurrency: int | None = None,
                      max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (), seed: int = 0,
                      progress: bool = False, batch_size: int | None = None) -> list[ScheduleRow]:
  """Decodes `prompts` under each schedule at each temperature; one `ScheduleRow` per pair.

  Args:
    target, draft: the pair; the draft's confidence head as it is (calibrate it first:
      `calibration_study.with_temperatures`).
    prompts: token-id lists, decoded through `concurrency` slots (default 8; `batch_size` is its
      deprecated alias), row i seeded ``seed + i``, every prompt keyed ``jax.random.key(seed)``.
    specs: the schedules (`parse_schedules`). sps: the dense throughput table prefix/top_k read.
    temperatures: sampling temperatures. max_new_tokens, stop_token_ids: per row.

  Raises:
    ValueError: no specs, prefix/top_k without `sps`, a draft without a confidence head for a
      schedule that reads it, and `generate`'s own errors.
  """
  specs = _check_specs(specs, sps)
  concurrency = calibration_study.concurrency_of(concurrency, batch_size)
  built = {spec: spec.build(sps) for spec in specs}
  rows = []
  bar = _bar(len(specs) * len(temperatures), "schedules", progress)
  for temperature in temperatures:
    for spec in specs:
      result = calibration_study.decode_queue(
          target, draft, prompts, temperature=temperature, concurrency=concurrency,
          max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
          schedule=built[spec], trace=False)
      rows.append(_decode_row(spec.label, temperature, concurrency, result))
      bar.update(1)
  bar.close()
  return rows


def throughput_sweep(target, draft, prompts: Sequence[Sequence[int]],
                     specs: Sequence[ScheduleSpec], batch_sizes: Sequence[int], *, sps=None,
                     temperature: float = 0.0, max_new_tokens: int = 128,
                     stop_token_ids: Sequence[int] = (), seed: int = 0,
                     progress: bool = False) -> list[ScheduleRow]:
  """tokens/s of each schedule at each concurrency b (`batch_sizes`), on the same work: `prompts`
  (cycled up to b when there are fewer) through b slots of the queue, compilation excluded; one
  `ScheduleRow` per (b, schedule)."""
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
      result = calibration_study.decode_queue(
          target, draft, batch, temperature=temperature, concurrency=int(b),
          max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
          schedule=built[spec], trace=False)
      rows.append(_decode_row(spec.label, temperature, int(b), result))
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
  per row and accepts ``min(A, ℓ)``. Each trace is one batch (a queue's trace: its slots, so the
  row's interval treats slots, not prompts, as the units); a stateful schedule's state runs
  through its rounds in order. Rounds that did not verify every position count as inactive.

  Args:
    traces: fixed-schedule traces (`calibration_study.trace_rounds`, `Calibration.traces`).
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
  confidence, accept_len = calibration_study.full_rounds(traces)
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
  """`profile_sps` of the verify forwards alone (``draft_cost=False``: the study's verify-bound
  model) over `sps_batch_tokens` (on the current device); saved to `path` if given."""
  return profile_sps(target, draft, batch_tokens=sps_batch_tokens(max_batch, draft.config.gamma),
                     context=context, repeats=repeats, steps=steps, path=path, draft_cost=False)


def verify_bound_tokens_per_second(row: ScheduleRow, sps) -> float:
  """B · τ · sps[round(B · verify_tokens)]: the tokens/s of `row`'s batch if each round cost one
  packed verify of the scheduled tokens (the table's rate) and nothing else; NaN past the table."""
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
