"""Calibration of the confidence head: Sequential Temperature Scaling (STS) and its diagnostics.

This module owns the host-side (NumPy, float64) fit of the per-position temperatures that the
confidence head applies at run time, ``c_k = σ(raw_k / T_k)`` (SPEC §7, DSpark paper §3.2.1), and
the measures that judge a calibration. The data are rounds that verified every position:

* ``confidence`` [N, γ]: the head's conditional confidences c_{n,k} ∈ [0, 1] (uncalibrated, or
  calibrated already when ``temperatures`` is None);
* ``accept_len`` [N] int in 0..γ: how many drafts each round accepted.

Every measure is of the *cumulative product* a_{n,k} = Π_{i≤k} c_{n,i} (the predicted probability that
drafts 1..k all survive) against the label ``accept_len ≥ k``, position by position; with
``temperatures`` given, each c_{n,i} is first rescaled to σ(logit(c_{n,i}) / T_i). Logits of 0 and 1
are clipped to ±logit(1 − 1e-12), so rescaled confidences of 0 and 1 stay finite.

* `ece`: expected calibration error with ``bins`` equal-width bins on [0, 1] (a prediction of exactly
  1 falls in the last bin), each bin's |mean label − mean prediction| weighted by its share of the N
  rounds.
* `reliability`: the per-bin numbers behind a reliability diagram.
* `auc`: the ROC AUC of a_{n,k} for the label (ties count one half).
* `fit_sts`: left to right, position k's temperature is the grid value that minimises the ECE of a_k,
  the temperatures of positions < k held at their fitted values (ties: the first grid value).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from dspark_jax import validation

EPSILON = 1e-12
"""Confidences are clipped to [EPSILON, 1 − EPSILON] before their logit is taken."""

DEFAULT_GRID = np.logspace(-1.0, 1.0, 41)
"""The STS search grid: 41 log-spaced temperatures in [0.1, 10] (SGLang's)."""


class Reliability(NamedTuple):
  """A reliability diagram per position (`reliability`).

  Attributes:
    centres: [bins] float64 bin centres on [0, 1].
    accuracy: [γ, bins] float64 empirical survival rate per bin (NaN for an empty bin).
    confidence: [γ, bins] float64 mean predicted survival per bin (NaN for an empty bin).
    counts: [γ, bins] int64 rounds per bin.
  """

  centres: np.ndarray
  accuracy: np.ndarray
  confidence: np.ndarray
  counts: np.ndarray


# ---- checks ---------------------------------------------------------------------------------------


def _check_data(confidence, accept_len) -> tuple[np.ndarray, np.ndarray]:
  c = np.asarray(validation.as_array("confidence", confidence))
  if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1:
    raise ValueError(f"confidence: expected shape [N, γ] with N, γ >= 1, got {c.shape}")
  if c.dtype.kind not in "iuf":
    raise ValueError(f"confidence: expected numbers, got dtype {c.dtype}")
  c = c.astype(np.float64)
  bad = ~((c >= 0) & (c <= 1))
  if bad.any():
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"confidence: element {list(index)} is {c[index]}; must be in [0, 1]")
  n, gamma = c.shape
  lens = np.asarray(validation.as_array("accept_len", accept_len))
  if lens.shape != (n,):
    raise ValueError(f"accept_len: expected shape ({n},), got {lens.shape}")
  if lens.dtype.kind not in "iu":
    raise ValueError(f"accept_len: expected integers, got dtype {lens.dtype}")
  lens = lens.astype(np.int64)
  bad = (lens < 0) | (lens > gamma)
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"accept_len: row {i} is {lens[i]}; must be in [0, {gamma}]")
  return c, lens


def _check_temperatures(temperatures, gamma: int) -> np.ndarray | None:
  if temperatures is None:
    return None
  t = np.asarray(temperatures)
  if t.shape != (gamma,):
    raise ValueError(f"temperatures: expected shape ({gamma},), got {t.shape}")
  if t.dtype.kind not in "iuf":
    raise ValueError(f"temperatures: expected numbers, got dtype {t.dtype}")
  t = t.astype(np.float64)
  bad = ~(np.isfinite(t) & (t > 0))
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"temperatures: entry {i} is {t[i]}; must be finite and > 0")
  return t


def _check_bins(bins) -> int:
  if isinstance(bins, bool) or not isinstance(bins, (numbers.Integral, np.integer)) or bins < 1:
    raise ValueError(f"bins: expected an integer >= 1, got {bins!r}")
  return int(bins)


# ---- the pieces -----------------------------------------------------------------------------------


def logit(confidence) -> np.ndarray:
  """float64 log(c / (1 − c)) with c clipped to [EPSILON, 1 − EPSILON]."""
  c = np.clip(np.asarray(confidence, np.float64), EPSILON, 1.0 - EPSILON)
  return np.log(c) - np.log1p(-c)


def apply_temperatures(confidence, temperatures) -> np.ndarray:
  """[N, γ] float64 σ(logit(c_{n,k}) / T_k): what the confidence head emits with `temperatures`."""
  c = np.asarray(confidence, np.float64)
  z = logit(c) / np.asarray(temperatures, np.float64)
  return 1.0 / (1.0 + np.exp(-z))


def _cumulative(confidence, temperatures) -> np.ndarray:
  c = np.asarray(confidence, np.float64)
  if temperatures is not None:
    c = apply_temperatures(c, temperatures)
  return np.cumprod(c, axis=1)


def _labels(accept_len: np.ndarray, gamma: int) -> np.ndarray:
  """[N, γ] bool: draft k survived (accept_len ≥ k, k = 1..γ)."""
  return accept_len[:, None] >= np.arange(1, gamma + 1)[None, :]


def _bin_index(predicted: np.ndarray, bins: int) -> np.ndarray:
  return np.minimum((predicted * bins).astype(np.int64), bins - 1)


def _ece_rows(predicted: np.ndarray, label: np.ndarray, bins: int) -> np.ndarray:
  """ECE of each row of `predicted` [G, N] against `label` [N] (one row per candidate)."""
  g, n = predicted.shape
  index = _bin_index(predicted, bins) + bins * np.arange(g)[:, None]
  counts = np.bincount(index.ravel(), minlength=g * bins).reshape(g, bins)
  sums = np.bincount(index.ravel(), weights=predicted.ravel(), minlength=g * bins).reshape(g, bins)
  hits = np.bincount(index.ravel(), weights=np.broadcast_to(label, (g, n)).ravel().astype(np.float64),
                     minlength=g * bins).reshape(g, bins)
  return np.abs(hits - sums).sum(axis=1) / n  # Σ_b (n_b / N)·|mean label − mean prediction|


# ---- public measures ------------------------------------------------------------------------------


def ece(confidence, accept_len, temperatures=None, bins: int = 15) -> np.ndarray:
  """[γ] float64 ECE of the cumulative product a_k against ``accept_len ≥ k`` per position k.

  Equal-width bins on [0, 1], each bin weighted by its count (module docstring).

  Args:
    confidence: [N, γ] conditional confidences in [0, 1].
    accept_len: [N] int in 0..γ, from rounds that verified every position.
    temperatures: optional [γ] temperatures applied first (σ(logit(c) / T)).
    bins: number of bins.
  """
  c, lens = _check_data(confidence, accept_len)
  t = _check_temperatures(temperatures, c.shape[1])
  bins = _check_bins(bins)
  a = _cumulative(c, t)
  y = _labels(lens, c.shape[1])
  return np.array([_ece_rows(a[None, :, k], y[:, k], bins)[0] for k in range(c.shape[1])])


def reliability(confidence, accept_len, temperatures=None, bins: int = 15) -> Reliability:
  """Per-position reliability diagrams of the cumulative product (same bins as `ece`)."""
  c, lens = _check_data(confidence, accept_len)
  t = _check_temperatures(temperatures, c.shape[1])
  bins = _check_bins(bins)
  a = _cumulative(c, t)
  y = _labels(lens, c.shape[1]).astype(np.float64)
  gamma = c.shape[1]
  counts = np.zeros((gamma, bins), np.int64)
  accuracy = np.full((gamma, bins), np.nan)
  mean_conf = np.full((gamma, bins), np.nan)
  for k in range(gamma):
    index = _bin_index(a[:, k], bins)
    counts[k] = np.bincount(index, minlength=bins)
    filled = counts[k] > 0
    accuracy[k, filled] = np.bincount(index, y[:, k], bins)[filled] / counts[k, filled]
    mean_conf[k, filled] = np.bincount(index, a[:, k], bins)[filled] / counts[k, filled]
  centres = (np.arange(bins) + 0.5) / bins
  return Reliability(centres=centres, accuracy=accuracy, confidence=mean_conf, counts=counts)


def _average_ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks of `x`, ties given the mean of the ranks they span."""
  order = np.argsort(x, kind="stable")
  sorted_x = x[order]
  starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
  ends = np.r_[starts[1:], x.shape[0]]
  mean_rank = (starts + ends + 1) / 2.0  # ranks starts+1 .. ends
  ranks = np.empty(x.shape[0])
  ranks[order] = np.repeat(mean_rank, ends - starts)
  return ranks


def auc(confidence, accept_len, temperatures=None) -> np.ndarray:
  """[γ] float64 ROC AUC of the cumulative product a_k for the label ``accept_len ≥ k``.

  The Mann-Whitney statistic: the probability that a surviving round scores above a failing one,
  ties counting one half; NaN at a position where every label is the same.
  """
  c, lens = _check_data(confidence, accept_len)
  t = _check_temperatures(temperatures, c.shape[1])
  a = _cumulative(c, t)
  y = _labels(lens, c.shape[1])
  out = np.full(c.shape[1], np.nan)
  for k in range(c.shape[1]):
    positives = int(y[:, k].sum())
    negatives = y.shape[0] - positives
    if positives and negatives:
      ranks = _average_ranks(a[:, k])
      out[k] = (ranks[y[:, k]].sum() - positives * (positives + 1) / 2) / (positives * negatives)
  return out


def fit_sts(confidence, accept_len, *, grid=None, bins: int = 15) -> np.ndarray:
  """Sequential Temperature Scaling: [γ] float64 temperatures, one per position.

  Position by position, left to right, T_k is the grid value minimising the ECE of
  a_k = a_{k−1}·σ(logit(c_k) / T_k) against ``accept_len ≥ k``, with T_1..T_{k−1} fixed at their fitted
  values (ties: the first grid value). Temperature scaling preserves each position's order.

  Args:
    confidence: [N, γ] raw (uncalibrated) conditional confidences in [0, 1].
    accept_len: [N] int in 0..γ, from rounds that verified every position.
    grid: 1-D candidate temperatures (finite, > 0); default `DEFAULT_GRID` (41 log-spaced values in
      [0.1, 10]).
    bins: ECE bins.
  """
  c, lens = _check_data(confidence, accept_len)
  bins = _check_bins(bins)
  grid = DEFAULT_GRID if grid is None else np.asarray(grid)
  if grid.ndim != 1 or grid.shape[0] < 1 or grid.dtype.kind not in "iuf":
    raise ValueError(f"grid: expected a non-empty 1-D array of temperatures, got shape "
                     f"{grid.shape} of {grid.dtype}")
  grid = grid.astype(np.float64)
  bad = ~(np.isfinite(grid) & (grid > 0))
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"grid: entry {i} is {grid[i]}; must be finite and > 0")
  z = logit(c)
  y = _labels(lens, c.shape[1])
  fitted = np.empty(c.shape[1])
  previous = np.ones(c.shape[0])
  for k in range(c.shape[1]):
    candidates = previous[None, :] / (1.0 + np.exp(-z[None, :, k] / grid[:, None]))  # [G, N]
    errors = _ece_rows(candidates, y[:, k], bins)
    best = int(np.argmin(errors))
    fitted[k] = grid[best]
    previous = candidates[best]
  return fitted
