"""Tensor and data parallelism on JAX's own SPMD: one model over a device mesh.

* `layout`: the layout (`Plan`: a mesh and its axis names; which parameter is split on which axis;
  the divisibility checks; the KV caches' sharding).
* `placement`: `shard` (sharded copies of a target and draft) and `make_mesh`.
* `loading`: a checkpoint read straight into shards (`load_pretrained(..., mesh=...)`).

docs/sharding.md gives the layout and why sampling stays exact across shards.
"""
