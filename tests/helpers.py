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


def assert_same_block(a, b, *, fields=("tokens", "corrected_logits", "greedy_mask", "temperatures",
                                       "confidence")):
  """Two blocks from different programs (folded vs eager, padded vs not) are the same block.

  On the CPU this is bit-for-bit equality (the contract CI checks). On a GPU, XLA may pick another
  kernel for the [B, r] x [r, V] product in each program, so the corrected logits may differ in their
  last bit; there we demand closeness, and identical tokens for every row whose corrected logits
  came out bit-identical (a row with a last-bit difference may legitimately draw another token when
  its top two Gumbel scores are that close; each path still samples exactly from its own logits).
  """
  import jax
  if jax.default_backend() == "cpu":
    for field in fields:
      x, y = getattr(a, field), getattr(b, field)
      assert (x is None) == (y is None), field
      if x is not None:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field)
    return
  x = np.asarray(a.corrected_logits, np.float32)
  y = np.asarray(b.corrected_logits, np.float32)
  np.testing.assert_allclose(x, y, rtol=2**-7, atol=1e-6)
  same = np.all(x == y, axis=(1, 2))
  np.testing.assert_array_equal(np.asarray(a.tokens)[same], np.asarray(b.tokens)[same])


def edge_rows(batch, gamma, vocab, nan_at, tie_at, seed=12, tie_value=50.0):
  """[batch, γ, V] float32 base logits whose first rows are edge cases: rows 0-1 all -inf, rows 2-3
  a NaN at column `nan_at`, rows 4-5 an exact tie between the two columns `tie_at`; the rest
  normal."""
  rng = np.random.default_rng(seed)
  base = rng.normal(0, 2, (batch, gamma, vocab)).astype(np.float32)
  base[0:2] = -np.inf
  base[2:4, :, nan_at] = np.nan
  base[4:6] = 0.0
  base[4:6, :, list(tie_at)] = tie_value
  return base

