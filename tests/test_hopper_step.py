"""The experimental Hopper (Mosaic GPU) greedy step: exact in the interpreter, lowers for CUDA."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.kernels import hopper_step
from dspark_jax.draft import block as proposal
from tests import helpers, stats

CPU = jax.default_backend() == "cpu"  # there the kernel runs in Mosaic GPU's interpreter


def _inputs(batch, rank, vocab, gamma=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  v = jax.random.normal(keys[0], (batch, rank)).astype(jnp.bfloat16)
  w2 = (0.3 * jax.random.normal(keys[1], (rank, vocab))).astype(jnp.bfloat16)
  base = jax.random.normal(keys[2], (batch, gamma, vocab)).astype(jnp.bfloat16)
  return v, w2, base


@pytest.mark.parametrize("batch,stages,reverse", [(64, 1, False), (64, 2, False), (128, 3, False),
                                                 (64, 2, True)])
def test_partials_are_the_rounded_logits_max_and_first_argmax_per_instance(batch, stages, reverse):
  # V = 640 = ten 64-column tiles over 4 instances: instance p visits tiles p, p + 4, p + 8, the
  # last tile (9) standing in for those past it; reversed, tiles 9 - p, 5 - p, 1 - p, tile 0
  # standing in for those below it. Rows 0-1 tie exactly across two tiles of one instance (tiles
  # 1 and 9, or 4 and 0 reversed) and within one tile: the first column must win whichever tile
  # comes first. Exact in the interpreter (CPU); on a GPU, to the tensor cores' summation order.
  rank, vocab, programs = 64, 640, 4
  v, w2, base = _inputs(batch, rank, vocab)
  v = v.at[:2].set(0)                        # rows 0-1: corrected = base exactly
  base = base.at[:2, 1].set(0).at[0, 1, [70, 585]].set(5.0).at[1, 1, [3, 9, 259]].set(2.0)
  program_max, program_argmax = hopper_step.greedy_partials(
      v, w2, base, step=1, stages=stages, programs=programs, reverse=reverse, interpret=CPU)
  assert program_max.shape == program_argmax.shape == (programs, batch)
  x = (base[:, 1].astype(jnp.float32) + jnp.dot(v, w2, preferred_element_type=jnp.float32))
  x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  tokens = np.asarray(hopper_step.tokens(program_max, program_argmax))
  assert tokens[0] == 70 and tokens[1] == 3
  walk = (lambda t: max(9 - t, 0)) if reverse else (lambda t: min(t, 9))
  columns = [np.sort(np.concatenate([np.arange(64 * walk(t), 64 * walk(t) + 64)
                                     for t in range(p, 12, programs)]))
             for p in range(programs)]           # instance p's columns, in column order
  want_max = np.stack([x[:, c].max(-1) for c in columns])
  want_argmax = np.stack([c[x[:, c].argmax(-1)] for c in columns])
  if not CPU:  # the tensor cores sum v @ W2 in another order: one bf16 ulp, rare near-tie flips
    np.testing.assert_allclose(np.asarray(program_max), want_max, rtol=2**-7)
    assert np.mean(tokens == x.argmax(-1)) >= 0.9
    return
  np.testing.assert_array_equal(np.asarray(program_max), want_max)
  np.testing.assert_array_equal(np.asarray(program_argmax), want_argmax)
  np.testing.assert_array_equal(tokens, x.argmax(-1))


def test_rejects_shapes_it_cannot_run():
  v, w2, base = _inputs(64, 64, 640)
  with pytest.raises(ValueError, match="^v: "):
    hopper_step.greedy_partials(v[:32], w2, base[:32], step=0, interpret=CPU)
  with pytest.raises(ValueError, match="^tile: "):
    hopper_step.greedy_partials(v, w2, base, step=0, tile=96, interpret=CPU)
  # The sampling kernel pads a batch below 64 rows in multiples of 8, on one warpgroup.
  sampling = functools.partial(hopper_step.sampling_partials, w2=w2, corrected=None, step=0,
                               interpret=CPU)
  with pytest.raises(ValueError, match=r"^v: expected \[12, r\] with the batch a multiple of 64, "
                                       "or of 8 below it"):
    sampling(v[:12], base_logits=base[:12], temperature=jnp.ones(12), greedy=jnp.zeros(12))
  with pytest.raises(ValueError, match="^consumers: expected 1, or 2 with B a multiple of 128"):
    sampling(v[:8], base_logits=base[:8], temperature=jnp.ones(8), greedy=jnp.zeros(8),
             consumers=2)


def test_w2_parts_are_w2_part_by_part_and_kernels_check_w2():
  # `prepare_head_arrays` adds W2 as [V/64, r, 64] (part p: columns 64p .. 64p + 63) to a new
  # dict; a kernel refuses a W2 of any other shape, naming it, and the greedy kernel refuses
  # parts when its tiles are not 64 columns wide.
  v, w2, base = _inputs(64, 64, 640)
  arrays = {"w1": jnp.zeros((640, 64), jnp.bfloat16), "w2": w2}
  prepared = proposal.prepare_head_arrays(arrays)
  assert set(arrays) == {"w1", "w2"} and prepared["w2"] is w2
  parts = np.asarray(prepared["w2_parts"], np.float32)
  assert parts.shape == (10, 64, 64)
  np.testing.assert_array_equal(parts[3, :, 5], np.asarray(w2[:, 3 * 64 + 5], np.float32))
  with pytest.raises(ValueError, match=r"^w2: expected \[64, 640\] \(128-column copies\)"):
    hopper_step.greedy_partials(v, parts, base, step=0, tile=128, interpret=CPU)
  with pytest.raises(ValueError, match=r"^w2: expected \[64, 640\] or \[10, 64, 64\]"):
    hopper_step.sampling_partials(v, w2[:, :512], base, None, jnp.ones(64), jnp.zeros(64),
                                  step=0, interpret=CPU)
  with pytest.raises(ValueError, match="^w2: V = 600"):
    hopper_step.w2_parts(w2[:, :600])


def test_lowers_for_cuda_at_the_benchmark_shape():
  # B = 128, r = 256, V = 129280, bf16: the kernel must trace and lower for a GPU (no GPU needed).
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  lowered = jax.jit(hopper_step.greedy_partials, static_argnames=("step", "programs")).trace(
      spec((128, 256), jnp.bfloat16), spec((256, 129280), jnp.bfloat16),
      spec((128, 7, 129280), jnp.bfloat16), step=3, programs=132).lower(
          lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("kind,prepared", [("vanilla", False), ("gated", True)])
def test_hopper_form_equals_the_loop(kind, prepared):
  # Greedy-only blocks through `proposal.folded_block(pallas_options=hopper)`, B = 64, V = 640:
  # tokens and confidence equal the loop form's bit for bit in the interpreter (on a GPU the two
  # sum v @ W2 in different orders: the edge rows must agree, the rest nearly all), with rows of
  # NaN, -inf and an exact tie across tiles (the kernel's integer keys). The gated head's block
  # walks step 1's tiles backwards (``serpentine``) and reads W2 part by part
  # (`proposal.prepare_head_arrays`).
  batch, gamma, vocab, rank, hidden = 64, 2, 640, 64, 6
  head = helpers.make_head(kind, vocab, rank, hidden)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  rng = np.random.default_rng(4)
  base = rng.normal(0, 2, (batch, gamma, vocab)).astype(np.float32)
  base[0] = -np.inf
  base[1, :, [100, 500]] = np.nan
  base[2:4] = 0.0
  base[2:4, :, [70, 630]] = 60.0          # an exact tie between the second and the last tile ...
  w2 = 0.1 * head.arrays()["w2"]
  arrays = dict(head.arrays(), w2=w2.at[:, 630].set(w2[:, 70]))  # ... with the same bias
  if not CPU:  # the kernel's tensor cores take 16-bit operands
    arrays = {name: a.astype(jnp.bfloat16) for name, a in arrays.items()}
  if prepared:
    arrays = proposal.prepare_head_arrays(arrays)
  h = jnp.asarray(rng.normal(0, 1, (batch, gamma, hidden)), jnp.float32)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.zeros(batch)), np.arange(batch),
                               np.arange(batch) * 3)
  outs = [proposal.folded_block(
      arrays, conf.arrays(), jnp.asarray(base).astype(jnp.bfloat16), rows["anchor"], h,
      rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(0),
      kind=kind, greedy_only=True, form=form, pallas_options=options)
      for form, options in (("loop", ()),
                            ("pallas", (("hopper", True), ("serpentine", kind == "gated"))))]
  loop_tokens, tokens = np.asarray(outs[0][0]), np.asarray(outs[1][0])
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(loop_tokens, tokens)
    np.testing.assert_array_equal(np.asarray(outs[0][2]), np.asarray(outs[1][2]))
  else:
    assert np.mean(loop_tokens == tokens) >= 0.9
  assert np.all(tokens[0] == 0) and np.all(tokens[1] == 100) and np.all(tokens[2:4] == 70)


def _head_arrays(kind, vocab, rank, hidden, seed=0, scale=1.0, dtype=jnp.bfloat16):
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=seed, scale=scale)
  return {name: jnp.asarray(a, dtype) for name, a in arrays.items()}


ARGMAX = (("argmax", True),)  # the kernel, not the token choice, finds greedy rows' first argmax
PARTS = "parts"  # the head's arrays prepared: the kernel reads W2 part by part


@pytest.mark.parametrize("kind,batch,settings", [("vanilla", 64, ()), ("gated", 64, PARTS),
                                                 ("vanilla", 128, ()), ("vanilla", 64, ARGMAX),
                                                 ("gated", 128, ARGMAX), ("vanilla", 8, PARTS),
                                                 ("gated", 16, ARGMAX)])
def test_hopper_sampling_equals_the_loop(kind, batch, settings):
  # Sampling-variant blocks through `hopper_step.sampling_partials`: B = 64 (4 stages) and 128
  # (3 stages), V = 1280 (ten 128-column tiles of two 64-column parts over 4 instances), γ = 2,
  # bf16 logits, greedy rows and rows at T = 0.5, 1, 2, a confidence head. Rows 0-1 all -inf, rows 2-3 a NaN at column 1100, rows 4-5 an exact tie
  # between columns 70 and 1250 (first and last tile, same bias). Tokens, corrected logits and
  # confidence equal the loop form's bit for bit in the interpreter (a float32 head there: with
  # bf16 operands the interpreter's and XLA's dots may round one logit in 10^4 apart); on a GPU
  # (bf16 head) the tensor cores sum v @ W2 in their own order (corrected logits to bf16 rounding,
  # tokens nearly all). The gated head's block walks step 1's tiles backwards (``serpentine``).
  # By default the kernel leaves greedy rows' first argmax to the token choice, which finds it in
  # the chosen tile; `ARGMAX`: the kernel finds it. `PARTS`: W2 part by part
  # (`proposal.prepare_head_arrays`). B = 8 and 16: the kernel pads the rows to 64 in shared memory.
  gamma, vocab, rank, hidden = 2, 1280, 64, 6
  arrays = _head_arrays(kind, vocab, rank, hidden, dtype=jnp.float32 if CPU else jnp.bfloat16)
  arrays["w2"] = arrays["w2"].at[:, 1250].set(arrays["w2"][:, 70])
  if settings == PARTS:
    arrays, settings = proposal.prepare_head_arrays(arrays), ()
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  base = helpers.edge_rows(batch, gamma, vocab, nan_at=1100, tie_at=(70, 1250), seed=8,
                          tie_value=60.0)
  rng = np.random.default_rng(9)
  h = jnp.asarray(rng.normal(0, 1, (batch, gamma, hidden)), jnp.float32)
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.5, 1.0, 2.0], batch // 4),
                             seed=np.arange(batch))
  rows = proposal.block_arrays(params, np.arange(batch) * 11, np.arange(batch) * 3)
  loop, hopper = [proposal.folded_block(
      arrays, conf.arrays(), jnp.asarray(base, jnp.bfloat16), rows["anchor"], h, rows["greedy"],
      rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(2), kind=kind,
      greedy_only=False, form=form, pallas_options=options)
      for form, options in (("loop", ()),
                            ("pallas", (("hopper", True), ("serpentine", kind == "gated"))
                             + settings))]
  tokens = np.asarray(hopper[0])
  if CPU:
    for a, b in zip(loop, hopper):  # as float32: NumPy's NaN == NaN rule skips bfloat16
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  else:
    np.testing.assert_allclose(np.asarray(loop[1], np.float32), np.asarray(hopper[1], np.float32),
                               rtol=2**-7, atol=1e-6)
    assert np.mean(np.asarray(loop[0]) == tokens) >= 0.9
  assert np.all(tokens[0:2] == 0) and np.all(tokens[2:4] == 1100)
  assert np.all(tokens[4] == 70) and np.all(np.isin(tokens[5], [70, 1250]))


def _vanilla_block_law_bf16(w1, w2, base, anchor, temperature):
  """The exact law of (x1, x2) for a vanilla head whose corrected logits are rounded to bf16 (as
  the kernel stores and samples them): [V, V] float64."""
  def rounded(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float64)

  def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)
  first = softmax(rounded(base[0] + w1[anchor] @ w2) / temperature)          # [V]
  second = softmax(rounded(base[1][None, :] + w1 @ w2) / temperature)        # [V (x1), V]
  return first[:, None] * second


@pytest.mark.skipif(CPU, reason="60,000 rows are too many for the interpreter; on the CPU the "
                                "kernel equals the loop form bit for bit (test above), whose law "
                                "test_proposal checks")
def test_hopper_sampling_block_law():
  # The Hopper kernel's own law on a GPU (its exp, log and summation order are its own). N = 940
  # calls x 64 rows = 60,160 sampled rows, V = 256 (two 128-column tiles: the tile choice is
  # exercised), γ = 2: the law of (x1, x2) over 65,536 outcomes, with the corrected logits rounded
  # to bf16 as the kernel rounds them. Statistic: Pearson chi-square (bins with expected count < 5
  # pooled) against that enumerated float64 law; threshold p >= 1e-3. Power: the law at 1.15 x the
  # temperature must be rejected (p < 1e-6).
  vocab, gamma, rank, batch, calls, temperature, anchor = 256, 2, 64, 64, 940, 0.9, 3
  arrays = _head_arrays("vanilla", vocab, rank, 3, seed=5, scale=3.0)
  rng = np.random.default_rng(6)
  base = jnp.asarray(rng.normal(0, 2.5, (gamma, vocab)), jnp.bfloat16)
  tokens = []
  for call in range(calls):
    params = dj.SamplingParams(temperature=np.full(batch, temperature),
                               seed=call * batch + np.arange(batch))
    r = proposal.block_arrays(params, np.full(batch, anchor), np.full(batch, 11))
    tokens.append(np.asarray(proposal.folded_block(
        arrays, None, jnp.broadcast_to(base, (batch, gamma, vocab)), r["anchor"], None,
        r["greedy"], r["temperature"], r["seeds"], r["positions"], jax.random.key(9),
        kind="vanilla", greedy_only=False, form="pallas", pallas_options=(("hopper", True),))[0]))
  tokens = np.concatenate(tokens)
  counts = np.zeros((vocab,) * gamma)
  np.add.at(counts, tuple(tokens.T), 1)
  w1, w2 = (np.asarray(arrays[name], np.float64) for name in ("w1", "w2"))
  base64 = np.asarray(base, np.float64)
  stats.assert_law(counts, _vanilla_block_law_bf16(w1, w2, base64, anchor, temperature),
                   what="hopper block law")
  stats.assert_rejects(counts, _vanilla_block_law_bf16(w1, w2, base64, anchor, 1.15 * temperature),
                       what="hopper vs 1.15 T")


def _sampling_step(v, w2, base, temperature, greedy, step, **settings):
  """`hopper_step.sampling_partials` on 4 instances: [keys, tokens, the corrected logits it wrote
  at `step` as float32] (NumPy matches NaN with NaN in float32, not in bfloat16)."""
  def kernel():
    corrected = hopper_step.new_corrected(base.shape, base.dtype)
    keys, tokens = hopper_step.sampling_partials(v, w2, base, corrected, temperature, greedy,
                                                 step=step, programs=4, interpret=CPU, **settings)
    return keys, tokens, jax.freeze(corrected)[:, step].astype(jnp.float32)
  return [np.asarray(x) for x in jax.jit(kernel)()]


@pytest.mark.parametrize("reread", [True, False])
def test_two_consumer_sampling_kernel_equals_one_consumer(reread):
  # The 128-row form on the GPU: two warpgroups, 64 rows each, over shared W2 parts. Called
  # directly (inside a folded block the interpreter's two threads can stall on a 2-CPU host), at
  # V = 1280 (ten 128-column tiles over 4 instances), with an all -inf row, a NaN, an exact tie
  # across two tiles and greedy and sampled rows: keys, tokens and the corrected logits it writes
  # equal the one-warpgroup kernel's bit for bit in the CPU interpreter. On a GPU the tokens and
  # logits do too (the same WGMMA), and the tiles' log-masses to float32 rounding: a row's exp sum
  # is reduced across threads in another order from a [128, 64] accumulator than from [64, 64].
  batch, rank, vocab, gamma, step = 128, 64, 1280, 2, 1
  v, w2, base = _inputs(batch, rank, vocab, gamma, seed=4)
  v = v.at[:4].set(0)  # rows 0-3: corrected = base exactly
  base = base.at[0].set(-jnp.inf).at[1, :, 1100].set(jnp.nan).at[2:4, step].set(0.0)
  base = base.at[2:4, step, [70, 1250]].set(4.0)
  temperature = jnp.tile(jnp.array([0.5, 1.0, 2.0, 1.0]), batch // 4)
  greedy = (jnp.arange(batch) % 4 == 3).astype(jnp.int32)

  one, two = (_sampling_step(v, w2, base, temperature, greedy, step, consumers=consumers,
                             reread=reread) for consumers in (1, 2))
  for a, b in zip(one[1:], two[1:]):
    np.testing.assert_array_equal(a, b)
  if CPU:
    np.testing.assert_array_equal(one[0], two[0])
  else:
    np.testing.assert_allclose(one[0], two[0], rtol=1e-6, atol=1e-6)
  # The pairs are the tiles' (`fused_step` without draws): [T, B] tile-major, T = 4 instances x
  # 3 tiles each >= the 10 tiles, the rows past the last tile repeating it.
  x = one[2]  # the corrected logits the kernel wrote, [B, V] float32
  tiles = x.reshape(batch, 10, 128)
  t = np.asarray(temperature)[:, None]
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    want_max = tiles.max(axis=2)
    shift = np.where(np.isfinite(want_max), want_max, 0.0) / t
    want_mass = shift + np.log(np.exp(tiles / t[..., None] - shift[..., None]).sum(axis=2))
  greedy_rows = np.asarray(greedy)[:, None] != 0
  keys, tokens = one[0][:10].T, one[1][:10].T  # [B, tiles]
  assert one[0].shape == (12, batch) and np.array_equal(one[0][10:], np.stack([one[0][9]] * 2))
  np.testing.assert_array_equal(np.where(greedy_rows, keys, 0), np.where(greedy_rows, want_max, 0))
  # Log-masses to float32 rounding: on a GPU the kernel's exp and division are the approximate
  # instructions (ex2.approx, div.full), NumPy's differ in the last bits.
  np.testing.assert_allclose(keys[~greedy_rows[:, 0]], want_mass[~greedy_rows[:, 0]], rtol=1e-6,
                             atol=1e-5)
  first = np.where(np.isnan(tiles).any(axis=2), np.argmax(np.isnan(tiles), axis=2),
                   np.argmax(tiles, axis=2)) + 128 * np.arange(10)
  np.testing.assert_array_equal(tokens, np.where(greedy_rows, first, 128 * np.arange(10)))
  with pytest.raises(ValueError, match="consumers: expected 1, or 2 with B a multiple of 128"):
    hopper_step.sampling_partials(v[:64], w2, base[:64], None, temperature[:64], greedy[:64],
                                  step=step, consumers=2, interpret=CPU)


@pytest.mark.parametrize("consumers", [1, 2])
def test_sampling_kernel_walks_the_tiles_backwards_on_request(consumers):
  # ``reverse=True`` (the odd steps of a serpentine block): V = 1280, ten 128-column tiles over 4
  # instances (3 visits each), 128 rows with a tie across tiles 0 and 9 and greedy and sampled
  # rows. The corrected logits are the forward walk's and so are the tiles' pairs, in reverse row
  # order: row t is tile 9 - t, rows 10-11 repeat tile 0. Bit for bit (the same code per tile).
  batch, rank, vocab, gamma, step = 128, 64, 1280, 2, 1
  v, w2, base = _inputs(batch, rank, vocab, seed=5)
  v = v.at[:2].set(0)
  base = base.at[:2, step].set(0.0).at[:2, step, [70, 1250]].set(4.0)
  temperature = jnp.tile(jnp.array([0.5, 1.0, 2.0, 1.0]), batch // 4)
  greedy = (jnp.arange(batch) % 2 == 0).astype(jnp.int32)

  forward, backward = (_sampling_step(v, w2, base, temperature, greedy, step, consumers=consumers,
                                      reverse=reverse) for reverse in (False, True))
  np.testing.assert_array_equal(forward[2], backward[2])
  for a, b in zip(forward[:2], backward[:2]):
    np.testing.assert_array_equal(a[:10], b[:10][::-1])
    np.testing.assert_array_equal(b[10:], np.stack([b[9]] * 2))
  assert forward[1][0, 0] == 70 and forward[1][9, 0] == 1250  # the tie: a greedy row's tiles


@pytest.mark.parametrize("consumers,stages", [(1, 3), (2, 3)])
def test_sampling_kernel_overlapping_products_changes_nothing(consumers, stages):
  # ``overlap=True`` starts both parts' products of a tile before the first part's epilogue (two
  # accumulators) and refills a slot after its part instead of before the next: the same values
  # in a different order of work. V = 768 (six tiles over 4 instances, 2 visits each, the last
  # tile revisited), 128 rows with a -inf row, a NaN and greedy and sampled rows, the fewest
  # stages it takes: keys, tokens and corrected logits equal the kernel's without, bit for bit.
  batch, rank, vocab, gamma, step = 128, 64, 768, 2, 1
  v, w2, base = _inputs(batch, rank, vocab, gamma, seed=6)
  base = base.at[0].set(-jnp.inf).at[1, :, 700].set(jnp.nan)
  temperature = jnp.tile(jnp.array([0.5, 1.0, 2.0, 1.0]), batch // 4)
  greedy = (jnp.arange(batch) % 4 == 3).astype(jnp.int32)
  plain, overlapped = (_sampling_step(v, w2, base, temperature, greedy, step, stages=stages,
                                      consumers=consumers, overlap=overlap)
                       for overlap in (False, True))
  for a, b in zip(plain, overlapped):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="stages: overlap needs >= 3"):
    _sampling_step(v, w2, base, temperature, greedy, step, stages=2, consumers=consumers,
                   overlap=True)


def test_hopper_sampling_rejects_stages_shared_memory_cannot_hold():
  # 128 rows at r = 256 fit three stages of 64-column parts (`sampling_stages`), not four.
  assert hopper_step.sampling_stages(128, 256) == 3 and hopper_step.sampling_stages(64, 256) == 4
  arrays = _head_arrays("vanilla", 1280, 256, 3)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.ones(128)), np.arange(128),
                               np.zeros(128))
  with pytest.raises(ValueError, match="^v: 128 rows with r = 256 and 4 stages need"):
    proposal.folded_block(arrays, None, jnp.zeros((128, 2, 1280), jnp.bfloat16), rows["anchor"],
                          None, rows["greedy"], rows["temperature"], rows["seeds"],
                          rows["positions"], jax.random.key(0), kind="vanilla", greedy_only=False,
                          form="pallas", pallas_options=(("hopper", True), ("stages", 4)))


@pytest.mark.parametrize("batch,reverse,settings", [
    (64, False, {}), (128, False, {}), (128, True, {}),
    (64, False, {"overlap": False, "argmax": False}),
    (128, True, {"overlap": True, "argmax": False}), (128, True, {"parts": True}),
    (8, True, {"parts": True, "argmax": False})])
def test_sampling_kernel_lowers_for_cuda_at_the_benchmark_shape(batch, reverse, settings):
  # r = 256, V = 129280, bf16, the corrected logits a mutable buffer updated in place; `reverse`:
  # an odd step of a serpentine block; `parts`: W2 part by part (`hopper_step.w2_parts`); B = 8:
  # the rows padded to 64 in shared memory.
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  rank, vocab, gamma = 256, 129280, 7
  settings = dict(settings)
  w2_shape = (vocab // 64, rank, 64) if settings.pop("parts", False) else (rank, vocab)

  def step(v, w2, base, temperature, greedy):
    corrected = hopper_step.new_corrected(base.shape, base.dtype)
    pairs = hopper_step.sampling_partials(v, w2, base, corrected, temperature, greedy, step=3,
                                          programs=132, reverse=reverse, **settings)
    return pairs, jax.freeze(corrected)
  lowered = jax.jit(step).trace(
      spec((batch, rank), jnp.bfloat16), spec(w2_shape, jnp.bfloat16),
      spec((batch, gamma, vocab), jnp.bfloat16), spec((batch,), jnp.float32),
      spec((batch,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_hopper_by_default_only_where_it_was_measured_to_win():
  hopper_gpu = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
  bf16 = jnp.bfloat16
  assert proposal.hopper_by_default(128, 129280, bf16, bf16, hopper_gpu)
  assert proposal.hopper_by_default(256, 151936, bf16, bf16, hopper_gpu)
  assert not proposal.hopper_by_default(64, 129280, bf16, bf16, hopper_gpu)   # slower at 64 rows
  assert not proposal.hopper_by_default(160, 129280, bf16, bf16, hopper_gpu)  # not 64-row blocks
  # Sampling: one warpgroup of 64 rows or two, and shared memory for two stages (128 rows at
  # r = 256).
  sampled = functools.partial(proposal.hopper_by_default, greedy_only=False, rank=256)
  assert sampled(128, 129280, bf16, bf16, hopper_gpu) and sampled(128, 151936, bf16, bf16, hopper_gpu)
  assert sampled(64, 129280, bf16, bf16, hopper_gpu) and sampled(64, 151936, bf16, bf16, hopper_gpu)
  assert not sampled(8, 129280, bf16, bf16, hopper_gpu)     # the Triton kernel below 64 rows
  assert not sampled(192, 129280, bf16, bf16, hopper_gpu)   # three row blocks: not measured
  assert not sampled(256, 129280, bf16, bf16, hopper_gpu)   # v does not fit shared memory
  assert not sampled(128, 129344, bf16, bf16, hopper_gpu)   # 64-column sampler tiles (64 x 2021)
  assert not proposal.hopper_by_default(128, 129281, bf16, bf16, hopper_gpu)  # no 64-column tiles
  assert not proposal.hopper_by_default(128, 129280, jnp.float32, bf16, hopper_gpu)  # TF32 WGMMA
  assert not proposal.hopper_by_default(128, 129280, bf16, jnp.float32, hopper_gpu)
  ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
  assert not proposal.hopper_by_default(128, 129280, bf16, bf16, ampere)
  cpu = types.SimpleNamespace(platform="cpu")
  assert not proposal.hopper_by_default(128, 129280, bf16, bf16, cpu)


def test_hopper_form_names_a_setting_it_does_not_take():
  head = helpers.make_head("vanilla", 640, 64, 3)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.zeros(64)), np.arange(64),
                               np.zeros(64))
  with pytest.raises(ValueError, match="^pallas_options: 'num_warps' is not a setting"):
    proposal.folded_block(head.arrays(), None, jnp.zeros((64, 2, 640)), rows["anchor"], None,
                          rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"],
                          jax.random.key(0), kind="vanilla", greedy_only=True, form="pallas",
                          pallas_options=(("hopper", True), ("num_warps", 8)))


@pytest.mark.parametrize("form", ["keep", "io", "tiled", "choice", "split"])
def test_resident_probe_kernels_lower_for_cuda(form):
  # `scripts/resident_probe.py` (issue 6, version 38): one persistent kernel for all steps, with a
  # grid-wide barrier of global semaphores, which Mosaic GPU's CPU interpreter does not run (the
  # probe ran on an H200). Here each of its forms must still trace and lower for a GPU.
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "scripts" / "resident_probe.py"
  spec_ = importlib.util.spec_from_file_location("resident_probe", path)
  probe = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(probe)
  rows, rank, vocab, gamma, programs = 64, 64, 1280, 2, 4
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  v, w2 = spec((rows, rank)), spec((vocab // 64, rank, 64))
  base = {"io": spec((rows, gamma, vocab)), "tiled": spec((gamma, vocab // 64, rows, 64)),
          "split": spec((rows, gamma, vocab))}.get(form)
  if form == "split":
    run = functools.partial(probe.split_steps, stages=2, programs=programs, gamma=gamma)
  else:
    run = functools.partial(probe.resident_steps, keep=2 if form == "keep" else 0, stages=2,
                            programs=programs, gamma=gamma)
    if form == "choice":
      run = functools.partial(run, w1=jnp.zeros((vocab, rank), jnp.bfloat16))
  lowered = jax.jit(run).trace(v, w2, base).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
