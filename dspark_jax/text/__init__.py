"""Text in and text out: tokenizers with their special tokens, stop ids and chat templates
(`tokenizer`), and decoding from strings to strings with stop strings (`generation`)."""

from dspark_jax.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["load_tokenizer", "Tokenizer"]
