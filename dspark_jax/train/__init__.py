"""Training: the corpus and tokenizer, the losses and the resumable trainer.

* `data`: the standard-library corpus, its deterministic split, the byte-level BPE tokenizer.
* `trainer`: `lm_loss`, `dspark_loss`, `make_optimizer`, the resumable `Trainer` and its train
  states. Model weights are written in `dspark_jax.formats.checkpoints`' format.
"""
