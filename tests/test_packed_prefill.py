"""The packed prefill (`TargetModel.packed_prefill`, `kernels.attention.attend_segments`, the
queue's packed refills): prompts packed one after another into one pass give each prompt what a
fresh prefill of it alone gives (hidden states, features, cache writes), and an engine whose
refills pack decodes the same tokens as one whose refills pad. Tiny f32 models on the CPU; the
cuDNN form against the einsum one on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.decoding import packing
from dspark_jax.decoding import queue as queue_module
from dspark_jax.decoding import slots as slot_module
from dspark_jax.kernels import attention
from dspark_jax.models import target as tm
from dspark_jax.paging import cache as paging
from tests.test_decoding import make_draft, make_target
from tests.test_queue import PROMPTS, SEEDS, STOP, TEMPERATURES

LENGTHS = [3, 5, 1, 4]


def test_prompt_size_is_a_unit_times_a_power_of_two_or_three_halves_of_one():
  sizes = [packing.prompt_size(t, unit=8) for t in (1, 8, 9, 17, 25, 33, 49, 65, 97, 100)]
  assert sizes == [8, 8, 16, 24, 32, 48, 64, 96, 128, 128]
  assert packing.prompt_size(4608) == 6144 and packing.prompt_size(4096) == 4096


def _qkv(tokens, heads=4, kv_heads=2, d=8, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (1, tokens, heads, d), dtype),
          jax.random.normal(keys[1], (1, tokens, kv_heads, d), dtype),
          jax.random.normal(keys[2], (1, tokens, kv_heads, d), dtype))


def _each_segment_alone(q, k, v, lengths):
  """Each segment through the causal einsum form on its own, zeros past the segments."""
  out = jnp.zeros_like(q)
  start = 0
  for n in lengths:
    mask = jnp.tril(jnp.ones((n, n), bool))[None]
    part = attention.attend_xla(q[:, start:start + n], jnp.swapaxes(k[:, start:start + n], 1, 2),
                                jnp.swapaxes(v[:, start:start + n], 1, 2), mask)
    out = out.at[:, start:start + n].set(part)
    start += n
  return out


def test_segment_attention_equals_each_segment_attended_alone():
  q, k, v = _qkv(16)
  lengths = jnp.asarray(LENGTHS, jnp.int32)          # 13 tokens, 3 of padding
  out = attention.attend_segments(q, k, v, lengths, implementation="xla")
  want = _each_segment_alone(q, k, v, LENGTHS)
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  assert not np.asarray(out[:, sum(LENGTHS):]).any()
  # Power: attending across segments (plain causal over the packed row) gives other values.
  whole = attention.attend_xla(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                               jnp.tril(jnp.ones((16, 16), bool))[None])
  assert np.abs(np.asarray(whole[:, 3:13] - want[:, 3:13])).max() > 0.1


def test_the_einsum_form_is_chosen_off_the_gpu_up_to_its_limit():
  small = jax.ShapeDtypeStruct((1, attention.SEGMENT_XLA_MAX, 4, 8), jnp.float32)
  large = jax.ShapeDtypeStruct((1, attention.SEGMENT_XLA_MAX + 1, 4, 8), jnp.float32)
  assert attention.choose_segments(small, platform="cpu") == "xla"
  assert attention.choose_segments(large, platform="cpu") is None


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [LENGTHS, [700, 129, 1000, 300], [77]])
def test_cudnn_segment_attention_equals_the_einsum_form(lengths):
  # cuDNN's packed layout at a Qwen3 head shape (32 query heads over 8 key/value heads of 128),
  # bf16: within bf16 rounding of the float32 einsum form on the same bf16 inputs.
  total = sum(lengths)
  size = packing.prompt_size(total, unit=64)
  q, k, v = _qkv(size, heads=32, kv_heads=8, d=128, dtype=jnp.bfloat16)
  lengths = jnp.asarray(lengths, jnp.int32)
  assert attention.choose_segments(q) == "cudnn"
  out = jax.jit(attention.attend_segments)(q, k, v, lengths)
  want = _each_segment_alone(*(x.astype(jnp.float32) for x in (q, k, v)), list(map(int, lengths)))
  err = np.abs(np.asarray(out, np.float32) - np.asarray(want)).max()
  assert err <= 2e-2, err
  assert not np.asarray(out[:, total:], np.float32).any()


def _packed_inputs(config, lengths, size, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in lengths]
  tokens = np.zeros((size,), np.int32)
  tokens[:sum(lengths)] = np.concatenate(prompts)
  rows, positions, _ = packing.pack(jnp.asarray(lengths, jnp.int32), size)
  return prompts, jnp.asarray(tokens), rows, positions


@pytest.mark.parametrize("paged", [False, True])
def test_packed_prefill_equals_each_prompt_prefilled_alone(paged):
  # Hidden states and features of every packed token equal a fresh prefill of its prompt alone;
  # the cache holds each prompt's keys/values at its row's positions and nothing past them.
  target = make_target()
  config = target.config
  size, slots = 16, 16
  prompts, tokens, rows, positions = _packed_inputs(config, LENGTHS, size)
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  if paged:  # each row's two pages of 8 positions, shuffled through the pool
    table = jnp.asarray([[5, 2], [0, 7], [3, 6], [1, 4]], jnp.int32)
    cache = paging.paged_cache(config, slots=4, num_pages=8, max_pages=2,
                               page_size=16).with_table(table)
  else:
    cache = tm.init_cache(config, len(LENGTHS), slots)
  hidden, features, cache = jax.jit(target.packed_prefill)(tokens, rows, positions, lengths, cache)
  start = 0
  for r, prompt in enumerate(prompts):
    n = prompt.size
    alone_cache = tm.init_cache(config, 1, slots)
    alone_hidden, alone_features, alone_cache = target(
        jnp.asarray(prompt)[None], jnp.arange(n, dtype=jnp.int32)[None], alone_cache, head=False,
        fresh=True)
    np.testing.assert_allclose(hidden[start:start + n], alone_hidden[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(features[start:start + n], alone_features[0], rtol=2e-5, atol=2e-5)
    for name in "kv":
      for layer in range(config.num_layers):
        if paged:
          row = paging.gather(getattr(cache, name)[layer], cache.table, 2)[r]
        else:
          row = cache[name][layer][r]
        np.testing.assert_allclose(row[:, :n], alone_cache[name][layer][0][:, :n], rtol=2e-5,
                                   atol=2e-5)
        assert not np.asarray(row[:, n:]).any()
    start += n


def test_pack_prompts_lays_the_rows_out_and_gives_padding_rows_one_token():
  lens = np.array([3, 9, 5])
  padded = np.zeros((3, 12), np.int32)
  for i, n in enumerate(lens):
    padded[i, :n] = np.arange(1, n + 1) + 10 * i
  saved = {2: {"count": 3, "out": np.array([40, 41, 42, 43])}}  # resumed: prompt + 2 tokens
  tokens, row_lens = slot_module._pack_prompts(padded, lens, np.array([1, 2, 1, 1]), saved,
                                               real=2, limit=256)
  np.testing.assert_array_equal(row_lens, [9, 7, 1, 1])
  assert tokens.size == packing.prompt_size(18)
  want = np.concatenate([padded[1, :9], padded[2, :5], [40, 41], padded[1, :1], padded[1, :1]])
  np.testing.assert_array_equal(tokens[:18], want)
  assert not tokens[18:].any()
  assert slot_module._pack_prompts(padded, lens, np.array([1, 2]), saved, real=2, limit=8) is None


@pytest.fixture(scope="module")
def pair():
  target = make_target()
  return target, make_draft(target, 3, "vanilla")


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_packed_refills_decode_the_tokens_padded_refills_decode(pair, kv, monkeypatch):
  # 6 prompts (greedy and sampled rows, a stop token) through 2 slots in refills of 2 rows; paged:
  # a pool of one slot's capacity, so rows are preempted and resumed (a resumed row's refill
  # packs its prompt and committed tokens). Tokens, counts and finish reasons equal the padded
  # refills', and every refill of the packing engine packed.
  target, draft = pair
  packed_calls = []
  original = queue_module._pack_prompts

  def counting(*args, **kw):
    out = original(*args, **kw)
    packed_calls.append(out is not None)
    return out
  monkeypatch.setattr(queue_module, "_pack_prompts", counting)
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  options = dict(max_batch_size=2, rounds_per_call=1, refill_rows=2, refill_at=1)
  if kv == "paged":
    options.update(kv="paged", page_size=16, num_pages=2)
  results = {}
  for pack in (False, True):
    engine = dj.Engine(target, draft, pack_prompts=pack, **options)
    results[pack] = engine.generate(PROMPTS, params, jax.random.key(5), max_new_tokens=8,
                                    stop_token_ids=[STOP])
  padded, packed = results[False], results[True]
  np.testing.assert_array_equal(packed.tokens, padded.tokens)
  np.testing.assert_array_equal(packed.lengths, padded.lengths)
  np.testing.assert_array_equal(packed.row_accepted, padded.row_accepted)
  assert packed.finish_reason == padded.finish_reason
  assert packed_calls and all(packed_calls)
  if kv == "paged":
    assert packed.preemptions >= 1 and packed.preemptions == padded.preemptions


@pytest.mark.parametrize("spec", [True, False])
def test_a_fixed_batch_prefilled_packed_decodes_the_padded_batchs_tokens(pair, spec, monkeypatch):
  # `generate` without slots: 6 prompts of 1..7 tokens (greedy and sampled rows, a stop token),
  # padded to 8 rows, packed into one pass or right-padded: the same tokens, lengths and finish
  # reasons; the packing run packed.
  target, draft = pair
  calls = []
  original = packing.pack_prompts
  monkeypatch.setattr(packing, "pack_prompts",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  params = dj.SamplingParams(temperature=TEMPERATURES, seed=SEEDS)
  out = {pack: dj.generate(target, draft if spec else None, PROMPTS, params, jax.random.key(5),
                           max_new_tokens=8, stop_token_ids=[STOP], spec=spec,
                           pack_prompts=pack) for pack in (False, True)}
  np.testing.assert_array_equal(out[True].tokens, out[False].tokens)
  np.testing.assert_array_equal(out[True].lengths, out[False].lengths)
  assert out[True].finish_reason == out[False].finish_reason
  assert calls == [1]


@pytest.mark.gpu
def test_packed_prefill_through_cudnn_equals_the_padded_one_pass_on_the_gpu():
  # bf16, rows of length 1, 64, 200 and 256 packed into 768 tokens (cuDNN's packed layout) against
  # the same rows right-padded to 256 in one pass (cuDNN's causal attention): the last logits and
  # every written cache slot within bf16 rounding.
  from flax import nnx

  from dspark_jax.decoding import rounds
  from tests.test_prefill import SHAPE_GPU, VOCAB_GPU
  config = tm.TargetConfig(vocab_size=VOCAB_GPU, num_layers=2, layer=SHAPE_GPU,
                           feature_layers=(-1, 1), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  target = tm.TargetModel(config, rngs=nnx.Rngs(0))
  draft = make_draft(target, 3, "vanilla")
  lengths = [1, 64, 200, 256]
  slots = 320
  prompts, tokens, _, _ = _packed_inputs(config, lengths, packing.prompt_size(sum(lengths)))
  padded = np.zeros((4, 256), np.int32)
  for r, prompt in enumerate(prompts):
    padded[r, :prompt.size] = prompt
  lens = jnp.asarray(lengths, jnp.int32)
  fresh = lambda: (tm.init_cache(config, 4, slots), draft.init_context(4, slots))
  packed_fn = jax.jit(lambda t, l: rounds._packed_prefill_forward(target, draft, t, l, *fresh()))
  padded_fn = jax.jit(lambda p, l: rounds._prefill_forward(target, draft, p, l, *fresh(), None))
  assert "__cudnn$fmha" in packed_fn.lower(tokens, lens).compile().as_text()
  got = jax.tree.map(lambda x: np.asarray(x, np.float32), packed_fn(tokens, lens))
  want = jax.tree.map(lambda x: np.asarray(x, np.float32), padded_fn(jnp.asarray(padded), lens))
  np.testing.assert_allclose(got[0], want[0], atol=8 * 2.0**-8 * np.abs(want[0]).max())
  valid = (np.arange(slots)[None, :] < np.asarray(lengths)[:, None])[:, None, :, None]
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    np.testing.assert_allclose(np.where(valid, a, 0), np.where(valid, b, 0),
                               atol=8 * 2.0**-8 * np.abs(b).max())
