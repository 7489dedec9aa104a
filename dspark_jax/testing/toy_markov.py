"""A toy target/draft pair small enough to enumerate, and the propose -> verify loop that decodes it.

This module owns the harness behind the exact-law checks of verification (tests and
``notebooks/distribution_checks.ipynb``). It runs the library's real code paths on a model pair whose
laws `law_checks` can write down exactly:

* the **target** is a Markov chain: its next-token logits are ``target_table[previous token]``, so the
  verify pass over ``[anchor, x_1..x_γ]`` is a table lookup, and `law_checks.chain_law` is its exact
  autoregressive law;
* the **draft** is a real DSpark draft: base logits ``draft_base[anchor]`` [γ, V] stand in for the
  parallel backbone, and a real `heads.MarkovHead` conditions each drafted token on the one before.

`speculative_decode` generates L tokens for N independent rows by repeated `proposal.sample_block` ->
`verification.verify` rounds, with one base key for the whole decode: every random stream is a
function of (key, seed, position, stream) only, and positions advance with what was committed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.draft import heads
from dspark_jax.draft import block as proposal
from dspark_jax.sampling import params as sp
from dspark_jax import verification
from dspark_jax.testing import compiling


@dataclasses.dataclass(frozen=True)
class ToyPair:
  """A Markov target and a DSpark draft over a small vocabulary.

  Attributes:
    target_table: [V, V] float32; row i holds the target's logits after token i.
    draft_base: [V, γ, V] float32; the draft's base logits for a block anchored at token i.
    head: the draft's sequential head (vanilla, no hidden states).
  """

  target_table: np.ndarray
  draft_base: np.ndarray
  head: heads.MarkovHead

  @property
  def vocab(self) -> int:
    return self.target_table.shape[0]

  @property
  def gamma(self) -> int:
    return self.draft_base.shape[1]


def random_pair(vocab: int, gamma: int, *, seed: int = 0, rank: int = 4, target_scale: float = 1.5,
                draft_scale: float = 1.0, head_scale: float = 2.0) -> ToyPair:
  """A pair whose draft law differs from the target's (random tables, a random vanilla head)."""
  rng = np.random.default_rng(seed)
  head = heads.markov_head_from_arrays("vanilla", {
      "w1": rng.normal(0, 1, (vocab, rank)).astype(np.float32),
      "w2": rng.normal(0, head_scale / np.sqrt(rank), (rank, vocab)).astype(np.float32)})
  return ToyPair(
      target_table=rng.normal(0, target_scale, (vocab, vocab)).astype(np.float32),
      draft_base=rng.normal(0, draft_scale, (vocab, gamma, vocab)).astype(np.float32),
      head=head)


def identical_pair(target_table: np.ndarray, gamma: int) -> ToyPair:
  """A pair whose draft law equals the target's (p = q): zero base logits, ``W1 = I``, ``W2 = table``,
  so the corrected logits of every draft step are exactly the target's next-token logits."""
  table = np.asarray(target_table, np.float32)
  vocab = table.shape[0]
  head = heads.markov_head_from_arrays("vanilla", {"w1": np.eye(vocab, dtype=np.float32),
                                                   "w2": table})
  return ToyPair(target_table=table, draft_base=np.zeros((vocab, gamma, vocab), np.float32),
                 head=head)


@dataclasses.dataclass
class DecodeTrace:
  """What `speculative_decode` produced.

  Attributes:
    tokens: [N, L] int generated tokens; the pad symbol V after a stop token.
    accept_lens: [rounds, N] accepted drafts per round (rows already done included, ignore them).
    num_committed: [rounds, N] tokens committed per round.
    active: [rounds, N] bool, the row still needed tokens in that round.
    verify_lens: [rounds, N] the verify length each round used.
  """

  tokens: np.ndarray
  accept_lens: np.ndarray
  num_committed: np.ndarray
  active: np.ndarray
  verify_lens: np.ndarray

  def mean_accepted(self) -> float:
    """τ: mean tokens committed per active round (accepted drafts + the bonus)."""
    return float(self.num_committed[self.active].mean())


def speculative_decode(pair: ToyPair, params: sp.SamplingParams, key: jax.Array, start: int,
                       length: int, *, first_position: int | np.ndarray = 0,
                       verify_lens: np.ndarray | Callable[[int], np.ndarray] | None = None,
                       stop_token_ids=(), greedy_only: bool = False, store_logits: bool = True,
                       block_hook: Callable[[proposal.DraftBlock, np.ndarray],
                                            proposal.DraftBlock] | None = None
                       ) -> DecodeTrace:
  """Generates `length` tokens per row after `start` by propose -> verify rounds.

  Args:
    pair: the toy model pair.
    params: `SamplingParams`, one row per independent decode.
    key: the one base key of the whole decode.
    start: the token before the first generated one (the first anchor).
    length: tokens to generate per row.
    first_position: absolute position of `start` (scalar or [N]).
    verify_lens: [N] verify lengths (1..γ+1) used every round, a function round -> [N], or None.
    stop_token_ids: passed to `verification.verify`.
    greedy_only: propose with the greedy-only variant (every row must be greedy).
    store_logits: False proposes `proposal.CompactLogits` blocks (no stored corrected logits).
    block_hook: ``hook(block, anchor) -> block`` applied to each proposed block before verification
      (mutation tests: a deliberately wrong verifier must be caught).

  Returns:
    A `DecodeTrace`.
  """
  n = params.batch_size
  vocab, gamma = pair.vocab, pair.gamma
  table = jnp.asarray(pair.target_table)
  draft_base = jnp.asarray(pair.draft_base)
  tokens = np.full((n, length), vocab, np.int64)
  count = np.zeros(n, np.int64)
  done = np.zeros(n, bool)
  anchor = np.full(n, start, np.int32)
  position = np.broadcast_to(np.asarray(first_position, np.int32), (n,)).copy()
  trace = {"accept_lens": [], "num_committed": [], "active": [], "verify_lens": []}

  def propose_and_verify(params, key, anchor, position, lens):
    block = proposal.sample_block(pair.head, draft_base[anchor], anchor, None, params, key,
                                  position, greedy_only=greedy_only, store_logits=store_logits)
    if block_hook is not None:
      block = block_hook(block, anchor)
    verify_inputs = jnp.concatenate([anchor[:, None], block.tokens], axis=1)
    return verification.verify(table[verify_inputs], block, params, key, position, lens,
                               stop_token_ids)

  step = compiling.compute_bound_jit(propose_and_verify)  # hundreds of thousands of rows
  round_index = 0
  while not done.all():
    lens = verify_lens(round_index) if callable(verify_lens) else verify_lens
    lens = np.full(n, gamma + 1, np.int32) if lens is None else np.asarray(lens, np.int32)
    result = step(params, key, jnp.asarray(anchor), jnp.asarray(position), jnp.asarray(lens))
    committed = np.asarray(result.committed)
    num = np.asarray(result.num_committed)
    for slot in range(gamma + 1):
      take = ~done & (slot < num) & (count < length)
      tokens[take, count[take]] = committed[take, slot]
      count += take
    trace["accept_lens"].append(np.asarray(result.accept_len))
    trace["num_committed"].append(num)
    trace["active"].append(~done)
    trace["verify_lens"].append(lens)
    done |= np.asarray(result.finished) | (count >= length)
    anchor = committed[np.arange(n), num - 1].astype(np.int32)
    position = position + num.astype(np.int32)
    round_index += 1
  return DecodeTrace(tokens=tokens, **{k: np.stack(v) for k, v in trace.items()})
