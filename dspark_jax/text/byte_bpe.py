"""The shipped pair's byte-level BPE tokenizer: its reserved tokens, and loading it with them checked.

This module owns the rule that ``<|endoftext|>`` has id 0 (it ends every training file, and is the
shipped models' EOS) and ``<|mask|>`` id 1 (the DSpark block filler). Training a tokenizer
(`dspark_jax.train.data`) and loading the shipped one (`dspark_jax.formats.shipped`) both keep it.
"""

from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (END_OF_TEXT, MASK)
END_OF_TEXT_ID, MASK_ID = 0, 1


def check_tokenizer(tokenizer) -> None:
  """Raises ValueError unless a ``tokenizers.Tokenizer`` holds the reserved tokens at their ids."""
  for token, expected in ((END_OF_TEXT, END_OF_TEXT_ID), (MASK, MASK_ID)):
    got = tokenizer.token_to_id(token)
    if got != expected:
      raise ValueError(f"tokenizer: {token!r} has id {got}, expected {expected}")


def load_tokenizer(path: str):
  """The ``tokenizers.Tokenizer`` saved at `path` (``tokenizer.save(path)``), its reserved ids
  checked."""
  from tokenizers import Tokenizer

  tokenizer = Tokenizer.from_file(path)
  check_tokenizer(tokenizer)
  return tokenizer
