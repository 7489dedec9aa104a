"""Tensor parallelism on 8 forced CPU devices (tests/conftest.py sets the XLA flag).

* greedy `generate`, speculative and autoregressive, gives one device's tokens at TP = 1, 2, 4, 8
  (tiny f32 models whose heads, KV heads, SwiGLU width and vocabulary divide 8);
* sampled rows give one device's tokens too: every random stream is counter-based and its values
  do not depend on the sharding, so only the order of float sums differs (equal tokens unless two
  Gumbel scores tie within rounding, which these seeds do not hit);
* the law: `sample_block` -> `verify` rounds of the toy Markov pair with the vocabulary split over
  2 devices (temperature, top-k and top-p, capped verify lengths) against the exact chain law by
  chi-square (N = 24,000 sampled rows, fail at p < 1e-3), with a power check (a wrong law is
  rejected at p < 1e-6); the same draws are also bit-identical to one device's;
* loading straight into shards: no read of a split tensor returns more than its shard's bytes;
* the clear errors of a mesh that does not divide the model;
* ``lax.mulhi`` (Philox) exact in sharded programs (`mulhi.partitionable_mulhi`); a sharded draft
  traced under the user's jit still counts its devices for the kernels' preconditions; paged
  pools split by KV head, with one device's values;
* schedules under a mesh: greedy tokens and verify lengths of `top_k` equal one device's, and the
  law of `prefix` through a sharded `decode` (chi-square, exact law, power check; slow);
* two processes (`jax.distributed`, scripts/multihost_demo.py) decode one device's tokens (slow).
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import dspark_jax as dj
from dspark_jax.formats import qwen3
from dspark_jax.formats import safetensors_io
from dspark_jax.kernels import dispatch
from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.models import target as tm
from dspark_jax.paging import cache as paging
from dspark_jax.parallel import mulhi
from dspark_jax.scheduling import schedules
from dspark_jax.testing import law_checks
from dspark_jax.testing import toy_markov
from tests import stats
from tests import test_decoding
from tests import test_generate_schedules as schedule_tests

VOCAB = 64
SHAPE = layers.LayerShape(hidden_size=32, num_heads=8, num_kv_heads=8, head_dim=8,
                          intermediate_size=64)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (forced) devices")


def make_pair(tie=False):
  config = tm.TargetConfig(vocab_size=VOCAB, num_layers=1, layer=SHAPE, feature_layers=(-1, 0),
                           tie_embeddings=tie)
  target = tm.TargetModel(config, rngs=nnx.Rngs(0))
  target.final_norm.scale[...] = jnp.full((SHAPE.hidden_size,), 4.0)
  draft_config = dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(-1, 0),
                                mask_token_id=VOCAB - 1, head_kind="vanilla", rank=16)
  return target, dm.DSparkDraft(draft_config, config, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def pair():
  return make_pair()


@pytest.fixture(scope="module")
def reference(pair):
  target, draft = pair
  greedy = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  sampled = dj.SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3], top_k=[0, 5, 0, 0],
                              top_p=[1.0, 1.0, 1.0, 0.8], seed=[1, 2, 3, 4])
  key = jax.random.key(0)
  return {
      "spec": dj.generate(target, draft, PROMPTS, greedy, key, max_new_tokens=10).tokens,
      "ar": dj.generate(target, None, PROMPTS, greedy, key, max_new_tokens=10,
                        spec=False).tokens,
      "params": (greedy, sampled)}


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2,
                                pytest.param(4, marks=pytest.mark.slow), 8])
def test_greedy_generate_equals_one_device(pair, reference, tp):
  target, draft = pair
  sharded_target, sharded_draft = dj.shard(target, draft, dj.make_mesh(tp))
  greedy, _ = reference["params"]
  key = jax.random.key(0)
  spec = dj.generate(sharded_target, sharded_draft, PROMPTS, greedy, key, max_new_tokens=10)
  np.testing.assert_array_equal(spec.tokens, reference["spec"])
  ar = dj.generate(sharded_target, None, PROMPTS, greedy, key, max_new_tokens=10, spec=False)
  np.testing.assert_array_equal(ar.tokens, reference["ar"])
  kernel = sharded_target.layers[0].attention.qkv_proj.kernel[...]
  assert kernel.sharding.spec == P(None, "tp") and len(kernel.sharding.device_set) == tp


@pytest.mark.slow
def test_sampled_rows_and_data_parallel_replicas_equal_one_device(pair, reference):
  """TP 4 x DP 2 on all 8 devices: sampled rows (temperature, top-k, top-p) as on one device."""
  target, draft = pair
  mesh = dj.make_mesh(4, dp=2)
  sharded_target, sharded_draft = dj.shard(target, draft, mesh, dp="dp")
  _, sampled = reference["params"]
  out = dj.generate(sharded_target, sharded_draft, PROMPTS, sampled, jax.random.key(0),
                    max_new_tokens=10)
  one = dj.generate(target, draft, PROMPTS, sampled, jax.random.key(0), max_new_tokens=10)
  np.testing.assert_array_equal(out.tokens, one.tokens)


def test_shard_copies_without_changing_the_originals_and_saves_canonically(pair, tmp_path):
  target, draft = pair
  before = np.asarray(target.layers[0].attention.qkv_proj.kernel[...]).copy()
  sharded_target, sharded_draft = dj.shard(target, draft, dj.make_mesh(4))
  np.testing.assert_array_equal(target.layers[0].attention.qkv_proj.kernel[...], before)
  assert target.plan is None and target.layers[0].attention.column_groups == 1
  assert sharded_target.layers[0].mlp.column_groups == 4
  assert sharded_draft.head.w2[...].sharding.spec == P(None, "tp")
  assert sharded_draft.head.w1[...].sharding.is_fully_replicated
  dj.save_pretrained(sharded_target, str(tmp_path / "t"))       # written in the canonical order
  loaded, _ = dj.load_pretrained(str(tmp_path / "t"))
  np.testing.assert_array_equal(loaded.layers[0].attention.qkv_proj.kernel[...], before)


def test_load_pretrained_reads_each_shard_on_its_own(pair, reference, tmp_path, monkeypatch):
  target, _ = pair
  dj.save_pretrained(target, str(tmp_path / "t"), max_shard_bytes=20_000)
  opened = []
  monkeypatch.setattr(safetensors_io, "LazyTensors", lambda d: opened.append(
      LazyCounting(d)) or opened[-1])
  mesh = dj.make_mesh(4)
  loaded, _ = dj.load_pretrained(str(tmp_path / "t"), mesh=mesh)
  tensors = opened[0]
  full = {name: int(np.prod(h.shape)) * h.dtype.itemsize for name, h in tensors.items()}
  split = [n for n in full if any(s in n for s in ("proj", "embed_tokens", "lm_head"))]
  for name in split:   # every split tensor: no read returned more than a quarter of it
    assert tensors.largest_read[name] <= full[name] // 4, name
  assert not any(s in tensors.whole for s in split)
  np.testing.assert_array_equal(
      loaded.layers[0].attention.qkv_proj.kernel[...],
      dj.shard(target, None, mesh)[0].layers[0].attention.qkv_proj.kernel[...])
  greedy, _ = reference["params"]
  out = dj.generate(loaded, None, PROMPTS, greedy, jax.random.key(0), max_new_tokens=10,
                    spec=False)
  np.testing.assert_array_equal(out.tokens, reference["ar"])


class LazyCounting(safetensors_io.LazyTensors):
  """`LazyTensors` that also records which tensors were ever read whole."""

  def read(self, name, index):
    value = super().read(name, index)
    if value.shape == self[name].shape:
      self.whole = getattr(self, "whole", set()) | {name}
    return value

  whole = frozenset()


def test_meshes_that_do_not_divide_the_model_are_refused(pair):
  target, draft = pair
  mesh = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
  with pytest.raises(ValueError, match=r"axis 'tp' has size 3, which does not divide the "
                                       r"vocab_size = 64"):
    dj.shard(target, draft, mesh)
  odd = tm.TargetConfig(vocab_size=48, num_layers=1, layer=layers.LayerShape(
      hidden_size=32, num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=48))
  model = nnx.eval_shape(lambda: tm.TargetModel(odd, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"size 3, .* target num_kv_heads = 2"):
    dj.shard(model, None, mesh)
  with pytest.raises(ValueError, match=r"size 4, .* target num_heads = 6"):
    dj.shard(model, None, dj.make_mesh(4))
  with pytest.raises(ValueError, match="the mesh has no axis 'model'"):
    dj.shard(target, None, dj.make_mesh(2), tp="model")


def test_sharded_sampling_and_verification_follow_the_exact_law():
  """Toy pair, V = 6 split over 2 devices; L = 3 tokens; N = 24,000 sampled rows."""
  vocab, length, start, n = 6, 3, 1, 24_000
  temperature, top_k, top_p = 0.9, 4, 0.9
  base = toy_markov.random_pair(vocab, 3, seed=5)
  mesh = dj.make_mesh(2)            # Auto axes: XLA places what the specs leave open
  put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
  head = dj.markov_head_from_arrays("vanilla", base.head.arrays())
  head.w2.value = put(head.w2[...], P(None, "tp"))
  sharded = toy_markov.ToyPair(target_table=put(base.target_table, P(None, "tp")),
                               draft_base=put(base.draft_base, P(None, None, "tp")), head=head)
  params = dj.SamplingParams(temperature=np.full(n, temperature), top_k=np.full(n, top_k),
                             top_p=np.full(n, top_p), seed=np.arange(n))
  lens = 1 + np.arange(n) % 4                       # verify lengths 1..γ+1, capped rounds too
  key = jax.random.key(7)
  trace = toy_markov.speculative_decode(sharded, params, key, start, length, verify_lens=lens)
  assert trace.verify_lens.shape[0] >= 2
  counts = law_checks.outcome_counts(trace.tokens, vocab)
  law = law_checks.chain_law(base.target_table, start, length, temperature=temperature,
                             top_k=top_k, top_p=top_p)
  stats.assert_law(counts, law, what="sharded verify")
  wrong = law_checks.chain_law(base.target_table, start, length, temperature=temperature)
  stats.assert_rejects(counts, wrong, what="sharded verify against the untruncated law")
  one_device = toy_markov.speculative_decode(base, params, key, start, length, verify_lens=lens)
  np.testing.assert_array_equal(trace.tokens, one_device.tokens)


def test_mulhi_is_exact_in_sharded_programs_and_one_device_keeps_jax_lowering():
  """`mulhi.partitionable_mulhi`: programs over 2 devices lower ``lax.mulhi`` by half-width
  parts, exactly (extremes and random pairs against Python integers); one-device programs keep
  JAX's ``chlo.mulhi``."""
  assert mulhi.partitionable_mulhi() == mulhi._needs_partitionable_mulhi()   # idempotent
  rng = np.random.default_rng(0)
  mesh = dj.make_mesh(2)
  jitted = jax.jit(jax.lax.mulhi)
  for dtype in (np.uint32, np.int32, np.uint8, np.int16):
    info = np.iinfo(dtype)
    edges = [info.min, info.max, 0, 1, info.max, info.min, -1 if info.min else 2, info.max]
    x = np.concatenate([rng.integers(info.min, info.max, 56, endpoint=True), edges]).astype(dtype)
    y = np.concatenate([rng.integers(info.min, info.max, 56, endpoint=True),
                        edges[::-1]]).astype(dtype)
    bits = 8 * np.dtype(dtype).itemsize
    want = np.array([(int(a) * int(b)) >> bits for a, b in zip(x, y)]).astype(dtype)
    xs, ys = (jax.device_put(v, NamedSharding(mesh, P(None, "tp"))) for v in (x[None], y[None]))
    np.testing.assert_array_equal(jitted(xs, ys)[0], want, err_msg=dtype.__name__)
    if mulhi._MULHI_RULE:
      assert "chlo.mulhi" in jitted.lower(x, y).as_text()
      assert "chlo.mulhi" not in jitted.lower(xs, ys).as_text()


def test_a_traced_sharded_draft_still_counts_its_devices(pair):
  """Under the user's own jit the head's W2 is a tracer (one device, by its sharding); the plan
  the sharded draft records keeps the kernels' one-device precondition in force."""
  target, draft = pair
  sharded_target, sharded_draft = dj.shard(target, draft, dj.make_mesh(2))
  params = dj.SamplingParams(temperature=0.0, batch_size=2)
  tokens = np.array([[1, 2], [3, 4]], np.int32)
  propose = nnx.jit(lambda t, d: dj.draft_proposal(t, d, tokens, params, jax.random.key(0),
                                                   greedy_only=True, backend="triton").tokens)
  with pytest.raises(ValueError, match="precondition failed: the block lives on one device"):
    propose(sharded_target, sharded_draft)
  assert layout.plan_devices(sharded_draft.plan) == 2 and layout.plan_devices(None) is None
  choice = dispatch.resolve("auto", None, **dict(_PROBLEM, devices=2))
  assert choice.backend is dispatch.Backend.XLA


_PROBLEM = dict(greedy_only=True, batch=8, vocab=VOCAB, rank=16, gamma=3, w2_dtype=jnp.float32,
                logits_dtype=jnp.float32, head_kind="vanilla")


def test_paged_caches_are_split_by_kv_head_and_give_one_devices_values(pair):
  """Target prefill and draft context over paged pools [P, K, page_size, D] at TP = 2: the pools
  come back split on K, and logits, features and pools equal one device's (up to float sums)."""
  target, draft = pair
  sharded_target, sharded_draft = dj.shard(target, draft, dj.make_mesh(2))
  b, prompt = 2, 5
  tokens = jnp.asarray(np.arange(b * prompt).reshape(b, prompt) % VOCAB, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt))
  table = np.array([[3, 0], [1, 4]], np.int32)

  @nnx.jit
  def run(target, draft):
    cache = paging.paged_cache(target.config, slots=b, num_pages=5, max_pages=2,
                               page_size=16).with_table(table)
    logits, features, cache = target(tokens, positions, cache)
    context = draft.extend_context(features, positions, paging.paged_context(draft, cache))
    return logits, features, cache.k + cache.v + context.k + context.v

  want = run(target, draft)
  got = run(sharded_target, sharded_draft)
  split = NamedSharding(sharded_target.plan.mesh, P(None, "tp", None, None))
  for pool in got[2]:
    assert pool.sharding.is_equivalent_to(split, pool.ndim), pool.sharding
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def scheduled_pair():
  """V = 8, γ = 3 (test_generate_schedules' law pair): a draft whose confidence is a function of
  the previous token, so the schedules' verify lengths vary by row and round."""
  target = test_decoding.make_target(vocab=8, sharpness=2.5, seed=3)
  draft = schedule_tests.with_token_confidence(test_decoding.make_draft(
      target, schedule_tests.GAMMA, "vanilla", copy_bias=2.0, seed=4))
  return target, draft


def test_greedy_decoding_under_a_schedule_equals_one_device(scheduled_pair):
  """`top_k` (lag 2) at TP = 2: the same greedy tokens and the same verify lengths each round."""
  target, draft = scheduled_pair
  schedule = schedules.top_k(schedule_tests.SMOOTH, lag=2)
  params = dj.SamplingParams(temperature=0.0, batch_size=schedule_tests.ROWS)
  prompts = [[1, 2, 3], [4, 5], [6, 7, 1, 2, 0], [3]]
  run = lambda t, d: dj.generate(t, d, prompts, params, jax.random.key(1), max_new_tokens=9,
                                 schedule=schedule, trace=True)
  one, sharded = run(target, draft), run(*dj.shard(target, draft, dj.make_mesh(2)))
  np.testing.assert_array_equal(sharded.tokens, one.tokens)
  np.testing.assert_array_equal(sharded.trace.verify_lens, one.trace.verify_lens)
  assert (one.trace.verify_lens[one.trace.active] < schedule_tests.GAMMA + 1).any()


@pytest.mark.slow
def test_sharded_decode_under_a_schedule_follows_the_target_law(scheduled_pair):
  """N = 16,384 sampled 3-token decodes (T = 1) through `decode` at TP = 2 under Algorithm 1
  (`prefix`, the jagged table): 4 rows (same prompt, own seeds) vmapped over 4,096 keys.
  Statistic: Pearson chi-square of the three tokens over the 512 outcomes (small cells pooled)
  against the target's exact law, threshold p >= 1e-4; power: the law at T = 0.6 is rejected at
  p < 1e-6. The schedule verifies fewer than γ + 1 tokens per round on average."""
  target, draft = scheduled_pair
  rows, keys, prompt = schedule_tests.ROWS, 4096, [1, 5, 2]
  sharded_target, sharded_draft = dj.shard(target, draft, dj.make_mesh(2))
  tokens = np.tile(np.array([prompt], np.int32), (rows, 1))
  lens = np.full((rows,), len(prompt), np.int32)
  params = dj.SamplingParams(temperature=1.0, batch_size=rows, seed=np.arange(rows))
  schedule = schedules.prefix(schedule_tests.JAGGED)
  (target_def, target_state), (draft_def, draft_state) = map(nnx.split, (sharded_target,
                                                                          sharded_draft))
  def one(target_state, draft_state, key):
    return dj.decode(nnx.merge(target_def, target_state), nnx.merge(draft_def, draft_state),
                     tokens, lens, params, key, max_new_tokens=3, schedule=schedule)
  run = jax.jit(jax.vmap(one, in_axes=(None, None, 0)))
  out = run(target_state, draft_state, jax.random.split(jax.random.key(7), keys))
  samples = np.asarray(out.tokens).reshape(-1, 3)
  assert samples.shape == (rows * keys, 3) and np.all(samples >= 0)
  verify_tokens = np.asarray(out.row_verified).sum() / np.asarray(out.row_rounds).sum()
  assert 1.0 < verify_tokens < schedule_tests.GAMMA + 1
  counts = law_checks.outcome_counts(samples, 8)[:8, :8, :8]
  exact = test_decoding._exact_first_three
  stats.assert_law(counts, exact(target, prompt, 1.0), threshold=1e-4,
                   what="prefix schedule through a sharded decode")
  stats.assert_rejects(counts, exact(target, prompt, 0.6), what="wrong temperature")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_decode_one_devices_tokens(tmp_path):
  """scripts/multihost_demo.py as two processes on the CPU (2 devices each, Gloo collectives):
  `jax.distributed.initialize`, one mesh over both (TP = 4: every layer's collectives cross
  processes), the target loaded into shards (each process reading its own parts), speculative
  greedy `generate`: both processes print one device's tokens. (Data-parallel replicas are
  tested in one process: `test_sampled_rows_and_data_parallel_replicas_equal_one_device`.)"""
  tp, dp = 4, 1
  config = tm.TargetConfig(vocab_size=VOCAB, num_layers=2, layer=SHAPE, feature_layers=(-1, 0))
  target = tm.TargetModel(config, rngs=nnx.Rngs(0))
  draft = dm.DSparkDraft(dm.DraftConfig(gamma=3, num_layers=1, target_layer_ids=(-1, 0),
                                        mask_token_id=VOCAB - 1, head_kind="vanilla", rank=16),
                         config, rngs=nnx.Rngs(1))
  dj.save_pretrained(target, str(tmp_path / "t"))
  dj.save_pretrained(draft, str(tmp_path / "d"), target=target)
  prompts = [[1, 2, 3], [4, 5]]
  want = dj.generate(target, draft, prompts, dj.SamplingParams(temperature=0.0, batch_size=2),
                     jax.random.key(0), max_new_tokens=10).tokens
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = root
  common = [sys.executable, os.path.join(root, "scripts", "multihost_demo.py"), "--coordinator",
            f"localhost:{_free_port()}", "--num-processes", "2", "--cpu-devices", "2",
            "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--tp", str(tp),
            "--dp", str(dp),
            "--prompts", json.dumps(prompts)]
  runs = [subprocess.Popen(common + ["--process-id", str(i), "--out", str(tmp_path / f"{i}.json")],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for i in range(2)]
  for run in runs:
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
  for i in range(2):
    result = json.loads((tmp_path / f"{i}.json").read_text())
    assert (result["process"], result["devices"], result["local_devices"]) == (i, 4, 2)
    np.testing.assert_array_equal(result["tokens"], want)
