"""Training: the corpus and tokenizer, the losses and the resumable trainer, and the drafter
command built on them.

* `data`: the standard-library corpus, its deterministic split, the byte-level BPE tokenizer.
* `trainer`: `lm_loss`, `dspark_loss`, `make_optimizer`, the resumable `Trainer` and its train
  states. Model weights are written in `dspark_jax.formats.checkpoints`' format.
* `conversations`: conversation jsonl rendered with a target's chat template, masked to the
  responses and packed into fixed-length rows.
* `token_rows`: pre-tokenized rows and their loss mask, read from an ``.npz`` and checked.
* `drafter`: `train_drafter`, a DSpark drafter for a Hugging Face Qwen3 target (``dspark-jax
  train``).
* `regenerate`: the target's own answers to a prompt file (``dspark-jax regenerate``).
"""
