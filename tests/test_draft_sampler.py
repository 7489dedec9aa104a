"""DraftSampler: routing, buckets and padding, the memory gate (OFF/AUTO/FORCE), compile guard."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.draft import proposer as draft_sampler
from dspark_jax.draft import memory_gate
from dspark_jax.draft import block as proposal
from tests import helpers

GAMMA, VOCAB, RANK, HIDDEN = 4, 96, 8, 6
BIG = {"bytes_limit": 64 * 2**30, "bytes_in_use": 2**30}
SMALL = {"bytes_limit": 2 * 2**30, "bytes_in_use": 2**30 + 2**20}


def _build(kind="rnn", max_batch_size=8, **kwargs):
  head = helpers.make_head(kind, VOCAB, RANK, HIDDEN)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(HIDDEN + RANK, GAMMA))
  kwargs.setdefault("memory_stats", BIG)
  return dj.build_draft_sampler(head, max_batch_size=max_batch_size, vocab_size=VOCAB, gamma=GAMMA,
                                logits_dtype=jnp.float32, confidence_head=conf, **kwargs)


def _batch(batch, temperature=None, seed=0):
  rng = np.random.default_rng(seed)
  temperature = (np.where(np.arange(batch) % 2, 0.9, 0.0) if temperature is None
                 else np.asarray(temperature))
  return dict(base_logits=jnp.asarray(rng.normal(size=(batch, GAMMA, VOCAB)), jnp.float32),
              anchor=jnp.asarray(rng.integers(0, VOCAB, batch), jnp.int32),
              hidden=jnp.asarray(rng.normal(size=(batch, GAMMA, HIDDEN)), jnp.float32),
              params=dj.SamplingParams(temperature=temperature, seed=np.arange(batch) + 100),
              key=jax.random.key(5), positions=jnp.arange(batch, dtype=jnp.int32) * 3)


def test_bucket_sizes():
  assert draft_sampler.bucket_sizes(1) == (1,)
  assert draft_sampler.bucket_sizes(8) == (1, 2, 4, 8)
  assert draft_sampler.bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
  with pytest.raises(ValueError, match="max_batch_size"):
    draft_sampler.bucket_sizes(0)


def test_routing_follows_the_batch_and_the_gate():
  sampler = _build(mode="auto")
  assert sampler.folded_sampling
  inputs = _batch(5)
  mixed = sampler.propose(**inputs)
  assert mixed.path == "folded-sampling" and mixed.corrected_logits.shape == (5, GAMMA, VOCAB)
  greedy = sampler.propose(**dict(inputs, params=dj.SamplingParams(temperature=np.zeros(5))))
  assert greedy.path == "folded-greedy" and greedy.corrected_logits is None
  assert greedy.confidence.shape == (5, GAMMA)
  off = _build(mode="off")
  assert not off.folded_sampling
  assert off.propose(**inputs).path == "eager"
  assert off.propose(**dict(inputs, params=dj.SamplingParams(temperature=np.zeros(5)))).path == \
      "folded-greedy"


def test_every_path_gives_the_same_block():
  inputs = _batch(6)
  folded = _build(mode="force").propose(**inputs)
  eager = _build(mode="off").propose(**inputs)
  reference = dj.sample_block(_build().head, **inputs, confidence_head=_build().confidence_head)
  for block in (eager, reference):
    helpers.assert_same_block(folded, block, fields=("tokens", "corrected_logits"))
    # The folded call ran padded to bucket 8: a [8, H] product may round its last bit differently
    # from a [6, H] one. Confidence is a float output, so equal to float32 rounding is the contract.
    np.testing.assert_allclose(folded.confidence, block.confidence, rtol=1e-5)
  np.testing.assert_array_equal(folded.greedy_mask, np.arange(6) % 2 == 0)


def test_padding_never_changes_a_row():
  sampler = _build(mode="force", max_batch_size=16)
  inputs = _batch(16)
  full = sampler.propose(**inputs)
  for batch in (1, 3, 5, 9):  # buckets 1, 4, 8, 16
    part = sampler.propose(**{k: (v if k == "key" else
                                  (dj.SamplingParams(temperature=v.temperature[:batch],
                                                     seed=v.seed[:batch]) if k == "params"
                                   else v[:batch])) for k, v in inputs.items()})
    if batch == 1:  # row 0 is greedy: the all-greedy path, which emits no corrected logits
      assert part.path == "folded-greedy"
      np.testing.assert_array_equal(part.tokens, full.tokens[:1])
      continue
    head = jax.tree.map(lambda x: x[:batch], full)
    helpers.assert_same_block(part, head, fields=("tokens", "corrected_logits"))


@pytest.mark.parametrize("form", ["auto", "pallas"])
def test_steady_state_never_recompiles(form):
  # Counted two ways: the sampler's own program count, and XLA backend compilations seen by
  # jax.monitoring while proposing shapes that were proposed before. "pallas" covers the kernel
  # form's extra jitted pieces (its per-step kernel wrapper, the up-front noise).
  sampler = _build(mode="force", max_batch_size=8, form=form)
  sampler.warmup(jnp.float32)
  programs = sampler.compilations
  assert programs == 2 * len(sampler.buckets)

  def one_round():
    for batch in (8, 5, 3, 1):
      inputs = _batch(batch, seed=batch)
      sampler.propose(**inputs).tokens.block_until_ready()
      greedy = dj.SamplingParams(temperature=np.zeros(batch))
      sampler.propose(**dict(inputs, params=greedy)).tokens.block_until_ready()

  one_round()  # first sight of each batch size (host-side helpers may compile here)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration") else None)
  try:
    one_round()
    one_round()
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == []
  assert sampler.compilations == programs


def test_auto_gate_decisions_with_injected_stats(caplog):
  need = memory_gate.sampling_need_bytes(8, VOCAB, GAMMA, jnp.float32)
  assert need == 8 * VOCAB * 4 + 8 * GAMMA * VOCAB * 4
  on = _build(mode="auto", memory_stats=BIG)
  assert on.folded_sampling and on.decision.free_bytes == 63 * 2**30
  assert on.decision.compiled_bytes is not None and on.decision.compiled_bytes > 0
  with caplog.at_level(logging.WARNING, logger="dspark_jax"):
    off = _build(mode="auto", memory_stats=SMALL)
  assert not off.folded_sampling
  assert off.decision.free_bytes == 2**30 - 2**20
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "force" in warnings[0].getMessage().lower()
  assert off.propose(**_batch(4)).path == "eager"
  # headroom is the threshold: exactly enough passes, one byte short fails.
  free = 10 * 2**30
  stats = {"bytes_limit": free, "bytes_in_use": 0}
  assert _build(mode="auto", memory_stats=stats, headroom_bytes=free - need).folded_sampling
  assert not _build(mode="auto", memory_stats=stats, headroom_bytes=free - need + 1).folded_sampling
  # A callable is accepted, and FORCE ignores memory.
  assert _build(mode="auto", memory_stats=lambda: BIG).folded_sampling
  assert _build(mode="force", memory_stats=SMALL).folded_sampling


def test_free_memory_fallbacks():
  f = memory_gate.free_bytes_from_stats
  assert f(None) is None and f({}) is None
  assert f({"bytes_limit": 10, "bytes_in_use": 3}) == 7
  assert f({"bytes_reservable_limit": 10, "bytes_reserved": 4}) == 6
  assert f({"bytes_limit": 10}) == 10
  assert f({"largest_free_block_bytes": 5}) == 5
  assert f({"bytes_limit": 3, "bytes_in_use": 9}) == 0
  # A device that reports nothing usable: AUTO stays greedy-only and says why.
  sampler = _build(mode="auto", memory_stats={"num_allocs": 3})
  assert not sampler.folded_sampling and "unknown" in sampler.decision.reason
  # The CPU policy: the host's available memory.
  device = jax.local_devices()[0]
  free, source = memory_gate.probe_free_bytes(None, device)
  if device.platform == "cpu" and not device.memory_stats():
    assert free > 0 and "host MemAvailable" in source
  else:
    assert free is None or free > 0


@pytest.mark.parametrize("value,expected", [
    ("off", dj.FoldedSampling.OFF), ("AUTO", dj.FoldedSampling.AUTO),
    (" Force ", dj.FoldedSampling.FORCE), ("", dj.FoldedSampling.AUTO),
])
def test_mode_from_environment(monkeypatch, value, expected):
  monkeypatch.setenv(memory_gate.ENV_VAR, value)
  assert memory_gate.resolve_mode(None) is expected
  assert _build(mode=None).decision.mode is expected


def test_bad_mode_is_rejected(monkeypatch):
  monkeypatch.setenv(memory_gate.ENV_VAR, "sometimes")
  with pytest.raises(ValueError, match="DSPARK_JAX_FOLDED_SAMPLING.*'sometimes'"):
    _build(mode=None)
  monkeypatch.delenv(memory_gate.ENV_VAR)
  assert memory_gate.resolve_mode(None) is dj.FoldedSampling.AUTO
  with pytest.raises(ValueError, match="mode: expected one of off\\|auto\\|force"):
    _build(mode="always")


@pytest.mark.parametrize("edit,match", [
    (lambda d: dict(d, base_logits=jnp.zeros((9, GAMMA, VOCAB))), "9 rows exceed max_batch_size=8"),
    (lambda d: dict(d, base_logits=jnp.zeros((2, GAMMA, VOCAB + 1))), "vocab 97 does not match"),
    (lambda d: dict(d, base_logits=jnp.zeros((2, GAMMA + 1, VOCAB))), "γ=5 does not match"),
    (lambda d: dict(d, base_logits=jnp.zeros((2, GAMMA, VOCAB), jnp.bfloat16)), "dtype bfloat16"),
    (lambda d: dict(d, hidden=None), "hidden: a 'rnn' head needs"),
])
def test_propose_rejects_bad_inputs(edit, match):
  with pytest.raises(ValueError, match=match):
    _build().propose(**edit(_batch(2)))


def test_build_rejects_bad_arguments():
  head = helpers.make_head("vanilla", VOCAB, RANK, HIDDEN)
  with pytest.raises(ValueError, match="vocab_size: 95 does not match"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=95, gamma=2)
  with pytest.raises(ValueError, match="gamma: must be >= 1"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=0)
  with pytest.raises(ValueError, match="form: expected \"auto\" or one of"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, form="fused")
  with pytest.raises(ValueError, match="form: \"pallas\" needs a vocab divisible by 16, got 90"):
    dj.build_draft_sampler(helpers.make_head("vanilla", 90, RANK, HIDDEN), max_batch_size=2,
                           vocab_size=90, gamma=2, form="pallas")
  with pytest.raises(ValueError, match="logits_dtype"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, logits_dtype=jnp.int32)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(HIDDEN))
  with pytest.raises(ValueError, match="hidden_size: required"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, confidence_head=conf)
  vanilla = dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2,
                                   logits_dtype=jnp.float32, confidence_head=conf, hidden_size=HIDDEN)
  assert vanilla.hidden_size == HIDDEN


def test_auto_form_policy():
  # The measured choice (BENCHMARKS.md, issue 6); "loop" off the GPU.
  choose = proposal.choose_form
  assert choose(False, 129280, "cpu") == "loop" and choose(True, 129280, "cpu") == "loop"
  assert choose(True, 129280, "gpu") == "pallas" and choose(False, 151936, "gpu") == "pallas"
  assert choose(False, 95, "gpu") == "loop"  # no 16-column tile divides V
  assert choose(True, 95, "gpu") == "unrolled"


def test_prepared_head_arrays_on_a_hopper_gpu(monkeypatch):
  # Where its buckets may run a Hopper kernel (`proposal.reads_w2_parts`), the sampler compiles
  # and calls its programs with the head's arrays prepared (W2 part by part as well). Posing as
  # such a GPU here (V = 128): the arrays are prepared and the blocks do not change (on the CPU no
  # kernel reads the parts).
  head = helpers.make_head("vanilla", 128, RANK, HIDDEN)
  rng = np.random.default_rng(3)
  inputs = dict(base_logits=jnp.asarray(rng.normal(size=(5, GAMMA, 128)), jnp.float32),
                anchor=jnp.arange(5, dtype=jnp.int32), hidden=None,
                params=dj.SamplingParams(temperature=[0.0, 0.9, 1.0, 0.0, 1.3], seed=np.arange(5)),
                key=jax.random.key(5), positions=jnp.arange(5, dtype=jnp.int32) * 3)
  build = lambda: dj.build_draft_sampler(head, max_batch_size=8, vocab_size=128, gamma=GAMMA,
                                         logits_dtype=jnp.float32, memory_stats=BIG)
  plain = build().propose(**inputs)
  monkeypatch.setattr(proposal, "reads_w2_parts", lambda batch, vocab, device=None: True)
  sampler = build()
  posed = sampler.propose(**inputs)
  assert set(sampler._weights[0]) == {"w1", "w2", "w2_parts"}
  np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(posed.tokens))
  np.testing.assert_array_equal(np.asarray(plain.corrected_logits),
                                np.asarray(posed.corrected_logits))
