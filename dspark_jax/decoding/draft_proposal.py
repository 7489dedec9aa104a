"""`draft_proposal`: the block a draft proposes after given tokens, exactly as inside `generate`.

This module owns one researcher-facing function. For tokens ``[B, n]`` it runs generate's pieces
(`dspark_jax.decoding.rounds`) in one compiled program:

* the context half of generate's prefill over ``tokens[:, :n-1]``, by the same calls (the target
  on a fresh cache, then `DSparkDraft.extend_context`): the target's features of positions
  0 .. n-2 fill the draft's context cache (the prefill's first-token sampling is left out: here the
  token is given, and compiling the target's top-k/top-p sampler would triple the compile time);
* the anchor ``tokens[:, n-1]`` at position n-1 (where generate puts its first sampled token);
* the draft forward (`rounds._draft_forward`): the block ``[anchor, mask × (γ-1)]`` at positions
  n-1 .. n+γ-2, attending to the whole context and bidirectionally to itself;
* the folded block sampler (`dspark_jax.draft.block.folded_block`) with the draft's head and
  confidence head, keyed as generate's round at that position is.

It is DeepSpec's evaluator step (``deepspec/eval/dspark``) after a prompt of n-1 tokens whose first
generated token is ``tokens[:, n-1]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import requests
from dspark_jax.decoding import rounds
from dspark_jax import validation
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import pallas_block
from dspark_jax.models import draft as dm
from dspark_jax.models import layout
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "greedy_only", "backend",
                                             "store_logits"))
def _program(target_state, draft_state, tokens, rows, key, *, target_def, draft_def, greedy_only,
             backend, store_logits):
  target = nnx.merge(target_def, target_state)
  draft = nnx.merge(draft_def, draft_state)
  batch, n = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(n - 1, dtype=jnp.int32), (batch, n - 1))
  _, features, _ = target(tokens[:, :n - 1], positions, tm.init_cache(target.config, batch, n))
  state = {"context": draft.extend_context(features, positions, draft.init_context(batch, n)),
           "anchor": tokens[:, n - 1], "anchor_pos": jnp.full((batch,), n - 1, jnp.int32)}
  base, hidden = rounds._draft_forward(target, draft, state)
  head = pallas_block.head_arrays_for(draft.head.arrays(), [backend])
  head, conf, hidden = rounds._draft_inputs(draft, hidden, head)
  drafts, corrected, confidence = proposal.folded_block(
      head, conf, base, state["anchor"], hidden, rows["greedy"], rows["temperature"],
      rows["seeds"], state["anchor_pos"], key, kind=draft.head.kind, greedy_only=greedy_only,
      backend=backend, store_logits=store_logits)
  if isinstance(corrected, proposal.CompactLogits):
    corrected = corrected.with_inputs(base, head["w2"])
  return drafts, corrected, confidence


def draft_proposal(target: tm.TargetModel, draft: dm.DSparkDraft, tokens, params: sp.SamplingParams,
                   key: jax.Array, *, greedy_only: bool = False, store_logits: bool = True,
                   backend=None, config=None) -> proposal.DraftBlock:
  """The draft block `draft` proposes after `tokens`, as `generate` forms it.

  Args:
    target: the target (its features are the draft's context; its embedding and LM head are shared).
    draft: the DSpark draft (any head kind, including "none").
    tokens: [B, n] int token ids in [0, V), n >= 2: context ``tokens[:, :n-1]`` and anchor
      ``tokens[:, n-1]`` (at position n-1).
    params: `SamplingParams` with B rows: greedy rows take the argmax, sampled rows draw from
      ``softmax(corrected / T)`` on the streams of ``(key, seed, n + k, Stream.DRAFT)``.
    key: base PRNG key.
    greedy_only: the folded greedy-only variant (every row argmax, no corrected logits), as
      generate runs an all-greedy batch. Default: the sampling variant, which also returns the
      corrected logits of greedy rows (its tokens are the same argmax).
    store_logits, backend, config: as for `generate` (`dspark_jax.kernels.dispatch`).

  Returns:
    A `DraftBlock`: ``tokens`` [B, γ] at positions n .. n+γ-1, ``corrected_logits`` [B, γ, V] in
    the draft's compute dtype (None with `greedy_only`), ``confidence`` [B, γ] (sigmoid, after the
    calibrated temperatures if the head has them; None without a confidence head), ``path`` and
    ``backend``.

  Raises:
    ValueError: a draft that does not fit the target, `tokens` not [B, n >= 2] integers in
      [0, V) (naming the first bad element), params of another batch size, a bad key, or an
      explicit backend whose preconditions fail.
  """
  draft.config.check_against(target.config)
  requests.check_pair(target, draft)
  tokens = validation.as_array("tokens", tokens)
  if np.ndim(tokens) != 2:
    raise ValueError(f"tokens: expected [B, n], got shape {np.shape(tokens)}")
  batch, n = np.shape(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
  if batch < 1 or n < 2:
    raise ValueError(f"tokens: expected B >= 1 rows of n >= 2 tokens (context, then the anchor), "
                     f"got shape {np.shape(tokens)}")
  validation.check_range("tokens", tokens, 0, target.config.vocab_size)
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != batch:
    raise ValueError(f"params: has {params.batch_size} rows but tokens has {batch}")
  if greedy_only and not params.all_greedy():
    raise ValueError("greedy_only: every row of params must be greedy")
  validation.check_key("key", key)
  gamma, vocab = draft.config.gamma, target.config.vocab_size
  choice = proposal.choose_backend(
      draft.head.arrays(), jax.ShapeDtypeStruct((batch, gamma, vocab), draft.config.dtype),
      kind=draft.head.kind, greedy_only=greedy_only, store_logits=store_logits,
      confidence=draft.confidence is not None, backend=backend, config=config,
      devices=layout.plan_devices(draft.plan))
  rows = rounds._row_arrays(params)
  target_def, target_state = nnx.split(target)
  draft_def, draft_state = nnx.split(draft)
  drafts, corrected, confidence = _program(
      target_state, draft_state, jnp.asarray(tokens, jnp.int32), rows, key, target_def=target_def,
      draft_def=draft_def, greedy_only=greedy_only, backend=choice, store_logits=store_logits)
  return proposal.DraftBlock(
      tokens=drafts, corrected_logits=corrected, greedy_mask=jnp.asarray(rows["greedy"]),
      temperatures=jnp.asarray(rows["temperature"]), confidence=confidence,
      path=proposal.PATH_FOLDED_GREEDY if greedy_only else proposal.PATH_FOLDED_SAMPLING,
      backend=choice)
