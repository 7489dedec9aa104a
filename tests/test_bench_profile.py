"""The profile's reducer (`benchmarks.bench_profile`): the HLO costs of a program's ops, and a real
`jax.profiler` trace of a tiny jitted loop read back and reduced per call and per iteration."""

import jax
import jax.numpy as jnp

from benchmarks import bench_profile as bp

FUSED_SLICE = """HloModule jit_f, is_scheduled=true

%fused_slice (param_0: bf16[4,8,16], param_1: s32[]) -> bf16[8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,8,16}
  ROOT %b = bf16[8,16]{1,0} bitcast(%ds)
}

%fused_update (param_0.1: f32[64,32], param_1.1: f32[1,32], param_2: s32[]) -> f32[64,32] {
  %param_0.1 = f32[64,32]{1,0} parameter(0)
  %param_1.1 = f32[1,32]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  ROOT %dus = f32[64,32]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %c.1)
}

ENTRY %main (w: bf16[4,8,16], i: s32[], cache: f32[64,32], row: f32[1,32]) -> f32[64,32] {
  %w = bf16[4,8,16]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %cache = f32[64,32]{1,0} parameter(2)
  %row = f32[1,32]{1,0} parameter(3)
  %slice_fusion.3 = bf16[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %update_fusion = f32[64,32]{1,0} fusion(%cache, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (bf16[8,16]{1,0}, f32[64,32]{1,0}) tuple(%slice_fusion.3, %update_fusion)
}
"""


def test_hlo_costs_count_slices_and_in_place_updates():
  costs = bp.hlo_costs(FUSED_SLICE)
  assert set(costs) == {"slice_fusion.3", "update_fusion"}  # parameters, tuple: no kernel
  # One [8, 16] bf16 slice read of the [4, 8, 16] parameter, the same written; the index: 4 bytes.
  assert costs["slice_fusion.3"].bytes == 8 * 16 * 2 * 2 + 4
  assert costs["slice_fusion.3"].label == "slice_fusion bf16[8,16]"
  # The cache updated in place: the row read and written, the index, nothing of the cache.
  assert costs["update_fusion"].bytes == 32 * 4 * 2 + 4
  assert bp.module_name(FUSED_SLICE) == "jit_f"


SPLIT_K = """HloModule jit_g, is_scheduled=true

%gemm_computation (p0: bf16[8,1,512], p1: bf16[8,512,2560]) -> f32[8,1,2560] {
  %p0 = bf16[8,1,512]{2,1,0} parameter(0)
  %p1 = bf16[8,512,2560]{2,1,0} parameter(1)
  ROOT %d = f32[8,1,2560]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[8,1,512], w: bf16[8,512,2560]) -> f32[8,1,2560] {
  %a = bf16[8,1,512]{2,1,0} parameter(0)
  %w = bf16[8,512,2560]{2,1,0} parameter(1)
  ROOT %gemm_fusion_dot.7 = f32[8,1,2560]{2,1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"128","split_k":"SPLIT","num_stages":"4","num_warps":"4","num_ctas":"1"}}}
}
"""


def test_a_split_k_projection_counts_as_a_gemm_and_a_batched_dot_does_not():
  """XLA's split-K turns a projection [1, 4096] @ [4096, 2560] into a dot batched over 8 slices of
  K; the profile's GEMM total must still hold it. The same fusion without a split (a batched
  product, e.g. attention's) is not a GEMM."""
  split = bp.hlo_costs(SPLIT_K.replace("SPLIT", "8"))["gemm_fusion_dot.7"]
  assert split.gemm and split.flops == 2.0 * 8 * 2560 * 512
  assert split.label == "gemm_fusion_dot f32[8,1,2560] K=512"
  assert not bp.hlo_costs(SPLIT_K.replace("SPLIT", "1"))["gemm_fusion_dot.7"].gemm


SUMMED_SPLITS = """HloModule jit_h, is_scheduled=true

%gemm_computation (p0: bf16[8,1,512], p1: bf16[8,512,2560]) -> f32[8,1,2560] {
  %p0 = bf16[8,1,512]{2,1,0} parameter(0)
  %p1 = bf16[8,512,2560]{2,1,0} parameter(1)
  ROOT %d = f32[8,1,2560]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_convert (param_0: f32[8,1,2560]) -> bf16[1,2560] {
  %param_0 = f32[8,1,2560]{2,1,0} parameter(0)
  %zero = f32[] constant(0)
  %r = f32[1,2560]{1,0} reduce(%param_0, %zero), dimensions={0}, to_apply=%add
  ROOT %c = bf16[1,2560]{1,0} convert(%r)
}

ENTRY %main (a: bf16[8,1,512], w: bf16[8,512,2560]) -> bf16[1,2560] {
  %a = bf16[8,1,512]{2,1,0} parameter(0)
  %w = bf16[8,512,2560]{2,1,0} parameter(1)
  %gemm_fusion_dot.3 = f32[8,1,2560]{2,1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %loop_convert_fusion = bf16[1,2560]{1,0} fusion(%gemm_fusion_dot.3), kind=kInput, calls=%fused_convert
}
"""


def test_a_projection_whose_partials_are_summed_counts_as_a_gemm():
  """Where the fusion's config does not name its split (XLA's nested GEMM fusions), the split
  shows in the HLO: a dot batched over K's slices whose user sums it over that dimension. A
  batched dot whose user sums another dimension stays a batched product."""
  split = bp.hlo_costs(SUMMED_SPLITS)["gemm_fusion_dot.3"]
  assert split.gemm and split.flops == 2.0 * 8 * 2560 * 512
  other = SUMMED_SPLITS.replace("dimensions={0}", "dimensions={2}").replace(
      "f32[1,2560]{1,0} reduce", "f32[8,1]{1,0} reduce")
  assert not bp.hlo_costs(other)["gemm_fusion_dot.3"].gemm


def test_a_traced_loop_reduces_per_call_and_iteration(tmp_path):
  """Two calls of a 3-iteration loop of one [8, 64] @ [64, 32] product: the trace (the host XLA
  ops on a CPU) splits by the annotations; the product's group runs once an iteration, with its
  FLOPs from the optimized HLO."""
  @jax.jit
  def f(x, w):
    return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w) @ w.T + x, x)

  x, w = jnp.ones((8, 64)), jnp.full((64, 32), 0.01)
  thunk = lambda: f(x, w)
  jax.block_until_ready(thunk())
  text = f.lower(x, w).compile().as_text()
  costs = bp.hlo_costs(text)
  bp.trace_call(thunk, str(tmp_path), calls=2)
  trace = bp.read_trace(str(tmp_path))
  assert trace["events"] and len(trace["windows"]) == 2
  result = bp.reduce_calls(trace, costs, calls=2, iterations=3, gap_us=1.0, bandwidth=1e10,
                           rate=1e11, module=bp.module_name(text))
  assert result["split"] == "annotations" and result["calls_traced"] == 2
  assert 0 < result["busy_us"] <= result["span_us"] and 0 < result["busy_pct"] <= 100
  assert result["costed_share"] == 1.0
  flops = sorted(round(r["gflop"] * 1e9) for r in result["groups"] if r["gflop"])
  assert 2 * 8 * 64 * 32 in flops and 2 * 8 * 32 * 64 in flops  # each product once an iteration
  gemms = [r for r in result["groups"] if r["gemm"]]
  assert gemms and all(r["x_floor"] > 0 and r["count"] >= 1 for r in gemms)


def test_calls_split_at_the_largest_gaps_without_annotations():
  ev = lambda start, end, name="k": bp.Event(name, start, end, None, None)
  events = [ev(0, 10), ev(12, 20), ev(1000, 1010), ev(1011, 1020, "j")]
  calls, how = bp.split_calls(events, [], 2)
  assert how == "largest gaps" and [len(c) for c in calls] == [2, 2]
  timeline = bp.call_timeline(calls[1], gap_ns=0.5)
  assert timeline["span_ns"] == 20 and timeline["busy_ns"] == 19 and timeline["big_gaps"] == 1
  assert timeline["largest"][0] == {"us": 1e-3, "after": "k", "before": "j"}
  # A GEMM-named kernel without an HLO op is still a GEMM, against the call's weights.
  result = bp.reduce_calls({"events": events, "windows": [], "source": "test"}, {}, calls=2,
                           iterations=1, gap_us=0.0, bandwidth=1.0, rate=1.0)
  assert [r["group"] for r in result["groups"]] == ["k", "j"]
  assert bp.gemm_cell(result, 1e-6) == "n/a"
  result["groups"][0]["gemm"] = True
  assert bp.gemm_cell(result, result["groups"][0]["us"] * 1e-6).endswith("(1.00w)")
