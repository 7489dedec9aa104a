"""Throughput profiles: how many verify steps, or whole decoding rounds, run per second at each
verify batch size.

This module owns `profile_sps`, the measurement behind the ``sps`` table that the schedules
`schedules.prefix` and `schedules.top_k` read (SPEC §7). With ``draft_cost=True`` (the default
when the draft is given), ``sps[n]`` = whole decoding rounds per second whose verify runs n batch
tokens (the paper's "engine steps per second"), so that τ·SPS(n) is the decoding loop's token
rate; with ``draft_cost=False``, the target's verify forward passes per second alone.

**What is timed.** With ``batch_size=B`` the sizes are the decoding loop's own token buckets for
B rows (`packing.token_buckets`), each spread over the B rows as evenly as it goes, and
`SpsProfile.dense` is the step table the loop really runs: n tokens cost what their bucket costs.
With explicit ``batch_tokens`` each n is packed alone, over ``ceil(n / (γ + 1))`` rows.

* A **round** (``draft_cost=True``) is the decoding loop's own iteration (`decoding.loop.iteration`)
  on the path and block backend the loop would choose for rows of ``temperature``: the draft
  forward, the folded block sampling, the packed verify of the size's tokens, the acceptance, the
  commit and the draft-context update. A fixed schedule sets each row's verify length; every
  row is active with its anchor at ``context`` in every round. One program serves all of a
  batch's buckets (the loop's `lax.switch` among them), as in the loop.
* A **verify** (``draft_cost=False``) is the packed verify alone (`decoding.packing`): n tokens of
  rows at positions ``context .. context + γ`` packed into a bucket of n slots.

Either runs over caches sized as the decoding loops allocate them (`models.target.cache_slots`).
Each sample is the seconds of ``steps`` of them back to back inside one compiled `lax.fori_loop`
(no host dispatch between them, as inside the decoding loop): a call of ``steps + 1`` less a call
of one, so what a call pays once (the host's dispatch, the wait for its result) cancels. After
``warmup`` untimed samples, the rate is ``steps / median(seconds)`` over ``repeats`` samples. The
cache contents do not change the work (attention reads each row up to its position, whatever the
slots hold), so they are left zero (a round's acceptance then varies, but not its cost: the
shapes are static). What a decoding loop pays outside its rounds (prefills, the host between
programs) is not in the table.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax import verification
from dspark_jax.decoding import loop
from dspark_jax.decoding import packing
from dspark_jax.decoding import requests
from dspark_jax.decoding import rounds
from dspark_jax.decoding import slots
from dspark_jax.decoding import stops
from dspark_jax.draft import block as proposal
from dspark_jax.draft import memory_gate
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.sampling import params as sp
from dspark_jax.scheduling import schedules



@dataclasses.dataclass
class SpsProfile:
  """A measured throughput table (`profile_sps`).

  Attributes:
    batch_tokens: [n] int64 the requested verify batch sizes, ascending.
    steps_per_second: [n] float64 rounds (``kind == "round"``) or verify forwards
      (``"verify"``) per second at each.
    rows: [n] int64 rows the packed tokens belonged to.
    seconds: [n, repeats] float64 the timed samples (each of ``steps`` rounds or forwards).
    context, gamma, steps: the settings measured.
    device: the accelerator, in words. date: when (ISO 8601, UTC).
    kind: "round" (whole decoding rounds, ``draft_cost=True``) or "verify" (verify forwards).
  """

  batch_tokens: np.ndarray
  steps_per_second: np.ndarray
  rows: np.ndarray
  seconds: np.ndarray
  context: int
  gamma: int
  steps: int
  device: str
  date: str
  kind: str = "verify"

  def dense(self) -> np.ndarray:
    """The dense ``sps`` the schedules take: ``sps[m]`` = the best rate measured at any size
    n >= m, for m up to the largest size. A packed verify of m tokens runs in the fastest bucket
    that holds it (`buckets`): where a bucket measured slower than a larger one, its tokens pack
    into the larger one, so the table's cost never rises as m falls."""
    sizes = self.batch_tokens.astype(np.int64)
    best = np.maximum.accumulate(self.steps_per_second[::-1])[::-1]   # best rate at sizes >= n
    table = np.zeros(int(sizes[-1]) + 1, np.float64)
    index = np.searchsorted(sizes, np.arange(1, sizes[-1] + 1))
    table[1:] = best[index]
    return table

  def buckets(self) -> tuple[int, ...] | None:
    """The token buckets a decoding loop of these rows should pack into: the measured sizes
    faster than every larger one (the largest, every row whole, always), ascending; with these,
    a verify of m tokens runs at `dense`'s rate. None for a profile of explicit ``batch_tokens``
    (not one batch's buckets)."""
    sizes = self.batch_tokens.astype(np.int64)
    rows = np.unique(self.rows)
    if rows.size != 1 or int(sizes[-1]) != int(rows[0]) * (self.gamma + 1):
      return None
    rates = self.steps_per_second
    faster = [i for i in range(len(sizes)) if i == len(sizes) - 1 or rates[i] > rates[i + 1:].max()]
    return tuple(int(sizes[i]) for i in faster)

  def table(self) -> dict[int, float]:
    """{batch tokens: steps per second}."""
    return {int(n): float(s) for n, s in zip(self.batch_tokens, self.steps_per_second)}

  def save(self, path: str | os.PathLike) -> None:
    """Writes the table as JSON with `schedules.save_sps` (``schedules.load_sps`` reads it back)."""
    meta = {"device": self.device, "date": self.date, "context": self.context,
            "gamma": self.gamma, "steps": self.steps, "rows": self.rows.tolist(),
            "kind": self.kind}
    schedules.save_sps(path, (self.batch_tokens.tolist(), self.steps_per_second.tolist()), meta)


def _check_batch_tokens(batch_tokens) -> np.ndarray:
  values = np.asarray(batch_tokens)
  if values.ndim != 1 or values.size == 0 or values.dtype.kind not in "iu":
    raise ValueError(f"batch_tokens: expected a non-empty sequence of ints >= 1, got "
                     f"{batch_tokens!r}")
  bad = values < 1
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"batch_tokens: entry {i} is {values[i]}; must be >= 1")
  return np.unique(values.astype(np.int64))


def _device_name() -> str:
  device = jax.devices()[0]
  return f"{device.platform}: {device.device_kind} (jax {jax.__version__})"


def _spread(tokens: int, rows: int, width: int) -> np.ndarray:
  """[rows] counts summing to `tokens` (<= rows · width), as even as they go."""
  counts = np.full(rows, tokens // rows, np.int32)
  counts[:tokens % rows] += 1
  return counts


def _timed_forwards(target_def, target_state, rows: int, tokens: int, context: int, gamma: int):
  """A compiled thunk ``call(n)`` running n packed verifies of `tokens` tokens over `rows` rows
  back to back in one program, returning when they are done."""
  config = nnx.merge(target_def, target_state).config
  width = gamma + 1
  block = jnp.zeros((rows, width), jnp.int32)
  positions = jnp.broadcast_to(context + jnp.arange(width, dtype=jnp.int32), (rows, width))
  counts = jnp.asarray(_spread(tokens, rows, width))
  cache = tm.init_cache(config, rows, tm.cache_slots(context + width))  # as the loops allocate
  # The weights travel as a flat list of arrays: flattening an nnx.State on every call costs
  # the host more than dispatching the program.
  leaves, tree = jax.tree.flatten(target_state)

  def run(leaves, cache, n):
    target = nnx.merge(target_def, jax.tree.unflatten(tree, leaves))

    def body(_, carry):
      cache, total = carry
      logits, _, cache = packing.packed_verify(target, block, positions, counts, cache, (tokens,))
      return cache, total + logits[:, 0, 0].astype(jnp.float32).sum()  # keeps the forward live

    return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))

  # The cache is donated and carried from call to call: one cache in memory, as in the loops.
  compiled = jax.jit(run, donate_argnums=1).lower(leaves, cache, np.int32(0)).compile()
  held = [cache]

  def call(n: int):
    held[0], total = compiled(leaves, held[0], np.int32(n))
    jax.block_until_ready(total)
  return call


def _round_buckets(rows: int, tokens: int, width: int, batch_size: int | None) -> tuple[int, ...]:
  """The token buckets the timed rounds pack into: the loop's own for a `batch_size` profile
  (`packing.token_buckets`), else `tokens` alone (with the dense verify, every row whole, last)."""
  if batch_size is not None:
    return packing.token_buckets(rows, width)
  return tuple(sorted({tokens, rows * width}))


def _timed_rounds(target_def, target_state, draft_def, draft_state, rows: int,
                  buckets: tuple[int, ...], context: int, temperature: float):
  """A compiled thunk ``call(n, counts) -> state`` running n whole decoding rounds of `rows` rows
  back to back in one program (`loop.iteration`: draft forward, block sampling, the packed verify of
  ``counts`` [rows] tokens per row in the smallest of `buckets` that holds them, acceptance,
  commit and context update), every row active with its anchor at `context` in every round,
  returning when they are done. One program serves every count."""
  target = nnx.merge(target_def, target_state)
  draft = nnx.merge(draft_def, draft_state)
  gamma, vocab = draft.config.gamma, target.config.vocab_size
  width = gamma + 1
  params = sp.SamplingParams(temperature=np.full(rows, temperature, np.float32))
  path, reason = requests._choose_path(True, params, draft, rows, vocab, None, None,
                                       memory_gate.DEFAULT_HEADROOM_BYTES)
  if path == proposal.PATH_EAGER:
    raise ValueError(f"temperature: {temperature} samples, but the memory gate disables folded "
                     f"sampling at {rows} rows ({reason})")
  backend = requests.choose_block_backend(draft, path, rows, vocab, store_logits=True,
                                          backend=None, config=None)
  # The schedule's state is the rows' verify lengths: set before each round, returned as they are.
  schedule = schedules.Schedule(lambda batch, _: jnp.full((batch,), width, jnp.int32),
                                lambda confidence, active, lens: (lens, lens), buckets)
  out_len = 2 * width   # every round commits from 0 (the counts are reset)
  inputs = {"max_new": np.full(rows, out_len, np.int32), "rows": rounds._row_arrays(params),
            "stop_ids": verification.stop_id_array((), rows, vocab),
            "stop_seqs": stops.stop_sequence_array((), rows, vocab)}
  state = slots._empty_state(target, draft, schedule, rows, tm.cache_slots(context + 2 * width),
                             out_len, inputs)
  # Everything a round reads arrives at run time, as in the queue's chunks: nothing to fold.
  fresh = {"anchor_pos": np.full(rows, context, np.int32), "count": np.zeros(rows, np.int32),
           "done": np.zeros(rows, bool), "finished": np.zeros(rows, bool)}
  inputs, fresh = jax.device_put((inputs, fresh))
  leaves, tree = jax.tree.flatten((target_state, draft_state))   # flat: see `_timed_forwards`
  key = jax.random.key(0)

  def run(leaves, state, counts, n, inputs, fresh, key):
    body = loop.iteration(*slots._models(leaves, tree, target_def, draft_def), path,
                          inputs["max_new"], inputs["rows"], inputs["stop_ids"],
                          inputs["stop_seqs"], key, backend=backend, schedule=schedule)

    def step(_, state):   # every row at `context`, active, with `counts` to verify
      return body(dict(state, schedule=counts, **fresh))

    return jax.lax.fori_loop(0, n, step, state)

  # The state (its caches) is donated and carried from call to call, as in `_timed_forwards`.
  counts0 = np.zeros(rows, np.int32)
  compiled = jax.jit(run, donate_argnums=1).lower(
      leaves, state, counts0, np.int32(0), inputs, fresh, key).compile()
  held = [state]

  def call(n: int, counts) -> dict:
    held[0] = compiled(leaves, held[0], np.asarray(counts, np.int32), np.int32(n), inputs,
                       fresh, key)
    jax.block_until_ready(held[0]["anchor"])
    return held[0]   # valid until the next call, which donates it
  return call


def _samples(call, steps: int, repeats: int, warmup: int, clock=time.perf_counter
             ) -> list[float]:
  """`repeats` samples of the seconds `steps` forwards take, after `warmup` untimed calls.

  Each sample is a call of ``steps + 1`` forwards less a call of one, so what every call pays once
  (the host dispatching the program and its arguments, the wait for the result) cancels, as it
  does inside a decoding loop. Where noise makes that difference not positive, the sample is the
  longer call's share of `steps` forwards instead."""
  for _ in range(warmup):
    call(1)
    call(steps + 1)
  samples = []
  for _ in range(repeats):
    start = clock()
    call(1)
    short = clock() - start
    start = clock()
    call(steps + 1)
    long = clock() - start
    samples.append(long - short if long > short else long * steps / (steps + 1))
  return samples


def profile_sps(target: tm.TargetModel, draft: dm.DSparkDraft | None = None, *,
                batch_size: int | None = None, batch_tokens: Sequence[int] | None = None,
                context: int = 1024,
                gamma: int | None = None, repeats: int = 5, warmup: int = 1, steps: int = 8,
                path: str | os.PathLike | None = None, draft_cost: bool | None = None,
                temperature: float = 0.0) -> SpsProfile:
  """Measures decoding rounds, or the target's verify steps, per second at each verify batch size
  (module docstring).

  Args:
    target: the target model (its weights and dtype as they will decode).
    draft: the draft whose γ sets the verify width; optional when `gamma` is given.
    batch_size: the decoding batch B: measure the loop's token buckets for B rows (the default,
      with B = 8 when neither this nor `batch_tokens` is given).
    batch_tokens: instead, verify batch sizes n ≥ 1 to measure (sorted, duplicates dropped).
    context: the position of each row's anchor: the context length the forward attends over.
    gamma: drafts per block (default: the draft's).
    repeats: timed samples per size (the median is kept). warmup: untimed samples first.
    steps: rounds or forwards per sample, back to back in one compiled loop.
    path: if given, the table is saved there as JSON (`SpsProfile.save`).
    draft_cost: time whole decoding rounds, the draft's part included (module docstring): the
      rates are rounds per second. Needs `draft`. None (the default): True when `draft` is
      given, else False (the verify forwards alone).
    temperature: the rows' temperature in the timed rounds (0: greedy rows, the folded-greedy
      path; > 0: sampled rows, the folded-sampling path where the memory gate allows it).

  Returns:
    An `SpsProfile`; `SpsProfile.dense` is the dense ``sps`` the schedules take (a saved file
    read by ``schedules.load_sps`` interpolates between the sizes instead). Pass the profile
    itself to `schedules.prefix` / `schedules.top_k` and they also pack into its `buckets`.

  Raises:
    ValueError: bad sizes or settings (naming the argument), no γ, a γ that differs from the
      draft's, a sampled `temperature` at a batch where the memory gate disables folded sampling.
  """
  if not isinstance(target, tm.TargetModel):
    raise ValueError(f"target: expected a TargetModel, got {type(target).__name__}")
  if batch_size is not None and batch_tokens is not None:
    raise ValueError("batch_size, batch_tokens: give one of them")
  context = validation.check_nonnegative_int("context", context)
  repeats = validation.check_positive_int("repeats", repeats)
  warmup = validation.check_nonnegative_int("warmup", warmup)
  steps = validation.check_positive_int("steps", steps)
  if gamma is None:
    if draft is None:
      raise ValueError("gamma: required without a draft (the verify width is γ + 1)")
    gamma = draft.config.gamma
  gamma = validation.check_positive_int("gamma", gamma)
  if draft is not None and draft.config.gamma != gamma:
    raise ValueError(f"gamma: {gamma}, but the draft drafts γ = {draft.config.gamma}")
  if draft_cost is None:
    draft_cost = draft is not None
  if not isinstance(draft_cost, (bool, np.bool_)):
    raise ValueError(f"draft_cost: expected a bool, got {draft_cost!r}")
  if draft_cost and draft is None:
    raise ValueError("draft_cost: needs the draft whose rounds it times")
  real = isinstance(temperature, (int, float, np.integer, np.floating))
  if isinstance(temperature, (bool, np.bool_)) or not real or not np.isfinite(temperature) \
      or temperature < 0:
    raise ValueError(f"temperature: expected a finite float >= 0, got {temperature!r}")
  if batch_tokens is None:
    batch_size = validation.check_positive_int("batch_size", 8 if batch_size is None
                                               else batch_size)
    sizes = np.asarray(packing.token_buckets(batch_size, gamma + 1), np.int64)
    rows = np.full(sizes.shape, batch_size, np.int64)
  else:
    sizes = _check_batch_tokens(batch_tokens)
    rows = -(-sizes // (gamma + 1))
  target_def, target_state = nnx.split(target)
  measured = {}
  if draft_cost:
    draft_def, draft_state = nnx.split(draft)
    call = None
    for n_rows, n in zip(rows, sizes):
      buckets = _round_buckets(int(n_rows), int(n), gamma + 1, batch_size)
      if call is None or batch_size is None:   # one program serves a batch's buckets
        call = None   # the last program's caches go before the next are allocated
        call = _timed_rounds(target_def, target_state, draft_def, draft_state, int(n_rows),
                             buckets, context, temperature)
      counts = _spread(int(n), int(n_rows), gamma + 1)
      measured[int(n)] = _samples(lambda k: call(k, counts), steps, repeats, warmup)
  else:
    for n_rows, n in zip(rows, sizes):
      call = None   # the last size's cache goes before the next is allocated
      call = _timed_forwards(target_def, target_state, int(n_rows), int(n), context, gamma)
      measured[int(n)] = _samples(call, steps, repeats, warmup)
  call = None
  seconds = np.array([measured[int(n)] for n in sizes], np.float64)
  profile = SpsProfile(
      batch_tokens=sizes, steps_per_second=steps / np.median(seconds, axis=1), rows=rows,
      seconds=seconds, context=context, gamma=gamma, steps=steps, device=_device_name(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      kind="round" if draft_cost else "verify")
  if path is not None:
    profile.save(path)
  return profile
