"""Property tests (hypothesis) over shapes and parameters: invariants that hold for every input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dspark_jax as dj
from tests import helpers

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

rows = st.tuples(
    st.one_of(st.just(0.0), st.floats(1e-4, 5.0)),  # temperature (0 = greedy)
    st.integers(-2, 4),                              # top_k (1 = greedy, <= 0 off)
    st.integers(0, 2**32 - 1),                       # seed
    st.integers(0, 10_000),                          # position
)


@SETTINGS
@given(batch=st.lists(rows, min_size=1, max_size=6), vocab=st.sampled_from([1, 2, 3, 17, 64]),
       scale=st.floats(0.0, 30.0), data_seed=st.integers(0, 2**16))
def test_sample_step_invariants(batch, vocab, scale, data_seed):
  temperature, top_k, seed, position = map(np.array, zip(*batch))
  logits = (scale * np.random.default_rng(data_seed).normal(size=(len(batch), vocab))).astype(np.float32)
  params = dj.SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
  key = jax.random.key(data_seed)
  tokens = np.asarray(dj.sample_step(jnp.asarray(logits), params, key, jnp.asarray(position)))
  assert tokens.dtype == np.int32 and np.all((tokens >= 0) & (tokens < vocab))
  greedy = np.asarray(params.greedy_mask)
  np.testing.assert_array_equal(tokens[greedy], np.argmax(logits[greedy], axis=-1))
  # Reversing the batch reverses the tokens: each row's stream is its own.
  reverse = np.asarray(dj.sample_step(
      jnp.asarray(logits[::-1]),
      dj.SamplingParams(temperature=temperature[::-1], top_k=top_k[::-1], seed=seed[::-1]), key,
      jnp.asarray(position[::-1])))
  np.testing.assert_array_equal(reverse, tokens[::-1])


@pytest.mark.slow  # 25 examples, each compiling a folded and an eager program
@SETTINGS
@given(kind=st.sampled_from(["vanilla", "gated", "rnn"]), batch=st.integers(1, 5),
       gamma=st.integers(1, 5), vocab=st.sampled_from([2, 5, 33]), rank=st.sampled_from([1, 4]),
       greedy_rows=st.integers(0, 5), data_seed=st.integers(0, 2**16))
def test_block_invariants(kind, batch, gamma, vocab, rank, greedy_rows, data_seed):
  hidden = 3
  head = helpers.make_head(kind, vocab, rank, hidden, seed=data_seed)
  rng = np.random.default_rng(data_seed)
  base = jnp.asarray(rng.normal(size=(batch, gamma, vocab)), jnp.float32)
  h = jnp.asarray(rng.normal(size=(batch, gamma, hidden)), jnp.float32)
  temperature = np.where(np.arange(batch) < greedy_rows, 0.0, rng.uniform(0.2, 3.0, batch))
  params = dj.SamplingParams(temperature=temperature)
  args = (head, base, jnp.asarray(rng.integers(0, vocab, batch)), h, params,
          jax.random.key(data_seed), jnp.asarray(rng.integers(0, 1000, batch)))
  folded = dj.sample_block(*args)
  eager = dj.sample_block_eager(*args)
  tokens = np.asarray(folded.tokens)
  assert tokens.shape == (batch, gamma) and np.all((tokens >= 0) & (tokens < vocab))
  # The folded and eager paths are two XLA programs running the same step: bit for bit on the CPU
  # (`assert_same_block`; to last-bit rounding of the product on a GPU).
  helpers.assert_same_block(folded, eager, fields=("tokens", "corrected_logits"))
  greedy = np.asarray(params.greedy_mask)
  np.testing.assert_array_equal(tokens[greedy],
                                np.argmax(np.asarray(folded.corrected_logits)[greedy], axis=-1))
