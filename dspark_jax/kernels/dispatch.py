"""Which backend computes a folded draft block: the one decision, its table and its preconditions.

A folded block (`dspark_jax.draft.block.folded_block`) is computed by one of three backends:

* ``xla``: the γ-step loop written in JAX (`lax.fori_loop`, or the steps unrolled), on any device.
  It is the reference and the fallback.
* ``triton``: one Pallas (Triton) kernel per step (`triton_step`) and a token kernel
  (`token_kernels`) per step, chained by programmatic dependent launch where the GPU has it.
* ``hopper``: one Mosaic GPU kernel per step (`hopper_step`: TMA, WGMMA) on a Hopper GPU.

`choose` makes the decision from the shapes, dtypes and device alone, before anything is traced. A
backend runs only where every one of its preconditions (`preconditions`) holds; ``auto`` takes the
first row of `DEFAULTS` whose backend's preconditions hold and whose batch threshold is met, else
``xla``. An explicit request (the ``backend`` argument, or ``$DSPARK_JAX_BACKEND``) that fails a
precondition raises a `ValueError` that names it. Off the GPU the kernels run only in Pallas'
interpreter (slowly: for tests), and only when asked for explicitly.

The returned `Choice` is static and hashable: the compiled programs take it as a static argument,
and `DraftBlock.backend` and `DraftSampler.backends` record which backend ran and why.

`choose_layer_kernel` is the same rule for a model layer's one-kernel replacement of XLA
operations (`attention_inputs`): ``auto``, ``xla`` or ``pallas`` from the argument or an
environment variable.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Callable

import jax
import jax.numpy as jnp

from dspark_jax.kernels import hopper_step
from dspark_jax.sampling import sampler as sampling

ENV_VAR = "DSPARK_JAX_BACKEND"

MIN_TRITON_TILE = 16
"""The Triton kernel's vocabulary tile: a power of two of at least this many columns dividing V."""
MIN_TRITON_RANK = 16
"""A Triton dot needs an inner dimension of at least 16: the rank r, in multiples of 16."""
HOPPER_ROWS = 64
"""Rows of one WGMMA instruction: the Hopper kernels take whole multiples of it."""
HOPPER_PART = 64
"""Vocabulary columns per WGMMA in the Hopper kernels; V must be a multiple."""
HOPPER_SMEM_BYTES = 227 * 1024
"""Shared memory one Hopper kernel instance may use (H100 / H200)."""
TILE_DRAWS_BELOW_BATCH = 64
"""Triton sampling blocks below this many rows draw every tile's token in the step kernel; larger
ones draw in the chosen tile, in the token kernel (BENCHMARKS.md, versions 9 and 27)."""


class Backend(str, enum.Enum):
  """What computes a folded block."""

  XLA = "xla"
  TRITON = "triton"
  HOPPER = "hopper"


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """The XLA backend's settings.

  Attributes:
    form: "loop" (`lax.fori_loop`, outputs written in place) or "unrolled" (the γ steps traced one
      after another); None: "unrolled" for greedy-only blocks on a GPU, else "loop". Both compute
      the same values bit for bit.
  """

  form: str | None = None

  def __post_init__(self):
    if self.form not in (None, "loop", "unrolled"):
      raise ValueError(f"XlaConfig.form: expected None, 'loop' or 'unrolled', got {self.form!r}")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """The Triton chain's settings (None: the measured default).

  Attributes:
    rows: rows per kernel instance (default: B rounded up to a power of two in [16, 64]).
    num_warps, num_stages: Triton's (None: Triton's default warps; 3 stages).
    k_chunk: rank chunk of the kernel's loop over r (default 64; one dot where it does not divide r).
    tiles_per_program: vocabulary tiles one instance walks through (default 1).
    tile_draws: every tile draws its token in the step kernel (default: below
      `TILE_DRAWS_BELOW_BATCH` rows); else the token kernel draws in the chosen tile.
    pdl: chain the kernels by programmatic dependent launch (default: where the GPU has it and the
      chain applies: W1 gathered in the kernel, the token chosen from the tiles alone).
  """

  rows: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  k_chunk: int | None = None
  tiles_per_program: int | None = None
  tile_draws: bool | None = None
  pdl: bool | None = None

  def kernel_settings(self) -> dict:
    """The settings `triton_step.step_stats` takes, defaults left out."""
    names = ("rows", "num_warps", "num_stages", "k_chunk", "tiles_per_program")
    return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclasses.dataclass(frozen=True)
class HopperConfig:
  """The Hopper kernels' settings (None: the measured default).

  Attributes:
    stages: pipeline stages (greedy: 2; sampling: the most that fit shared memory, up to 4).
    programs: grid size (default: the GPU's multiprocessor count; 4 in the interpreter).
    consumers: sampling: warpgroups splitting the rows, 1 or 2 (default 2 where B is a multiple of
      128 on a GPU).
    serpentine: odd steps walk the vocabulary tiles from the last one down (default True).
  """

  stages: int | None = None
  programs: int | None = None
  consumers: int | None = None
  serpentine: bool = True


CONFIG_TYPES = {Backend.XLA: XlaConfig, Backend.TRITON: TritonConfig, Backend.HOPPER: HopperConfig}


@dataclasses.dataclass(frozen=True)
class Problem:
  """What the decision depends on: one folded block's static description.

  Attributes:
    platform: "gpu", "cpu", "tpu", ... compute_capability: the GPU's, e.g. "9.0" (None elsewhere).
    core_count: the GPU's multiprocessor count (sizes the Hopper grid). greedy_only: the variant.
    batch, vocab, rank, gamma: B, V, r, γ. w2_dtype, logits_dtype: dtype names.
    head_kind: "vanilla", "gated", "rnn" or "none" (r = 0). store_logits: the sampling variant stores its corrected
    logits (False: a `CompactLogits`). confidence: a confidence head runs in the block.
  """

  platform: str
  compute_capability: str | None
  core_count: int
  greedy_only: bool
  batch: int
  vocab: int
  rank: int
  gamma: int
  w2_dtype: str
  logits_dtype: str
  head_kind: str
  store_logits: bool = True
  confidence: bool = False
  devices: int = 1

  @property
  def variant(self) -> str:
    return "greedy" if self.greedy_only else "sampling"

  @property
  def interpret(self) -> bool:
    """The kernels would run in Pallas' interpreter (not on a GPU)."""
    return self.platform != "gpu"


@dataclasses.dataclass(frozen=True)
class Choice:
  """A dispatch decision: the backend, its settings, and why. Static and hashable.

  Attributes:
    backend: the `Backend` that runs the block.
    config: its `XlaConfig`, `TritonConfig` or `HopperConfig`.
    reason: one line: what was asked for and why this backend runs.
    interpret: a kernel backend asked for off the GPU: the kernels run in Pallas' interpreter.
  """

  backend: Backend
  config: XlaConfig | TritonConfig | HopperConfig
  reason: str
  interpret: bool = False

  @property
  def name(self) -> str:
    return self.backend.value


# ---- preconditions ---------------------------------------------------------------------------------

Precondition = tuple[str, Callable[[Problem], bool]]


def _is_float(name: str) -> bool:
  return jnp.issubdtype(jnp.dtype(name), jnp.floating)


def hopper_greedy_smem(batch: int, rank: int, stages: int = 2, tile: int = 64,
                       itemsize: int = 2) -> int:
  """Shared memory of the Hopper greedy kernel: v, the stages' W2 and U_k tiles, the pairs."""
  return (batch * rank + stages * (rank + batch) * tile) * itemsize + 2 * batch * 4 + 1024


def _tiles_per_instance(p: Problem) -> int:
  tiles = p.vocab // max(sampling.vocab_tile(p.vocab), 1)
  programs = 4 if p.interpret else max(p.core_count, 1)
  return -(-tiles // min(programs, tiles))


HAS_HEAD: Precondition = (
    "a sequential head (r >= 1; a rank-0 draft samples its base logits, on XLA)",
    lambda p: p.rank >= 1)

ONE_DEVICE: Precondition = (
    "the block lives on one device (under a tensor-parallel mesh the XLA backend runs, "
    "partitioned by XLA)", lambda p: p.devices == 1)

TRITON_PRECONDITIONS: tuple[Precondition, ...] = (
    HAS_HEAD,
    ONE_DEVICE,
    (f"V has a power-of-two tile of at least {MIN_TRITON_TILE} columns",
     lambda p: sampling.vocab_tile(p.vocab) >= MIN_TRITON_TILE),
    (f"r is a multiple of {MIN_TRITON_RANK}", lambda p: p.rank % MIN_TRITON_RANK == 0),
    ("W2 and the logits are float", lambda p: _is_float(p.w2_dtype) and _is_float(p.logits_dtype)),
)

HOPPER_PRECONDITIONS: tuple[Precondition, ...] = (
    HAS_HEAD,
    ONE_DEVICE,
    ("a Hopper GPU (compute capability 9) or Pallas' interpreter",
     lambda p: p.interpret or str(p.compute_capability or "").startswith("9")),
    ("W2 and the logits are bfloat16",
     lambda p: p.w2_dtype == "bfloat16" and p.logits_dtype == "bfloat16"),
    (f"r is a multiple of {HOPPER_PART}", lambda p: p.rank % HOPPER_PART == 0),
    (f"V is a multiple of {HOPPER_PART}", lambda p: p.vocab % HOPPER_PART == 0),
    (f"B is a multiple of {HOPPER_ROWS}", lambda p: p.batch % HOPPER_ROWS == 0),
    ("the sampling variant stores its corrected logits (store_logits=True)",
     lambda p: p.greedy_only or p.store_logits),
    (f"sampling: B is {HOPPER_ROWS} or a multiple of {2 * HOPPER_ROWS}",
     lambda p: p.greedy_only or p.batch == HOPPER_ROWS or p.batch % (2 * HOPPER_ROWS) == 0),
    (f"sampling: the sampler's vocabulary tile is {2 * HOPPER_PART} columns",
     lambda p: p.greedy_only or sampling.vocab_tile(p.vocab) == 2 * HOPPER_PART),
    ("the kernel's buffers fit shared memory with two pipeline stages",
     lambda p: (hopper_greedy_smem(p.batch, p.rank) if p.greedy_only
                else hopper_step.sampling_smem_bytes(p.batch, p.rank, 2, _tiles_per_instance(p)))
     <= HOPPER_SMEM_BYTES),
)

PRECONDITIONS: dict[Backend, tuple[Precondition, ...]] = {
    Backend.XLA: (),
    Backend.TRITON: TRITON_PRECONDITIONS,
    Backend.HOPPER: HOPPER_PRECONDITIONS,
}


def failed_precondition(backend: Backend, problem: Problem) -> str | None:
  """The first of `backend`'s preconditions that `problem` fails, or None."""
  for name, holds in PRECONDITIONS[backend]:
    if not holds(problem):
      return name
  return None


# ---- the default table -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Default:
  """One row of the default table: on `platform` (and compute capability `capability`, a prefix),
  `variant` blocks from `min_batch` rows run `backend` where its preconditions hold."""

  backend: Backend
  variant: str            # "greedy", "sampling" or "any"
  min_batch: int
  capability: str         # compute-capability prefix ("" = any GPU)
  source: str             # where the threshold was measured


DEFAULTS: tuple[Default, ...] = (
    Default(Backend.HOPPER, "greedy", 128, "9",
            "BENCHMARKS.md v19: 9-16 % faster than Triton at 128 rows, 1-10 % slower at 64"),
    Default(Backend.HOPPER, "sampling", 64, "9",
            "BENCHMARKS.md v32-v37: 5-20 % faster than Triton at 64 and 128 rows"),
    Default(Backend.TRITON, "any", 1, "",
            "BENCHMARKS.md v9-v30: faster than XLA at every measured shape on the H200"),
)


def _requested(backend) -> Backend | None:
  """`backend` (argument, else ``$DSPARK_JAX_BACKEND``) as a Backend; None for "auto"."""
  if isinstance(backend, Choice):
    raise TypeError("backend: a Choice is already a decision")
  source = "backend"
  if backend is None:
    backend, source = os.environ.get(ENV_VAR) or "auto", f"${ENV_VAR}"
  if isinstance(backend, Backend):
    return backend
  value = str(backend).strip().lower()
  if value == "auto":
    return None
  try:
    return Backend(value)
  except ValueError:
    raise ValueError(f"{source}: expected 'auto', 'xla', 'triton' or 'hopper', got "
                     f"{backend!r}") from None


def _default_config(backend: Backend, problem: Problem):
  if backend is Backend.XLA:
    greedy_gpu = problem.greedy_only and problem.platform == "gpu"
    return XlaConfig(form="unrolled" if greedy_gpu else "loop")
  return CONFIG_TYPES[backend]()


def choose(problem: Problem, backend: Backend | str | None = None, config=None) -> Choice:
  """The backend that runs `problem`'s block, with its settings and the reason.

  Args:
    problem: the block's static description (`problem_for` builds one).
    backend: "auto" (the table), "xla", "triton" or "hopper"; None reads ``$DSPARK_JAX_BACKEND``
      (unset: "auto").
    config: settings for the requested backend (an `XlaConfig`, `TritonConfig` or `HopperConfig`),
      or None for the defaults; with "auto" it applies only if the table picks its backend (the
      `Choice` returned says which config runs).

  Raises:
    ValueError: an explicit backend whose precondition `problem` fails (the message names it), an
      unknown backend name, or a config of another backend's type.
  """
  wanted = _requested(backend)
  if config is not None and not isinstance(config, tuple(CONFIG_TYPES.values())):
    raise ValueError(f"config: expected XlaConfig, TritonConfig or HopperConfig, got "
                     f"{type(config).__name__}")
  if wanted is not None:
    if config is not None and not isinstance(config, CONFIG_TYPES[wanted]):
      raise ValueError(f"config: {type(config).__name__} is not a setting of backend "
                       f"{wanted.value!r} (it takes {CONFIG_TYPES[wanted].__name__})")
    failed = failed_precondition(wanted, problem)
    if failed is not None:
      raise ValueError(f"backend {wanted.value!r}: precondition failed: {failed} ({_shape(problem)})")
    interpret = wanted is not Backend.XLA and problem.interpret
    where = "in Pallas' interpreter" if interpret else f"on {problem.platform}"
    return Choice(wanted, config or _default_config(wanted, problem),
                  f"{wanted.value} requested, {where}", interpret)
  if problem.platform != "gpu":
    return Choice(Backend.XLA, config if isinstance(config, XlaConfig)
                  else _default_config(Backend.XLA, problem),
                  f"auto: {problem.platform} is not a GPU (kernels run there only in an interpreter)")
  skipped = []
  for row in DEFAULTS:
    if row.variant not in ("any", problem.variant) or problem.batch < row.min_batch:
      continue
    if not str(problem.compute_capability or "").startswith(row.capability):
      continue
    failed = failed_precondition(row.backend, problem)
    if failed is not None:
      skipped.append(f"not {row.backend.value}: {failed}")
      continue
    chosen = config if isinstance(config, CONFIG_TYPES[row.backend]) else None
    return Choice(row.backend, chosen or _default_config(row.backend, problem),
                  "auto: " + "; ".join(skipped + [f"{row.backend.value} ({row.source})"]))
  chosen = config if isinstance(config, XlaConfig) else _default_config(Backend.XLA, problem)
  return Choice(Backend.XLA, chosen,
                "auto: " + "; ".join(skipped + ["xla, the fallback"]))


def _shape(p: Problem) -> str:
  return (f"{p.variant}, B={p.batch}, V={p.vocab}, r={p.rank}, γ={p.gamma}, W2 {p.w2_dtype}, "
          f"logits {p.logits_dtype}, {p.platform}"
          + (f" {p.compute_capability}" if p.compute_capability else ""))


def problem_for(*, greedy_only: bool, batch: int, vocab: int, rank: int, gamma: int, w2_dtype,
                logits_dtype, head_kind: str, store_logits: bool = True, confidence: bool = False,
                device: jax.Device | None = None, devices: int = 1) -> Problem:
  """A `Problem` on `device` (default: JAX's first device), its arrays spanning `devices`."""
  device = device or jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  return Problem(
      platform=device.platform, compute_capability=None if capability is None else str(capability),
      core_count=int(getattr(device, "core_count", 0) or 132), greedy_only=bool(greedy_only),
      batch=int(batch), vocab=int(vocab), rank=int(rank), gamma=int(gamma),
      w2_dtype=jnp.dtype(w2_dtype).name, logits_dtype=jnp.dtype(logits_dtype).name,
      head_kind=str(head_kind), store_logits=bool(store_logits), confidence=bool(confidence),
      devices=int(devices))


def resolve(backend, config=None, **problem) -> Choice:
  """`choose(problem_for(**problem), backend, config)`; a `Choice` passes through unchanged."""
  if isinstance(backend, Choice):
    return backend
  return choose(problem_for(**problem), backend, config)


def table() -> str:
  """The default table and every backend's preconditions, as text (``dspark-jax probe`` prints it)."""
  lines = ["default (auto) on a GPU, first row that applies:"]
  for row in DEFAULTS:
    cap = f"compute capability {row.capability}.x" if row.capability else "any GPU"
    lines.append(f"  {row.backend.value:7s} {row.variant:8s} from B = {row.min_batch:<4d} {cap}: "
                 f"{row.source}")
  lines.append("  xla     otherwise (and off the GPU)")
  for backend in (Backend.TRITON, Backend.HOPPER):
    lines.append(f"{backend.value} preconditions:")
    lines.extend(f"  - {name}" for name, _ in PRECONDITIONS[backend])
  return "\n".join(lines)


LAYER_KERNEL_CHOICES = ("auto", "xla", "pallas")


def choose_layer_kernel(what: str, env_var: str, implementation: str | None,
                        failed: Callable[[], str | None], *,
                        platform: str | None = None) -> str:
  """``"pallas"`` (the kernel, compiled), ``"interpret"`` (in Pallas' interpreter) or ``"xla"``.

  The request is `implementation`, else ``$env_var``, else ``auto``: one of
  `LAYER_KERNEL_CHOICES`. ``auto`` takes the compiled kernel on a GPU where ``failed()`` (the
  kernel's first failed precondition, in words, or None) is None, else ``xla``. ``pallas`` takes
  the kernel wherever the precondition holds, in the interpreter off the GPU (slowly: for tests).

  Raises:
    ValueError: an unknown request, or ``pallas`` where the precondition fails (naming `what`).
  """
  requested = implementation or os.environ.get(env_var, "auto") or "auto"
  if requested not in LAYER_KERNEL_CHOICES:
    raise ValueError(f"{what} implementation: expected one of {LAYER_KERNEL_CHOICES}, got "
                     f"{requested!r} (from {'the argument' if implementation else env_var})")
  if requested == "xla":
    return "xla"
  reason = failed()
  if requested == "pallas" and reason:
    raise ValueError(f"{what} implementation 'pallas': precondition failed: {reason}")
  platform = platform or jax.default_backend()
  if reason or (requested == "auto" and platform != "gpu"):
    return "xla"
  return "pallas" if platform == "gpu" else "interpret"
