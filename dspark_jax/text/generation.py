"""Decoding from text to text: `generate_text` wraps `dspark_jax.generate` with a `Tokenizer`.

This module owns the text-level contract of a decode:

* **Prompts** are strings, encoded with the tokenizer's post-processor (``add_special_tokens``); with
  ``chat=True`` each prompt is a string (one user message) or a list of message dicts, rendered by
  the tokenizer's chat template with the generation prompt and encoded without further special
  tokens (`Tokenizer.encode_chat`).
* **Stop tokens**: the tokenizer's `Tokenizer.stop_token_ids` (EOS of the model's configs and of the
  tokenizer) that exist in the target's vocabulary, plus any ``stop_token_ids`` the caller passes.
* **Stop strings** are matched twice. Inside the compiled loop, as token sequences
  (``generate(..., stop_sequences=...)``): each string's encoding and, for byte-level tokenizers
  (where a leading space belongs to the next token) when the string does not start with whitespace,
  also the encoding of ``" " + string``; the row stops as soon as its committed tokens end with one
  of them. That catches the usual tokenisations only: a string can also form across other token
  boundaries (``"\\n\\n"`` from two ``"\\n"`` tokens, or inside a longer token). So the decoded text
  is the reference: the completion ends at the first token whose decoded prefix contains a stop
  string, and the text is cut just before the earliest stop string in it. Then the finish reason is
  ``"stop_string"`` whichever way the string was found (the loop may have run past it; its
  statistics count those tokens).
* **Results**: per prompt a `TextResult` with the text (special tokens skipped unless asked), the
  token ids (up to and including the stop token or the tokens forming the stop string), the finish
  reason (``"stop_string"``, ``"stop_token"`` or ``"length"``), the row's τ and counts, and the
  batch's `GenerateResult` (τ, per-position acceptance and its counts, tokens/s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dspark_jax import validation
from dspark_jax.text.tokenizer import Tokenizer

FINISH_REASONS = ("stop_string", "stop_token", "length")


@dataclasses.dataclass(frozen=True)
class TextResult:
  """One prompt's completion.

  Attributes:
    text: the completion, cut before the first stop string; special tokens skipped unless
      ``skip_special_tokens=False``.
    token_ids: the completion's token ids (a stop token or the tokens that formed the stop string
      included; nothing after).
    finish_reason: "stop_string", "stop_token" or "length".
    stop: the stop string that ended the row (None unless finish_reason is "stop_string").
    prompt_token_ids: the encoded prompt (after the chat template, if any).
    tau: this row's tokens per round, 1 + accepted / rounds (1.0 for autoregressive decoding or a
      row with no round).
    rounds, accepted: this row's rounds and accepted drafts (counts for pooling).
    batch: the batch's `GenerateResult` (shared by every prompt of the call).
  """

  text: str
  token_ids: list[int]
  finish_reason: str
  stop: str | None
  prompt_token_ids: list[int]
  tau: float
  rounds: int
  accepted: int
  batch: Any

  @property
  def batch_tau(self) -> float:
    return float(self.batch.tau)

  @property
  def acceptance(self) -> np.ndarray:
    """[γ] the batch's per-position conditional acceptance."""
    return self.batch.acceptance

  @property
  def tokens_per_second(self) -> float:
    """The batch's generated tokens per second (compilation excluded)."""
    return float(self.batch.tokens_per_second)


def encode_prompts(tokenizer: Tokenizer, prompts, *, chat: bool = False,
                   chat_kwargs: Mapping[str, Any] | None = None,
                   add_special_tokens: bool = True) -> list[list[int]]:
  """Token ids of each prompt (module docstring). A single string is a batch of one.

  Raises:
    ValueError: a prompt of the wrong type (naming its index), one that encodes to no tokens, or
      ``chat=True`` with a tokenizer that has no chat template.
  """
  if isinstance(prompts, str):
    prompts = [prompts]
  if not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts: expected a non-empty list of strings"
                     + (" or message lists" if chat else ""))
  if chat_kwargs is not None and not isinstance(chat_kwargs, Mapping):
    raise ValueError(f"chat_kwargs: expected a mapping of template variables (a dict), got "
                     f"{type(chat_kwargs).__name__} {chat_kwargs!r}")
  encoded = []
  for i, prompt in enumerate(prompts):
    if chat:
      if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
      elif isinstance(prompt, Mapping) or not isinstance(prompt, Sequence):
        raise ValueError(f"prompts: entry {i} is a {type(prompt).__name__}; with chat=True each "
                         "prompt is a string or a list of message dicts (wrap one conversation "
                         "in a list)")
      ids = tokenizer.encode_chat(prompt, add_generation_prompt=True, **(chat_kwargs or {}))
    else:
      if not isinstance(prompt, str):
        raise ValueError(f"prompts: entry {i} is a {type(prompt).__name__}, not a string (pass "
                         "chat=True for message lists)")
      ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not ids:
      raise ValueError(f"prompts: entry {i} encodes to no tokens")
    encoded.append(ids)
  return encoded


def _stop_lists(stop, batch: int) -> list[list[str]]:
  """Stop strings per row: a string, a list shared by every row, or B lists (one per row)."""
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, Sequence):
    raise ValueError(f"stop: expected a string or a list of strings, got {type(stop).__name__}")
  if stop and all(isinstance(s, str) for s in stop):
    rows = [list(stop)] * batch
  elif stop and all(isinstance(s, Sequence) and not isinstance(s, str) for s in stop):
    if len(stop) != batch:
      raise ValueError(f"stop: {len(stop)} per-row lists for {batch} prompts")
    rows = [list(s) for s in stop]
  elif not stop:
    rows = [[] for _ in range(batch)]
  else:
    raise ValueError("stop: expected strings, or one list of strings per prompt")
  for r, row in enumerate(rows):
    for j, s in enumerate(row):
      if not isinstance(s, str) or not s:
        raise ValueError(f"stop: row {r} entry {j} is {s!r}; stop strings are non-empty strings")
  return rows


def stop_token_sequences(tokenizer: Tokenizer, strings: Sequence[str],
                         vocab_size: int | None = None) -> tuple[list[list[int]], list[int]]:
  """The token sequences matched in the loop for `strings` (module docstring) and, for each, the
  index of its string. Sequences with an id at or past `vocab_size` (never generated) are left out;
  duplicates are kept once."""
  sequences, owners, seen = [], [], set()
  for index, string in enumerate(strings):
    variants = [string]
    if tokenizer.is_byte_level and not string[0].isspace():
      variants.append(" " + string)
    for variant in variants:
      ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
      if not ids or ids in seen or (vocab_size is not None and max(ids) >= vocab_size):
        continue
      seen.add(ids)
      sequences.append(list(ids))
      owners.append(index)
  return sequences, owners


def _cut_at_stop(tokenizer: Tokenizer, tokens: list[int], stops: Sequence[str],
                 skip_special_tokens: bool) -> tuple[int, str, str] | None:
  """(n, text, stop): the fewest leading tokens whose text holds a stop string, that text cut before
  its earliest stop string, and that string; None when the whole text holds none."""
  decode = lambda n: tokenizer.decode(tokens[:n], skip_special_tokens=skip_special_tokens)
  holds = lambda text: any(s in text for s in stops)
  if not stops or not holds(decode(len(tokens))):
    return None
  low, high = 1, len(tokens)  # decoded prefixes only grow: the first n that holds one
  while low < high:
    middle = (low + high) // 2
    if holds(decode(middle)):
      high = middle
    else:
      low = middle + 1
  text = decode(low)
  position, stop = min((text.find(s), i) for i, s in enumerate(stops) if s in text)
  return low, text[:position], stops[stop]


def generate_text(target, draft, tokenizer: Tokenizer, prompts, params, key, *,
                  max_new_tokens: int | Sequence[int], stop=(), chat: bool = False,
                  spec: bool = True, skip_special_tokens: bool = True,
                  chat_kwargs: Mapping[str, Any] | None = None, add_special_tokens: bool = True,
                  **generate_kwargs) -> list[TextResult]:
  """Decodes text prompts to text with `dspark_jax.generate` (module docstring for the rules).

  Args:
    target, draft: the models (`draft` may be None with ``spec=False``).
    tokenizer: a `Tokenizer` whose ids are the target's.
    prompts: strings; with ``chat=True`` strings (one user message each) or message lists. A single
      string is a batch of one.
    params: `SamplingParams` with one row per prompt.
    key: base PRNG key.
    max_new_tokens: per-row budget (an int or one per prompt).
    stop: a stop string, a list shared by all prompts, or one list per prompt.
    chat: render prompts with the tokenizer's chat template; `chat_kwargs` go to the template
      (e.g. ``{"enable_thinking": False}``).
    spec: speculative decoding (default) or the autoregressive baseline.
    skip_special_tokens: leave special tokens out of the text.
    add_special_tokens: plain prompts go through the tokenizer's post-processor (e.g. a BOS).
    **generate_kwargs: passed to `dspark_jax.generate` (``stop_token_ids`` are added to the
      tokenizer's; ``mode``, ``backend``, ...).

  Returns:
    One `TextResult` per prompt, in order.

  Raises:
    ValueError: a bad prompt, stop string or tokenizer (naming it), or whatever `generate` refuses.
  """
  from dspark_jax import decoding

  if not isinstance(tokenizer, Tokenizer):
    raise ValueError(f"tokenizer: expected a dspark_jax Tokenizer, got {type(tokenizer).__name__}")
  if "stop_sequences" in generate_kwargs:
    raise ValueError("stop_sequences: pass stop strings as stop= (generate_text encodes them)")
  vocab = target.config.vocab_size
  validation.check_key("key", key)
  prompt_ids = encode_prompts(tokenizer, prompts, chat=chat, chat_kwargs=chat_kwargs,
                              add_special_tokens=add_special_tokens)
  batch = len(prompt_ids)
  stops = _stop_lists(stop, batch)
  extra = np.asarray(generate_kwargs.pop("stop_token_ids", ()))
  if extra.ndim > 1 or (extra.size and extra.dtype.kind not in "iu"):
    raise ValueError(f"stop_token_ids: generate_text takes integer ids shared by every prompt, "
                     f"got {extra.dtype} of shape {extra.shape}")
  extra = extra.reshape(-1).tolist()
  stop_ids = list(dict.fromkeys([int(i) for i in extra] +
                                [i for i in tokenizer.stop_token_ids if i < vocab]))
  if any(stops):
    per_row = [stop_token_sequences(tokenizer, row, vocab)[0] for row in stops]
    shared = all(row == stops[0] for row in stops)
    generate_kwargs["stop_sequences"] = per_row[0] if shared else per_row
  result = decoding.generate(target, draft, prompt_ids, params, key, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_ids, spec=spec, **generate_kwargs)
  reasons = getattr(result, "finish_reason", None)
  stop_index = getattr(result, "stop_index", None)
  out = []
  for b in range(batch):
    tokens = [int(t) for t in result.tokens[b, :int(result.lengths[b])]]
    if reasons is not None:
      reason = reasons[b]
    else:
      reason = "stop_token" if bool(result.finished[b]) else "length"
    matched = None
    cut = _cut_at_stop(tokenizer, tokens, stops[b], skip_special_tokens)
    if cut is not None:
      n, text, matched = cut
      tokens, reason = tokens[:n], "stop_string"
    elif reason == "stop_sequence":  # matched as tokens, but the text shows no stop string
      sequences, owners = stop_token_sequences(tokenizer, stops[b], vocab)
      index = int(stop_index[b])
      matched = stops[b][owners[index]]
      text = tokenizer.decode(tokens[:len(tokens) - len(sequences[index])],
                              skip_special_tokens=skip_special_tokens)
      reason = "stop_string"
    else:
      text = tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    rounds = int(result.row_rounds[b]) if result.row_rounds is not None else 0
    accepted = int(result.row_accepted[b]) if result.row_accepted is not None else 0
    out.append(TextResult(text=text, token_ids=tokens, finish_reason=reason, stop=matched,
                          prompt_token_ids=list(prompt_ids[b]),
                          tau=1.0 + accepted / rounds if rounds else 1.0, rounds=rounds,
                          accepted=accepted, batch=result))
  return out
