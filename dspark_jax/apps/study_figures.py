"""The schedule study's figures (matplotlib), each on its own `Figure` with an Agg canvas: the
global backend is not touched.

* `plot_reliability`: per-position reliability of the cumulative survival before/after STS, with
  ECE and AUC (the paper's Fig. 6), from a `calibration_study.Calibration`.
* `plot_threshold_sweep`: τ, verify tokens and acceptance rate against the threshold (Fig. 5), from
  `schedule_study.ThresholdSweep` values.
* `plot_throughput`: tokens/s against batch size per schedule, from `schedule_study.ScheduleRow`
  values, with the verify-bound model beside it given a throughput table.
* `plot_serving`: tokens/s per GPU against tokens/s per user, one line per schedule, each point a
  concurrency, from the JSON of ``benchmarks/bench_serving.py`` (its ``throughput`` results).

Each saves a PNG and returns its path.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence

from dspark_jax.apps.calibration_study import Calibration
from dspark_jax.apps.schedule_study import (ScheduleRow, ThresholdSweep,
                                            verify_bound_tokens_per_second)
from dspark_jax.scheduling import calibration


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


def _read_document(document):
  if isinstance(document, (str, os.PathLike)):
    try:
      with open(document, encoding="utf-8") as f:
        return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
      raise ValueError(f"document: cannot read {document} ({error})") from None
  return document


def serving_points(document) -> dict[str, list[tuple[int, float, float]]]:
  """``{schedule: [(concurrency, tokens/s per user, tokens/s per GPU), ...]}`` sorted by
  concurrency, from a ``bench_serving`` JSON document (a dict, or the path of its file).

  Raises:
    ValueError: an unreadable file, or no ``results.throughput`` list of points with
      ``concurrency``, ``schedule``, ``per_user_tokens_per_s`` and ``tokens_per_s``.
  """
  document = _read_document(document)
  results = document.get("results") if isinstance(document, Mapping) else None
  points = results.get("throughput") if isinstance(results, Mapping) else None
  if not isinstance(points, list) or not points:
    raise ValueError("document: no results.throughput points (run bench_serving with the "
                     "throughput study)")
  out: dict[str, list[tuple[int, float, float]]] = {}
  for i, point in enumerate(points):
    try:
      entry = (int(point["concurrency"]), float(point["per_user_tokens_per_s"]),
               float(point["tokens_per_s"]))
      name = str(point["schedule"])
    except (KeyError, TypeError, ValueError):
      raise ValueError(f"document: results.throughput[{i}] lacks concurrency, schedule, "
                       f"per_user_tokens_per_s or tokens_per_s") from None
    out.setdefault(name, []).append(entry)
  return {name: sorted(items) for name, items in out.items()}


def plot_serving(document, path: str | os.PathLike, *, title: str | None = None) -> str:
  """Two panels from a ``bench_serving`` JSON document or file (`serving_points`), one line per
  schedule: tokens/s per GPU against concurrency, and tokens/s per GPU (y) against tokens/s per
  user (x) through its concurrencies (each point labelled c). Saves a PNG; returns its path."""
  document = _read_document(document)
  curves = serving_points(document)
  fig, axes = _figure(11, 4.2, 1, 2)
  left = axes[0][0]
  for name, items in curves.items():
    left.plot([c for c, _, _ in items], [g for _, _, g in items], marker="o", label=name)
  left.set_xscale("log", base=2)
  left.set_xlabel("concurrency (slots)")
  left.set_ylabel("tokens/s per GPU")
  left.grid(alpha=0.3, which="both")
  left.legend(fontsize=7)
  ax = axes[0][1]
  for name, items in curves.items():
    users = [u for _, u, _ in items]
    gpus = [g for _, _, g in items]
    ax.plot(users, gpus, marker="o", label=name)
    for c, u, g in items:
      ax.annotate(f"c={c}", (u, g), textcoords="offset points", xytext=(3, 3), fontsize=6)
  for axis, values in ((ax.xaxis, [u for items in curves.values() for _, u, _ in items]),
                       (ax.yaxis, [g for items in curves.values() for _, _, g in items])):
    finite = [v for v in values if not math.isnan(v)]
    if finite and min(finite) > 0 and max(finite) > 10 * min(finite):  # log past a decade
      (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log")
  ax.set_xlabel("tokens/s per user (mean over prompts)")
  ax.set_ylabel("tokens/s per GPU")
  if title is None and isinstance(document, Mapping):
    meta = document.get("meta", {})
    title = f"{document.get('results', {}).get('pair', '')} on {meta.get('device_kind', '?')}"
  fig.suptitle(textwrap.fill(title or "serving throughput", 140), fontsize=9)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  return _save(fig, path)
