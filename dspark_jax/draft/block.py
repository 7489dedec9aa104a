"""Block sampling of a DSpark draft: the γ-step loop, folded (one compiled program) or eager.

Given the backbone's base logits ``U`` [B, γ, V] and hidden states ``h`` [B, γ, H], step k = 1..γ
computes the *corrected* logits ``L_k = U_k + bias_k(x_{k-1})`` (x_0 = anchor), stores them in the
logits dtype, and samples ``x_k`` from the stored values: greedy rows by argmax, sampled rows exactly
from ``softmax(L_k / T)``. Sampling from the *stored* (rounded) logits is deliberate: the verifier's
draft law ``q = softmax(corrected / T)`` is then exactly the law the tokens were drawn from.

Two paths run the same step function (`_block_step`), so for the same key they draw from the same
law with the same arithmetic (equal values, up to how XLA compiles each program):

* **folded** (`sample_block`, `folded_block`): the whole loop in one jitted program, the JAX
  counterpart of SGLang's CUDA-graph folding. Variant ``greedy_only=True`` takes the argmax
  everywhere and does not emit corrected logits (greedy verification does not need them). Which
  backend computes it is decided once, from shapes and device, by `dspark_jax.kernels.dispatch`:
  XLA (forms "loop", a `lax.fori_loop` writing in place, and "unrolled", the same arithmetic as the
  eager path), or the GPU kernels (`dspark_jax.kernels.pallas_block`), which sum
  ``v @ W2`` in their own order, so a corrected logit can differ in its last bit and a near-tie go
  the other way; the law, ``softmax`` of the *stored* logits, is the same (tests check it).
* **eager** (`sample_block_eager`): a Python loop calling the compiled step γ times: the reference, and
  the fallback for mixed batches when the memory gate disables the folded sampling variant.

``store_logits=False`` (XLA and Triton backends, and the eager path) keeps a `CompactLogits` instead
of the [B, γ, V] corrected logits: each token's ``log q`` and what recomputes any row with the same arithmetic,
for the verifier's one row per request. The same tokens, less memory, no faster.

Randomness: draft token k of row b uses the stream of ``(key, seed_b, positions_b + k, Stream.DRAFT)``,
where ``positions`` holds the anchors' absolute positions. So block sampling at step k draws exactly
what ``sample_step(L_k, params, key, positions + k)`` would.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspark_jax import validation
from dspark_jax.draft import heads as heads_lib
from dspark_jax.kernels import dispatch
from dspark_jax.kernels import pallas_block
from dspark_jax.sampling import params as sp
from dspark_jax.sampling import sampler as sampling

PATH_FOLDED_SAMPLING = "folded-sampling"
PATH_FOLDED_GREEDY = "folded-greedy"
PATH_EAGER = "eager"


def choose_backend(head_params: dict, base_logits, *, kind: str, greedy_only: bool,
                   store_logits: bool = True, confidence: bool = False, backend=None, config=None,
                   device: jax.Device | None = None, devices: int | None = None
                   ) -> dispatch.Choice:
  """The `dispatch.Choice` for a folded block of these arrays (shapes and dtypes only).

  `backend`: a `dispatch.Choice` (returned as it is), "auto", "xla", "triton", "hopper", or None
  (``$DSPARK_JAX_BACKEND``, default "auto"); `config`: that backend's settings (`dispatch`). The
  devices the block spans count (the kernels run on one device only): `devices` where given (a
  sharded draft's, `models.layout.plan_devices`, known when its arrays are traced), else those
  ``head_params["w2"]`` spans (1 for a traced array).
  """
  batch, gamma, vocab = base_logits.shape
  return dispatch.resolve(
      backend, config, greedy_only=greedy_only, batch=batch, vocab=vocab,
      rank=head_params["w1"].shape[1], gamma=gamma, w2_dtype=head_params["w2"].dtype,
      logits_dtype=base_logits.dtype, head_kind=kind, store_logits=store_logits,
      confidence=confidence, device=device,
      devices=max(devices or 1, _devices(head_params["w2"])))


def _devices(x) -> int:
  """The devices a concrete array spans (1 for a traced or host value)."""
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
  try:
    return len(sharding.device_set) if sharding is not None else 1
  except (AttributeError, TypeError, ValueError):  # a tracer's sharding has no device set
    return 1


@struct.dataclass
class CompactLogits:
  """A sampling block's draft law without its [B, γ, V] corrected logits (``store_logits=False``).

  Verification reads the corrected logits twice: ``q_k(x_k)`` of every drafted token, and the whole
  row ``q_j`` at a row's first rejection j. This keeps the first, ``log q_k(x_k)``, and what
  recomputes any row: the head's vectors ``v_k`` (``bias_k = v_k @ W2``), the base logits and W2,
  with the arithmetic that drafted the block (`kernel`: the same operations, the same summation
  order), so a recomputed row equals the row the token was drawn from. The recomputation is a
  different compiled program: where a compiler could contract or reorder its float operations
  differently, a logit could differ in its last bit, and the verifier's q by that much; use
  ``store_logits=True`` (the default) where that matters. Per step the block then writes B floats instead of B·V logits
  (a third of the floor's bytes at B = 128), and the verifier reads W2 once more per round.

  `folded_block`, a compiled program, leaves `base_logits` and `w2` as None: they are its inputs,
  and returning an input from a program copies it (231 MB at B = 128, V = 129280). The caller
  attaches its own arrays (`with_inputs`); `sample_block`, `DraftSampler` and `generate` do.

  Attributes:
    token_log_q: [B, γ] float32 ``log softmax(corrected_k / T)[x_k]`` (a greedy row's: unused).
    vectors: [B, γ, r] the head's vectors in W2's dtype.
    base_logits: [B, γ, V] the backbone's logits the block was drafted from (None: not attached).
    w2: [r, V] the head's second matrix (None: not attached).
    kernel: static: None for XLA's arithmetic (the XLA backend and the eager path), else the
      Triton step kernel's settings, ``((name, value), ...)``, it was drafted with.
    drafted_rows: static: the batch the block was drafted at, when it had more (padding) rows:
      rows are recomputed at that size, so that the product is summed as it was.
  """

  token_log_q: jax.Array
  vectors: jax.Array
  base_logits: jax.Array | None = None
  w2: jax.Array | None = None
  kernel: tuple | None = struct.field(pytree_node=False, default=None)
  drafted_rows: int | None = struct.field(pytree_node=False, default=None)

  @property
  def shape(self) -> tuple[int, int, int]:
    """[B, γ, V], the shape of the corrected logits this stands in for."""
    self._check_attached()
    return tuple(self.base_logits.shape)

  def with_inputs(self, base_logits: jax.Array, w2: jax.Array) -> CompactLogits:
    """The same law with the block's base logits [B', γ, V] and W2 [r, V] attached (B' >= B: a
    padded block's own base logits, of which the first B rows are this block's)."""
    if self.base_logits is not None:
      return self
    batch = self.token_log_q.shape[0]
    drafted = base_logits.shape[0]
    return self.replace(base_logits=base_logits[:batch], w2=w2,
                        drafted_rows=self.drafted_rows or (drafted if drafted > batch else None))

  def _check_attached(self):
    if self.base_logits is None or self.w2 is None:
      raise ValueError("CompactLogits: base_logits and w2 are not attached; call "
                       "with_inputs(base_logits, w2) with the block's inputs")

  def rows(self, position: jax.Array) -> jax.Array:
    """[B, V] row b's corrected logits at block position ``position[b]`` (0-based), in the logits
    dtype: the values its token was drawn from, recomputed with the same arithmetic."""
    batch = self.shape[0]
    pad = max((self.drafted_rows or batch) - batch, 0)
    take = lambda x: jnp.pad(jnp.take_along_axis(x, position[:, None, None], axis=1)[:, 0],
                             ((0, pad), (0, 0)))
    return corrected_rows(take(self.vectors), take(self.base_logits), self.w2, self.kernel)[:batch]

  def first_rows(self, n: int) -> CompactLogits:
    """The first `n` rows (a padded block's real ones), still recomputed at the drafted size."""
    cut = lambda x: None if x is None else x[:n]
    return self.replace(token_log_q=cut(self.token_log_q), vectors=cut(self.vectors),
                        base_logits=cut(self.base_logits),
                        drafted_rows=self.drafted_rows or self.token_log_q.shape[0])

  def dense(self) -> jax.Array:
    """[B, γ, V] all the corrected logits (tests and inspection; the point is not to need them)."""
    batch, gamma, _ = self.shape
    return jnp.stack([self.rows(jnp.full((batch,), k, jnp.int32)) for k in range(gamma)], axis=1)


def corrected_rows(v: jax.Array, base: jax.Array, w2: jax.Array, kernel: tuple | None) -> jax.Array:
  """``round(base + v @ W2)`` [B, V] in `base`'s dtype, by the arithmetic a block was drafted with.

  Args:
    v: [B, r] vectors in W2's dtype. base: [B, V] base logits. w2: [r, V].
    kernel: None (XLA: the folded loop's and the eager path's step) or the Triton backend's
      kernel settings: the same kernel then sums ``v @ W2`` in the same order.
  """
  if kernel is None:
    return _rounded_logits(base, heads_lib.markov_bias(w2, v)).astype(base.dtype)
  return pallas_block.corrected_rows(v, base, w2, kernel)


@struct.dataclass
class DraftBlock:
  """A proposed block of γ draft tokens per row.

  Attributes:
    tokens: [B, γ] int32 draft tokens x_1..x_γ.
    corrected_logits: [B, γ, V] corrected logits (before temperature) in the base logits' dtype; a
      `CompactLogits` in their place (``store_logits=False``); or None on the greedy-only path.
    greedy_mask: [B] bool, rows drafted by argmax.
    temperatures: [B] float32 draft temperatures (clamped >= 1e-5).
    confidence: [B, γ] float32 confidence per position, or None without a confidence head.
    path: which path produced the block ("folded-sampling", "folded-greedy" or "eager"); static.
    backend: the `dispatch.Choice` that computed a folded block (backend, settings, reason), or
      None (the eager path); static.
  """

  tokens: jax.Array
  corrected_logits: jax.Array | None
  greedy_mask: jax.Array
  temperatures: jax.Array
  confidence: jax.Array | None
  path: str = struct.field(pytree_node=False, default=PATH_FOLDED_SAMPLING)
  backend: dispatch.Choice | None = struct.field(pytree_node=False, default=None)


def _round_to(x: jax.Array, dtype) -> jax.Array:
  """float32 `x` rounded (to nearest even) to the values of a narrower float `dtype`, kept in f32."""
  if jnp.dtype(dtype).itemsize >= 4:
    return x
  info = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _rounded_logits(base_k, bias):
  """``U_k + bias`` rounded to the logits dtype, as float32 [B, V] (the values a step samples from)."""
  # Round *before* sampling, so the tokens come from exactly the values we emit. reduce_precision
  # rather than a convert pair: XLA (allowing excess precision, its default on GPU) may delete
  # convert(convert(x, bf16), f32) and sample from the unrounded float32 sum.
  return _round_to(base_k.astype(jnp.float32) + bias, base_k.dtype)


def _block_step(kind, head_params, conf_params, greedy_only, k, prev, state, base_k, hidden_k,
                greedy, temperature, seeds, positions, key, store_logits=True):
  """One position of the block: bias, correct, round to the logits dtype, sample, confidence.

  Returns ``(tokens [B] int32, new_state [B, r], law, confidence [B] | None)``: `law` is the
  corrected logits [B, V] in the logits dtype, or with ``store_logits=False`` the pair
  ``(v [B, r] in W2's dtype, log q(token) [B] float32)`` `CompactLogits` keeps.
  """
  v, e, state = heads_lib.markov_vector(kind, head_params, prev, hidden_k, state)
  rounded = _rounded_logits(base_k, heads_lib.markov_bias(head_params["w2"], v))
  if greedy_only:
    tokens = sampling.greedy_tokens(rounded)
  else:
    keys = sampling.row_keys(key, seeds, positions + k + 1, sampling.Stream.DRAFT)
    tokens = sampling.sample_tokens(rounded, greedy, temperature, keys)
  if store_logits or greedy_only:
    law = rounded.astype(base_k.dtype)  # exact: `rounded` is representable
  else:  # the verifier's log q, from the same values
    log_q = jax.nn.log_softmax(rounded / temperature[:, None], axis=-1)
    law = (v.astype(head_params["w2"].dtype),
           jnp.take_along_axis(log_q, tokens[:, None], axis=1)[:, 0])
  confidence = None
  if conf_params is not None:
    confidence = heads_lib.confidence_step(conf_params, hidden_k, e, k)
  return tokens, state, law, confidence


def _compact(law_per_step):
  """`CompactLogits` (inputs not attached) from the steps' ``(v_k, log q_k)`` pairs."""
  vectors, log_q = zip(*law_per_step)
  return CompactLogits(token_log_q=jnp.stack(log_q, axis=1), vectors=jnp.stack(vectors, axis=1))


@functools.partial(jax.jit, static_argnames=("kind", "greedy_only", "backend", "config",
                                             "store_logits"))
def folded_block(head_params, conf_params, base_logits, anchor, hidden, greedy, temperature, seeds,
                 positions, key, *, kind, greedy_only, backend=None, config=None,
                 store_logits=True):
  """The folded γ-step loop as one program; arrays only (see `sample_block` for the meaning).

  `backend` (static): a `dispatch.Choice`, or "auto", "xla", "triton", "hopper", or None
  (``$DSPARK_JAX_BACKEND`` when traced, default "auto"), resolved by `choose_backend`; `config`
  (static): the backend's settings (`dispatch.XlaConfig`, `TritonConfig`, `HopperConfig`). Callers
  that record the decision resolve it first and pass the `Choice`. `head_params` may carry
  ``"w2_parts"`` (`pallas_block.prepare_head_arrays`), which the Hopper kernels then read.
  `store_logits` (static, sampling variant): False returns a `CompactLogits` instead of the
  corrected logits, without its inputs attached (`CompactLogits.with_inputs`).

  Returns ``(tokens [B, γ], corrected [B, γ, V] | CompactLogits | None, confidence [B, γ] | None)``.

  Raises:
    ValueError: an explicit backend whose preconditions the shapes fail (`dispatch.choose`).
  """
  choice = choose_backend(head_params, base_logits, kind=kind, greedy_only=greedy_only,
                          store_logits=store_logits, confidence=conf_params is not None,
                          backend=backend, config=config)
  if choice.backend is not dispatch.Backend.XLA:
    tokens, corrected, confidence = pallas_block.block(
        choice, kind, head_params, conf_params, base_logits, anchor, hidden, greedy, temperature,
        seeds, positions, key, greedy_only, store_logits)
    if isinstance(corrected, tuple):
      token_log_q, vectors, kernel = corrected
      corrected = CompactLogits(token_log_q=token_log_q, vectors=vectors, kernel=kernel)
    return tokens, corrected, confidence
  form = choice.config.form or "loop"
  batch, gamma, vocab = base_logits.shape
  rank = head_params["w1"].shape[1]
  compact = not (store_logits or greedy_only)
  if form == "unrolled":
    prev, state = anchor.astype(jnp.int32), jnp.zeros((batch, rank), jnp.float32)
    outputs = []
    for k in range(gamma):
      prev, state, law, confidence = _block_step(
          kind, head_params, conf_params, greedy_only, k, prev, state, base_logits[:, k],
          None if hidden is None else hidden[:, k], greedy, temperature, seeds, positions, key,
          store_logits)
      outputs.append((prev, law, confidence))
    tokens, laws, confidence = zip(*outputs)
    if greedy_only:
      corrected = None
    else:
      corrected = (_compact(laws) if compact
                   else jnp.stack(laws, axis=1))
    return (jnp.stack(tokens, axis=1), corrected,
            None if conf_params is None else jnp.stack(confidence, axis=1))
  carry = {
      "prev": anchor.astype(jnp.int32),
      "state": jnp.zeros((batch, rank), jnp.float32),
      "tokens": jnp.zeros((batch, gamma), jnp.int32),
  }
  if compact:
    carry["vectors"] = jnp.zeros((batch, gamma, rank), head_params["w2"].dtype)
    carry["log_q"] = jnp.zeros((batch, gamma), jnp.float32)
  elif not greedy_only:
    carry["corrected"] = jnp.zeros((batch, gamma, vocab), base_logits.dtype)
  if conf_params is not None:
    carry["confidence"] = jnp.zeros((batch, gamma), jnp.float32)

  def body(k, carry):
    base_k = jax.lax.dynamic_index_in_dim(base_logits, k, axis=1, keepdims=False)
    hidden_k = (None if hidden is None
                else jax.lax.dynamic_index_in_dim(hidden, k, axis=1, keepdims=False))
    tokens, state, law, confidence = _block_step(
        kind, head_params, conf_params, greedy_only, k, carry["prev"], carry["state"], base_k,
        hidden_k, greedy, temperature, seeds, positions, key, store_logits)
    out = dict(carry, prev=tokens, state=state)
    put = lambda name, value: jax.lax.dynamic_update_index_in_dim(carry[name], value, k, axis=1)
    out["tokens"] = put("tokens", tokens)
    if "corrected" in carry:
      out["corrected"] = put("corrected", law)
    if compact:
      out["vectors"], out["log_q"] = put("vectors", law[0]), put("log_q", law[1])
    if "confidence" in carry:
      out["confidence"] = put("confidence", confidence)
    return out

  carry = jax.lax.fori_loop(0, gamma, body, carry)
  corrected = carry.get("corrected")
  if compact:
    corrected = CompactLogits(token_log_q=carry["log_q"], vectors=carry["vectors"])
  return carry["tokens"], corrected, carry.get("confidence")


@functools.partial(jax.jit, static_argnames=("kind", "greedy_only", "store_logits"))
def _eager_step(head_params, conf_params, k, prev, state, base_logits, hidden, greedy, temperature,
                seeds, positions, key, *, kind, greedy_only, store_logits=True):
  # Slicing inside the compiled step saves two host dispatches per step.
  base_k = jax.lax.dynamic_index_in_dim(base_logits, k, axis=1, keepdims=False)
  hidden_k = (None if hidden is None
              else jax.lax.dynamic_index_in_dim(hidden, k, axis=1, keepdims=False))
  return _block_step(kind, head_params, conf_params, greedy_only, k, prev, state, base_k, hidden_k,
                     greedy, temperature, seeds, positions, key, store_logits)


def eager_block(head_params, conf_params, base_logits, anchor, hidden, greedy, temperature, seeds,
                positions, key, *, kind, greedy_only=False, store_logits=True):
  """The same loop step by step from Python (one compiled step, called γ times)."""
  batch, gamma, _ = base_logits.shape
  prev = jnp.asarray(anchor, jnp.int32)
  state = jnp.zeros((batch, head_params["w1"].shape[1]), jnp.float32)
  tokens, laws, confidence = [], [], []
  for k in range(gamma):
    prev, state, law, confidence_k = _eager_step(
        head_params, conf_params, np.int32(k), prev, state, base_logits, hidden, greedy,
        temperature, seeds, positions, key, kind=kind, greedy_only=greedy_only,
        store_logits=store_logits)
    tokens.append(prev)
    laws.append(law)
    confidence.append(confidence_k)
  if greedy_only:
    corrected = None
  else:
    corrected = (jnp.stack(laws, axis=1) if store_logits
                 else _compact(laws).with_inputs(jnp.asarray(base_logits), head_params["w2"]))
  return (jnp.stack(tokens, axis=1), corrected,
          None if conf_params is None else jnp.stack(confidence, axis=1))


# ---- public entry points ---------------------------------------------------------------------------


def check_block_inputs(head: heads_lib.MarkovHead, base_logits, anchor, hidden, params, positions,
                       confidence_head=None) -> None:
  """Raises ValueError (naming the argument and its first bad element) unless the inputs of a block
  proposal fit together: shapes, dtypes, anchors in [0, V), positions in [0, 2**31). Values being
  traced are checked for shape and dtype only."""
  if np.ndim(base_logits) != 3:
    raise ValueError(f"base_logits: expected [B, γ, V], got shape {np.shape(base_logits)}")
  if not jnp.issubdtype(base_logits.dtype, jnp.floating):
    raise ValueError(f"base_logits: expected a float dtype, got {base_logits.dtype}")
  batch, gamma, vocab = base_logits.shape
  if vocab != head.vocab_size:
    raise ValueError(f"base_logits: vocab {vocab} does not match the head's vocab {head.vocab_size}")
  validation.check_batch("anchor", anchor, batch)
  validation.check_range("anchor", anchor, 0, vocab)
  validation.check_batch("positions", positions, batch)
  sampling.check_positions("positions", positions)
  if not isinstance(params, sp.SamplingParams):
    raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
  if params.batch_size != batch:
    raise ValueError(f"params: has {params.batch_size} rows but base_logits has {batch}")
  needs_hidden = head.needs_hidden or confidence_head is not None
  if hidden is None:
    if needs_hidden:
      what = "a confidence head" if not head.needs_hidden else f"a {head.kind!r} head"
      raise ValueError(f"hidden: {what} needs the backbone hidden states [B, γ, H], got None")
    return
  if np.ndim(hidden) != 3 or tuple(hidden.shape[:2]) != (batch, gamma):
    raise ValueError(f"hidden: expected [{batch}, {gamma}, H], got shape {np.shape(hidden)}")
  if head.hidden_size is not None and hidden.shape[2] != head.hidden_size:
    raise ValueError(f"hidden: H={hidden.shape[2]} does not match the head's H={head.hidden_size}")
  if confidence_head is not None:
    width = confidence_head.w.shape[0]
    if width not in (hidden.shape[2], hidden.shape[2] + head.rank):
      raise ValueError(f"confidence_head: w has {width} entries; expected H={hidden.shape[2]} or "
                       f"H+r={hidden.shape[2] + head.rank}")
    temps = confidence_head.temperatures
    if temps is not None and temps.shape[0] != gamma:
      raise ValueError(f"confidence_head: has {temps.shape[0]} temperatures for γ={gamma}")


def block_arrays(params: sp.SamplingParams, anchor, positions) -> dict[str, Any]:
  """The per-row arrays the step function reads, from the sampling params."""
  def cast(x, dtype):  # host values stay on the host: no device dispatch before the program runs
    return np.asarray(x, dtype) if isinstance(x, (np.ndarray, list, tuple)) else jnp.asarray(x, dtype)

  return {
      "anchor": cast(anchor, np.int32),
      "greedy": cast(params.greedy_mask, np.bool_),
      "temperature": cast(params.draft_temperature, np.float32),
      "seeds": cast(params.seed, np.uint32),
      "positions": cast(positions, np.int32),
  }


def as_block_inputs(base_logits, anchor, hidden, positions):
  """The array arguments of a proposal as arrays (lists are converted; TypeError names others)."""
  return (validation.as_array("base_logits", base_logits), validation.as_array("anchor", anchor),
          None if hidden is None else validation.as_array("hidden", hidden),
          validation.as_array("positions", positions))


def _run(runner, path, head, base_logits, anchor, hidden, params, key, positions, confidence_head,
         greedy_only, store_logits, backend=None, config=None):
  base_logits, anchor, hidden, positions = as_block_inputs(base_logits, anchor, hidden, positions)
  check_block_inputs(head, base_logits, anchor, hidden, params, positions, confidence_head)
  validation.check_key("key", key)
  rows = block_arrays(params, anchor, positions)
  conf_params = None if confidence_head is None else confidence_head.arrays()
  arrays = head.arrays()
  choice, extra = None, {}
  if runner is folded_block:
    choice = choose_backend(arrays, base_logits, kind=head.kind, greedy_only=greedy_only,
                            store_logits=store_logits, confidence=conf_params is not None,
                            backend=backend, config=config)
    arrays = pallas_block.head_arrays_for(arrays, [choice])
    extra = {"backend": choice}
  tokens, corrected, confidence = runner(
      arrays, conf_params, base_logits, rows["anchor"], hidden, rows["greedy"],
      rows["temperature"], rows["seeds"], rows["positions"], key, kind=head.kind,
      greedy_only=greedy_only, store_logits=store_logits, **extra)
  if isinstance(corrected, CompactLogits):
    corrected = corrected.with_inputs(jnp.asarray(base_logits), arrays["w2"])
  return DraftBlock(tokens=tokens, corrected_logits=corrected, greedy_mask=rows["greedy"],
                    temperatures=rows["temperature"], confidence=confidence, path=path,
                    backend=choice)


def sample_block(head: heads_lib.MarkovHead, base_logits: jax.Array, anchor: jax.Array,
                 hidden: jax.Array | None, params: sp.SamplingParams, key: jax.Array,
                 positions: jax.Array, *, confidence_head: heads_lib.ConfidenceHead | None = None,
                 greedy_only: bool = False, store_logits: bool = True, backend=None,
                 config=None) -> DraftBlock:
  """Samples a draft block with the folded (single compiled program) loop.

  Args:
    head: the sequential head.
    base_logits: [B, γ, V] backbone logits; row k predicts draft token k+1.
    anchor: [B] int, the last committed token of each row (x_0).
    hidden: [B, γ, H] backbone hidden states, or None (allowed for a vanilla head without confidence).
    params: `SamplingParams` with B rows.
    key: base PRNG key.
    positions: [B] int absolute position of each anchor; draft token k sits at ``positions + k``.
    confidence_head: optional; fills ``DraftBlock.confidence``.
    greedy_only: argmax on every row and do not emit corrected logits.
    store_logits: False keeps a `CompactLogits` in ``corrected_logits`` instead of the [B, γ, V]
      logits: each token's ``log q`` and what recomputes the one row the verifier needs.
    backend: "auto", "xla", "triton", "hopper", or None (``$DSPARK_JAX_BACKEND``, default "auto"):
      what computes the block (`dspark_jax.kernels.dispatch`).
    config: the backend's settings (`dispatch.XlaConfig`, `TritonConfig`, `HopperConfig`) or None.

  Returns:
    A `DraftBlock`; ``block.backend`` says which backend ran and why.

  Raises:
    ValueError: a bad input, or an explicit backend whose preconditions the shapes fail.
  """
  return _run(folded_block, PATH_FOLDED_GREEDY if greedy_only else PATH_FOLDED_SAMPLING, head,
              base_logits, anchor, hidden, params, key, positions, confidence_head, greedy_only,
              store_logits, backend, config)


def sample_block_eager(head: heads_lib.MarkovHead, base_logits: jax.Array, anchor: jax.Array,
                       hidden: jax.Array | None, params: sp.SamplingParams, key: jax.Array,
                       positions: jax.Array, *,
                       confidence_head: heads_lib.ConfidenceHead | None = None,
                       store_logits: bool = True) -> DraftBlock:
  """Same contract as `sample_block` (sampling variant), run step by step from Python."""
  return _run(eager_block, PATH_EAGER, head, base_logits, anchor, hidden, params, key, positions,
              confidence_head, False, store_logits)
