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



RELATIVE = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -10}
"""How far two compiled programs' corrected logits may part, relative to the row's largest
magnitude: one unit in the last place of a 16-bit dtype (both round the same float32 sum); for
float32, the precision of TF32, which XLA may use for float32 products on a GPU."""


def assert_blocks_agree(ref, other, *, what="block"):
  """Two differently compiled programs' blocks of the same draft agree as far as floats allow.

  `ref` and `other` are ``(tokens [B, γ], corrected [B, γ, V] | None, ...)``. Bit equality of floats
  between differently compiled programs (XLA against a kernel in Pallas' interpreter, or two kernel
  forms) depends on the host's instruction set, so this asserts what holds on every machine. Per row,
  up to the first step whose drafted tokens differ: the corrected logits agree within `RELATIVE`
  of the dtype times the row's largest magnitude (NaN where NaN, equal infinities), and where a
  step's logits are bit for bit equal, its token is equal (the draw is integer and selection logic on equal values and equal
  noise). Without logits (greedy-only blocks) tokens are compared as a whole: at least half the rows
  must draft the same tokens through the whole block (near-ties may go either way), which also keeps
  the check from passing vacuously. The law of each program is checked by the law tests.
  """
  tokens_a, tokens_b = np.asarray(ref[0]), np.asarray(other[0])
  assert tokens_a.shape == tokens_b.shape, f"{what}: token shapes {tokens_a.shape} {tokens_b.shape}"
  logits_a = None if ref[1] is None else np.asarray(ref[1], np.float32)
  logits_b = None if other[1] is None else np.asarray(other[1], np.float32)
  assert (logits_a is None) == (logits_b is None), f"{what}: one block has no corrected logits"
  dtype = None if ref[1] is None else np.dtype(getattr(ref[1], "dtype", np.float32))
  tolerance = RELATIVE.get(np.dtype(dtype).name, 2.0 ** -10) if dtype is not None else 0.0
  whole_rows = 0
  for row in range(tokens_a.shape[0]):
    for step in range(tokens_a.shape[1]):
      if logits_a is not None:
        a, b = logits_a[row, step], logits_b[row, step]
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what}: row {row} "
                                      f"step {step}: NaN positions differ")
        finite = np.isfinite(a) & np.isfinite(b)
        np.testing.assert_array_equal(a[~finite & ~np.isnan(a)], b[~finite & ~np.isnan(a)],
                                      err_msg=f"{what}: row {row} step {step}: infinities differ")
        # A sum's rounding error scales with its terms, not with the result (cancellation).
        scale = max(float(np.max(np.abs(a[finite]), initial=0.0)), 1e-30)
        np.testing.assert_array_less(np.abs(a[finite] - b[finite]), tolerance * scale * 1.0001,
                                     err_msg=f"{what}: row {row} step {step}: logits differ by "
                                     f"more than {tolerance:g} of the row's largest magnitude")
        same = np.array_equal(a, b, equal_nan=True)
      else:  # greedy-only: no logits to compare; near-ties may go either way
        same = False
      if same:
        assert tokens_a[row, step] == tokens_b[row, step], (
            f"{what}: row {row} step {step}: equal logits but tokens {tokens_a[row, step]} != "
            f"{tokens_b[row, step]}")
      if tokens_a[row, step] != tokens_b[row, step]:
        break
    else:
      whole_rows += 1
  rows = tokens_a.shape[0]
  assert 2 * whole_rows >= rows, (
      f"{what}: only {whole_rows} of {rows} rows drafted the same tokens through the whole block")


def tiny_target_calls(dtype=None, seed=3):
  """A tiny target (2 layers, E = 64, 4 query / 2 kv heads of 16), a contiguous cache of 3 rows ×
  32 slots of random context, the same as a paged cache (`paging.cache.PagedKV`: pages of 8,
  row r's logical page j at physical page perm[r·4 + j] of a shuffled pool), and two calls
  (tokens [3, T], positions): a decode step (T = 1) and a verify block (T = 4).

  Returns ``(target, contiguous, paged, calls, rng)``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from dspark_jax.models import layers
  from dspark_jax.models import target as tm
  from dspark_jax.paging import cache as paging
  shape = layers.LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128)
  extra = {} if dtype is None else {"dtype": dtype}
  target = tm.TargetModel(tm.TargetConfig(vocab_size=32, num_layers=2, layer=shape,
                                          feature_layers=(-1, 1), **extra), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(seed)
  b, slots, page_size = 3, 32, 8
  cache = tm.init_cache(target.config, b, slots)
  cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), cache)
  perm = rng.permutation(b * slots // page_size)
  pool = lambda x: x.reshape(b, 2, slots // page_size, page_size, 16).transpose(
      0, 2, 1, 3, 4).reshape(-1, 2, page_size, 16)[np.argsort(perm)]
  paged = paging.PagedKV(tuple(map(pool, cache["k"])), tuple(map(pool, cache["v"])),
                         jnp.asarray(perm.reshape(b, -1), jnp.int32))
  calls = []
  for t, start in ((1, [3, 17, 0]), (4, [9, 2, 28])):
    tokens = jnp.asarray(rng.integers(0, 32, (b, t)), jnp.int32)
    calls.append((tokens, jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)))
  return target, cache, paged, calls, rng
