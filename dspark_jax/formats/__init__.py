"""Checkpoint formats: our own, and those of other libraries, read and written exactly.

* `checkpoints`: dspark_jax's own format (one safetensors file per model, the config in its
  metadata; the shipped pair's and the trainer's).
* `shipped`: the trained pair in ``dspark_jax/assets`` (in that format, split into parts) and its
  tokenizer: `load_shipped`, `load_shipped_tokenizer`.
* `safetensors_io`: a directory's tensors (one ``model.safetensors``, or an index and its shards, in
  the Hugging Face layout), as NumPy arrays.
* `qwen3`: Hugging Face ``Qwen3ForCausalLM`` checkpoints as `dspark_jax.TargetModel`s and back.
* `deepspec`: DeepSpec ``Qwen3DSparkModel`` drafts; `speculators`: the speculators library's
  DSpark / DFlash drafts (vLLM's); `pretrained`: `load_pretrained` / `save_pretrained`.
"""
