"""Synthetic acceptance: the real forwards of a target, with greedy verification outcomes drawn from
a given law, so that a serving run on random weights accepts as a trained pair would.

Random weights accept almost nothing (τ ≈ 1), and the shipped pair is too small for its verify to
cost what a Qwen3-4B target's does. `synthetic_target` keeps every forward of a target (its cost
is what is measured) and rewrites only its greedy choice after a drafted token:

* **Acceptance law** (``rates`` = c_1 … c_γ): a query at slot j of a row's block whose next token in
  that block is the draft x_{j+1} puts its arg-max on x_{j+1} with probability ``c_{j+1}``
  (``c_γ`` for slots past γ), and on another token otherwise. A greedy row's verify therefore
  accepts draft k, given drafts < k were accepted, with probability c_k, independently of
  everything else: τ = 1 + Σ_k Π_{i ≤ k} c_i for a full verify. The draw is a hash of the query's
  position, its token and the next token (no key to thread through the engine); a row at a new
  position draws afresh.
* Queries with no next token in their block (the last slot, an autoregressive step, the last
  packed token of a row) keep the target's own logits.
* **Rows that differ** (``spread`` σ ≥ 0): row r (the engine's slot r) accepts draft k with
  c_{r,k} = sigmoid(logit(c_k) + σ·z_{r,k}) instead, z_{r,k} a standard normal hashed from (r, k):
  easy and hard rows side by side, as a trained drafter's calibrated confidence sees them (the
  paper's confidence AUC is 0.81–0.91). σ = 0 is the plain law. A schedule can only gain over
  `fixed` where rows differ: with equal rows every row's drafts are worth the same, and on the
  H100's round tables no uniform verify length beats the full one (BENCHMARKS.md).
* **Confidence** (`law_confidence`): a schedule that reads the draft's confidences is given the
  same c_{r,k} instead: a perfectly calibrated head, so its decisions are consistent with the law.

Only greedy rows (temperature 0) follow the law: a sampled row's acceptance reads the target's
probabilities, which the rewrite does not make consistent with it. The logits are the target's own
everywhere else, so the LM head and every layer still run.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import target as tm
from dspark_jax.scheduling import schedules

DEFAULT_RATES = (0.82, 0.78, 0.74, 0.70, 0.65, 0.60, 0.55)
"""c_1..c_7: τ ≈ 3.66 for a full verify, about the paper's MT-Bench τ for Qwen3-4B."""
FORCED_LOGIT = 1e4
"""The forced token's logit: above any logit a bf16 target of ours produces."""


def mean_tau(rates: Sequence[float], spread: float, rows: int) -> float:
  """The mean over rows 0..rows-1 of `expected_tau` of their rates c_{r,k} (`row_rates`)."""
  gamma = len(rates)
  law = np.asarray(row_rates(check_rates(rates), check_spread(spread),
                             jnp.arange(rows, dtype=jnp.int32)[:, None],
                             jnp.arange(gamma, dtype=jnp.int32)[None, :]), np.float64)
  return float(np.mean(1.0 + np.cumprod(law, axis=1).sum(axis=1)))


def expected_tau(rates: Sequence[float], verified: int | None = None) -> float:
  """τ of a round verifying `verified` drafts (default all) under the law:
  1 + Σ_{k ≤ verified} Π_{i ≤ k} c_i."""
  total, survive = 1.0, 1.0
  for c in list(rates)[:len(rates) if verified is None else verified]:
    survive *= float(c)
    total += survive
  return total


def check_rates(rates: Sequence[float]) -> tuple[float, ...]:
  """`rates` as a tuple of floats, each in [0, 1], at least one (ValueError naming the first bad)."""
  out = tuple(float(r) for r in rates)
  if not out:
    raise ValueError("rates: expected at least one conditional acceptance rate")
  for i, r in enumerate(out):
    if not 0.0 <= r <= 1.0:
      raise ValueError(f"rates: c_{i + 1} = {r} is not in [0, 1]")
  return out


def _uniform(*parts: jax.Array) -> jax.Array:
  """A float32 in [0, 1) per element, a hash (murmur3's finaliser, chained) of the int parts."""
  h = jnp.uint32(0x9E3779B9)
  for part in parts:
    h = h ^ part.astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def check_spread(spread) -> float:
  """`spread` as a float >= 0 (ValueError naming it)."""
  value = float(spread)
  if not value >= 0.0:
    raise ValueError(f"spread: expected a number >= 0, got {spread!r}")
  return value


def row_rates(rates: Sequence[float], spread: float, rows: jax.Array, slots: jax.Array
              ) -> jax.Array:
  """float32 c_{r,k} of draft k = ``slots + 1`` (slots past γ - 1 read c_γ) in row r = `rows`
  (broadcast together): sigmoid(logit(c_k) + spread·z_{r,k}), z a standard normal hashed from
  (r, k); with ``spread == 0`` exactly c_k (module docstring)."""
  law = jnp.asarray(rates, jnp.float32)
  k = jnp.minimum(slots, law.shape[0] - 1)
  c = law[k]
  if not spread:
    return c
  rows = jnp.asarray(rows, jnp.int32)
  u1 = jnp.maximum(_uniform(rows, k, jnp.int32(1)), jnp.float32(2.0 ** -24))
  u2 = _uniform(rows, k, jnp.int32(2))
  z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * jnp.pi * u2)
  logit = jnp.log(c) - jnp.log1p(-c)   # ±inf at c = 1 or 0: those rows stay sure
  return jax.nn.sigmoid(logit + jnp.float32(spread) * z)


def force_choice(logits: jax.Array, tokens: jax.Array, following: jax.Array, slots: jax.Array,
                 positions: jax.Array, rates: Sequence[float], rows: jax.Array | None = None,
                 spread: float = 0.0) -> jax.Array:
  """The law's greedy choice written into `logits` [..., V] (module docstring).

  Args:
    logits: [..., V]. tokens, positions: [...] the queries' tokens and absolute positions.
    following: [...] the next token of each query's block, -1 where there is none.
    slots: [...] each query's slot in its row's block (0 = the anchor).
    rates: c_1..c_γ. rows, spread: [...] each query's row, and σ (`row_rates`); rows may be None
      when spread is 0.
  """
  vocab = logits.shape[-1]
  c = row_rates(rates, spread, 0 if rows is None else rows, slots)
  keep = _uniform(positions, tokens, following) < c
  choice = jnp.where(keep, following, (following + 1) % vocab)
  forced = (following >= 0)[..., None] & (jnp.arange(vocab) == choice[..., None])
  return jnp.where(forced, jnp.asarray(FORCED_LOGIT, logits.dtype), logits)


class SyntheticTarget(tm.TargetModel):
  """A `TargetModel` whose greedy choice after a drafted token follows `rates` (module docstring).

  Build one with `synthetic_target`; it shares the wrapped target's parameters.
  """

  rates: tuple[float, ...] = ()
  spread: float = 0.0

  def __call__(self, tokens, positions, cache, *, head=True, fresh=False):
    logits, features, cache = super().__call__(tokens, positions, cache, head=head, fresh=fresh)
    if not head:  # hidden states (a prefill): no drafted token to accept
      return logits, features, cache
    following = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], -1)], axis=1)
    slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None], tokens.shape)
    return force_choice(logits, tokens, following, slots, positions, self.rates, rows,
                        self.spread), features, cache

  def packed(self, tokens, rows, slots, positions, cache, width):
    logits, features, cache = super().packed(tokens, rows, slots, positions, cache, width)
    same_row = jnp.concatenate([rows[1:] == rows[:-1], jnp.zeros((1,), bool)])
    following = jnp.where(same_row, jnp.roll(tokens, -1), -1)
    return force_choice(logits, tokens, following, slots, positions, self.rates, rows,
                        self.spread), features, cache


def synthetic_target(target: tm.TargetModel, rates: Sequence[float], spread: float = 0.0
                     ) -> SyntheticTarget:
  """A `SyntheticTarget` over `target`'s parameters (shared, not copied) with law `rates` and
  rows spread by `spread` (module docstring)."""
  rates = check_rates(rates)
  spread = check_spread(spread)
  _, state = nnx.split(target)
  shell = nnx.eval_shape(lambda: SyntheticTarget(target.config, rngs=nnx.Rngs(0)))
  nnx.update(shell, state)
  shell.rates = rates
  shell.spread = spread
  return shell


def law_confidence(schedule: schedules.Schedule | None, rates: Sequence[float],
                   spread: float = 0.0) -> schedules.Schedule | None:
  """`schedule` deciding on the law's confidences c_{r,k} (`row_rates`) instead of the draft's."""
  if schedule is None:
    return None
  rates = check_rates(rates)
  spread = check_spread(spread)

  def update(confidence, active, state):
    batch, gamma = confidence.shape
    if gamma != len(rates):
      raise ValueError(f"rates: {len(rates)} rates for a block of γ = {gamma}")
    law = row_rates(rates, spread, jnp.arange(batch, dtype=jnp.int32)[:, None],
                    jnp.arange(gamma, dtype=jnp.int32)[None, :])
    return schedule.update(jnp.broadcast_to(law, confidence.shape), active, state)

  return schedules.Schedule(init=schedule.init, update=update,
                            buckets=getattr(schedule, "buckets", None))
