"""Parameters read straight into shards: every device's part of every parameter, read on its own.

This module owns building a sharded model from a reader of parameter parts, so that no parameter
is ever whole on the host or on one device (a Qwen3-32B-shaped target is 64 GB in bf16): each
parameter is a `jax.make_array_from_callback` whose callback reads the index a device holds. A
fused projection's shard (column groups, `models.layers.group_columns`) is read as the matching
rows of each of its parts. `dspark_jax.formats.qwen3.load_qwen3` (``mesh=...``) supplies the
reader over a checkpoint directory.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx

from dspark_jax.models import layers
from dspark_jax.models import layout
from dspark_jax.parallel import placement

Reader = Callable[[str, tuple[slice, ...]], np.ndarray]
"""``read(name, index) -> array``: the part `index` (a slice per axis, in our layout: kernels
[in, out]) of the parameter `name` (a `dspark_jax.formats.checkpoints.named_arrays` name: fused
projections by part)."""


def _bounds(index, shape) -> tuple[slice, ...]:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _fused_reader(prefix: str, suffix: str, widths: tuple[int, ...], groups: int, read: Reader):
  """Reads a column range of a fused parameter stored in `groups` column groups from its parts."""
  canonical = layers.group_columns(np.arange(sum(widths))[None], widths, groups)[0]
  starts = np.cumsum((0,) + widths[:-1])
  names = [prefix + part for part in layers.FUSED[suffix]]
  def run(rows: slice, cols: slice) -> np.ndarray:
    ids = canonical[cols]
    pieces, begin = [], 0
    while begin < len(ids):          # runs of consecutive columns of one part
      end = begin + 1
      while end < len(ids) and ids[end] == ids[end - 1] + 1 and (
          np.searchsorted(starts, ids[end], "right") == np.searchsorted(starts, ids[begin],
                                                                        "right")):
        end += 1
      part = int(np.searchsorted(starts, ids[begin], "right")) - 1
      first = int(ids[begin] - starts[part])
      pieces.append(read(names[part], (rows, slice(first, first + end - begin))))
      begin = end
    return np.concatenate(pieces, axis=-1)
  return run


def sharded_model(abstract: nnx.Module, plan: layout.Plan, shape: layers.LayerShape,
                  read: Reader) -> nnx.Module:
  """The model `abstract` (from ``nnx.eval_shape``) with every parameter read shard by shard.

  Args:
    abstract: a `TargetModel` or `DSparkDraft` of abstract arrays.
    plan: the layout (`layout.Plan`); divisibility is the caller's check (`layout.check_divisible`).
    shape: the model's layer shape (the widths of the fused projections).
    read: the `Reader` of the checkpoint's parameters; it returns the parameter's dtype.

  Returns:
    The model, its parameters `NamedSharding`-placed as `layout.param_spec` says and its fused
    projections in ``plan.tp_size`` column groups, its `plan` recorded.
  """
  graphdef, state = nnx.split(abstract)
  groups = plan.tp_size
  def build(path, leaf):
    name = placement.path_name(path)
    widths = placement.fused_widths(name, shape)
    if widths is None:
      part = lambda index: read(name, _bounds(index, leaf.shape))
    else:
      suffix = next(s for s in layers.FUSED if name.endswith(s))
      fused = _fused_reader(name[:-len(suffix)], suffix, widths, groups, read)
      part = lambda index: fused(*_bounds(index, leaf.shape))
    sharding = plan.sharding(layout.param_spec(name, plan))
    return jax.make_array_from_callback(
        leaf.shape, sharding, lambda index: np.asarray(part(index), leaf.dtype))
  model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(build, state))
  placement.set_plan(model, plan)
  return model
