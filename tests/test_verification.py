"""verify(): the accept rule's mechanics, caps, stop tokens, NaN, invariances, input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.draft import block as proposal
from tests import helpers

V, G = 8, 3


def greedy_block(tokens, corrected=None):
  tokens = np.asarray(tokens, np.int32)
  batch = tokens.shape[0]
  return dj.DraftBlock(tokens=tokens, corrected_logits=corrected, greedy_mask=np.ones(batch, bool),
                       temperatures=np.full(batch, 1e-5, np.float32), confidence=None,
                       path=proposal.PATH_FOLDED_GREEDY)


def one_hot_logits(preds, vocab=V):
  """Target logits [B, γ+1, V] whose argmax at row j is preds[b][j]."""
  preds = np.asarray(preds)
  logits = np.zeros(preds.shape + (vocab,), np.float32)
  np.put_along_axis(logits, preds[..., None], 5.0, axis=-1)
  return logits


def sampled_setup(batch=6, seed=0, temperature=1.0, **kwargs):
  head = helpers.make_head("vanilla", V, 4, 3, seed=seed)
  rng = np.random.default_rng(seed)
  base = jnp.asarray(rng.normal(size=(batch, G, V)), jnp.float32)
  params = dj.SamplingParams(temperature=temperature, batch_size=batch, **kwargs)
  positions = np.arange(batch, dtype=np.int32) * 4
  block = dj.sample_block(head, base, np.zeros(batch, np.int32), None, params, jax.random.key(1),
                          positions)
  target = rng.normal(size=(batch, G + 1, V)).astype(np.float32)
  return block, params, positions, target


def test_greedy_accepts_the_matching_prefix_and_takes_the_argmax_bonus():
  preds = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
  drafts = [[1, 2, 3], [1, 5, 3], [0, 2, 3], [1, 2, 7]]
  params = dj.SamplingParams(temperature=0.0, batch_size=4)
  result = dj.verify(one_hot_logits(preds), greedy_block(drafts), params, jax.random.key(0),
                     np.zeros(4, np.int32))
  np.testing.assert_array_equal(result.accept_len, [3, 1, 0, 2])
  np.testing.assert_array_equal(result.bonus, [4, 2, 1, 3])
  np.testing.assert_array_equal(result.num_committed, [4, 2, 1, 3])
  np.testing.assert_array_equal(result.committed, [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1],
                                                   [1, 2, 3, -1]])
  assert not np.any(result.finished)


def test_greedy_ties_go_to_the_smallest_index():
  target = np.zeros((1, G + 1, V), np.float32)
  target[..., [2, 5]] = 1.0  # tie between 2 and 5 everywhere
  params = dj.SamplingParams(temperature=0.0, batch_size=1)
  result = dj.verify(target, greedy_block([[2, 5, 2]]), params, jax.random.key(0), np.zeros(1, int))
  assert int(result.accept_len[0]) == 1 and int(result.bonus[0]) == 2


def test_verify_lens_cap_and_the_capped_draft_is_the_bonus():
  preds = [[1, 2, 3, 4]] * 4
  drafts = [[1, 2, 3]] * 4
  params = dj.SamplingParams(temperature=0.0, batch_size=4)
  result = dj.verify(one_hot_logits(preds), greedy_block(drafts), params, jax.random.key(0),
                     np.zeros(4, np.int32), verify_lens=np.array([1, 2, 3, 4]))
  np.testing.assert_array_equal(result.accept_len, [0, 1, 2, 3])
  np.testing.assert_array_equal(result.bonus, [1, 2, 3, 4])
  np.testing.assert_array_equal(result.num_committed, [1, 2, 3, 4])


def test_sampled_cap_commits_the_accepted_draft_and_never_reads_rows_past_the_cap():
  # Target == draft law at row 0: draft 1 is always accepted, so with verify_len 1 it is the bonus.
  block, params, positions, _ = sampled_setup()
  target = np.full((6, G + 1, V), np.nan, np.float32)   # rows >= verify_len are never read
  target[:, 0] = np.asarray(block.corrected_logits[:, 0])
  result = dj.verify(target, block, params, jax.random.key(2), positions,
                     verify_lens=np.ones(6, np.int32))
  np.testing.assert_array_equal(result.accept_len, 0)
  np.testing.assert_array_equal(result.bonus, block.tokens[:, 0])


def test_stop_tokens_cut_the_commit_and_finish_the_row():
  preds = [[1, 2, 3, 4]] * 3
  drafts = [[1, 2, 3]] * 3
  params = dj.SamplingParams(temperature=0.0, batch_size=3)
  logits, block, key, positions = one_hot_logits(preds), greedy_block(drafts), jax.random.key(0), \
      np.zeros(3, np.int32)
  shared = dj.verify(logits, block, params, key, positions, stop_token_ids=[2, 7])
  np.testing.assert_array_equal(shared.num_committed, [2, 2, 2])
  np.testing.assert_array_equal(shared.committed[0], [1, 2, -1, -1])
  assert np.all(shared.finished)
  np.testing.assert_array_equal(shared.accept_len, 3)  # the verification outcome itself is kept
  per_row = dj.verify(logits, block, params, key, positions,
                      stop_token_ids=np.array([[4, -1], [3, 1], [-1, -1]]))
  np.testing.assert_array_equal(per_row.num_committed, [4, 1, 4])
  np.testing.assert_array_equal(per_row.finished, [True, True, False])


def test_nan_and_all_minus_inf_target_rows_give_valid_tokens():
  block, params, positions, target = sampled_setup(batch=4, temperature=[0.0, 1.0, 0.0, 1.0])
  target[0, :, 3] = np.nan
  target[1, :, 6] = np.nan
  target[2:] = -np.inf
  result = dj.verify(target, block, params, jax.random.key(3), positions)
  # A greedy NaN row takes its first NaN (argmax's rule); a sampled NaN row has no law: its draft is
  # rejected (u·q < NaN is false) and the bonus is 0. All -inf rows give token 0.
  np.testing.assert_array_equal(result.bonus, [3, 0, 0, 0])
  assert int(result.accept_len[1]) == 0
  assert np.all((np.asarray(result.committed) >= -1) & (np.asarray(result.committed) < V))


def test_a_row_does_not_depend_on_the_other_rows():
  block, params, positions, target = sampled_setup(batch=6, temperature=[0.0, 1.0, 0.5, 2.0, 1.0, 0.7],
                                                   seed=np.array([5, 6, 7, 8, 9, 10]))
  key = jax.random.key(4)
  full = dj.verify(target, block, params, key, positions)
  order = np.array([3, 1, 5])
  sub_params = dj.SamplingParams(temperature=params.temperature[order], seed=params.seed[order])
  sub_block = jax.tree.map(lambda x: x[order], block)
  part = dj.verify(target[order], sub_block, sub_params, key, positions[order])
  for field in ("accept_len", "bonus", "committed", "num_committed"):
    np.testing.assert_array_equal(np.asarray(getattr(full, field))[order], getattr(part, field))


def test_verify_runs_inside_a_users_jit_and_never_mutates_inputs():
  block, params, positions, target = sampled_setup()
  before = (target.copy(), positions.copy(), np.asarray(block.tokens).copy())
  lens = np.array([4, 3, 2, 1, 4, 4], np.int32)
  eager = dj.verify(target, block, params, jax.random.key(5), positions, verify_lens=lens)
  jitted = jax.jit(lambda t, b, p, pos, l: dj.verify(t, b, p, jax.random.key(5), pos, l))(
      target, block, params, positions, lens)
  for field in ("accept_len", "bonus", "committed", "num_committed", "finished"):
    np.testing.assert_array_equal(getattr(eager, field), getattr(jitted, field))
  np.testing.assert_array_equal(before[0], target)
  np.testing.assert_array_equal(before[1], positions)
  np.testing.assert_array_equal(before[2], block.tokens)


def test_repeated_calls_do_not_recompile():
  block, params, positions, target = sampled_setup()
  key = jax.random.key(6)
  dj.verify(target, block, params, key, positions, stop_token_ids=[3])
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration") else None)
  try:
    for shift in range(3):
      dj.verify(target + shift, block, params, key, positions + shift, stop_token_ids=[3])
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == []


def _bad_inputs():
  block, params, positions, target = sampled_setup()
  greedy = dj.SamplingParams(temperature=0.0, batch_size=6)
  yield "vocab V=9", dict(target_logits=np.zeros((6, G + 1, 9), np.float32))
  yield r"expected \[6, 4, V\]", dict(target_logits=target[:, :G])
  yield "expected a float dtype", dict(target_logits=target.astype(np.int32))
  yield "verify_lens: row 2 is 5", dict(verify_lens=np.array([1, 2, 5, 1, 0, 1]))
  yield "verify_lens: row 0 is 0", dict(verify_lens=np.zeros(6, np.int32))
  yield "verify_lens: expected integers", dict(verify_lens=np.ones(6, np.float32))
  yield "positions: expected shape", dict(positions=positions[:3])
  yield "stop_token_ids: entry 1 is 8", dict(stop_token_ids=[1, 8])
  yield "params: has 3 rows", dict(params=dj.SamplingParams(temperature=1.0, batch_size=3))
  yield "block: row 0 was drafted sampled but params row 0 is greedy", dict(params=greedy)
  yield "at temperature 1.0 but params row 0 asks for 0.5", dict(
      params=dj.SamplingParams(temperature=0.5, batch_size=6))
  yield "no corrected logits", dict(block=block.replace(corrected_logits=None, path="folded-greedy"))
  yield "block: expected a DraftBlock", dict(block=np.asarray(block.tokens))


@pytest.mark.parametrize("match,edit", list(_bad_inputs()), ids=[m for m, _ in _bad_inputs()])
def test_bad_inputs_raise_clear_errors(match, edit):
  block, params, positions, target = sampled_setup()
  args = dict(target_logits=target, block=block, params=params, key=jax.random.key(0),
              positions=positions)
  args.update(edit)
  with pytest.raises(ValueError, match=match):
    dj.verify(**args)
