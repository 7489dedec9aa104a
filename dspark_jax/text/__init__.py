"""Text in and text out: tokenizers with their special tokens, stop ids and chat templates
(`tokenizer`), the shipped pair's byte-level BPE and its reserved ids (`byte_bpe`), and decoding from
strings to strings with stop strings (`generation`)."""

from dspark_jax.text.generation import TextResult, encode_prompts, generate_text
from dspark_jax.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["encode_prompts", "generate_text", "load_tokenizer", "TextResult", "Tokenizer"]
