"""`decode`: the compiled decoding loop as a pure function, under the user's own jit and vmap."""

import jax
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.decoding import stops
from dspark_jax.scheduling import schedules
from tests.test_decoding import make_draft, make_target

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3]]
SCHEDULE = schedules.threshold(0.3)


@pytest.fixture(scope="module")
def pair():
  target = make_target(sharpness=1.0)  # a flatter law: sampled rows differ between keys
  return target, make_draft(target, 3, "gated")


def _padded(prompts, width=8):
  out = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.array([len(p) for p in prompts], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [True, False])
def test_decode_under_jit_equals_generate(pair, spec):
  target, draft = pair
  prompt, lens = _padded(PROMPTS)
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.0, 0.7], seed=[1, 2, 3, 4])
  budgets = np.array([6, 4, 6, 2])
  # Stop sequences (per row), and with spec a schedule and the trace, as both take them.
  sequences = [[[5, 5]], [[3], [8, 8]], [], [[4, 4, 4]]]
  extra = dict(schedule=SCHEDULE, trace=True) if spec else {}
  want = dj.generate(target, draft, PROMPTS, params, jax.random.key(0), max_new_tokens=budgets,
                     stop_token_ids=[7], stop_sequences=sequences, spec=spec, **extra)
  padded = stops.stop_sequence_array(sequences, 4, target.config.vocab_size)
  run = jax.jit(lambda p, k: dj.decode(target, draft, prompt, lens, p, k, max_new_tokens=6,
                                       budgets=budgets, stop_token_ids=np.full((4, 1), 7),
                                       stop_sequences=padded, spec=spec, **extra))
  got = run(params, jax.random.key(0))
  # generate pads the batch to 4 rows and the prompts to 8 columns too: the same program's shapes.
  np.testing.assert_array_equal(np.asarray(got.tokens), want.tokens)
  np.testing.assert_array_equal(np.asarray(got.lengths), want.lengths)
  np.testing.assert_array_equal(np.asarray(got.finished), want.finished)
  assert stops.finish_reasons(got.finish_reason) == want.finish_reason
  np.testing.assert_array_equal(np.asarray(got.stop_index), want.stop_index)
  assert int(got.rounds) == want.rounds
  if spec:
    np.testing.assert_array_equal(np.asarray(got.reached), want.reached)
    np.testing.assert_array_equal(np.asarray(got.accepted), want.accepted)
    np.testing.assert_array_equal(np.asarray(got.row_rounds), want.row_rounds)
    np.testing.assert_array_equal(np.asarray(got.row_verified), want.row_verified)
    rounds = want.rounds
    for name in ("verify_lens", "accept_len", "active"):
      np.testing.assert_array_equal(np.asarray(getattr(got.trace, name))[:rounds],
                                    getattr(want.trace, name))
    # Differently compiled float32 programs: equal up to a few roundings (2**-23 relative each).
    np.testing.assert_allclose(np.asarray(got.trace.confidence)[:rounds], want.trace.confidence,
                               rtol=1e-5, atol=1e-6)
  else:
    assert got.trace is None and want.trace is None


@pytest.mark.slow
def test_decode_vmaps_over_keys_and_seeds(pair):
  target, draft = pair
  prompt, lens = _padded(PROMPTS)
  params = dj.SamplingParams(temperature=[0.0, 1.0, 1.0, 1.0], seed=[1, 2, 3, 4])
  keys = jax.random.split(jax.random.key(3), 4)
  decode = lambda p, k: dj.decode(target, draft, prompt, lens, p, k, max_new_tokens=5)
  batched = jax.jit(jax.vmap(decode, in_axes=(None, 0)))(params, keys)
  assert batched.tokens.shape == (4, 4, 5)
  for i in range(4):  # each key's decode equals the unbatched one
    alone = jax.jit(decode)(params, keys[i])
    np.testing.assert_array_equal(np.asarray(batched.tokens[i]), np.asarray(alone.tokens))
  assert len({np.asarray(batched.tokens[i, 1:]).tobytes() for i in range(4)}) > 1  # keys matter
  # Greedy row 0 is the same under every key.
  assert all(np.array_equal(batched.tokens[0, 0], batched.tokens[i, 0]) for i in range(4))
  # vmap over seeds: a traced SamplingParams.
  seeds = np.arange(12, dtype=np.uint32).reshape(3, 4)
  by_seed = jax.jit(jax.vmap(lambda s: decode(
      dj.SamplingParams(temperature=params.temperature, seed=s), jax.random.key(0))))(seeds)
  assert by_seed.tokens.shape == (3, 4, 5)


@pytest.mark.slow
def test_decode_greedy_only_variant(pair):
  target, draft = pair
  prompt, lens = _padded(PROMPTS)
  params = dj.SamplingParams(temperature=[0.0, 0.0, 0.0, 0.0])
  folded = dj.decode(target, draft, prompt, lens, params, jax.random.key(0), max_new_tokens=4,
                     greedy_only=True)
  want = dj.generate(target, draft, PROMPTS, params, jax.random.key(0), max_new_tokens=4)
  assert want.path == "folded-greedy"  # the same program as generate's for an all-greedy batch
  np.testing.assert_array_equal(np.asarray(folded.tokens), want.tokens)
  with pytest.raises(ValueError, match="^draft: required"):
    dj.decode(target, None, prompt, lens, params, jax.random.key(0), max_new_tokens=4)
