"""The heads' arithmetic of one draft step, as pure functions of their arrays (a dict).

This module owns what a sequential ("Markov") head and the confidence head compute at one block
position: `markov_vector` (the rank-r vector ``v``), `markov_bias` (``v @ W2``), `markov_step`
(both) and `confidence_step`. The heads themselves, their checks and their nnx modules are
`dspark_jax.draft.heads` (which imports these functions, and documents the formulas); the XLA block
(`draft.block`) and the kernels' block (`pallas_block`) call them inside compiled programs.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

HEAD_KINDS = ("vanilla", "gated", "rnn", "none")
_HIGHEST = jax.lax.Precision.HIGHEST


def _dense(x, w, b=None):
  y = jnp.dot(x, w.astype(jnp.float32), precision=_HIGHEST)
  return y if b is None else y + b.astype(jnp.float32)


def markov_vector(kind: str, params: Mapping[str, jax.Array], prev_tokens: jax.Array,
                  hidden: jax.Array | None, state: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The rank-r vector a sequential head multiplies with ``W2`` (``bias = v @ W2``), for one step.

  Args:
    kind: "vanilla", "gated", "rnn" or "none".
    params: the head's arrays (see `draft.heads.markov_head_from_arrays`).
    prev_tokens: [B] int, the token sampled at the previous step (the anchor at step 1).
    hidden: [B, H] backbone hidden state of this position; unused (may be None) for "vanilla" and
      "none".
    state: [B, r] float32 recurrent state; carried unchanged by "vanilla", "gated" and "none".

  Returns:
    ``(v [B, r] float32, e [B, r] float32 = w1[prev_tokens], new_state [B, r] float32)``.
  """
  e = jnp.take(params["w1"], prev_tokens, axis=0).astype(jnp.float32)
  if kind in ("vanilla", "none"):
    v = e                                    # "none": [B, 0]
  elif kind == "gated":
    gate = jax.nn.sigmoid(_dense(jnp.concatenate([hidden.astype(jnp.float32), e], -1),
                                 params["gate_w"], params["gate_b"]))
    v = gate * e
  elif kind == "rnn":
    joint = _dense(jnp.concatenate([state, e, hidden.astype(jnp.float32)], -1),
                   params["joint_w"], params["joint_b"])
    a, c, o = jnp.split(joint, 3, axis=-1)
    keep = jax.nn.sigmoid(a)
    state = keep * state + (1.0 - keep) * jnp.tanh(c)
    v = jnp.tanh(o)
  else:
    raise ValueError(f"kind: expected one of {HEAD_KINDS}, got {kind!r}")
  return v, e, state


def markov_step(kind: str, params: Mapping[str, jax.Array], prev_tokens: jax.Array,
                hidden: jax.Array | None, state: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One step of a sequential head: `markov_vector`, then ``bias = v @ W2``.

  Returns:
    ``(bias [B, V] float32, e [B, r] float32 = w1[prev_tokens], new_state [B, r] float32)``.
  """
  v, e, state = markov_vector(kind, params, prev_tokens, hidden, state)
  return markov_bias(params["w2"], v), e, state


def markov_bias(w2: jax.Array, v: jax.Array) -> jax.Array:
  """``bias = v @ W2``: [B, V] float32 from [B, r] vectors (cast to W2's dtype first) and [r, V].

  r = 0 (a draft without a sequential head) gives exact zeros."""
  if w2.shape[0] == 0:
    return jnp.zeros((*v.shape[:-1], w2.shape[1]), jnp.float32)
  # float32 weights get full-precision products (no TF32); 16-bit weights stream as they are.
  precision = _HIGHEST if w2.dtype == jnp.float32 else None
  return jnp.dot(v.astype(w2.dtype), w2, preferred_element_type=jnp.float32, precision=precision)


def confidence_step(params: Mapping[str, jax.Array], hidden: jax.Array, e: jax.Array,
                    position: int | jax.Array) -> jax.Array:
  """[B] float32 confidence of one block position.

  Args:
    params: ``w`` [H] or [H + r], ``b`` [], optional ``temperatures`` [γ].
    hidden: [B, H] hidden state of this position.
    e: [B, r] ``w1[x_{k-1}]`` from the Markov head (used only when ``w`` is [H + r]).
    position: 0-based index k-1 of the position in the block (selects the temperature).
  """
  w = params["w"]
  width = hidden.shape[-1]
  if w.shape[0] == width:
    x = hidden.astype(jnp.float32)
  elif w.shape[0] == width + e.shape[-1]:
    x = jnp.concatenate([hidden.astype(jnp.float32), e], -1)
  else:
    raise ValueError(f"confidence w: has {w.shape[0]} entries; expected H={width} or "
                     f"H+r={width + e.shape[-1]}")
  raw = _dense(x, w, params["b"])
  if "temperatures" in params:
    raw = raw / params["temperatures"][position].astype(jnp.float32)
  return jax.nn.sigmoid(raw)
