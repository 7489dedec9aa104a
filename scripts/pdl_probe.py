"""Issue 6 probe: can a Mosaic GPU kernel start while the kernel before it still runs (PDL)?

Programmatic dependent launch lets kernel B be launched early and run its prologue (say, stream
the next draft step's W2 into shared memory) while kernel A finishes; B's
``griddepcontrol.wait`` (`plgpu.griddepcontrol_wait`) then holds it until A is done. It only
happens if the launcher sets CUDA's programmatic-stream-serialization attribute on B's launch.
This runs a slow kernel A (a dependent arithmetic chain per instance; with or without
`plgpu.griddepcontrol_launch_dependents` at its start) and then kernel B (with or without the
wait) in one XLA program, and reads their start and end times off the GPU timeline (JAX's
profiler): B starting before A ends means PDL is in effect. It also lists the jax shared
libraries that mention the launch attribute.

  PYTHONPATH=. python3 scripts/pdl_probe.py
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_sampler  # noqa: E402

SIDE = 64  # each instance works on a [64, 64] float32 tile in the WGMMA register layout


def chain_kernel(programs, iterations, trigger, wait):
  """A kernel whose instances each run `iterations` dependent multiply-adds on one tile."""
  def kernel(x_gmem, o_gmem, smem, barrier):
    program = lax.axis_index("program")
    if trigger:
      plgpu.griddepcontrol_launch_dependents()
    if wait:
      plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(x_gmem.at[program], smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    x = plgpu.load(smem, (), layout=plgpu.Layout.WGMMA)
    x = lax.fori_loop(0, iterations, lambda i, x: x * 1.0000001 + 1e-7, x)
    smem[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem.at[program])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((programs, SIDE, SIDE), jnp.float32),
                      grid=(programs,), grid_names=("program",),
                      scratch_types=[plgpu.SMEM((SIDE, SIDE), jnp.float32),
                                     plgpu.Barrier(num_arrivals=1, num_barriers=1)])


def triton_chain_kernel(programs, iterations, trigger, wait):
  """The same in Pallas' Triton lowering, with the two instructions as the library writes them
  (`fused_step.launch_control`: inline assembly that passes the load's lane indices through)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  from dspark_jax.kernels import triton_step as fused_step

  def kernel(x_ref, o_ref):
    program = pl.program_id(0)
    lanes = lax.broadcasted_iota(jnp.int32, (x_ref.shape[1],), 0)
    if trigger:
      lanes = fused_step.launch_control("launch_dependents", lanes, interpret=False)
    if wait:
      lanes = fused_step.launch_control("wait", lanes, interpret=False)
    x = pltriton.load(x_ref.at[program, lanes])
    x = lax.fori_loop(0, iterations, lambda i, x: x * 1.0000001 + 1e-7, x)
    o_ref[program] = x

  return lambda x: pl.pallas_call(
      kernel, grid=(programs,), in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=4))(x)


def launch_attribute_mentions():
  """jax shared libraries whose bytes mention the programmatic-serialization launch attribute."""
  import jaxlib
  roots = {os.path.dirname(os.path.dirname(jaxlib.__file__))}
  found = []
  for root in roots:
    for path in glob.glob(os.path.join(root, "jax*", "**", "*.so*"), recursive=True):
      try:
        with open(path, "rb") as f:
          data = f.read()
      except OSError:
        continue
      for needle in (b"ProgrammaticStreamSerialization", b"PROGRAMMATIC_STREAM_SERIALIZATION",
                     b"griddepcontrol"):
        if needle in data:
          found.append(f"{os.path.relpath(path, root)}: {needle.decode()}")
  return found


def main():
  programs = jax.devices()[0].core_count
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {programs} instances")
  for line in launch_attribute_mentions() or ["(no jax library mentions it)"]:
    print("  " + line)
  runs = [("mosaic", t, w) for t, w in ((True, True), (False, True), (True, False), (False, False))]
  runs += [("triton", True, True), ("triton", False, True), ("triton", False, False)]
  for backend, trigger, wait in runs:
    make = chain_kernel if backend == "mosaic" else triton_chain_kernel
    first = make(programs, 20000, trigger=trigger, wait=False)
    second = make(programs, 200, trigger=False, wait=wait)
    x = jnp.ones((programs, SIDE, SIDE) if backend == "mosaic" else (programs, 128), jnp.float32)
    program = jax.jit(lambda x: second(first(x))).lower(x).compile()
    jax.block_until_ready(program(x))
    out = tempfile.mkdtemp()
    with jax.profiler.trace(out, create_perfetto_trace=True):
      for _ in range(3):
        time.sleep(0.02)
        jax.block_until_ready(program(x))
    files = glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)
    kernels = trace_sampler.last_burst(trace_sampler.gpu_kernel_events(
        max(files, key=os.path.getmtime)))
    if len(kernels) != 2:
      print(f"{backend}: trigger {trigger:d} wait {wait:d}: {len(kernels)} kernels: "
            f"{[(round(d, 1), n[:30]) for _, d, n in kernels]}")
      continue
    (a_start, a_dur, _), (b_start, b_dur, _) = kernels
    print(f"{backend}: A triggers {trigger:d}, B waits {wait:d}: A {a_dur:7.1f} µs, B starts "
          f"{b_start - (a_start + a_dur):+7.1f} µs after A ends, B {b_dur:7.1f} µs "
          f"({'overlap: PDL' if b_start < a_start + a_dur else 'no overlap'})")


if __name__ == "__main__":
  main()
