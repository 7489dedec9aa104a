"""generate(): speculative == autoregressive (greedy, token for token; sampled, in law), KV rollback,
stop tokens, mixed prompt lengths, routing, compile guard, input checks. Tiny f32 models on the CPU."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as dj
from dspark_jax import decoding
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import dispatch
from dspark_jax.models import draft as dm
from dspark_jax.testing import law_checks
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from tests import stats

VOCAB = 12
SHAPE = layers.LayerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=64)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3], [2, 2, 2, 2, 2, 2, 2, 2, 2]]


def make_target(vocab=VOCAB, sharpness=4.0, seed=0):
  config = tm.TargetConfig(vocab_size=vocab, num_layers=2, layer=SHAPE, feature_layers=(-1, 1))
  target = tm.TargetModel(config, rngs=nnx.Rngs(seed))
  target.final_norm.scale[...] = jnp.full((SHAPE.hidden_size,), sharpness)  # a less flat law
  return target


def make_draft(target, gamma, kind, copy_bias=4.0, seed=1):
  """A random draft whose sequential head leans towards repeating the previous token, so rounds
  see a mix of full acceptance, partial acceptance and immediate rejection."""
  vocab = target.config.vocab_size
  config = dm.DraftConfig(gamma=gamma, target_layer_ids=(-1, 1), mask_token_id=vocab - 1,
                          head_kind=kind, rank=vocab)
  draft = dm.DSparkDraft(config, target.config, rngs=nnx.Rngs(seed))
  if kind != "rnn":
    draft.head.w1[...] = jnp.eye(vocab)
    draft.head.w2[...] = copy_bias * jnp.eye(vocab)
  return draft


@pytest.fixture(scope="module")
def target():
  return make_target()


@pytest.mark.slow
@pytest.mark.parametrize("gamma,kind", [(1, "gated"), (4, "rnn"), (7, "vanilla"), (7, "gated")])
def test_greedy_speculative_equals_greedy_autoregressive(target, gamma, kind):
  draft = make_draft(target, gamma, kind)
  params = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  budgets = [9, 4, 13, 1, 7]
  spec = dj.generate(target, draft, PROMPTS, params, jax.random.key(0), max_new_tokens=budgets)
  plain = dj.generate(target, None, PROMPTS, params, jax.random.key(0), max_new_tokens=budgets,
                      spec=False)
  assert spec.path == "folded-greedy" and plain.path == "autoregressive"
  assert spec.backend is not None and plain.backend is None
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, budgets)
  # The copy-biased heads are accepted often enough to save rounds; the rnn head is random (no copy
  # bias), so whether it saves any depends on the random weights.
  assert spec.rounds < plain.rounds or gamma == 1 or kind == "rnn"
  assert spec.acceptance.shape == (gamma,)


@pytest.mark.slow
def test_rounds_mix_rejections_and_acceptance_and_rows_do_not_interact(target):
  # The copy-biased draft is accepted sometimes and rejected sometimes (so stale KV entries of
  # rejected positions exist and must be ignored); each row equals the same prompt decoded alone.
  draft = make_draft(target, 4, "vanilla")
  params = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  together = dj.generate(target, draft, PROMPTS, params, jax.random.key(0), max_new_tokens=16)
  assert 0.05 < together.acceptance[0] < 0.95, together.acceptance
  assert 1.0 < together.tau < 5.0
  for i, prompt in enumerate(PROMPTS):
    alone = dj.generate(target, draft, [prompt], dj.SamplingParams(temperature=0.0, batch_size=1),
                        jax.random.key(0), max_new_tokens=16)
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[i])


@pytest.mark.slow
def test_stale_cache_entries_are_never_read(target):
  # Fill the KV cache with garbage, then run a prompt: logits equal a fresh cache's. (Compiled, as
  # `generate` runs it: one program per shape instead of one per operation.)
  run = nnx.jit(lambda model, tokens, positions, cache: model(tokens, positions, cache))
  tokens = jnp.array([[3, 1, 4, 1, 5]])
  positions = jnp.arange(5)[None]
  fresh = tm.init_cache(target.config, 1, 12)
  garbage = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape) * 50, fresh)
  want, _, _ = run(target, tokens, positions, fresh)
  got, _, _ = run(target, tokens, positions, garbage)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Incremental decoding equals one pass.
  cache = tm.init_cache(target.config, 1, 12)
  first, _, cache = run(target, tokens[:, :3], positions[:, :3], cache)
  rest, _, _ = run(target, tokens[:, 3:], positions[:, 3:], cache)
  np.testing.assert_allclose(jnp.concatenate([first, rest], 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_stop_tokens_end_rows_like_the_baseline(target):
  draft = make_draft(target, 4, "gated")
  params = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  plain = dj.generate(target, None, PROMPTS, params, jax.random.key(0), max_new_tokens=12, spec=False)
  stop = int(plain.tokens[0, 3])  # a token the first row produces
  spec = dj.generate(target, draft, PROMPTS, params, jax.random.key(0), max_new_tokens=12,
                     stop_token_ids=[stop])
  base = dj.generate(target, None, PROMPTS, params, jax.random.key(0), max_new_tokens=12,
                     stop_token_ids=[stop], spec=False)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  np.testing.assert_array_equal(spec.finished, base.finished)
  assert spec.finished[0] and spec.lengths[0] <= 4
  for row, n in zip(spec.tokens, spec.lengths):
    assert np.all(row[n:] == -1) and (stop not in row[:n - 1])


def _exact_first_three(target, prompt, temperature):
  """The target's exact law of its first three sampled tokens after `prompt` (float64 products of
  the model's float32 conditionals, every prefix enumerated)."""
  v = target.config.vocab_size
  prefixes = np.array([prompt + [a, b] for a in range(v) for b in range(v)])
  n = prefixes.shape[1]
  cache = tm.init_cache(target.config, len(prefixes), n)
  logits, _, _ = target(jnp.asarray(prefixes), jnp.broadcast_to(jnp.arange(n), prefixes.shape), cache)
  logits = np.asarray(logits, np.float64)
  law = np.zeros((v, v, v))
  p1 = law_checks.target_probs(logits[0, n - 3], temperature)
  for a, b in itertools.product(range(v), repeat=2):
    row = a * v + b
    p2 = law_checks.target_probs(logits[row, n - 2], temperature)
    p3 = law_checks.target_probs(logits[row, n - 1], temperature)
    law[a, b] = p1[a] * p2[b] * p3
  return law


@pytest.mark.slow
def test_speculative_sampling_law_equals_the_target_law():
  # N = 59,579 sampled rows (T = 1) with 5,957 greedy rows interleaved (65,536 rows: the largest
  # that fills its power-of-two batch bucket), one prompt, V = 8, γ = 3.
  # Statistic: Pearson chi-square of the first three generated tokens over all 512 outcomes against
  # the target's exact autoregressive law; threshold p >= 1e-3. Power: the draft's own law of those
  # tokens (the same decode with every draft accepted) must be rejected at p < 1e-6.
  target = make_target(vocab=8, sharpness=6.0, seed=3)
  draft = make_draft(target, 3, "vanilla", copy_bias=2.0, seed=4)
  rows, every = 65_536, 11
  greedy = np.arange(rows) % every == every - 1
  assert (~greedy).sum() == 59_579
  params = dj.SamplingParams(temperature=np.where(greedy, 0.0, 1.0))
  prompt = [1, 5, 2]
  result = dj.generate(target, draft, [prompt] * rows, params, jax.random.key(11), max_new_tokens=3)
  assert result.path == "folded-sampling"
  greedy_rows = result.tokens[greedy]
  assert np.all(greedy_rows == greedy_rows[0])
  counts = law_checks.outcome_counts(result.tokens[~greedy], 8)[:8, :8, :8]
  law = _exact_first_three(target, prompt, 1.0)
  stats.assert_law(counts, law, what="speculative sampling, first three tokens")
  stats.assert_rejects(counts, _exact_first_three(target, prompt, 0.6), what="wrong temperature")
  assert 0.05 < result.acceptance[0] < 0.95


@pytest.mark.slow
def test_prepared_head_arrays_decode_the_same_tokens(target, monkeypatch):
  # Where the Hopper kernels run, `generate` prepares the head's arrays once, outside the rounds'
  # loop (`pallas_block.head_arrays_for` with the decode's choice: W2 part by part as well, which
  # those kernels read; test_dispatch checks when it prepares). Preparing here regardless (on the
  # CPU the XLA backend drafts, which ignores the parts): the arrays are prepared once per trace,
  # for the choice `result.backend` records, and the tokens do not change.
  from dspark_jax.kernels import pallas_block
  target = make_target(vocab=64)
  draft = make_draft(target, 4, "vanilla")
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.7, 1.3, 0.0], seed=[4, 8, 15, 16, 23])
  run = lambda: dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=10)
  plain = run()
  prepared = []
  monkeypatch.setattr(pallas_block, "head_arrays_for",
                      lambda arrays, choices: prepared.append(list(choices))
                      or pallas_block.prepare_head_arrays(arrays))
  # Compiled and traced again under the patch (a new function object has no cached trace), and
  # both dropped afterwards.
  monkeypatch.setattr(decoding.compile_cache, "_COMPILED", {})
  monkeypatch.setattr(decoding.loop, "_decode_program", functools.partial(decoding._decode_program))
  posed = run()
  assert prepared == [[posed.backend]] and posed.path == plain.path == "folded-sampling"
  assert posed.backend == plain.backend
  np.testing.assert_array_equal(plain.tokens, posed.tokens)


@pytest.mark.slow
def test_generate_records_the_backend(target, monkeypatch):
  # `GenerateResult.backend`: the choice that drafted a folded path's blocks, with its reason (None
  # for the eager path and the baseline: test_greedy_speculative_equals_greedy_autoregressive,
  # test_eager_fallback_equals_folded_sampling). An explicit backend and config are recorded as
  # asked; a bad one, or a bad $DSPARK_JAX_BACKEND, is an error naming it, before compiling.
  draft = make_draft(target, 4, "gated")
  greedy = dj.SamplingParams(temperature=0.0, batch_size=len(PROMPTS))
  run = functools.partial(dj.generate, target, draft, PROMPTS, greedy, jax.random.key(5),
                          max_new_tokens=6)
  auto = run()
  assert auto.path == "folded-greedy"
  assert auto.backend == proposal.choose_backend(
      draft.head.arrays(), jax.ShapeDtypeStruct((8, 4, VOCAB), draft.config.dtype),
      kind="gated", greedy_only=True)
  if jax.default_backend() == "cpu":
    assert auto.backend.name == "xla" and auto.backend.reason.startswith("auto: cpu is not a GPU")
  unrolled = run(backend="xla", config=dispatch.XlaConfig(form="unrolled"))
  assert unrolled.backend.config == dispatch.XlaConfig(form="unrolled")
  assert unrolled.backend.reason.startswith("xla requested")
  np.testing.assert_array_equal(unrolled.tokens, auto.tokens)  # greedy: the target's tokens
  with pytest.raises(ValueError, match="^backend: expected 'auto', 'xla', 'triton' or 'hopper', "
                                       "got 'fused'"):
    run(backend="fused")
  with pytest.raises(ValueError, match="^backend 'triton': precondition failed: V has a "
                                       "power-of-two tile"):  # V = 12
    run(backend="triton")
  monkeypatch.setenv(dispatch.ENV_VAR, "fused")
  with pytest.raises(ValueError, match=r"^\$DSPARK_JAX_BACKEND: expected"):
    run()


@pytest.mark.slow
@pytest.mark.kernel
def test_hopper_backend_decodes_the_targets_greedy_tokens():
  # The Hopper backend inside `generate`'s rounds (in the interpreter: 64 rows, bf16 draft,
  # V = 128, r = 128), the head's arrays prepared once outside the loop. Greedy rows decode the
  # target's own greedy tokens whatever the draft proposes (the baseline's, exactly); sampled rows
  # run the sampling kernel (their tokens depend on the draft's draws: checked for range only).
  vocab, batch = 128, 64
  target = make_target(vocab=vocab, seed=2)
  config = dm.DraftConfig(gamma=3, target_layer_ids=(-1, 1), mask_token_id=vocab - 1,
                          head_kind="vanilla", rank=vocab, dtype=jnp.bfloat16,
                          param_dtype=jnp.bfloat16)
  draft = dm.DSparkDraft(config, target.config, rngs=nnx.Rngs(1))
  draft.head.w1[...] = jnp.eye(vocab, dtype=jnp.bfloat16)
  draft.head.w2[...] = 4.0 * jnp.eye(vocab, dtype=jnp.bfloat16)
  prompts = [[(7 * i) % vocab, (3 * i + 1) % vocab] for i in range(batch)]
  greedy_rows = np.arange(batch) % 2 == 0
  params = dj.SamplingParams(temperature=np.where(greedy_rows, 0.0, 1.0), seed=np.arange(batch))
  plain = dj.generate(target, None, prompts, dj.SamplingParams(temperature=0.0, batch_size=batch),
                      jax.random.key(3), max_new_tokens=5, spec=False)
  for p, path in ((dj.SamplingParams(temperature=0.0, batch_size=batch), "folded-greedy"),
                  (params, "folded-sampling")):
    result = dj.generate(target, draft, prompts, p, jax.random.key(3), max_new_tokens=5,
                         backend="hopper", mode="force")
    assert result.path == path and result.backend.name == "hopper", result.backend
    assert result.backend.reason == ("hopper requested, in Pallas' interpreter"
                                     if jax.default_backend() == "cpu" else "hopper requested, on gpu")
    rows = np.asarray(p.greedy_mask)
    np.testing.assert_array_equal(result.tokens[rows], plain.tokens[rows])
    assert np.all((result.tokens >= 0) & (result.tokens < vocab)) and np.all(result.lengths == 5)


@pytest.mark.slow
def test_eager_fallback_equals_folded_sampling(target):
  draft = make_draft(target, 4, "rnn")
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.7, 1.3, 0.0], seed=[4, 8, 15, 16, 23])
  folded = dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=10,
                       mode="force")
  eager = dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=10,
                      mode="off")
  assert (folded.path, eager.path) == ("folded-sampling", "eager")
  assert folded.backend is not None and eager.backend is None
  np.testing.assert_array_equal(folded.tokens, eager.tokens)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["force", "off"])
def test_compact_draft_logits_decode_the_same_tokens(target, mode):
  # store_logits=False keeps each token's log q and recomputes the rejected row instead of storing
  # the corrected logits: on the folded and on the eager path, the same tokens as stored logits.
  draft = make_draft(target, 4, "gated")
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.7, 1.3, 0.9], top_k=[0, 0, 3, 0, 5],
                             seed=[4, 8, 15, 16, 23])
  runs = [dj.generate(target, draft, PROMPTS, params, jax.random.key(5), max_new_tokens=12,
                      mode=mode, store_logits=store) for store in (True, False)]
  assert runs[0].path == runs[1].path == ("folded-sampling" if mode == "force" else "eager")
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  assert runs[1].rounds > 3 and 0 < runs[1].acceptance[0] < 1


@pytest.mark.slow
def test_calls_in_the_same_buckets_never_recompile(target):
  draft = make_draft(target, 4, "vanilla")
  params = dj.SamplingParams(temperature=[0.0, 1.0, 0.5], seed=[1, 2, 3])
  dj.generate(target, draft, PROMPTS[:3], params, jax.random.key(0), max_new_tokens=6)
  programs = decoding.compiled_programs()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration") else None)
  try:
    # Other prompts, lengths, budgets, seeds and key; the same batch, prompt and budget buckets.
    other = dj.SamplingParams(temperature=[1.0, 0.0, 2.0], seed=[7, 8, 9])
    result = dj.generate(target, draft, [[5, 4, 3, 2], [1], [7, 7]], other, jax.random.key(3),
                         max_new_tokens=[8, 2, 5])
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [] and decoding.compiled_programs() == programs
  assert result.compile_seconds == 0.0


def test_compiling_ahead_queues_each_program_once_and_a_later_call_gets_it(monkeypatch):
  # Inside `compiling_ahead`, a new program is lowered, queued (once, however often it is met) and
  # signalled by `Deferred`; afterwards `compiled` returns it (waiting for its thread), logged
  # once with its own seconds, and `wait_ahead` stores the rest. Programs equal a plain compile's.
  cache = decoding.compile_cache
  monkeypatch.setattr(cache, "_COMPILED", {})
  monkeypatch.setattr(cache, "_LOG", [])

  def affine(x, *, scale):
    return x * scale + 1.0

  x = jnp.arange(4.0)
  with cache.compiling_ahead(2):
    for scale in (2.0, 2.0, 3.0):
      with pytest.raises(cache.Deferred, match="affine"):
        cache.compiled(affine, (x,), dict(scale=scale))
    assert decoding.compiled_programs() == 2 and cache.compile_log() == []
  program, waited = cache.compiled(affine, (x,), dict(scale=2.0))
  np.testing.assert_array_equal(program(x), x * 2.0 + 1.0)
  assert waited >= 0.0 and [name for name, _ in cache.compile_log()] == [affine.__qualname__]
  cache.wait_ahead()
  assert len(cache.compile_log()) == 2 and not cache._PENDING
  program, waited = cache.compiled(affine, (x,), dict(scale=3.0))
  np.testing.assert_array_equal(program(x), x * 3.0 + 1.0)
  assert waited == 0.0 and decoding.compiled_programs() == 2
  with pytest.raises(ValueError, match="^workers: expected at least 1, got 0"):
    with cache.compiling_ahead(0):
      pass


@pytest.mark.parametrize("edit,match", [
    (dict(prompts=[[1, 2], [3, VOCAB]]), "prompts: row 1 token 1 is 12"),
    (dict(prompts=[[1], []]), "prompts: row 1 must be a non-empty"),
    (dict(params=dj.SamplingParams(temperature=0.0, batch_size=3)), "params: has 3 rows"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(draft=None), "draft: required"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids: entry 0 is 12"),
])
def test_bad_inputs_raise_clear_errors(target, edit, match):
  args = dict(target=target, draft=make_draft(target, 2, "vanilla"), prompts=[[1, 2], [3]],
              params=dj.SamplingParams(temperature=0.0, batch_size=2), key=jax.random.key(0))
  args.update(edit)
  with pytest.raises(ValueError, match=match):
    dj.generate(**args)


def test_draft_must_fit_the_target(target):
  config = dm.DraftConfig(gamma=2, target_layer_ids=(0,), mask_token_id=1)
  with pytest.raises(ValueError, match="target_layer_ids"):
    dm.DSparkDraft(config, target.config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="mask_token_id: 99"):
    dm.DSparkDraft(dm.DraftConfig(target_layer_ids=(-1, 1), mask_token_id=99), target.config,
                   rngs=nnx.Rngs(0))
