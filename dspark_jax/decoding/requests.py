"""What a decode request needs before any program runs, the same for a fixed batch and the queue.

This module owns the host's checks and shapes of a request: the prompts (checked, right-padded to
a length bucket: powers of two, at least `MIN_BUCKET`), the per-row budgets, sampling parameters,
key and stop arrays (`check_request`), the draft's fit to the target (`check_models`,
`check_pair`), and the path and block backend a decode takes (`_choose_path`,
docs/memory_gate.md: an all-greedy batch runs the greedy-only variant; a batch with sampled rows
the folded sampling variant if the memory gate allows it, else the eager fallback;
`choose_block_backend`). `decoding.host` (the fixed batch) and `decoding.queue` (the slots) both
build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from dspark_jax import device_memory
from dspark_jax import validation
from dspark_jax import verification
from dspark_jax.decoding import stops
from dspark_jax.decoding.rounds import PATH_AUTOREGRESSIVE
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp

MIN_BUCKET = 8


def bucket(n: int, minimum: int = 1) -> int:
  """The padding bucket of `n`: the smallest power of two >= max(n, minimum)."""
  size = 1
  while size < max(n, minimum):
    size *= 2
  return size


def _prepare_prompts(prompts, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
    rows = [np.asarray(p) for p in np.asarray(prompts)]
  elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
    rows = [np.asarray(p) for p in prompts]
  else:
    raise ValueError("prompts: expected a sequence of token-id sequences or a [B, T] array")
  if not rows:
    raise ValueError("prompts: empty batch")
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size == 0:
      raise ValueError(f"prompts: row {i} must be a non-empty 1-D token sequence, got shape "
                       f"{row.shape}")
    if row.dtype.kind not in "iu":
      raise ValueError(f"prompts: row {i} has dtype {row.dtype}; expected integer token ids")
    bad = (row < 0) | (row >= vocab)
    if bad.any():
      j = int(np.flatnonzero(bad)[0])
      raise ValueError(f"prompts: row {i} token {j} is {row[j]}; must be in [0, {vocab})")
  lens = np.array([r.size for r in rows], np.int32)
  padded = np.zeros((len(rows), bucket(int(lens.max()), MIN_BUCKET)), np.int32)
  for i, row in enumerate(rows):
    padded[i, :row.size] = row
  return padded, lens


def _check_budgets(max_new_tokens, batch: int) -> np.ndarray:
  """[B] int64 budgets from an int or B ints in [0, 2**31), or ValueError naming the first bad one."""
  budgets = np.asarray(max_new_tokens)
  if budgets.dtype.kind not in "iu":
    raise ValueError(f"max_new_tokens: expected an int or {batch} ints, got {max_new_tokens!r}")
  if budgets.ndim > 1 or (budgets.ndim == 1 and budgets.shape[0] != batch):
    raise ValueError(f"max_new_tokens: expected an int or {batch} ints (one per prompt), got "
                     f"shape {budgets.shape}")
  budgets = np.broadcast_to(budgets.astype(np.int64), (batch,))
  validation.check_range("max_new_tokens", budgets, 0, validation.POSITION_LIMIT,
                         what="must be in [0, 2**31)")
  return budgets


def check_pair(target: tm.TargetModel, draft: dm.DSparkDraft) -> None:
  """Raises ValueError unless the draft's real weights fit the target's: the vocabulary of its
  head and the width of its context projection (configs can agree while the arrays do not)."""
  vocab, hidden = target.embed.embedding.shape
  if draft.head.vocab_size != vocab:
    raise ValueError(f"draft: its head has a vocabulary of {draft.head.vocab_size}, the target's "
                     f"embedding {vocab}")
  features = len(draft.config.target_layer_ids) * hidden
  kernel = tuple(draft.fc.kernel.shape)
  if kernel != (features, hidden):
    raise ValueError(f"draft: its context projection fc is {list(kernel)}; the target (hidden size "
                     f"{hidden}, {len(draft.config.target_layer_ids)} feature layers) needs "
                     f"{[features, hidden]}")


def check_models(target: tm.TargetModel, draft: dm.DSparkDraft | None, spec: bool) -> None:
  """Raises ValueError unless speculative decoding (`spec`) has a draft whose config and weights
  fit the target (`check_pair`); the baseline takes any draft, or None."""
  if spec:
    if draft is None:
      raise ValueError("draft: required for speculative decoding (pass spec=False for the baseline)")
    draft.config.check_against(target.config)
    check_pair(target, draft)


def _choose_path(spec, params, draft, batch, vocab, mode, memory_stats, headroom_bytes,
                 store_logits=True):
  if not spec:
    return PATH_AUTOREGRESSIVE, None
  if params.all_greedy():
    return proposal.PATH_FOLDED_GREEDY, None
  mode = memory_gate.resolve_mode(mode)
  need = memory_gate.sampling_need_bytes(batch, vocab, draft.config.gamma, draft.config.dtype,
                                         store_logits=store_logits, rank=draft.head.rank)
  free, source = device_memory.probe_free_bytes(memory_stats)
  enabled, reason = memory_gate.decide(mode, need, free, headroom_bytes, source)
  if not enabled and mode is memory_gate.FoldedSampling.AUTO:
    memory_gate.logger.warning("dspark_jax: folded sampling disabled; %s", reason)
  return (proposal.PATH_FOLDED_SAMPLING if enabled else proposal.PATH_EAGER), reason


def check_request(prompts, params: sp.SamplingParams, key: jax.Array, max_new_tokens,
                  stop_token_ids, stop_sequences, vocab: int):
  """A request's host arrays, checked in this order (the first bad argument is named): the
  prompts (`_prepare_prompts`), `params` (`SamplingParams` with a row per prompt), the budgets
  (`_check_budgets`), the key, the stop ids and the stop sequences.

  Returns:
    ``(padded [B, T] int32, lengths [B] int32, budgets [B] int64, stop_ids [B, S], stop_seqs
    [B, S, L])``.
  """
  padded, lens = _prepare_prompts(prompts, vocab)
  count = len(lens)
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != count:
    raise ValueError(f"params: has {params.batch_size} rows but there are {count} prompts")
  budgets = _check_budgets(max_new_tokens, count)
  validation.check_key("key", key)
  stop_ids = verification.stop_id_array(stop_token_ids, count, vocab)
  stop_seqs = stops.stop_sequence_array(stop_sequences, count, vocab)
  return padded, lens, budgets, stop_ids, stop_seqs


def choose_block_backend(draft: dm.DSparkDraft, path: str, batch: int, vocab: int, *,
                         store_logits: bool, backend, config):
  """The `dispatch.Choice` that drafts the blocks of a folded `path` at `batch` rows of a
  vocabulary of `vocab` (`proposal.choose_backend`)."""
  return proposal.choose_backend(
      draft.head.arrays(),
      jax.ShapeDtypeStruct((batch, draft.config.gamma, vocab), draft.config.dtype),
      kind=draft.head.kind, greedy_only=path == proposal.PATH_FOLDED_GREEDY,
      store_logits=store_logits, confidence=draft.confidence is not None, backend=backend,
      config=config)
