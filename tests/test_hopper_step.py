"""The Hopper (Mosaic GPU) step kernels and the Hopper backend's blocks: in Mosaic GPU's interpreter
on the CPU (marked ``kernel``), lowering for CUDA, and the block law on a GPU (marked ``gpu``).

Bit equality is asserted only where it is guaranteed on every host: integer and selection logic
on identical values, and kernel outputs whose float inputs are exact in any summation order.
Blocks of differently compiled programs (the XLA backend against the kernels, one kernel form
against another) are compared with `helpers.assert_blocks_agree`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import hopper_step
from dspark_jax.kernels import pallas_block
from tests import helpers, stats

CPU = jax.default_backend() == "cpu"  # there the kernel runs in Mosaic GPU's interpreter
BF16_ULP = 2.0 ** -7  # one unit in the last place of a bfloat16, relative


def _inputs(batch, rank, vocab, gamma=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  v = jax.random.normal(keys[0], (batch, rank)).astype(jnp.bfloat16)
  w2 = (0.3 * jax.random.normal(keys[1], (rank, vocab))).astype(jnp.bfloat16)
  base = jax.random.normal(keys[2], (batch, gamma, vocab)).astype(jnp.bfloat16)
  return v, w2, base


def _exact_inputs(batch, rank, vocab, gamma=2, seed=0):
  """Like `_inputs`, with v integers in [-2, 2] and W2 multiples of 1/16 in [-1, 1]: every partial
  sum of ``v @ W2`` is exact in float32, so the product is the same in any summation order (the
  interpreter's, XLA's, the tensor cores'), and ``U + v @ W2`` is one rounding."""
  rng = np.random.default_rng(seed)
  v = jnp.asarray(rng.integers(-2, 3, (batch, rank)), jnp.bfloat16)
  w2 = jnp.asarray(np.clip(np.round(rng.normal(0, 0.3, (rank, vocab)) * 16), -16, 16) / 16,
                   jnp.bfloat16)
  base = jnp.asarray(rng.normal(0, 4, (batch, gamma, vocab)), jnp.bfloat16)
  return v, w2, base


def _assert_within_one_ulp(a, b, what):
  """float32 [B, V] views of two bfloat16 arrays: NaN where NaN, equal infinities, finite values
  within one bfloat16 unit in the last place. Returns [B] bool: the rows that are bit-equal."""
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what}: NaN positions")
  finite = np.isfinite(a) & np.isfinite(b)
  infinite = ~finite & ~np.isnan(a)
  np.testing.assert_array_equal(a[infinite], b[infinite], err_msg=f"{what}: infinities")
  scale = np.maximum(np.abs(a[finite]), np.abs(b[finite]))
  assert np.all(np.abs(a[finite] - b[finite]) <= BF16_ULP * scale), f"{what}: more than one ulp"
  return np.all((a == b) | (np.isnan(a) & np.isnan(b)), axis=tuple(range(1, a.ndim)))


@pytest.mark.kernel
@pytest.mark.parametrize("batch,stages,reverse", [(64, 1, False), (64, 2, False), (128, 3, False),
                                                 (64, 2, True)])
def test_partials_are_the_rounded_logits_max_and_first_argmax_per_instance(batch, stages, reverse):
  # V = 640 = ten 64-column tiles over 4 instances: instance p visits tiles p, p + 4, p + 8, the
  # last tile (9) standing in for those past it; reversed, tiles 9 - p, 5 - p, 1 - p, tile 0
  # standing in for those below it. Rows 0-1 tie exactly across two tiles of one instance (tiles
  # 1 and 9, or 4 and 0 reversed) and within one tile: the first column must win whichever tile
  # comes first. v @ W2 is exact in any summation order (`_exact_inputs`, which also make exact
  # ties after rounding to bf16 common), so the kernel's pairs equal the reference's bit for bit
  # on every host and on the GPU's tensor cores.
  rank, vocab, programs = 64, 640, 4
  v, w2, base = _exact_inputs(batch, rank, vocab)
  v = v.at[:2].set(0)                        # rows 0-1: corrected = base exactly
  base = base.at[:2, 1].set(0).at[0, 1, [70, 585]].set(50.0).at[1, 1, [3, 9, 259]].set(40.0)
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
  np.testing.assert_array_equal(np.asarray(program_max), want_max)
  np.testing.assert_array_equal(np.asarray(program_argmax), want_argmax)
  np.testing.assert_array_equal(tokens, x.argmax(-1))


def test_rejects_shapes_it_cannot_run():
  v, w2, base = _inputs(64, 64, 640)
  with pytest.raises(ValueError, match="^v: "):
    hopper_step.greedy_partials(v[:32], w2, base[:32], step=0, interpret=CPU)
  with pytest.raises(ValueError, match="^tile: "):
    hopper_step.greedy_partials(v, w2, base, step=0, tile=96, interpret=CPU)
  # The sampling kernel takes whole 64-row blocks (the padded step below 64 rows is gone).
  v2, w2_2, base2 = _inputs(128, 64, 1280)
  sampling = functools.partial(hopper_step.sampling_partials, w2=w2_2, corrected=None, step=0,
                               interpret=CPU)
  for rows in (8, 12, 16):
    with pytest.raises(ValueError, match=rf"^v: expected \[{rows}, r\] with the batch a multiple "
                                         "of 64"):
      sampling(v2[:rows], base_logits=base2[:rows], temperature=jnp.ones(rows),
               greedy=jnp.zeros(rows))
  with pytest.raises(ValueError, match="^consumers: expected 1, or 2 with B a multiple of 128"):
    sampling(v2[:64], base_logits=base2[:64], temperature=jnp.ones(64), greedy=jnp.zeros(64),
             consumers=2)


def test_w2_parts_are_w2_part_by_part_and_kernels_check_w2():
  # `pallas_block.prepare_head_arrays` adds W2 as [V/64, r, 64] (part p: columns 64p .. 64p + 63)
  # to a new dict; a kernel refuses a W2 of any other shape, naming it, and the greedy kernel
  # refuses parts when its tiles are not 64 columns wide.
  v, w2, base = _inputs(64, 64, 640)
  arrays = {"w1": jnp.zeros((640, 64), jnp.bfloat16), "w2": w2}
  prepared = pallas_block.prepare_head_arrays(arrays)
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




def _head_arrays(kind, vocab, rank, hidden, seed=0, scale=1.0, dtype=jnp.bfloat16):
  arrays = helpers.head_arrays(kind, vocab, rank, hidden, seed=seed, scale=scale)
  return {name: jnp.asarray(a, dtype) for name, a in arrays.items()}


def _xla_and_hopper_blocks(arrays, conf, base, rows, h, key, *, kind, greedy_only, config):
  """The same block from the XLA backend and from the Hopper backend (`config`), in Mosaic GPU's
  interpreter on the CPU: two ``(tokens, corrected, confidence)`` triples."""
  run = functools.partial(
      proposal.folded_block, arrays, conf, jnp.asarray(base, jnp.bfloat16), rows["anchor"], h,
      rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"], key, kind=kind,
      greedy_only=greedy_only)
  return run(backend="xla"), run(backend="hopper", config=config)


def _assert_confidence_agrees(xla, hopper):
  """Confidence is computed by XLA on both backends, from the drafted tokens: equal to float32
  rounding on every row that drafted the same tokens."""
  same = np.all(np.asarray(xla[0]) == np.asarray(hopper[0]), axis=1)
  np.testing.assert_allclose(np.asarray(xla[2])[same], np.asarray(hopper[2])[same], rtol=1e-5,
                             atol=1e-6)


@pytest.mark.kernel
@pytest.mark.parametrize("kind,prepared", [("vanilla", False), ("gated", True)])
def test_hopper_greedy_block_agrees_with_xla(kind, prepared):
  # Greedy-only blocks on the Hopper backend, B = 64, V = 640, bf16: the same tokens as the XLA
  # backend's up to near-ties (`assert_blocks_agree`: the kernel sums v @ W2 in its own order),
  # with rows of -inf, NaN and an exact tie across tiles (the kernel's integer keys) that must
  # come out exactly, and the confidence of every row that drafted the same tokens. The gated
  # head's block walks step 1's tiles backwards (``serpentine``) and reads W2 part by part
  # (`pallas_block.prepare_head_arrays`).
  batch, gamma, vocab, rank, hidden = 64, 2, 640, 64, 6
  arrays = _head_arrays(kind, vocab, rank, hidden, dtype=jnp.float32)
  w2 = 0.1 * arrays["w2"]
  arrays = dict(arrays, w2=w2.at[:, 630].set(w2[:, 70]))  # the tie's columns: the same bias ...
  arrays = {name: a.astype(jnp.bfloat16) for name, a in arrays.items()}
  if prepared:
    arrays = pallas_block.prepare_head_arrays(arrays)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  rng = np.random.default_rng(4)
  base = rng.normal(0, 2, (batch, gamma, vocab)).astype(np.float32)
  base[0] = -np.inf
  base[1, :, [100, 500]] = np.nan
  base[2:4] = 0.0
  base[2:4, :, [70, 630]] = 60.0          # ... and an exact tie between the second and last tile
  h = jnp.asarray(rng.normal(0, 1, (batch, gamma, hidden)), jnp.float32)
  rows = proposal.block_arrays(dj.SamplingParams(temperature=np.zeros(batch)), np.arange(batch),
                               np.arange(batch) * 3)
  xla, hopper = _xla_and_hopper_blocks(
      arrays, conf.arrays(), base, rows, h, jax.random.key(0), kind=kind, greedy_only=True,
      config=dispatch.HopperConfig(serpentine=kind == "gated"))
  helpers.assert_blocks_agree(xla, hopper, what=f"hopper greedy block ({kind})")
  _assert_confidence_agrees(xla, hopper)
  tokens = np.asarray(hopper[0])
  assert np.all(tokens[0] == 0) and np.all(tokens[1] == 100) and np.all(tokens[2:4] == 70)


@pytest.mark.kernel
@pytest.mark.parametrize("kind,batch,prepared,serpentine", [
    ("vanilla", 64, False, False), ("gated", 64, True, True), ("vanilla", 128, True, True),
    ("gated", 128, False, False)])
@pytest.mark.slow
def test_hopper_sampling_block_agrees_with_xla(kind, batch, prepared, serpentine):
  # Sampling-variant blocks on the Hopper backend: B = 64 and 128 (one warpgroup), V = 1280
  # (ten 128-column tiles of two 64-column parts over 4 instances), γ = 2, bf16 head and logits,
  # greedy rows and rows at T = 0.5, 1, 2, a confidence head. Rows 0-1 all -inf, rows 2-3 a NaN at
  # column 1100, rows 4-5 an exact tie between columns 70 and 1250 (first and last tile, same
  # bias). The kernel sums v @ W2 in its own order, so against the XLA backend
  # (`assert_blocks_agree`): corrected logits within one bf16 ulp, equal tokens wherever a step's
  # logits are bit-equal, the edge rows exactly. `serpentine`: odd steps walk the tiles backwards;
  # `prepared`: W2 part by part (`pallas_block.prepare_head_arrays`).
  gamma, vocab, rank, hidden = 2, 1280, 64, 6
  arrays = _head_arrays(kind, vocab, rank, hidden)
  arrays["w2"] = arrays["w2"].at[:, 1250].set(arrays["w2"][:, 70])
  if prepared:
    arrays = pallas_block.prepare_head_arrays(arrays)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(hidden + rank, gamma))
  base = helpers.edge_rows(batch, gamma, vocab, nan_at=1100, tie_at=(70, 1250), seed=8,
                           tie_value=60.0)
  rng = np.random.default_rng(9)
  h = jnp.asarray(rng.normal(0, 1, (batch, gamma, hidden)), jnp.float32)
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.5, 1.0, 2.0], batch // 4),
                             seed=np.arange(batch))
  rows = proposal.block_arrays(params, np.arange(batch) * 11, np.arange(batch) * 3)
  xla, hopper = _xla_and_hopper_blocks(
      arrays, conf.arrays(), base, rows, h, jax.random.key(2), kind=kind, greedy_only=False,
      config=dispatch.HopperConfig(serpentine=serpentine))
  helpers.assert_blocks_agree(xla, hopper, what=f"hopper sampling block ({kind}, B = {batch})")
  _assert_confidence_agrees(xla, hopper)
  tokens = np.asarray(hopper[0])
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


@pytest.mark.gpu
@pytest.mark.kernel
def test_hopper_sampling_block_law():
  # The Hopper kernel's own law on a GPU (its exp, log and summation order are its own; 60,000
  # rows are too many for the interpreter, where the blocks agree with the XLA backend's, whose
  # law test_proposal checks). N = 940 calls x 64 rows = 60,160 sampled rows, V = 256 (two
  # 128-column tiles: the tile choice is exercised), γ = 2: the law of (x1, x2) over 65,536
  # outcomes, with the corrected logits rounded to bf16 as the kernel rounds them. Statistic:
  # Pearson chi-square (bins with expected count < 5 pooled) against that enumerated float64 law;
  # threshold p >= 1e-3. Power: the law at 1.15 x the temperature must be rejected (p < 1e-6).
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
        kind="vanilla", greedy_only=False, backend="hopper")[0]))
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
  """`hopper_step.sampling_partials` on 4 instances: (keys, tokens or None, the corrected logits it
  wrote at `step` as float32) (NumPy matches NaN with NaN in float32, not in bfloat16)."""
  def kernel():
    corrected = hopper_step.new_corrected(base.shape, base.dtype)
    pairs = hopper_step.sampling_partials(v, w2, base, corrected, temperature, greedy,
                                          step=step, programs=4, interpret=CPU, **settings)
    keys, tokens = pairs if isinstance(pairs, tuple) else (pairs, None)
    return keys, tokens, jax.freeze(corrected)[:, step].astype(jnp.float32)
  keys, tokens, corrected = jax.jit(kernel)()
  return np.asarray(keys), None if tokens is None else np.asarray(tokens), np.asarray(corrected)


def _sampling_inputs(batch, rank, vocab, gamma, step, seed):
  """`_inputs` with rows 0-3 v = 0 (corrected = base exactly), row 0 all -inf, a NaN at column 1100
  of row 1, an exact tie between columns 70 and 1250 (first and last tile) in rows 2-3 at `step`;
  temperatures 0.5, 1, 2, 1 and every fourth row greedy."""
  v, w2, base = _inputs(batch, rank, vocab, gamma, seed=seed)
  v = v.at[:4].set(0)
  base = base.at[0].set(-jnp.inf).at[1, :, 1100].set(jnp.nan).at[2:4, step].set(0.0)
  base = base.at[2:4, step, [70, 1250]].set(4.0)
  temperature = jnp.tile(jnp.array([0.5, 1.0, 2.0, 1.0]), batch // 4)
  greedy = (jnp.arange(batch) % 4 == 3).astype(jnp.int32)
  return v, w2, base, temperature, greedy


def _assert_pairs_are_the_tiles(out, temperature, greedy, tiles=10, tile=128):
  """`sampling_partials`' pairs are those of the corrected logits it wrote: [T, B] tile-major,
  T = 4 instances x 3 tiles each >= the 10 tiles, the rows past the last tile repeating it; a
  greedy row's key is its tile's max (exact: a selection), its token the tile's first argmax; a
  sampled row's key the tile's log-mass (to float32 rounding: on a GPU the kernel's exp and
  division are the approximate instructions), its token the tile's first column."""
  keys_all, tokens_all, x = out
  batch = x.shape[0]
  assert keys_all.shape == (12, batch) and np.array_equal(keys_all[10:],
                                                          np.stack([keys_all[9]] * 2))
  per_tile = x.reshape(batch, tiles, tile)
  t = np.asarray(temperature)[:, None]
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    want_max = per_tile.max(axis=2)
    shift = np.where(np.isfinite(want_max), want_max, 0.0) / t
    want_mass = shift + np.log(np.exp(per_tile / t[..., None] - shift[..., None]).sum(axis=2))
  greedy_rows = np.asarray(greedy) != 0
  keys = keys_all[:tiles].T  # [B, tiles]
  np.testing.assert_array_equal(keys[greedy_rows], want_max[greedy_rows])
  np.testing.assert_allclose(keys[~greedy_rows], want_mass[~greedy_rows], rtol=1e-6, atol=1e-5)
  if tokens_all is not None:
    first = np.where(np.isnan(per_tile).any(axis=2), np.argmax(np.isnan(per_tile), axis=2),
                     np.argmax(per_tile, axis=2)) + tile * np.arange(tiles)
    np.testing.assert_array_equal(tokens_all[:tiles].T,
                                  np.where(greedy_rows[:, None], first, tile * np.arange(tiles)))


def _assert_pairs_agree(a, b, same, greedy, what):
  """Two kernel forms' [T, B] pairs on rows `same` (whose corrected logits are bit-equal): greedy
  rows' keys and all tokens equal (selection on equal values), sampled rows' log-masses to float32
  rounding (a form may sum a tile's exp in another order)."""
  greedy_rows = np.asarray(greedy) != 0
  np.testing.assert_array_equal(a[0][:, same & greedy_rows], b[0][:, same & greedy_rows],
                                err_msg=f"{what}: greedy keys")
  np.testing.assert_allclose(a[0][:, same & ~greedy_rows], b[0][:, same & ~greedy_rows],
                             rtol=1e-6, atol=1e-6, err_msg=f"{what}: log-masses")
  if a[1] is not None:
    np.testing.assert_array_equal(a[1][:, same], b[1][:, same], err_msg=f"{what}: tokens")


@pytest.mark.slow  # the two-warpgroup kernel in the interpreter: 8-17 s on 2 cores
@pytest.mark.kernel
def test_two_consumer_sampling_kernel_agrees_with_one_consumer():
  # The 128-row form on the GPU: two warpgroups, 64 rows each, over shared W2 parts. Called
  # directly (inside a folded block the interpreter's two threads can stall on a 2-CPU host), at
  # V = 1280 (ten 128-column tiles over 4 instances), with an all -inf row, a NaN, an exact tie
  # across two tiles and greedy and sampled rows. Each form's pairs are its own logits' tiles'
  # (`_assert_pairs_are_the_tiles`); against each other (one [128, r] product against two
  # [64, r] ones): corrected logits within one bf16 ulp, and on rows whose logits are bit-equal
  # the same pairs (`_assert_pairs_agree`).
  batch, rank, vocab, gamma, step = 128, 64, 1280, 2, 1
  v, w2, base, temperature, greedy = _sampling_inputs(batch, rank, vocab, gamma, step, seed=4)
  one, two = (_sampling_step(v, w2, base, temperature, greedy, step, consumers=consumers)
              for consumers in (1, 2))
  same = _assert_within_one_ulp(one[2], two[2], "corrected logits, 1 vs 2 consumers")
  assert same.mean() >= 0.5 and same[:4].all()  # rows 0-3: corrected = base
  _assert_pairs_agree(one, two, same, greedy, "1 vs 2 consumers")
  for out in (one, two):
    _assert_pairs_are_the_tiles(out, temperature, greedy)
  if one[1] is not None:  # the tie (a greedy row): the first column
    assert one[1][0, 3] == 70 and one[1][9, 3] == 1250
  with pytest.raises(ValueError, match="consumers: expected 1, or 2 with B a multiple of 128"):
    hopper_step.sampling_partials(v[:64], w2, base[:64], None, temperature[:64], greedy[:64],
                                  step=step, consumers=2, interpret=CPU)


@pytest.mark.kernel
@pytest.mark.parametrize("consumers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sampling_kernel_walks_the_tiles_backwards_on_request(consumers):
  # ``reverse=True`` (the odd steps of a serpentine block): V = 1280, ten 128-column tiles over 4
  # instances (3 visits each), 128 rows with a tie across tiles 0 and 9 and greedy and sampled
  # rows. The corrected logits are the forward walk's (within one bf16 ulp: another compiled
  # program) and so are the tiles' pairs on bit-equal rows, in reverse row order: row t is tile
  # 9 - t, rows 10-11 repeat tile 0.
  batch, rank, vocab, gamma, step = 128, 64, 1280, 2, 1
  v, w2, base, temperature, greedy = _sampling_inputs(batch, rank, vocab, gamma, step, seed=5)
  forward, backward = (_sampling_step(v, w2, base, temperature, greedy, step, consumers=consumers,
                                      reverse=reverse) for reverse in (False, True))
  same = _assert_within_one_ulp(forward[2], backward[2], "corrected logits, reversed")
  assert same.mean() >= 0.5 and same[:4].all()
  unreversed = tuple(None if a is None else a[:10][::-1] for a in backward[:2])
  _assert_pairs_agree(tuple(None if a is None else a[:10] for a in forward[:2]), unreversed, same,
                      greedy, "reversed walk")
  for a in backward[:2]:
    if a is not None:
      np.testing.assert_array_equal(a[10:], np.stack([a[9]] * 2))
  _assert_pairs_are_the_tiles(forward, temperature, greedy)
  if forward[1] is not None:  # the tie, in a greedy row: each tile's first column
    assert forward[1][0, 3] == 70 and forward[1][9, 3] == 1250


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
                          backend="hopper", config=dispatch.HopperConfig(stages=4))


def test_hopper_backend_names_what_it_cannot_take():
  # Before anything runs: a config of another backend, and each precondition the arrays fail.
  def block(arrays, batch=64, vocab=640, dtype=jnp.bfloat16, **kwargs):
    rows = proposal.block_arrays(dj.SamplingParams(temperature=np.zeros(batch)), np.arange(batch),
                                 np.zeros(batch))
    return proposal.folded_block(
        arrays, None, jnp.zeros((batch, 2, vocab), dtype), rows["anchor"], None, rows["greedy"],
        rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(0), kind="vanilla",
        greedy_only=True, backend="hopper", **kwargs)
  arrays = _head_arrays("vanilla", 640, 64, 3)
  with pytest.raises(ValueError, match="^config: TritonConfig is not a setting of backend 'hopper'"):
    block(arrays, config=dispatch.TritonConfig(num_warps=8))
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: W2 and the logits "
                                       "are bfloat16"):
    block(_head_arrays("vanilla", 640, 64, 3, dtype=jnp.float32), dtype=jnp.float32)
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: B is a multiple "
                                       "of 64"):
    block(arrays, batch=32)
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: r is a multiple "
                                       "of 64"):  # the shipped ablation head's rank
    block(_head_arrays("vanilla", 640, 1, 3))


@pytest.mark.parametrize("batch,reverse,settings", [
    (64, False, {}), (128, False, {}), (128, True, {}), (128, True, {"parts": True}),
    (64, True, {"parts": True}), (128, False, {"consumers": 1, "stages": 3})])
def test_sampling_kernel_lowers_for_cuda_at_the_benchmark_shape(batch, reverse, settings):
  # r = 256, V = 129280, bf16, the corrected logits a mutable buffer updated in place; `reverse`:
  # an odd step of a serpentine block; `parts`: W2 part by part (`hopper_step.w2_parts`).
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
