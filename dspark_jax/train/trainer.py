"""Training: the target's language-model loss, the DSpark drafter loss (docs/design.md), and the loop.

This module owns how weights are learned:

* `lm_loss`: next-token cross-entropy of a `TargetModel` on [B, L + 1] token windows.
* `dspark_loss`: the DeepSpec recipe for a `DSparkDraft` against a frozen target. For each sequence
  the target runs once (no gradient) and gives the context features and its own next-token law; A
  random anchors per sequence form γ-token blocks whose context is every position before the anchor;
  the blocks of a sequence read its one context in place (`DSparkDraft.shared_blocks`), so memory
  grows with the context plus the blocks, not with their product.
  Per block position k (1-based), with weight ``exp(-(k-1)/4)``:
  ``0.1·CE(corrected logits, the sequence's token) + 0.9·‖p_draft − p_target‖₁ + 1.0·BCE(confidence,
  1 − ½‖p_draft − p_target‖₁)``. The sequential head is teacher-forced on the true previous tokens;
  ``use_markov=False`` trains the DFlash-style parallel ablation (corrected = base logits).
* `make_schedule`, `make_optimizer`: AdamW with linear warm-up (4 %) and cosine decay, global-norm
  clipping at 1.0; the schedule's horizon lives in the optimizer state (`ScheduleState`), so that
  `set_horizon` can fit it to a time budget once the step rate is measured.
* `Trainer`: jitted train steps over nnx parameters (optionally float32 master parameters over
  lower-precision weights, gradient accumulation, data parallelism over a mesh axis by jit's SPMD
  partitioning; Pallas kernels per shard, `attention.batch_sharded`), a progress bar with the
  loss terms, learning rate and tokens/s, periodic evaluation, periodic resumable checkpoints
  (`save_train_state` / `load_train_state`: parameters, optimizer state, step and history in one
  safetensors file, in the tensor names of `dspark_jax.formats.checkpoints`) and a wall-clock
  budget, so a run can be split across calls, its step count fitted to the budget on request.
* Batches as pure functions of the step: `lm_batches` (token windows), `draft_batches` (anchors
  anywhere past a prompt) and `masked_draft_batches` (anchors whose block starts on a response
  token, with the response mask for `dspark_loss`).

The target and the drafter's shared embedding and LM head are never updated by `dspark_loss`: only the
draft's own parameters are differentiated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.formats import checkpoints
from dspark_jax.kernels import attention
from dspark_jax.models import draft as dm
from dspark_jax.draft import heads
from dspark_jax.models import target as tm

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "bce": 1.0}
POSITION_DECAY = 4.0


def lm_loss(model: tm.TargetModel, windows: jax.Array) -> tuple[jax.Array, dict]:
  """Mean next-token cross-entropy over [B, L + 1] windows (token t predicts token t + 1)."""
  inputs, labels = windows[:, :-1], windows[:, 1:]
  batch, length = inputs.shape
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  logits, _, _ = model(inputs, positions, tm.init_cache(model.config, batch, length))
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  return ce.mean(), {"ce": ce.mean()}


def _gather_rows(x, index):
  """x [N, L, ...] gathered at index [N, A, G] along L -> [N, A, G, ...]."""
  n, a, g = index.shape
  flat = jnp.take_along_axis(x, index.reshape(n, a * g, *([1] * (x.ndim - 2))), axis=1)
  return flat.reshape(n, a, g, *x.shape[2:])


def target_law(target: tm.TargetModel, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The frozen target's part of `dspark_loss` on [N, L] sequences at positions 0..L-1: its law
  at every position, [N, L, V] float32 probabilities, and its features [N, L, F], both outside
  the gradient. The part a cache of target features would replace."""
  n, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (n, length))
  # Positions 0..L-1 of a fresh cache: a one-pass prefill (on a GPU, cuDNN's causal attention
  # over the call's own keys, not the chunk form's two parts over an empty prior cache).
  logits, features, _ = target(tokens, positions, tm.init_cache(target.config, n, length),
                               fresh=True)
  probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
  return jax.lax.stop_gradient(probs), jax.lax.stop_gradient(features)


def dspark_loss(draft: dm.DSparkDraft, target: tm.TargetModel, tokens: jax.Array,
                anchors: jax.Array, loss_mask: jax.Array | None = None, *,
                use_markov: bool = True) -> tuple[jax.Array, dict]:
  """The drafter loss of docs/design.md on [N, L] sequences with [N, A] anchor positions.

  Anchors must satisfy ``1 <= anchor <= L - γ - 1``: the block predicts tokens anchor+1..anchor+γ.
  `loss_mask` ([N, L], optional): a block position counts only where the token it predicts is
  masked in (a response token); the loss is then the position-weighted mean over the counted
  positions, and the metrics are means over them. Without it every position counts and the loss
  is the mean over blocks of each block's position-weighted mean.

  Returns:
    (scalar loss, metrics: ce, tv, bce, and the mean draft confidence).
  """
  gamma = draft.config.gamma
  n, length = tokens.shape
  a = anchors.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length), (n, length))
  p_target_all, features = target_law(target, tokens)

  context = draft.extend_context(features, positions, draft.init_context(n, length))  # [N, K, L, D]
  steps = jnp.arange(gamma)
  index = anchors[..., None] + steps                                        # [N, A, γ]
  anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)
  labels = _gather_rows(tokens, index + 1).reshape(n * a, gamma)
  p_target = _gather_rows(p_target_all, index).reshape(n * a, gamma, -1)
  base, hidden = draft.shared_blocks(target, anchor_tokens, anchors, context)
  anchor_tokens = anchor_tokens.reshape(-1)

  prev = jnp.concatenate([anchor_tokens[:, None], labels[:, :-1]], axis=1)  # teacher forcing
  head = draft.head.arrays()
  state = jnp.zeros((n * a, draft.head.rank), jnp.float32)
  biases, embeddings = [], []
  for k in range(gamma):
    bias, e, state = heads.markov_step(draft.head.kind, head, prev[:, k], hidden[:, k], state)
    biases.append(bias)
    embeddings.append(e)
  corrected = base.astype(jnp.float32)
  if use_markov:
    corrected = corrected + jnp.stack(biases, axis=1)
  log_q = jax.nn.log_softmax(corrected, axis=-1)
  ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]       # [N*A, γ]
  tv = jnp.sum(jnp.abs(jnp.exp(log_q) - p_target), axis=-1)                 # ‖·‖₁
  weights = jnp.exp(-steps / POSITION_DECAY)
  per_position = LOSS_WEIGHTS["ce"] * ce + LOSS_WEIGHTS["tv"] * tv
  metrics = {"ce": ce.mean(), "tv": tv.mean()}
  if draft.confidence is not None:
    conf = draft.confidence.arrays()
    confidence = jnp.stack([heads.confidence_step(conf, hidden[:, k], embeddings[k], k)
                            for k in range(gamma)], axis=1)
    label = jax.lax.stop_gradient(1.0 - 0.5 * tv)
    confidence = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    bce = -(label * jnp.log(confidence) + (1 - label) * jnp.log1p(-confidence))
    per_position = per_position + LOSS_WEIGHTS["bce"] * bce
    metrics.update(bce=bce.mean(), confidence=confidence.mean())
    terms = dict(ce=ce, tv=tv, bce=bce, confidence=confidence)
  else:
    terms = dict(ce=ce, tv=tv)
  if loss_mask is None:
    loss = jnp.mean(jnp.sum(per_position * weights, axis=1) / jnp.sum(weights))
    return loss, metrics
  counted = _gather_rows(loss_mask.astype(jnp.float32), index + 1).reshape(n * a, gamma)
  total = jnp.maximum(jnp.sum(counted), 1.0)
  loss = jnp.sum(per_position * weights * counted) / jnp.maximum(jnp.sum(weights * counted), 1e-6)
  return loss, {k: jnp.sum(v * counted) / total for k, v in terms.items()}


class ScheduleState(NamedTuple):
  """`scale_by_cosine_schedule`'s state: the step `count`, the horizon `total` and the `warmup`
  steps (int32), the `peak` rate and its `end` value (float32), and `warmup_ppm`, the warm-up's
  share of the horizon in parts per million (int32; -1 when the warm-up is a fixed number of
  steps). `set_horizon` moves the horizon."""
  count: jax.Array
  total: jax.Array
  warmup: jax.Array
  peak: jax.Array
  end: jax.Array
  warmup_ppm: jax.Array


def cosine_rate(count, total, warmup, peak, end):
  """The learning rate at step `count`: linear warm-up from 0 over `warmup` steps, then cosine decay
  from `peak` to `end` at step `total` (constant after); optax's ``warmup_cosine_decay_schedule``
  with every argument an array (traceable)."""
  count = jnp.asarray(count, jnp.float32)
  total = jnp.asarray(total, jnp.float32)
  warmup = jnp.asarray(warmup, jnp.float32)
  progress = jnp.clip((count - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
  cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
  return jnp.where(count < warmup, peak * count / jnp.maximum(warmup, 1.0), cosine)


def _ppm(warmup_fraction: float) -> int:
  return int(round(warmup_fraction * 10**6))


def _warmup_steps(total: int, warmup_ppm: int) -> int:
  """The warm-up of a horizon of `total` steps: its share, at least one step (exact integers)."""
  return max(1, int(total) * int(warmup_ppm) // 10**6)


def scale_by_cosine_schedule(learning_rate: float, total_steps: int, *,
                             warmup_fraction: float = 0.04, warmup_steps: int | None = None,
                             end_fraction: float = 0.1) -> optax.GradientTransformation:
  """Scales updates by ``-cosine_rate(step)``: `warmup_steps` (or `warmup_fraction` of the
  horizon, at least one) of linear warm-up, then cosine decay to ``end_fraction *
  learning_rate`` at `total_steps`. The horizon lives in the state (`ScheduleState`), so that
  `set_horizon` can move it after the step rate is measured (`Trainer`'s ``fit_horizon``)."""
  fixed = warmup_steps is not None
  if fixed:
    warmup = int(warmup_steps)
    if warmup < 0:
      raise ValueError(f"warmup_steps: expected an int >= 0, got {warmup_steps!r}")
  else:
    warmup = _warmup_steps(total_steps, _ppm(warmup_fraction))

  def init(params):
    del params
    return ScheduleState(jnp.zeros([], jnp.int32), jnp.asarray(total_steps, jnp.int32),
                         jnp.asarray(warmup, jnp.int32), jnp.asarray(learning_rate, jnp.float32),
                         jnp.asarray(end_fraction * learning_rate, jnp.float32),
                         jnp.asarray(-1 if fixed else _ppm(warmup_fraction), jnp.int32))

  def update(updates, state, params=None):
    del params
    rate = cosine_rate(state.count, state.total, state.warmup, state.peak, state.end)
    updates = jax.tree.map(lambda u: (-rate * u).astype(u.dtype), updates)
    return updates, state._replace(count=optax.safe_int32_increment(state.count))
  return optax.GradientTransformation(init, update)


def _schedule_states(opt_state) -> list[ScheduleState]:
  return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ScheduleState))
          if isinstance(s, ScheduleState)]


def set_horizon(opt_state, total_steps: int):
  """`opt_state` with every `ScheduleState`'s horizon set to `total_steps` (and its warm-up,
  when given as a fraction, to that fraction of the new horizon); the rest unchanged."""
  def move(s):
    if not isinstance(s, ScheduleState):
      return s
    ppm = int(s.warmup_ppm)
    warmup = s.warmup if ppm < 0 else jnp.asarray(_warmup_steps(total_steps, ppm), jnp.int32)
    return s._replace(total=jnp.asarray(total_steps, jnp.int32), warmup=warmup)
  return jax.tree.map(move, opt_state, is_leaf=lambda s: isinstance(s, ScheduleState))


def horizon(opt_state) -> int | None:
  """The horizon (total steps) of the first `ScheduleState` in `opt_state`; None without one."""
  states = _schedule_states(opt_state)
  return int(states[0].total) if states else None


def learning_rate_at(opt_state, step: int) -> float | None:
  """The rate the first `ScheduleState` in `opt_state` gives at `step`; None without one."""
  states = _schedule_states(opt_state)
  if not states:
    return None
  s = states[0]
  return float(cosine_rate(step, s.total, s.warmup, s.peak, s.end))


def make_schedule(learning_rate: float, total_steps: int, *, warmup_fraction: float = 0.04,
                  warmup_steps: int | None = None, end_fraction: float = 0.1):
  """``step -> learning rate`` of `make_optimizer` at horizon `total_steps`: linear warm-up over
  `warmup_steps` (or `warmup_fraction` of the steps, at least one), then cosine decay to
  ``end_fraction * learning_rate`` (DeepSpec's: 0)."""
  warmup = (warmup_steps if warmup_steps is not None else
            _warmup_steps(total_steps, _ppm(warmup_fraction)))
  return lambda step: cosine_rate(step, total_steps, warmup, learning_rate,
                                  end_fraction * learning_rate)


def make_optimizer(learning_rate: float, total_steps: int, *, warmup_fraction: float = 0.04,
                   warmup_steps: int | None = None, weight_decay: float = 0.01,
                   clip_norm: float = 1.0, b2: float = 0.95,
                   end_fraction: float = 0.1) -> optax.GradientTransformation:
  """AdamW (b1 0.9, `b2`, decoupled `weight_decay`) on `make_schedule`'s rates (its horizon in the
  state: `scale_by_cosine_schedule`), clipped to global norm `clip_norm`. DeepSpec's recipe is
  ``b2=0.999, weight_decay=0.0, end_fraction=0.0`` (`dspark_jax.train.drafter.TrainOptions`'
  defaults)."""
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.scale_by_adam(b1=0.9, b2=b2),
                     optax.add_decayed_weights(weight_decay),
                     scale_by_cosine_schedule(learning_rate, total_steps,
                                              warmup_fraction=warmup_fraction,
                                              warmup_steps=warmup_steps,
                                              end_fraction=end_fraction))


_STEP_PROGRAMS: dict = {}
"""Compiled train steps by (model and frozen structure, loss function, optimizer, parameter
dtypes, micro-batches): trainers of the same model and objective share one program."""


def _step_program(graphdef, frozen_def, loss_fn, optimizer, shapes, parts: int, sharding=None):
  """The jitted ``(params, rest, frozen_state, opt_state, batch) -> (params, opt_state,
  metrics)`` of a `Trainer` (params and opt_state donated); `sharding` (mesh, data axis) is the
  batch sharding it is traced under (`attention.batch_sharded`), part of the program's key."""
  key = (graphdef, frozen_def, id(loss_fn), id(optimizer), parts, sharding,
         tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(shapes)))
  if key in _STEP_PROGRAMS:
    return _STEP_PROGRAMS[key][0]

  def gradients(params, rest, frozen, batch):
    def objective(params):
      cast = jax.tree.map(lambda p, s: p.astype(s.dtype), params, shapes)
      return loss_fn(nnx.merge(graphdef, cast, rest), frozen, batch)
    return jax.value_and_grad(objective, has_aux=True)(params)

  def step_fn(params, rest, frozen_state, opt_state, batch):
    frozen = None if frozen_def is None else nnx.merge(frozen_def, frozen_state)
    if parts == 1:
      (loss, metrics), grads = gradients(params, rest, frozen, batch)
    else:
      micro = jax.tree.map(lambda x: jnp.moveaxis(
          x.reshape(x.shape[0] // parts, parts, *x.shape[1:]), 1, 0), batch)

      def one(total, part):
        out = gradients(params, rest, frozen, part)
        return jax.tree.map(jnp.add, total, out), None
      first = gradients(params, rest, frozen, jax.tree.map(lambda x: x[0], micro))
      total, _ = jax.lax.scan(one, first, jax.tree.map(lambda x: x[1:], micro))
      (loss, metrics), grads = jax.tree.map(lambda x: x / parts, total)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree_utils.tree_norm(grads))
    return optax.apply_updates(params, updates), opt_state, metrics

  program = jax.jit(step_fn, donate_argnums=(0, 3))
  _STEP_PROGRAMS[key] = (program, loss_fn, optimizer)  # keeps the ids in the key alive
  return program


def _laid_out_on(x, mesh) -> bool:
  """Whether array `x` already has a `NamedSharding` over `mesh`."""
  sharding = getattr(x, "sharding", None)
  return isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh


@dataclasses.dataclass
class Trainer:
  """Trains the nnx.Param leaves of `model` with ``loss_fn(model, frozen, batch) -> (loss, metrics)``.

  `frozen` (e.g. the target a drafter learns from) is passed to every step as an argument, never
  differentiated, never updated.

  `train(batches, steps)` runs jitted steps with a tqdm progress bar, checkpoints every
  `checkpoint_every` steps and at the end (if `checkpoint_path`), resumes from `checkpoint_path` when
  it exists, and stops early (after checkpointing) once `max_seconds` of wall time have passed.
  ``batches(step)`` must be a pure function of the step so a resumed run sees the same data; a
  resumed run then equals an uninterrupted one bit for bit (same device and program).

  Options:
    master_dtype: the dtype the parameters are trained in (e.g. float32 over bfloat16 weights: the
      optimizer state follows it, and each step casts a copy to the model's own dtypes for the
      loss); None keeps the model's dtypes.
    accumulate: micro-batches per step: every leaf of a batch is split along axis 0 into this many
      interleaved parts (row i goes to part i mod `accumulate`), their gradients averaged before
      one update.
    mesh, data_axis: data parallelism: every batch leaf is sharded along axis 0 over mesh axis
      `data_axis`, parameters and optimizer state are replicated, and jit's SPMD partitioner
      inserts the gradient reduction. `frozen` is replicated too, but for the leaves already laid
      out on `mesh` (a target sharded by `dspark_jax.shard` over the mesh's tensor axis), which
      keep their layout.
    schedule: ``step -> learning rate``, shown on the progress bar and logged (default: the
      rate of the optimizer's `ScheduleState`, when it has one).
    fit_horizon: with `max_seconds`, on a fresh run: after one step (the compile) and
      `probe_steps` more, the step rate is measured and ``train``'s step count and the schedule's
      horizon (`set_horizon`) become what the rest of the budget allows (95 % of it, at most the
      steps asked for); the outcome is in `fitted`. A resumed run keeps the horizon it saved.
      Evaluations after the probe are not budgeted: the time limit stops the run in any case.
    tokens_per_step: tokens one step trains on, for the bar's tokens/s.
    evaluate, evaluate_every: ``evaluate(model) -> {name: float}`` run before the first step,
      every `evaluate_every` steps and at the end, on the model holding the current parameters; results go to
      `evaluations` (and the bar).
  History (`history`, `evaluations`) is saved with the checkpoint and restored with it.
  """

  model: nnx.Module
  loss_fn: Callable[[nnx.Module, Any, Any], tuple[jax.Array, dict]]
  optimizer: optax.GradientTransformation
  frozen: nnx.Module | None = None
  checkpoint_path: str | None = None
  checkpoint_every: int = 500
  max_seconds: float | None = None
  history: list = dataclasses.field(default_factory=list)
  master_dtype: Any = None
  accumulate: int = 1
  mesh: Any = None
  data_axis: str = "dp"
  schedule: Callable[[int], Any] | None = None
  tokens_per_step: int | None = None
  evaluate: Callable[[nnx.Module], dict] | None = None
  evaluate_every: int = 0
  evaluations: list = dataclasses.field(default_factory=list)
  fit_horizon: bool = False
  probe_steps: int = 30
  fitted: dict | None = None

  def __post_init__(self):
    if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or \
        self.accumulate < 1:
      raise ValueError(f"accumulate: expected an int >= 1, got {self.accumulate!r}")
    if isinstance(self.probe_steps, bool) or not isinstance(self.probe_steps, int) or \
        self.probe_steps < 1:
      raise ValueError(f"probe_steps: expected an int >= 1, got {self.probe_steps!r}")
    self.graphdef, params, self.rest = nnx.split(self.model, nnx.Param, ...)
    self.shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    master = self.master_dtype
    self.params = params if master is None else jax.tree.map(
        lambda x: x.astype(master) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    self.opt_state = self.optimizer.init(self.params)
    self.step = 0
    if self.checkpoint_path and os.path.exists(self.checkpoint_path):
      self.params, self.opt_state, self.step = load_train_state(
          self.checkpoint_path, self.params, self.opt_state)
      meta = checkpoints.read_metadata(self.checkpoint_path)
      self.history = list(meta.get("history", []))
      self.evaluations = list(meta.get("evaluations", []))
    self.frozen_def, self.frozen_state = (None, None) if self.frozen is None else nnx.split(self.frozen)
    if self.mesh is not None:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      self.params, self.opt_state, self.rest = jax.device_put(
          (self.params, self.opt_state, self.rest), replicated)
      self.frozen_state = jax.tree.map(
          lambda x: x if _laid_out_on(x, self.mesh) else jax.device_put(x, replicated),
          self.frozen_state)
    self._step_fn = _step_program(self.graphdef, self.frozen_def, self.loss_fn, self.optimizer,
                                  self.shapes, self.accumulate,
                                  None if self.mesh is None else (self.mesh, self.data_axis))

  def _tracing(self):
    """The context the step is traced in: with a mesh, kernels run per shard of the batch."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return attention.batch_sharded(self.mesh, self.data_axis)

  def _place(self, batch):
    if self.mesh is None:
      return batch
    sharded = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.data_axis))
    return jax.device_put(batch, sharded)

  def model_params(self):
    """The current parameters in the model's own dtypes (on the mesh's first device, with a
    mesh)."""
    params = jax.tree.map(lambda p, s: p.astype(s.dtype), self.params, self.shapes)
    return params if self.mesh is None else jax.device_put(params, self.mesh.devices.flat[0])

  def save(self) -> None:
    if self.checkpoint_path:
      save_train_state(self.checkpoint_path, self.params, self.opt_state, self.step,
                       extra={"history": self.history, "evaluations": self.evaluations})

  def _evaluate(self, bar) -> None:
    nnx.update(self.model, self.model_params())
    result = {k: float(v) for k, v in self.evaluate(self.model).items()}
    self.evaluations.append({"step": self.step, **result})
    if not bar.disable:
      bar.write(f"step {self.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))

  def _fit(self, steps: int, now: float, start: float, probe_start: float) -> int:
    """The step count the budget allows after the probe; the horizon set to it."""
    rate = self.probe_steps / max(now - probe_start, 1e-9)
    left = self.max_seconds - (now - start)
    fitted = min(steps, self.step + max(0, int(0.95 * rate * left)))
    self.opt_state = set_horizon(self.opt_state, fitted)
    if self.mesh is not None:
      self.opt_state = jax.device_put(
          self.opt_state, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    self.fitted.update(steps_per_second=rate, requested_steps=steps, horizon=fitted)
    return fitted

  def train(self, batches: Callable[[int], Any], steps: int, *, log_every: int = 50,
            progress: bool = True) -> nnx.Module:
    """Trains until `steps` total steps (or the time budget); returns the model with new params.
    `progress`: show the tqdm bar."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    fitting = self.fit_horizon and self.max_seconds is not None
    if fitting and self.step > 0:        # a resumed fitted run finishes the horizon it saved
      steps = min(steps, horizon(self.opt_state) or steps)
      fitting = False
    probe_start = None
    bar = tqdm(total=steps, initial=self.step, desc="train", dynamic_ncols=True,
               mininterval=2.0, disable=not progress)
    since, since_step = time.perf_counter(), self.step
    if self.evaluate is not None and self.evaluate_every and self.step == 0 and steps > 0:
      self._evaluate(bar)  # the untrained model: where the curve starts
    while self.step < steps:
      with self._tracing():
        self.params, self.opt_state, metrics = self._step_fn(
            self.params, self.rest, self.frozen_state, self.opt_state,
            self._place(batches(self.step)))
      self.step += 1
      bar.update(1)
      if fitting and self.step in (1, 1 + self.probe_steps) and self.step < steps:
        jax.block_until_ready(self.params)
        if self.step == 1:
          probe_start = time.perf_counter()
          self.fitted = {"first_step_s": probe_start - start}
        else:
          steps = self._fit(steps, time.perf_counter(), start, probe_start)
          bar.total = steps
          bar.refresh()
          fitting = False
      if self.step % log_every == 0 or self.step == steps:
        metrics = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        rate = (learning_rate_at(self.opt_state, self.step - 1) if self.schedule is None
                else float(self.schedule(self.step - 1)))
        if rate is not None:
          metrics["lr"] = rate
        if self.tokens_per_step:
          metrics["tokens_per_s"] = (self.tokens_per_step * (self.step - since_step)
                                     / max(now - since, 1e-9))
        since, since_step = now, self.step
        self.history.append({"step": self.step, **metrics})
        shown = {k: f"{metrics[k]:.3f}" for k in ("loss", "ce", "tv", "bce") if k in metrics}
        if "lr" in metrics:
          shown["lr"] = f"{metrics['lr']:.2e}"
        if "tokens_per_s" in metrics:
          shown["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
        bar.set_postfix(shown)
      if self.evaluate is not None and self.evaluate_every and (
          self.step % self.evaluate_every == 0 or self.step == steps):
        self._evaluate(bar)
      if self.checkpoint_path and self.step % self.checkpoint_every == 0:
        self.save()
      if self.max_seconds is not None and time.perf_counter() - start > self.max_seconds:
        break
    bar.close()
    self.save()
    nnx.update(self.model, self.model_params())
    return self.model


def lm_batches(stream: np.ndarray, batch: int, length: int, seed: int) -> Callable[[int], jax.Array]:
  """``step -> [batch, length + 1]`` random windows of a token stream, a pure function of the step."""
  def at(step: int) -> jax.Array:
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(stream) - length - 1, batch)
    return jnp.asarray(np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int32))
  return at


def draft_batches(sequences: np.ndarray, batch: int, anchors: int, gamma: int, first_anchor: int,
                  seed: int) -> Callable[[int], tuple[jax.Array, jax.Array]]:
  """``step -> (tokens [batch, L], anchors [batch, A])``: random sequences and anchor positions in
  ``first_anchor .. L - γ - 1``, ascending in each row (`masked_draft_batches` says why), a pure
  function of the step."""
  length = sequences.shape[1]
  if not 1 <= first_anchor <= length - gamma - 1:
    raise ValueError(f"first_anchor: {first_anchor} leaves no room for a block of γ={gamma} in "
                     f"sequences of length {length}")

  def at(step: int):
    rng = np.random.default_rng((seed, step))
    rows = rng.integers(0, len(sequences), batch)
    where = np.sort(rng.integers(first_anchor, length - gamma, (batch, anchors)), axis=1)
    return (jnp.asarray(sequences[rows].astype(np.int32)), jnp.asarray(where.astype(np.int32)))
  return at


def masked_draft_batches(tokens: np.ndarray, mask: np.ndarray, batch: int, anchors: int,
                         gamma: int, seed: int) -> Callable[[int], tuple[jax.Array, ...]]:
  """``step -> (tokens [batch, L], anchors [batch, A], mask [batch, L])``: random rows of packed
  data and anchors among each row's valid positions (``1 <= p <= L - γ - 1`` with ``mask[p + 1]``:
  the block's first prediction is a response token), drawn with replacement and ascending in each
  row, as DeepSpec orders them (the loss does not depend on the order; the ragged kernel's form of
  the shared context attention, `kernels.shared_attention`, reads a tile of queries' context only
  up to its last anchor); a pure function of the step. Rows without a valid position are never
  drawn.

  Raises:
    ValueError: shapes that differ, or no row with a valid anchor (naming `mask`).
  """
  tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
  if tokens.ndim != 2 or tokens.shape != mask.shape:
    raise ValueError(f"mask: shape {mask.shape} differs from tokens' {tokens.shape} (both [N, L])")
  length = tokens.shape[1]
  valid = np.zeros_like(mask)
  if length - gamma - 1 >= 1:
    valid[:, 1:length - gamma] = mask[:, 2:length - gamma + 1]
  counts = valid.sum(axis=1)
  usable = np.flatnonzero(counts)
  if usable.size == 0:
    raise ValueError(f"mask: no row has a response token at a position a block of γ={gamma} can "
                     f"start before (sequence length {length})")
  positions = [np.flatnonzero(valid[r]) for r in range(len(valid))]

  def at(step: int):
    rng = np.random.default_rng((seed, step))
    rows = usable[rng.integers(0, usable.size, batch)]
    where = np.sort([positions[r][rng.integers(0, counts[r], anchors)] for r in rows], axis=1)
    return (jnp.asarray(tokens[rows].astype(np.int32)), jnp.asarray(where.astype(np.int32)),
            jnp.asarray(mask[rows]))
  return at


def save_train_state(path: str, params, opt_state, step: int, extra: dict | None = None) -> None:
  """Parameters and optimizer state (float32) plus the step, for resuming (`load_train_state`)."""
  from safetensors.flax import save_file

  arrays = {f"params.{k}": v for k, v in checkpoints.named_arrays(params).items()}
  arrays.update({f"opt.{k}": v for k, v in checkpoints.named_arrays(opt_state).items()})
  meta = {"step": str(int(step))}
  meta.update({k: json.dumps(v) for k, v in (extra or {}).items()})
  tmp = path + ".tmp"
  save_file({k: jnp.asarray(v) for k, v in arrays.items()}, tmp, metadata=meta)
  os.replace(tmp, path)  # never leave a half-written checkpoint behind


def load_train_state(path: str, params_template, opt_state_template):
  """(params, opt_state, step) from `path`, shaped like the templates."""
  arrays = checkpoints.load_arrays(path)
  params = checkpoints.replace_named(params_template, {k[7:]: v for k, v in arrays.items()
                                           if k.startswith("params.")}, what=path)
  opt_state = checkpoints.replace_named(opt_state_template, {k[4:]: v for k, v in arrays.items()
                                                 if k.startswith("opt.")}, what=path)
  return params, opt_state, int(checkpoints.read_metadata(path)["step"])
