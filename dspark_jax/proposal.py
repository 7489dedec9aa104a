"""Block sampling of a DSpark draft: the γ-step loop, folded (one compiled program) or eager.

Given the backbone's base logits ``U`` [B, γ, V] and hidden states ``h`` [B, γ, H], step k = 1..γ
computes the *corrected* logits ``L_k = U_k + bias_k(x_{k-1})`` (x_0 = anchor), stores them in the
logits dtype, and samples ``x_k`` from the stored values: greedy rows by argmax, sampled rows exactly
from ``softmax(L_k / T)``. Sampling from the *stored* (rounded) logits is deliberate: the verifier's
draft law ``q = softmax(corrected / T)`` is then exactly the law the tokens were drawn from.

Two paths run the same step function (`_block_step`) and give bit-identical results for the same key:

* **folded** (`sample_block`): the whole loop in one jitted program, the JAX counterpart of SGLang's
  CUDA-graph folding. Variant ``greedy_only=True`` takes the argmax everywhere and does not emit
  corrected logits (greedy verification does not need them). Three forms compute the same function
  (`FORMS`): ``"loop"`` (`lax.fori_loop`, outputs written in place), ``"unrolled"`` (the γ steps traced
  one after another) and ``"pallas"`` (unrolled, each step's logits and tile statistics from one
  `fused_step` kernel; the GPU form). The first two are bit-identical; the kernel sums ``v @ W2`` in
  its own order, so on a GPU a corrected logit can differ in its last bit and a near-tie can go the
  other way; the law, ``softmax`` of the *stored* logits, is the same (tests check it).
* **eager** (`sample_block_eager`): a Python loop calling the compiled step γ times: the reference, and
  the fallback for mixed batches when the memory gate disables the folded sampling variant.

``store_logits=False`` (both paths, every form but the Hopper and persistent kernels) keeps a
`CompactLogits` instead of the [B, γ, V] corrected logits: each token's ``log q`` and what recomputes
any row bit for bit, for the verifier's one row per request. The same tokens; less memory; on an
H200 not faster (BENCHMARKS.md, issue 6, version 22).

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

from dspark_jax import fused_block
from dspark_jax import fused_step
from dspark_jax import heads as heads_lib
from dspark_jax import hopper_block
from dspark_jax import hopper_step
from dspark_jax import sampling
from dspark_jax import sampling_params as sp
from dspark_jax import token_kernels

PATH_FOLDED_SAMPLING = "folded-sampling"
PATH_FOLDED_GREEDY = "folded-greedy"
PATH_EAGER = "eager"
FORMS = ("loop", "unrolled", "pallas")
TILE_DRAWS_BELOW_BATCH = 64
"""Batches below this draw every tile's token in the kernel (``draws``); larger ones draw in the
chosen tile, in the token choice (`token_kernels.draw_tokens`): the per-tile draws cost the kernel
more than the draw after the choice costs at 64 rows and up, and less below (H200, BENCHMARKS.md,
issue 6, versions 9 and 27)."""
HOPPER_FROM_BATCH = 128
"""Greedy-only blocks of this many rows and more run `hopper_step` by default on a Hopper GPU (in
multiples of 64): 9-16 % faster than the Triton step kernel at 128 rows on an H200 and 1-10 %
slower at 64 (BENCHMARKS.md, issue 6, version 19)."""
HOPPER_SAMPLING_FROM_BATCH = 64
"""Sampling blocks of this many rows and more run `hopper_step` by default on a Hopper GPU: 64 rows
(one warpgroup) or multiples of 128 (two) whose rows fit the kernel's shared memory (up to 128 at
r = 256); on an H200 17-20 % less time than the Triton path at 128 rows and 5-9 % at 64
(BENCHMARKS.md, issue 6, versions 32-35)."""
HOPPER_SERPENTINE = True
"""Whether the Hopper kernels walk the tiles of odd steps from the last one down by default
(``pallas_options`` ``("serpentine", ...)``), so that a step starts on the W2 tiles the step before
left in L2: 2 % faster for sampling and 1 % for greedy-only at 128 rows on an H200 (BENCHMARKS.md,
issue 6, version 34)."""


def is_hopper(device: jax.Device | None = None) -> bool:
  """Whether `device` (default: the first) is a GPU of compute capability 9 (TMA and WGMMA)."""
  device = device or jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def prepare_head_arrays(head_params: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A head's arrays plus ``"w2_parts"``, W2 stored part by part (`hopper_step.w2_parts`), which
  `folded_block`'s Hopper kernels then read instead of W2: 1-5 % faster on an H200
  (BENCHMARKS.md, issue 6, version 37), for a second copy of W2 in memory. Prepare once, outside
  the decoding loop (`decoding.generate` does on a Hopper GPU); other paths ignore the entry. A
  new dict: `head_params` is not changed."""
  w2 = head_params["w2"]
  if w2.ndim != 2:
    raise ValueError(f"head_params: w2 must be [r, V], got shape {list(w2.shape)}")
  return dict(head_params, w2_parts=hopper_step.w2_parts(w2))


def reads_w2_parts(batch: int, vocab: int, device: jax.Device | None = None) -> bool:
  """Whether blocks of `batch` rows may run a Hopper kernel that reads prepared W2 parts
  (`prepare_head_arrays`): a Hopper GPU, from `HOPPER_SAMPLING_FROM_BATCH` rows (the fewest any
  of them takes), V a multiple of the parts' 64 columns. `decoding.generate` prepares then."""
  return (is_hopper(device) and batch >= HOPPER_SAMPLING_FROM_BATCH
          and vocab % hopper_step.PART == 0)


def head_arrays_for(head_params: dict[str, jax.Array], batch: int) -> dict[str, jax.Array]:
  """`head_params` as blocks of up to `batch` rows read them best: prepared
  (`prepare_head_arrays`) where a Hopper kernel may read W2 part by part (`reads_w2_parts`), else
  as they are. What `generate`, `DraftSampler` and the benchmark scripts pass to `folded_block`."""
  if reads_w2_parts(batch, head_params["w2"].shape[1]):
    return prepare_head_arrays(head_params)
  return head_params


def hopper_by_default(batch: int, vocab: int, w2_dtype, logits_dtype,
                      device: jax.Device | None = None, *, greedy_only: bool = True,
                      rank: int | None = None) -> bool:
  """Whether a Pallas block takes `hopper_step` when `pallas_options` does not say.

  Yes on a GPU of compute capability 9 (Hopper: the kernels use TMA and WGMMA) with bfloat16 W2 and
  base logits (the measured case; a float32 W2 would run on the tensor cores at TF32 precision):
  greedy-only blocks from `HOPPER_FROM_BATCH` rows in multiples of 64 with V a multiple of 64;
  sampling blocks (`rank` given) from `HOPPER_SAMPLING_FROM_BATCH` rows, 64 of them or a multiple
  of 128 (one or two warpgroups), with 128-column sampler tiles and shared memory for two
  pipeline stages (`hopper_step.sampling_stages`).
  """
  device = device or jax.devices()[0]
  common = (is_hopper(device) and jnp.dtype(w2_dtype) == jnp.bfloat16
            and jnp.dtype(logits_dtype) == jnp.bfloat16)
  if greedy_only:
    return (common and batch >= HOPPER_FROM_BATCH and batch % hopper_step.ROW_BLOCK == 0
            and vocab % 64 == 0)
  warpgroups = batch == hopper_step.ROW_BLOCK or batch % (2 * hopper_step.ROW_BLOCK) == 0
  if not (common and rank and batch >= HOPPER_SAMPLING_FROM_BATCH and warpgroups
          and sampling.vocab_tile(vocab) == 2 * hopper_step.PART):
    return False
  tiles_per_instance = -(-(vocab // sampling.vocab_tile(vocab)) // getattr(device, "core_count",
                                                                          132))
  return hopper_step.sampling_stages(batch, rank, tiles_per_instance) >= 2


def choose_form(greedy_only: bool, vocab: int, platform: str | None = None) -> str:
  """The form ``form="auto"`` resolves to: the fastest measured on an H200 (BENCHMARKS.md, issue 6).

  On GPUs: "pallas" when the vocabulary suits the kernel (`fused_step.supports`), else "loop" for
  the sampling variant and "unrolled" for greedy-only. Off the GPU: "loop" (Pallas' interpreter is
  for tests only). The kernel won at every measured batch size, so the batch does not enter.
  """
  if (platform or jax.default_backend()) != "gpu":
    return "loop"
  if fused_step.supports(vocab):
    return "pallas"
  return "unrolled" if greedy_only else "loop"


@struct.dataclass
class CompactLogits:
  """A sampling block's draft law without its [B, γ, V] corrected logits (``store_logits=False``).

  Verification reads the corrected logits twice: ``q_k(x_k)`` of every drafted token, and the whole
  row ``q_j`` at a row's first rejection j. This keeps the first, ``log q_k(x_k)``, and what
  recomputes any row: the head's vectors ``v_k`` (``bias_k = v_k @ W2``), the base logits and W2,
  with the arithmetic that drafted the block (`kernel`), so a recomputed row equals the row the
  token was drawn from bit for bit. Per step the block then writes B floats instead of B·V logits
  (a third of the floor's bytes at B = 128), and the verifier reads W2 once more per round.

  `folded_block`, a compiled program, leaves `base_logits` and `w2` as None: they are its inputs,
  and returning an input from a program copies it (231 MB at B = 128, V = 129280). The caller
  attaches its own arrays (`with_inputs`); `sample_block`, `DraftSampler` and `generate` do.

  Attributes:
    token_log_q: [B, γ] float32 ``log softmax(corrected_k / T)[x_k]`` (a greedy row's: unused).
    vectors: [B, γ, r] the head's vectors in W2's dtype.
    base_logits: [B, γ, V] the backbone's logits the block was drafted from (None: not attached).
    w2: [r, V] the head's second matrix (None: not attached).
    kernel: static: None for XLA's arithmetic (forms "loop" and "unrolled", and the eager path),
      else the `fused_step` kernel settings, ``((name, value), ...)``, of the "pallas" form.
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
    dtype: bit for bit the values its token was drawn from."""
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
    kernel: None (XLA: the folded loop's and the eager path's step) or the "pallas" form's
      `fused_step` settings: the same kernel then sums ``v @ W2`` in the same order.
  """
  if kernel is None:
    return _rounded_logits(base, heads_lib.markov_bias(w2, v)).astype(base.dtype)
  batch, vocab = base.shape
  tiles = vocab // sampling.vocab_tile(vocab)
  stats = fused_step.step_stats(
      v, w2, base[:, None], jnp.ones((batch,), jnp.float32),
      jnp.zeros((1, batch, tiles + vocab // tiles), jnp.float32), None,
      greedy=jnp.zeros((batch,), jnp.int32), step=0, greedy_only=False, draws=True,
      interpret=jax.default_backend() == "cpu", **dict(kernel))
  return stats.corrected[:, 0]


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
  """

  tokens: jax.Array
  corrected_logits: jax.Array | None
  greedy_mask: jax.Array
  temperatures: jax.Array
  confidence: jax.Array | None
  path: str = struct.field(pytree_node=False, default=PATH_FOLDED_SAMPLING)


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


def _pallas_block(kind, head_params, conf_params, base_logits, anchor, hidden, greedy, temperature,
                  seeds, positions, key, greedy_only, pallas_options, store_logits=True):
  """The γ steps unrolled: per step one `fused_step` kernel, then the token choice.

  A vanilla head without a confidence head has its ``W1[x_prev]`` gathered inside the kernel
  (``("w1_in_kernel", False)`` in `pallas_options` gathers it in XLA instead). The kernel keeps
  each row's (key, token) pair per tile, and the choice is one reduction over the tiles (XLA's, or
  a kernel of `token_kernels`). Below `TILE_DRAWS_BELOW_BATCH` rows (or with ``("draws", True)``)
  every tile has drawn its token in the kernel, with every step's noise drawn before the first
  step; else the reduction chooses a sampled row's tile and draws inside it (below).

  ``("persistent", True)`` (vanilla head, at most `fused_block.MAX_ROWS` rows) runs the whole block
  in one persistent kernel instead (`fused_block.block_tokens`; ``("programs", P)`` sets its grid):
  the same tokens and logits as the per-step kernels with tile draws, bit for bit. It is opt-in: on
  an H200 it was not faster overall (BENCHMARKS.md, issue 6, version 18), and it needs its whole
  grid resident on the GPU at once. ``("hopper_block", True)`` (vanilla head, sampling variant, B
  a multiple of 8 up to 64, 128-column tiles) runs it as the small-batch Hopper kernel
  `hopper_block.block_tokens` instead (experimental: on an H200 the default path's tokens and
  logits, but slower, 195 against 157 µs at B = 8, V = 129280: BENCHMARKS.md, issue 6, version 39;
  ``("stages", s)``, ``("programs", P)`` set it up).

  ``("hopper", True)`` (B a multiple of 64, any head) computes v in XLA and runs each step as a
  Mosaic GPU kernel for Hopper GPUs: `hopper_step.greedy_partials` (greedy-only; ``("tile", c)``,
  ``("stages", s)``, ``("programs", P)`` set it up) or `hopper_step.sampling_partials` (the
  corrected logits written in place into a `hopper_step.new_corrected` buffer, the tiles' pairs
  tile-major, then `token_kernels.draw_tokens` chooses and draws; at r = 256 up to 128 rows;
  ``("consumers", 1 | 2)``, ``("reread", ...)`` and ``("overlap", ...)`` set its warpgroups; the
  token choice finds greedy rows' first argmax in their chosen tiles, unless ``("argmax", True)``
  (the kernel then does); with a vanilla head the token choice also writes the next step's
  ``W1[x]``, unless ``("vectors", False)``);
  ``("serpentine", ...)`` (both; default `HOPPER_SERPENTINE`) walks odd steps' tiles from the last
  one down. Blocks take it by default where `hopper_by_default` says so (greedy-only from 128 rows
  in multiples of 64; sampling at 64 rows and in multiples of 128 that fit its shared memory) and
  no kernel settings are given; ``("hopper", False)`` keeps the Triton kernel.

  Without per-tile draws (from `TILE_DRAWS_BELOW_BATCH` rows), the token choice draws:
  `token_kernels.draw_tokens` derives each row's key, adds the tiles' Gumbel draws to their
  log-masses, chooses the tile and draws inside it from the stored corrected logits, so no noise
  is drawn up front (``("choice", False)`` leaves the draw to XLA after its reduction instead).

  ``("pdl", True)`` chains the per-step Triton kernels by programmatic dependent launch: each
  step's token choice is `token_kernels.choose_tokens` (the same reduction as a kernel), and each
  kernel lets the next one launch once its own instances run, the next waiting before it reads
  the token (``("prefetch", True)``: after loading its first chunk of W2). With per-tile draws the
  noise is the chain's first kernel (`token_kernels.block_noise`), and the first step kernel waits
  for it only before its epilogue. The token kernels write the block's tokens in place. It is the
  default on GPUs that have it (`fused_step.pdl_supported`) where the chain applies: W1 gathered
  in the kernel and the token chosen from the tiles alone (greedy-only, or per-tile draws); it
  also applies to the token choice that draws, where it is not the default (no faster on an
  H200); elsewhere asking for it is an error. Same tokens and logits bit for bit (BENCHMARKS.md,
  issue 6, versions 25 and 28).

  ``store_logits=False`` (sampling variant, the per-step Triton kernel only) writes no corrected
  logits but each tile's log-mass; with per-tile draws also each draw's logit, else
  `fused_step.chosen_tile_draws` draws in the chosen tiles (recomputed by the same code); XLA then
  forms each token's ``log q``. Returns a `CompactLogits`.
  """
  options = dict(pallas_options)
  batch, gamma, vocab = base_logits.shape
  small_block = options.pop("hopper_block", False)  # `hopper_block`: persistent, like fused_block
  persistent = options.pop("persistent", False) or small_block
  interpret = jax.default_backend() == "cpu"
  # With a confidence head XLA needs W1[x_prev] anyway: gather it once there.
  w1_in_kernel = options.pop("w1_in_kernel", True) and kind == "vanilla" and conf_params is None
  compact = not (store_logits or greedy_only)
  draws, choice = options.pop("draws", None), options.pop("choice", None)
  # Settings for the Triton kernel (rows, warps, ...) keep it, unless hopper is asked for.
  hopper = options.pop("hopper", not (persistent or interpret or options or compact)
                       and (greedy_only or not (draws or choice is False))
                       and hopper_by_default(batch, vocab, head_params["w2"].dtype,
                                             base_logits.dtype, greedy_only=greedy_only,
                                             rank=head_params["w2"].shape[0]))
  if draws is None:
    draws = batch < TILE_DRAWS_BELOW_BATCH and not (choice or hopper)
  draws = draws and not greedy_only
  # Without per-tile draws the token choice draws (`token_kernels.draw_tokens`), where it can.
  if choice is None:
    choice = not (greedy_only or draws or compact or persistent)
  choice = choice and not greedy_only
  if choice and (draws or compact or persistent):
    raise ValueError("pallas_options: choice (the token choice draws) is a setting of the "
                     "per-step kernels without draws, with store_logits=True")
  if hopper and not (greedy_only or choice or compact):  # compact: refused below
    raise ValueError("pallas_options: the hopper sampling kernel's token choice draws "
                     "(`token_kernels.draw_tokens`): it takes neither draws nor choice=False")
  # Programmatic dependent launch chains the step kernels and their token choices (`fused_step`).
  chainable = not (hopper or persistent) and w1_in_kernel and (greedy_only or draws or choice)
  pdl = options.pop("pdl", chainable and not choice and not interpret
                    and fused_step.pdl_supported())
  prefetch = options.pop("prefetch", False)
  if pdl and not chainable:
    raise ValueError("pallas_options: pdl is a setting of the per-step Triton kernel: it needs W1 "
                     "gathered in the kernel (a vanilla head without a confidence head) and the "
                     "token chosen from the tiles alone (greedy-only, or per-tile draws)")
  hopper_settings = ({"tile", "stages", "programs", "serpentine"} if greedy_only
                     else {"stages", "programs", "consumers", "reread", "serpentine", "vectors",
                           "overlap", "argmax"})
  if compact and (hopper or persistent):
    raise ValueError(f"pallas_options: {'hopper' if hopper else 'persistent'} does not take "
                     "store_logits=False (the per-step Triton kernel does)")
  if hopper and set(options) - hopper_settings:
    raise ValueError(f"pallas_options: {sorted(set(options) - hopper_settings)[0]!r} is not a "
                     f"setting of the hopper kernel (it takes {sorted(hopper_settings)})")
  prev = prev_of_block = anchor.astype(jnp.int32)
  state = jnp.zeros((batch, head_params["w1"].shape[1]), jnp.float32)
  corrected, tokens, confidence, vectors, log_q, block = None, [], [], [], [], None
  # The kernels read a bool mask as it is; another dtype is converted once, not per step.
  noise, greedy_rows = None, greedy if greedy.dtype == jnp.bool_ else greedy.astype(jnp.int32)
  # In a pdl chain with tile draws, the noise is the chain's first kernel, and the first step
  # kernel waits for it only before its epilogue (pdl="late").
  noise_kernel = pdl and draws and not persistent
  if choice or noise_kernel:  # the kernels derive the rows' keys themselves
    key_words = sampling.key_words(key)
  if noise_kernel:
    tile = sampling.vocab_tile(vocab)
    noise = token_kernels.block_noise(key_words, seeds, positions, gamma=gamma,
                                      tiles=vocab // tile, tile=tile, pdl=True,
                                      interpret=interpret)
  elif not (choice or greedy_only):  # one small program, not γ chains of them
    tile = sampling.vocab_tile(vocab)
    steps = positions[None, :] + jnp.arange(1, gamma + 1, dtype=positions.dtype)[:, None]
    keys = sampling.row_keys(key, jnp.broadcast_to(seeds, steps.shape).reshape(-1),
                             steps.reshape(-1), sampling.Stream.DRAFT).reshape(steps.shape)
    noise = sampling.tile_noise(keys, vocab // tile, tile)   # [γ, B, V/c + c]
  if persistent:
    if kind != "vanilla":
      raise ValueError(f"pallas_options: persistent needs a vanilla head, got {kind!r}")
    if small_block:
      if greedy_only or compact:
        raise ValueError("pallas_options: hopper_block runs the sampling variant with its "
                         "corrected logits (greedy_only=False, store_logits=True)")
      tokens, corrected = hopper_block.block_tokens(
          prev, head_params["w1"], head_params.get("w2_parts", head_params["w2"]), base_logits,
          temperature, noise, greedy=greedy_rows, interpret=interpret, **options)
    else:
      tokens, corrected = fused_block.block_tokens(
          prev, head_params["w1"], head_params["w2"], base_logits, temperature, noise,
          greedy=greedy_rows, greedy_only=greedy_only, interpret=interpret, **options)
    if conf_params is not None:  # the vanilla head's e_k = W1[x_{k-1}], for all k at once
      prevs = jnp.concatenate([prev[:, None], tokens[:, :-1]], axis=1)
      e = heads_lib.markov_vector(kind, head_params, prevs, None, None)[1]
      confidence = jnp.stack([heads_lib.confidence_step(conf_params, hidden[:, k], e[:, k], k)
                              for k in range(gamma)], axis=1)
    return tokens, corrected, None if conf_params is None else confidence
  hopper_serpentine = hopper and options.pop("serpentine", HOPPER_SERPENTINE)
  # A vanilla head's next vector W1[x] comes from the sampling step's token choice (no XLA gather;
  # the token kernel's rank must be a power of two).
  rank = head_params["w1"].shape[1]
  hopper_vectors = (hopper and not greedy_only and options.pop("vectors", True)
                    and kind == "vanilla" and rank & (rank - 1) == 0)
  # W2 part by part where the head's arrays have it (`prepare_head_arrays`) and the kernel's
  # copies are parts: the greedy kernel's only with its default 64-column tiles.
  w2_kernel = head_params["w2"]
  if ("w2_parts" in head_params
      and (not greedy_only or options.get("tile", hopper_step.PART) == hopper_step.PART)):
    w2_kernel = head_params["w2_parts"]
  if hopper and not greedy_only:  # the corrected logits written in place
    corrected_ref = hopper_step.new_corrected(base_logits.shape, base_logits.dtype)
    # The token choice finds a greedy row's first argmax in its chosen tile (version 36).
    hopper_argmax = options.pop("argmax", False)
  for k in range(gamma):
    hidden_k = None if hidden is None else hidden[:, k]
    if hopper:  # v (in XLA, or from the token choice before), the Mosaic GPU kernel, the choice
      if hopper_vectors and k:  # a vanilla head's v_k = W1[x_{k-1}], written by the choice before
        v, e = next_vectors, next_vectors.astype(jnp.float32)  # (e only for a confidence head)
      else:
        v, e, state = heads_lib.markov_vector(kind, head_params, prev, hidden_k, state)
      # Serpentine: odd steps walk the tiles from the last one down (`hopper_step._tile_walk`).
      reverse = hopper_serpentine and k % 2 == 1
      if greedy_only:
        prev = hopper_step.tokens(*hopper_step.greedy_partials(
            v, w2_kernel, base_logits, step=k, reverse=reverse, interpret=interpret,
            **options))
      else:  # the tiles' pairs, tile-major; the token choice draws
        tile_key, tile_token = hopper_step.sampling_partials(
            v, w2_kernel, base_logits, corrected_ref, temperature, greedy_rows,
            step=k, reverse=reverse, argmax=hopper_argmax, interpret=interpret, **options)
        w1 = head_params["w1"] if hopper_vectors and k + 1 < gamma else None
        prev, block, *next_vectors = token_kernels.draw_tokens(
            tile_key, tile_token, corrected_ref[...], greedy_rows, temperature, key_words, seeds,
            positions, block, w1, step=k, batch=batch, gamma=gamma, tile_major=True,
            reversed_tiles=reverse, greedy_in_tile=not hopper_argmax, interpret=interpret)
        next_vectors = next_vectors[0] if next_vectors else None
      tokens.append(prev)
      if conf_params is not None:
        confidence.append(heads_lib.confidence_step(conf_params, hidden_k, e, k))
      continue
    if w1_in_kernel:
      head_input, w1, e = prev, head_params["w1"], None
    else:
      head_input, e, state = heads_lib.markov_vector(kind, head_params, prev, hidden_k, state)
      w1 = None
    stats = fused_step.step_stats(
        head_input, head_params["w2"], base_logits, temperature, noise, corrected,
        greedy=greedy_rows, w1=w1, step=k, greedy_only=greedy_only, draws=draws,
        store_logits=not compact, pdl=pdl and (True if k else "late" if noise_kernel else "first"),
        prefetch=prefetch,
        padded_pairs=choice, interpret=interpret, **options)
    corrected = stats.corrected
    # The token-choice kernels also write the block's tokens in place (no stacking at the end).
    if choice:  # the token choice adds the noise and draws in the chosen tile
      prev, block = token_kernels.draw_tokens(
          stats.tile_key, stats.tile_token, corrected, greedy_rows, temperature, key_words, seeds,
          positions, block, step=k, batch=batch, pdl=bool(pdl), gamma=gamma, interpret=interpret)
    elif pdl:  # the same reduction as a kernel of the chain
      prev, block = token_kernels.choose_tokens(
          stats.tile_key, stats.tile_token, block, batch=batch, pdl=True, step=k, gamma=gamma,
          interpret=interpret)
    else:
      prev = sampling.tokens_from_tile_choices(stats.tile_key, stats.tile_token)  # one reduction
    if compact and not draws:  # no logits to reread: the chosen tiles again, by the same code
      drawn, draw_logit = fused_step.chosen_tile_draws(
          head_input, head_params["w2"], base_logits, temperature, noise, greedy_rows, prev,
          w1=w1, step=k, interpret=interpret, **options)
      prev = jnp.where(greedy, prev, drawn)
    elif not (greedy_only or draws or choice):  # sampled rows chose a tile: draw inside it
      prev = sampling.tokens_in_chosen_tiles(corrected, prev, greedy, temperature, noise[k], step=k)
    if compact:  # log q is formed after the loop: small XLA kernels here would each cost a launch
      log_q.append((stats.tile_log_mass, stats.tile_draw_logit if draws else draw_logit))
      if not w1_in_kernel:
        vectors.append(head_input.astype(head_params["w2"].dtype))
    tokens.append(prev)
    if conf_params is not None:
      confidence.append(heads_lib.confidence_step(conf_params, hidden_k, e, k))
  if hopper and not greedy_only:
    corrected = jax.freeze(corrected_ref)
  tokens = jnp.stack(tokens, axis=1) if block is None else block
  if compact:
    w2 = head_params["w2"]
    if w1_in_kernel:  # the kernel gathered v_k = W1[x_{k-1}]: the same rows, once for the block
      prevs = jnp.concatenate([prev_of_block[:, None], tokens[:, :-1]], axis=1)
      vectors = jnp.take(head_params["w1"], prevs, axis=0).astype(w2.dtype)
    else:
      vectors = jnp.stack(vectors, axis=1)
    # log q(x) = L[x] / T - logsumexp over the tiles' log-masses; x lies in tile x // c.
    masses, logit = (jnp.stack(a, axis=1) for a in zip(*log_q))  # [B, γ, V/c]; [B, γ, V/c or -]
    if draws:  # every tile's draw: the token's is its tile's
      logit = jnp.take_along_axis(logit, (tokens // tile)[..., None], axis=2)[..., 0]
    log_q = logit / temperature[:, None] - jax.nn.logsumexp(masses, axis=2)
    # The row block enters the kernel's summation: recompute with the drafted one.
    kernel = dict(options, rows=options.get("rows") or fused_step.row_block(batch))
    corrected = CompactLogits(token_log_q=log_q, vectors=vectors,
                              kernel=tuple(sorted(kernel.items())))
  return tokens, corrected, None if conf_params is None else jnp.stack(confidence, axis=1)


def _compact(law_per_step):
  """`CompactLogits` (inputs not attached) from the steps' ``(v_k, log q_k)`` pairs."""
  vectors, log_q = zip(*law_per_step)
  return CompactLogits(token_log_q=jnp.stack(log_q, axis=1), vectors=jnp.stack(vectors, axis=1))


@functools.partial(jax.jit, static_argnames=("kind", "greedy_only", "form", "pallas_options",
                                             "store_logits"))
def folded_block(head_params, conf_params, base_logits, anchor, hidden, greedy, temperature, seeds,
                 positions, key, *, kind, greedy_only, form="auto", pallas_options=(),
                 store_logits=True):
  """The folded γ-step loop as one program; arrays only (see `sample_block` for the meaning).

  `form` (static): ``"auto"`` (`choose_form`) or one of `FORMS`. ``"loop"`` runs a `lax.fori_loop`
  writing the outputs in place; ``"unrolled"`` traces the γ steps one after another (no device-side
  loop condition, no zero-initialised buffers; the outputs are stacked); ``"pallas"`` is unrolled
  with one `fused_step` kernel per step (needs V divisible by 16; on the CPU it runs in Pallas'
  interpreter, slowly: for tests). `pallas_options`: static ``((name, value), ...)`` passed to
  `fused_step.step_stats` (``rows``, ``num_warps``, ``num_stages``, ``k_chunk``,
  ``tiles_per_program``, ``draws``: default below `TILE_DRAWS_BELOW_BATCH` rows), ``choice``
  (default where there are no draws: the token choice draws, `token_kernels.draw_tokens`),
  ``w1_in_kernel`` (default True: a vanilla head's ``W1`` rows are gathered inside the kernel,
  unless a confidence head needs them in XLA), ``persistent`` / ``programs`` (default off: the
  whole block in one `fused_block` kernel), and ``hopper`` (each step a `hopper_step` kernel;
  default where `hopper_by_default` says so, i.e. on a Hopper GPU from 128 rows, or 64 for
  sampling, else off). `head_params` may carry ``"w2_parts"`` (`prepare_head_arrays`): the
  Hopper kernels then read W2 part by part, the same values from longer runs of memory.
  `store_logits` (static, sampling variant): False returns a `CompactLogits` instead of the
  corrected logits, without its inputs attached (`CompactLogits.with_inputs`).

  Returns ``(tokens [B, γ], corrected [B, γ, V] | CompactLogits | None, confidence [B, γ] | None)``.
  """
  if form == "auto":
    form = choose_form(greedy_only, base_logits.shape[2])
  if form not in FORMS:
    raise ValueError(f"form: expected \"auto\" or one of {FORMS}, got {form!r}")
  if form == "pallas":
    return _pallas_block(kind, head_params, conf_params, base_logits, anchor, hidden, greedy,
                         temperature, seeds, positions, key, greedy_only, pallas_options,
                         store_logits)
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
  """Raises ValueError (naming the argument) unless the inputs of a block proposal fit together."""
  if np.ndim(base_logits) != 3:
    raise ValueError(f"base_logits: expected [B, γ, V], got shape {np.shape(base_logits)}")
  if not jnp.issubdtype(base_logits.dtype, jnp.floating):
    raise ValueError(f"base_logits: expected a float dtype, got {base_logits.dtype}")
  batch, gamma, vocab = base_logits.shape
  if vocab != head.vocab_size:
    raise ValueError(f"base_logits: vocab {vocab} does not match the head's vocab {head.vocab_size}")
  sampling.check_batch("anchor", anchor, batch)
  sampling.check_batch("positions", positions, batch)
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


def _run(runner, path, head, base_logits, anchor, hidden, params, key, positions, confidence_head,
         greedy_only, store_logits):
  check_block_inputs(head, base_logits, anchor, hidden, params, positions, confidence_head)
  rows = block_arrays(params, anchor, positions)
  conf_params = None if confidence_head is None else confidence_head.arrays()
  tokens, corrected, confidence = runner(
      head.arrays(), conf_params, base_logits, rows["anchor"], hidden, rows["greedy"],
      rows["temperature"], rows["seeds"], rows["positions"], key, kind=head.kind,
      greedy_only=greedy_only, store_logits=store_logits)
  if isinstance(corrected, CompactLogits):
    corrected = corrected.with_inputs(jnp.asarray(base_logits), head.arrays()["w2"])
  return DraftBlock(tokens=tokens, corrected_logits=corrected, greedy_mask=rows["greedy"],
                    temperatures=rows["temperature"], confidence=confidence, path=path)


def sample_block(head: heads_lib.MarkovHead, base_logits: jax.Array, anchor: jax.Array,
                 hidden: jax.Array | None, params: sp.SamplingParams, key: jax.Array,
                 positions: jax.Array, *, confidence_head: heads_lib.ConfidenceHead | None = None,
                 greedy_only: bool = False, store_logits: bool = True) -> DraftBlock:
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

  Returns:
    A `DraftBlock`.
  """
  return _run(folded_block, PATH_FOLDED_GREEDY if greedy_only else PATH_FOLDED_SAMPLING, head,
              base_logits, anchor, hidden, params, key, positions, confidence_head, greedy_only,
              store_logits)


def sample_block_eager(head: heads_lib.MarkovHead, base_logits: jax.Array, anchor: jax.Array,
                       hidden: jax.Array | None, params: sp.SamplingParams, key: jax.Array,
                       positions: jax.Array, *,
                       confidence_head: heads_lib.ConfidenceHead | None = None,
                       store_logits: bool = True) -> DraftBlock:
  """Same contract as `sample_block` (sampling variant), run step by step from Python."""
  return _run(eager_block, PATH_EAGER, head, base_logits, anchor, hidden, params, key, positions,
              confidence_head, False, store_logits)
