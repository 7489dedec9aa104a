"""Block sampling: exact joint laws, folded and eager agree, the backends agree, key streams, input
checks.

Blocks from differently compiled programs (the XLA loop against the unrolled form or a kernel in
Pallas' interpreter, folded against eager, one batch against another) are compared with
`helpers.assert_blocks_agree`, not bit for bit: the last bits of a float program depend on the
host's instruction set (FMA, vector width). Exact equality is asserted where it holds on every host:
integer and selection logic on identical inputs, the same program run twice, and special rows (all
-inf, NaN, exact ties)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import compiling
from dspark_jax.testing import law_checks as reference
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.kernels import token_kernels
from tests import helpers, stats


KINDS = ("vanilla", "gated", "rnn")


def _outputs(block):
  """A `DraftBlock` as the ``(tokens, corrected, confidence)`` triple `folded_block` returns."""
  return block.tokens, block.corrected_logits, block.confidence


def _assert_agree(ref, other, what):
  """`helpers.assert_blocks_agree`, and the confidence (third output) close wherever it reads the
  same tokens: step k's confidence reads x_{k-1} and the head's state, so rows are compared up to
  their first differing token."""
  helpers.assert_blocks_agree(ref, other, what=what)
  a, b = ref[2], other[2]
  assert (a is None) == (b is None), f"{what}: one block has no confidence"
  if a is None:
    return
  tokens_a, tokens_b = np.asarray(ref[0]), np.asarray(other[0])
  same = np.concatenate([np.ones((len(tokens_a), 1), bool), tokens_a[:, :-1] == tokens_b[:, :-1]],
                        axis=1)
  same = np.logical_and.accumulate(same, axis=1)
  np.testing.assert_allclose(np.asarray(a)[same], np.asarray(b)[same], rtol=1e-5, atol=1e-6,
                             err_msg=f"{what}: confidence")


@pytest.mark.parametrize("kind,temperature", [("vanilla", 1.0), ("gated", 0.7), ("rnn", 1.6)])
def test_block_joint_law_equals_enumerated_law(kind, temperature):
  # N = 150,000 sampled rows (interleaved with 150,000 greedy rows in the same batches), V = 5,
  # γ = 3: the law of (x1, x2, x3) over all 125 outcomes. Statistic: Pearson chi-square against the
  # exactly enumerated law (SPEC §3, NumPy float64). Threshold p >= 1e-3. Power check: the same counts
  # must reject the law of a draft without the sequential head (p < 1e-6).
  vocab, gamma, rank, hidden, n = 5, 3, 4, 3, 150_000
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=7, scale=2.0)
  head = dj.markov_head_from_arrays(kind, arrays)
  rng = np.random.default_rng(8)
  base = rng.normal(0, 1.0, (gamma, vocab)).astype(np.float32)
  h = rng.normal(0, 1.0, (gamma, hidden)).astype(np.float32)
  anchor = 2
  rows = 2 * n
  params = dj.SamplingParams(temperature=np.tile([0.0, temperature], n), seed=np.arange(rows))
  block = dj.sample_block(
      head, jnp.broadcast_to(base, (rows, gamma, vocab)), jnp.full((rows,), anchor, jnp.int32),
      jnp.broadcast_to(h, (rows, gamma, hidden)), params, jax.random.key(42),
      jnp.full((rows,), 30, jnp.int32))
  tokens = np.asarray(block.tokens)
  greedy_rows, sampled_rows = tokens[0::2], tokens[1::2]

  # Greedy rows: the argmax path through the exact corrected logits, every time.
  path = []
  for _ in range(gamma):
    logits = reference.corrected_logits(kind, arrays, base, anchor, h, path + [0] * (gamma - len(path)))
    path.append(int(np.argmax(logits[len(path)])))
  assert np.all(greedy_rows == path)

  counts = np.zeros((vocab,) * gamma)
  np.add.at(counts, tuple(sampled_rows.T), 1)
  law = reference.block_law(kind, arrays, base, anchor, h, temperature)
  stats.assert_law(counts, law, what=f"{kind} block law")
  parallel_law = np.ones((vocab,) * gamma)
  for seq in itertools.product(range(vocab), repeat=gamma):
    parallel_law[seq] = np.prod([reference.softmax(base[k] / temperature)[seq[k]]
                                 for k in range(gamma)])
  stats.assert_rejects(counts, parallel_law, what=f"{kind} vs a draft without the head")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_folded_agrees_with_eager(kind, dtype):
  # Folded and eager run the same step function in two compiled programs: their blocks agree as far
  # as floats allow (`helpers.assert_blocks_agree`); the same program run twice is bit for bit.
  batch, gamma, vocab, rank, hidden = 6, 7, 300, 16, 12
  head = dj.markov_head_from_arrays(
      kind, {k: jnp.asarray(v, dtype) for k, v in helpers.head_arrays(kind, vocab, rank, hidden).items()})
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  keys = jax.random.split(jax.random.key(9), 2)
  base = (2.0 * jax.random.normal(keys[0], (batch, gamma, vocab))).astype(dtype)
  h = jax.random.normal(keys[1], (batch, gamma, hidden)).astype(dtype)
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 1.0, 2.0, 1e-7], top_k=[0, 0, 1, 0, 0, 0],
                             seed=[3, 1, 4, 1, 5, 9])
  args = (head, base, jnp.arange(batch), h, params, jax.random.key(1), jnp.arange(batch) * 10)
  folded = dj.sample_block(*args, confidence_head=conf)
  eager = dj.sample_block_eager(*args, confidence_head=conf)
  assert folded.path == "folded-sampling" and eager.path == "eager"
  if jax.default_backend() == "cpu":
    assert folded.backend.backend is dispatch.Backend.XLA  # "auto" on the CPU
  _assert_agree(_outputs(eager), _outputs(folded), f"folded vs eager, {kind}")
  assert folded.corrected_logits.dtype == dtype
  again = dj.sample_block(*args, confidence_head=conf)
  for x, y in zip(_outputs(folded), _outputs(again)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  greedy_only = dj.sample_block(*args, confidence_head=conf, greedy_only=True)
  assert greedy_only.corrected_logits is None and greedy_only.path == "folded-greedy"
  # Greedy rows draft the same tokens in both variants (two programs: near-ties may go either way,
  # so at least half the greedy rows whole, `helpers.assert_blocks_agree` without logits).
  mask = np.asarray(params.greedy_mask)
  assert mask.sum() == 3
  helpers.assert_blocks_agree((np.asarray(folded.tokens)[mask], None),
                              (np.asarray(greedy_only.tokens)[mask], None),
                              what=f"greedy rows, sampling vs greedy-only variant, {kind}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_block_step_k_is_sample_step_at_position_plus_k(kind, dtype):
  # Draft token k of a row is what sample_step draws from the *emitted* L_k at position
  # anchor_pos + k: the tokens come from exactly the rounded logits the verifier will see.
  batch, gamma, vocab, hidden = 4, 3, 64, 5
  head = dj.markov_head_from_arrays(
      kind, {k: jnp.asarray(v, dtype) for k, v in helpers.head_arrays(kind, vocab, 8, hidden).items()})
  base = jax.random.normal(jax.random.key(0), (batch, gamma, vocab)).astype(dtype)
  h = jnp.ones((batch, gamma, hidden), dtype)
  params = dj.SamplingParams(temperature=[1.0, 0.0, 0.6, 1.4], seed=[10, 20, 30, 40])
  positions = jnp.array([5, 0, 123, 9])
  key = jax.random.key(77)
  block = dj.sample_block(head, base, jnp.zeros(batch, jnp.int32), h, params, key, positions)
  assert block.corrected_logits.dtype == dtype
  for k in range(gamma):
    step = dj.sample_step(block.corrected_logits[:, k], params, key, positions + k + 1)
    np.testing.assert_array_equal(np.asarray(step), np.asarray(block.tokens[:, k]))


def test_rows_are_independent_of_batch_composition():
  # Another batch (or another row order) is another program or other inputs to its product: the
  # rows agree with the full batch's as far as floats allow (`helpers.assert_blocks_agree`).
  vocab, gamma = 50, 4
  head = helpers.make_head("rnn", vocab, 8, 5)
  rng = np.random.default_rng(0)
  base = rng.normal(size=(6, gamma, vocab)).astype(np.float32)
  h = rng.normal(size=(6, gamma, 5)).astype(np.float32)
  temperature = np.array([1.0, 0.0, 0.9, 1.5, 0.7, 2.0])
  seeds = np.array([11, 12, 13, 14, 15, 16])

  def run(idx):
    block = dj.sample_block(head, jnp.asarray(base[idx]), jnp.asarray(idx), jnp.asarray(h[idx]),
                            dj.SamplingParams(temperature=temperature[idx], seed=seeds[idx]),
                            jax.random.key(3), jnp.asarray(idx) * 7)
    return np.asarray(block.tokens), np.asarray(block.corrected_logits)

  full = run(np.arange(6))
  for idx in ([4, 0, 2], [5, 4, 3, 2, 1, 0]):
    helpers.assert_blocks_agree(tuple(x[idx] for x in full), run(np.array(idx)),
                                what=f"rows {idx} vs the full batch")


def test_inputs_are_not_mutated():
  head = helpers.make_head("gated", 30, 4, 3)
  base = np.random.default_rng(0).normal(size=(2, 3, 30)).astype(np.float32)
  h = np.ones((2, 3, 3), np.float32)
  anchor = np.array([1, 2])
  before = (base.copy(), h.copy(), anchor.copy())
  dj.sample_block(head, jnp.asarray(base), anchor, jnp.asarray(h),
                  dj.SamplingParams(temperature=[1.0, 0.0]), jax.random.key(0), np.array([0, 0]))
  for a, b in zip((base, h, anchor), before):
    np.testing.assert_array_equal(a, b)


def _inputs(batch=2, gamma=3, vocab=30, hidden=3):
  return dict(base_logits=jnp.zeros((batch, gamma, vocab)), anchor=jnp.zeros(batch, jnp.int32),
              hidden=jnp.zeros((batch, gamma, hidden)),
              params=dj.SamplingParams(temperature=[1.0] * batch), key=jax.random.key(0),
              positions=jnp.zeros(batch, jnp.int32))


@pytest.mark.parametrize("edit,match", [
    (lambda d: dict(d, base_logits=d["base_logits"][0]), "base_logits: expected \\[B, γ, V\\]"),
    (lambda d: dict(d, base_logits=jnp.zeros((2, 3, 31))), "base_logits: vocab 31"),
    (lambda d: dict(d, anchor=jnp.zeros(3, jnp.int32)), "anchor: expected shape \\(2,\\)"),
    (lambda d: dict(d, positions=jnp.zeros(2)), "positions: expected integers"),
    (lambda d: dict(d, hidden=None), "hidden: a 'gated' head needs"),
    (lambda d: dict(d, hidden=jnp.zeros((2, 3, 4))), "hidden: H=4 does not match"),
    (lambda d: dict(d, hidden=jnp.zeros((2, 2, 3))), "hidden: expected \\[2, 3, H\\]"),
    (lambda d: dict(d, params=dj.SamplingParams(temperature=[1.0])), "params: has 1 rows"),
    (lambda d: dict(d, params={"temperature": 1.0}), "params: expected SamplingParams"),
])
def test_sample_block_rejects_bad_inputs(edit, match):
  head = helpers.make_head("gated", 30, 4, 3)
  with pytest.raises(ValueError, match=match):
    dj.sample_block(head, **edit(_inputs()))


LOOP = ("xla", dispatch.XlaConfig(form="loop"))
# Every tile draws its token in the step kernel: the default below 64 rows, forced for law tests.
TILE_DRAWS = dispatch.TritonConfig(tile_draws=True)
# No tile draws: the token choice draws in the chosen tile (`token_kernels.draw_tokens`).
CHOICE = dispatch.TritonConfig(tile_draws=False)
# Kernels chained by programmatic dependent launch (a no-op in the interpreter).
PDL = dispatch.TritonConfig(pdl=True)


def _folded(head_params, conf_params, base, rows, hidden, key, kind, greedy_only, backend, config,
            store_logits=True):
  return proposal.folded_block(
      head_params, conf_params, base, rows["anchor"], hidden, rows["greedy"], rows["temperature"],
      rows["seeds"], rows["positions"], key, kind=kind, greedy_only=greedy_only, backend=backend,
      config=config, store_logits=store_logits)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend,config", [
    ("xla", dispatch.XlaConfig(form="unrolled")),
    pytest.param("triton", None, marks=pytest.mark.kernel),
    pytest.param("triton", CHOICE, marks=pytest.mark.kernel),
], ids=["unrolled", "triton", "triton-choice"])
@pytest.mark.slow
def test_every_folded_form_agrees_with_the_loop(kind, backend, config):
  # Each form against the XLA loop, as far as floats allow (`helpers.assert_blocks_agree`): the
  # forms are other programs (the kernel runs in Pallas' interpreter on the CPU; on a GPU it sums
  # v @ W2 in its own order), so a corrected logit may differ in its last bit and a near-tie go the
  # other way (the law is checked separately: test_pallas_form_block_law). With a confidence head
  # XLA gathers W1[x_prev]; 5 rows: every tile draws in the step kernel, or (CHOICE) the token
  # choice draws in the chosen tile.
  batch, gamma, vocab, rank, hidden = 5, 4, 192, 16, 6
  head = helpers.make_head(kind, vocab, rank, hidden)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  keys = jax.random.split(jax.random.key(3), 2)
  base = 2.0 * jax.random.normal(keys[0], (batch, gamma, vocab))
  h = jax.random.normal(keys[1], (batch, gamma, hidden))
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0, 1.0])
  rows = proposal.block_arrays(params, np.arange(batch), np.arange(batch) * 7)
  for greedy_only in (False, True):
    loop, other = [_folded(head.arrays(), conf.arrays(), base, rows, h, jax.random.key(4), kind,
                           greedy_only, b, c) for b, c in (LOOP, (backend, config))]
    assert (loop[1] is None) == greedy_only
    _assert_agree(loop, other, f"{backend} {config} vs the loop, {kind}, greedy_only={greedy_only}")


@pytest.mark.kernel
@pytest.mark.parametrize("kind,temperature,config", [
    ("vanilla", 1.0, None),          # 64k rows: the token choice draws (`draw_tokens`)
    ("gated", 0.6, TILE_DRAWS),      # every tile draws in the kernel; v from XLA
    ("vanilla", 0.8, TILE_DRAWS),    # ... with W1 gathered in the kernel
], ids=["vanilla-choice", "gated-tile-draws", "vanilla-tile-draws"])
@pytest.mark.slow
def test_pallas_form_block_law(kind, temperature, config):
  # The kernel form's own law (on a GPU its arithmetic differs from XLA's; on the CPU it runs in the
  # interpreter). N = 59,904 sampled rows (+ 4,096 greedy rows), V = 48 (three 16-column tiles, so
  # the two-level draw crosses tiles), γ = 2: the law of (x1, x2) over 2,304 outcomes. Statistic:
  # Pearson chi-square (bins with expected count < 5 pooled) against the enumerated float64 law;
  # threshold p >= 1e-3. Power: the law at 1.15 x the temperature must be rejected (p < 1e-6).
  # The 64,000 rows are drafted in 128 calls of 500 rows (the same rows, seeds, positions and key;
  # a row's draws depend on (key, seed, position) only, test_rows_are_independent_of_batch_composition,
  # so these are the tokens one 64,000-row call draws, up to the last bits of the arithmetic, which
  # depend on the compiled program: every chunk samples the same law). Each call still has >= 64
  # rows, so the kernel's settings are those of the large batch (64-row blocks, the last one partly
  # masked; without TILE_DRAWS the token choice draws). Why: in the interpreter every instance of
  # a kernel's grid (one per 64-row block, one per row in `draw_tokens`) handles whole arrays, so
  # its time grows as rows²: one 64,096-row call took 60-200 s on 2 CPU cores; 32 calls of 2,003
  # rows ~10 s, these 128 calls of 500 rows half that.
  vocab, gamma, rank, hidden, n, greedy_n = 48, 2, 16, 3, 59_904, 4_096
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=5, scale=1.5)
  head = dj.markov_head_from_arrays(kind, arrays)
  rng = np.random.default_rng(6)
  base = rng.normal(0, 1.5, (gamma, vocab)).astype(np.float32)
  h = rng.normal(0, 1.0, (gamma, hidden)).astype(np.float32)
  anchor, rows, chunk = 3, n + greedy_n, 500
  assert rows % chunk == 0 and chunk >= dispatch.TILE_DRAWS_BELOW_BATCH
  params = dj.SamplingParams(temperature=np.r_[np.zeros(greedy_n), np.full(n, temperature)],
                             seed=np.arange(rows))
  r = proposal.block_arrays(params, np.full(rows, anchor), np.full(rows, 11))
  draft = compiling.compute_bound_jit(functools.partial(
      proposal.folded_block, kind=kind, greedy_only=False, backend="triton", config=config))
  tokens = []
  for start in range(0, rows, chunk):
    part = slice(start, start + chunk)
    tokens.append(draft(
        head.arrays(), None, jnp.broadcast_to(base, (chunk, gamma, vocab)), r["anchor"][part],
        jnp.broadcast_to(h, (chunk, gamma, hidden)), r["greedy"][part], r["temperature"][part],
        r["seeds"][part], r["positions"][part], jax.random.key(9))[0])
  tokens = np.concatenate([np.asarray(t) for t in tokens])
  assert tokens.shape == (rows, gamma)
  path = []
  for _ in range(gamma):
    logits = reference.corrected_logits(kind, arrays, base, anchor, h, path + [0] * (gamma - len(path)))
    path.append(int(np.argmax(logits[len(path)])))
  assert np.all(tokens[:greedy_n] == path)
  counts = np.zeros((vocab,) * gamma)
  np.add.at(counts, tuple(tokens[greedy_n:].T), 1)
  stats.assert_law(counts, reference.block_law(kind, arrays, base, anchor, h, temperature),
                   what=f"pallas {kind} block law")
  stats.assert_rejects(counts, reference.block_law(kind, arrays, base, anchor, h, 1.15 * temperature),
                       what=f"pallas {kind} vs 1.15 T")


@pytest.mark.slow
@pytest.mark.kernel
def test_pallas_form_over_many_tiles_with_edge_rows():
  # V = 2064 = 129 tiles of 16. Rows: all -inf, a NaN in the last tile, an exact tie between the
  # first and the last tile, normal rows; greedy and sampled. The kernel's per-tile draws and their
  # reduction, per step, chained or not (pdl: `choose_tokens` reduces; also with a 16-wide rank
  # chunk); the token choice that draws (`draw_tokens`, chained or not). W2 = 0: every program's
  # corrected logits are the base logits exactly (the bias is an exact zero on any host), so the
  # logits and the tokens (selection logic on identical values) must equal the loop's exactly, and
  # the special rows draft their defined tokens on every form.
  batch, gamma, vocab, rank = 8, 2, 2064, 16
  head = helpers.make_head("vanilla", vocab, rank, 4)
  base = helpers.edge_rows(batch, gamma, vocab, nan_at=2060, tie_at=(5, 2050))  # first, last tile
  arrays = dict(head.arrays(), w2=jnp.zeros_like(head.arrays()["w2"]))  # keep the edge rows intact
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.9], batch // 2))
  rows = proposal.block_arrays(params, np.arange(batch), np.arange(batch) * 5)
  forms = (LOOP, ("triton", None), ("triton", PDL),
           ("triton", dispatch.TritonConfig(pdl=True, k_chunk=16)), ("triton", CHOICE),
           ("triton", dispatch.TritonConfig(tile_draws=False, pdl=True)))
  for g in (False, True):
    loop, *others = [_folded(arrays, None, jnp.asarray(base), rows, None, jax.random.key(1),
                             "vanilla", g, b, c) for b, c in forms]
    for (b, c), block in zip(forms, [loop] + others):
      what = f"{b} {c}, greedy_only={g}"
      tokens = np.asarray(block[0])
      np.testing.assert_array_equal(tokens, np.asarray(loop[0]), err_msg=what)
      if not g:
        np.testing.assert_array_equal(np.asarray(block[1]), base, err_msg=what)
      # all -inf: token 0; a NaN: the NaN's column (greedy and sampled); the greedy tie: the first
      assert np.all(tokens[0:2] == 0) and np.all(tokens[2:4] == 2060), what
      assert np.all(tokens[4] == 5), what
      assert np.all(np.isin(tokens[5], (5, 2050))), what


@pytest.mark.kernel
@pytest.mark.parametrize("draws,store_logits", [(True, True), (False, False)])
def test_kernel_sampling_step_needs_noise_and_greedy_mask(draws, store_logits):
  # Without draws and with the logits stored, the noise is the token choice's (`draw_tokens`).
  batch, gamma, vocab, rank = 2, 1, 64, 16
  w2 = jnp.zeros((rank, vocab), jnp.float32)
  base = jnp.zeros((batch, gamma, vocab), jnp.float32)
  noise = jnp.zeros((gamma, batch, vocab // 64 + 64), jnp.float32)
  v, temperature = jnp.zeros((batch, rank)), jnp.ones((batch,))
  with pytest.raises(ValueError, match="^greedy: "):
    fused_step.step_stats(v, w2, base, temperature, noise, None, step=0, greedy_only=False,
                          draws=draws, store_logits=store_logits, interpret=True)
  with pytest.raises(ValueError, match="^noise: "):
    fused_step.step_stats(v, w2, base, temperature, None, None, greedy=jnp.zeros(batch, bool),
                          step=0, greedy_only=False, draws=draws, store_logits=store_logits,
                          interpret=True)


@pytest.mark.kernel
def test_kernel_first_max_keys_match_argmax():
  # `fused_step` reduces integer keys, not floats (Triton's float max drops NaN). The keys must give
  # jnp.argmax's answer and the max: 200 rows of 64 values with exact ties, signed zeros, ±inf,
  # all -inf rows and NaNs.
  rng = np.random.default_rng(21)
  values = rng.integers(-3, 3, size=(200, 64)).astype(np.float32)
  values[rng.random(values.shape) < 0.2] = -0.0
  values[0] = -np.inf
  values[1, [5, 40]] = np.inf
  values[2, [7, 9]] = np.nan
  values[3, :] = -0.0
  values[3, 30] = 0.0
  values[4, 3] = -np.nan
  columns = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), values.shape)
  best, first = fused_step.row_first_max(jnp.asarray(values), columns)
  np.testing.assert_array_equal(np.asarray(first), np.argmax(values, axis=1))
  want = np.max(values, axis=1)  # NaN where a NaN is present, as jnp.argmax's winner
  np.testing.assert_array_equal(np.asarray(best), want)  # equal as values: -0 == +0


@pytest.mark.kernel
def test_choose_tokens_is_the_tile_reduction():
  # `token_kernels.choose_tokens` (the token choice of a pdl chain) against XLA's reduction
  # (`sampling.tokens_from_tile_choices`) on pairs with the kernel's padded rows: ties between
  # tiles and between NaN keys (NaN beats every key; the smaller token wins), +inf, a row of -inf
  # keys, and a tile count that is not a power of two.
  rng = np.random.default_rng(0)
  rows, batch, tiles = 16, 5, 37
  key = rng.normal(size=(rows, tiles)).astype(np.float32)
  token = rng.permutation(rows * tiles).reshape(rows, tiles).astype(np.int32)
  key[0, [3, 30]] = 9.0
  key[1, [4, 20]] = np.nan
  key[2] = -np.inf
  key[3, -1] = np.inf
  want = sampling.tokens_from_tile_choices(jnp.asarray(key[:batch]), jnp.asarray(token[:batch]))
  for pdl in (False, True):
    got = token_kernels.choose_tokens(key, token, batch=batch, pdl=pdl, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert int(want[0]) == min(token[0, 3], token[0, 30])
  assert int(want[1]) == min(token[1, 4], token[1, 20]) and int(want[3]) == token[3, -1]


@pytest.mark.slow
@pytest.mark.kernel
def test_draw_tokens_is_the_two_level_draw():
  # `token_kernels.draw_tokens` (the token choice that draws) against `sampling.tokens_from_tile_stats`
  # with the noise `sampling.tile_noise` gives the same rows' keys, at three block positions:
  # integer logits (exact ties inside and across tiles), a row of -inf (token 0), NaNs (the first
  # NaN), +inf (the first +inf), greedy and sampled rows, pairs with padded rows after the batch,
  # or tile-major (in order or reversed) with rows after the last tile, and a tile count (99) that
  # is not a power of two. Tile-major pairs without tokens (``greedy_in_tile``: every tile's token
  # its first column, a greedy row's first max found in its chosen tile) give the same tokens,
  # also with the NaN and +inf rows greedy (steps 1 and 2).
  rng = np.random.default_rng(0)
  batch, gamma, tile, tiles = 6, 3, 16, 99
  vocab = tile * tiles
  logits = rng.integers(-4, 4, size=(batch, gamma, vocab)).astype(np.float32)
  logits[0] = -np.inf
  logits[2][:, [9, vocab - 3]] = np.nan
  logits[3][:, [20, vocab - 1]] = np.inf
  corrected = jnp.asarray(logits, jnp.bfloat16)
  greedy = jnp.asarray([0, 1, 0, 0, 1, 0], jnp.int32)
  temperature = jnp.asarray(rng.uniform(0.3, 2.0, batch), jnp.float32)
  seeds = jnp.arange(batch, dtype=jnp.uint32) * 7
  positions = jnp.arange(batch, dtype=jnp.int32) + 100
  key = jax.random.key(11)
  w1 = jnp.asarray(rng.normal(0, 1, (vocab, 8)), jnp.bfloat16)
  pad = lambda a: jnp.concatenate([a, jnp.zeros((10, tiles), a.dtype)])
  for step in range(gamma):
    x = corrected[:, step].astype(jnp.float32)
    tile_max, tile_arg, mass = sampling.tile_stats(x, temperature)
    starts = jnp.broadcast_to(jnp.arange(tiles, dtype=jnp.int32) * tile, tile_max.shape)
    pairs = sampling.tile_choices(tile_max, tile_arg, mass, starts, greedy != 0)  # no noise
    keys = sampling.row_keys(key, seeds, positions + step + 1, dj.Stream.DRAFT)
    want = sampling.tokens_from_tile_stats(corrected[:, step], tile_max, tile_arg, mass,
                                           greedy != 0, temperature,
                                           sampling.tile_noise(keys, tiles, tile))
    for pdl in (False, True):
      got = token_kernels.draw_tokens(*map(pad, pairs), corrected, greedy, temperature,
                                   sampling.key_words(key), seeds, positions, step=step,
                                   batch=batch, pdl=pdl, interpret=True)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Tile-major pairs (`hopper_step.sampling_partials`'), with rows past the last tile that
    # must be ignored (here: large keys).
    # Reversed (``sampling_partials(reverse=True)``): row t is tile V/c - 1 - t. With W1 the
    # kernel also writes each row's W1[token] (the next step's vector of a vanilla head).
    for reverse in (False, True):
      order = (lambda a: a[::-1]) if reverse else (lambda a: a)
      extra = lambda a: jnp.concatenate([order(a.T), jnp.full((5, batch), 1e9, a.dtype)])
      got, vectors = token_kernels.draw_tokens(
          *map(extra, pairs), corrected, greedy, temperature, sampling.key_words(key), seeds,
          positions, w1=w1, step=step, tile_major=True, reversed_tiles=reverse, interpret=True)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
      np.testing.assert_array_equal(np.asarray(vectors), np.asarray(w1)[np.asarray(want)])
    assert int(want[0]) == 0 and int(want[2]) == 9 and int(want[3]) == 20
    for rows_greedy in (greedy, jnp.asarray([1, 1, 1, 1, 0, 0], jnp.int32)) if step else ():
      tile_key = sampling.tile_choices(tile_max, tile_arg, mass, starts, rows_greedy != 0)[0]
      want = sampling.tokens_from_tile_stats(corrected[:, step], tile_max, tile_arg, mass,
                                             rows_greedy != 0, temperature,
                                             sampling.tile_noise(keys, tiles, tile))
      got = token_kernels.draw_tokens(
          tile_key.T[::-1], None, corrected, rows_greedy, temperature, sampling.key_words(key),
          seeds, positions, step=step, tile_major=True, reversed_tiles=True,
          greedy_in_tile=True, interpret=True)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(want[0]) == 0 and int(want[2]) == 9 and int(want[3]) == 20
  with pytest.raises(ValueError, match="tile_token: None exactly when greedy_in_tile"):
    token_kernels.draw_tokens(tile_key.T, None, corrected, greedy, temperature,
                              sampling.key_words(key), seeds, positions, step=0, tile_major=True,
                              interpret=True)


@pytest.mark.kernel
def test_backends_and_settings_are_refused_where_they_do_not_apply():
  # Raised while the block is traced, before any kernel runs.
  batch, gamma, vocab, rank = 2, 2, 64, 16
  base = jnp.zeros((batch, gamma, vocab))
  hidden = jnp.zeros((batch, gamma, 3))
  rows = proposal.block_arrays(dj.SamplingParams(temperature=[1.0, 0.0]), [0, 1], [0, 0])
  def run(kind, backend, config, hidden=None, conf=None, store_logits=True, base=base, rank=rank,
          dtype=jnp.float32):
    arrays = {k: v.astype(dtype) for k, v in
              helpers.head_arrays(kind, base.shape[2], rank, 3).items()}
    return _folded(arrays, conf, base.astype(dtype), rows, hidden, jax.random.key(0), kind,
                   False, backend, config, store_logits=store_logits)
  pdl = "^TritonConfig.pdl: the chain needs W1 gathered in the kernel"
  with pytest.raises(ValueError, match=pdl):
    run("gated", "triton", PDL, hidden)                                   # v from XLA
  with pytest.raises(ValueError, match=pdl):                              # W1[x] gathered in XLA
    run("vanilla", "triton", PDL, hidden, conf=helpers.confidence_arrays(3 + rank))
  with pytest.raises(ValueError, match=pdl):  # compact, no tile draws: `chosen_tile_draws`
    run("vanilla", "triton", dispatch.TritonConfig(tile_draws=False, pdl=True), store_logits=False)
  with pytest.raises(ValueError, match="^config: TritonConfig is not a setting of backend 'hop"):
    run("vanilla", "hopper", TILE_DRAWS)
  with pytest.raises(ValueError, match="^config: HopperConfig is not a setting of backend 'tri"):
    run("vanilla", "triton", dispatch.HopperConfig())
  with pytest.raises(ValueError, match="^backend 'triton': precondition failed: r is a multiple"):
    run("vanilla", "triton", None, rank=8)
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: W2 and the logits "
                     "are bfloat16"):
    run("vanilla", "hopper", None)
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: B is a multiple "
                     "of 64"):
    run("vanilla", "hopper", None, base=jnp.zeros((batch, gamma, 128)), rank=64,
        dtype=jnp.bfloat16)
  assert not fused_step.pdl_supported() or jax.default_backend() == "gpu"
