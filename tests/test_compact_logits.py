"""Blocks drafted with ``store_logits=False`` (`proposal.CompactLogits`): the same tokens, rows that
recompute the stored rows, verification that decides as with the stored logits, on every path.

A stored and a compact block come from two compiled programs, so they are compared with
`helpers.assert_blocks_agree` (the last bits of a float program depend on the host's instruction
set), except where equality holds on every host (W2 = 0: the corrected logits are the base logits).

The exact-law tests of verification with compact blocks are in test_verification_law.py (marked
"compact"), with mutation tests showing that a wrong log q or a wrong recomputed row is caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as dj
from dspark_jax.draft import proposer as draft_sampler
from dspark_jax.draft import memory_gate
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import dispatch
from dspark_jax import verification
from tests import helpers

KINDS = ("vanilla", "gated", "rnn")
BATCH, GAMMA, VOCAB, RANK, HIDDEN = 6, 4, 192, 16, 6


def _inputs(kind, dtype, confidence=False, seed=0):
  arrays = helpers.head_arrays(kind, VOCAB, RANK, HIDDEN, seed=seed, scale=2.0)
  arrays["w2"] = arrays["w2"].astype(dtype)
  head = dj.markov_head_from_arrays(kind, arrays)
  conf = None
  if confidence:
    conf = dj.confidence_head_from_arrays(helpers.confidence_arrays(HIDDEN + RANK, GAMMA))
  rng = np.random.default_rng(seed + 1)
  base = jnp.asarray(rng.normal(0, 2.0, (BATCH, GAMMA, VOCAB)), dtype)
  hidden = jnp.asarray(rng.normal(0, 1.0, (BATCH, GAMMA, HIDDEN)), jnp.float32)
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0, 1.0, 0.8], seed=np.arange(BATCH) + 3)
  return head, conf, base, hidden, params


def _run(path, head, conf, base, hidden, params, store_logits):
  """(tokens, corrected or CompactLogits, confidence) of one block on `path`."""
  anchor, positions = np.arange(BATCH) * 5 % VOCAB, np.arange(BATCH) * 7
  if path == "eager":
    block = dj.sample_block_eager(head, base, anchor, hidden, params, jax.random.key(4), positions,
                                  confidence_head=conf, store_logits=store_logits)
    return block.tokens, block.corrected_logits, block.confidence
  backend, config = path
  rows = proposal.block_arrays(params, anchor, positions)
  tokens, law, confidence = proposal.folded_block(
      head.arrays(), None if conf is None else conf.arrays(), base, rows["anchor"], hidden,
      rows["greedy"], rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(4),
      kind=head.kind, greedy_only=False, backend=backend, config=config,
      store_logits=store_logits)
  if not store_logits:  # the program returns it without its inputs (they would be copied)
    assert law.base_logits is None and law.w2 is None
    law = law.with_inputs(base, head.arrays()["w2"])
  return tokens, law, confidence


LOOP = ("xla", dispatch.XlaConfig(form="loop"))
TILE_DRAWS = ("triton", dispatch.TritonConfig(tile_draws=True))  # every tile draws in the kernel
# No tile draws: the stored block's token choice draws in the chosen tile (`draw_tokens`); the
# compact block's `triton_step.chosen_tile_draws` rereads the chosen tiles and draws there.
CHOSEN_TILE = ("triton", dispatch.TritonConfig(tile_draws=False))
PATHS = [LOOP, ("xla", dispatch.XlaConfig(form="unrolled")),
         pytest.param(TILE_DRAWS, marks=pytest.mark.kernel),
         pytest.param(CHOSEN_TILE, marks=pytest.mark.kernel), "eager"]


def _same_prefix(tokens_a, tokens_b):
  """[B, γ] bool: the step's preceding tokens agree (what step k's confidence and state read)."""
  tokens_a, tokens_b = np.asarray(tokens_a), np.asarray(tokens_b)
  same = np.concatenate([np.ones((len(tokens_a), 1), bool), tokens_a[:, :-1] == tokens_b[:, :-1]],
                        axis=1)
  return np.logical_and.accumulate(same, axis=1)


# The kernel that rereads the chosen tiles with every head kind; every other path with one kind,
# each kind on two of them (suite time).
COMPACT_CASES = [
    pytest.param(kind, CHOSEN_TILE, marks=pytest.mark.kernel, id=f"triton-chosen-tile-{kind}")
    for kind in KINDS] + [
    pytest.param("gated", TILE_DRAWS, marks=pytest.mark.kernel, id="triton-draws-gated"),
    pytest.param("rnn", LOOP, id="loop-rnn"),
    pytest.param("vanilla", ("xla", dispatch.XlaConfig(form="unrolled")), id="unrolled-vanilla"),
    pytest.param("gated", "eager", id="eager-gated")]


@pytest.mark.parametrize("kind,path", COMPACT_CASES)
@pytest.mark.slow
def test_compact_block_keeps_the_tokens_and_recomputes_its_rows(kind, path):
  # Against the same block with stored logits (another program): the tokens, and every recomputed
  # row against the stored row, agree as far as floats allow (`helpers.assert_blocks_agree`: rows
  # within one unit in the last place, tokens equal wherever the rows are bit-equal; the kernel
  # path recomputes with its own kernel); the confidence close where it reads the same tokens; the
  # kept log q equal to log softmax(recomputed / T) at the block's token to float32 rounding (the
  # XLA paths compute that expression in another program; the kernel forms it from its tiles'
  # log-masses).
  head, conf, base, hidden, params = _inputs(kind, jnp.bfloat16, confidence=kind == "gated")
  stored = _run(path, head, conf, base, hidden, params, True)
  compact = _run(path, head, conf, base, hidden, params, False)
  law = compact[1]
  assert isinstance(law, proposal.CompactLogits)
  dense = law.dense()
  assert dense.dtype == stored[1].dtype
  helpers.assert_blocks_agree(stored, (compact[0], dense), what=f"stored vs compact, {path}")
  if conf is not None:
    same = _same_prefix(stored[0], compact[0])
    np.testing.assert_allclose(np.asarray(compact[2])[same], np.asarray(stored[2])[same],
                               rtol=1e-5, atol=1e-6)
  log_q = jax.nn.log_softmax(dense.astype(jnp.float32) / params.draft_temperature[:, None, None],
                             axis=-1)
  log_q = np.asarray(jnp.take_along_axis(log_q, compact[0][..., None], axis=2)[..., 0])
  sampled = ~params.greedy_mask
  np.testing.assert_allclose(np.asarray(law.token_log_q)[sampled], log_q[sampled],
                             atol=2e-6, rtol=1e-5)
  assert law.kernel is None if path[0] != "triton" else dict(law.kernel)["rows"] == 16


@pytest.mark.parametrize("path", [
    LOOP, pytest.param(TILE_DRAWS, marks=pytest.mark.kernel),
    pytest.param(CHOSEN_TILE, marks=pytest.mark.kernel)],
    ids=["loop", "triton-draws", "triton-chosen-tile"])
@pytest.mark.slow
def test_compact_edge_rows_on_the_kernel_and_the_loop(path):
  # All -inf rows, a NaN, an exact tie across the first and last tile (V = 2064: 129 tiles of 16):
  # the compact block's tokens and rows are the stored block's, and verification decides alike.
  # W2 = 0: both programs' corrected logits (and the recomputed rows) are the base logits exactly
  # on any host (the bias is an exact zero), so tokens and rows must be equal exactly; the special
  # rows draft their defined tokens.
  batch, gamma, vocab, rank = 8, 2, 2064, 16
  head = helpers.make_head("vanilla", vocab, rank, 4)
  base = helpers.edge_rows(batch, gamma, vocab, nan_at=2060, tie_at=(5, 2050))
  rng = np.random.default_rng(13)
  arrays = dict(head.arrays(), w2=jnp.zeros_like(head.arrays()["w2"]))
  params = dj.SamplingParams(temperature=np.tile([0.0, 0.9], batch // 2), seed=np.arange(batch))
  rows = proposal.block_arrays(params, np.arange(batch), np.arange(batch) * 5)
  target = jnp.asarray(rng.normal(0, 2, (batch, gamma + 1, vocab)), jnp.float32)
  backend, config = path
  blocks = []
  for store_logits in (True, False):
    tokens, corrected, _ = proposal.folded_block(
        arrays, None, jnp.asarray(base), rows["anchor"], None, rows["greedy"],
        rows["temperature"], rows["seeds"], rows["positions"], jax.random.key(1),
        kind="vanilla", greedy_only=False, backend=backend, config=config,
        store_logits=store_logits)
    if not store_logits:
      corrected = corrected.with_inputs(jnp.asarray(base), arrays["w2"])
    blocks.append(proposal.DraftBlock(tokens=tokens, corrected_logits=corrected,
                                      greedy_mask=rows["greedy"],
                                      temperatures=rows["temperature"], confidence=None))
  stored, compact = blocks
  np.testing.assert_array_equal(np.asarray(stored.tokens), np.asarray(compact.tokens))
  np.testing.assert_array_equal(np.asarray(stored.corrected_logits), base)
  np.testing.assert_array_equal(np.asarray(compact.corrected_logits.dense()), base)
  tokens = np.asarray(compact.tokens)
  # all -inf: token 0; a NaN: the NaN's column (greedy and sampled); the greedy tie: the first
  assert np.all(tokens[0:2] == 0) and np.all(tokens[2:4] == 2060) and np.all(tokens[4] == 5)
  results = [verification.verify(target, b, params, jax.random.key(2), np.arange(batch) * 5)
             for b in blocks]
  for field in ("accept_len", "bonus", "committed"):
    np.testing.assert_array_equal(getattr(results[0], field), getattr(results[1], field))
  assert np.all((np.asarray(results[1].bonus) >= 0) & (np.asarray(results[1].bonus) < vocab))


@pytest.mark.parametrize("path", [LOOP, pytest.param(("triton", None), marks=pytest.mark.kernel)],
                         ids=["loop", "triton"])
@pytest.mark.slow
def test_compact_verification_decides_as_with_stored_logits(path):
  # 64 rows (on the kernel path: the draws in the chosen tiles, `triton_step.chosen_tile_draws`,
  # from this size on), a quarter greedy, some top-k, verify lengths and a stop token; the target leans
  # towards the drafts so rounds end at every position. The two blocks (two programs) agree as far
  # as floats allow (`helpers.assert_blocks_agree`), and on every row that drafted the same tokens
  # they must give the same AcceptResult, field for field; also with verify_arrays under the
  # user's own jit.
  batch, gamma, vocab, rank = 64, 4, 256, 16
  head = helpers.make_head("vanilla", vocab, rank, 4, seed=3, scale=2.0)
  rng = np.random.default_rng(0)
  base = jnp.asarray(rng.normal(0, 1.5, (batch, gamma, vocab)), jnp.float32)
  row = np.arange(batch)
  params = dj.SamplingParams(temperature=np.where(row % 4 == 0, 0.0, 0.9),
                             top_k=np.where(row % 3 == 0, 20, 0), seed=row)
  anchor, positions = row * 7 % vocab, row + 5
  blocks = []
  for store_logits in (True, False):
    r = proposal.block_arrays(params, anchor, positions)
    backend, config = path
    tokens, corrected, _ = proposal.folded_block(
        head.arrays(), None, base, r["anchor"], None, r["greedy"], r["temperature"], r["seeds"],
        r["positions"], jax.random.key(1), kind="vanilla", greedy_only=False, backend=backend,
        config=config, store_logits=store_logits)
    if not store_logits:
      corrected = corrected.with_inputs(base, head.arrays()["w2"])
    blocks.append(proposal.DraftBlock(tokens=tokens, corrected_logits=corrected,
                                      greedy_mask=r["greedy"], temperatures=r["temperature"],
                                      confidence=None))
  helpers.assert_blocks_agree(
      (blocks[0].tokens, blocks[0].corrected_logits),
      (blocks[1].tokens, blocks[1].corrected_logits.dense()), what=f"stored vs compact, {path}")
  same = np.all(np.asarray(blocks[0].tokens) == np.asarray(blocks[1].tokens), axis=1)
  target = jnp.asarray(rng.normal(0, 1.5, (batch, gamma + 1, vocab)), jnp.float32)
  target = target.at[:, :gamma].add(3.0 * jax.nn.one_hot(blocks[0].tokens, vocab))
  lens = rng.integers(1, gamma + 2, batch)
  results = [verification.verify(target, b, params, jax.random.key(2), positions, lens,
                                 stop_token_ids=(int(blocks[0].tokens[1, 2]),)) for b in blocks]
  results.append(jax.jit(lambda t, law: verification.verify_arrays(
      t, blocks[1].tokens, law, params.draft_temperature, params.greedy_mask,
      params.draft_temperature, params.top_k, params.top_p, params.seed, positions, lens,
      np.full((batch, 1), -1, np.int32), jax.random.key(2), greedy_only=False))(
          target, blocks[1].corrected_logits))
  results.append(verification.verify_arrays(
      target, blocks[0].tokens, blocks[0].corrected_logits, params.draft_temperature,
      params.greedy_mask, params.draft_temperature, params.top_k, params.top_p, params.seed,
      positions, lens, np.full((batch, 1), -1, np.int32), jax.random.key(2), greedy_only=False))
  for a, b in (results[:2], results[2:]):
    for field in ("accept_len", "bonus", "committed", "num_committed", "finished"):
      np.testing.assert_array_equal(np.asarray(getattr(a, field))[same],
                                    np.asarray(getattr(b, field))[same], err_msg=field)
  accept = np.asarray(results[0].accept_len)[~params.greedy_mask & (lens == gamma + 1)]
  assert len(np.unique(accept)) >= 3  # rejections at several positions, so rows are recomputed


@pytest.mark.kernel
def test_compact_mode_names_the_backend_that_cannot_take_it():
  # The Hopper kernels write the corrected logits: with store_logits=False the explicit backend
  # is refused, naming the precondition, on shapes that meet every other one (64 rows, bfloat16,
  # r and V multiples of 64); raised while the block is traced, before any kernel runs.
  batch, gamma, vocab, rank = 64, 2, 128, 64
  arrays = {k: jnp.asarray(v, jnp.bfloat16)
            for k, v in helpers.head_arrays("vanilla", vocab, rank, 4).items()}
  head = dj.markov_head_from_arrays("vanilla", arrays)
  base = jnp.zeros((batch, gamma, vocab), jnp.bfloat16)
  params = dj.SamplingParams(temperature=np.ones(batch))
  choice = proposal.choose_backend(arrays, base, kind="vanilla", greedy_only=False,
                                   store_logits=True, backend="hopper")
  assert choice.backend is dispatch.Backend.HOPPER
  assert choice.interpret == (jax.default_backend() != "gpu")  # the interpreter off the GPU
  match = ("^backend 'hopper': precondition failed: the sampling variant stores its corrected "
           "logits")
  with pytest.raises(ValueError, match=match):
    dj.sample_block(head, base, np.zeros(batch, np.int32), None, params, jax.random.key(0),
                    np.zeros(batch, np.int32), store_logits=False, backend="hopper")


def test_draft_sampler_compact_blocks_pad_recompute_and_never_recompile():
  # Batch 5 runs in bucket 8: the block's rows are the first 5 of the padded block, recomputed at
  # the drafted 8 rows, agreeing with the stored-logits sampler's (another program:
  # `helpers.assert_blocks_agree`); steady state compiles nothing; the memory gate counts log q and
  # the vectors instead of the logits.
  head = helpers.make_head("rnn", VOCAB, RANK, HIDDEN)
  build = lambda store: dj.build_draft_sampler(
      head, max_batch_size=8, vocab_size=VOCAB, gamma=GAMMA, logits_dtype=jnp.float32,
      mode="force", memory_stats={"bytes_limit": 2**36, "bytes_in_use": 0}, store_logits=store)
  stored, compact = build(True), build(False)
  assert compact.decision.need_bytes == memory_gate.sampling_need_bytes(
      8, VOCAB, GAMMA, jnp.float32, store_logits=False, rank=RANK) == 8 * VOCAB * 4 + 8 * GAMMA * (
          4 + RANK * 4)
  _, _, base, hidden, _ = _inputs("rnn", jnp.float32)
  params = dj.SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0, 1.0], seed=np.arange(5))
  inputs = dict(base_logits=base[:5], anchor=np.arange(5), hidden=hidden[:5], params=params,
                key=jax.random.key(7), positions=np.arange(5) * 3)
  a, b = stored.propose(**inputs), compact.propose(**inputs)
  assert isinstance(b.corrected_logits, proposal.CompactLogits)
  assert b.corrected_logits.drafted_rows == 8 and b.corrected_logits.shape == (5, GAMMA, VOCAB)
  helpers.assert_blocks_agree((a.tokens, a.corrected_logits), (b.tokens, b.corrected_logits.dense()),
                              what="stored vs compact sampler")
  programs = compact.compilations
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if name.endswith("backend_compile_duration") else None)
  try:
    compact.propose(**dict(inputs, key=jax.random.key(8))).tokens.block_until_ready()
  finally:
    jax.monitoring.clear_event_listeners()
  assert compiles == [] and compact.compilations == programs


def test_compact_logits_without_inputs_name_what_is_missing():
  law = proposal.CompactLogits(token_log_q=jnp.zeros((2, 3)), vectors=jnp.zeros((2, 3, 4)))
  with pytest.raises(ValueError, match="base_logits and w2 are not attached; call with_inputs"):
    law.rows(jnp.zeros((2,), jnp.int32))


def test_bad_compact_block_is_rejected_by_verify():
  head, _, base, _, params = _inputs("vanilla", jnp.float32)
  block = dj.sample_block(head, base, np.arange(BATCH), None, params, jax.random.key(0),
                          np.arange(BATCH), store_logits=False)
  law = block.corrected_logits
  bad = block.replace(corrected_logits=law.replace(token_log_q=law.token_log_q[:, :2]))
  target = jnp.zeros((BATCH, GAMMA + 1, VOCAB))
  with pytest.raises(ValueError, match=r"block: its CompactLogits hold log q of shape \(6, 2\)"):
    verification.verify(target, bad, params, jax.random.key(0), np.arange(BATCH))
