"""The models: Qwen3-style layers and their tensor-parallel layout, the target, the DSpark draft.

* `layers`: RoPE, grouped-query attention with q/k norm, SwiGLU, `DecoderLayer`, cache writes.
* `layout`: the tensor-parallel layout rules (`Plan`, parameter specs, cache constraints).
* `target`: `TargetModel` / `TargetConfig`.
* `draft`: `DSparkDraft` / `DraftConfig`: the draft backbone, its heads, its context cache.
"""
