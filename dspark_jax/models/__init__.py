"""The models: Qwen3-style layers, the target with its static KV cache, the DSpark draft, the shipped pair.

* `layers`: RoPE, grouped-query attention with q/k norm, SwiGLU, `DecoderLayer`, cache writes.
* `layout`: the tensor-parallel layout rules (`Plan`, parameter specs, cache constraints).
* `target`: `TargetModel` / `TargetConfig`.
* `draft`: `DSparkDraft` / `DraftConfig`: the draft backbone, its heads, its context cache.
* `shipped`: the trained pair in ``dspark_jax/assets`` and `load_shipped`.
"""
