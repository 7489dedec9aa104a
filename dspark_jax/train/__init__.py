"""Training: the corpus and tokenizer, the losses and the resumable trainer, checkpoints.

* `data`: the standard-library corpus, its deterministic split, the byte-level BPE tokenizer.
* `trainer`: `lm_loss`, `dspark_loss`, `make_optimizer`, the resumable `Trainer`.
* `checkpoints`: safetensors weights with their configs, and resumable train states.
"""
