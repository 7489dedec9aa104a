"""The tensor-parallel layout the models follow: which axis of which parameter and cache is split.

This module owns the layout rules and nothing that moves data (`dspark_jax.parallel.placement`
and `dspark_jax.parallel.loading` do); it sits with the models, which constrain their caches by it:

* `Plan`: a `jax.sharding.Mesh` and the names of its tensor-parallel axis (``tp``) and, optionally,
  its data-parallel axis (``dp``: replicas, the batch split across them);
* `param_spec`: a parameter's `PartitionSpec` from its path (the names of
  `dspark_jax.formats.checkpoints.named_arrays` before unfusing, e.g.
  ``layers.3.attention.qkv_proj.kernel``). Split over ``tp``: the fused q/k/v and gate/up
  projections by output columns (stored in column groups, `models.layers.group_columns`, so each
  device holds whole heads), ``o_proj`` and ``down_proj`` by input rows, the embedding [V, E] and
  the LM head [E, V] by vocabulary, the Markov head's ``w2`` [r, V] by vocabulary. Everything else
  (norms, the draft's ``fc``, ``w1``, the gated / rnn matrices, the confidence head) is replicated;
* `check_divisible`: ValueError naming the mesh axis, its size and the dimension it does not
  divide (query heads, KV heads, SwiGLU width, vocabulary);
* `constrain_cache`: a head-major [B, K, S, D] KV cache sharded on its KV-head axis (and on the
  batch axis over ``dp`` where the batch divides), applied where the models write their caches;
  `constrain_pool`: a paged cache's pool [num_pages, K, page_size, D] sharded on its KV-head axis
  (pages are shared by every row, so never split over ``dp``);
* `plan_devices`: the devices a model laid out by a plan spans, known when its arrays are traced.

The layout is a hint to XLA's SPMD partitioner, which inserts every collective; values never
depend on it except through the order of floating-point sums (docs/sharding.md).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

FUSED_COLUMNS = ("attention.qkv_proj.kernel", "mlp.gate_up_proj.kernel")
"""Fused projections split by output columns, in column groups."""
ROW_SPLIT = ("attention.o_proj.kernel", "mlp.down_proj.kernel")
"""Projections split by input rows (their products are summed across devices)."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """A mesh and how the models use its axes. Static and hashable (models carry it).

  Attributes:
    mesh: the device mesh; its axes are made Auto (XLA's partitioner places what the layout leaves
      open; a ``jax.make_mesh`` default of Explicit axes would make every reshape of a split
      axis name its output sharding). tp: the axis the weights, heads and vocabulary are split over.
    dp: None, or the axis of data-parallel replicas (the batch is split over it).
  """

  mesh: Mesh
  tp: str = "tp"
  dp: str | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(self.mesh).__name__}")
    for field, name in (("tp", self.tp), ("dp", self.dp)):
      if name is not None and name not in self.mesh.axis_names:
        raise ValueError(f"{field}: the mesh has no axis {name!r} (axes: {self.mesh.axis_names})")
    if self.dp is not None and self.dp == self.tp:
      raise ValueError(f"dp: must differ from tp, both are {self.tp!r}")
    auto = (jax.sharding.AxisType.Auto,) * len(self.mesh.axis_names)
    if tuple(self.mesh.axis_types) != auto:
      object.__setattr__(self, "mesh", Mesh(self.mesh.devices, self.mesh.axis_names,
                                            axis_types=auto))

  @property
  def tp_size(self) -> int:
    return int(self.mesh.shape[self.tp])

  @property
  def dp_size(self) -> int:
    return 1 if self.dp is None else int(self.mesh.shape[self.dp])

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)


def param_spec(name: str, plan: Plan) -> P:
  """The `PartitionSpec` of the parameter at path `name` (module docstring)."""
  if any(name == s or name.endswith("." + s) for s in FUSED_COLUMNS) or name in (
      "lm_head.kernel", "head.w2"):
    return P(None, plan.tp)
  if any(name.endswith("." + s) for s in ROW_SPLIT) or name == "embed.embedding":
    return P(plan.tp, None)
  return P()


def check_divisible(plan: Plan, *, vocab_size: int, shapes: dict) -> None:
  """Raises ValueError unless the ``tp`` axis divides the vocabulary and, for each named layer
  shape in `shapes` (e.g. ``{"target": LayerShape, "draft": LayerShape}``), its query heads, KV
  heads and SwiGLU width."""
  size = plan.tp_size
  dims = [("vocab_size", vocab_size, "the vocabulary")]
  for owner, shape in shapes.items():
    dims += [(f"{owner} num_heads", shape.num_heads, "query heads"),
             (f"{owner} num_kv_heads", shape.num_kv_heads, "KV heads (each device keeps whole "
              "heads of the cache)"),
             (f"{owner} intermediate_size", shape.intermediate_size, "SwiGLU columns")]
  for what, value, meaning in dims:
    if value % size:
      raise ValueError(f"mesh: axis {plan.tp!r} has size {size}, which does not divide the "
                       f"{what} = {value} ({meaning} are split over it)")


def cache_spec(plan: Plan, batch: int) -> P:
  """The spec of a head-major [B, K, S, D] cache: K over ``tp``; B over ``dp`` if it divides."""
  dp = plan.dp if plan.dp is not None and batch % plan.dp_size == 0 else None
  return P(dp, plan.tp, None, None)


def constrain_cache(x: jax.Array, plan: Plan | None) -> jax.Array:
  """`x` (a [B, K, S, D] cache) constrained to `cache_spec`; unchanged without a plan."""
  if plan is None:
    return x
  return jax.lax.with_sharding_constraint(x, plan.sharding(cache_spec(plan, x.shape[0])))


def constrain_pool(x: jax.Array, plan: Plan | None) -> jax.Array:
  """`x` (a paged cache's pool [num_pages, K, page_size, D]) constrained to K over ``tp``;
  unchanged without a plan."""
  if plan is None:
    return x
  return jax.lax.with_sharding_constraint(x, plan.sharding(P(None, plan.tp, None, None)))


def plan_devices(plan: Plan | None) -> int | None:
  """The devices a model laid out by `plan` spans (its mesh's size), or None without a plan.
  Recorded on the model, so known when its arrays are traced (the user's own ``jit``)."""
  return None if plan is None else int(plan.mesh.size)
