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
* **Confidence** (`law_confidence`): a schedule that reads the draft's confidences is given the
  same c_k instead: a perfectly calibrated head, so its decisions are consistent with the law.

Only greedy rows (temperature 0) follow the law: a sampled row's acceptance reads the target's
probabilities, which the rewrite does not make consistent with it. The logits are the target's own
everywhere else, so the LM head and every layer still run.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import target as tm
from dspark_jax.scheduling import schedules

DEFAULT_RATES = (0.82, 0.78, 0.74, 0.70, 0.65, 0.60, 0.55)
"""c_1..c_7: τ ≈ 3.66 for a full verify, about the paper's MT-Bench τ for Qwen3-4B."""
FORCED_LOGIT = 1e4
"""The forced token's logit: above any logit a bf16 target of ours produces."""


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


def force_choice(logits: jax.Array, tokens: jax.Array, following: jax.Array, slots: jax.Array,
                 positions: jax.Array, rates: Sequence[float]) -> jax.Array:
  """The law's greedy choice written into `logits` [..., V] (module docstring).

  Args:
    logits: [..., V]. tokens, positions: [...] the queries' tokens and absolute positions.
    following: [...] the next token of each query's block, -1 where there is none.
    slots: [...] each query's slot in its row's block (0 = the anchor).
    rates: c_1..c_γ.
  """
  law = jnp.asarray(rates, jnp.float32)
  vocab = logits.shape[-1]
  c = law[jnp.minimum(slots, law.shape[0] - 1)]
  keep = _uniform(positions, tokens, following) < c
  choice = jnp.where(keep, following, (following + 1) % vocab)
  forced = (following >= 0)[..., None] & (jnp.arange(vocab) == choice[..., None])
  return jnp.where(forced, jnp.asarray(FORCED_LOGIT, logits.dtype), logits)


class SyntheticTarget(tm.TargetModel):
  """A `TargetModel` whose greedy choice after a drafted token follows `rates` (module docstring).

  Build one with `synthetic_target`; it shares the wrapped target's parameters.
  """

  rates: tuple[float, ...] = ()

  def __call__(self, tokens, positions, cache, *, head=True, fresh=False):
    logits, features, cache = super().__call__(tokens, positions, cache, head=head, fresh=fresh)
    if not head:  # hidden states (a prefill): no drafted token to accept
      return logits, features, cache
    following = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], -1)], axis=1)
    slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return force_choice(logits, tokens, following, slots, positions, self.rates), features, cache

  def packed(self, tokens, rows, slots, positions, cache, width):
    logits, features, cache = super().packed(tokens, rows, slots, positions, cache, width)
    same_row = jnp.concatenate([rows[1:] == rows[:-1], jnp.zeros((1,), bool)])
    following = jnp.where(same_row, jnp.roll(tokens, -1), -1)
    return force_choice(logits, tokens, following, slots, positions, self.rates), features, cache


def synthetic_target(target: tm.TargetModel, rates: Sequence[float]) -> SyntheticTarget:
  """A `SyntheticTarget` over `target`'s parameters (shared, not copied) with law `rates`."""
  rates = check_rates(rates)
  _, state = nnx.split(target)
  shell = nnx.eval_shape(lambda: SyntheticTarget(target.config, rngs=nnx.Rngs(0)))
  nnx.update(shell, state)
  shell.rates = rates
  return shell


def law_confidence(schedule: schedules.Schedule | None, rates: Sequence[float]
                   ) -> schedules.Schedule | None:
  """`schedule` deciding on confidences c_1..c_γ in every row instead of the draft's."""
  if schedule is None:
    return None
  law = jnp.asarray(check_rates(rates), jnp.float32)

  def update(confidence, active, state):
    if confidence.shape[-1] != law.shape[0]:
      raise ValueError(f"rates: {law.shape[0]} rates for a block of γ = {confidence.shape[-1]}")
    return schedule.update(jnp.broadcast_to(law, confidence.shape), active, state)

  return schedules.Schedule(init=schedule.init, update=update,
                            buckets=getattr(schedule, "buckets", None))
