"""The draft side of a round: sequential heads, block sampling, the compiled proposer, the memory gate.

* `heads`: vanilla / gated / rnn sequential heads and the confidence head.
* `block`: `DraftBlock`, `CompactLogits`, the γ-step block loop (folded into one program, or eager).
* `proposer`: `build_draft_sampler` / `DraftSampler`, compiled variants per padding bucket and routing.
* `memory_gate`: whether the folded sampling variant fits in device memory (OFF / AUTO / FORCE).

Which backend computes a folded block (XLA, the Triton chain, the Hopper kernels) is decided in
`dspark_jax.kernels.dispatch`.
"""
