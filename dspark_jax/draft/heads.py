"""The sequential ("Markov") heads and the confidence head of a DSpark draft (docs/design.md).

Each head is a flax nnx module *and* a pure function of a plain params pytree (a dict of arrays), so the
same math runs inside compiled programs that take the weights as arguments.

Markov heads (rank r; ``w1`` [V, r] embedding, ``w2`` [r, V] projection, so ``bias = v @ w2``):

* ``vanilla``: ``v = w1[x_prev]``
* ``gated``:   ``g = sigmoid([h; e] @ gate_w + gate_b)``, ``v = g * e``  with ``e = w1[x_prev]``
* ``rnn``:     ``[a, c, o] = split([s; e; h] @ joint_w + joint_b, 3)``,
  ``s' = sigmoid(a) * s + (1 - sigmoid(a)) * tanh(c)``, ``v = tanh(o)``; the state s starts at 0.
* ``none``:    no sequential head (DeepSpec's ``markov_rank = 0``, a DFlash-style parallel drafter):
  ``w1`` [V, 0] and ``w2`` [0, V] are empty and the bias is exactly 0, so every position is drawn
  from the base logits. The GPU kernels exclude it (`dspark_jax.kernels.dispatch`); XLA runs it.

These are DeepSpec's heads (``deepspec/modeling/dspark/markov_head.py``) with ``w2`` = the transpose
of ``markov_w2.weight`` and ``gate_w`` / ``joint_w`` the transposes of ``gate_proj`` / ``joint_proj``.

Confidence head: ``c_k = sigmoid((w . x + b) / T_k)`` with ``x = h_k`` (``w`` [H]) or
``x = [h_k; w1[x_{k-1}]]`` (``w`` [H + r], "with markov"); ``T_k`` are optional calibrated per-position
temperatures (absent = 1).

Arithmetic (`dspark_jax.kernels.head_steps`, imported here): the small products run in float32;
``v`` is cast to ``w2``'s dtype for the [B, r] x [r, V] product (accumulated in float32), so bf16
weights stream as bf16.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# the heads' arithmetic of one step, as pure functions (its home is below the kernels that run it)
from dspark_jax.kernels.head_steps import (HEAD_KINDS, confidence_step, markov_bias,  # noqa: F401
                                           markov_step, markov_vector)

_HEAD_KEYS = {
    "vanilla": ("w1", "w2"),
    "gated": ("w1", "w2", "gate_w", "gate_b"),
    "rnn": ("w1", "w2", "joint_w", "joint_b"),
    "none": ("w1", "w2"),
}
# ---- validation and construction from arrays -----------------------------------------------------


def _as_float_array(name: str, value) -> jax.Array:
  array = jnp.asarray(value)
  if not jnp.issubdtype(array.dtype, jnp.floating):
    raise ValueError(f"arrays[{name!r}]: expected a float array, got dtype {array.dtype}")
  return array


def _expect_shape(name: str, array, shape) -> None:
  if tuple(array.shape) != tuple(shape):
    raise ValueError(f"arrays[{name!r}]: expected shape {tuple(shape)}, got {tuple(array.shape)}")


def _check_markov_arrays(kind: str, arrays: Mapping) -> dict[str, jax.Array]:
  if kind not in HEAD_KINDS:
    raise ValueError(f"kind: expected one of {HEAD_KINDS}, got {kind!r}")
  needed = _HEAD_KEYS[kind]
  missing = [k for k in needed if k not in arrays]
  if missing:
    raise ValueError(f"arrays: a {kind!r} head needs keys {needed}; missing {missing}")
  unknown = sorted(set(arrays) - set(needed))
  if unknown:
    raise ValueError(f"arrays: unexpected keys {unknown} for a {kind!r} head (expects {needed})")
  out = {k: _as_float_array(k, arrays[k]) for k in needed}
  if out["w1"].ndim != 2:
    raise ValueError(f"arrays['w1']: expected [V, r], got shape {tuple(out['w1'].shape)}")
  vocab, rank = out["w1"].shape
  if kind == "none" and rank != 0:
    raise ValueError(f"arrays['w1']: a 'none' head has rank 0 (w1 [V, 0]), got shape "
                     f"{tuple(out['w1'].shape)}")
  if kind != "none" and rank == 0:
    raise ValueError(f"arrays['w1']: a {kind!r} head needs rank r >= 1, got shape "
                     f"{tuple(out['w1'].shape)} (use kind 'none' for a draft without a head)")
  _expect_shape("w2", out["w2"], (rank, vocab))
  if kind == "gated":
    w = out["gate_w"]
    if w.ndim != 2 or w.shape[1] != rank or w.shape[0] <= rank:
      raise ValueError(f"arrays['gate_w']: expected [H+r, r] with r={rank}, H>0, "
                       f"got {tuple(w.shape)}")
    _expect_shape("gate_b", out["gate_b"], (rank,))
  if kind == "rnn":
    w = out["joint_w"]
    if w.ndim != 2 or w.shape[1] != 3 * rank or w.shape[0] <= 2 * rank:
      raise ValueError(f"arrays['joint_w']: expected [2r+H, 3r] with r={rank}, H>0, "
                       f"got {tuple(w.shape)}")
    _expect_shape("joint_b", out["joint_b"], (3 * rank,))
  return out


def _check_confidence_arrays(arrays: Mapping) -> dict[str, jax.Array]:
  allowed = ("w", "b", "temperatures")
  missing = [k for k in ("w", "b") if k not in arrays]
  if missing:
    raise ValueError(f"arrays: a confidence head needs keys ('w', 'b'); missing {missing}")
  unknown = sorted(set(arrays) - set(allowed))
  if unknown:
    raise ValueError(f"arrays: unexpected keys {unknown} for a confidence head (expects {allowed})")
  out = {k: _as_float_array(k, arrays[k]) for k in allowed if k in arrays}
  if out["w"].ndim != 1:
    raise ValueError(f"arrays['w']: expected [H] or [H+r], got shape {tuple(out['w'].shape)}")
  _expect_shape("b", out["b"], ())
  if "temperatures" in out:
    t = out["temperatures"]
    if t.ndim != 1:
      raise ValueError(f"arrays['temperatures']: expected [γ], got shape {tuple(t.shape)}")
    host = np.asarray(t, np.float64)
    bad = ~np.isfinite(host) | (host <= 0)
    if bad.any():
      row = int(np.flatnonzero(bad)[0])
      raise ValueError(f"arrays['temperatures']: entry {row} is {host[row]}; must be finite, > 0")
  return out


# ---- nnx modules --------------------------------------------------------------------------------


class MarkovHead(nnx.Module):
  """A sequential head (vanilla, gated, rnn, or none: no bias) holding its weights as `nnx.Param`s.

  Build one from arrays with `markov_head_from_arrays`, or with random weights with `MarkovHead.random`.
  ``head(prev_tokens, hidden, state)`` runs `markov_step`; ``head.arrays()`` returns the params pytree.
  """

  def __init__(self, kind: str, arrays: Mapping[str, jax.Array]):
    checked = _check_markov_arrays(kind, arrays)
    self.kind = kind
    for name, value in checked.items():
      setattr(self, name, nnx.Param(value))

  @classmethod
  def random(cls, kind: str, *, vocab_size: int, rank: int, hidden_size: int | None = None,
             rngs: nnx.Rngs, dtype=jnp.float32, bias_scale: float = 1.0) -> "MarkovHead":
    """Random weights scaled so that the bias entries are O(`bias_scale`); kind "none" needs
    ``rank=0`` and gets the empty arrays."""
    if kind == "none":
      if rank != 0:
        raise ValueError(f"rank: a 'none' head has rank 0, got {rank}")
      return cls(kind, {"w1": jnp.zeros((vocab_size, 0), dtype),
                        "w2": jnp.zeros((0, vocab_size), dtype)})
    if kind != "vanilla" and not hidden_size:
      raise ValueError(f"hidden_size: a {kind!r} head needs the backbone hidden size")
    normal = jax.nn.initializers.normal
    arrays = {"w1": normal(1.0)(rngs.params(), (vocab_size, rank), dtype),
              "w2": normal(bias_scale / np.sqrt(rank))(rngs.params(), (rank, vocab_size), dtype)}
    if kind == "gated":
      fan_in = hidden_size + rank
      arrays["gate_w"] = normal(1.0 / np.sqrt(fan_in))(rngs.params(), (fan_in, rank), dtype)
      arrays["gate_b"] = jnp.zeros((rank,), dtype)
    elif kind == "rnn":
      fan_in = 2 * rank + hidden_size
      arrays["joint_w"] = normal(1.0 / np.sqrt(fan_in))(rngs.params(), (fan_in, 3 * rank), dtype)
      arrays["joint_b"] = jnp.zeros((3 * rank,), dtype)
    return cls(kind, arrays)

  @property
  def vocab_size(self) -> int:
    return int(self.w1.shape[0])

  @property
  def rank(self) -> int:
    return int(self.w1.shape[1])

  @property
  def hidden_size(self) -> int | None:
    """H implied by the weights (gated, rnn); None for vanilla and none, which do not see h."""
    if self.kind == "gated":
      return int(self.gate_w.shape[0]) - self.rank
    if self.kind == "rnn":
      return int(self.joint_w.shape[0]) - 2 * self.rank
    return None

  @property
  def needs_hidden(self) -> bool:
    return self.kind in ("gated", "rnn")

  def arrays(self) -> dict[str, jax.Array]:
    """The params pytree: a dict of the weights (keys as in `markov_head_from_arrays`)."""
    return {name: getattr(self, name)[...] for name in _HEAD_KEYS[self.kind]}

  def __call__(self, prev_tokens, hidden=None, state=None):
    if state is None:
      state = jnp.zeros((np.shape(prev_tokens)[0], self.rank), jnp.float32)
    return markov_step(self.kind, self.arrays(), prev_tokens, hidden, state)


class ConfidenceHead(nnx.Module):
  """The confidence head; see `confidence_step`. Build with `confidence_head_from_arrays`."""

  def __init__(self, arrays: Mapping[str, jax.Array]):
    checked = _check_confidence_arrays(arrays)
    self.w = nnx.Param(checked["w"])
    self.b = nnx.Param(checked["b"])
    self.temperatures = (nnx.Param(checked["temperatures"]) if "temperatures" in checked else None)

  @classmethod
  def random(cls, *, width: int, rngs: nnx.Rngs, dtype=jnp.float32) -> "ConfidenceHead":
    """Random weights; `width` is H, or H + r for a head "with markov"."""
    w = jax.nn.initializers.normal(1.0 / np.sqrt(width))(rngs.params(), (width,), dtype)
    return cls({"w": w, "b": jnp.zeros((), dtype)})

  def arrays(self) -> dict[str, jax.Array]:
    out = {"w": self.w[...], "b": self.b[...]}
    if self.temperatures is not None:
      out["temperatures"] = self.temperatures[...]
    return out

  def __call__(self, hidden, e, position):
    return confidence_step(self.arrays(), hidden, e, position)


def markov_head_from_arrays(kind: str, arrays: Mapping[str, np.ndarray]) -> MarkovHead:
  """Builds a sequential head from NumPy (or JAX) arrays; the inputs are copied, never mutated.

  Args:
    kind: "vanilla", "gated", "rnn" or "none" (no sequential head: ``w1`` [V, 0], ``w2`` [0, V]).
    arrays: ``w1`` [V, r] (embedding) and ``w2`` [r, V] (``bias = w1[x] @ w2``) for every kind;
      gated adds ``gate_w`` [H+r, r] (input order [h; e]) and ``gate_b`` [r]; rnn adds ``joint_w``
      [2r+H, 3r] (input order [s; e; h], output split [gate; candidate; output]) and ``joint_b`` [3r].

  Raises:
    ValueError: unknown kind, missing or unexpected keys, inconsistent shapes, non-float arrays.
  """
  return MarkovHead(kind, arrays)


def confidence_head_from_arrays(arrays: Mapping[str, np.ndarray]) -> ConfidenceHead:
  """Builds a confidence head from ``w`` [H] or [H+r] (with markov: input [h; w1[x_prev]]), ``b`` []
  and optionally ``temperatures`` [γ] (calibrated, > 0). Inputs are copied, never mutated."""
  return ConfidenceHead(arrays)
