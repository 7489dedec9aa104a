"""Sharded copies of a target and its draft on a device mesh (`shard`), and `make_mesh`.

This module owns placing models that already exist on one device onto a mesh: each parameter is
put with the `NamedSharding` of `layout.param_spec`, the fused projections reordered into column
groups (`models.layers.group_columns`) so each device holds whole heads, and the copies record
their `layout.Plan` (their caches are kept sharded by KV head). The models passed in are never
changed. `host_value` and `to_host` read arrays whole on the host, from every process where they span
several hosts. Loading a checkpoint straight into shards, without a whole copy on one device, is
`loading`'s job.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from dspark_jax.models import draft as dm
from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.models import target as tm


def make_mesh(tp: int, dp: int = 1, *, devices=None) -> jax.sharding.Mesh:
  """A ``(dp, tp)`` mesh named ``("dp", "tp")`` over the first ``dp * tp`` of `devices` (default
  ``jax.devices()``; devices of one replica are neighbours). ValueError if there are too few."""
  devices = list(jax.devices() if devices is None else devices)
  for name, value in (("tp", tp), ("dp", dp)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
  if tp * dp > len(devices):
    raise ValueError(f"tp * dp: {tp} * {dp} = {tp * dp} devices, but only {len(devices)} are "
                     "available")
  grid = np.array(devices[:tp * dp], dtype=object).reshape(dp, tp)
  return jax.sharding.Mesh(grid, ("dp", "tp"))


def host_value(x) -> np.ndarray:
  """`x` whole on the host as NumPy; an array spanning other processes' devices (several hosts,
  `jax.distributed`) is gathered from every process (a collective: every process must call it)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def to_host(tree):
  """`tree` with every array that spans other processes' devices replaced by its `host_value`
  (every process must call it); other leaves unchanged. Before ``jax.device_get`` of a program's
  outputs whose rows are split over a ``dp`` axis that spans several hosts."""
  def leaf(x):
    return host_value(x) if isinstance(x, jax.Array) and not x.is_fully_addressable else x
  return jax.tree.map(leaf, tree)


def path_name(path) -> str:
  """A state path as a dotted parameter name (``layers.0.attention.qkv_proj.kernel``)."""
  parts = []
  for key in path:
    part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
    if part != "value":
      parts.append(str(part))
  return ".".join(parts)


def fused_widths(name: str, shape: layers.LayerShape) -> tuple[int, ...] | None:
  """The part widths of fused parameter `name` of a layer of `shape`, or None if not fused."""
  if name.endswith("attention.qkv_proj.kernel"):
    nk = shape.num_kv_heads * shape.head_dim
    return (shape.num_heads * shape.head_dim, nk, nk)
  if name.endswith("mlp.gate_up_proj.kernel"):
    return (shape.intermediate_size, shape.intermediate_size)
  return None


def column_groups(model) -> int:
  """The column groups `model`'s fused projections are stored in (1 unless sharded)."""
  return 1 if model.plan is None else model.plan.tp_size


def set_plan(model, plan: layout.Plan | None) -> None:
  """Records `plan` on `model` (in place: only for copies this package made) and the matching
  column order on each of its layers."""
  model.plan = plan
  groups = 1 if plan is None else plan.tp_size
  for layer in model.layers:
    layer.attention.column_groups = groups
    layer.mlp.column_groups = groups


def canonical_state(model):
  """`model`'s parameter state with the fused projections in their stored-whole order
  (``[q | k | v]``, ``[gate | up]``), whatever the model's column groups."""
  state = nnx.state(model, nnx.Param)
  groups = column_groups(model)
  if groups == 1:
    return state
  shape = model.config.layer if isinstance(model, tm.TargetModel) else model.shape
  def regroup(path, leaf):
    widths = fused_widths(path_name(path), shape)
    return leaf if widths is None else layers.ungroup_columns(leaf, widths, groups)
  return jax.tree_util.tree_map_with_path(regroup, state)


def _place(model, plan: layout.Plan, shape: layers.LayerShape):
  old = column_groups(model)
  graphdef, state = nnx.split(model)
  def put(path, leaf):
    name = path_name(path)
    widths = fused_widths(name, shape)
    if widths is not None and old != plan.tp_size:
      leaf = layers.group_columns(layers.ungroup_columns(leaf, widths, old), widths, plan.tp_size)
    return jax.device_put(leaf, plan.sharding(layout.param_spec(name, plan)))
  copy = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(put, state))
  set_plan(copy, plan)
  return copy


def shard(target: tm.TargetModel, draft: dm.DSparkDraft | None, mesh: jax.sharding.Mesh, *,
          tp: str = "tp", dp: str | None = None
          ) -> tuple[tm.TargetModel, dm.DSparkDraft | None]:
  """Sharded copies of a target and its draft, for tensor (and data) parallel decoding.

  The copies run everywhere the originals do (`dspark_jax.generate`, `decode`, `draft_proposal`,
  the user's own ``jit``): XLA partitions each program over the mesh and issues the collectives.
  Tokens equal one device's up to the order of floating-point sums (docs/sharding.md).

  Args:
    target: a `TargetModel` (on one device, or already sharded: it is re-laid out).
    draft: its `DSparkDraft`, or None.
    mesh: a `jax.sharding.Mesh` (`make_mesh` builds one).
    tp: the mesh axis the weights, KV heads and vocabulary are split over.
    dp: None, or the axis of data-parallel replicas (the decoding batch is split over it where
      it divides).

  Returns:
    ``(target, draft)`` copies; `draft` is None if None was passed. The arguments are unchanged.

  Raises:
    ValueError: a mesh axis missing, or a ``tp`` size that does not divide the vocabulary, the
      query heads, KV heads or SwiGLU width of the target's or the draft's layers (naming the
      axis, its size and the dimension).
  """
  if not isinstance(target, tm.TargetModel):
    raise ValueError(f"target: expected a TargetModel, got {type(target).__name__}")
  if draft is not None and not isinstance(draft, dm.DSparkDraft):
    raise ValueError(f"draft: expected a DSparkDraft or None, got {type(draft).__name__}")
  plan = layout.Plan(mesh, tp, dp)
  shapes = {"target": target.config.layer}
  if draft is not None:
    shapes["draft"] = draft.shape
  layout.check_divisible(plan, vocab_size=target.config.vocab_size, shapes=shapes)
  sharded_target = _place(target, plan, target.config.layer)
  sharded_draft = None if draft is None else _place(draft, plan, draft.shape)
  return sharded_target, sharded_draft
