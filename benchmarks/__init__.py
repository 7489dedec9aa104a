"""Maintained benchmarks of dspark_jax, sharing one timing harness (`benchmarks.harness`).

* `benchmarks.bench_sampler`: the folded draft-block sampler (sampling and greedy-only variants,
  ``DraftSampler.propose``, the eager loop, and PyTorch's CUDA-graph reference where torch has
  CUDA), in µs and × the memory floor ``γ·(r·V + 2·B·V)·itemsize / bandwidth``.
* `benchmarks.bench_decode`: one speculative round split into its parts (draft forward, block
  sampling, target verify, accept/commit, context update), the full round and one autoregressive
  step, in ms and × their memory floors; then ``generate`` end to end.
* `benchmarks.bench_paged`: the target's autoregressive step and verify over a paged KV cache
  (pages in shuffled order, read through the block table) against the contiguous cache, in ms and
  paged / contiguous.
* `benchmarks.bench_serving`: the queue-driven decode over a dataset of spread output lengths:
  occupancy and tokens/s against static batches at equal slots, and tokens/s per GPU against
  tokens/s per user at concurrency 1…256 per verify schedule.
* `benchmarks.bench_profile`: one call of the round (AR step, verify, draft forward, full round)
  kernel by kernel from a `jax.profiler` trace: time, count, bytes and FLOPs per kernel group
  against its own floor, GPU busy % and the gaps between kernels.
* `benchmarks.bench_compact`: the sampling block with stored corrected logits against
  ``store_logits=False`` (`CompactLogits`), alone and followed by verification.
* `benchmarks.bench_gemm`: the Qwen3-4B projections (36 distinct weights) and LM head at 1…512
  rows, XLA (default, cuBLAS-only, no fusion autotuner) against JAX's Hopper Pallas matmul, in µs
  and × the weight-read or compute floor.
* `benchmarks.bench_train` / `benchmarks.bench_train_deepspec`: one drafter training step, ours and
  DeepSpec's own PyTorch step at the same shapes, in tokens/s and MFU.

Each module has ``main(argv=None)`` and runs from the repository root as
``python -m benchmarks.<name> [--small] [--backend auto|xla|triton|hopper] [--json PATH]``;
``--small`` uses tiny shapes and few repeats (seconds on a CPU). The summary table is printed last.
``scripts/gpu_check.py`` runs them, with the GPU-relevant tests, before a GPU change is submitted.
"""
