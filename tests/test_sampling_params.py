"""SamplingParams: defaults, normalisation (SPEC §4), validation errors, pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj


def test_defaults_and_broadcasting():
  params = dj.SamplingParams(temperature=[0.5, 1.0, 0.0])
  assert params.batch_size == 3
  np.testing.assert_array_equal(params.top_k, [0, 0, 0])
  np.testing.assert_array_equal(params.top_p, [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(params.seed, [0, 1, 2])  # row index: rows independent by default
  assert params.seed.dtype == np.uint32 and params.top_k.dtype == np.int32
  scalar = dj.SamplingParams(temperature=0.7, batch_size=4)
  np.testing.assert_allclose(scalar.temperature, [0.7] * 4)


def test_greedy_rule_and_draft_temperature():
  params = dj.SamplingParams(temperature=[0.0, 9e-6, 1e-5, 1.0, 1.0, 1.0],
                             top_k=[0, 0, 0, 1, 0, -3])
  np.testing.assert_array_equal(params.greedy_mask, [True, True, False, True, False, False])
  np.testing.assert_allclose(params.draft_temperature, [1e-5, 1e-5, 1e-5, 1.0, 1.0, 1.0])
  assert not params.all_greedy()
  assert dj.SamplingParams(temperature=[0.0, 2.0], top_k=[5, 1]).all_greedy()


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=[1.0, -0.5]), "SamplingParams.temperature: row 1 is -0.5"),
    (dict(temperature=[np.nan]), "SamplingParams.temperature: row 0 is nan"),
    (dict(temperature=[1.0, np.inf]), "SamplingParams.temperature: row 1 is inf"),
    (dict(temperature=[1.0, 1.0], top_p=[0.5, 0.0]), "SamplingParams.top_p: row 1 is 0.0"),
    (dict(temperature=[1.0], top_p=[1.5]), "SamplingParams.top_p: row 0 is 1.5"),
    (dict(temperature=[1.0], top_k=[2.5]), "SamplingParams.top_k: row 0 is 2.5"),
    (dict(temperature=[1.0, 1.0], seed=[1, -1]), "SamplingParams.seed: row 1 is -1"),
    (dict(temperature=[1.0], seed=[2**32]), "SamplingParams.seed: row 0 is 4294967296"),
    (dict(temperature=[1.0, 1.0], top_k=[1, 2, 3]), "different batch sizes"),
    (dict(temperature=[[1.0]]), "SamplingParams.temperature: expected a scalar or a \\[B\\] array"),
    (dict(temperature=1.0), "cannot infer the batch size"),
    (dict(temperature=["hot"]), "SamplingParams.temperature: expected numbers"),
])
def test_bad_values_name_field_and_first_bad_row(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dj.SamplingParams(**kwargs)


def test_inputs_are_not_mutated_and_object_is_immutable():
  temperature = np.array([1.0, 0.0])
  params = dj.SamplingParams(temperature=temperature)
  temperature[0] = 5.0
  assert params.temperature[0] == 1.0
  with pytest.raises(AttributeError):
    params.temperature = np.zeros(2)


def test_pytree_round_trip_and_jit():
  params = dj.SamplingParams(temperature=[0.0, 1.5], top_k=[0, 4], seed=[7, 8])
  leaves, treedef = jax.tree.flatten(params)
  assert len(leaves) == 4
  rebuilt = jax.tree.unflatten(treedef, leaves)
  np.testing.assert_array_equal(rebuilt.seed, [7, 8])

  @jax.jit
  def masked(p):
    return p.greedy_mask, p.draft_temperature

  mask, temps = masked(params)
  np.testing.assert_array_equal(mask, [True, False])
  np.testing.assert_allclose(temps, [1e-5, 1.5])

  @jax.jit
  def build_inside(t):  # traced values: only shapes are checked
    return dj.SamplingParams(temperature=t).greedy_mask

  np.testing.assert_array_equal(build_inside(jnp.array([0.0, 1.0])), [True, False])


def test_padded_rows_are_greedy_filler():
  params = dj.SamplingParams(temperature=[1.0, 2.0], seed=[5, 6]).padded(4)
  np.testing.assert_array_equal(params.greedy_mask, [False, False, True, True])
  np.testing.assert_array_equal(params.seed, [5, 6, 0, 0])
  with pytest.raises(ValueError, match="padded: size 1"):
    params.padded(1)
