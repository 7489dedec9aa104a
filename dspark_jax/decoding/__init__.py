"""Speculative decoding with a DSpark draft, and the autoregressive baseline, as compiled loops.

This package owns `generate` (prompts in, tokens and decoding statistics out) and `decode` (the same
loop as a pure function of arrays). One module per job:

* `rounds`: the pure pieces of one iteration (prefill, autoregressive step, speculative round:
  draft forward, folded block, verify, commit, context update, counts).
* `loop`: the whole decode as one program (`lax.while_loop`), `decode`, `DecodeOutput`, and the
  eager fallback that drives the same round from Python.
* `requests`: what both the fixed batch and the queue check and shape on the host: prompts padded
  to buckets, budgets, sampling parameters, stop arrays, the pair check, the path and backend.
* `compile_cache`: each decode program compiled once per process and shape.
* `host`: `generate` (the front: a fixed batch here, or the queue) and `GenerateResult`.
* `stops`: stop sequences: the host check (`stop_sequence_array`), the in-loop match, finish codes.
* `queue`: the queue-driven decode (continuous batching): `Engine` and its host loop, `generate(...,
  max_batch_size=S)`; S slots refilled from a prompt queue. `slots`: the slots' state and their
  refill and chunk programs; `paged_slots`: paged admission, growth and preemption;
  `queue_results`: `QueueResult`, `PromptResult`.
* `draft_proposal`: the block a draft proposes after given tokens, by the same pieces as a round.

* **Prefill.** Prompts of different lengths are right-padded to a length bucket and run through the
  target once; the first new token is sampled from the target at each row's last prompt position
  (`target_law`, stream `Stream.TARGET`), and the draft's context cache is filled from the prompt's
  target features.
* **Rounds** (`spec=True`), all inside one `lax.while_loop`: the draft forward gives base logits
  and hidden states; the folded block sampler (`proposal.folded_block`) drafts γ tokens; the target runs
  ``[anchor, x_1..x_γ]`` at positions ``anchor_pos..anchor_pos+γ``; `verification.verify_arrays`
  accepts a prefix and a bonus; the committed tokens are appended (up to ``max_new_tokens``); the
  target features of those positions extend the draft's context. Finished rows stop committing and
  stop advancing. An optional verify-length `Schedule` (``dspark_jax.scheduling.schedules``) picks
  each row's verify length from the block's confidence inside the loop, its state in the carry.
* **Stops**: stop token ids and stop sequences, matched inside the loop; nothing after the first
  match is committed; `GenerateResult.finish_reason` says why each row ended.
* **Baseline** (`spec=False`): plain autoregressive decoding with the same target, sampler, buckets
  and stop rules, one token per loop iteration.

Randomness: every draw is a function of (key, seed, absolute position, stream).
"""

from dspark_jax.decoding.rounds import (PATH_AUTOREGRESSIVE, _after_proposal,
                                        _autoregressive_step, _draft_forward, _draft_inputs,
                                        _finish, _finish_jit, _prefill, _row_arrays,
                                        _speculative_round)
from dspark_jax.decoding.loop import (DecodeOutput, RoundTrace, _decode_program, _eager_draft,
                                      _eager_prefill, _eager_verify, _run_eager, check_schedule,
                                      decode)
from dspark_jax.decoding.stops import (FINISH_LENGTH, FINISH_REASONS, FINISH_STOP_SEQUENCE,
                                       FINISH_STOP_TOKEN, stop_sequence_array)
from dspark_jax.decoding.requests import (MIN_BUCKET, _check_budgets, _choose_path,
                                          _prepare_prompts, bucket, check_pair)
from dspark_jax.decoding.compile_cache import _COMPILED, compiled_programs
from dspark_jax.decoding.host import GenerateResult, generate
from dspark_jax.decoding.queue import Engine, PromptResult, QueueResult
from dspark_jax.decoding import compile_cache, host, loop, queue, requests, rounds, stops

__all__ = ["DecodeOutput", "Engine", "PromptResult", "QueueResult", "FINISH_LENGTH",
           "FINISH_REASONS", "FINISH_STOP_SEQUENCE",
           "FINISH_STOP_TOKEN", "GenerateResult", "MIN_BUCKET", "PATH_AUTOREGRESSIVE", "RoundTrace",
           "bucket", "check_pair", "check_schedule", "compiled_programs", "decode", "generate",
           "stop_sequence_array"]
