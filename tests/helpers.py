"""Shared builders for the tests: random head arrays of the documented layouts."""

import numpy as np

import dspark_jax as dj


def head_arrays(kind, vocab, rank, hidden, seed=0, scale=1.0):
  """Arrays in the layout `markov_head_from_arrays` documents, float32."""
  rng = np.random.default_rng(seed)
  arrays = {"w1": rng.normal(0, 1, (vocab, rank)),
            "w2": rng.normal(0, scale / np.sqrt(rank), (rank, vocab))}
  if kind == "gated":
    arrays["gate_w"] = rng.normal(0, 1 / np.sqrt(hidden + rank), (hidden + rank, rank))
    arrays["gate_b"] = rng.normal(0, 0.5, rank)
  if kind == "rnn":
    arrays["joint_w"] = rng.normal(0, 1.5 / np.sqrt(2 * rank + hidden), (2 * rank + hidden, 3 * rank))
    arrays["joint_b"] = rng.normal(0, 0.5, 3 * rank)
  return {k: v.astype(np.float32) for k, v in arrays.items()}


def confidence_arrays(width, gamma=None, seed=1):
  rng = np.random.default_rng(seed)
  arrays = {"w": rng.normal(0, 1 / np.sqrt(width), width).astype(np.float32),
            "b": np.float32(0.2)}
  if gamma is not None:
    arrays["temperatures"] = rng.uniform(0.5, 2.0, gamma).astype(np.float32)
  return arrays


def make_head(kind, vocab, rank, hidden, seed=0, scale=1.0):
  return dj.markov_head_from_arrays(kind, head_arrays(kind, vocab, rank, hidden, seed, scale))
