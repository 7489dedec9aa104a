"""The chunked prefill (`decoding.rounds._prefill_forward`): passes of `chunk` positions write the
caches and give the last token's logits of the whole-prompt pass, and its activation memory follows
the chunk. Tiny f32 models on the CPU; decoding through it (the queue, paged and contiguous, against
whole-prompt prefills) is tested in tests/test_queue.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax.decoding import rounds
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from tests.test_decoding import make_draft, make_target

WIDTH = 13
SLOTS = 16
VOCAB_GPU = 64
SHAPE_GPU = layers.LayerShape(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                              intermediate_size=512)


@pytest.fixture(scope="module")
def pair():
  target = make_target()
  return target, make_draft(target, 3, "vanilla")


def _program(pair, chunk, width, slots=SLOTS):
  target, draft = pair
  (t_def, t_state), (d_def, d_state) = nnx.split(target), nnx.split(draft)

  def run(t_state, d_state, prompt, lens):
    target, draft = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
    batch = prompt.shape[0]
    return rounds._prefill_forward(target, draft, prompt, lens,
                                   tm.init_cache(target.config, batch, slots),
                                   draft.init_context(batch, slots), chunk)
  return jax.jit(run), (t_state, d_state)


def test_chunks_write_the_caches_and_last_logits_of_one_pass(pair):
  # Rows of length 1, at a chunk boundary, just past it and at the width; chunks of 4 (three full
  # passes and a 1-position remainder). Every cache slot before a row's length and the last token's
  # logits match the whole prompt in one pass. (Passes that stop after the longest row, short of
  # the width: the queue's refills, tests/test_queue.py.)
  lens = [1, 4, 5, 13, 12]
  vocab = pair[0].config.vocab_size
  prompt = jnp.asarray(np.random.default_rng(3).integers(0, vocab, (len(lens), WIDTH)), jnp.int32)
  lens = jnp.asarray(lens, jnp.int32)
  whole, models = _program(pair, None, WIDTH)
  ref_logits, ref_cache, ref_context = whole(*models, prompt, lens)
  valid = (np.arange(SLOTS)[None, :] < np.asarray(lens)[:, None])[:, None, :, None]
  run, _ = _program(pair, 4, WIDTH)
  logits, cache, context = run(*models, prompt, lens)
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves((cache, context)), jax.tree.leaves((ref_cache, ref_context))):
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5,
                               atol=1e-5)


def test_activation_memory_follows_the_chunk(pair):
  # XLA's own accounting of the compiled program's temporaries (no timing): a 256-position prompt
  # in passes of 32 needs under a quarter of the whole pass's scratch memory (its scores are
  # [B, N, 32, S] per pass, not [B, N, 256, S]).
  width = 256
  args = (jnp.zeros((2, width), jnp.int32), jnp.asarray([width, 100], jnp.int32))
  temp = {}
  for chunk in (None, 32):
    run, models = _program(pair, chunk, width, slots=width)
    temp[chunk] = run.lower(*models, *args).compile().memory_analysis().temp_size_in_bytes
  assert temp[32] < temp[None] / 4, temp


def test_prefill_chunk_is_checked():
  target = make_target()
  params = dj.SamplingParams(temperature=[0.0])
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="prefill_chunk"):
      dj.generate(target, None, [[1, 2]], params, jax.random.key(0), spec=False,
                  prefill_chunk=bad)
  with pytest.raises(ValueError, match="prefill_chunk"):
    dj.Engine(target, None, 2, spec=False, prefill_chunk=0)


def test_fresh_needs_positions_from_zero():
  target = make_target()
  cache = tm.init_cache(target.config, 1, SLOTS)
  with pytest.raises(ValueError, match="fresh=True needs positions 0..T-1 in every row; row 0 starts at 2"):
    target(jnp.zeros((1, 3), jnp.int32), jnp.arange(2, 5)[None], cache, fresh=True)


def test_chunked_prefill_takes_the_two_part_form_where_choose_causal_holds(pair, monkeypatch):
  # The dispatch, on the CPU: with `choose_causal` saying "cudnn" and an XLA stand-in for cuDNN
  # (tests/test_attention.py::fake_cudnn), passes of 64 over a 128-wide prompt take the two-part
  # form in every layer (the first pass, from slot 0, and the second, from 64) and give the
  # caches and last logits of today's path (passes over the cache).
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from dspark_jax.kernels import attention
  from tests.test_attention import fake_cudnn
  width, slots = 128, 160
  lens = jnp.asarray([1, 64, 100, 128], jnp.int32)
  prompt = jnp.asarray(np.random.default_rng(5).integers(0, pair[0].config.vocab_size,
                                                          (4, width)), jnp.int32)
  run, models = _program(pair, 64, width, slots=slots)
  ref = run(*models, prompt, lens)
  calls = []
  monkeypatch.setattr(attention, "choose_causal", lambda q, *a, **k: "cudnn")
  monkeypatch.setattr(fa, "dot_product_attention", fake_cudnn(calls))
  run, models = _program(pair, 64, width, slots=slots)
  out = run(*models, prompt, lens)
  layers_ = pair[0].config.num_layers
  assert calls == [fa.MaskType.PADDING, fa.MaskType.CAUSAL] * layers_   # traced once: the loop body
  valid = (np.arange(slots)[None, :] < np.asarray(lens)[:, None])[:, None, :, None]
  np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(out[1:]), jax.tree.leaves(ref[1:])):
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5,
                               atol=1e-5)


def _uses_cudnn(run, models, *args) -> bool:
  return "__cudnn$fmha" in run.lower(*models, *args).compile().as_text()


@pytest.mark.gpu
def test_prefill_through_cudnn_equals_the_chunked_cache_form_on_the_gpu(monkeypatch):
  # bf16: the one pass (fresh, cuDNN's causal attention over its own keys) and passes of 64
  # through cuDNN's two parts (the cache before the chunk, the chunk's own keys, joined by
  # log-sum-exp: `kernels.attention.attend_chunk`) against passes of 64 through the ragged kernel
  # over the cache written so far (DSPARK_JAX_ATTENTION=ragged): rows of length 1, at a chunk edge
  # and at the width; the last logits and every valid cache slot within bf16 rounding.
  config = tm.TargetConfig(vocab_size=VOCAB_GPU, num_layers=2, layer=SHAPE_GPU,
                           feature_layers=(-1, 1), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  target = tm.TargetModel(config, rngs=nnx.Rngs(0))
  draft = make_draft(target, 3, "vanilla")
  lens = jnp.asarray([1, 64, 200, 256], jnp.int32)
  prompt = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB_GPU, (4, 256)), jnp.int32)
  out = {}
  for name, chunk, implementation in (("one pass", None, "auto"), ("two parts", 64, "auto"),
                                      ("ragged", 64, "ragged")):
    monkeypatch.setenv("DSPARK_JAX_ATTENTION", implementation)
    run, models = _program((target, draft), chunk, 256, slots=256 + 64)
    assert _uses_cudnn(run, models, prompt, lens) == (implementation == "auto"), name
    out[name] = jax.tree.map(lambda x: np.asarray(x, np.float32), run(*models, prompt, lens))
  ref_logits, ref_cache, _ = out["ragged"]
  valid = (np.arange(256 + 64)[None, :] < np.asarray(lens)[:, None])[:, None, :, None]
  for name in ("one pass", "two parts"):
    logits, cache, _ = out[name]
    np.testing.assert_allclose(logits, ref_logits, atol=8 * 2.0**-8 * np.abs(ref_logits).max(),
                               err_msg=name)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
      np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                                 atol=8 * 2.0**-8 * np.abs(want).max(), err_msg=name)
