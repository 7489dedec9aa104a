"""The acceptance study behind ``dspark-jax eval``: DSpark drafter vs its parallel ablation.

This module owns the measurement the paper's Table 1 and Fig. 2 make, on the shipped pair: for each
temperature, the held-out prompts are decoded speculatively with the DSpark drafter (sequential head)
and with the ablation trained without it, and once autoregressively. It reports τ (mean tokens per
round, accepted drafts + bonus), the per-position conditional acceptance P(draft k accepted | drafts
1..k-1 accepted), and tokens/s of each decoder. `format_table` prints it; `plot_acceptance` draws the
per-position curves (a PNG, via matplotlib).

Each configuration is one `generate` call over all prompts (its compilation excluded from tokens/s);
rows stop at ``<|endoftext|>`` or after ``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dspark_jax.train import data
from dspark_jax import decoding
from dspark_jax.sampling import params as sp
from dspark_jax.models import shipped


@dataclasses.dataclass
class StudyRow:
  """One (drafter, temperature) configuration of the study."""

  drafter: str
  temperature: float
  tau: float
  acceptance: np.ndarray
  rounds: int
  tokens: int
  tokens_per_second: float
  baseline_tokens_per_second: float

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["acceptance"] = [None if np.isnan(a) else float(a) for a in self.acceptance]
    return out


def acceptance_study(pair: shipped.ShippedPair, *, num_prompts: int | None = None,
                     max_new_tokens: int = 128, temperatures: Sequence[float] = (0.0, 1.0),
                     seed: int = 0, progress: bool = True) -> list[StudyRow]:
  """Runs the study on the first `num_prompts` held-out prompts (all by default)."""
  from tqdm.auto import tqdm

  texts = pair.prompts[:num_prompts] if num_prompts else pair.prompts
  prompts = [pair.encode(t) for t in texts]
  drafters = {"dspark": pair.draft, "parallel (ablation)": pair.ablation}
  rows = []
  bar = tqdm(total=len(temperatures) * (len(drafters) + 1), desc="eval", disable=not progress)
  for temperature in temperatures:
    params = sp.SamplingParams(temperature=np.full(len(prompts), temperature),
                               seed=np.arange(len(prompts)) + seed)
    key = jax.random.key(seed)
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=[data.END_OF_TEXT_ID])
    baseline = decoding.generate(pair.target, None, prompts, params, key, spec=False, **common)
    bar.update(1)
    for name, draft in drafters.items():
      result = decoding.generate(pair.target, draft, prompts, params, key, **common)
      rows.append(StudyRow(drafter=name, temperature=float(temperature), tau=result.tau,
                           acceptance=result.acceptance, rounds=result.rounds,
                           tokens=int(result.lengths.sum()),
                           tokens_per_second=result.tokens_per_second,
                           baseline_tokens_per_second=baseline.tokens_per_second))
      bar.update(1)
  bar.close()
  return rows


def format_table(rows: Sequence[StudyRow]) -> str:
  """A markdown table: τ, per-position acceptance and tokens/s per configuration."""
  gamma = len(rows[0].acceptance)
  head = ("| drafter | T | τ | " + " | ".join(f"acc@{k + 1}" for k in range(gamma)) +
          " | tokens/s | plain tokens/s |")
  lines = [head, "|---|---:|---:|" + "---:|" * gamma + "---:|---:|"]
  for row in rows:
    acc = " | ".join("–" if np.isnan(a) else f"{a:.2f}" for a in row.acceptance)
    lines.append(f"| {row.drafter} | {row.temperature:g} | {row.tau:.2f} | {acc} | "
                 f"{row.tokens_per_second:.0f} | {row.baseline_tokens_per_second:.0f} |")
  return "\n".join(lines)


def plot_acceptance(rows: Sequence[StudyRow], path: str) -> str:
  """Per-position conditional acceptance, one panel per temperature; saves a PNG at `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  temperatures = sorted({row.temperature for row in rows})
  fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 3.6), squeeze=False)
  for ax, temperature in zip(axes[0], temperatures):
    for row in rows:
      if row.temperature != temperature:
        continue
      positions = np.arange(1, len(row.acceptance) + 1)
      ax.plot(positions, row.acceptance, marker="o", label=f"{row.drafter} (τ = {row.tau:.2f})")
    ax.set_title(f"T = {temperature:g}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
