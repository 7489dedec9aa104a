"""A folded draft block computed by the GPU kernels: the Triton chain or the Hopper step kernels.

This module owns the γ-step loop when `dispatch.choose` picked a kernel backend. The loop is
unrolled; each step runs one step kernel and one token choice:

* **Triton** (`triton_step.step_stats`, `token_kernels`): the step kernel writes the corrected logits
  and one (key, token) pair per row and vocabulary tile. Below `dispatch.TILE_DRAWS_BELOW_BATCH`
  rows every tile draws its token in the kernel, with the block's noise drawn up front (by
  `token_kernels.block_noise`, the chain's first kernel, where the GPU has programmatic dependent
  launch); from there `token_kernels.draw_tokens` chooses the tile and draws inside it. A vanilla
  head without a confidence head has ``W1[x_prev]`` gathered inside the kernel. Greedy-only blocks
  and tile-draw blocks chain their kernels by programmatic dependent launch where the GPU has it.
* **Hopper** (`hopper_step`): v is computed in XLA (or written by the token choice before, for a
  vanilla head), the Mosaic GPU kernel streams W2 and U_k by TMA into WGMMA; the greedy kernel keeps
  one running-best pair per instance, the sampling kernel writes the corrected logits in place and
  every tile's pair, and `token_kernels.draw_tokens` draws. Odd steps walk the tiles backwards.

The law is the XLA backend's: the kernels sum ``v @ W2`` in their own order, so a corrected logit
can differ from XLA's in its last bit (and a near-tie go the other way); the tokens are exact
samples from ``softmax`` of the corrected logits the block returns.

``store_logits=False`` (Triton only) writes no corrected logits but each tile's log-mass; the
block returns a `CompactLogits`-ready ``(token_log_q, vectors, kernel)`` triple.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.kernels import dispatch
from dspark_jax.kernels import head_steps
from dspark_jax.kernels import hopper_step
from dspark_jax.kernels import token_kernels
from dspark_jax.kernels import triton_step
from dspark_jax.sampling import sampler as sampling


def prepare_head_arrays(head_params: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A head's arrays plus ``"w2_parts"``, W2 stored part by part ([V/64, r, 64],
  `hopper_step.w2_parts`), which the Hopper kernels read instead of W2 (each copy one contiguous
  run of memory), for a second copy of W2 in memory. Prepare once, outside a decoding loop; other
  backends ignore the entry. A new dict: `head_params` is not changed."""
  w2 = head_params["w2"]
  if w2.ndim != 2:
    raise ValueError(f"head_params: w2 must be [r, V], got shape {list(w2.shape)}")
  return dict(head_params, w2_parts=hopper_step.w2_parts(w2))


def head_arrays_for(head_params: dict[str, jax.Array], choices) -> dict[str, jax.Array]:
  """`head_params`, prepared (`prepare_head_arrays`) where any of `choices` (`dispatch.Choice`s)
  runs the Hopper kernels, else as they are."""
  if any(c.backend is dispatch.Backend.HOPPER for c in choices) and "w2_parts" not in head_params:
    return prepare_head_arrays(head_params)
  return head_params


def block(choice: dispatch.Choice, kind, head_params, conf_params, base_logits, anchor, hidden,
          greedy, temperature, seeds, positions, key, greedy_only, store_logits=True):
  """The γ steps of a folded block on `choice`'s kernel backend (traced inside the caller's jit).

  Returns ``(tokens [B, γ], corrected, confidence [B, γ] | None)``: `corrected` is the [B, γ, V]
  corrected logits, None (greedy-only), or with ``store_logits=False`` the tuple
  ``(token_log_q [B, γ], vectors [B, γ, r], kernel settings)`` of a `CompactLogits`.
  """
  batch, gamma, vocab = base_logits.shape
  rank = head_params["w1"].shape[1]
  interpret = choice.interpret or jax.default_backend() != "gpu"
  hopper = choice.backend is dispatch.Backend.HOPPER
  config = choice.config
  compact = not (store_logits or greedy_only)
  # With a confidence head XLA needs W1[x_prev] anyway: gather it once there.
  w1_in_kernel = kind == "vanilla" and conf_params is None and not hopper
  if hopper:
    draws = False
  else:
    draws = (config.tile_draws if config.tile_draws is not None
             else batch < dispatch.TILE_DRAWS_BELOW_BATCH) and not greedy_only
  # Without tile draws the token choice draws in the chosen tile (`token_kernels.draw_tokens`).
  choice_draws = not (greedy_only or draws or compact)
  # Programmatic dependent launch chains the Triton step kernels and their token choices.
  chainable = not hopper and w1_in_kernel and (greedy_only or draws or choice_draws)
  pdl = False
  if not hopper:
    pdl = config.pdl
    if pdl is None:
      pdl = chainable and not choice_draws and not interpret and triton_step.pdl_supported()
    elif pdl and not chainable:
      raise ValueError("TritonConfig.pdl: the chain needs W1 gathered in the kernel (a vanilla "
                       "head without a confidence head) and the token chosen from the tiles")
  settings = {} if hopper else config.kernel_settings()

  prev = prev_of_block = anchor.astype(jnp.int32)
  state = jnp.zeros((batch, rank), jnp.float32)
  corrected, tokens, confidence, vectors, log_q, out = None, [], [], [], [], None
  # The kernels read a bool mask as it is; another dtype is converted once, not per step.
  greedy_rows = greedy if greedy.dtype == jnp.bool_ else greedy.astype(jnp.int32)
  tile = sampling.vocab_tile(vocab)
  noise = None
  noise_kernel = pdl and draws  # the chain's first kernel; the first step waits before its epilogue
  if choice_draws or noise_kernel:  # the kernels derive the rows' keys themselves
    key_words = sampling.key_words(key)
  if noise_kernel:
    noise = token_kernels.block_noise(key_words, seeds, positions, gamma=gamma,
                                      tiles=vocab // tile, tile=tile, pdl=True,
                                      interpret=interpret)
  elif not (choice_draws or greedy_only):  # one small program, not γ chains of them
    steps = positions[None, :] + jnp.arange(1, gamma + 1, dtype=positions.dtype)[:, None]
    keys = sampling.row_keys(key, jnp.broadcast_to(seeds, steps.shape).reshape(-1),
                             steps.reshape(-1), sampling.Stream.DRAFT).reshape(steps.shape)
    noise = sampling.tile_noise(keys, vocab // tile, tile)   # [γ, B, V/c + c]

  if hopper:
    # A vanilla head's next vector W1[x] comes from the token choice (the token kernel's rank must
    # be a power of two); W2 part by part where the head's arrays have it.
    hopper_vectors = not greedy_only and kind == "vanilla" and rank & (rank - 1) == 0
    w2_kernel = head_params.get("w2_parts", head_params["w2"])
    kernel_args = {n: getattr(config, n) for n in ("stages", "programs")
                   if getattr(config, n) is not None}
    if not greedy_only:
      if config.consumers is not None:
        kernel_args["consumers"] = config.consumers
      corrected_ref = hopper_step.new_corrected(base_logits.shape, base_logits.dtype)
    next_vectors = None
  for k in range(gamma):
    hidden_k = None if hidden is None else hidden[:, k]
    if hopper:
      if hopper_vectors and k:  # v_k = W1[x_{k-1}], written by the token choice before
        v, e = next_vectors, next_vectors.astype(jnp.float32)
      else:
        v, e, state = head_steps.markov_vector(kind, head_params, prev, hidden_k, state)
      reverse = config.serpentine and k % 2 == 1
      if greedy_only:
        prev = hopper_step.tokens(*hopper_step.greedy_partials(
            v, w2_kernel, base_logits, step=k, reverse=reverse, interpret=interpret,
            **kernel_args))
      else:  # the tiles' pairs, tile-major; the token choice draws
        tile_key, tile_token = hopper_step.sampling_partials(
            v, w2_kernel, base_logits, corrected_ref, temperature, greedy_rows,
            step=k, reverse=reverse, argmax=False, interpret=interpret, **kernel_args)
        w1 = head_params["w1"] if hopper_vectors and k + 1 < gamma else None
        prev, out, *more = token_kernels.draw_tokens(
            tile_key, tile_token, corrected_ref[...], greedy_rows, temperature, key_words, seeds,
            positions, out, w1, step=k, batch=batch, gamma=gamma, tile_major=True,
            reversed_tiles=reverse, greedy_in_tile=True, interpret=interpret)
        next_vectors = more[0] if more else None
      tokens.append(prev)
      if conf_params is not None:
        confidence.append(head_steps.confidence_step(conf_params, hidden_k, e, k))
      continue
    if w1_in_kernel:
      head_input, w1, e = prev, head_params["w1"], None
    else:
      head_input, e, state = head_steps.markov_vector(kind, head_params, prev, hidden_k, state)
      w1 = None
    stats = triton_step.step_stats(
        head_input, head_params["w2"], base_logits, temperature, noise, corrected,
        greedy=greedy_rows, w1=w1, step=k, greedy_only=greedy_only, draws=draws,
        store_logits=not compact, pdl=pdl and (True if k else "late" if noise_kernel else "first"),
        padded_pairs=choice_draws, interpret=interpret, **settings)
    corrected = stats.corrected
    # The token kernels also write the block's tokens in place (no stacking at the end).
    if choice_draws:  # the token choice adds the noise and draws in the chosen tile
      prev, out = token_kernels.draw_tokens(
          stats.tile_key, stats.tile_token, corrected, greedy_rows, temperature, key_words, seeds,
          positions, out, step=k, batch=batch, pdl=bool(pdl), gamma=gamma, interpret=interpret)
    elif pdl:  # the same reduction as a kernel of the chain
      prev, out = token_kernels.choose_tokens(
          stats.tile_key, stats.tile_token, out, batch=batch, pdl=True, step=k, gamma=gamma,
          interpret=interpret)
    else:
      prev = sampling.tokens_from_tile_choices(stats.tile_key, stats.tile_token)  # one reduction
    if compact and not draws:  # no logits to reread: the chosen tiles again, by the same code
      drawn, draw_logit = triton_step.chosen_tile_draws(
          head_input, head_params["w2"], base_logits, temperature, noise, greedy_rows, prev,
          w1=w1, step=k, interpret=interpret, **settings)
      prev = jnp.where(greedy, prev, drawn)
    if compact:  # log q is formed after the loop: small XLA kernels here would each cost a launch
      log_q.append((stats.tile_log_mass, stats.tile_draw_logit if draws else draw_logit))
      if not w1_in_kernel:
        vectors.append(head_input.astype(head_params["w2"].dtype))
    tokens.append(prev)
    if conf_params is not None:
      confidence.append(head_steps.confidence_step(conf_params, hidden_k, e, k))
  if hopper and not greedy_only:
    corrected = jax.freeze(corrected_ref)
  tokens = jnp.stack(tokens, axis=1) if out is None else out
  confidence = None if conf_params is None else jnp.stack(confidence, axis=1)
  if not compact:
    return tokens, None if greedy_only else corrected, confidence
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
  token_log_q = logit / temperature[:, None] - jax.nn.logsumexp(masses, axis=2)
  # The row block enters the kernel's summation: recompute with the drafted one.
  kernel = dict(settings, rows=settings.get("rows") or triton_step.row_block(batch))
  return tokens, (token_log_q, vectors, tuple(sorted(kernel.items()))), confidence


def corrected_rows(v, base, w2, kernel):
  """``round(base + v @ W2)`` [B, V] by the Triton step kernel with settings `kernel` (the
  arithmetic a compact block was drafted with): v [B, r] in W2's dtype, base [B, V], w2 [r, V]."""
  batch, vocab = base.shape
  tiles = vocab // sampling.vocab_tile(vocab)
  stats = triton_step.step_stats(
      v, w2, base[:, None], jnp.ones((batch,), jnp.float32),
      jnp.zeros((1, batch, tiles + vocab // tiles), jnp.float32), None,
      greedy=jnp.zeros((batch,), jnp.int32), step=0, greedy_only=False, draws=True,
      interpret=jax.default_backend() == "cpu", **dict(kernel))
  return stats.corrected[:, 0]
