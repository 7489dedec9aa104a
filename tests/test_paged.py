"""Paged KV (`dspark_jax.paging`, `kernels.paged_attention`): attention through a block table equals
the contiguous forms, writes land where the table says and nowhere else, the target and the draft
give the contiguous caches' results over a paged cache, and the host allocator's bookkeeping and
admission rule. Pages are assigned in shuffled order; unused pages, unallocated entries and every
position past a row's length hold NaN, which must never reach a result. The kernel runs in Pallas'
interpreter on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels import attention
from dspark_jax.kernels import paged_attention
from dspark_jax.kernels import ragged_attention as ra
from dspark_jax.paging import allocator
from dspark_jax.paging import cache as paging
from dspark_jax.models import layers
from dspark_jax.models import target as tm
from tests.test_decoding import make_draft, make_target
from tests.test_packing import kernel_sized_target

INTERPRET = jax.default_backend() != "gpu"
BF16_ULP = 2.0 ** -8


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)


def _paged(rng, contiguous, page_size, lengths, spare=3):
  """Pools [P, K, page_size, D] holding the [B, K, S, D] `contiguous` cache's first `lengths[b]`
  positions of each row in shuffled pages (NaN everywhere else: other pages, the rest of a row's
  last page), and the table (-1 past each row's pages)."""
  b, heads, slots, d = contiguous[0].shape
  max_pages = slots // page_size
  needed = -(-np.asarray(lengths) // page_size)
  pages = rng.permutation(int(needed.sum()) + spare)
  table = np.full((b, max_pages), paging.UNALLOCATED, np.int32)
  pools = []
  for x in contiguous:
    pool = np.full((len(pages), heads, page_size, d), np.nan, np.float32)
    pools.append(pool)
  used = 0
  for row in range(b):
    for m in range(needed[row]):
      table[row, m] = pages[used]
      used += 1
      for x, pool in zip(contiguous, pools):
        chunk = np.asarray(x[row, :, m * page_size:(m + 1) * page_size], np.float32).copy()
        chunk[:, max(lengths[row] - m * page_size, 0):] = np.nan
        pool[table[row, m]] = chunk
  dtype = contiguous[0].dtype
  return [jnp.asarray(p, dtype) for p in pools], jnp.asarray(table)


def _limits(rng, b, t, slots):
  """Rows of: nothing, one position, the whole capacity, a causal verify block, random."""
  rows = [np.zeros(t), np.ones(t), np.full(t, slots)]
  rows.append(rng.integers(0, slots - t + 1) + np.arange(t) + 1)
  while len(rows) < b:
    rows.append(rng.integers(0, slots + 1, t))
  return jnp.asarray(np.stack(rows[:b]), jnp.int32)


def _case(seed, groups, t, dtype, page_size, max_pages, b=5, heads=2, d=16):
  rng = np.random.default_rng(seed)
  slots = page_size * max_pages
  q = jnp.asarray(rng.normal(size=(b, t, heads * groups, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, heads, slots, d)), dtype) for _ in range(2))
  limits = _limits(rng, b, t, slots)
  (k_pool, v_pool), table = _paged(rng, (k, v), page_size, np.asarray(jnp.max(limits, axis=1)))
  mask = jnp.arange(slots)[None, None] < limits[:, :, None]
  with jax.default_matmul_precision("highest"):
    ref = attention.attend_xla(q, k, v, mask)
  return q, k_pool, v_pool, table, limits, ref


@pytest.mark.parametrize("groups,t,dtype,page_size,max_pages", [
    (1, 1, jnp.float32, 16, 4),
    (2, 8, jnp.bfloat16, 16, 4),
    (4, 3, jnp.float32, 64, 17),      # 1088 slots: the gather is cut to a page-count bucket
    (8, 1, jnp.bfloat16, 32, 2),
])
def test_xla_form_through_shuffled_pages_equals_the_contiguous_form(groups, t, dtype, page_size,
                                                                     max_pages):
  q, k_pool, v_pool, table, limits, ref = _case(groups + t, groups, t, dtype, page_size, max_pages)
  assert paged_attention.choose_paged(q, k_pool, table) == "xla"
  out = jax.jit(paged_attention.attend_paged)(q, k_pool, v_pool, table, limits)
  assert out.dtype == q.dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
  assert _rel_err(out, ref) <= (1e-5 if dtype == jnp.float32 else 4 * BF16_ULP)
  assert np.all(np.asarray(out, np.float32)[0] == 0)             # a row of length 0: zeros


@pytest.mark.kernel
@pytest.mark.parametrize("groups,t,dtype,page_size,splits", [
    (2, 7, jnp.float32, 16, 1),
    (4, 1, jnp.bfloat16, 32, 3),
])
def test_kernel_through_shuffled_pages_equals_the_contiguous_form(groups, t, dtype, page_size,
                                                                  splits):
  q, k_pool, v_pool, table, limits, ref = _case(7 * groups, groups, t, dtype, page_size, 4)
  out, lse = ra.ragged_attention(q, k_pool, v_pool, limits, block_table=table, block_kv=16,
                                 splits=splits, interpret=INTERPRET)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert _rel_err(out, ref) <= (1e-5 if dtype == jnp.float32 else 4 * BF16_ULP)
  assert np.all(np.asarray(lse)[np.asarray(limits) == 0] == -np.inf)


@pytest.mark.gpu
@pytest.mark.kernel
def test_compiled_kernel_through_shuffled_pages_at_a_model_shape():
  q, k_pool, v_pool, table, limits, ref = _case(13, 4, 8, jnp.bfloat16, 64, 16, b=4, heads=8,
                                                d=128)
  assert paged_attention.choose_paged(q, k_pool, table) == "ragged"
  out = jax.jit(paged_attention.attend_paged)(q, k_pool, v_pool, table, limits)
  assert _rel_err(out, ref) <= 4 * BF16_ULP


def test_kernel_preconditions_name_the_page_size_and_the_table():
  q = jnp.zeros((2, 1, 4, 16), jnp.float32)
  pool = jnp.zeros((6, 2, 48, 16), jnp.float32)
  table = jnp.zeros((2, 3), jnp.int32)
  assert "page_size=48 is not a multiple of block_kv=32" in ra.precondition(
      q, pool, block_kv=32, block_table=table)
  assert "block_table shape (3, 3)" in ra.precondition(q, pool, block_kv=16,
                                                       block_table=jnp.zeros((3, 3), jnp.int32))
  with pytest.raises(ValueError, match="page_size=48 is not a multiple of block_kv=32"):
    ra.ragged_attention(q, pool, pool, jnp.ones((2, 1), jnp.int32), block_table=table,
                        block_kv=32, interpret=True)
  assert ra.paged_block(48) == 16 and ra.paged_block(256) == 64
  huge = jax.ShapeDtypeStruct((2 ** 18, 8, 64, 16), jnp.float32)
  assert "2^31 elements" in ra.precondition(q, huge, block_kv=64, block_table=table)
  probe = jax.ShapeDtypeStruct((64, 8, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((4096, 8, 64, 128), jnp.bfloat16)
  big_table = jax.ShapeDtypeStruct((64, 130), jnp.int32)
  assert paged_attention.choose_paged(probe, pool, big_table, platform="gpu") == "ragged"
  assert paged_attention.choose_paged(probe, pool, big_table, platform="cpu") == "xla"


def test_writes_land_through_the_table_and_idle_slots_write_nothing():
  rng = np.random.default_rng(0)
  b, heads, d, page_size, max_pages, t = 3, 2, 4, 16, 3, 5
  cache = paging.init_pools(1, slots=b, num_pages=8, max_pages=max_pages, page_size=page_size,
                            kv_heads=heads, head_dim=d, dtype=jnp.float32)
  table = np.full((b, max_pages), paging.UNALLOCATED, np.int32)
  table[0], table[1, :2] = [5, 0, 3], [7, 2]          # slot 2 idle: no pages
  cache = cache.with_table(table)
  pool = jnp.asarray(rng.normal(size=cache.k[0].shape), jnp.float32)
  start = jnp.asarray([13, 27, 4], jnp.int32)           # slots 0 and 1 cross pages
  positions = start[:, None] + jnp.arange(t)[None]
  values = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
  new = paging.write(pool, cache.table, rows, positions, values)
  dense = layers.write_heads(paging.gather(pool, cache.table, max_pages), values, start)
  got = paging.gather(new, cache.table, max_pages)
  np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(dense)[0])
  np.testing.assert_array_equal(np.asarray(got)[1, :, :32], np.asarray(dense)[1, :, :32])
  held = {5, 0, 3, 7, 2}
  for page in set(range(8)) - held:                    # slot 2's writes dropped, free pages kept
    np.testing.assert_array_equal(np.asarray(new[page]), np.asarray(pool[page]))
  np.testing.assert_array_equal(paging.physical(cache.table, rows, positions, 8, page_size)[0][2],
                                [8] * t)


def test_target_and_draft_over_a_paged_cache_equal_the_contiguous_caches():
  _check_models_over_pages(make_target(), page_size=16)


@pytest.mark.gpu
def test_target_and_draft_over_a_paged_cache_through_the_kernel():
  # Head size 16 and pages of 64: the kernel's preconditions hold for both caches.
  target = kernel_sized_target()
  probe = jax.ShapeDtypeStruct((3, 4, 4, 16), jnp.float32)
  assert paged_attention.choose_paged(probe, jax.ShapeDtypeStruct((10, 2, 64, 16), jnp.float32),
                                      jax.ShapeDtypeStruct((3, 3), jnp.int32)) == "ragged"
  _check_models_over_pages(target, page_size=64)


def _check_models_over_pages(target, page_size):
  # One program per cache kind: a prefill, a verify block, an AR step, the draft's context and
  # block, and a packed verify (rows of 2, 0 and 3 tokens in a bucket of 6, one padding token).
  draft = make_draft(target, gamma=3, kind="vanilla")
  config = target.config
  rng = np.random.default_rng(1)
  b, max_pages, prompt = 3, 3, 20
  alloc = allocator.PageAllocator(num_pages=10, page_size=page_size, slots=b, max_pages=max_pages)
  for slot in (2, 0, 1):
    assert alloc.reserve(slot, max_pages * page_size)
  paged = paging.paged_cache(config, slots=b, num_pages=10, max_pages=max_pages,
                             page_size=page_size).with_table(alloc.table)
  caches = {"paged": (paged, paging.paged_context(draft, paged)),
            "dense": (tm.init_cache(config, b, max_pages * page_size),
                      draft.init_context(b, max_pages * page_size))}
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (b, prompt)), jnp.int32)
  starts = jnp.asarray([prompt, prompt - 7, prompt - 19], jnp.int32)
  rows = jnp.asarray([0, 0, 2, 2, 2, 3], jnp.int32)
  slots = jnp.asarray([0, 1, 0, 1, 2, 0], jnp.int32)

  @jax.jit
  def run(cache, context):
    outs = []
    for positions in (jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt)),
                      starts[:, None] + jnp.arange(4, dtype=jnp.int32)[None],   # a verify
                      starts[:, None] + 4):                                      # an AR step
      logits, features, cache = target(tokens[:, :positions.shape[1]], positions, cache)
      context = draft.extend_context(features, positions, context)
      outs += [logits, features]
    outs += list(draft(target, tokens[:, 0], starts, context))
    logits, features, cache = target.packed(tokens[0, :6], rows, slots,
                                            starts[jnp.minimum(rows, b - 1)] + slots, cache, 4)
    return outs + [logits, features], cache

  with pytest.raises(ValueError, match="cache: a paged cache of 3 slots .* for 2 rows"):
    target(tokens[:2, :1], jnp.zeros((2, 1), jnp.int32), paged)
  got, cache = run(*caches["paged"])
  want, dense = run(*caches["dense"])
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5)
  for pool, whole in zip(cache.k + cache.v, dense["k"] + dense["v"]):
    read = paging.gather(pool, cache.table, max_pages)
    np.testing.assert_allclose(np.asarray(read), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_allocator_hands_out_each_page_once_and_admits_in_queue_order():
  alloc = allocator.PageAllocator(num_pages=10, page_size=16, slots=4, max_pages=4)
  assert alloc.reserve(0, 40) and alloc.held(0) == 3 and alloc.lengths[0] == 48
  assert alloc.reserve(0, 20) and alloc.held(0) == 3     # never shrinks
  assert alloc.reserve(1, 64) and alloc.free_pages == 3
  assert not alloc.reserve(2, 64) and alloc.held(2) == 0 and alloc.free_pages == 3   # waits
  paging.check_table(alloc.table, 10, alloc.lengths, 16)
  # Admission: the longest prefix of the queue that fits; a later small row never overtakes.
  assert alloc.admit([16, 32, 1]) == 2 and alloc.admit([64, 1]) == 0 and alloc.admit([]) == 0
  assert alloc.release(1) == 4 and alloc.free_pages == 7 and np.all(alloc.table[1] == -1)
  assert alloc.reserve(2, 64) and alloc.free_pages == 3
  assert allocator.row_positions(100, 50, 7) == 166
  # A random workload: rows start and finish; the table never shares or loses a page.
  rng = np.random.default_rng(0)
  alloc = allocator.PageAllocator(num_pages=12, page_size=16, slots=4, max_pages=5)
  for _ in range(200):
    slot = int(rng.integers(0, 4))
    if alloc.held(slot) and rng.random() < 0.5:
      alloc.release(slot)
    else:
      alloc.reserve(slot, int(rng.integers(0, 81)))
    paging.check_table(alloc.table, 12, alloc.lengths, 16)
    assert alloc.free_pages + sum(alloc.held(s) for s in range(4)) == 12


def test_grow_preempts_the_newest_rows_and_every_other_row_gets_its_pages():
  alloc = allocator.PageAllocator(num_pages=8, page_size=16, slots=3, max_pages=6)
  assert alloc.admit([32, 32, 32, 32]) == 4
  for slot in (1, 0, 2):                                 # admission order: 1, 0, 2
    assert alloc.start(slot, 32)
  assert alloc.grow([64, 64, 48]) == [2]                 # 5 more pages wanted, 2 free
  assert (alloc.held(0), alloc.held(1), alloc.held(2), alloc.free_pages) == (4, 4, 0, 0)
  assert alloc.grow([96, 64, 0]) == [0] and alloc.held(1) == 4 and alloc.free_pages == 4
  assert alloc.grow([0, 96, 0]) == [] and alloc.held(1) == 6   # the oldest row always fits
  with pytest.raises(ValueError, match="slot: 1 still holds 6 pages"):
    alloc.start(1, 16)
  assert allocator.lookahead(3, 7) == 32
  # A random workload: rows start, grow and finish; after every `grow` each running row holds
  # what it wants, no page is shared or lost, and the oldest running row is never preempted.
  rng = np.random.default_rng(0)
  alloc = allocator.PageAllocator(num_pages=12, page_size=16, slots=4, max_pages=8)
  wants = np.zeros(4, np.int64)
  for _ in range(150):
    for slot in range(4):
      if wants[slot] and rng.random() < 0.1:
        alloc.release(slot)
        wants[slot] = 0
      elif not wants[slot] and alloc.admit([16]) and alloc.start(slot, 16):
        wants[slot] = 16
    wants = np.minimum(wants + rng.integers(0, 20, 4) * (wants > 0), 128)
    oldest = min((s for s in range(4) if wants[s]), key=lambda s: alloc._order[s], default=None)
    preempted = alloc.grow(wants)
    assert oldest not in preempted
    wants[preempted] = 0
    paging.check_table(alloc.table, 12, wants, 16)
    assert all(alloc.held(s) * 16 >= wants[s] for s in range(4))
    assert alloc.free_pages + sum(alloc.held(s) for s in range(4)) == 12


def _grow_one_row_at_a_time(alloc, wants):
  """`PageAllocator.grow`'s policy written row by row: rows sorted oldest first; while the pages
  missing exceed the free ones, release the newest; then `reserve` each kept row, oldest first."""
  running = sorted((s for s in range(len(wants)) if alloc.held(s) or wants[s]),
                   key=lambda s: alloc._order[s])
  short = lambda: sum(max(-(-int(wants[s]) // alloc.page_size) - alloc.held(s), 0)
                      for s in running) - alloc.free_pages
  preempted = []
  while running and short() > 0:
    preempted.append(running.pop())
    alloc.release(preempted[-1])
  for slot in running:
    assert alloc.reserve(slot, int(wants[slot]))
  return preempted


def test_grow_hands_out_the_pages_that_reserving_row_by_row_would():
  # Two allocators in lockstep on a random workload under page pressure (24 slots, 60 pages of
  # 16): `grow` and the row-by-row policy preempt the same rows and leave the same block table,
  # lengths and free list (so the pages every row reads are the same).
  rng = np.random.default_rng(7)
  fast, slow = (allocator.PageAllocator(num_pages=60, page_size=16, slots=24, max_pages=10)
                for _ in range(2))
  wants = np.zeros(24, np.int64)
  preemptions = 0
  for _ in range(120):
    for slot in range(24):
      if wants[slot] and rng.random() < 0.08:
        fast.release(slot)
        slow.release(slot)
        wants[slot] = 0
      elif not wants[slot] and rng.random() < 0.5 and fast.admit([16]):
        assert fast.start(slot, 16) and slow.start(slot, 16)
        wants[slot] = 16
    wants = np.minimum(wants + rng.integers(0, 40, 24) * (wants > 0), 160)
    got = fast.grow(wants)
    assert got == _grow_one_row_at_a_time(slow, wants)
    np.testing.assert_array_equal(fast.table, slow.table)
    np.testing.assert_array_equal(fast.lengths, slow.lengths)
    assert fast._free == slow._free
    preemptions += len(got)
    wants[got] = 0
  assert preemptions > 10                               # the pressure did preempt


@pytest.mark.parametrize("call,message", [
    (lambda: allocator.PageAllocator(3, 16, 2, 4), "num_pages: a pool of 3 pages cannot hold one"),
    (lambda: paging.init_pools(1, slots=2, num_pages=3, max_pages=4, page_size=16, kv_heads=1,
                               head_dim=8, dtype=jnp.float32), "num_pages: a pool of 3 pages"),
    (lambda: allocator.PageAllocator(8, 24, 2, 4), "page_size: 24 is not a multiple of 16"),
    (lambda: allocator.PageAllocator(8, 16, 2, 4).reserve(0, 65), "positions: 65 exceed"),
    (lambda: allocator.admissible(8, [16, 80], 16, 4), "needs: row 1 needs 80 positions"),
    (lambda: allocator.PageAllocator(8, 16, 2, 4).grow([0, 65]), "wants: slot 1 wants 65"),
    (lambda: paging.check_table(np.asarray([[0, 1], [9, -1]]), 4), r"entry \[1, 0\] = 9 points"),
    (lambda: paging.check_table(np.asarray([[0, -1]]), 4, [17], 16), r"entry \[0, 1\] = -1"),
    (lambda: paging.check_table(np.asarray([[0, 2], [2, -1]]), 4), "page another entry holds"),
    (lambda: allocator.pool_pages(0), "page_bytes"),
    (lambda: paged_attention.attend_paged(jnp.zeros((1, 1, 2, 16)), jnp.zeros((2, 1, 16, 16)),
                                          jnp.zeros((2, 1, 16, 16)), jnp.asarray([[1, 5]]),
                                          jnp.asarray([[17]])), r"entry \[0, 1\] = 5 points"),
    (lambda: allocator.pool_pages(64, memory_stats={}), "memory_stats: free device memory"),
])
def test_bad_input_is_named(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_pool_pages_sizes_the_pool_from_free_memory_less_reserve_and_headroom():
  stats = {"bytes_limit": 100 * 2**20, "bytes_in_use": 20 * 2**20}
  page = allocator.token_bytes(36, 8, 128, 2) * 64           # Qwen3-4B, bf16, 64 positions
  assert allocator.token_bytes(36, 8, 128, 2) == 147456
  assert allocator.pool_pages(page, memory_stats=stats, headroom_bytes=2**20,
                              reserve_bytes=2**20) == (78 * 2**20) // page
  assert allocator.pool_pages(page, memory_stats=lambda: stats, headroom_bytes=90 * 2**20) == 0
