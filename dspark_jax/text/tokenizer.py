"""Tokenizers for text in and out: a `tokenizers` model plus the special tokens, stop ids and chat
template that a Hugging Face model directory declares.

This module owns reading a tokenizer directory and the text-level contracts of the package:

* ``tokenizer.json`` (required): the `tokenizers` library's serialisation (vocabulary, merges,
  normalisation, pre-tokenisation, post-processing, decoder, added tokens).
* ``tokenizer_config.json`` (optional): the named special tokens (``bos_token``, ``eos_token``,
  ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``, as strings or
  ``AddedToken`` objects, and any other ``*_token`` string), ``extra_special_tokens`` /
  ``additional_special_tokens``, ``added_tokens_decoder`` (id -> token and its flags),
  ``chat_template`` (a string, or a list of ``{name, template}``), ``clean_up_tokenization_spaces``
  and ``split_special_tokens``. A ``chat_template.jinja`` file and
  ``additional_chat_templates/*.jinja`` take priority over the config's template, as in
  transformers.
* ``generation_config.json`` and ``config.json`` (optional): ``eos_token_id`` (an int or a list).

What transformers does on load is done here too: tokens of ``added_tokens_decoder`` that
``tokenizer.json`` lacks are added with their flags (their ids must be the ones declared), and a named
or extra special token that is not an added token yet becomes a special added token. Then
``encode``/``decode`` equal a ``PreTrainedTokenizerFast`` loaded from the same directory, and
`Tokenizer.apply_chat_template` renders as transformers does: a sandboxed jinja2 environment
(``ImmutableSandboxedEnvironment``) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block rendered as its body, a ``raise_exception(message)``
global, a ``strftime_now(format)`` global and a ``tojson`` filter that does not escape HTML
(``json.dumps`` with ``ensure_ascii=False`` by default); the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named special
tokens as strings, and the caller's keyword arguments (which override the special tokens).

Stop ids: `Tokenizer.eos_token_ids` are the ids generation ends on by the model's own declaration,
in the order transformers' ``generate`` and DeepSpec's evaluator look for them:
``generation_config.json``'s ``eos_token_id``, else ``config.json``'s, else the tokenizer's
``eos_token``. `Tokenizer.stop_token_ids` is the union of all three (no id twice, that order).

The shipped pair's tokenizer (`dspark_jax.formats.shipped`) is a `Tokenizer` built with
`Tokenizer.from_backend`; only there do ``<|endoftext|>`` = 0 and ``<|mask|>`` = 1 hold
(`dspark_jax.text.byte_bpe`). Loaded models take every id from their files.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from dspark_jax import validation

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_content(value: Any, where: str) -> dict | None:
  """A special-token entry (a string, or an ``AddedToken`` object) as AddedToken keyword arguments;
  None for null."""
  if value is None:
    return None
  if isinstance(value, str):
    return {"content": value}
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
             if k in value}
    return {"content": value["content"], **flags}
  raise ValueError(f"{where}: expected a token string or an AddedToken object, got {value!r}")


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ValueError(f"{path}: not valid JSON ({error})") from None


def _id_list(value: Any, where: str) -> list[int]:
  """``eos_token_id`` as a list: an int, a list of ints, or null (empty)."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  for i, v in enumerate(values):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise ValueError(f"{where}: entry {i} is {v!r}; expected a token id (an int >= 0)")
  return list(values)


class Tokenizer:
  """A `tokenizers.Tokenizer` with its special tokens, stop ids and chat templates.

  Build one with `load_tokenizer` (a model directory) or `Tokenizer.from_backend`.

  Attributes:
    backend: the `tokenizers.Tokenizer` (a private copy: the caller's object is never changed).
    special_tokens: named special tokens, ``{"eos_token": "<|im_end|>", ...}`` (only those set).
    extra_special_tokens: further special tokens (``additional_special_tokens``).
    chat_templates: ``{name: jinja source}``; the default one is ``"default"``.
    eos_token_ids, stop_token_ids: tuples of ids (module docstring).
    clean_up_tokenization_spaces: transformers' space clean-up after decoding (never for BPE).
  """

  def __init__(self, backend, *, special_tokens: Mapping[str, Any] | None = None,
               extra_special_tokens: Sequence[Any] = (),
               added_tokens_decoder: Mapping[int, Any] | None = None,
               chat_template: str | Mapping[str, str] | None = None,
               eos_token_ids: Sequence[int] | None = None,
               extra_stop_token_ids: Sequence[int] = (),
               clean_up_tokenization_spaces: bool = False, split_special_tokens: bool = False):
    """Wraps `backend` (copied first).

    Args:
      backend: a `tokenizers.Tokenizer`.
      special_tokens: named special tokens (strings or AddedToken dicts with ``content``); any key
        ending in ``_token``.
      extra_special_tokens: more special tokens (strings or AddedToken dicts).
      added_tokens_decoder: ``{id: token}`` that must exist at those ids (added when missing).
      chat_template: one jinja template, or ``{name: template}`` with a ``"default"``.
      eos_token_ids: the model's declared end ids (None: the ``eos_token``'s id).
      extra_stop_token_ids: further ids to stop on (joined into `stop_token_ids`).
      clean_up_tokenization_spaces: as transformers' flag of that name.
      split_special_tokens: encode special tokens' text as ordinary text (transformers' flag).

    Raises:
      ValueError: a declared token whose id disagrees with ``tokenizer.json``, or an eos token or id
        outside the vocabulary.
    """
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    if not isinstance(backend, Backend):
      raise ValueError(f"backend: expected a tokenizers.Tokenizer, got {type(backend).__name__}")
    self.backend = Backend.from_str(backend.to_str())
    self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
    self.backend.encode_special_tokens = bool(split_special_tokens)
    names: dict[str, str] = {}
    to_add: list[dict] = []
    for key, value in (special_tokens or {}).items():
      if not key.endswith("_token"):
        raise ValueError(f"special_tokens: {key!r} is not a '*_token' name")
      token = _token_content(value, f"special_tokens[{key!r}]")
      if token is not None:
        names[key] = token["content"]
        to_add.append({**token, "special": True})
    extras = []
    for i, value in enumerate(extra_special_tokens):
      token = _token_content(value, f"extra_special_tokens[{i}]")
      extras.append(token["content"])
      to_add.append({**token, "special": True})
    # added_tokens_decoder first, in id order, then the special tokens (transformers' order).
    declared = sorted((int(i), _token_content(t, f"added_tokens_decoder[{i}]"))
                      for i, t in (added_tokens_decoder or {}).items())
    added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
    for token_id, token in declared:
      if token["content"] not in added:
        self._add(AddedToken(**token), token.get("special", False))
        added.add(token["content"])
      got = self.backend.token_to_id(token["content"])
      if got != token_id:
        raise ValueError(f"added_tokens_decoder: {token['content']!r} is declared with id {token_id} "
                         f"but the tokenizer gives it id {got}")
    for token in to_add:
      if token["content"] not in added:
        self._add(AddedToken(**token), True)
        added.add(token["content"])
    self.special_tokens = names
    self.extra_special_tokens = tuple(extras)
    if chat_template is None:
      self.chat_templates = {}
    elif isinstance(chat_template, str):
      self.chat_templates = {"default": chat_template}
    else:
      self.chat_templates = dict(chat_template)
    eos = self.special_token_id("eos_token")
    if eos_token_ids is None:
      eos_token_ids = [] if eos is None else [eos]
    self.eos_token_ids = self._check_ids("eos_token_ids", eos_token_ids)
    stop = list(self.eos_token_ids) + list(extra_stop_token_ids) + ([] if eos is None else [eos])
    self.stop_token_ids = self._check_ids("stop_token_ids", list(dict.fromkeys(stop)))

  def _add(self, token, special: bool) -> None:
    if special:
      self.backend.add_special_tokens([token])
    else:
      self.backend.add_tokens([token])

  def _check_ids(self, name: str, ids: Sequence[int]) -> tuple[int, ...]:
    size = self.vocab_size
    for i, token_id in enumerate(ids):
      if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < size:
        raise ValueError(f"{name}: entry {i} is {token_id!r}; must be an id in [0, {size})")
    return tuple(int(i) for i in ids)

  @classmethod
  def from_backend(cls, backend, **kwargs) -> "Tokenizer":
    """The same as the constructor: a `tokenizers.Tokenizer` and keyword arguments of `__init__`."""
    return cls(backend, **kwargs)

  # ---- vocabulary ------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """Tokens, added tokens included (transformers' ``len(tokenizer)``)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def __len__(self) -> int:
    return self.vocab_size

  def get_vocab_size(self) -> int:
    return self.vocab_size

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  def special_token_id(self, name: str) -> int | None:
    """The id of the named special token (e.g. ``"eos_token"``), None when it is not set."""
    token = self.special_tokens.get(name)
    return None if token is None else self.backend.token_to_id(token)

  @property
  def eos_token_id(self) -> int | None:
    return self.special_token_id("eos_token")

  @property
  def bos_token_id(self) -> int | None:
    return self.special_token_id("bos_token")

  @property
  def pad_token_id(self) -> int | None:
    return self.special_token_id("pad_token")

  @property
  def all_special_ids(self) -> list[int]:
    """Ids of the named and extra special tokens, as transformers' ``all_special_ids``. (Decoding
    with ``skip_special_tokens`` drops every added token flagged special, which may be more.)"""
    ids = [self.backend.token_to_id(t) for t in (*self.special_tokens.values(),
                                                   *self.extra_special_tokens)]
    return list(dict.fromkeys(i for i in ids if i is not None))

  @functools.cached_property
  def is_byte_level(self) -> bool:
    """Whether the decoder is byte-level (GPT-2 style: a leading space is part of the next token)."""
    decoder = json.loads(self.backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)

  # ---- text <-> ids ----------------------------------------------------------------------------

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; `add_special_tokens` runs ``tokenizer.json``'s post-processor (e.g. a
    BOS), as transformers' ``encode`` does by default."""
    if not isinstance(text, str):
      raise ValueError(f"text: expected a string, got {type(text).__name__}")
    return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
    """The text of `ids` (a sequence or 1-D array); -1 entries (the package's padding) are dropped.
    Ids at or past `vocab_size` have no text and give none, as in the `tokenizers` library and
    transformers (a model's embedding table is often larger than its tokenizer).

    Raises:
      ValueError: an id below -1, naming its position.
    """
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    for position, token_id in enumerate(ids):
      if token_id < -1:
        raise ValueError(f"ids: entry {position} is {token_id}; must be a token id >= 0 or -1 "
                         "(padding)")
    text = self.backend.decode([i for i in ids if i >= 0], skip_special_tokens=skip_special_tokens)
    if self.clean_up_tokenization_spaces and self._model_type() != "BPE":
      for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text

  def _model_type(self) -> str:
    return type(self.backend.model).__name__

  # ---- chat ------------------------------------------------------------------------------------

  @property
  def chat_template(self) -> str | None:
    """The default chat template (None when the tokenizer has none)."""
    return self.chat_templates.get("default")

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, chat_template: str | None = None,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          documents: Sequence[Mapping[str, Any]] | None = None, **kwargs) -> str:
    """Renders a conversation with the chat template, as transformers'
    ``apply_chat_template(..., tokenize=False)`` does (module docstring).

    Note the default: ``add_generation_prompt=True`` (transformers defaults to False), because a
    prompt for generation is the common use here.

    Args:
      messages: dicts with at least ``role``; keys whose value is None are dropped first, and a
        message's reasoning under ``thinking``/``reasoning`` is also offered as
        ``reasoning_content`` (and ``thinking``), as transformers does.
      add_generation_prompt: end with the opening of an assistant turn.
      chat_template: a template name of `chat_templates`, or a jinja source (default: the
        ``"tool_use"`` template when `tools` are given and it exists, else ``"default"``).
      tools, documents: passed to the template as JSON-like data.
      **kwargs: more template variables (e.g. ``enable_thinking=False``).

    Raises:
      ValueError: no template, malformed messages, or the template's own ``raise_exception``.
    """
    import jinja2

    source = self._template_source(chat_template, tools)
    chat = _messages(messages)
    variables = {**self.special_tokens, **kwargs}
    try:
      return _compile(source).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                     add_generation_prompt=bool(add_generation_prompt),
                                     **_plain(variables))
    except jinja2.exceptions.TemplateError as error:
      raise ValueError(f"chat template: {error}") from error

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                  **kwargs) -> list[int]:
    """Token ids of the rendered conversation, encoded without the post-processor's special
    tokens (the template writes its own), as transformers' ``apply_chat_template`` does."""
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return self.encode(text, add_special_tokens=False)

  def _template_source(self, chat_template: str | None, tools) -> str:
    if chat_template is not None:
      return self.chat_templates.get(chat_template, chat_template)
    if tools is not None and "tool_use" in self.chat_templates:
      return self.chat_templates["tool_use"]
    if "default" in self.chat_templates:
      return self.chat_templates["default"]
    if self.chat_templates:
      raise ValueError(f"chat_template: the tokenizer has several templates and no default; pass "
                       f"one of {sorted(self.chat_templates)}")
    raise ValueError("chat_template: the tokenizer has no chat template (tokenizer_config.json "
                     "'chat_template' or chat_template.jinja); pass chat_template= or use plain text")

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens}, "
            f"stop_token_ids={list(self.stop_token_ids)}, chat_templates={sorted(self.chat_templates)})")


def _messages(messages) -> list[dict]:
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
    raise ValueError(f"messages: expected a list of message dicts, got {type(messages).__name__}")
  chat = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise ValueError(f"messages: entry {i} is a {type(message).__name__}, not a dict")
    if not isinstance(message.get("role"), str):
      raise ValueError(f"messages: entry {i} has no string 'role'")
    message = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    chat.append(message)
  return chat


def _plain(value: Any) -> Any:
  """A deep copy made of JSON-like types only (what a sandboxed template may see)."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if hasattr(value, "item") and callable(value.item):  # NumPy scalars
    return _plain(value.item())
  return f"<{type(value).__name__}>"


_TEMPLATES: dict[str, Any] = {}


def _compile(source: str):
  """The compiled template of `source` (cached), in transformers' environment."""
  template = _TEMPLATES.get(source)
  if template is not None:
    return template
  import jinja2
  from jinja2 import ext, sandbox

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format):
    return datetime.now().strftime(format)

  class Generation(ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
    transformers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  environment = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=[Generation, ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = strftime_now
  try:
    template = environment.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as error:
    raise ValueError(f"chat template: not valid jinja ({error.message}, line {error.lineno})") from None
  _TEMPLATES[source] = template
  return template


def load_tokenizer(directory: str) -> Tokenizer:
  """Loads the tokenizer of a Hugging Face model directory (module docstring for the files).

  Raises:
    TypeError: `directory` is not a path (str or os.PathLike).
    ValueError: ``tokenizer.json`` missing or unreadable, a config that is not JSON or has a bad
      field, a declared token id that disagrees with ``tokenizer.json``; each names the file.
  """
  from tokenizers import Tokenizer as Backend

  directory = validation.check_path("directory", directory)
  if not os.path.isdir(directory):
    raise ValueError(f"{directory}: not a directory")
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.exists(path):
    raise ValueError(f"{path}: missing (a tokenizer directory needs the tokenizers library's "
                     "tokenizer.json)")
  try:
    backend = Backend.from_file(path)
  except Exception as error:  # the tokenizers library raises its own exception type
    raise ValueError(f"{path}: not a readable tokenizer ({error})") from None

  config_path = os.path.join(directory, "tokenizer_config.json")
  config = _read_json(config_path) if os.path.exists(config_path) else {}
  if not isinstance(config, dict):
    raise ValueError(f"{config_path}: expected a JSON object")
  special: dict[str, Any] = {}
  for key, value in config.items():
    if key in NAMED_SPECIAL_TOKENS or (key.endswith("_token") and isinstance(value, str)):
      if value is not None:
        special[key] = value
  extras = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
  if isinstance(extras, Mapping):  # model-specific named tokens
    special.update({k: v for k, v in extras.items() if v is not None})
    extras = []
  if not isinstance(extras, list):
    raise ValueError(f"{config_path}: extra_special_tokens must be a list or an object")
  decoder = config.get("added_tokens_decoder") or {}
  if not isinstance(decoder, Mapping):
    raise ValueError(f"{config_path}: added_tokens_decoder must be an object")
  for key in decoder:
    if not str(key).isdigit():
      raise ValueError(f"{config_path}: added_tokens_decoder key {key!r} is not a token id")

  templates: dict[str, str] = {}
  raw = config.get("chat_template")
  if isinstance(raw, str):
    templates["default"] = raw
  elif isinstance(raw, list):
    for i, entry in enumerate(raw):
      if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
              and isinstance(entry.get("template"), str)):
        raise ValueError(f"{config_path}: chat_template entry {i} needs string 'name' and 'template'")
      templates[entry["name"]] = entry["template"]
  elif raw is not None:
    raise ValueError(f"{config_path}: chat_template must be a string or a list of "
                     "{name, template} objects")
  files: dict[str, str] = {}
  if os.path.exists(os.path.join(directory, CHAT_TEMPLATE_FILE)):
    files["default"] = os.path.join(directory, CHAT_TEMPLATE_FILE)
  extra_dir = os.path.join(directory, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        files[name[:-len(".jinja")]] = os.path.join(extra_dir, name)
  if files:  # template files replace the config's templates
    templates = {}
    for name, file in files.items():
      with open(file, encoding="utf-8") as f:
        templates[name] = f.read()

  declared: list[int] = []
  for name in ("generation_config.json", "config.json"):
    file = os.path.join(directory, name)
    if os.path.exists(file):
      values = _read_json(file)
      if not isinstance(values, dict):
        raise ValueError(f"{file}: expected a JSON object")
      declared.append(_id_list(values.get("eos_token_id"), f"{file}: eos_token_id"))
    else:
      declared.append([])
  eos = next((ids for ids in declared if ids), None)
  try:
    return Tokenizer(backend, special_tokens=special, extra_special_tokens=extras,
                     added_tokens_decoder={int(k): v for k, v in decoder.items()},
                     chat_template=templates or None, eos_token_ids=eos,
                     extra_stop_token_ids=[i for ids in declared for i in ids],
                     clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces",
                                                                  False)),
                     split_special_tokens=bool(config.get("split_special_tokens", False)))
  except ValueError as error:
    raise ValueError(f"{directory}: {error}") from None
