"""Exact reference laws and the goodness-of-fit statistic behind every distribution check.

This module owns the *independent* side of the distribution tests: plain NumPy float64 evaluations of
the math in docs/exactness.md, written without JAX and without sharing code with the implementation, and
the Pearson chi-square used to compare observed counts with them. The test suite and
``notebooks/distribution_checks.ipynb`` both use it, so a researcher can rerun every proof.

* heads: `head_bias`, `confidence`, `corrected_logits` (one row, teacher-forced), `block_law` (the
  exact joint law of a drafted block, by enumeration).
* verification: `target_probs` (temperature, top-k, top-p of one row) and `chain_law` (the exact law of the
  next L tokens of a Markov target, greedy or sampled, with stop tokens).
* `chi_square`: Pearson's statistic with small cells pooled.
"""

from __future__ import annotations

import itertools

import numpy as np

MIN_EXPECTED = 5.0
"""Cells expected to hold fewer counts than this are pooled (the chi-square approximation needs it)."""


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
  x = np.asarray(x, np.float64)
  z = np.exp(x - x.max())
  return z / z.sum()


def head_bias(kind, arrays, prev, hidden, state):
  """The head of one row (docs/design.md): returns (bias [V], e [r], new_state [r]) in float64."""
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


def target_probs(logits, temperature, top_k=0, top_p=1.0):
  """One row's target law: softmax(logits / T), then top-k, then top-p on the renormalised top-k law.

  "Most likely" orders by the scaled logit, ties by the smaller token id. Returns float64 [V].
  """
  scaled = np.asarray(logits, np.float64) / max(float(temperature), 1e-5)
  order = sorted(range(scaled.shape[0]), key=lambda i: (-scaled[i], i))
  probs = softmax(scaled)
  kept = order[:top_k] if top_k > 0 else order
  mass = probs[kept] / probs[kept].sum()
  if top_p < 1.0:
    cumulative = np.cumsum(mass)
    count = int(np.searchsorted(cumulative, top_p)) + 1  # smallest prefix whose mass reaches top_p
    kept = kept[:count]
  out = np.zeros_like(probs)
  out[kept] = probs[kept]
  return out / out.sum()


def chain_law(table, start, length, *, temperature=1.0, top_k=0, top_p=1.0, greedy=False,
              stop_tokens=()):
  """Exact law of the next `length` tokens of a Markov target, sampled autoregressively.

  Args:
    table: [V, V] logits; row i is the target's next-token logits after token i.
    start: the token before the first generated one.
    length: number of tokens generated.
    temperature, top_k, top_p: the row's sampling parameters (`target_probs`).
    greedy: the point mass on the argmax chain (ties -> smallest id) instead.
    stop_tokens: generation ends after the first of these; later slots hold the pad symbol V.

  Returns:
    float64 array of shape [V + 1] * length over outcomes (symbol V = nothing generated).
  """
  table = np.asarray(table, np.float64)
  vocab = table.shape[0]
  stops = set(int(t) for t in stop_tokens)
  law = np.zeros((vocab + 1,) * length)

  def step_probs(prev):
    if greedy:
      out = np.zeros(vocab)
      out[int(np.argmax(table[prev]))] = 1.0
      return out
    return target_probs(table[prev], temperature, top_k, top_p)

  def visit(prefix, prob, prev):
    if len(prefix) == length:
      law[tuple(prefix)] += prob
      return
    if prefix and prefix[-1] in stops:
      visit(prefix + [vocab] * (length - len(prefix)), prob, prev)
      return
    for token, p in enumerate(step_probs(prev)):
      if p > 0:
        visit(prefix + [token], prob * p, token)

  visit([], 1.0, start)
  return law


def chi_square(counts, probs, min_expected: float = MIN_EXPECTED):
  """Pearson chi-square of observed `counts` against the exact law `probs` (same shape, any rank).

  Outcomes whose expected count is below `min_expected` are pooled into one bin (dropped if the pool
  itself is still below it) so the chi-square approximation holds. An outcome observed where the law
  puts zero mass returns p = 0.

  Returns:
    (statistic, degrees of freedom, p-value).
  """
  try:
    from scipy import stats  # a test-time dependency (the `test` extra)
  except ImportError as error:
    raise ImportError("dspark_jax.testing.law_checks.chi_square needs scipy: pip install "
                      "'dspark-jax[test]' (or scipy)") from error

  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  n = counts.sum()
  if np.any(counts[probs == 0] > 0):
    return np.inf, 0, 0.0
  expected = n * probs
  big = expected >= min_expected
  obs = list(counts[big])
  exp = list(expected[big])
  small_exp = expected[~big].sum()
  if small_exp >= min_expected:
    obs.append(counts[~big].sum())
    exp.append(small_exp)
  obs, exp = np.array(obs), np.array(exp)
  exp = exp * obs.sum() / exp.sum()  # condition on the pooled total
  statistic = float(((obs - exp) ** 2 / exp).sum())
  dof = len(obs) - 1
  return statistic, dof, float(stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0


def outcome_counts(sequences, vocab: int) -> np.ndarray:
  """Counts of [N, L] sequences over symbols 0..V (V = pad) as an array of shape [V + 1] * L."""
  sequences = np.asarray(sequences)
  counts = np.zeros((vocab + 1,) * sequences.shape[1])
  np.add.at(counts, tuple(sequences.T), 1)
  return counts
