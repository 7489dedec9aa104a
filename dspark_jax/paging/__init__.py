"""Paged KV: caches whose memory follows the rows' real lengths, in pages from one pool per layer.

* `cache`: the device side, pure functions: `PagedKV` (per layer a page pool, the block table
  per slot), writes through the block table, the gather of a row's pages, table checks.
* `allocator`: the host side, NumPy: `PageAllocator` (pages handed out as rows grow, freed when
  they finish), the admission rule, and `pool_pages` (how many pages fit in device memory).

Attention reads a pool through its block table in `dspark_jax.kernels.paged_attention`; the target
and the draft take a `PagedKV` wherever they take a contiguous cache (docs/paged_kv.md).
"""
