"""`DraftSampler`: the built-once draft proposer that routes each batch to a compiled variant.

`build_draft_sampler` resolves the memory gate (`memory_gate`) and compiles, ahead of time, the folded
programs of `proposal.folded_block` for a fixed set of padding buckets (powers of two up to, and
including, ``max_batch_size``), so steady-state proposing never recompiles:

* **greedy-only** variant: always built;
* **sampling** variant (mixed greedy + sampled rows, emits corrected logits): built iff the gate says so.

`DraftSampler.propose` routes a batch: all-greedy -> folded greedy-only; with sampled rows ->
folded sampling if enabled, else the eager loop. The path taken is recorded on the block (`block.path`).
Batches are padded with greedy filler rows to the next bucket; because every row's randomness depends
only on its own (seed, position), padding never changes a real row's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.draft import heads as heads_lib
from dspark_jax.draft import memory_gate
from dspark_jax import validation
from dspark_jax.draft import block as proposal
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from dspark_jax.sampling import params as sp

FoldedSampling = memory_gate.FoldedSampling


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
  """Padding buckets: 1, 2, 4, ... below `max_batch_size`, then `max_batch_size` itself."""
  if max_batch_size < 1:
    raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
  sizes = []
  size = 1
  while size < max_batch_size:
    sizes.append(size)
    size *= 2
  sizes.append(max_batch_size)
  return tuple(sizes)


def _pad_rows(x, size):
  """Zero rows appended up to `size` (NumPy on the host for host values: nothing to compile)."""
  if x is None or x.shape[0] == size:
    return x
  pad = [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  return np.pad(x, pad) if isinstance(x, np.ndarray) else jnp.pad(x, pad)


def _is_typed_key(key) -> bool:
  return jax.dtypes.issubdtype(getattr(key, "dtype", np.uint32), jax.dtypes.prng_key)


def _signature(greedy_only: bool, args: tuple) -> tuple:
  """What can change between calls of one sampler: variant, bucket, hidden dtype, key type.

  (The weights, γ, V and the logits dtype are fixed at build time and checked in `propose`.)
  """
  base_logits, hidden, key = args[2], args[4], args[9]
  return (greedy_only, base_logits.shape[0], None if hidden is None else hidden.dtype, key.dtype)


@dataclasses.dataclass
class DraftSampler:
  """Proposes draft blocks; build with `build_draft_sampler`.

  Attributes:
    head, confidence_head: the heads (weights are passed to the compiled programs as arguments).
    max_batch_size, vocab_size, gamma, logits_dtype, hidden_size: the static shapes it serves.
    buckets: the padding bucket sizes.
    decision: the `memory_gate.GateDecision` taken at build time.
    backend, config: what was asked for ("auto", "xla", "triton", "hopper", or None for
      ``$DSPARK_JAX_BACKEND``) and its settings (`dspark_jax.kernels.dispatch`).
    store_logits: sampling blocks carry their corrected logits (True) or a
      `proposal.CompactLogits` (False).
    compilations: how many programs this sampler has compiled (for compile guards).
  """

  head: heads_lib.MarkovHead
  confidence_head: heads_lib.ConfidenceHead | None
  max_batch_size: int
  vocab_size: int
  gamma: int
  logits_dtype: Any
  hidden_size: int | None
  buckets: tuple[int, ...]
  decision: memory_gate.GateDecision | None = None
  backend: str | None = None
  config: Any = None
  store_logits: bool = True
  compilations: int = 0
  _compiled: dict = dataclasses.field(default_factory=dict, repr=False)
  _choices: dict = dataclasses.field(default_factory=dict, repr=False)
  _weights: tuple | None = dataclasses.field(default=None, repr=False)

  @property
  def folded_sampling(self) -> bool:
    """Whether mixed batches run the folded sampling variant (else they run eagerly)."""
    return bool(self.decision and self.decision.folded_sampling)

  @property
  def uses_hidden(self) -> bool:
    return self.head.needs_hidden or self.confidence_head is not None

  def bucket_for(self, batch: int) -> int:
    return next(b for b in self.buckets if b >= batch)

  # ---- compilation ---------------------------------------------------------------------------------
  def choice(self, greedy_only: bool, bucket: int) -> dispatch.Choice:
    """The backend decision (`dispatch.Choice`) for one variant at one padding bucket."""
    key = (greedy_only, bucket)
    if key not in self._choices:
      arrays = self.head.arrays()
      self._choices[key] = proposal.choose_backend(
          arrays, jax.ShapeDtypeStruct((bucket, self.gamma, self.vocab_size), self.logits_dtype),
          kind=self.head.kind, greedy_only=greedy_only, store_logits=self.store_logits,
          confidence=self.confidence_head is not None, backend=self.backend, config=self.config)
    return self._choices[key]

  @property
  def backends(self) -> dict[tuple[str, int], dispatch.Choice]:
    """``{(variant, bucket): Choice}`` for every enabled variant and bucket: what runs, and why."""
    out = {}
    for bucket in self.buckets:
      out[("greedy", bucket)] = self.choice(True, bucket)
      if self.folded_sampling:
        out[("sampling", bucket)] = self.choice(False, bucket)
    return out

  def _head_arrays(self, arrays=None) -> dict:
    """The head's arrays (or `arrays`) as the programs take them: with W2 part by part
    (`pallas_block.prepare_head_arrays`) where a bucket runs the Hopper kernels."""
    choices = [self.choice(g, b) for b in self.buckets for g in (True, False)]
    return pallas_block.head_arrays_for(self.head.arrays() if arrays is None else arrays, choices)

  def _abstract_inputs(self, bucket: int, hidden_dtype=None):
    def spec(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype)
    hidden = None
    if self.uses_hidden:
      hidden = spec((bucket, self.gamma, self.hidden_size), hidden_dtype or self.logits_dtype)
    return (
        # Shapes only: the head's arrays may be abstract (`dspark-jax probe`).
        jax.tree.map(lambda a: spec(a.shape, a.dtype),
                     jax.eval_shape(self._head_arrays, self.head.arrays())),
        None if self.confidence_head is None
        else jax.tree.map(lambda a: spec(a.shape, a.dtype), self.confidence_head.arrays()),
        spec((bucket, self.gamma, self.vocab_size), self.logits_dtype),
        spec((bucket,), jnp.int32), hidden, spec((bucket,), jnp.bool_), spec((bucket,), jnp.float32),
        spec((bucket,), jnp.uint32), spec((bucket,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )

  def _executable(self, greedy_only: bool, args: tuple):
    signature = _signature(greedy_only, args)
    compiled = self._compiled.get(signature)
    if compiled is None:
      choice = self.choice(greedy_only, args[2].shape[0])
      compiled = proposal.folded_block.lower(*args, kind=self.head.kind, greedy_only=greedy_only,
                                             backend=choice,
                                             store_logits=self.store_logits).compile()
      self._compiled[signature] = compiled
      self.compilations += 1
    return compiled

  def compile_variant(self, greedy_only: bool, bucket: int, hidden_dtype=None):
    """Compiles (or fetches) one variant at one bucket; returns the `jax.stages.Compiled`."""
    return self._executable(greedy_only, self._abstract_inputs(bucket, hidden_dtype))

  def warmup(self, hidden_dtype=None) -> None:
    """Compiles every enabled variant at every bucket now, instead of on first use."""
    for bucket in self.buckets:
      self.compile_variant(True, bucket, hidden_dtype)
      if self.folded_sampling:
        self.compile_variant(False, bucket, hidden_dtype)

  # ---- proposing ------------------------------------------------------------------------------------
  def propose(self, base_logits: jax.Array, anchor: jax.Array, hidden: jax.Array | None,
              params: sp.SamplingParams, key: jax.Array, positions: jax.Array
              ) -> proposal.DraftBlock:
    """Proposes a block (see `proposal.sample_block` for the arguments) on the path the gate picks.

    Raises:
      ValueError: more rows than `max_batch_size`, a vocab / γ / dtype mismatch, or any bad input.
    """
    base_logits, anchor, hidden, positions = proposal.as_block_inputs(base_logits, anchor, hidden,
                                                                       positions)
    validation.check_key("key", key)
    if np.ndim(base_logits) != 3:
      raise ValueError(f"base_logits: expected [B, γ, V], got shape {np.shape(base_logits)}")
    batch, gamma, vocab = base_logits.shape
    if batch > self.max_batch_size:
      raise ValueError(f"base_logits: {batch} rows exceed max_batch_size={self.max_batch_size}")
    if vocab != self.vocab_size:
      raise ValueError(f"base_logits: vocab {vocab} does not match the sampler's {self.vocab_size}")
    if gamma != self.gamma:
      raise ValueError(f"base_logits: γ={gamma} does not match the sampler's γ={self.gamma}")
    if base_logits.dtype != self.logits_dtype:
      raise ValueError(f"base_logits: dtype {base_logits.dtype} does not match the sampler's "
                       f"logits_dtype {np.dtype(self.logits_dtype)}")
    proposal.check_block_inputs(self.head, base_logits, anchor, hidden, params, positions,
                                self.confidence_head)
    if not self.uses_hidden:
      hidden = None  # a vanilla head without confidence never reads it; keep one signature
    all_greedy = params.all_greedy()
    if not all_greedy and not self.folded_sampling:
      return proposal.sample_block_eager(self.head, base_logits, anchor, hidden, params, key,
                                         positions, confidence_head=self.confidence_head,
                                         store_logits=self.store_logits)

    bucket = self.bucket_for(batch)
    rows = proposal.block_arrays(params.padded(bucket), _pad_rows(np.asarray(anchor), bucket),
                                 _pad_rows(np.asarray(positions), bucket))
    # One transfer for all the small per-row arrays (they also go into the returned block).
    rows = jax.device_put(rows)
    if not _is_typed_key(key):
      key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if self._weights is None:
      self._weights = (self._head_arrays(),
                       None if self.confidence_head is None else self.confidence_head.arrays())
    args = (*self._weights, _pad_rows(base_logits, bucket), rows["anchor"],
            _pad_rows(hidden, bucket), rows["greedy"], rows["temperature"], rows["seeds"],
            rows["positions"], key)
    tokens, corrected, confidence = self._executable(all_greedy, args)(*args)
    if isinstance(corrected, proposal.CompactLogits):  # the program's inputs: attached, not copied
      corrected = corrected.with_inputs(args[2], self._weights[0]["w2"])
    greedy, temperature = rows["greedy"], rows["temperature"]
    if bucket != batch:
      tokens, greedy, temperature = tokens[:batch], greedy[:batch], temperature[:batch]
      if isinstance(corrected, proposal.CompactLogits):
        corrected = corrected.first_rows(batch)
      elif corrected is not None:
        corrected = corrected[:batch]
      confidence = None if confidence is None else confidence[:batch]
    return proposal.DraftBlock(
        tokens=tokens, corrected_logits=None if all_greedy else corrected,
        greedy_mask=greedy, temperatures=temperature,
        confidence=confidence,
        path=proposal.PATH_FOLDED_GREEDY if all_greedy else proposal.PATH_FOLDED_SAMPLING,
        backend=self.choice(all_greedy, bucket))


def _infer_hidden_size(head, confidence_head, hidden_size):
  if head.hidden_size is not None:
    if hidden_size is not None and hidden_size != head.hidden_size:
      raise ValueError(f"hidden_size: {hidden_size} does not match the head's H={head.hidden_size}")
    return head.hidden_size
  if confidence_head is not None and hidden_size is None:
    raise ValueError(f"hidden_size: required with a {head.kind!r} head and a confidence head "
                     "(the confidence weight alone cannot tell H from H+r)")
  return hidden_size


def build_draft_sampler(head: heads_lib.MarkovHead, *, max_batch_size: int, vocab_size: int,
                        gamma: int, logits_dtype=jnp.bfloat16,
                        mode: FoldedSampling | str | None = None,
                        headroom_bytes: int = memory_gate.DEFAULT_HEADROOM_BYTES,
                        memory_stats=None,
                        confidence_head: heads_lib.ConfidenceHead | None = None,
                        hidden_size: int | None = None, backend: str | None = None,
                        config=None, store_logits: bool = True) -> DraftSampler:
  """Builds a `DraftSampler`: resolves the memory gate and compiles the folded variants once.

  Args:
    head: the sequential head.
    max_batch_size: the most rows one `propose` call may carry; the largest padding bucket.
    vocab_size: V; must match the head.
    gamma: block size γ.
    logits_dtype: dtype of the base (and corrected) logits.
    mode: `FoldedSampling` (or "off" / "auto" / "force"); None reads ``$DSPARK_JAX_FOLDED_SAMPLING``,
      default AUTO.
    headroom_bytes: AUTO's required margin beyond the estimated need (default 1 GiB).
    memory_stats: override of the device's memory statistics: a mapping shaped like
      ``jax.Device.memory_stats()``, or a callable returning one. See `memory_gate` for the policy
      when nothing is reported.
    confidence_head: optional confidence head, run inside the folded loop.
    hidden_size: H, needed only when it cannot be read off the heads.
    backend: what computes the folded programs: "auto" (the dispatch table, per variant and
      bucket), "xla", "triton" or "hopper"; None reads ``$DSPARK_JAX_BACKEND`` (default "auto").
      An explicit backend must satisfy its preconditions at every bucket
      (`dspark_jax.kernels.dispatch`). The same law on every backend.
    config: that backend's settings (`dispatch.XlaConfig`, `TritonConfig`, `HopperConfig`).
    store_logits: False: sampling blocks keep a `proposal.CompactLogits` (each token's log q and
      what recomputes the verifier's row) instead of the [B, γ, V] corrected logits; the memory
      gate then counts that instead.

  Returns:
    A `DraftSampler` whose greedy-only variant (and sampling variant, if enabled) is compiled at the
    largest bucket; smaller buckets compile on first use, or all at once with `DraftSampler.warmup`.
  """
  mode = memory_gate.resolve_mode(mode)
  max_batch_size = validation.check_positive_int("max_batch_size", max_batch_size)
  vocab_size = validation.check_positive_int("vocab_size", vocab_size)
  gamma = validation.check_positive_int("gamma", gamma)
  if vocab_size != head.vocab_size:
    raise ValueError(f"vocab_size: {vocab_size} does not match the head's vocab {head.vocab_size}")
  if gamma < 1:
    raise ValueError(f"gamma: must be >= 1, got {gamma}")
  if headroom_bytes < 0:
    raise ValueError(f"headroom_bytes: must be >= 0, got {headroom_bytes}")
  logits_dtype = jnp.dtype(logits_dtype)
  if not jnp.issubdtype(logits_dtype, jnp.floating):
    raise ValueError(f"logits_dtype: expected a float dtype, got {logits_dtype}")
  sampler = DraftSampler(
      head=head, confidence_head=confidence_head, max_batch_size=max_batch_size,
      vocab_size=vocab_size, gamma=gamma, logits_dtype=logits_dtype,
      hidden_size=_infer_hidden_size(head, confidence_head, hidden_size),
      buckets=bucket_sizes(max_batch_size), backend=backend, config=config,
      store_logits=store_logits)
  for bucket in sampler.buckets:  # an explicit backend's preconditions, checked before compiling
    for greedy_only in (True, False):
      sampler.choice(greedy_only, bucket)

  need = memory_gate.sampling_need_bytes(max_batch_size, vocab_size, gamma, logits_dtype,
                                         store_logits=store_logits, rank=head.rank)
  free, source = memory_gate.probe_free_bytes(memory_stats)
  enabled, reason = memory_gate.decide(mode, need, free, headroom_bytes, source)
  compiled_bytes = None
  if mode is not FoldedSampling.OFF:
    analysis = sampler.compile_variant(False, max_batch_size).memory_analysis()
    if analysis is not None:
      compiled_bytes = int(analysis.output_size_in_bytes + analysis.temp_size_in_bytes)
    if not enabled:
      sampler._compiled.clear()  # not used: do not keep the executable around
  sampler.decision = memory_gate.GateDecision(
      mode=mode, folded_sampling=enabled, need_bytes=need, free_bytes=free,
      headroom_bytes=headroom_bytes, compiled_bytes=compiled_bytes, reason=reason)
  if mode is FoldedSampling.AUTO and not enabled:
    memory_gate.logger.warning("dspark_jax: folded sampling disabled; %s", reason)
  sampler.compile_variant(True, max_batch_size)
  return sampler
