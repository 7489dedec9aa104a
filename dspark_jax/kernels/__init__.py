"""GPU kernels for the folded draft block and the models' attention, and the decisions which run.

* `dispatch`: the backend decision (XLA, the Triton chain, the Hopper kernels) as a table with each
  kernel's preconditions, typed configs, ``$DSPARK_JAX_BACKEND``.
* `pallas_block`: a folded block computed by the kernels (the per-step Triton chain, or the Hopper
  step kernels), given a dispatch decision.
* `triton_step`: one Pallas (Triton) kernel per draft step: corrected logits and per-tile statistics.
* `head_steps`: the heads' arithmetic of one draft step (pure functions; `draft.heads` builds on it).
* `token_kernels`: the per-row kernels of the chain: token choice, in-tile draws, the block's noise.
* `hopper_step`: the draft steps as Mosaic GPU kernels for Hopper GPUs (TMA, WGMMA).
* `attention`: which form computes the models' attention (``$DSPARK_JAX_ATTENTION``): XLA
  einsums, cuDNN's fused attention, or `ragged_attention`.
* `ragged_attention`: a few queries per row over a head-major KV cache, reading each row's prefix;
  `paged_attention`: the same through a block table.
* `attention_inputs`: a layer's query/key norms, rotary embedding and cache writes in one kernel.
* `shared_attention`: training's context attention (forward and backward).
"""
