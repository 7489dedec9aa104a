"""Tokenizers against transformers, chat templates, stop ids, and generate_text's text contract."""

import json
import os

import jax
import numpy as np
import pytest

from dspark_jax import decoding
from dspark_jax.formats import shipped
from dspark_jax.sampling import params as sp
from dspark_jax.text import generation
from dspark_jax.text import tokenizer as tk

# A Qwen-style chat template of our own: block tags on their own lines (trim_blocks/lstrip_blocks
# decide the whitespace), the bos_token variable, raise_exception, tojson, a template kwarg.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if message.role not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role: ' + message.role) }}
  {% elif message.role == 'system' and not loop.first %}
    {{ raise_exception('a system message must come first') }}
  {% endif %}
<|im_start|>{{ message.role }}
  {% if message.role == 'assistant' and message.reasoning_content %}
<think>
{{ message.reasoning_content | trim }}
</think>

  {% endif %}
  {% if message.role == 'assistant' %}
{% generation %}{{ message.content | trim }}<|im_end|>{% endgeneration %}

  {% else %}
{{ message.content | trim }}<|im_end|>
  {% endif %}
{% endfor %}
{% if tools %}
<|im_start|>tools
  {% for tool in tools %}
{{ tool | tojson }}
  {% endfor %}
<|im_end|>
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
  {% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

  {% endif %}
{% endif %}
"""

TEXTS = ["Hello world", " The lazy  dog\n\n", "héllo ✓ 日本 \t x",
         "<|im_start|>user\nhi<think>x</think><|im_end|>", "def add(x, y):\n    return x + y"]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "And now?", "name": None}],
]


def _token(content, special):
  return {"content": content, "lstrip": False, "rstrip": False, "normalized": False,
          "single_word": False, "special": special}


def write_tokenizer_dir(directory, *, template=TEMPLATE, generation_eos=(2, 0), config_eos=2):
  """A tiny byte-level BPE directory: tokenizer.json with <|endoftext|> = 0, <|im_start|> = 1,
  <|im_end|> = 2; tokenizer_config.json adding <think> = 300, </think> = 301 (not special) and the
  extra special token <|tool|> = 302; eos <|im_end|>, bos and pad <|endoftext|>. Returns its path."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  os.makedirs(directory, exist_ok=True)
  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(["The quick brown fox jumps over the lazy dog.",
                               "Speculative decoding drafts a block of tokens.",
                               "Hello, world! How are you today?",
                               "def add(x, y):\n    return x + y\n"] * 5, trainer=trainer)
  backend.save(os.path.join(directory, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "extra_special_tokens": ["<|tool|>"], "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {"0": _token("<|endoftext|>", True),
                                     "2": _token("<|im_end|>", True),
                                     "300": _token("<think>", False),
                                     "301": _token("</think>", False)}}
  if template is not None:
    config["chat_template"] = template
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
  if generation_eos is not None:
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": list(generation_eos)}, f)
  if config_eos is not None:
    with open(os.path.join(directory, "config.json"), "w") as f:
      json.dump({"eos_token_id": config_eos}, f)
  return str(directory)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def both(tok_dir):
  transformers = pytest.importorskip("transformers")
  return tk.load_tokenizer(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_tokenizer_equals_transformers(both):
  ours, hf = both
  assert type(hf).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
  assert len(ours) == len(hf) == 303
  assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
      hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (2, 0, 0)
  assert ours.all_special_ids == hf.all_special_ids == [0, 2, 302]
  for token in ("<think>", "</think>", "<|tool|>", "<|im_start|>"):
    assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token)
  assert ours.token_to_id("<think>") == 300 and ours.token_to_id("<|tool|>") == 302
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == hf.encode(text) == ours.encode(text, add_special_tokens=False), text
    for skip in (False, True):
      assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
  # Ids past the tokenizer's vocabulary have no text in either; -1 (padding) is dropped.
  assert ours.decode([276, 5000, -1, 292]) == hf.decode([276, 5000, 292])
  assert ours.is_byte_level


def test_chat_template_equals_transformers(both):
  ours, hf = both
  tools = [{"name": "add", "description": "adds <b>two</b> numbers é",
            "parameters": {"x": "int", "y": "int"}}]
  rendered = set()
  for chat in CHATS:
    for generation_prompt in (False, True):
      for kwargs in ({}, {"enable_thinking": False}, {"tools": tools}):
        text = ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, **kwargs)
        assert text == hf.apply_chat_template(chat, tokenize=False,
                                              add_generation_prompt=generation_prompt, **kwargs)
        ids = ours.encode_chat(chat, add_generation_prompt=generation_prompt, **kwargs)
        assert ids == hf.apply_chat_template(chat, add_generation_prompt=generation_prompt,
                                             **kwargs)["input_ids"]
        rendered.add(text)
  assert len(rendered) == len(CHATS) * 3 * 2 - len(CHATS)  # enable_thinking matters only with the prompt
  text = ours.apply_chat_template(CHATS[1])
  assert text == ("<|endoftext|>\n<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?"
                  "<|im_end|>\n<|im_start|>assistant\n")
  assert '"adds <b>two</b> numbers é"' in ours.apply_chat_template(CHATS[0], tools=tools)
  # raise_exception: transformers raises the template's error, we a ValueError with its message.
  import jinja2
  bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
  with pytest.raises(jinja2.exceptions.TemplateError, match="a system message must come first"):
    hf.apply_chat_template(bad, tokenize=False)
  with pytest.raises(ValueError, match="chat template: a system message must come first"):
    ours.apply_chat_template(bad)
  with pytest.raises(ValueError, match="chat template: unknown role: robot"):
    ours.apply_chat_template([{"role": "robot", "content": "x"}])
  # The caller's messages are not changed (reasoning aliases, dropped None values).
  assert CHATS[2][2] == {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"}
  assert CHATS[2][3] == {"role": "user", "content": "And now?", "name": None}


def test_template_file_and_stop_ids(tmp_path, both):
  transformers = pytest.importorskip("transformers")
  ours, _ = both
  # generation_config.json first, then config.json, then the tokenizer's eos.
  assert ours.eos_token_ids == (2, 0) and ours.stop_token_ids == (2, 0)
  only_config = tk.load_tokenizer(write_tokenizer_dir(tmp_path / "a", generation_eos=None,
                                                      config_eos=[0]))
  assert only_config.eos_token_ids == (0,) and only_config.stop_token_ids == (0, 2)
  bare = tk.load_tokenizer(write_tokenizer_dir(tmp_path / "b", generation_eos=None,
                                               config_eos=None, template=None))
  assert bare.eos_token_ids == bare.stop_token_ids == (2,) and bare.chat_template is None
  with pytest.raises(ValueError, match="has no chat template"):
    bare.encode_chat(CHATS[0])
  # chat_template.jinja takes priority over the config's template, as in transformers.
  directory = write_tokenizer_dir(tmp_path / "c")
  with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
    f.write("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
  ours_c = tk.load_tokenizer(directory)
  hf_c = transformers.AutoTokenizer.from_pretrained(directory)
  for chat in CHATS[:2]:
    assert ours_c.apply_chat_template(chat) == hf_c.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
  assert ours_c.apply_chat_template(CHATS[0]) == "[user] Hi there\n[assistant] "


def test_load_tokenizer_refuses_bad_directories(tmp_path):
  directory = write_tokenizer_dir(tmp_path / "t")
  with pytest.raises(ValueError, match="not a directory"):
    tk.load_tokenizer(str(tmp_path / "absent"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match=r"tokenizer.json: missing"):
    tk.load_tokenizer(str(empty))
  config = os.path.join(directory, "tokenizer_config.json")
  good = open(config).read()
  open(config, "w").write("{broken")
  with pytest.raises(ValueError, match=r"tokenizer_config.json: not valid JSON"):
    tk.load_tokenizer(directory)
  values = json.loads(good)
  values["added_tokens_decoder"]["7"] = _token("<think>", False)
  open(config, "w").write(json.dumps(values))
  with pytest.raises(ValueError, match=r"'<think>' is declared with id 7 but the tokenizer gives "
                                       r"it id 300"):
    tk.load_tokenizer(directory)
  open(config, "w").write(good)
  open(os.path.join(directory, "generation_config.json"), "w").write('{"eos_token_id": [2, "x"]}')
  with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id: entry 1 is 'x'"):
    tk.load_tokenizer(directory)
  open(os.path.join(directory, "generation_config.json"), "w").write('{"eos_token_id": 999}')
  with pytest.raises(ValueError, match=r"eos_token_ids: entry 0 is 999; must be an id in \[0, 303\)"):
    tk.load_tokenizer(directory)
  open(os.path.join(directory, "tokenizer.json"), "w").write('{"truncated": ')
  with pytest.raises(ValueError, match=r"tokenizer.json: not a readable tokenizer"):
    tk.load_tokenizer(directory)
  ours = shipped.load_shipped_tokenizer()
  with pytest.raises(ValueError, match=r"ids: entry 1 is -2"):
    ours.decode([5, -2])
  with pytest.raises(ValueError, match=r"messages: entry 0 has no string 'role'"):
    tk.Tokenizer(ours.backend, chat_template="x").apply_chat_template([{"content": "a"}])


def test_shipped_tokenizer_keeps_its_reserved_ids():
  ours = shipped.load_shipped_tokenizer()
  assert ours.token_to_id("<|endoftext|>") == 0 and ours.token_to_id("<|mask|>") == 1
  assert ours.eos_token_ids == ours.stop_token_ids == (0,)
  assert ours.special_token_id("mask_token") == 1 and ours.chat_template is None
  assert ours.vocab_size == 8192 and ours.is_byte_level
  text = "def f(x):\n    return x  # é\n"
  assert ours.decode(ours.encode(text)) == text


# ---- generate_text: the text contract on given tokens (generate replaced) ---------------------------


class _Fake:
  """Stands in for `decoding.generate`: returns fixed rows and records its arguments."""

  def __init__(self, rows, reasons=None, stop_index=None):
    self.rows, self.reasons, self.stop_index, self.kwargs = rows, reasons, stop_index, None

  def __call__(self, target, draft, prompts, params, key, **kwargs):
    self.kwargs, self.prompts = kwargs, prompts
    width = max(len(r) for r in self.rows)
    tokens = np.full((len(self.rows), width), -1, np.int32)
    for i, row in enumerate(self.rows):
      tokens[i, :len(row)] = row
    lengths = np.array([len(r) for r in self.rows])
    fields = dict(
        tokens=tokens, lengths=lengths, finished=np.array([r != "length" for r in self.reasons]),
        rounds=4, tau=2.5, acceptance=np.array([0.5, 0.25]), path="folded-greedy",
        wall_seconds=0.5, compile_seconds=0.0, reached=np.array([4, 2]),
        accepted=np.array([2, 1]), row_rounds=np.array([4, 2, 0])[:len(self.rows)],
        row_accepted=np.array([3, 0, 0])[:len(self.rows)],
        finish_reason=list(self.reasons), stop_index=np.asarray(self.stop_index))
    known = decoding.GenerateResult.__dataclass_fields__
    result = decoding.GenerateResult(**{k: v for k, v in fields.items() if k in known})
    for name in ("finish_reason", "stop_index"):  # before generate reports them itself
      if name not in known:
        setattr(result, name, fields[name])
    return result


class _Target:
  class config:
    vocab_size = 8192


def test_generate_text_cuts_text_and_tokens(monkeypatch):
  ours = shipped.load_shipped_tokenizer()
  enc = lambda s: ours.encode(s)
  body = enc("x = 1\n\ny = 2\n") + [0] + enc("z")
  stops = ["1\n\ny", "never"]
  fake = _Fake([body, enc("a = 1") + [0], enc("b = [1, 2, 3]")],
               reasons=["stop_token", "stop_token", "length"], stop_index=[-1, -1, -1])
  monkeypatch.setattr(decoding, "generate", fake)
  params = sp.SamplingParams(temperature=np.zeros(3))
  out = generation.generate_text(_Target, None, ours, ["p", "q", "r"], params,
                                 jax.random.key(0), max_new_tokens=16, stop=stops, spec=False,
                                 stop_token_ids=[5])
  # The stop string forms across token boundaries: text cut before it, tokens through it.
  first = out[0]
  assert first.finish_reason == "stop_string" and first.stop == "1\n\ny"
  assert first.text == "x = "
  assert "1\n\ny" in ours.decode(first.token_ids) and "1\n\ny" not in ours.decode(
      first.token_ids[:-1])
  assert first.token_ids == body[:len(first.token_ids)]
  # A stop token: the text skips it (a special token), the ids keep it.
  assert (out[1].finish_reason, out[1].text, out[1].token_ids[-1]) == ("stop_token", "a = 1", 0)
  assert (out[2].finish_reason, out[2].text, out[2].stop) == ("length", "b = [1, 2, 3]", None)
  assert out[0].tau == 1.75 and out[1].tau == 1.0 and out[2].tau == 1.0 and out[0].rounds == 4
  assert out[0].batch_tau == 2.5 and out[0].tokens_per_second == len(body + enc("a = 1") + [0]
                                                                       + enc("b = [1, 2, 3]")) / 0.5
  # What generate received: the caller's stop ids then the tokenizer's; each stop string's
  # encoding and its leading-space variant (byte-level), in order.
  assert fake.kwargs["stop_token_ids"] == [5, 0]
  assert fake.kwargs["stop_sequences"] == [enc("1\n\ny"), enc(" 1\n\ny"), enc("never"),
                                           enc(" never")]
  assert fake.prompts == [enc("p"), enc("q"), enc("r")]
  # A match of the token sequences whose text shows no stop string (e.g. skipped specials) cuts
  # the matched tokens.
  special = ours.decode([1])
  sequences, owners = generation.stop_token_sequences(ours, ["x", special], 8192)
  assert [1] in sequences and owners[sequences.index([1])] == 1
  fake = _Fake([enc("a b") + [1]], reasons=["stop_sequence"], stop_index=[sequences.index([1])])
  monkeypatch.setattr(decoding, "generate", fake)
  [res] = generation.generate_text(_Target, None, ours, "p", sp.SamplingParams(temperature=[0.0]),
                                   jax.random.key(0), max_new_tokens=8, stop=["x", special],
                                   spec=False)
  assert (res.finish_reason, res.stop, res.text) == ("stop_string", special, "a b")


def test_generate_text_refuses_bad_arguments():
  ours = shipped.load_shipped_tokenizer()
  params = sp.SamplingParams(temperature=[0.0])
  call = lambda **kw: generation.generate_text(_Target, None, ours, kw.pop("prompts", ["p"]),
                                               params, jax.random.key(0), max_new_tokens=4, **kw)
  with pytest.raises(ValueError, match=r"stop: row 0 entry 1 is ''"):
    call(stop=["a", ""])
  with pytest.raises(ValueError, match=r"stop: 2 per-row lists for 1 prompts"):
    call(stop=[["a"], ["b"]])
  with pytest.raises(ValueError, match=r"prompts: entry 0 is a list, not a string"):
    call(prompts=[[{"role": "user", "content": "x"}]])
  with pytest.raises(ValueError, match=r"prompts: entry 0 is a dict; with chat=True"):
    call(prompts=[{"role": "user", "content": "x"}], chat=True)
  with pytest.raises(ValueError, match=r"chat_template: the tokenizer has no chat template"):
    call(chat=True)
  with pytest.raises(ValueError, match=r"prompts: entry 0 encodes to no tokens"):
    call(prompts=[""])
  with pytest.raises(ValueError, match=r"stop_token_ids: generate_text takes integer ids shared"):
    call(stop_token_ids=[[1], [2]])
  with pytest.raises(ValueError, match=r"stop_token_ids: generate_text takes integer ids shared"):
    call(stop_token_ids=[1.5])
  with pytest.raises(ValueError, match=r"stop_sequences: pass stop strings as stop="):
    call(stop_sequences=[[1]])
  with pytest.raises(ValueError, match=r"tokenizer: expected a dspark_jax Tokenizer"):
    generation.generate_text(_Target, None, ours.backend, ["p"], params, jax.random.key(0),
                             max_new_tokens=4)


# ---- generate_text on the shipped pair ---------------------------------------------------------------


SHIPPED_CHAT = ("{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}def answer():\n{% endif %}")


@pytest.mark.slow  # one compiled program of the shipped pair: about 10 s on 2 cores
def test_generate_text_on_the_shipped_pair():
  if not hasattr(decoding.GenerateResult, "__dataclass_fields__") or \
      "finish_reason" not in decoding.GenerateResult.__dataclass_fields__:
    pytest.skip("generate has no stop_sequences/finish_reason yet (decoding's stop sequences)")
  pair = shipped.load_shipped()
  chat_tokenizer = tk.Tokenizer(pair.tokenizer.backend, chat_template=SHIPPED_CHAT,
                                special_tokens={"eos_token": "<|endoftext|>"})
  params = sp.SamplingParams(temperature=np.zeros(2))
  prompts = ["def add(x, y):\n    ", "    def __repr__(self):\n        return "]
  common = dict(max_new_tokens=24, stop=[["\n"], ["never seen"]])
  out = generation.generate_text(pair.target, pair.draft, pair.tokenizer, prompts, params,
                                 jax.random.key(0), **common)
  first, second = out
  assert first.finish_reason == "stop_string" and first.stop == "\n"
  assert first.text and "\n" not in first.text and "\n" in pair.decode(first.token_ids)
  assert pair.decode(first.token_ids).startswith(first.text)
  assert "\n" not in pair.decode(first.token_ids[:-1])
  assert first.prompt_token_ids == pair.encode(prompts[0])
  assert second.finish_reason in ("length", "stop_token")
  if second.finish_reason == "length":
    assert len(second.token_ids) == 24 and second.text == pair.decode(second.token_ids)
  else:
    assert second.token_ids[-1] == 0 and len(second.token_ids) <= 24
  assert first.batch is second.batch and first.batch.tau >= 1.0 and second.rounds >= 1
  # Chat: the prompt is the rendered template, encoded without the post-processor's tokens.
  chats = [[{"role": "user", "content": "add two numbers"}], "sort a list"]
  out = generation.generate_text(pair.target, pair.draft, chat_tokenizer, chats, params,
                                 jax.random.key(0), chat=True, **common)
  assert out[0].prompt_token_ids == pair.encode("# user: add two numbers\ndef answer():\n")
  assert out[1].prompt_token_ids == pair.encode("# user: sort a list\ndef answer():\n")
  assert out[0].finish_reason in ("stop_string", "stop_token", "length")
  assert all("\n" not in r.text for r in out if r.finish_reason == "stop_string")
