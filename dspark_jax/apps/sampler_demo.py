"""The random-weight sampler demo behind ``dspark-jax sampler-demo``: the draft sampler end to end.

It builds a sequential head and a confidence head on random weights, prints the memory gate's decision,
proposes one mixed greedy/sampled batch on every path (folded sampling, folded greedy-only, eager),
checks that the folded and eager paths agree token for token, and times them (median after warm-up).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.draft import proposer as draft_sampler
from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import params as sp


def _median_ms(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # warm-up (compilation)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def run(args) -> int:
  batch, gamma, vocab, hidden_size = args.batch_size, args.gamma, args.vocab, args.hidden
  device = jax.local_devices()[0]
  dtype = jnp.dtype(args.dtype or ("float32" if device.platform == "cpu" else "bfloat16"))
  rngs = nnx.Rngs(0)
  head = heads.MarkovHead.random(args.head, vocab_size=vocab, rank=args.rank,
                                 hidden_size=hidden_size, rngs=rngs, dtype=dtype, bias_scale=2.0)
  confidence = heads.ConfidenceHead.random(width=hidden_size + args.rank, rngs=rngs, dtype=dtype)
  print(f"dspark-jax demo on {device.device_kind} ({device.platform}): B={batch} γ={gamma} "
        f"V={vocab} r={args.rank} H={hidden_size} head={args.head} dtype={dtype.name}")

  sampler = draft_sampler.build_draft_sampler(
      head, max_batch_size=batch, vocab_size=vocab, gamma=gamma, logits_dtype=dtype,
      mode=args.mode, confidence_head=confidence, hidden_size=hidden_size)
  print("memory gate:", sampler.decision.summary())

  keys = jax.random.split(jax.random.key(1), 3)
  base_logits = (3.0 * jax.random.normal(keys[0], (batch, gamma, vocab))).astype(dtype)
  hidden = jax.random.normal(keys[1], (batch, gamma, hidden_size)).astype(dtype)
  anchor = jnp.arange(batch, dtype=jnp.int32)
  positions = jnp.full((batch,), 100, jnp.int32)
  temperature = np.where(np.arange(batch) % 2 == 0, 0.0, 0.7 + 0.1 * np.arange(batch))
  mixed = sp.SamplingParams(temperature=temperature, seed=np.arange(batch) + 1000)
  greedy = sp.SamplingParams(temperature=np.zeros(batch))
  key = jax.random.key(2026)

  def propose(params):
    return sampler.propose(base_logits, anchor, hidden, params, key, positions)

  def eager(params):
    return proposal.sample_block_eager(head, base_logits, anchor, hidden, params, key, positions,
                                       confidence_head=confidence)

  mixed_block, greedy_block, eager_block = propose(mixed), propose(greedy), eager(mixed)
  print(f"\nmixed batch (even rows greedy, odd rows T = {temperature[1]:.1f}, "
        f"{temperature[3]:.1f}, ...):")
  print(f"  path: {mixed_block.path}")
  for row in range(min(batch, 4)):
    kind = "greedy " if temperature[row] == 0 else f"T={temperature[row]:.1f}"
    conf = " ".join(f"{c:.2f}" for c in np.asarray(mixed_block.confidence[row]))
    print(f"  row {row} ({kind}): tokens {np.asarray(mixed_block.tokens[row]).tolist()}  "
          f"confidence [{conf}]")
  same = bool(jnp.array_equal(mixed_block.tokens, eager_block.tokens)
              and jnp.array_equal(mixed_block.corrected_logits, eager_block.corrected_logits))
  print(f"  eager path gives the same tokens and corrected logits: {same}")
  print(f"all-greedy batch path: {greedy_block.path}; tokens of row 0 "
        f"{np.asarray(greedy_block.tokens[0]).tolist()}")

  timings = [("folded sampling (mixed batch)", _median_ms(lambda: propose(mixed).tokens, args.repeats)),
             ("folded greedy-only (all greedy)", _median_ms(lambda: propose(greedy).tokens, args.repeats)),
             ("eager (mixed batch)", _median_ms(lambda: eager(mixed).tokens, args.repeats))]
  print(f"\nmedian of {args.repeats} calls after warm-up:")
  for name, ms in timings:
    print(f"  {name:<34} {ms:8.3f} ms")
  print(f"  eager / folded sampling: {timings[2][1] / timings[0][1]:.2f}x")
  return 0 if same else 1
