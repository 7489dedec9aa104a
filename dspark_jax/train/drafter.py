"""`train_drafter`: a DSpark drafter for a Hugging Face Qwen3 target, from conversation data.

This module owns the product around the losses and the `Trainer` (docs/training.md):

* **Configuration** (`default_draft_config`). DeepSpec's defaults: 5 draft layers of the target's
  own layer shape, block γ = 7, a vanilla Markov head of rank 256, the confidence head reading
  ``W1[x_{k-1}]``, and as many target layers as draft layers spread from layer 1 to layer L - 3
  (`spread_layers`: Qwen3-4B/8B's 1, 9, 17, 25, 33 of 36), never the final one. The mask id is
  the first id past the tokenizer's vocabulary (Qwen3: 151669) when the embedding has room.
* **Data** (`dspark_jax.train.conversations`). The target's chat template renders the
  conversations (``enable_thinking`` as asked), the loss counts response tokens only, and rows are
  packed to `TrainOptions.seq_len`. The last `TrainOptions.heldout` conversations are kept out of
  training: their prompts give the held-out τ (greedy speculative decoding of
  `TrainOptions.eval_tokens` tokens) every `TrainOptions.eval_every` steps. Data already
  tokenized comes as an ``.npz`` of token rows and their loss mask (`dspark_jax.train.token_rows`):
  the rows are used as they are, the last `TrainOptions.heldout` kept out, their tokens before the
  first masked one the held-out prompts.
* **Training.** SPEC §8's recipe with DeepSpec's settings by default (`TrainOptions`:
  `trainer.dspark_loss` with the response mask; AdamW, b2 0.999, no weight decay, at 6e-4 with
  4 % warm-up and cosine decay to zero; global-norm clipping at 1; 10 epochs):
  `TrainOptions.batch_size` sequences of `TrainOptions.anchors` blocks per step, split into
  `TrainOptions.micro_batches` micro-batches, over `TrainOptions.dp` data-parallel devices;
  float32 parameters and optimizer state over weights stored in the draft's dtype. Anchors and
  rows are a pure function of (seed, step), so a run resumed from its checkpoint equals an
  uninterrupted one.
* **Output.** ``OUT/`` holds the drafter in DeepSpec's format (or speculators', `format`), which
  `dspark_jax.load_pretrained(target_dir, OUT)` loads; ``OUT/training/`` holds the resumable
  state (``train_state.safetensors``, every `TrainOptions.checkpoint_every` steps), the options,
  the loss history and held-out τ (``history.json``) and the loss curve (``loss.png``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import validation
from dspark_jax.decoding import host
from dspark_jax.formats import pretrained
from dspark_jax.formats import qwen3
from dspark_jax.models import draft as dm
from dspark_jax.models import target as tm
from dspark_jax.parallel import placement
from dspark_jax.sampling import params as sp
from dspark_jax.text import tokenizer as tk
from dspark_jax.train import conversations as cv
from dspark_jax.train import token_rows
from dspark_jax.train import trainer as training

TRAINING_DIR = "training"
STATE_FILE = "train_state.safetensors"


def spread_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
  """Target layers for the draft to read, spread as Qwen3-4B's (1, 9, 17, 25, 33) of 36 layers:
  `count` ids evenly from layer 1 to layer ``num_layers - 3`` (rounded, deduplicated), never the
  final layer (which DeepSpec reads after the final norm)."""
  if num_layers < 2:
    raise ValueError(f"num_layers: the draft needs a layer before the final one, got {num_layers}")
  low = 1 if num_layers >= 3 else 0
  high = max(num_layers - 3, low)
  ids = sorted({int(np.floor(low + (high - low) * i / max(count - 1, 1) + 0.5))
                for i in range(count)})
  assert ids[-1] < num_layers - 1
  return tuple(ids)


def default_mask_token_id(target: tm.TargetConfig, tokenizer_size: int) -> int:
  """The first id past the tokenizer's tokens (Qwen3: 151669 of 151936); ValueError naming
  ``mask_token_id`` when the target's embedding has no such row."""
  if tokenizer_size >= target.vocab_size:
    raise ValueError(f"mask_token_id: the tokenizer's {tokenizer_size} tokens fill the target's "
                     f"vocabulary of {target.vocab_size}; pass an unused id")
  return int(tokenizer_size)


def default_draft_config(target: tm.TargetConfig, *, mask_token_id: int, num_layers: int = 5,
                         gamma: int = 7, rank: int = 256, head_kind: str = "vanilla",
                         confidence: bool = True, confidence_with_markov: bool | None = None,
                         target_layer_ids: Sequence[int] | None = None,
                         num_anchors: int = 512, dtype=None) -> dm.DraftConfig:
  """DeepSpec's drafter for `target` (module docstring), with any choice overridden.

  ``head_kind="none"`` (or ``rank=0``) is the DFlash-style drafter without a Markov head; the
  confidence head then reads h alone. `dtype` defaults to the target's storage dtype.
  """
  if head_kind == "none" or rank == 0:
    head_kind, rank = "none", 0
  if confidence_with_markov is None:
    confidence_with_markov = head_kind != "none"
  ids = (spread_layers(target.num_layers, num_layers) if target_layer_ids is None
         else tuple(int(i) for i in target_layer_ids))
  dtype = jnp.dtype(dtype or target.param_dtype)
  return dm.DraftConfig(gamma=gamma, num_layers=num_layers, target_layer_ids=ids,
                        mask_token_id=mask_token_id, head_kind=head_kind, rank=rank,
                        confidence=confidence,
                        confidence_with_markov=bool(confidence and confidence_with_markov),
                        num_anchors=num_anchors, dtype=dtype, param_dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TrainOptions:
  """How `train_drafter` trains. The defaults are DeepSpec's recipe (its Qwen3 configurations,
  SPEC §8): 10 epochs of rows of 4096 tokens, 512 rows per step taken one per device at a time,
  512 anchor blocks per row, AdamW (b2 0.999, no weight decay) at a peak of 6e-4 with 4 % warm-up
  and cosine decay to zero, gradients clipped to global norm 1.

  Attributes:
    steps: optimizer steps; None: `epochs` passes over the packed rows, each of
      ``rows // batch_size`` steps (at least one), as DeepSpec counts them.
    epochs: passes over the training rows when `steps` is None.
    batch_size: sequences per step (a multiple of `accumulate` * `dp`). seq_len: tokens per packed
      row of conversations (token rows keep their own length). anchors: blocks per sequence.
    learning_rate, warmup_fraction: the peak rate and the warm-up's share of the steps.
    warmup_steps: the warm-up in steps instead of a share (None: `warmup_fraction`).
    final_lr_fraction: the rate at the last step, as a fraction of the peak.
    weight_decay, adam_b2: AdamW's decoupled weight decay and second-moment decay.
    accumulate: micro-batches per step; None: ``batch_size // dp`` (one sequence per device per
      micro-batch, DeepSpec's local batch). dp: data-parallel devices (a mesh axis "dp").
    tp: devices the frozen target is split over (mesh axis "tp", `dspark_jax.shard`'s layout: its
      weights, heads and vocabulary), for a target too large for one device; the mesh has
      ``dp * tp`` devices and the draft is replicated over it.
    seed: the draft's initialisation and the data order.
    thinking: ``enable_thinking`` for the chat template (None: the template's default).
    heldout: conversations kept out of training for the held-out τ (0: none).
    eval_every: steps between held-out τ measurements, which also run before the first step and
      at the end (0: only then); none without `heldout`.
    eval_tokens: tokens generated per held-out prompt.
    checkpoint_every: steps between resumable checkpoints. log_every: steps between logged
      metrics.
    format: "deepspec" or "speculators".
    max_seconds: a wall-clock budget (the state is saved when it runs out; rerun to resume).
    fit_to_budget: with `max_seconds`: measure the step rate after the first steps and fit the
      step count and the cosine schedule's horizon (the warm-up too, when a share) to what the
      budget allows, rather than cutting the schedule short (`trainer.Trainer`'s
      ``fit_horizon``); a rerun resumes to the fitted horizon.
  """

  steps: int | None = None
  epochs: int = 10
  batch_size: int = 512
  seq_len: int = 4096
  anchors: int = 512
  learning_rate: float = 6e-4
  warmup_fraction: float = 0.04
  warmup_steps: int | None = None
  final_lr_fraction: float = 0.0
  weight_decay: float = 0.0
  adam_b2: float = 0.999
  accumulate: int | None = None
  dp: int = 1
  tp: int = 1
  seed: int = 0
  thinking: bool | None = None
  heldout: int = 8
  eval_every: int = 500
  eval_tokens: int = 128
  checkpoint_every: int = 500
  log_every: int = 10
  format: str = "deepspec"
  max_seconds: float | None = None
  fit_to_budget: bool = False

  def __post_init__(self):
    for name in ("epochs", "batch_size", "seq_len", "anchors", "dp", "tp", "eval_tokens",
                 "checkpoint_every", "log_every") + (
                     ("steps",) if self.steps is not None else ()) + (
                     ("accumulate",) if self.accumulate is not None else ()):
      validation.check_positive_int(name, getattr(self, name))
    for name in ("heldout", "eval_every", "seed") + (
        ("warmup_steps",) if self.warmup_steps is not None else ()):
      validation.check_nonnegative_int(name, getattr(self, name))
    if self.fit_to_budget and self.max_seconds is None:
      raise ValueError("fit_to_budget: needs max_seconds (the budget the steps are fitted to)")
    for name, low, high, closed in (("learning_rate", 0, np.inf, False),
                                    ("warmup_fraction", 0, 1, True),
                                    ("final_lr_fraction", 0, 1, True),
                                    ("weight_decay", 0, np.inf, True),
                                    ("adam_b2", 0, 1, True)):
      value = getattr(self, name)
      ok = (isinstance(value, (int, float, np.floating, np.integer))
            and not isinstance(value, bool) and (low <= value if closed else low < value)
            and value < high)
      if not ok:
        interval = f"[{low}, {high})" if closed else f"({low}, {high})"
        raise ValueError(f"{name}: expected a number in {interval}, got {value!r}")
    if self.batch_size % (self.micro_batches * self.dp):
      raise ValueError(f"batch_size: {self.batch_size} is not a multiple of accumulate * dp = "
                       f"{self.micro_batches} * {self.dp}")
    if self.format not in pretrained.DRAFT_FORMATS:
      raise ValueError(f"format: expected one of {pretrained.DRAFT_FORMATS}, got "
                       f"{self.format!r}")

  @property
  def micro_batches(self) -> int:
    """Micro-batches per step: `accumulate`, or one sequence per device at a time."""
    return self.accumulate if self.accumulate is not None else max(1, self.batch_size // self.dp)

  def total_steps(self, rows: int) -> int:
    """`steps`, or `epochs` passes of ``rows // batch_size`` steps (at least one) over `rows`
    training rows."""
    if self.steps is not None:
      return self.steps
    return self.epochs * max(1, rows // self.batch_size)

  @property
  def template_kwargs(self) -> dict:
    return {} if self.thinking is None else {"enable_thinking": bool(self.thinking)}


@dataclasses.dataclass
class TrainResult:
  """What `train_drafter` did: the trained `draft` and its `target`, the files of `out_dir`, the
  step reached, the schedule's `horizon` (the steps asked for, or those fitted to the budget), the
  loss `history`, held-out `evaluations` (τ per measurement) and the loss figure's path."""

  draft: dm.DSparkDraft
  target: tm.TargetModel
  out_dir: str
  files: list[str]
  step: int
  horizon: int
  history: list[dict]
  evaluations: list[dict]
  figure: str | None


def heldout_tau(target: tm.TargetModel, draft: dm.DSparkDraft, prompts: Sequence[Sequence[int]],
                *, max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> dict:
  """Greedy speculative decoding of `prompts` (one batch): ``{"tau": τ, "rows": [τ of each
  prompt]}``, τ over all rounds of all rows, a row's own τ ``1 + accepted / rounds`` (NaN for a
  row with no round)."""
  result = host.generate(target, draft, [list(p) for p in prompts],
                         sp.SamplingParams(temperature=np.zeros(len(prompts))),
                         jax.random.key(0), max_new_tokens=max_new_tokens,
                         stop_token_ids=list(stop_token_ids))
  rounds = np.asarray(result.row_rounds, np.float64)
  rows = 1.0 + np.asarray(result.row_accepted, np.float64) / np.where(rounds > 0, rounds, np.nan)
  return {"tau": float(result.tau), "rows": rows.tolist()}


def plot_history(history: Sequence[dict], evaluations: Sequence[dict], path: str) -> str:
  """The loss terms (and held-out τ when measured) against the step, as a PNG at `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = 2 if evaluations else 1
  fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.8), squeeze=False)
  steps = [h["step"] for h in history]
  for key in ("loss", "ce", "tv", "bce"):
    if history and key in history[0]:
      axes[0, 0].plot(steps, [h[key] for h in history], label=key)
  axes[0, 0].set_xlabel("step")
  axes[0, 0].set_title("training loss")
  axes[0, 0].legend()
  if evaluations:
    axes[0, 1].plot([e["step"] for e in evaluations], [e["tau"] for e in evaluations], "o-")
    axes[0, 1].set_xlabel("step")
    axes[0, 1].set_title("held-out τ (greedy)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _split(conversations: list[cv.Conversation], heldout: int, what: str):
  if heldout and len(conversations) <= heldout:
    raise cv.DataError(f"{what}: {len(conversations)} conversations, but heldout={heldout} are "
                       "kept out of training; add data or lower heldout")
  return (conversations[:-heldout], conversations[-heldout:]) if heldout else (conversations, [])


def _split_rows(rows: cv.Packed, heldout: int, what: str) -> tuple[cv.Packed, cv.Packed]:
  n = rows.tokens.shape[0]
  if heldout and n <= heldout:
    raise cv.DataError(f"{what}: {n} rows, but heldout={heldout} are kept out of training; add "
                       "data or lower heldout")
  cut = n - heldout
  part = lambda a, b: cv.Packed(rows.tokens[a:b], rows.mask[a:b], rows.lines[a:b])
  return part(0, cut), part(cut, n)


def train_drafter(target_dir: str, data: str, out_dir: str, *,
                  options: TrainOptions | None = None, draft_config: dict | None = None,
                  dtype=None, tokenizer_dir: str | None = None,
                  progress: bool = True) -> TrainResult:
  """Trains a DSpark drafter for the Qwen3 target in `target_dir` on the conversations in `data`
  and writes it to `out_dir` (module docstring); reruns resume from ``out_dir/training``.

  Args:
    target_dir: a Hugging Face Qwen3 directory with its tokenizer (or `tokenizer_dir`).
    data: conversation jsonl (`dspark_jax.train.conversations`), or an ``.npz`` of token rows and
      their loss mask (`dspark_jax.train.token_rows`; the rows keep their own length, and a
      held-out row's prompt is its tokens before the first masked one).
    out_dir: the drafter's directory (created).
    options: `TrainOptions` (default: its defaults).
    draft_config: keyword arguments of `default_draft_config` (``num_layers``, ``gamma``,
      ``rank``, ``head_kind``, ``confidence``, ``confidence_with_markov``, ``target_layer_ids``,
      ``mask_token_id``).
    dtype: the target's and draft's dtype (default: the checkpoint's).

  Raises:
    FileNotFoundError: a missing directory or file. `conversations.DataError`: bad data or a
      tokenizer without a chat template for conversations (naming the file, line and field, or
      the array and element). ValueError: a bad
      option or draft choice (naming it).
  """
  options = options or TrainOptions()
  target_dir = validation.check_path("target_dir", target_dir)
  out_dir = os.fspath(out_dir)
  tokenizer = tk.load_tokenizer(tokenizer_dir or target_dir)
  hf = qwen3.read_config(target_dir)
  target_config = qwen3.config_from_hf(hf)
  if token_rows.is_token_rows(data):
    rows = token_rows.read_token_rows(data, target_config.vocab_size)
    packed, held = _split_rows(rows, options.heldout, data)
    prompts = token_rows.heldout_prompts(held, data)
  else:
    cv.check_chat_template(tokenizer, f"{tokenizer_dir or target_dir}: tokenizer")
    conversations = cv.read_conversations(data)
    train_part, heldout_part = _split(conversations, options.heldout, data)
    packed = cv.load_packed(data, tokenizer, options.seq_len,
                            template_kwargs=options.template_kwargs, conversations=train_part)
    prompts = [tokenizer.encode_chat(c.prompt(), add_generation_prompt=True,
                                     **options.template_kwargs) for c in heldout_part]

  choices = dict(draft_config or {})
  if choices.get("mask_token_id") is None:
    choices["mask_token_id"] = default_mask_token_id(target_config, tokenizer.vocab_size)
  config = default_draft_config(target_config, dtype=dtype, **choices)
  target = qwen3.load_qwen3(target_dir, dtype=dtype, feature_layers=config.target_layer_ids)
  config = dataclasses.replace(config, dtype=target.config.dtype if dtype is None else config.dtype)
  draft = dm.DSparkDraft(config, target.config, rngs=nnx.Rngs(options.seed))

  steps = options.total_steps(len(packed.tokens))
  state_dir = os.path.join(out_dir, TRAINING_DIR)
  os.makedirs(state_dir, exist_ok=True)
  with open(os.path.join(state_dir, "options.json"), "w") as f:
    json.dump({"options": dataclasses.asdict(options), "draft": {
        k: v for k, v in dataclasses.asdict(config).items() if k not in ("layer", "dtype",
                                                                       "param_dtype")},
        "data": os.path.abspath(data), "target": os.path.abspath(target_dir),
        "rows": int(len(packed.tokens)), "response_tokens": packed.response_tokens,
        "steps": steps, "micro_batches": options.micro_batches}, f, indent=1)

  stops = [i for i in tokenizer.stop_token_ids if i < target.config.vocab_size]
  mesh = (None if options.dp * options.tp == 1 else
          placement.make_mesh(options.tp, options.dp))
  if options.tp > 1:
    target, _ = placement.shard(target, None, mesh, tp="tp", dp="dp")
  evaluate = None
  if prompts:
    def evaluate(model):
      pair = (target, model) if options.tp == 1 else placement.shard(target, model, mesh, tp="tp")
      return {"tau": heldout_tau(*pair, prompts, max_new_tokens=options.eval_tokens,
                                 stop_token_ids=stops)["tau"]}

  trainer = training.Trainer(
      draft, lambda m, t, b: training.dspark_loss(m, t, *b),
      training.make_optimizer(options.learning_rate, steps, weight_decay=options.weight_decay,
                              b2=options.adam_b2, warmup_fraction=options.warmup_fraction,
                              warmup_steps=options.warmup_steps,
                              end_fraction=options.final_lr_fraction),
      frozen=target, checkpoint_path=os.path.join(state_dir, STATE_FILE),
      checkpoint_every=options.checkpoint_every, max_seconds=options.max_seconds,
      fit_horizon=options.fit_to_budget, master_dtype=jnp.float32,
      accumulate=options.micro_batches, mesh=mesh,
      tokens_per_step=options.batch_size * packed.tokens.shape[1], evaluate=evaluate,
      evaluate_every=options.eval_every or steps)
  batches = training.masked_draft_batches(packed.tokens, packed.mask, options.batch_size,
                                          options.anchors, config.gamma, seed=options.seed)
  start = time.perf_counter()
  trainer.train(batches, steps, log_every=options.log_every, progress=progress)
  seconds = time.perf_counter() - start

  draft = trainer.model
  files = pretrained.save_pretrained(draft, out_dir, target=target, format=options.format)
  with open(os.path.join(state_dir, "history.json"), "w") as f:
    json.dump({"step": trainer.step, "horizon": training.horizon(trainer.opt_state),
               "fitted": trainer.fitted, "seconds_this_run": seconds,
               "history": trainer.history, "evaluations": trainer.evaluations}, f, indent=1)
  figure = (plot_history(trainer.history, trainer.evaluations, os.path.join(state_dir, "loss.png"))
            if trainer.history else None)
  return TrainResult(draft, target, out_dir, files, trainer.step,
                     training.horizon(trainer.opt_state), trainer.history, trainer.evaluations,
                     figure)


def describe(result: TrainResult) -> str:
  """A one-line summary of a run: steps, last loss, held-out τ first and last."""
  last = result.history[-1] if result.history else {}
  tau = ""
  if result.evaluations:
    tau = (f", held-out τ {result.evaluations[0]['tau']:.2f} (step "
           f"{result.evaluations[0]['step']}) -> {result.evaluations[-1]['tau']:.2f}")
  loss = last.get("loss")
  shown = "n/a" if loss is None else f"{loss:.3f}"
  return f"{result.step} steps, loss {shown}{tau}; drafter in {result.out_dir}"


__all__ = ["TrainOptions", "TrainResult", "default_draft_config", "default_mask_token_id",
           "heldout_tau", "plot_history", "spread_layers", "train_drafter", "describe"]
