"""Exact per-row sampling: parameters, row-keyed random streams, the sampler and the target's law.

* `params`: `SamplingParams`, a pytree of per-row temperature, top-k, top-p and seed; the greedy rule.
* `sampler`: `sample_step` (one exact step of a mixed greedy/sampled batch), `row_keys` / `Stream`
  (a row's randomness as a function of key, seed, position and stream), the two-level tile sampler.
* `target_law`: the target's law after temperature, top-k and top-p (`target_log_probs`,
  `sample_target`).
"""
