"""Stop sequences (`dspark_jax.decoding.stops`): the in-loop match, and `generate` ending rows on
them: across round boundaries, inside a round (later tokens dropped), at the first generated token,
per-row lists; speculative and autoregressive decoding agree for greedy rows, folded and eager for
sampled ones; bad inputs are refused naming ``stop_sequences``. Tiny f32 models on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.decoding import stops
from tests.test_decoding import PROMPTS, VOCAB, make_draft, make_target

MAX_NEW = 12


def reference_cut(tokens, sequences, stop_ids=()):
  """(length, reason, index) of a row's generated `tokens` (NumPy, independent of the library):
  the first position where the tokens so far end with a stop token or a sequence (earliest end; at
  one end a sequence beats a stop token, the smallest index first)."""
  tokens = [int(t) for t in tokens]
  for p in range(len(tokens)):
    for s, seq in enumerate(sequences):
      n = len(seq)
      if p + 1 >= n and tokens[p + 1 - n:p + 1] == list(seq):
        return p + 1, "stop_sequence", s
    if tokens[p] in stop_ids:
      return p + 1, "stop_token", -1
  return len(tokens), "length", -1


# ---- the match itself (no models) ---------------------------------------------------------------


def _match(generated, committed, num, sequences):
  """first_match for one row: `generated` tokens already out, then `committed` (first `num`)."""
  seqs = stops.stop_sequence_array([sequences], 1, VOCAB * 2)
  out = np.full((1, 16), -1, np.int32)
  out[0, :len(generated)] = generated
  recent = stops.history(jnp.asarray(out), jnp.array([len(generated)]), seqs.shape[2] - 1)
  hit, end, index = jax.jit(stops.first_match)(recent, jnp.asarray([committed], jnp.int32),
                                               jnp.array([num], jnp.int32), jnp.asarray(seqs))
  return bool(hit[0]), int(end[0]), int(index[0])


@pytest.mark.parametrize("generated, committed, num, sequences, want", [
    ([3, 4, 5], [6, 7, 8], 3, [[5, 6]], (True, 0, 0)),              # spans the boundary
    ([3, 4, 5], [6, 7, 8], 3, [[4, 5, 6, 7]], (True, 1, 0)),
    ([3, 4, 5], [6, 7, 8], 3, [[3, 4, 5, 6, 7, 8]], (True, 2, 0)),  # from the first token
    ([3, 4, 5], [6, 7, 8], 3, [[9, 3, 4]], (False, 3, -1)),         # never into the prompt
    ([], [3], 1, [[3]], (True, 0, 0)),                              # the first token alone
    ([], [3], 1, [[9, 3]], (False, 1, -1)),
    ([3, 4, 5], [6, 7, 8], 3, [[7, 8], [6, 7], [7]], (True, 1, 1)),  # earliest end, then index
    ([3, 4, 5], [6, 7, 8], 1, [[7]], (False, 3, -1)),               # only committed slots
    ([3, 4, 5], [6, 7, 8], 2, [[11, 12], [5, 6, 7]], (True, 1, 1)),
])
def test_first_match(generated, committed, num, sequences, want):
  assert _match(generated, committed, num, sequences) == want


def test_padding_never_matches_and_shapes_are_bucketed():
  seqs = stops.stop_sequence_array([[[1, 2, 3]], [], [[4], [5, 6], [7]]], 3, VOCAB)
  assert seqs.shape == (3, 4, 4) and seqs.dtype == np.int32
  np.testing.assert_array_equal(seqs[0, 0], [1, 2, 3, -1])
  np.testing.assert_array_equal(seqs[1], -1)
  np.testing.assert_array_equal(seqs[2, 1], [5, 6, -1, -1])
  recent = jnp.full((3, 3), -1, jnp.int32)  # -1 history: padding must not match it either
  hit, _, _ = jax.jit(stops.first_match)(recent, jnp.full((3, 2), 0, jnp.int32), jnp.full((3,), 2),
                                jnp.asarray(seqs))
  assert not np.asarray(hit).any()
  assert stops.stop_sequence_array((), 2, VOCAB).shape == (2, 0, 1)
  assert stops.stop_sequence_array([[], []], 2, VOCAB).shape == (2, 0, 1)  # per row, none
  shared = stops.stop_sequence_array([[1, 2], (3,), np.array([4, 5, 6])], 2, VOCAB)
  assert shared.shape == (2, 4, 4) and (shared[0] == shared[1]).all()
  array = np.array([[[1, 2, -1]], [[3, -1, -1]]])
  np.testing.assert_array_equal(stops.stop_sequence_array(array, 2, VOCAB)[:, 0, :3], array[:, 0])


@pytest.mark.parametrize("value, match", [
    ([[]], "stop_sequences: sequence 0 is empty"),
    ([[1, 2], []], "stop_sequences: sequence 1 is empty"),
    ([[1, VOCAB]], f"stop_sequences: sequence 0 element 1 is {VOCAB}; must be in \\[0, {VOCAB}\\)"),
    ([[-1]], "stop_sequences: sequence 0 element 0 is -1"),
    ([[1, 2.5]], "stop_sequences: sequence 0 element 1 is 2.5; expected an int"),
    ([[True]], "stop_sequences: sequence 0 element 0 is True"),
    ([1, 2], "stop_sequences: entry 0 is 1; expected a sequence of token ids"),
    (["ab"], "stop_sequences: entry 0 is 'ab'"),
    ([[[1]], [[2]], [[3]]], "stop_sequences: per-row lists for 3 rows but there are 2 prompts"),
    ([[[1]], [[2], []]], "stop_sequences: row 1 sequence 1 is empty"),
    ([[[1]], [[2], [3, 99]]], "stop_sequences: row 1 sequence 1 element 1 is 99"),
    ([[[1]], [2]], "stop_sequences: row 1 entry 0 is 2; per-row lists hold sequences"),
    (np.array([[[1, -1, 2]], [[1, 2, 3]]]), "stop_sequences: row 0 sequence 0 element 2 follows"),
    (np.array([[1, 2]]), "stop_sequences: an array must be \\[2, S, L\\]"),
    (5, "stop_sequences: expected a sequence of token-id sequences"),
])
def test_bad_stop_sequences_are_named(value, match):
  with pytest.raises(ValueError, match=match):
    stops.stop_sequence_array(value, 2, VOCAB)


@pytest.fixture(scope="module")
def target():
  return make_target()


def test_generate_checks_stop_sequences_before_compiling(target):
  draft = make_draft(target, 2, "vanilla")
  params = dj.SamplingParams(temperature=0.0, batch_size=2)
  with pytest.raises(ValueError, match="^stop_sequences: row 0 sequence 0 element 0 is 12"):
    dj.generate(target, draft, [[1], [2]], params, jax.random.key(0),
                stop_sequences=[[[VOCAB]], [[1]]])
  with pytest.raises(ValueError, match="^stop_sequences: sequence 0 is empty"):
    dj.generate(target, None, [[1], [2]], params, jax.random.key(0), spec=False,
                stop_sequences=[()])


# ---- through generate ---------------------------------------------------------------------------


def _padded(rows, count=2, width=8):
  """Per-row sequence lists as a [B, count, width] array, -1 padded (one program for every call)."""
  out = np.full((len(rows), count, width), -1, np.int32)
  for b, row in enumerate(rows):
    for s, seq in enumerate(row):
      out[b, s, :len(seq)] = seq
  return out


@pytest.fixture(scope="module")
def greedy_runs(target):
  """A greedy decode without stops (the same program: every stop slot -1); per-row stop
  sequences and stop tokens picked from it; then speculative (traced) and autoregressive decodes
  with them."""
  draft = make_draft(target, 4, "gated")
  params = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  key = jax.random.key(0)
  batch = len(PROMPTS)
  run = lambda d, spec, ids, seqs, **kw: dj.generate(
      target, d, PROMPTS, params, key, max_new_tokens=MAX_NEW, spec=spec, stop_token_ids=ids,
      stop_sequences=seqs, **kw)
  free = run(None, False, np.full((batch, 1), -1), _padded([[]] * batch))
  t = free.tokens
  sequences = [
      [[int(t[0, 0])]],                                       # the first generated token
      [[VOCAB - 1, VOCAB - 1], t[1, 4:7].tolist()],           # a never-seen one, then a later one
      [t[2, 2:9].tolist(), t[2, 5:8].tolist()],              # a long one and a shorter, earlier one
      [t[3, 1:4].tolist(), [int(t[3, 2])]],                  # ends on row 3's stop token: a tie
      [],                                                     # none
  ]
  stop_ids = np.array([[-1], [-1], [-1], [t[3, 2]], [t[4, 5]]])  # row 4: a stop token alone
  spec = run(draft, True, stop_ids, _padded(sequences), trace=True)
  plain = run(None, False, stop_ids, _padded(sequences))
  return free, sequences, stop_ids, spec, plain


@pytest.mark.slow
def test_greedy_rows_end_where_the_reference_says(greedy_runs):
  free, sequences, stop_ids, spec, plain = greedy_runs
  assert spec.path == "folded-greedy" and plain.path == "autoregressive"
  assert free.finish_reason == ["length"] * len(PROMPTS)
  for result in (spec, plain):
    for b, row in enumerate(sequences):
      length, reason, index = reference_cut(free.tokens[b], row, stop_ids[b])
      assert (result.lengths[b], result.finish_reason[b], result.stop_index[b]) == (
          length, reason, index), (b, result.tokens[b])
      np.testing.assert_array_equal(result.tokens[b, :length], free.tokens[b, :length])
      assert np.all(result.tokens[b, length:] == -1)
      assert result.finished[b] == (reason != "length")
  assert spec.finish_reason == plain.finish_reason
  assert spec.finish_reason[0] == "stop_sequence" and spec.lengths[0] == 1
  assert spec.stop_index[2] == 1  # the shorter sequence ends first
  assert spec.finish_reason[4] == "stop_token"
  assert spec.finish_reason[3] == "stop_sequence"  # a stop token and a sequence end together


def _round_starts(trace, b):
  """Index of the first token each of row b's rounds committed (the prefill commits token 0)."""
  commits = trace.accept_len[trace.active[:, b], b] + 1
  return 1 + np.concatenate([[0], np.cumsum(commits)[:-1]]), commits


@pytest.mark.slow
def test_matches_span_rounds_and_cut_rounds(greedy_runs):
  # From the trace: where each round of a row began; a match whose tokens straddle a round start
  # spanned rounds; a last round that would have committed more than the match needed dropped
  # those tokens. Both happen in this decode (fixed seeds and weights).
  _, sequences, _, spec, _ = greedy_runs
  spanned = cut = 0
  for b, row in enumerate(sequences):
    if spec.finish_reason[b] != "stop_sequence":
      continue
    end = int(spec.lengths[b])
    first = end - len(row[spec.stop_index[b]])
    starts, commits = _round_starts(spec.trace, b)
    spanned += any(first < s < end for s in starts)
    if len(starts) and starts[-1] < end:
      cut += int(end - starts[-1] < commits[-1])
  assert spanned >= 1 and cut >= 1, (spanned, cut)


@pytest.mark.slow
def test_sampled_rows_folded_equals_eager_and_end_on_their_sequences():
  # Sampled rows: the folded sampling path and the eager fallback commit the same tokens (the same
  # draws), and every row ends exactly where the reference cut of its own tokens says.
  target = make_target(sharpness=1.0)
  draft = make_draft(target, 3, "rnn")
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.8, 1.2, 1.0], seed=[3, 1, 4, 1, 5])
  sequences = [[2, 2], [5], [7, 1, 7], [3, 3, 3]]
  runs = [dj.generate(target, draft, PROMPTS, params, jax.random.key(9), max_new_tokens=10,
                      stop_sequences=sequences, mode=mode) for mode in ("force", "off")]
  assert [r.path for r in runs] == ["folded-sampling", "eager"]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  assert runs[0].finish_reason == runs[1].finish_reason
  np.testing.assert_array_equal(runs[0].stop_index, runs[1].stop_index)
  assert "stop_sequence" in runs[0].finish_reason and "length" in runs[0].finish_reason
  for b in range(len(PROMPTS)):
    n = int(runs[0].lengths[b])
    want = reference_cut(runs[0].tokens[b, :n], sequences)
    assert (n, runs[0].finish_reason[b], runs[0].stop_index[b]) == want
