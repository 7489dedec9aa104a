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
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from tests import helpers

GAMMA, VOCAB, RANK, HIDDEN = 4, 96, 8, 6
BIG = {"bytes_limit": 64 * 2**30, "bytes_in_use": 2**30}
SMALL = {"bytes_limit": 2 * 2**30, "bytes_in_use": 2**30 + 2**20}


def _build(kind="rnn", max_batch_size=8, rank=RANK, **kwargs):
  head = helpers.make_head(kind, VOCAB, rank, HIDDEN)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(HIDDEN + rank, GAMMA))
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.kernel)])
def test_steady_state_never_recompiles(backend):
  # Counted two ways: the sampler's own program count, and XLA backend compilations seen by
  # jax.monitoring while proposing shapes that were proposed before. "triton" (in Pallas'
  # interpreter; r = 16, the kernel's least) covers the kernel backend's extra jitted pieces (its
  # per-step kernel wrapper, the up-front noise).
  sampler = _build(mode="force", max_batch_size=8, backend=backend,
                   rank=16 if backend == "triton" else RANK)
  assert {c.name for c in sampler.backends.values()} == {"xla" if backend == "auto" else backend}
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
  with pytest.raises(ValueError, match="^backend: expected 'auto', 'xla', 'triton' or 'hopper', "
                                       "got 'fused'"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, backend="fused")
  # An explicit backend must run at every bucket: the error names the failed precondition.
  with pytest.raises(ValueError, match="^backend 'triton': precondition failed: V has a "
                                       "power-of-two tile of at least 16 columns"):
    dj.build_draft_sampler(helpers.make_head("vanilla", 90, 16, HIDDEN), max_batch_size=2,
                           vocab_size=90, gamma=2, backend="triton")
  with pytest.raises(ValueError, match="^backend 'triton': precondition failed: r is a multiple "
                                       "of 16"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, backend="triton")
  with pytest.raises(ValueError, match="^backend 'hopper': precondition failed: W2 and the logits "
                                       "are bfloat16"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, backend="hopper",
                           logits_dtype=jnp.float32)
  with pytest.raises(ValueError, match="^config: TritonConfig is not a setting of backend 'xla'"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, backend="xla",
                           config=dispatch.TritonConfig())
  with pytest.raises(ValueError, match="logits_dtype"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, logits_dtype=jnp.int32)
  conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(HIDDEN))
  with pytest.raises(ValueError, match="hidden_size: required"):
    dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2, confidence_head=conf)
  vanilla = dj.build_draft_sampler(head, max_batch_size=2, vocab_size=VOCAB, gamma=2,
                                   logits_dtype=jnp.float32, confidence_head=conf, hidden_size=HIDDEN)
  assert vanilla.hidden_size == HIDDEN


def test_backends_record_the_choice_and_its_reason(monkeypatch):
  # `DraftSampler.backends`: the choice per enabled variant and bucket; `DraftBlock.backend`: the
  # choice that drafted a folded block (None on the eager path). On the CPU "auto" is XLA.
  sampler = _build(mode="force")
  backends = sampler.backends
  assert set(backends) == {(variant, bucket) for variant in ("greedy", "sampling")
                           for bucket in sampler.buckets}
  for (variant, bucket), choice in backends.items():
    assert choice is sampler.choice(variant == "greedy", bucket)
    if jax.default_backend() == "cpu":
      assert choice.backend is dispatch.Backend.XLA and choice.config.form == "loop"
      assert choice.reason.startswith("auto: cpu is not a GPU")
  inputs = _batch(5)
  mixed = sampler.propose(**inputs)
  assert mixed.backend is backends[("sampling", 8)]
  greedy = sampler.propose(**dict(inputs, params=dj.SamplingParams(temperature=np.zeros(5))))
  assert greedy.backend is backends[("greedy", 8)]
  gate_off = _build(mode="off")  # no folded sampling variant: no sampling backends
  assert set(gate_off.backends) == {("greedy", bucket) for bucket in gate_off.buckets}
  assert gate_off.propose(**inputs).backend is None  # the eager path
  # `sample_block` records its own decision; an explicit backend says it was asked for.
  head, conf = sampler.head, sampler.confidence_head
  block = dj.sample_block(head, **inputs, confidence_head=conf)
  assert block.backend == proposal.choose_backend(head.arrays(), inputs["base_logits"],
                                                  kind=head.kind, greedy_only=False,
                                                  confidence=True)
  forced = dj.sample_block(head, **inputs, confidence_head=conf, backend="xla",
                           config=dispatch.XlaConfig(form="unrolled"))
  assert forced.backend.backend is dispatch.Backend.XLA
  assert forced.backend.config == dispatch.XlaConfig(form="unrolled")
  assert forced.backend.reason.startswith("xla requested")
  assert dj.sample_block_eager(head, **inputs, confidence_head=conf).backend is None
  # $DSPARK_JAX_BACKEND is read where `backend` is None.
  monkeypatch.setenv(dispatch.ENV_VAR, "xla")
  from_env = _build(mode="force")
  assert from_env.backend is None
  assert all(c.reason.startswith("xla requested") for c in from_env.backends.values())
  monkeypatch.setenv(dispatch.ENV_VAR, "sometimes")
  with pytest.raises(ValueError, match=r"^\$DSPARK_JAX_BACKEND: expected 'auto'"):
    _build(mode="force")


@pytest.mark.slow
@pytest.mark.kernel
def test_head_arrays_prepared_once_where_a_bucket_runs_the_hopper_kernels(monkeypatch):
  # Where any bucket runs the Hopper kernels the sampler compiles and calls all its programs with
  # the head's arrays prepared once (`pallas_block.head_arrays_for`: W2 part by part as well, which
  # those kernels read). Here bucket 64 runs them (in the interpreter on the CPU: `dispatch.choose`
  # patched to ask for "hopper" there; bf16, V = 128, r = 64) and the other buckets what they ran
  # before (XLA on the CPU, which ignores the parts). Against a sampler without the patch: the
  # other buckets' blocks are the same (the same arithmetic); the Hopper bucket's agree
  # (`assert_blocks_agree`: the kernel sums v @ W2 in its own order).
  vocab, rank = 128, 64
  arrays = helpers.head_arrays("vanilla", vocab, rank, HIDDEN, seed=3)
  head = dj.markov_head_from_arrays(
      "vanilla", {name: jnp.asarray(a, jnp.bfloat16) for name, a in arrays.items()})
  build = lambda: dj.build_draft_sampler(head, max_batch_size=64, vocab_size=vocab, gamma=GAMMA,
                                         logits_dtype=jnp.bfloat16, memory_stats=BIG)
  rng = np.random.default_rng(3)

  def inputs(batch, temperature):
    return dict(base_logits=jnp.asarray(rng.normal(0, 2, (batch, GAMMA, vocab)), jnp.bfloat16),
                anchor=jnp.asarray(rng.integers(0, vocab, batch), jnp.int32), hidden=None,
                params=dj.SamplingParams(temperature=temperature, seed=np.arange(batch) + 7),
                key=jax.random.key(5), positions=jnp.arange(batch, dtype=jnp.int32) * 3)
  calls = [inputs(64, np.tile([0.0, 0.9, 1.0, 1.3], 16)), inputs(64, np.zeros(64)),
           inputs(5, [0.0, 0.9, 1.0, 0.0, 1.3])]
  plain = build()
  plain_blocks = [plain.propose(**call) for call in calls]
  if jax.default_backend() == "cpu":  # (on a Hopper GPU "auto" takes the kernels at 64 rows)
    assert set(plain._weights[0]) == {"w1", "w2"}

  choose = dispatch.choose
  monkeypatch.setattr(dispatch, "choose", lambda problem, backend=None, config=None: choose(
      problem, "hopper" if problem.batch == 64 else backend, config))
  posed = build()
  assert posed.backends[("sampling", 64)].backend is dispatch.Backend.HOPPER
  assert posed.backends[("greedy", 64)].reason.startswith("hopper requested")
  for variant in ("greedy", "sampling"):  # the other buckets as they were
    assert posed.backends[(variant, 8)] == plain.backends[(variant, 8)]
    assert posed.backends[(variant, 8)].backend is not dispatch.Backend.HOPPER
  prepared = []
  monkeypatch.setattr(pallas_block, "prepare_head_arrays",
                      lambda arrays, prepare=pallas_block.prepare_head_arrays:
                      prepared.append(1) or prepare(arrays))
  blocks = [posed.propose(**call) for call in calls]
  assert prepared == [1] and set(posed._weights[0]) == {"w1", "w2", "w2_parts"}
  assert [b.backend.name for b in blocks] == ["hopper", "hopper", plain_blocks[2].backend.name]
  for name, a, b in zip(("mixed", "greedy"), plain_blocks, blocks):
    helpers.assert_blocks_agree((a.tokens, a.corrected_logits), (b.tokens, b.corrected_logits),
                                what=f"hopper bucket, {name}")
  helpers.assert_same_block(plain_blocks[2], blocks[2], fields=("tokens", "corrected_logits"))
