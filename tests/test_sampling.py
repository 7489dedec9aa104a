"""sample_step: exact per-row laws in mixed batches, greedy rows, key streams, edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.testing import compiling
from dspark_jax.testing import law_checks as reference
from dspark_jax.sampling import sampler as sampling
from tests import stats


def _mixed_pattern(vocab, rng):
  """Rows of one mixed batch: (temperature, top_k, logits). Greedy rows sit between sampled ones."""
  rows = [(0.0, 0), (0.3, 0), (1.0, 1), (1.0, 0), (2.0, 0), (1e-6, 50)]
  logits = [rng.normal(0.0, 1.5, vocab).astype(np.float32) for _ in rows]
  return rows, np.stack(logits)


@pytest.mark.parametrize("vocab,copies", [(7, 40_000), (100, 40_000), (1000, 30_000),
                                          (384, 30_000)])
@pytest.mark.slow
def test_sample_step_matches_softmax_in_mixed_batch(vocab, copies):
  # N = `copies` samples per pattern row (independent seeds). Statistic: Pearson chi-square of the
  # token counts against softmax(L / T) (bins with expected count < 5 pooled). Threshold p >= 1e-3.
  rng = np.random.default_rng(vocab)
  rows, logits = _mixed_pattern(vocab, rng)
  n_rows = len(rows)
  temperature = np.tile([t for t, _ in rows], copies)
  top_k = np.tile([k for _, k in rows], copies)
  params = dj.SamplingParams(temperature=temperature, top_k=top_k,
                             seed=np.arange(n_rows * copies) + 17)
  batch_logits = jnp.asarray(np.tile(logits, (copies, 1)))
  positions = jnp.full((n_rows * copies,), 5, jnp.int32)
  tokens = np.asarray(compiling.compute_bound_jit(dj.sample_step)(
      batch_logits, params, jax.random.key(vocab), positions))
  tokens = tokens.reshape(copies, n_rows)
  for row, (temp, k) in enumerate(rows):
    counts = np.bincount(tokens[:, row], minlength=vocab)
    if temp < 1e-5 or k == 1:
      assert np.all(tokens[:, row] == np.argmax(logits[row])), f"greedy row {row}"
      continue
    law = reference.softmax(logits[row] / temp)
    stats.assert_law(counts, law, what=f"V={vocab} T={temp}")
    # Power: the same counts must reject the law at a wrong temperature.
    stats.assert_rejects(counts, reference.softmax(logits[row] / (temp * 1.5)),
                         what=f"V={vocab} T={temp} vs T*1.5")


def test_greedy_rows_take_smallest_index_on_ties():
  logits = np.zeros((4, 10), np.float32)
  logits[:, [3, 6]] = 2.0  # two maxima
  params = dj.SamplingParams(temperature=[0.0, 1.0, 1e-6, 0.5], top_k=[0, 1, 0, 0])
  tokens = dj.sample_step(jnp.asarray(logits, jnp.bfloat16), params, jax.random.key(0),
                          jnp.arange(4))
  assert tokens.dtype == jnp.int32
  assert tokens[0] == 3 and tokens[1] == 3 and tokens[2] == 3  # the three greedy rows
  assert tokens[3] in (3, 6) or 0 <= tokens[3] < 10


def test_all_negative_infinity_rows_return_token_zero():
  logits = np.full((4, 16), -np.inf, np.float32)
  logits[2, 5] = 0.0  # a normal row among them
  params = dj.SamplingParams(temperature=[0.0, 1.0, 1.0, 2.0])
  tokens = np.asarray(dj.sample_step(jnp.asarray(logits), params, jax.random.key(3),
                                     jnp.arange(4)))
  np.testing.assert_array_equal(tokens, [0, 0, 5, 0])


def test_nan_logits_give_valid_token_ids():
  logits = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
  logits[0, 9] = np.nan
  logits[1, :] = np.nan
  params = dj.SamplingParams(temperature=[1.0, 0.0, 0.7])
  tokens = np.asarray(dj.sample_step(jnp.asarray(logits), params, jax.random.key(3),
                                     jnp.arange(3)))
  assert np.all((tokens >= 0) & (tokens < 32))
  assert tokens[0] == 9 and tokens[1] == 0  # documented: the first NaN wins the argmax


def test_positive_infinity_is_certain():
  logits = np.zeros((2, 8), np.float32)
  logits[:, 4] = np.inf
  tokens = dj.sample_step(jnp.asarray(logits), dj.SamplingParams(temperature=[1.0, 3.0]),
                          jax.random.key(0), jnp.arange(2))
  np.testing.assert_array_equal(np.asarray(tokens), [4, 4])


def test_request_stream_is_batch_invariant():
  # A request's token depends only on (key, seed, position): reorder, drop and add rows.
  rng = np.random.default_rng(1)
  vocab, batch = 50, 12
  logits = rng.normal(size=(batch, vocab)).astype(np.float32)
  temperature = rng.uniform(0.5, 2.0, batch)
  seeds = rng.integers(0, 2**32, batch, dtype=np.uint64)
  positions = rng.integers(0, 5000, batch)
  key = jax.random.key(11)

  def run(idx):
    return np.asarray(dj.sample_step(jnp.asarray(logits[idx]),
                                     dj.SamplingParams(temperature=temperature[idx], seed=seeds[idx]),
                                     key, jnp.asarray(positions[idx])))

  full = run(np.arange(batch))
  perm = rng.permutation(batch)
  np.testing.assert_array_equal(run(perm), full[perm])
  np.testing.assert_array_equal(run(np.arange(3, 9)), full[3:9])
  np.testing.assert_array_equal(run(np.r_[np.arange(batch), np.arange(batch)]),
                                np.r_[full, full])
  # Same request at another position, or with another seed, or another stream: fresh draws.
  many = np.asarray(dj.sample_step(jnp.asarray(np.repeat(logits[:1], 64, 0)),
                                   dj.SamplingParams(temperature=np.full(64, 2.0)),
                                   key, jnp.arange(64)))
  assert len(set(many.tolist())) > 10


def test_streams_are_distinct_and_keys_are_pure():
  seeds = jnp.arange(4, dtype=jnp.uint32)
  positions = jnp.full((4,), 9, jnp.int32)
  key = jax.random.key(5)
  draft = jax.random.key_data(sampling.row_keys(key, seeds, positions, dj.Stream.DRAFT))
  again = jax.random.key_data(sampling.row_keys(key, seeds, positions, dj.Stream.DRAFT))
  bonus = jax.random.key_data(sampling.row_keys(key, seeds, positions, dj.Stream.VERIFY_BONUS))
  np.testing.assert_array_equal(draft, again)
  assert not np.any(np.all(np.asarray(draft) == np.asarray(bonus), axis=-1))
  # A raw uint32 key and the typed key with the same bits give the same streams.
  raw = jax.random.key_data(key)
  np.testing.assert_array_equal(
      draft, jax.random.key_data(sampling.row_keys(raw, seeds, positions, dj.Stream.DRAFT)))


def test_threefry_is_jax_threefry_bit_for_bit():
  # The in-house block function (plain uint32 arithmetic, for kernels) against JAX's own: 4,096
  # random counters under each of 3 random keys.
  from jax.extend.random import threefry_2x32
  rng = np.random.default_rng(1)
  for key in rng.integers(0, 2**32, size=(3, 2), dtype=np.uint32):
    counter = rng.integers(0, 2**32, size=(2, 4096), dtype=np.uint32)
    y0, y1 = sampling.threefry2x32((key[0], key[1]), (counter[0], counter[1]))
    want = threefry_2x32(jnp.asarray(key), jnp.asarray(counter.reshape(-1)))
    np.testing.assert_array_equal(np.r_[np.asarray(y0), np.asarray(y1)], np.asarray(want))


def test_tile_noise_is_gumbel_and_counter_based():
  # N = 300 rows x 1,138 draws = 341,400 values from `tile_noise` (the keys of 300 (seed,
  # position) pairs). Statistic: Kolmogorov-Smirnov distance to the Gumbel(0, 1) CDF, threshold
  # 1.95 / sqrt(N) (p = 0.001); the lag-1 correlation along a row and between neighbouring rows,
  # threshold 4 / sqrt(N). Each value is `counter_gumbel` of its own counter.
  rows, tiles, tile = 300, 1010, 128
  keys = sampling.row_keys(jax.random.key(2), jnp.arange(rows) % 7, jnp.arange(rows) * 3, 0)
  noise = np.asarray(sampling.tile_noise(keys, tiles, tile), np.float64)
  values = np.sort(noise.reshape(-1))
  n = values.size
  cdf = np.exp(-np.exp(-values))
  distance = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
  assert distance < 1.95 / np.sqrt(n), distance
  centred = noise - noise.mean()
  along = np.sum(centred[:, 1:] * centred[:, :-1]) / np.sum(centred**2)
  across = np.sum(centred[1:] * centred[:-1]) / np.sum(centred**2)
  assert abs(along) < 4 / np.sqrt(n) and abs(across) < 4 / np.sqrt(n), (along, across)
  words = jax.random.key_data(keys)
  index = jnp.asarray([0, 1, 7, tiles - 1])
  np.testing.assert_array_equal(
      noise[:, [0, 1, 7, tiles - 1]].astype(np.float32),
      sampling.counter_gumbel(words[:, :1], words[:, 1:], sampling.TILE_DOMAIN, index))
  np.testing.assert_array_equal(
      noise[:, tiles:tiles + 4].astype(np.float32),
      sampling.counter_gumbel(words[:, :1], words[:, 1:], sampling.COLUMN_DOMAIN, jnp.arange(4)))


def _uint32_shapes(jaxpr, found):
  """Shapes of every uint32 value a jaxpr computes (the counter-based noise's integer work)."""
  for eqn in jaxpr.eqns:
    found += [v.aval.shape for v in eqn.outvars
              if getattr(v.aval, "dtype", None) == jnp.uint32]
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        _uint32_shapes(getattr(inner, "jaxpr", inner), found)
  return found


@pytest.mark.parametrize("vocab,tile", [(129280, 128), (151936, 128), (50_000, 16), (7, 1)])
def test_two_level_sampler_draws_tiles_plus_tile_width_noise(vocab, tile):
  # The point of the two-level form: V/c + c Gumbel draws per sampled row, not V.
  assert sampling.vocab_tile(vocab) == tile
  batch = 4
  params = dj.SamplingParams(temperature=np.full(batch, 0.9))
  jaxpr = jax.make_jaxpr(lambda logits, key, pos: sampling._sample_step(logits, params, key, pos, 0))(
      jax.ShapeDtypeStruct((batch, vocab), jnp.bfloat16), jax.random.key(0), jnp.arange(batch))
  # The Threefry blocks run on arrays of at most one counter per draw: [B, V/c + c].
  shapes = _uint32_shapes(jaxpr.jaxpr, [])
  assert max(shapes, key=np.prod) == (batch, vocab // tile + tile)


@pytest.mark.parametrize("vocab", [256, 384, 100])
def test_tile_stats_match_float64(vocab):
  rng = np.random.default_rng(vocab)
  logits = rng.normal(0, 4, size=(5, vocab)).astype(np.float32)
  logits[1, :] = -np.inf
  logits[2, : vocab // 2] = -np.inf   # whole -inf tiles next to normal ones
  logits[3, 7] = np.nan
  logits[4, 3] = np.inf
  temperature = np.array([0.7, 1.0, 2.0, 1.0, 1.0], np.float32)
  tile_max, tile_arg, mass = (np.asarray(a) for a in sampling.tile_stats(
      jnp.asarray(logits), jnp.asarray(temperature)))
  tile = sampling.vocab_tile(vocab)
  x = logits.astype(np.float64).reshape(5, -1, tile)
  with np.errstate(invalid="ignore", divide="ignore"):
    want = np.log(np.sum(np.exp(x / temperature[:, None, None]), axis=-1))
  np.testing.assert_allclose(mass[[0, 2]], want[[0, 2]], rtol=1e-6)
  assert np.all(mass[1] == -np.inf) and mass[4, 3 // tile] == np.inf
  assert np.isnan(mass[3, 7 // tile]) and np.isnan(tile_max[3, 7 // tile])
  assert tile_arg[3, 7 // tile] == 7
  np.testing.assert_array_equal(tile_arg[0], np.argmax(x[0], -1) + np.arange(x.shape[1]) * tile)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [256, 384])
def test_tile_draws_give_the_tokens_of_tile_stats(vocab):
  # `fused_step` draws a token in every tile and reduces (score, draw) pairs; that must pick the
  # token `tokens_from_tile_stats` picks from the chosen tile alone, for the same noise, and both
  # the token of the two-level draw written out with jnp.argmax (greedy rows: the argmax): 400 rows
  # of random logits (integer-valued, so exact ties), all -inf, NaN and +inf rows, all sampled and
  # all greedy.
  rng = np.random.default_rng(vocab)
  rows = 400
  logits = rng.integers(-4, 4, size=(rows, vocab)).astype(np.float32)
  logits[0] = -np.inf
  logits[1, : vocab // 2] = -np.inf
  logits[2, [9, vocab - 3]] = np.nan
  logits[3, [20, vocab - 1]] = np.inf
  temperature = jnp.asarray(rng.uniform(0.3, 2.0, rows), jnp.float32)
  keys = sampling.row_keys(jax.random.key(1), jnp.arange(rows), jnp.zeros(rows, jnp.int32), 0)
  tile = sampling.vocab_tile(vocab)
  tiles = vocab // tile
  noise = sampling.tile_noise(keys, tiles, tile)
  x = jnp.asarray(logits)
  tile_max, tile_arg, mass = sampling.tile_stats(x, temperature)
  windows = x.reshape(rows, tiles, tile) / temperature[:, None, None] + noise[:, None, tiles:]
  columns = jnp.arange(tiles)[:, None] * tile + jnp.arange(tile)[None, :]
  draws = jnp.take_along_axis(  # argmax per tile, NaN first, as a column of the row
      jnp.broadcast_to(columns, windows.shape),
      jnp.argmax(windows, axis=-1)[..., None], axis=-1)[..., 0]
  # The two-level draw written out with jnp.argmax (first max, NaN first), one stage at a time.
  start = jnp.argmax(mass + noise[:, :tiles], axis=-1) * tile
  chosen_tile = jnp.take_along_axis(x.reshape(rows, tiles, tile), (start // tile)[:, None, None],
                                    axis=1)[:, 0]
  direct = start + jnp.argmax(chosen_tile / temperature[:, None] + noise[:, tiles:], axis=-1)
  for greedy in (jnp.zeros(rows, bool), jnp.ones(rows, bool)):
    want = sampling.tokens_from_tile_stats(x, tile_max, tile_arg, mass, greedy, temperature, noise)
    got = sampling.tokens_from_tile_choices(*sampling.tile_choices(
        tile_max, tile_arg, mass + noise[:, :tiles], draws, greedy))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    expected = jnp.argmax(x, axis=-1) if bool(greedy[0]) else direct
    np.testing.assert_array_equal(np.asarray(want), np.asarray(expected))
  assert int(want[0]) == 0 and int(got[2]) == 9 and int(got[3]) == 20


@pytest.mark.parametrize("bad,match", [
    (lambda L, p, pos: (L[0], p, pos), "logits: expected \\[B, V\\]"),
    (lambda L, p, pos: (L.astype(jnp.int32), p, pos), "logits: expected a float dtype"),
    (lambda L, p, pos: (L, dj.SamplingParams(temperature=[1.0]), pos), "params: has 1 rows"),
    (lambda L, p, pos: (L, p, pos[:1]), "positions: expected shape"),
    (lambda L, p, pos: (L, p, pos.astype(jnp.float32)), "positions: expected integers"),
])
def test_sample_step_rejects_bad_inputs(bad, match):
  logits = jnp.zeros((2, 5))
  params = dj.SamplingParams(temperature=[1.0, 0.0])
  logits, params, positions = bad(logits, params, jnp.arange(2))
  with pytest.raises(ValueError, match=match):
    dj.sample_step(logits, params, jax.random.key(0), positions)


@pytest.mark.parametrize("vocab", [1, 7, 4096, 151936 // 16, 2 * 1187])
def test_two_stage_argmax_equals_argmax_with_ties_and_nans(vocab):
  rng = np.random.default_rng(vocab)
  scores = rng.integers(-3, 3, size=(6, vocab)).astype(np.float32)  # many exact ties
  scores[1] = -np.inf
  scores[2, vocab // 2] = np.nan
  scores[3, -1] = np.nan
  got = np.asarray(sampling.argmax_last(jnp.asarray(scores)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(scores), axis=-1)))


def test_compute_bound_jit_compiles_at_level_one_only_under_a_lower_level(monkeypatch):
  # The law checks' large programs: level 1 where XLA_FLAGS asks for less (the suite's level 0),
  # XLA's defaults otherwise; the tokens are those of a plain jit (same arithmetic).
  level_one = {"xla_backend_optimization_level": 1}
  for flags, want in (("--xla_backend_optimization_level=0 --x=1", level_one),
                      ("--xla_backend_optimization_level=2", {}), ("", {})):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert compiling.compute_bound_options() == want, flags
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  logits = jnp.asarray(np.random.default_rng(0).normal(0, 2, (512, 33)), jnp.float32)
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.7, 1.0, 1.9], 128), seed=np.arange(512))
  args = (logits, params, jax.random.key(4), jnp.arange(512, dtype=jnp.int32))
  np.testing.assert_array_equal(np.asarray(compiling.compute_bound_jit(dj.sample_step)(*args)),
                                np.asarray(jax.jit(dj.sample_step)(*args)))
