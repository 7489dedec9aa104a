"""Lossless verification of a draft block against the target (docs/exactness.md), for mixed batches.

This module owns the accept/reject rule and what a round commits. `verify` takes the target's logits
at the γ + 1 verify positions (row j = the target's distribution after the anchor and j drafts) and a
`DraftBlock`, and resolves every row in one compiled program, with no host synchronisation:

* **greedy rows**: ``pred_j = argmax(target_j)`` (ties -> smallest index); accept draft k while
  ``x_k == pred_{k-1}``; the bonus is ``pred`` at the first mismatch (or after the last draft).
* **sampled rows**: ``p_j`` is the target law of the row (`target_law`: temperature, top-k, top-p);
  ``q_j = softmax(corrected_j / T_draft)`` is the law the draft *really* sampled from (the block's
  emitted corrected logits; or, from a block drafted with ``store_logits=False``, ``q(x_k)`` as the
  draft computed it and the one row ``q_j`` at the first rejection recomputed bit for bit,
  `proposal.CompactLogits`). Draft k is accepted iff ``u_k · q(x_k) < p(x_k)``, left to right, stopping
  at the first rejection j; the bonus is drawn from ``normalise(max(p_j - q_j, 0))`` (from ``p_j`` when
  that mass is 0), or from ``p_γ`` when every draft was accepted. This is the speculative sampling
  rule, so each committed token is an exact sample of the target law given the tokens before it.

**Verify lengths.** An optional per-row ``verify_len`` ℓ in 1..γ+1 counts the anchor: the target checks
drafts 1..ℓ against its rows 0..ℓ−1. ``accept_len`` is capped at ℓ − 1; when draft ℓ was accepted too,
it is already an exact sample of ``p_{ℓ−1}`` and serves as the bonus, so a round commits at most ℓ
tokens and never reads target rows ≥ ℓ (they may hold anything, NaN included).

**Randomness.** Row b's accept uniform for draft k uses the key of ``(key, seed_b, positions_b + k,
Stream.VERIFY_ACCEPT)`` and its bonus the key of ``(key, seed_b, position of the bonus,
Stream.VERIFY_BONUS)``: independent of the draft's stream, and of the other rows.

**Stop tokens.** Nothing after the first committed stop token is committed, and the row is marked
finished. ``accept_len`` and ``bonus`` still report the verification outcome before that truncation.

**NaN.** A target row holding a NaN has no law: for a sampled row every probability is NaN, so the
draft is rejected (``u·q < NaN`` is false) and the bonus is token 0; a greedy row takes the index of its
first NaN (argmax treats NaN as the maximum). A target row of all ``-inf`` gives bonus 0 either way. No
path yields an id outside [0, V)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspark_jax import validation
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import sampler as sampling
from dspark_jax.sampling import params as sp
from dspark_jax.sampling import target_law


@struct.dataclass
class AcceptResult:
  """What one verification round decided, per row.

  Attributes:
    accept_len: [B] int32 number of draft tokens accepted (``<= verify_len - 1``), before stop tokens.
    bonus: [B] int32 the token committed after the accepted drafts, before stop tokens.
    committed: [B, γ+1] int32 the tokens to append, ``x_1..x_accept_len, bonus`` cut after the first
      stop token; unused slots hold -1.
    num_committed: [B] int32 number of valid entries of ``committed`` (>= 1).
    finished: [B] bool, a stop token was committed.
  """

  accept_len: jax.Array
  bonus: jax.Array
  committed: jax.Array
  num_committed: jax.Array
  finished: jax.Array


def _take(x, index, axis):
  """``x`` indexed along `axis` by a per-row index [B] (the other axes kept)."""
  index = jnp.expand_dims(index, tuple(range(1, x.ndim)))
  return jnp.squeeze(jnp.take_along_axis(x, index, axis=axis), axis)


def _uniforms(key, seeds, positions, gamma):
  """[B, γ] accept uniforms: draft k (1-based) of row b uses position ``positions_b + k``."""
  batch = seeds.shape[0]
  steps = jnp.arange(1, gamma + 1, dtype=jnp.int32)
  keys = sampling.row_keys(key, jnp.repeat(seeds, gamma),
                           (positions[:, None] + steps).reshape(-1), sampling.Stream.VERIFY_ACCEPT)
  return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys).reshape(batch, gamma)


def stop_mask(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """[B, T] bool: which of [B, T] `tokens` are stop tokens of their row ([B, S] ids, -1 = none)."""
  return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=2) & (tokens >= 0)


def _commit(tokens, accept_len, bonus, stop_ids):
  """Builds ``committed`` / ``num_committed`` / ``finished`` from the verification outcome."""
  batch, gamma = tokens.shape
  slot = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
  drafts = jnp.concatenate([tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  committed = jnp.where(slot < accept_len[:, None], drafts,
                        jnp.where(slot == accept_len[:, None], bonus[:, None], -1))
  is_stop = stop_mask(committed, stop_ids)
  finished = jnp.any(is_stop, axis=1)
  num_committed = jnp.where(finished, jnp.argmax(is_stop, axis=1).astype(jnp.int32) + 1,
                            accept_len + 1)
  committed = jnp.where(slot < num_committed[:, None], committed, -1)
  return committed, num_committed, finished


@functools.partial(jax.jit, static_argnames=("greedy_only",))
def verify_arrays(target_logits, tokens, corrected, draft_temperature, greedy, temperature, top_k,
                  top_p, seeds, positions, verify_lens, stop_ids, key, *, greedy_only):
  """The compiled verification; arrays only, no checks (see `verify` for the meaning).

  Args:
    target_logits: [B, γ+1, V]. tokens: [B, γ] int32. corrected: [B, γ, V], a
      `proposal.CompactLogits` (row q_j recomputed at the first rejection), or None (greedy_only).
    draft_temperature, temperature, top_p: [B] float32. greedy: [B] bool. top_k: [B] int32.
    seeds: [B] uint32. positions, verify_lens: [B] int32. stop_ids: [B, S] int32 (-1 = none).
    key: base PRNG key. greedy_only: every row is greedy; `corrected` is not read.

  Returns:
    An `AcceptResult`.
  """
  batch, gamma = tokens.shape
  vocab = target_logits.shape[-1]
  pred = sampling.greedy_tokens(target_logits.reshape(batch * (gamma + 1), vocab))
  pred = pred.reshape(batch, gamma + 1)
  accepted = tokens == pred[:, :gamma]
  compact = isinstance(corrected, proposal.CompactLogits)
  if not greedy_only:
    log_p = target_law.target_log_probs(target_logits, temperature, top_k, top_p)  # [B, γ+1, V]
    draft_log_q = lambda logits: jax.nn.log_softmax(
        logits.astype(jnp.float32) / jnp.expand_dims(draft_temperature, range(1, logits.ndim)),
        axis=-1)
    p_x = jnp.exp(jnp.take_along_axis(log_p[:, :gamma], tokens[..., None], axis=2)[..., 0])
    if compact:  # the draft kept log q(x_k); one row is recomputed below
      q_x = jnp.exp(corrected.token_log_q)
    else:
      log_q = draft_log_q(corrected)                                               # [B, γ, V]
      q_x = jnp.exp(jnp.take_along_axis(log_q, tokens[..., None], axis=2)[..., 0])
    sampled_accepted = _uniforms(key, seeds, positions, gamma) * q_x < p_x
    accepted = jnp.where(greedy[:, None], accepted, sampled_accepted)

  run = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1,
                dtype=jnp.int32)  # leading accepts
  cap = verify_lens - 1
  accept_len = jnp.minimum(run, cap)
  bonus = _take(pred, accept_len, 1)
  if not greedy_only:
    row_p = _take(log_p, accept_len, 1)                                     # [B, V]
    all_accepted = accept_len == gamma
    rejected_at = jnp.minimum(accept_len, gamma - 1)
    row_q = jnp.where(all_accepted[:, None], -jnp.inf,
                      draft_log_q(corrected.rows(rejected_at)) if compact
                      else _take(log_q, rejected_at, 1))
    residual = jnp.maximum(jnp.exp(row_p) - jnp.exp(row_q), 0.0)
    use_p = all_accepted[:, None] | ~(jnp.sum(residual, axis=1, keepdims=True) > 0)
    log_weights = jnp.where(use_p, row_p, jnp.log(residual))
    keys = sampling.row_keys(key, seeds, positions + accept_len + 1, sampling.Stream.VERIFY_BONUS)
    drawn = target_law.sample_from_log_weights(log_weights, keys)
    # The cap cut an accepted run: draft ℓ passed its test against row ℓ-1 and is the bonus.
    capped_draft = _take(tokens, jnp.minimum(cap, gamma - 1), 1)
    bonus = jnp.where(greedy, bonus, jnp.where(run > cap, capped_draft, drawn))

  committed, num_committed, finished = _commit(tokens, accept_len, bonus, stop_ids)
  return AcceptResult(accept_len=accept_len, bonus=bonus, committed=committed,
                      num_committed=num_committed, finished=finished)


# ---- the validated public entry point ---------------------------------------------------------------


def _concrete(x):
  """`x` as a NumPy array when its values are known on the host; None when traced."""
  if isinstance(x, jax.core.Tracer):
    return None
  return np.asarray(x)


def _first_row(bad: np.ndarray) -> int:
  return int(np.flatnonzero(bad)[0])


def stop_id_array(stop_token_ids, batch: int, vocab: int) -> jax.Array:
  """Normalises stop tokens to a [B, S] int32 array (-1 = no token): ids shared by every row (a
  sequence of ints) or per row (a [B, S] array padded with -1). Raises ValueError on bad ids."""
  if isinstance(stop_token_ids, (int, np.integer)):
    stop_token_ids = (stop_token_ids,)
  if isinstance(stop_token_ids, (list, tuple)) and stop_token_ids:
    stop_token_ids = validation.as_array("stop_token_ids", stop_token_ids)  # ragged: named
  ids = _concrete(stop_token_ids)
  if ids is None:
    ids = jnp.asarray(stop_token_ids, jnp.int32)
    if ids.ndim != 2 or ids.shape[0] != batch:
      raise ValueError(f"stop_token_ids: expected [S] ints or [{batch}, S], got shape {ids.shape}")
    return ids
  ids = np.asarray(ids)
  if ids.size == 0:
    return np.full((batch, 0), -1, np.int32)
  if ids.dtype.kind not in "iu":
    raise ValueError(f"stop_token_ids: expected integers, got dtype {ids.dtype}")
  if ids.ndim == 1:
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
      i = _first_row(bad)
      raise ValueError(f"stop_token_ids: entry {i} is {ids[i]}; must be in [0, {vocab})")
    return np.broadcast_to(ids.astype(np.int32), (batch, ids.shape[0])).copy()
  if ids.ndim != 2 or ids.shape[0] != batch:
    raise ValueError(f"stop_token_ids: expected [S] ints or [{batch}, S], got shape {ids.shape}")
  bad = (ids < -1) | (ids >= vocab)
  if bad.any():
    row, col = np.argwhere(bad)[0]
    raise ValueError(f"stop_token_ids: row {row} entry {col} is {ids[row, col]}; must be in "
                     f"[0, {vocab}) or -1 (padding)")
  return ids.astype(np.int32)


def _check_verify_lens(verify_lens, batch: int, gamma: int):
  if verify_lens is None:
    return np.full((batch,), gamma + 1, np.int32)
  validation.check_batch("verify_lens", verify_lens, batch)
  values = _concrete(verify_lens)
  if values is None:
    return jnp.clip(jnp.asarray(verify_lens, jnp.int32), 1, gamma + 1)  # traced: cannot raise
  bad = (values < 1) | (values > gamma + 1)
  if bad.any():
    row = _first_row(bad)
    raise ValueError(f"verify_lens: row {row} is {values[row]}; must be in 1..γ+1 = 1..{gamma + 1} "
                     "(the anchor counts)")
  return values.astype(np.int32)


def _check_block_matches_params(block: proposal.DraftBlock, params: sp.SamplingParams) -> None:
  ours, theirs = _concrete(block.greedy_mask), _concrete(params.greedy_mask)
  if ours is not None and theirs is not None and not np.array_equal(ours, theirs):
    row = _first_row(ours != theirs)
    raise ValueError(f"block: row {row} was drafted {'greedy' if ours[row] else 'sampled'} but "
                     f"params row {row} is {'greedy' if theirs[row] else 'sampled'}")
  if block.corrected_logits is None and theirs is not None and not theirs.all():
    row = _first_row(~theirs)
    raise ValueError(f"block: has no corrected logits (path {block.path!r}, greedy-only), but "
                     f"params row {row} is sampled; propose sampled rows with the sampling variant")
  ours, theirs = _concrete(block.temperatures), _concrete(params.draft_temperature)
  if ours is not None and theirs is not None and not np.array_equal(ours, theirs):
    row = _first_row(ours != theirs)
    raise ValueError(f"block: row {row} was drafted at temperature {ours[row]} but params row {row} "
                     f"asks for {theirs[row]}")


def check_verify_inputs(target_logits, block, params, positions) -> tuple[int, int, int]:
  """Raises ValueError (naming the argument) unless the inputs fit together; returns (B, γ, V)."""
  if not isinstance(block, proposal.DraftBlock):
    raise ValueError(f"block: expected a DraftBlock, got {type(block).__name__}")
  if np.ndim(block.tokens) != 2 or not jnp.issubdtype(block.tokens.dtype, jnp.integer):
    raise ValueError(f"block: tokens must be a [B, γ] integer array, got shape "
                     f"{np.shape(block.tokens)} dtype {getattr(block.tokens, 'dtype', None)}")
  batch, gamma = block.tokens.shape
  if np.ndim(target_logits) != 3:
    raise ValueError(f"target_logits: expected [B, γ+1, V], got shape {np.shape(target_logits)}")
  if not jnp.issubdtype(target_logits.dtype, jnp.floating):
    raise ValueError(f"target_logits: expected a float dtype, got {target_logits.dtype}")
  if tuple(target_logits.shape[:2]) != (batch, gamma + 1):
    raise ValueError(f"target_logits: expected [{batch}, {gamma + 1}, V] for a block of {batch} rows "
                     f"and γ={gamma} drafts, got shape {tuple(target_logits.shape)}")
  vocab = target_logits.shape[2]
  corrected = block.corrected_logits
  if isinstance(corrected, proposal.CompactLogits) and (
      tuple(corrected.token_log_q.shape) != (batch, gamma)
      or tuple(corrected.vectors.shape[:2]) != (batch, gamma)):
    raise ValueError(f"block: its CompactLogits hold log q of shape "
                     f"{tuple(corrected.token_log_q.shape)} and vectors of shape "
                     f"{tuple(corrected.vectors.shape)}; expected [{batch}, {gamma}] and "
                     f"[{batch}, {gamma}, r]")
  if corrected is not None and tuple(corrected.shape) != (batch, gamma, vocab):
    raise ValueError(f"target_logits: vocab V={vocab} does not match the block's corrected logits "
                     f"of shape {tuple(corrected.shape)}")
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != batch:
    raise ValueError(f"params: has {params.batch_size} rows but the block has {batch}")
  validation.check_batch("positions", positions, batch)
  sampling.check_positions("positions", positions)
  validation.check_range("block.tokens", block.tokens, 0, vocab)
  _check_block_matches_params(block, params)
  return batch, gamma, vocab


def verify(target_logits: jax.Array, block: proposal.DraftBlock, params: sp.SamplingParams,
           key: jax.Array, positions: jax.Array, verify_lens: jax.Array | None = None,
           stop_token_ids: Sequence[int] | jax.Array = ()) -> AcceptResult:
  """Verifies a draft block against the target in one compiled program (module docstring: the rules).

  Args:
    target_logits: [B, γ+1, V] float target logits; row j is the target's distribution after the
      anchor and the first j drafts.
    block: the `DraftBlock` being verified. A block from the greedy-only path (no corrected logits)
      runs the greedy-only variant; its rows must all be greedy.
    params: the `SamplingParams` the block was drafted with (B rows).
    key: base PRNG key (may be the draft's key: the streams differ).
    positions: [B] int absolute position of each anchor (as given to the proposal).
    verify_lens: optional [B] int in 1..γ+1 (the anchor counts); default γ+1 (verify everything).
    stop_token_ids: stop tokens shared by all rows (a sequence of ints), or per row ([B, S] ints,
      padded with -1).

  Returns:
    An `AcceptResult`.

  Raises:
    ValueError: shapes, dtypes or vocab sizes that do not fit the block; draft tokens outside
      [0, V); positions outside [0, 2**31); verify_lens out of range; stop ids outside the
      vocabulary; a block drafted under other greedy flags or temperatures than `params`; a key
      that is not one PRNG key (values are checked when they are concrete).
    TypeError: an argument that is not an array (lists of numbers are converted).
  """
  target_logits = validation.as_array("target_logits", target_logits)
  positions = validation.as_array("positions", positions)
  if verify_lens is not None:
    verify_lens = validation.as_array("verify_lens", verify_lens)
  batch, gamma, vocab = check_verify_inputs(target_logits, block, params, positions)
  validation.check_key("key", key)
  lens = _check_verify_lens(verify_lens, batch, gamma)
  stop_ids = stop_id_array(stop_token_ids, batch, vocab)
  greedy_only = block.corrected_logits is None
  return verify_arrays(
      target_logits, jnp.asarray(block.tokens, jnp.int32), block.corrected_logits,
      block.temperatures, jnp.asarray(params.greedy_mask), params.draft_temperature,
      params.top_k, params.top_p, params.seed, jnp.asarray(positions, jnp.int32), lens, stop_ids,
      key, greedy_only=greedy_only)
