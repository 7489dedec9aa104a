"""Independent NumPy (float64) evaluation of SPEC §3: heads, corrected logits, exact block laws."""

from __future__ import annotations

import itertools

import numpy as np


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
  x = np.asarray(x, np.float64)
  z = np.exp(x - x.max())
  return z / z.sum()


def head_bias(kind, arrays, prev, hidden, state):
  """SPEC §3 for one row: returns (bias [V], e [r], new_state [r]) in float64."""
  a = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
  e = a["w1"][prev]
  if kind == "vanilla":
    v = e
  elif kind == "gated":
    g = sigmoid(np.concatenate([hidden, e]) @ a["gate_w"] + a["gate_b"])
    v = g * e
  elif kind == "rnn":
    r = e.shape[0]
    z = np.concatenate([state, e, hidden]) @ a["joint_w"] + a["joint_b"]
    gate, cand, out = z[:r], z[r:2 * r], z[2 * r:]
    state = sigmoid(gate) * state + (1 - sigmoid(gate)) * np.tanh(cand)
    v = np.tanh(out)
  else:
    raise ValueError(kind)
  return v @ a["w2"], e, state


def confidence(arrays, hidden, e, k):
  w = np.asarray(arrays["w"], np.float64)
  x = hidden if w.shape[0] == hidden.shape[0] else np.concatenate([hidden, e])
  raw = x @ w + float(arrays["b"])
  if "temperatures" in arrays:
    raw = raw / float(arrays["temperatures"][k])
  return sigmoid(raw)


def corrected_logits(kind, arrays, base, anchor, hidden, tokens):
  """Corrected logits [γ, V] of one row given its drafted `tokens` (teacher-forced on them)."""
  gamma = base.shape[0]
  rank = np.shape(arrays["w1"])[1]
  state = np.zeros(rank)
  prev = anchor
  out = []
  for k in range(gamma):
    h = None if hidden is None else np.asarray(hidden[k], np.float64)
    bias, _, state = head_bias(kind, arrays, prev, h, state)
    out.append(np.asarray(base[k], np.float64) + bias)
    prev = tokens[k]
  return np.stack(out)


def block_law(kind, arrays, base, anchor, hidden, temperature):
  """Exact law of a block's token sequence for one sampled row: array [V]*γ of probabilities."""
  gamma, vocab = base.shape
  rank = np.shape(arrays["w1"])[1]
  law = np.zeros((vocab,) * gamma)
  for seq in itertools.product(range(vocab), repeat=gamma):
    logits = corrected_logits(kind, arrays, base, anchor, hidden, seq)
    p = 1.0
    for k in range(gamma):
      p *= softmax(logits[k] / temperature)[seq[k]]
    law[seq] = p
  del rank
  return law
