"""Conversation data for drafter training: jsonl in, packed token rows with a response mask out.

This module owns how a conversation file becomes training arrays:

* **Reading** (`read_conversations`). One JSON object per line, in either form: DeepSpec's
  ``{"turns": ["user text", "assistant text", ...]}`` (turns alternate user, assistant, starting
  with the user) or the common ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles
  ``system``, ``user``, ``assistant``; an assistant message may carry ``reasoning_content``). Blank
  lines are skipped. Every refusal is a `DataError` naming the file, the line and the field: an
  empty file, a line that is not a JSON object, neither key, a turn or message without a
  non-empty string ``content``, an unknown role, a conversation without an assistant turn.
* **Rendering** (`render`). The target's own chat template (`Tokenizer.apply_chat_template`, no
  generation prompt, template variables such as ``enable_thinking``) gives the text; the tokens are
  its encoding without the post-processor's special tokens. The **loss mask** is true exactly on
  the tokens of the assistant turns: for assistant message i the span starts where the rendering
  of the messages before it with a generation prompt stops agreeing with the whole rendering
  (their longest common prefix: the generation prompt's own text, e.g. an empty think block, is in
  the span only when the whole rendering has it too), and ends after the first end-of-turn marker
  that follows (the text the template writes after an assistant turn's content, found by rendering
  a probe conversation), so the drafter also learns to end a turn. A token belongs to the span when
  its first character does.
* **Packing** (`pack`). Conversations are laid into rows of a fixed length in file order, a row
  taking the next conversation while it fits (none is split); the rest of a row is padding whose
  mask is false. Positions run 0 .. L-1 along a row and a conversation attends to those before it in
  its row (no segment mask, as in pretraining-style packing): the target's law that the drafter
  learns is computed in that same context, so the loss stays consistent. A conversation longer
  than the row is refused (`DataError` naming its line).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant")
_PROBE = "\u2063probe\u2063"


class DataError(ValueError):
  """Bad training data; the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One conversation: its `messages` (dicts with ``role`` and ``content``) and the `line` of the
  file it came from (1-based; 0 when built in memory)."""

  messages: tuple[dict, ...]
  line: int = 0
  source: str = "<memory>"

  @property
  def where(self) -> str:
    return f"{self.source}:{self.line}"

  def prompt(self) -> list[dict]:
    """The messages before the first assistant turn (what a served request holds)."""
    for i, message in enumerate(self.messages):
      if message["role"] == "assistant":
        return [dict(m) for m in self.messages[:i]]
    return [dict(m) for m in self.messages]


def _check_content(value: Any, where: str, field: str) -> str:
  if not isinstance(value, str):
    got = "missing" if value is None else f"a {type(value).__name__}"
    raise DataError(f"{where}: {field} is {got}; expected a non-empty string")
  if not value.strip():
    raise DataError(f"{where}: {field} is empty; every turn needs content")
  return value


def parse_conversation(record: Any, where: str, *, need_assistant: bool = True) -> tuple[dict, ...]:
  """The messages of one record (either form of the module docstring); `DataError` naming
  `where` and the field otherwise."""
  if not isinstance(record, Mapping):
    raise DataError(f"{where}: expected a JSON object with 'turns' or 'messages', got "
                    f"{type(record).__name__}")
  if "messages" in record:
    raw = record["messages"]
    if not isinstance(raw, list) or not raw:
      raise DataError(f"{where}: messages must be a non-empty list")
    messages = []
    for i, message in enumerate(raw):
      if not isinstance(message, Mapping):
        raise DataError(f"{where}: messages[{i}] is a {type(message).__name__}, not an object")
      role = message.get("role")
      if role not in ROLES:
        raise DataError(f"{where}: messages[{i}].role is {role!r}; expected one of {ROLES}")
      entry = {"role": role, "content": _check_content(message.get("content"), where,
                                                        f"messages[{i}].content")}
      reasoning = message.get("reasoning_content")
      if role == "assistant" and reasoning is not None:
        entry["reasoning_content"] = _check_content(reasoning, where,
                                                    f"messages[{i}].reasoning_content")
      messages.append(entry)
  elif "turns" in record:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
      raise DataError(f"{where}: turns must be a non-empty list")
    messages = [{"role": ("user", "assistant")[i % 2],
                 "content": _check_content(turn, where, f"turns[{i}]")}
                for i, turn in enumerate(turns)]
  else:
    raise DataError(f"{where}: neither 'turns' nor 'messages' (keys: {sorted(record)[:8]})")
  if need_assistant and not any(m["role"] == "assistant" for m in messages):
    field = "messages" if "messages" in record else "turns"
    raise DataError(f"{where}: {field} has no assistant turn (nothing to learn from; a prompt "
                    "file is for `regenerate`)")
  return tuple(messages)


def read_conversations(path: str, *, need_assistant: bool = True) -> list[Conversation]:
  """The conversations of a jsonl file (module docstring).

  Raises:
    FileNotFoundError: no such file. DataError: an empty file, or a bad line (naming it).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data: {path} is not a file")
  out = []
  with open(path, encoding="utf-8") as f:
    for number, text in enumerate(f, start=1):
      if not text.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(text)
      except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg})") from None
      out.append(Conversation(parse_conversation(record, where, need_assistant=need_assistant),
                              number, path))
  if not out:
    raise DataError(f"{path}: the file holds no conversations (it is empty)")
  return out


def _common_prefix(a: str, b: str) -> int:
  n = min(len(a), len(b))
  i = 0
  while i < n and a[i] == b[i]:
    i += 1
  return i


def end_of_turn(tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> str:
  """The text a chat template writes right after an assistant turn's content (e.g.
  ``<|im_end|>``), whitespace stripped; "" when it writes nothing."""
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
      add_generation_prompt=False, **dict(template_kwargs or {}))
  at = text.rfind(_PROBE)
  return "" if at < 0 else text[at + len(_PROBE):].strip()


def check_chat_template(tokenizer, what: str) -> None:
  """DataError naming `what` unless the tokenizer has a chat template."""
  if getattr(tokenizer, "chat_template", None) is None:
    raise DataError(f"{what}: the tokenizer has no chat template (tokenizer_config.json "
                    "'chat_template' or chat_template.jinja); the training data is rendered with "
                    "the target's own template")


def render(tokenizer, conversation: Conversation, *,
           template_kwargs: Mapping[str, Any] | None = None,
           marker: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(ids [T] int32, mask [T] bool) of one conversation (module docstring); `marker` is
  `end_of_turn`'s text (computed when None)."""
  kwargs = dict(template_kwargs or {})
  messages = [dict(m) for m in conversation.messages]
  try:
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
  except ValueError as error:
    raise DataError(f"{conversation.where}: {error}") from None
  if marker is None:
    marker = end_of_turn(tokenizer, kwargs)
  spans, cursor = [], 0
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, **kwargs)
    start = max(_common_prefix(before, full), cursor)
    end = full.find(marker, start) if marker else -1
    end = len(full) if end < 0 else end + len(marker)
    spans.append((start, end))
    cursor = end
  encoding = tokenizer.backend.encode(full, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int32)
  starts = np.asarray([o[0] for o in encoding.offsets], np.int64)
  mask = np.zeros(len(ids), bool)
  for start, end in spans:
    mask |= (starts >= start) & (starts < end)
  return ids, mask


@dataclasses.dataclass
class Packed:
  """Packed training rows: `tokens` [N, L] int32, `mask` [N, L] bool (true on response tokens),
  and for each row the lines of the conversations it holds."""

  tokens: np.ndarray
  mask: np.ndarray
  lines: list[list[int]]

  @property
  def response_tokens(self) -> int:
    return int(self.mask.sum())


def pack(examples: Sequence[tuple[np.ndarray, np.ndarray]], length: int, pad_id: int, *,
         where: Sequence[str] | None = None) -> Packed:
  """Rows of `length` tokens from (ids, mask) examples (module docstring).

  Raises:
    DataError: an example longer than `length` (naming `where[i]`, else its index).
  """
  if isinstance(length, bool) or not isinstance(length, int) or length < 2:
    raise ValueError(f"length: expected an int >= 2, got {length!r}")
  rows_t, rows_m, lines = [], [], []
  current_t, current_m, current_l, used = [], [], [], 0
  for i, (ids, mask) in enumerate(examples):
    if len(ids) > length:
      name = where[i] if where is not None else f"conversation {i}"
      raise DataError(f"{name}: the conversation has {len(ids)} tokens, longer than the sequence "
                      f"length {length}; raise the sequence length or split it")
    if used + len(ids) > length:
      rows_t.append(current_t), rows_m.append(current_m), lines.append(current_l)
      current_t, current_m, current_l, used = [], [], [], 0
    current_t.append(ids)
    current_m.append(mask)
    current_l.append(i)
    used += len(ids)
  if current_t:
    rows_t.append(current_t), rows_m.append(current_m), lines.append(current_l)
  tokens = np.full((len(rows_t), length), pad_id, np.int32)
  masks = np.zeros((len(rows_t), length), bool)
  for r, (parts_t, parts_m) in enumerate(zip(rows_t, rows_m)):
    ids = np.concatenate(parts_t)
    tokens[r, :len(ids)] = ids
    masks[r, :len(ids)] = np.concatenate(parts_m)
  return Packed(tokens, masks, lines)


def pad_id_of(tokenizer) -> int:
  """The padding id: the tokenizer's pad token, else its eos token, else 0."""
  for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
    if token_id is not None:
      return int(token_id)
  return 0


def load_packed(path: str, tokenizer, length: int, *,
                template_kwargs: Mapping[str, Any] | None = None,
                conversations: Sequence[Conversation] | None = None) -> Packed:
  """`read_conversations` (or the given `conversations`), `render` each with the tokenizer's chat
  template, `pack` into rows of `length`; ``Packed.lines`` holds the file lines.

  Raises:
    DataError: as `read_conversations`, `check_chat_template` (naming `path`) and `pack`.
  """
  check_chat_template(tokenizer, f"{path}: tokenizer")
  if conversations is None:
    conversations = read_conversations(path)
  marker = end_of_turn(tokenizer, template_kwargs)
  examples = [render(tokenizer, c, template_kwargs=template_kwargs, marker=marker)
              for c in conversations]
  for conversation, (_, mask) in zip(conversations, examples):
    if not mask.any():
      raise DataError(f"{conversation.where}: the chat template rendered no assistant tokens")
  packed = pack(examples, length, pad_id_of(tokenizer), where=[c.where for c in conversations])
  packed.lines = [[conversations[i].line for i in row] for row in packed.lines]
  return packed
