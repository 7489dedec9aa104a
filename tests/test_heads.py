"""Heads: corrected logits against an independent NumPy evaluation of SPEC §3; construction checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import law_checks as reference
from tests import helpers

KINDS = ("vanilla", "gated", "rnn")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_corrected_logits_match_numpy_reference(kind, sampled):
  batch, gamma, vocab, rank, hidden = 3, 5, 40, 8, 6
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=3)
  head = dj.markov_head_from_arrays(kind, arrays)
  conf_arrays = helpers.confidence_arrays(hidden + rank, gamma)
  conf = dj.confidence_head_from_arrays(conf_arrays)
  rng = np.random.default_rng(4)
  base = rng.normal(size=(batch, gamma, vocab)).astype(np.float32)
  h = rng.normal(size=(batch, gamma, hidden)).astype(np.float32)
  anchor = np.array([0, 7, 39])
  params = dj.SamplingParams(temperature=[1.0, 0.8, 1.3] if sampled else [0.0] * 3)
  block = dj.sample_block(head, jnp.asarray(base), jnp.asarray(anchor), jnp.asarray(h), params,
                          jax.random.key(0), jnp.zeros(3, jnp.int32), confidence_head=conf)
  tokens = np.asarray(block.tokens)
  for b in range(batch):
    # The reference is teacher-forced on the tokens the sampler drew: it checks that step k used x_{k-1}.
    want = reference.corrected_logits(kind, arrays, base[b], anchor[b], h[b], tokens[b])
    np.testing.assert_allclose(np.asarray(block.corrected_logits[b]), want, rtol=1e-5, atol=1e-5)
    prevs = np.r_[anchor[b], tokens[b, :-1]]
    want_conf = [reference.confidence(conf_arrays, h[b, k], arrays["w1"][prevs[k]], k)
                 for k in range(gamma)]
    np.testing.assert_allclose(np.asarray(block.confidence[b]), want_conf, rtol=1e-5, atol=1e-6)
    if not sampled:
      # Greedy tokens are the first argmax of the logits the block returned (a selection on the
      # same values: exact); against the float64 reference, the token's logit is the maximum to
      # the reference's tolerance (a near-tie may go either way between two implementations).
      got = np.asarray(block.corrected_logits[b])
      np.testing.assert_array_equal(tokens[b], np.argmax(got, axis=-1))
      chosen = np.take_along_axis(want, tokens[b][:, None], axis=-1)[:, 0]
      assert np.all(chosen >= want.max(axis=-1) - 1e-5 * (1 + np.abs(want).max(axis=-1)))


def test_confidence_without_markov_input():
  hidden, rank = 6, 4
  arrays = helpers.confidence_arrays(hidden)
  conf = dj.confidence_head_from_arrays(arrays)
  h = np.random.default_rng(0).normal(size=(2, hidden)).astype(np.float32)
  e = np.ones((2, rank), np.float32)
  got = np.asarray(conf(jnp.asarray(h), jnp.asarray(e), 0))
  want = [reference.confidence(arrays, h[i], e[i], 0) for i in range(2)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_module_call_matches_pure_function():
  head = helpers.make_head("rnn", 30, 4, 5)
  prev = jnp.array([1, 2])
  hidden = jnp.ones((2, 5))
  bias, e, state = head(prev, hidden)
  np.testing.assert_array_equal(e, head.arrays()["w1"][prev])
  assert bias.shape == (2, 30) and state.shape == (2, 4)
  assert head.vocab_size == 30 and head.rank == 4 and head.hidden_size == 5


def test_from_arrays_copies_and_never_mutates():
  arrays = helpers.head_arrays("gated", 20, 4, 3)
  before = {k: v.copy() for k, v in arrays.items()}
  head = dj.markov_head_from_arrays("gated", arrays)
  arrays["w1"][:] = 0.0
  np.testing.assert_array_equal(np.asarray(head.arrays()["w1"]), before["w1"])


@pytest.mark.parametrize("kind,edit,match", [
    ("nope", lambda a: a, "kind: expected one of"),
    ("vanilla", lambda a: {"w1": a["w1"]}, "missing \\['w2'\\]"),
    ("vanilla", lambda a: dict(a, extra=a["w1"]), "unexpected keys \\['extra'\\]"),
    ("vanilla", lambda a: dict(a, w2=a["w2"].T), "arrays\\['w2'\\]: expected shape \\(4, 20\\)"),
    ("vanilla", lambda a: dict(a, w1=a["w1"].astype(np.int32)), "arrays\\['w1'\\]: expected a float"),
    ("gated", lambda a: dict(a, gate_w=a["gate_w"][:4]), "arrays\\['gate_w'\\]: expected \\[H\\+r, r\\]"),
    ("gated", lambda a: dict(a, gate_b=a["gate_b"][:2]), "arrays\\['gate_b'\\]: expected shape"),
    ("rnn", lambda a: dict(a, joint_w=a["joint_w"][:, :5]), "arrays\\['joint_w'\\]"),
    ("rnn", lambda a: dict(a, joint_b=a["joint_b"][:5]), "arrays\\['joint_b'\\]"),
])
def test_from_arrays_rejects_bad_arrays(kind, edit, match):
  base_kind = kind if kind in KINDS else "vanilla"
  arrays = helpers.head_arrays(base_kind, 20, 4, 3)
  with pytest.raises(ValueError, match=match):
    dj.markov_head_from_arrays(kind, edit(arrays))


@pytest.mark.parametrize("edit,match", [
    (lambda a: {"w": a["w"]}, "missing \\['b'\\]"),
    (lambda a: dict(a, w=a["w"][None]), "arrays\\['w'\\]: expected \\[H\\] or \\[H\\+r\\]"),
    (lambda a: dict(a, b=np.zeros(2, np.float32)), "arrays\\['b'\\]: expected shape \\(\\)"),
    (lambda a: dict(a, temperatures=np.array([1.0, 0.0, 2.0], np.float32)),
     "arrays\\['temperatures'\\]: entry 1 is 0.0"),
    (lambda a: dict(a, scale=a["b"]), "unexpected keys \\['scale'\\]"),
])
def test_confidence_from_arrays_rejects_bad_arrays(edit, match):
  with pytest.raises(ValueError, match=match):
    dj.confidence_head_from_arrays(edit(helpers.confidence_arrays(6)))


def test_random_heads_need_hidden_size_when_they_read_h():
  from flax import nnx
  with pytest.raises(ValueError, match="hidden_size"):
    dj.MarkovHead.random("gated", vocab_size=10, rank=4, rngs=nnx.Rngs(0))
  head = dj.MarkovHead.random("rnn", vocab_size=10, rank=4, hidden_size=3, rngs=nnx.Rngs(0),
                              dtype=jnp.bfloat16)
  assert head.arrays()["w2"].dtype == jnp.bfloat16 and head.hidden_size == 3
