"""Checkpoint formats of other libraries: reading and writing their files exactly.

* `safetensors_io`: a directory's tensors (one ``model.safetensors``, or an index and its shards, in
  the Hugging Face layout), as NumPy arrays.
* `qwen3`: Hugging Face ``Qwen3ForCausalLM`` checkpoints as `dspark_jax.TargetModel`s and back.
"""
