"""Tensor and data parallelism on JAX's own SPMD: one model over a device mesh.

The layout rules these follow (`Plan`: a mesh and its axis names; which parameter is split on which
axis; the divisibility checks; the KV caches' sharding) are `dspark_jax.models.layout`, beside the
models that constrain their caches by them (`layout` here keeps that import path).

* `placement`: `shard` (sharded copies of a target and draft) and `make_mesh`.
* `loading`: a checkpoint read straight into shards (`load_pretrained(..., mesh=...)`).
* `mulhi`: the ``lax.mulhi`` lowering that lets sampled verification compile over several devices
  (registered on import of this package).

docs/sharding.md gives the layout and why sampling stays exact across shards.
"""

from dspark_jax.parallel import mulhi as _mulhi  # noqa: F401  (registers the lowering)
