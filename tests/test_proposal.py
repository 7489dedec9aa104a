"""Block sampling: exact joint laws, folded == eager bit for bit, key streams, input checks."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import law_checks as reference
from dspark_jax import fused_block
from dspark_jax.kernels import triton_step as fused_step
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.kernels import token_kernels
from tests import helpers, stats

KINDS = ("vanilla", "gated", "rnn")


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
def test_folded_equals_eager_bit_for_bit(kind, dtype):
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
  helpers.assert_same_block(folded, eager)
  assert folded.corrected_logits.dtype == dtype
  greedy_only = dj.sample_block(*args, confidence_head=conf, greedy_only=True)
  assert greedy_only.corrected_logits is None and greedy_only.path == "folded-greedy"
  # Greedy rows draft the same tokens in both variants.
  mask = np.asarray(params.greedy_mask)
  np.testing.assert_array_equal(np.asarray(greedy_only.tokens)[mask], np.asarray(folded.tokens)[mask])


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
  vocab, gamma = 50, 4
  head = helpers.make_head("rnn", vocab, 8, 5)
  rng = np.random.default_rng(0)
  base = rng.normal(size=(6, gamma, vocab)).astype(np.float32)
  h = rng.normal(size=(6, gamma, 5)).astype(np.float32)
  temperature = np.array([1.0, 0.0, 0.9, 1.5, 0.7, 2.0])
  seeds = np.array([11, 12, 13, 14, 15, 16])

  def run(idx):
    return np.asarray(dj.sample_block(head, jnp.asarray(base[idx]), jnp.asarray(idx), jnp.asarray(h[idx]),
                                      dj.SamplingParams(temperature=temperature[idx], seed=seeds[idx]),
                                      jax.random.key(3), jnp.asarray(idx) * 7).tokens)

  full = run(np.arange(6))
  np.testing.assert_array_equal(run(np.array([4, 0, 2])), full[[4, 0, 2]])
  np.testing.assert_array_equal(run(np.array([5, 4, 3, 2, 1, 0])), full[::-1])


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


# The kernel's non-default paths (tiles walked in order on every step, no cache hints too).
XLA_CHOICE = (("w1_in_kernel", False), ("draws", False), ("serpentine", False),
              ("cache_hints", False))
TILE_DRAWS = (("draws", True),)  # the default below 64 rows, forced for the large law tests
XLA_DRAW = (("draws", False), ("choice", False))  # XLA reduces, then draws in the chosen tile
CHOICE = (("choice", True),)  # the token choice draws (`token_kernels.draw_tokens`), from 64 rows
PERSISTENT = (("persistent", True),)  # the whole block in one `fused_block` kernel
PDL = (("pdl", True),)  # kernels chained by programmatic dependent launch (a no-op on the CPU)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form,options", [("unrolled", ()), ("pallas", ()),
                                          ("pallas", XLA_CHOICE)])
def test_every_folded_form_equals_the_loop(kind, form, options):
  # On the CPU the forms are bit-identical (the kernel runs in Pallas' interpreter); on a GPU the
  # kernel sums v @ W2 in its own order, so corrected logits agree to bf16 rounding and tokens may
  # differ at near-ties (the law is checked separately: test_pallas_form_block_law).
  batch, gamma, vocab, rank, hidden = 5, 4, 192, 16, 6
  head = helpers.make_head(kind, vocab, rank, hidden)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  keys = jax.random.split(jax.random.key(3), 2)
  base = 2.0 * jax.random.normal(keys[0], (batch, gamma, vocab))
  h = jax.random.normal(keys[1], (batch, gamma, hidden))
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0, 1.0])
  rows = proposal.block_arrays(params, np.arange(batch), np.arange(batch) * 7)
  for greedy_only in (False, True):
    outs = [proposal.folded_block(
        head.arrays(), conf.arrays(), base, rows["anchor"], h, rows["greedy"], rows["temperature"],
        rows["seeds"], rows["positions"], jax.random.key(4), kind=kind, greedy_only=greedy_only,
        form=f, pallas_options=o) for f, o in (("loop", ()), (form, options))]
    for a, b in zip(*outs):
      assert (a is None) == (b is None)
      if a is not None:
        if jax.default_backend() == "cpu":
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        elif a.dtype != jnp.int32:
          np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                     rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("kind,temperature,options", [
    ("vanilla", 1.0, ()),            # 64k rows: the token choice draws (`draw_tokens`)
    ("gated", 0.6, TILE_DRAWS),      # every tile draws in the kernel; v from XLA
    ("vanilla", 0.8, TILE_DRAWS),    # ... with W1 gathered in the kernel
])
def test_pallas_form_block_law(kind, temperature, options):
  # The kernel form's own law (on a GPU its arithmetic differs from XLA's; on the CPU it runs in the
  # interpreter). N = 60,000 sampled rows (+ 4,096 greedy rows), V = 48 (three 16-column tiles, so
  # the two-level draw crosses tiles), γ = 2: the law of (x1, x2) over 2,304 outcomes. Statistic:
  # Pearson chi-square (bins with expected count < 5 pooled) against the enumerated float64 law;
  # threshold p >= 1e-3. Power: the law at 1.15 x the temperature must be rejected (p < 1e-6).
  # The 64,096 rows are drafted in 32 calls of 2,003 rows (the same rows, seeds, positions and key;
  # a row's draws depend on (key, seed, position) only, test_rows_are_independent_of_batch_composition,
  # so these are the tokens one 64,096-row call draws, bit for bit). Each call still has >= 64 rows,
  # so the kernel's settings are those of the large batch (64-row blocks, the last one partly
  # masked; without TILE_DRAWS the token choice draws). Why: in the interpreter every instance of
  # a kernel's grid (one per 64-row block, one per row in `draw_tokens`) handles whole arrays, so
  # its time grows as rows²: one 64,096-row call took 60-200 s on 2 CPU cores, the 32 take ~5 s.
  vocab, gamma, rank, hidden, n, greedy_n = 48, 2, 16, 3, 60_000, 4_096
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=5, scale=1.5)
  head = dj.markov_head_from_arrays(kind, arrays)
  rng = np.random.default_rng(6)
  base = rng.normal(0, 1.5, (gamma, vocab)).astype(np.float32)
  h = rng.normal(0, 1.0, (gamma, hidden)).astype(np.float32)
  anchor, rows, chunk = 3, n + greedy_n, 2_003
  assert rows % chunk == 0 and chunk >= proposal.TILE_DRAWS_BELOW_BATCH
  params = dj.SamplingParams(temperature=np.r_[np.zeros(greedy_n), np.full(n, temperature)],
                             seed=np.arange(rows))
  r = proposal.block_arrays(params, np.full(rows, anchor), np.full(rows, 11))
  tokens = []
  for start in range(0, rows, chunk):
    part = slice(start, start + chunk)
    tokens.append(proposal.folded_block(
        head.arrays(), None, jnp.broadcast_to(base, (chunk, gamma, vocab)), r["anchor"][part],
        jnp.broadcast_to(h, (chunk, gamma, hidden)), r["greedy"][part], r["temperature"][part],
        r["seeds"][part], r["positions"][part], jax.random.key(9), kind=kind, greedy_only=False,
        form="pallas", pallas_options=options)[0])
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


def test_pallas_form_over_many_tiles_with_edge_rows():
  # V = 2064 = 129 tiles of 16. Rows: all -inf, a NaN in the last tile, an exact tie between the
  # first and the last tile, normal rows; greedy and sampled. The kernel's per-tile draws and their
  # reduction, per step, in the persistent kernel, or chained (pdl: `choose_tokens` reduces; with
  # a W2 chunk loaded first); the token choice that draws (`draw_tokens`, chained or not); XLA's
  # draw in the chosen tile: each must give the loop form's tokens and logits bit for bit (CPU).
  batch, gamma, vocab, rank = 8, 2, 2064, 16
  head = helpers.make_head("vanilla", vocab, rank, 4)
  base = helpers.edge_rows(batch, gamma, vocab, nan_at=2060, tie_at=(5, 2050))  # first, last tile
  arrays = dict(head.arrays(), w2=jnp.zeros_like(head.arrays()["w2"]))  # keep the edge rows intact
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.9], batch // 2))
  rows = proposal.block_arrays(params, np.arange(batch), np.arange(batch) * 5)
  forms = (("loop", ()), ("pallas", ()), ("pallas", XLA_CHOICE), ("pallas", PERSISTENT),
           ("pallas", PDL), ("pallas", PDL + (("prefetch", True), ("k_chunk", 16))),
           ("pallas", CHOICE), ("pallas", CHOICE + PDL), ("pallas", XLA_DRAW))
  for g in (False, True):
    loop, *others = [proposal.folded_block(
        arrays, None, jnp.asarray(base), rows["anchor"], None, rows["greedy"],
        rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(1), kind="vanilla",
        greedy_only=g, form=f, pallas_options=o) for f, o in forms]
    for other in others:
      np.testing.assert_array_equal(np.asarray(loop[0]), np.asarray(other[0]))
      if not g:
        np.testing.assert_array_equal(np.asarray(loop[1]), np.asarray(other[1]))
    if not g:
      tokens = np.asarray(loop[0])
  assert np.all(tokens[0:2] == 0) and np.all(tokens[2:4] == 2060) and np.all(tokens[4] == 5)


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


@pytest.mark.parametrize("batch", [1, 5])
def test_persistent_kernel_equals_the_step_kernels(batch):
  # The persistent kernel computes every tile as the per-step kernels with tile draws do and
  # reduces the same (key, token) pairs in the same order, so tokens, corrected logits and
  # confidence must agree bit for bit, in the interpreter (CPU) and on a GPU alike (there its grid
  # has several instances and a real grid-wide barrier: V = 192 is three tiles).
  gamma, vocab, rank, hidden = 4, 192, 16, 6
  head = helpers.make_head("vanilla", vocab, rank, hidden)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  keys = jax.random.split(jax.random.key(13), 2)
  base = 2.0 * jax.random.normal(keys[0], (batch, gamma, vocab))
  h = jax.random.normal(keys[1], (batch, gamma, hidden))
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0, 1.0][:batch] if batch > 1 else [0.7])
  rows = proposal.block_arrays(params, np.arange(batch) * 11, np.arange(batch) * 7)
  for greedy_only in (False, True):
    for conf_arrays in (None, conf.arrays()):
      steps, whole = [proposal.folded_block(
          head.arrays(), conf_arrays, base, rows["anchor"], h, rows["greedy"],
          rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(4), kind="vanilla",
          greedy_only=greedy_only, form="pallas", pallas_options=o) for o in (TILE_DRAWS, PERSISTENT)]
      for a, b in zip(steps, whole):
        assert (a is None) == (b is None)
        if a is not None:
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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


def test_pdl_is_refused_where_the_chain_does_not_apply():
  batch, gamma, vocab, rank = 2, 2, 64, 16
  base = jnp.zeros((batch, gamma, vocab))
  rows = proposal.block_arrays(dj.SamplingParams(temperature=[1.0, 0.0]), [0, 1], [0, 0])
  def run(kind, options, hidden=None):
    head = helpers.make_head(kind, vocab, rank, 3)
    return proposal.folded_block(head.arrays(), None, base, rows["anchor"], hidden, rows["greedy"],
                                 rows["temperature"], rows["seeds"], rows["positions"],
                                 jax.random.key(0), kind=kind, greedy_only=False, form="pallas",
                                 pallas_options=options)
  with pytest.raises(ValueError, match="pdl is a setting of the per-step Triton kernel"):
    run("gated", PDL, jnp.zeros((batch, gamma, 3)))                  # v from XLA
  with pytest.raises(ValueError, match="pdl is a setting of the per-step Triton kernel"):
    run("vanilla", PDL + XLA_DRAW)                                   # XLA draws between steps
  with pytest.raises(ValueError, match="pdl is a setting of the per-step Triton kernel"):
    run("vanilla", PDL + PERSISTENT)
  with pytest.raises(ValueError, match="choice .* without draws"):
    run("vanilla", CHOICE + TILE_DRAWS)
  with pytest.raises(ValueError, match="hopper sampling kernel's token choice draws"):
    run("vanilla", (("hopper", True),) + TILE_DRAWS)
  assert not fused_step.pdl_supported() or jax.default_backend() == "gpu"


def test_persistent_kernel_rejects_what_it_cannot_run():
  batch, gamma, vocab, rank = 2, 2, 64, 16
  w1, w2 = jnp.zeros((vocab, rank)), jnp.zeros((rank, vocab))
  base, temperature = jnp.zeros((batch, gamma, vocab)), jnp.ones((batch,))
  anchor, greedy = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)
  noise = jnp.zeros((gamma, batch, vocab // 64 + 64))
  run = lambda **edit: fused_block.block_tokens(**dict(
      anchor=anchor, w1=w1, w2=w2, base_logits=base, temperature=temperature, noise=noise,
      greedy=greedy, greedy_only=False, interpret=True) | edit)
  with pytest.raises(ValueError, match="^noise: "):
    run(noise=None)
  with pytest.raises(ValueError, match="^greedy: "):
    run(greedy=None)
  with pytest.raises(ValueError, match=r"^base_logits: .* at most 64 rows, got 65"):
    run(anchor=jnp.zeros((65,), jnp.int32), base_logits=jnp.zeros((65, gamma, vocab)))
  with pytest.raises(ValueError, match="^programs: "):
    run(programs=-1, interpret=False)
  head = helpers.make_head("gated", vocab, rank, 3)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=[1.0, 1.0]), [0, 1], [0, 0])
  with pytest.raises(ValueError, match="persistent needs a vanilla head"):
    proposal.folded_block(head.arrays(), None, base, rows["anchor"], jnp.zeros((batch, gamma, 3)),
                          rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"],
                          jax.random.key(0), kind="gated", greedy_only=False, form="pallas",
                          pallas_options=PERSISTENT)
