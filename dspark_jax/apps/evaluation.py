"""The acceptance measurements behind ``dspark-jax eval``: the shipped pair's study, and any pair on
a DeepSpec evaluation dataset.

This module owns the measurement the paper's Table 1 and Fig. 2 make. `evaluate_pair` runs it for a
loaded target, drafter and tokenizer on prompts read by `read_eval_dataset` (DeepSpec's
``eval_datasets/*.jsonl``: one ``{"turns": [...]}`` per line, the first turn is the prompt), through a
given number of slots (the queue-driven decode, `decoding.queue`), at each temperature, and pools
the counts (`pool`); `ResultFile` appends each prompt's result as it finishes, and a rerun resumes.
`acceptance_study` is the shipped pair's study: for each
temperature, the held-out prompts are decoded speculatively with the DSpark drafter (sequential head)
and with the ablation trained without it, and once autoregressively. It reports τ (mean tokens per
round, accepted drafts + bonus), the per-position conditional acceptance P(draft k accepted | drafts
1..k-1 accepted), and tokens/s of each decoder. `format_table` prints it; `plot_acceptance` draws the
per-position curves (a PNG, via matplotlib, without touching its global backend).

Intervals (95 %): τ's treats prompts as the independent units (a ratio estimator, accepted drafts
over rounds per prompt, with its delta-method standard error); an acceptance point's is the Wilson
interval of accepted over reached drafts at that position, which treats the drafts as independent
trials (rounds of one prompt are not quite: read it as a guide). Both come from the counts that
`generate` returns, so results of several calls can be pooled.

In the study each configuration is one queue-driven `generate` call over all prompts (its compilation excluded
from tokens/s); rows stop at the tokenizer's stop ids (the shipped pair: ``<|endoftext|>``) or after
``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dspark_jax import decoding
from dspark_jax.sampling import params as sp
from dspark_jax.formats import shipped


@dataclasses.dataclass
class StudyRow:
  """One (drafter, temperature) configuration of the study."""

  drafter: str
  temperature: float
  tau: float
  acceptance: np.ndarray
  rounds: int
  tau_interval: tuple[float, float]
  acceptance_interval: np.ndarray   # [γ, 2]: low, high (NaN where no draft was reached)
  reached: np.ndarray               # [γ] counts
  accepted: np.ndarray              # [γ] counts
  tokens: int
  tokens_per_second: float
  baseline_tokens_per_second: float

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    clean = lambda a: None if np.isnan(a) else float(a)
    out["acceptance"] = [clean(a) for a in self.acceptance]
    out["acceptance_interval"] = [[clean(a) for a in pair] for pair in self.acceptance_interval]
    out["tau_interval"] = [float(a) for a in self.tau_interval]
    out["reached"] = [int(a) for a in self.reached]
    out["accepted"] = [int(a) for a in self.accepted]
    out["baseline_tokens_per_second"] = clean(self.baseline_tokens_per_second)
    return out


Z95 = 1.959963984540054


def wilson_interval(successes: np.ndarray, trials: np.ndarray, z: float = Z95) -> np.ndarray:
  """[..., 2] the Wilson score interval of successes / trials (NaN where trials == 0)."""
  successes, trials = np.asarray(successes, float), np.asarray(trials, float)
  with np.errstate(invalid="ignore", divide="ignore"):
    p = successes / trials
    denominator = 1 + z**2 / trials
    centre = (p + z**2 / (2 * trials)) / denominator
    half = z * np.sqrt(p * (1 - p) / trials + z**2 / (4 * trials**2)) / denominator
  out = np.stack([centre - half, centre + half], axis=-1)
  out[trials == 0] = np.nan
  return out


def ratio_interval(numerator: np.ndarray, denominator: np.ndarray,
                   z: float = Z95) -> tuple[float, float]:
  """The 95 % interval of Σ numerator / Σ denominator with the entries (prompts) as the
  independent units: the ratio estimator's delta-method standard error. Entries with a zero
  denominator are left out; NaN when none is left, a point interval with one."""
  keep = np.asarray(denominator) > 0
  a, r = np.asarray(numerator, float)[keep], np.asarray(denominator, float)[keep]
  if r.size == 0:
    return (float("nan"), float("nan"))
  ratio = a.sum() / r.sum()
  if r.size < 2:
    return (float(ratio), float(ratio))
  residual = a - ratio * r
  se = np.sqrt(np.sum(residual**2) / (r.size * (r.size - 1))) / r.mean()
  return (float(ratio - z * se), float(ratio + z * se))


def tau_interval(row_accepted: np.ndarray, row_rounds: np.ndarray,
                 z: float = Z95) -> tuple[float, float]:
  """The interval of τ = 1 + Σ accepted / Σ rounds with prompts as the independent units
  (`ratio_interval`); a point interval with fewer than two prompts."""
  lo, hi = ratio_interval(row_accepted, row_rounds, z)
  return (1 + lo, 1 + hi)


def acceptance_study(pair: shipped.ShippedPair, *, num_prompts: int | None = None,
                     max_new_tokens: int = 128, temperatures: Sequence[float] = (0.0, 1.0),
                     concurrency: int | None = None, seed: int = 0,
                     progress: bool = True, kv: str = "contiguous",
                     num_pages: int | None = None) -> list[StudyRow]:
  """Runs the study on the first `num_prompts` held-out prompts (all by default).

  Each temperature decodes the prompts plainly (the baseline tokens/s) and with both drafters,
  through `concurrency` slots (`decoding.queue`; default: one per prompt) whose caches are `kv`
  ("contiguous" or "paged", with `num_pages`: `decoding.Engine`); prompt i has seed ``seed + i``.
  """
  from tqdm.auto import tqdm

  texts = pair.prompts[:num_prompts] if num_prompts else pair.prompts
  prompts = [pair.encode(t) for t in texts]
  concurrency = _check_concurrency(len(prompts) if concurrency is None else concurrency)
  drafters = {"dspark": pair.draft, "parallel (ablation)": pair.ablation}
  stop_ids = list(pair.tokenizer.stop_token_ids)
  rows = []
  bar = tqdm(total=len(temperatures) * (len(drafters) + 1) * len(prompts), desc="eval",
             disable=not progress)
  for temperature in temperatures:
    decode = functools.partial(_decode_queue, pair.target, prompts, concurrency, temperature, seed,
                               max_new_tokens, stop_ids, bar, kv=kv, num_pages=num_pages)
    plain = decode(None)
    for name, draft in drafters.items():
      rows.append(_study_row(name, temperature, decode(draft), plain.tokens_per_second))
  bar.close()
  return rows


def _check_concurrency(concurrency) -> int:
  if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
    raise ValueError(f"concurrency: must be an integer >= 1, got {concurrency!r}")
  return concurrency


def _decode_queue(target, prompts, concurrency, temperature, seed, max_new_tokens, stop_ids, bar,
                  draft, *, results: "ResultFile | None" = None, name: str = "",
                  kv: str = "contiguous", num_pages: int | None = None) -> "Pooled":
  """Decodes `prompts` through `concurrency` slots (`decoding.queue`; speculatively with `draft`,
  plainly if None), pooled. Prompt i has seed ``seed + i``, every prompt the key
  ``jax.random.key(seed)``: its tokens do not depend on the concurrency. With `results`, prompts
  already there are skipped (their counts pooled from the file) and each finished prompt is
  appended as it finishes."""
  done = {} if results is None else results.done(name, temperature)
  todo = [i for i in range(len(prompts)) if i not in done]
  bar.update(len(prompts) - len(todo))
  parts = []
  if todo:
    params = sp.SamplingParams(temperature=np.full(len(todo), float(temperature)),
                               seed=np.asarray(todo) + seed)

    def finished(result):
      bar.update(1)
      if results is not None:
        results.append(name, temperature, todo[result.index], result)

    parts.append(pool([decoding.generate(
        target, draft, [prompts[i] for i in todo], params, jax.random.key(seed),
        max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, spec=draft is not None,
        max_batch_size=min(concurrency, len(todo)), on_finish=finished, kv=kv,
        num_pages=num_pages)]))
  if done:
    records = list(done.values())
    parts.append(Pooled(reached=np.sum([r["reached"] for r in records], axis=0),
                        accepted=np.sum([r["accepted"] for r in records], axis=0),
                        row_rounds=np.array([r["rounds"] for r in records]),
                        row_accepted=np.array([r["accepted_drafts"] for r in records]),
                        tokens=0, wall_seconds=0.0))
  return Pooled(reached=np.sum([p.reached for p in parts], axis=0),
                accepted=np.sum([p.accepted for p in parts], axis=0),
                row_rounds=np.concatenate([p.row_rounds for p in parts]),
                row_accepted=np.concatenate([p.row_accepted for p in parts]),
                tokens=sum(p.tokens for p in parts),
                wall_seconds=sum(p.wall_seconds for p in parts),
                rounds=sum(p.rounds for p in parts))


class ResultFile:
  """A JSON-lines file of per-prompt results (`decoding.PromptResult.as_dict` plus ``drafter``,
  ``temperature`` and ``prompt``, the prompt's index in the evaluated list), appended as prompts
  finish; a run over the same file skips the prompts it already holds."""

  def __init__(self, path: str):
    self.path = path
    self.records: list[dict] = []
    self.cut = False  # the file ends inside a line (an interrupted write): start a new one
    try:
      with open(path, encoding="utf-8") as f:
        for line in f:
          self.cut = not line.endswith("\n")
          if line.strip():
            try:
              self.records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by an interruption: decoded again
              continue
    except FileNotFoundError:
      pass
    except (OSError, UnicodeDecodeError) as error:
      raise ValueError(f"{path}: cannot read the results file ({error})") from None

  def done(self, name: str, temperature: float) -> dict[int, dict]:
    """The records of `name` at `temperature`, by prompt index."""
    return {r["prompt"]: r for r in self.records
            if r.get("drafter") == name and r.get("temperature") == float(temperature)}

  def append(self, name: str, temperature: float, prompt: int, result) -> None:
    record = {"drafter": name, "temperature": float(temperature), "prompt": int(prompt),
              **result.as_dict()}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(("\n" if self.cut else "") + json.dumps(record) + "\n")
    self.cut = False
    self.records.append(record)


def _study_row(name: str, temperature: float, pooled: "Pooled", plain: float) -> StudyRow:
  return StudyRow(drafter=name, temperature=float(temperature), tau=pooled.tau,
                  acceptance=pooled.acceptance, rounds=pooled.rounds,
                  tau_interval=tau_interval(pooled.row_accepted, pooled.row_rounds),
                  acceptance_interval=wilson_interval(pooled.accepted, pooled.reached),
                  reached=pooled.reached, accepted=pooled.accepted, tokens=pooled.tokens,
                  tokens_per_second=pooled.tokens_per_second, baseline_tokens_per_second=plain)


def read_eval_dataset(path: str, num_prompts: int | None = None) -> list[str]:
  """The prompts of a DeepSpec evaluation file: per non-blank line a JSON object whose ``turns`` is a
  non-empty list of strings; the first turn is the prompt. The first `num_prompts` (all by default).

  Raises:
    ValueError: an unreadable file, or a line that breaks the format, naming ``path:line``.
  """
  prompts = []
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except (OSError, UnicodeDecodeError) as error:
    raise ValueError(f"{path}: cannot read the dataset ({error})") from None
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as error:
      raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    turns = row.get("turns") if isinstance(row, dict) else None
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
      raise ValueError(f"{path}:{number}: expected an object whose 'turns' is a non-empty list of "
                       "strings")
    if not turns[0]:
      raise ValueError(f"{path}:{number}: the first turn (the prompt) is empty")
    prompts.append(turns[0])
    if num_prompts is not None and len(prompts) == num_prompts:
      break
  if not prompts:
    raise ValueError(f"{path}: no prompts")
  return prompts


@dataclasses.dataclass
class Pooled:
  """Counts of several `generate` calls together: τ and acceptance as if they were one call."""

  reached: np.ndarray        # [γ]
  accepted: np.ndarray       # [γ]
  row_rounds: np.ndarray     # [prompts]
  row_accepted: np.ndarray   # [prompts]
  tokens: int
  wall_seconds: float
  rounds: int = 0            # loop iterations of all the calls

  @property
  def tau(self) -> float:
    return 1.0 + float(self.row_accepted.sum()) / max(float(self.row_rounds.sum()), 1.0)

  @property
  def acceptance(self) -> np.ndarray:
    return np.where(self.reached > 0, self.accepted / np.maximum(self.reached, 1), np.nan)

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / max(self.wall_seconds, 1e-12)


def pool(results: Sequence[decoding.GenerateResult]) -> Pooled:
  """Pools the counts of `generate` results of one drafter (compilation excluded from the time)."""
  if not results:
    raise ValueError("results: nothing to pool")
  return Pooled(reached=np.sum([r.reached for r in results], axis=0),
                accepted=np.sum([r.accepted for r in results], axis=0),
                row_rounds=np.concatenate([r.row_rounds for r in results]),
                row_accepted=np.concatenate([r.row_accepted for r in results]),
                tokens=int(sum(int(r.lengths.sum()) for r in results)),
                wall_seconds=float(sum(r.wall_seconds for r in results)),
                rounds=int(sum(r.rounds for r in results)))


def evaluate_pair(target, draft, tokenizer, prompts: Sequence[str], *,
                  temperatures: Sequence[float] = (1.0,), max_new_tokens: int = 2048,
                  concurrency: int = 1, chat: bool = False,
                  chat_kwargs: Mapping[str, Any] | None = None, seed: int = 0,
                  baseline: bool = False, name: str = "draft",
                  progress: bool = True, results: str | None = None, kv: str = "contiguous",
                  num_pages: int | None = None) -> list[StudyRow]:
  """τ, per-position acceptance and tokens/s of `draft` on `prompts`, one `StudyRow` per temperature.

  The prompts are decoded through `concurrency` slots, each taking the next prompt as its row
  finishes (`decoding.queue`); prompt i has seed ``seed + i``, every prompt the key
  ``jax.random.key(seed)`` (so its tokens do not depend on the concurrency); rows stop at the
  tokenizer's stop ids or after `max_new_tokens`. With ``chat=True`` each prompt is one user message
  rendered by the chat template with `chat_kwargs` (DeepSpec's evaluator passes
  ``enable_thinking=False``). `baseline` also decodes autoregressively for the plain tokens/s (NaN
  otherwise). `results`: a JSON-lines file each finished prompt is appended to (`ResultFile`); a
  rerun skips the prompts it holds and pools their counts from it (tokens/s then covers the prompts
  decoded in this run only). `kv`, `num_pages`: the slots' caches, contiguous (default) or paged
  (`decoding.Engine`).
  """
  from tqdm.auto import tqdm

  from dspark_jax.text import generation

  concurrency = _check_concurrency(concurrency)
  ids = generation.encode_prompts(tokenizer, list(prompts), chat=chat, chat_kwargs=chat_kwargs)
  stop_ids = [i for i in tokenizer.stop_token_ids if i < target.config.vocab_size]
  file = None if results is None else ResultFile(results)
  rows = []
  bar = tqdm(total=len(temperatures) * len(ids) * (2 if baseline else 1), desc="eval",
             disable=not progress)
  for temperature in temperatures:
    decode = functools.partial(_decode_queue, target, ids, concurrency, temperature, seed,
                               max_new_tokens, stop_ids, bar, kv=kv, num_pages=num_pages)
    pooled = decode(draft, results=file, name=name)
    plain = decode(None).tokens_per_second if baseline else math.nan
    rows.append(_study_row(name, temperature, pooled, plain))
  bar.close()
  return rows


def format_table(rows: Sequence[StudyRow]) -> str:
  """A markdown table: τ and per-position acceptance with 95 % intervals, tokens/s."""
  gamma = len(rows[0].acceptance)
  head = ("| drafter | T | τ [95 %] | " + " | ".join(f"acc@{k + 1}" for k in range(gamma)) +
          " | tokens/s | plain tokens/s |")
  lines = [head, "|---|---:|---:|" + "---:|" * gamma + "---:|---:|"]
  for row in rows:
    acc = " | ".join("–" if np.isnan(a) else f"{a:.2f} [{lo:.2f}, {hi:.2f}]"
                     for a, (lo, hi) in zip(row.acceptance, row.acceptance_interval))
    lo, hi = row.tau_interval
    plain = ("–" if math.isnan(row.baseline_tokens_per_second)
             else f"{row.baseline_tokens_per_second:.0f}")
    lines.append(f"| {row.drafter} | {row.temperature:g} | {row.tau:.2f} [{lo:.2f}, {hi:.2f}] | "
                 f"{acc} | {row.tokens_per_second:.0f} | {plain} |")
  return "\n".join(lines)


def plot_acceptance(rows: Sequence[StudyRow], path: str) -> str:
  """Per-position conditional acceptance with 95 % intervals, one panel per temperature; saves a
  PNG at `path`. Draws on its own figure and canvas: matplotlib's global backend is not changed."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  temperatures = sorted({row.temperature for row in rows})
  fig = Figure(figsize=(5 * len(temperatures), 3.6))
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(temperatures), squeeze=False)
  for ax, temperature in zip(axes[0], temperatures):
    for row in rows:
      if row.temperature != temperature:
        continue
      positions = np.arange(1, len(row.acceptance) + 1)
      interval = np.asarray(row.acceptance_interval)
      errors = np.abs(interval - np.asarray(row.acceptance)[:, None]).T
      lo, hi = row.tau_interval
      ax.errorbar(positions, row.acceptance, yerr=errors, marker="o", capsize=3,
                  label=f"{row.drafter} (τ = {row.tau:.2f} [{lo:.2f}, {hi:.2f}])")
    ax.set_title(f"T = {temperature:g}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path
