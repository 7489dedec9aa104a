"""One call of the round profiled kernel by kernel: a `jax.profiler` trace reduced to a table.

Owns the profile of issue 46: for each call of ``--parts`` (default the AR step, the target verify
of γ + 1 = 8 tokens a row, the draft forward and the full round; `bench_decode`'s thunks, models
and floors: Qwen3-4B shape and the 5-layer draft, ``--small`` a tiny float32 pair for the CPU) at
every B of ``--batches`` (1, 16, 64) and ``--context`` (1024), it

* times the call unprofiled as `bench_decode` does (`harness.time_one` after the warm-up that
  compiles; the looped calls run LOOP iterations in one program and are reported per iteration),
  against `bench_decode.floors` (weights and KV at the measured copy rate, FLOPs at the measured
  bf16 matrix rate);
* captures a `jax.profiler.trace` of ``--trace-repeats`` calls, each inside a
  `jax.profiler.TraceAnnotation` and synced, into ``--out``/trace/B<b>_<part>/, with the compiled
  program's optimized HLO beside it (``module.hlo.txt.gz``);
* reads the trace back (`jax.profiler.ProfileData`; `read_trace`): on a GPU the device plane's
  stream lines (kernels, memcpys, memsets as CUPTI saw them); where there is none (the CPU) the host
  plane's XLA op events, innermost only (a ``while`` event contains its body's). Events fall into
  calls by the annotations' host times, or, where those do not hold them, at the largest gaps;
* reduces it (`reduce_calls`) to a table per call, per iteration: kernel group (the HLO op it ran,
  its uniquifying number stripped, with its output shape and, for a product, its contraction K;
  else the kernel name), kernels per iteration, µs per iteration, share of the busy time, MB moved
  and GFLOP from the op's shapes in the optimized HLO (`hlo_costs`: operands read and results
  written, a slice of a parameter counted as the slice, an in-place update as the update), and ×
  that floor. Then the gaps: device span of a call against the union of its kernels (busy %), the
  gaps between consecutive kernels above ``--gap-us`` (count, µs) and the largest few.

The last table (Markdown) has one row per (B, call): timed ms and × floor, traced span, busy %,
gaps, the GEMMs' time against their own floor (ops with a dot; where no HLO op maps, kernels named
like a GEMM against the call's weight bytes, marked ``w``) and the largest kernel group.
``--out``/profile.json holds everything (``--json`` elsewhere).

While a trace runs XLA replaces command buffers (CUDA graphs) by op-by-op launches unless
``--graphs`` (``--xla_enable_command_buffers_during_profiling=true``, experimental in XLA): the
default trace shows each kernel's own time faithfully but gaps of the op-by-op launches; the timed
column is the real call. Compare the traced span with the timed time.

  python -m benchmarks.bench_profile --small --out /tmp/profile     # CPU, < 1 minute
  python -m benchmarks.bench_profile --out profile                  # GPU: B = 1,16,64, context 1024
  python -m benchmarks.bench_profile --graphs --batches 1 --parts "autoregressive step"
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import glob
import gzip
import math
import os
import re
import shutil
import statistics
import time
import traceback

import jax
from flax import nnx

from benchmarks import bench_decode
from benchmarks import harness
from dspark_jax.models import target as tm

DEFAULT_PARTS = ("autoregressive step", "target verify", "draft forward", "full round")
MARKER = "bench_profile call "
OUTLIER = 1.5
GRAPHS_FLAG = "--xla_enable_command_buffers_during_profiling=true"
GEMM_KERNEL = re.compile(r"gemm|gemv|matmul|xmma|nvjet|cutlass|cublas|dot", re.IGNORECASE)
DERIVED_LINES = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops",
                 "Framework Name Scope", "Source code", "Launch Stats", "TensorFlow Ops"}
"""Lines a post-processed trace may add to a device plane (summaries of the stream lines)."""


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=harness.int_list, default=None,
                      help="comma list of batch sizes (default 1,16,64; --small: 2)")
  parser.add_argument("--context", type=int, default=None,
                      help="context in tokens (default 1024; --small: 32)")
  parser.add_argument("--parts", type=bench_decode.part_list, default=list(DEFAULT_PARTS),
                      help=f"comma list of calls (default {','.join(DEFAULT_PARTS)}; any of "
                      f"{', '.join(bench_decode.PARTS)})")
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--out", default="profile", help="folder of the traces and profile.json")
  parser.add_argument("--trace-repeats", type=int, default=3, help="calls traced (default 3)")
  parser.add_argument("--gap-us", type=float, default=2.0,
                      help="gaps between kernels above this count as gaps (default 2 µs)")
  parser.add_argument("--top", type=int, default=20, help="kernel groups shown per call")
  parser.add_argument("--graphs", action="store_true",
                      help=f"keep command buffers while tracing (XLA_FLAGS {GRAPHS_FLAG})")
  harness.add_common_arguments(parser, repeats=5, warmup=1)
  args = harness.finish_arguments(parser, parser.parse_args(argv))
  args.batches = args.batches or ([2] if args.small else [1, 16, 64])
  args.context = args.context or (32 if args.small else 1024)
  args.json = args.json or os.path.join(args.out, "profile.json")
  if args.context < 2 or args.trace_repeats < 1 or args.top < 1 or args.gap_us < 0:
    parser.error("--context >= 2, --trace-repeats >= 1, --top >= 1, --gap-us >= 0")
  return args


# ---- the program's ops, from its optimized HLO ---------------------------------------------------

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5,
               "u4": 0.5}
SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
OPERAND = re.compile(r"%([\w.\-]+)")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+) = (.*)$")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
        "call", "after-all", "partition-id", "replica-id", "opt-barrier", "iota"}
SLICES = {"dynamic-slice", "slice", "gather"}


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list  # names
  attrs: str
  root: bool


@dataclasses.dataclass
class OpCost:
  label: str
  bytes: float
  flops: float
  gemm: bool = False  # a projection: a product without batch dimensions, or split-K slices


def _closing(text: str, start: int) -> int:
  """Index of the bracket closing ``text[start]`` (one of ``([{``)."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def _split_top(text: str) -> list[str]:
  """`text` split at commas outside brackets."""
  parts, depth, last = [], 0, 0
  for i, ch in enumerate(text):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(text[last:i])
      last = i + 1
  return parts + [text[last:]]


def parse_hlo(text: str) -> dict[str, dict[str, Instruction]]:
  """``{computation: {instruction name: Instruction}}`` of an HLO module's text."""
  computations, current = {}, None
  for line in text.splitlines():
    match = INSTRUCTION.match(line)
    if match and current is not None:
      root, name, rest = match.groups()
      if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
      else:
        shape, _, rest = rest.partition(" ")
      opcode, _, rest = rest.partition("(")
      end = _closing("(" + rest, 0) - 1
      computations[current][name] = Instruction(name, shape, opcode.strip(),
                                                OPERAND.findall(rest[:end]), rest[end + 1:],
                                                bool(root))
      continue
    match = COMPUTATION.match(line)
    if match and not line.startswith(" "):
      current = match.group(1)
      computations[current] = {}
  return computations


def shape_bytes(shape: str) -> float:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES.get(dtype, 1)
             for dtype, dims in SHAPE.findall(shape)
             if dtype in DTYPE_BYTES or dtype.startswith("f8"))


def _dims(shape: str) -> list[int]:
  found = SHAPE.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _short(shape: str) -> str:
  found = SHAPE.findall(shape)
  return (f"{found[0][0]}[{found[0][1]}]" + ("…" if len(found) > 1 else "")) if found else shape


def _split_k(attrs: str) -> int:
  """The ``split_k`` of a Triton GEMM fusion's backend config (1 where it has none)."""
  found = re.search(r'"split_k":"?(\d+)', attrs)
  return int(found.group(1)) if found else 1


def _dot_flops(instr: Instruction, everything: dict) -> tuple[float, int, bool]:
  """``(FLOPs, K, batched)`` of a dot or a GEMM custom call; (0, 0, False) for anything else."""
  if instr.opcode == "dot":
    found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    batched = "lhs_batch_dims={" in instr.attrs
  elif instr.opcode == "custom-call" and re.search(r"gemm|matmul", instr.attrs, re.IGNORECASE):
    found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    batched = bool(re.search(r'"lhs_batch_dimensions":\[[^\]]', instr.attrs))
  else:
    return 0.0, 0, False
  if not found or not instr.operands or instr.operands[0] not in everything:
    return 0.0, 0, False
  lhs = _dims(everything[instr.operands[0]].shape)
  k = math.prod(lhs[int(d.strip('" '))] for d in found.group(1).split(",") if d.strip('" '))
  return 2.0 * math.prod(_dims(instr.shape)) * k, k, batched


def hlo_costs(text: str) -> dict[str, OpCost]:
  """Per instruction that runs as a kernel (fusions, custom calls, copies, ...): a group label,
  the bytes it moves at least (operands read, results written; a fused parameter only sliced
  counts as its slices, one only updated in place as nothing, an in-place update as its update)
  and its FLOPs (dots and GEMM custom calls)."""
  computations = parse_hlo(text)
  everything = {n: i for comp in computations.values() for n, i in comp.items()}
  owner = {n: c for c, comp in computations.items() for n in comp}

  def users(comp: dict, name: str) -> list[Instruction]:
    return [i for i in comp.values() if name in i.operands]

  def size(name: str) -> float:
    return shape_bytes(everything[name].shape) if name in everything else 0.0

  def read(comp: dict, instr: Instruction) -> float:
    """Bytes of a fused computation's value `instr` its users read."""
    used = users(comp, instr.name)
    if used and all(u.opcode in SLICES and u.operands[0] == instr.name for u in used):
      return sum(shape_bytes(u.shape) for u in used)
    if used and all(u.opcode == "dynamic-update-slice" and u.operands[0] == instr.name
                    for u in used):
      return 0.0
    if used and all(u.opcode == "bitcast" for u in used):
      return sum(read(comp, u) for u in used)
    return shape_bytes(instr.shape)

  def written(comp: dict, instr: Instruction) -> float:
    if instr.opcode == "tuple":
      return sum(written(comp, comp[ref]) for ref in instr.operands if ref in comp)
    if instr.opcode == "bitcast" and instr.operands and instr.operands[0] in comp:
      return written(comp, comp[instr.operands[0]])
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
      return size(instr.operands[1])
    return shape_bytes(instr.shape)

  def called(instr: Instruction) -> dict | None:
    found = re.search(r"calls=%?([\w.\-]+)", instr.attrs)
    return computations.get(found.group(1)) if found else None

  def flops(comp: dict) -> tuple[float, int, bool]:
    total, k, gemm = 0.0, 0, False
    for instr in comp.values():
      f, kk, batched = _dot_flops(instr, everything)
      gemm_here = f > 0 and not batched
      if instr.opcode == "fusion" and called(instr) is not None:
        f, kk, gemm_here = flops(called(instr))
      total, k, gemm = total + f, max(k, kk), gemm or gemm_here
    return total, k, gemm

  def summed_over_splits(comp: dict, instr: Instruction) -> bool:
    """Whether a user of `instr` sums it over its leading dimension, as XLA sums a GEMM's split-K
    partial products: a reduce over dimension 0 of it (or of its bitcast or convert), alone or
    fused into the user."""
    dims = _dims(instr.shape)
    for user in users(comp, instr.name):
      body = called(user) if user.opcode == "fusion" else None
      for reduce in ([user] if body is None else list(body.values())):
        if reduce.opcode != "reduce" or "dimensions={0}" not in reduce.attrs:
          continue
        source = (body or comp).get(reduce.operands[0]) if reduce.operands else None
        while source is not None and source.opcode in ("bitcast", "convert", "copy"):
          source = (body or comp).get(source.operands[0]) if source.operands else None
        if source is not None and (source.name == instr.name or (
            body is not None and source.opcode == "parameter" and _dims(source.shape) == dims)):
          return True
    return False

  inside = {c for i in everything.values() if i.opcode == "fusion"
            for c in re.findall(r"calls=%?([\w.\-]+)", i.attrs)}
  inside |= {c for i in everything.values() for c in re.findall(r"to_apply=%?([\w.\-]+)", i.attrs)}
  fused = {n for c in inside if c in computations for n in computations[c]}
  costs = {}
  for name, instr in everything.items():
    if instr.opcode in FREE or name in fused:
      continue
    label = re.sub(r"(\.\d+)+$", "", name)
    body = called(instr) if instr.opcode == "fusion" else None
    if body is not None:
      moved = sum(read(body, p) for p in body.values() if p.opcode == "parameter")
      moved += sum(written(body, i) for i in body.values() if i.root)
      f, k, gemm = flops(body)
      # XLA's split-K gives a projection's dot a batch dimension of K's slices, summed by its
      # user: still a GEMM.
      gemm = gemm or (f > 0 and (_split_k(instr.attrs) > 1 or summed_over_splits(
          computations[owner[name]], instr)))
    elif instr.opcode in SLICES or instr.opcode == "copy":
      moved, f, k, gemm = 2 * shape_bytes(instr.shape), 0.0, 0, False
    elif instr.opcode == "dynamic-update-slice":
      moved, f, k, gemm = 2 * written({}, instr), 0.0, 0, False
    else:
      shape = instr.shape
      if instr.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
        label += f" {target.group(1)}" if target and target.group(1) not in label else ""
        parts = _split_top(shape[1:-1]) if shape.startswith("(") else [shape]
        if len(parts) > 1 and SHAPE.search(parts[-1]) and SHAPE.search(parts[-1]).group(1) in (
            "s8", "u8"):
          shape = "(" + ",".join(parts[:-1]) + ")"  # a GEMM's workspace: not data
      moved = sum(size(ref) for ref in instr.operands) + shape_bytes(shape)
      f, k, batched = _dot_flops(instr, everything)
      gemm = f > 0 and not batched
    costs[name] = OpCost(f"{label} {_short(instr.shape)}" + (f" K={k}" if k else ""), moved, f,
                         gemm)
  return costs


def module_name(text: str) -> str | None:
  found = re.match(r"HloModule ([\w.\-]+)", text)
  return found.group(1) if found else None


# ---- the trace -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Event:
  name: str
  start: float  # ns
  end: float
  op: str | None  # the HLO op (stat hlo_op)
  module: str | None


def _stats(event) -> dict:
  return {k: v for k, v in event.stats if k is not None}


def _leaves(events: list[Event]) -> list[Event]:
  """The events of one thread that contain no other (a while op's event holds its body's)."""
  events = sorted(events, key=lambda e: (e.start, -e.end))
  return [e for i, e in enumerate(events)
          if not (i + 1 < len(events) and events[i + 1].start < e.end
                  and events[i + 1].end <= e.end)]


def read_trace(directory: str, marker: str = MARKER) -> dict:
  """The newest trace under `directory`: ``{"events": [Event] (device work, by start), "windows":
  [(start, end)] of the host annotations named `marker`..., "source": which plane and lines}``."""
  files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return {"events": [], "windows": [], "source": "no trace file"}
  planes = list(jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime)).planes)
  hosts = [p for p in planes if p.name.startswith("/host:")]
  windows = sorted((e.start_ns, e.end_ns) for p in hosts for line in p.lines for e in line.events
                   if e.name.startswith(marker))
  devices = sorted((p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name),
                   key=lambda p: p.name)
  for plane in devices:
    lines = list(plane.lines)
    streams = [l for l in lines if l.name.startswith("Stream")] or [
        l for l in lines if l.name not in DERIVED_LINES]
    events = []
    for line in streams:
      for e in line.events:
        stats = _stats(e)
        op, module = stats.get("hlo_op"), stats.get("hlo_module")
        events.append(Event(e.name, e.start_ns, e.end_ns, None if op is None else str(op),
                            None if module is None else str(module)))
    if events:
      return {"events": sorted(events, key=lambda e: e.start), "windows": windows,
              "source": f"{plane.name}: {', '.join(l.name for l in streams)}"}
  host_ops = []
  for plane in hosts:
    for line in plane.lines:
      ops = []
      for e in line.events:
        stats = _stats(e)
        if "hlo_op" in stats:
          ops.append(Event(e.name, e.start_ns, e.end_ns, str(stats["hlo_op"]),
                           str(stats.get("hlo_module", "")) or None))
      host_ops += _leaves(ops)
  return {"events": sorted(host_ops, key=lambda e: e.start), "windows": windows,
          "source": "host XLA ops" + (" (no device events: is CUPTI available?)"
                                      if devices else "")}


def split_calls(events: list[Event], windows: list, calls: int) -> tuple[list[list[Event]], str]:
  """`events` as one list per call: by the annotation windows where they hold >= 90 % of the
  events, else cut at the ``calls - 1`` largest gaps."""
  if windows:
    groups = [[] for _ in windows]
    for e in events:
      for i, (lo, hi) in enumerate(windows):
        if lo <= e.start <= hi:
          groups[i].append(e)
          break
    if sum(map(len, groups)) >= 0.9 * len(events):
      return [g for g in groups if g], "annotations"
  if len(events) < 2 or calls < 2:
    return ([events] if events else []), "one window"
  gaps = sorted(range(1, len(events)), key=lambda i: events[i].start - events[i - 1].end)
  cuts = sorted(gaps[-(calls - 1):])
  return [events[a:b] for a, b in zip([0] + cuts, cuts + [len(events)])], "largest gaps"


def call_timeline(events: list[Event], gap_ns: float) -> dict:
  """One call: span (first start to last end), busy (the union of its events), the gaps between
  consecutive busy stretches (over `gap_ns`: count and total) and the largest three."""
  stretches = []  # [start, end, first event, last event]
  for e in sorted(events, key=lambda e: e.start):
    if stretches and e.start <= stretches[-1][1]:
      if e.end > stretches[-1][1]:
        stretches[-1][1], stretches[-1][3] = e.end, e
    else:
      stretches.append([e.start, e.end, e, e])
  gaps = [(b[0] - a[1], a[3].name, b[2].name) for a, b in zip(stretches, stretches[1:])]
  big = [g for g in gaps if g[0] > gap_ns]
  return {"span_ns": stretches[-1][1] - stretches[0][0], "busy_ns": sum(b - a for a, b, *_ in
                                                                         stretches),
          "kernel_ns": sum(e.end - e.start for e in events), "gaps_ns": sum(g[0] for g in gaps),
          "big_gaps": len(big), "big_gaps_ns": sum(g[0] for g in big),
          "largest": [{"us": g[0] / 1e3, "after": g[1], "before": g[2]}
                      for g in sorted(gaps, reverse=True)[:3]]}


def kernel_group(name: str) -> str:
  """A kernel's group where no HLO op names it: its name less its uniquifying numbers."""
  return re.sub(r"([._]\d+)+$", "", name)


def _sanitized(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9_]", "_", name)


def reduce_calls(trace: dict, costs: dict[str, OpCost], *, calls: int, iterations: int,
                 gap_us: float, bandwidth: float, rate: float, module: str | None = None) -> dict:
  """`read_trace`'s events reduced per iteration of one call (a call runs `iterations`): the
  kernel groups (time, count, share of the busy time, bytes, FLOPs, × their floor at `bandwidth`
  and `rate`) and the call's timeline (`call_timeline`), means over the calls kept: a call whose
  span is over OUTLIER × the median span (a profiler start-up, a host hiccup) is left out."""
  events = trace["events"]
  if module and any(e.module == module for e in events):  # other programs' work left out
    events = [e for e in events if not e.module or e.module == module]
  by_calls, split = split_calls(events, trace["windows"], calls)
  if not by_calls:
    return {"source": trace["source"], "calls": 0, "groups": [], "split": split}
  timelines = [call_timeline(call, gap_us * 1e3) for call in by_calls]
  typical = statistics.median(t["span_ns"] for t in timelines)
  traced, kept = len(timelines), [i for i, t in enumerate(timelines)
                                   if t["span_ns"] <= OUTLIER * typical]
  by_calls, timelines = [by_calls[i] for i in kept], [timelines[i] for i in kept]
  events = [e for call in by_calls for e in call]
  per = len(by_calls) * iterations
  kernel_op = {_sanitized(n): n for n in costs}

  def op_of(e: Event) -> str | None:
    # An XLA kernel is named after its op; a library kernel (cuBLAS) carries the op as hlo_op.
    for name in (kernel_op.get(_sanitized(e.name)), kernel_op.get(_sanitized(e.op or ""))):
      if name:
        return name
    return None

  kernels_of = collections.defaultdict(set)  # kernels one execution of an op launches
  for e in events:
    kernels_of[op_of(e)].add(e.name)
  groups = {}
  for e in events:
    op = op_of(e)
    key = costs[op].label if op else kernel_group(e.name)
    g = groups.setdefault(key, {"group": key, "count": 0, "ns": 0.0, "bytes": 0.0, "flops": 0.0,
                                "costed": op is not None, "gemm": bool(op and costs[op].gemm),
                                "kernels": set(), "ops": set()})
    g["count"] += 1
    g["ns"] += e.end - e.start
    g["kernels"].add(e.name)
    if op:
      g["ops"].add(op)
      g["bytes"] += costs[op].bytes / len(kernels_of[op])
      g["flops"] += costs[op].flops / len(kernels_of[op])
  mean = lambda key: statistics.mean(t[key] for t in timelines) / iterations
  busy_us = mean("busy_ns") / 1e3
  rows = []
  for g in sorted(groups.values(), key=lambda g: -g["ns"]):
    us = g["ns"] / per / 1e3
    floor_us = max(g["bytes"] / bandwidth, g["flops"] / rate) / per * 1e6 if g["costed"] else None
    rows.append({"group": g["group"], "count": g["count"] / per, "us": us,
                 "share": us / busy_us if busy_us else None,
                 "mb": g["bytes"] / per / 1e6 if g["costed"] else None,
                 "gflop": g["flops"] / per / 1e9 if g["costed"] else None,
                 "floor_us": floor_us, "x_floor": us / floor_us if floor_us else None,
                 "gemm": g["gemm"] if g["costed"] else bool(GEMM_KERNEL.search(g["group"])),
                 "costed": g["costed"], "kernels": sorted(g["kernels"])[:5],
                 "ops": len(g["ops"])})
  span_us = mean("span_ns") / 1e3
  return {"source": trace["source"], "split": split, "calls": len(by_calls),
          "calls_traced": traced,
          "iterations": iterations, "span_us": span_us, "busy_us": busy_us,
          "kernel_us": mean("kernel_ns") / 1e3, "busy_pct": 100 * busy_us / span_us,
          "gaps_us": mean("gaps_ns") / 1e3, "gap_threshold_us": gap_us,
          "big_gaps": mean("big_gaps"), "big_gaps_us": mean("big_gaps_ns") / 1e3,
          "largest_gaps": timelines[len(timelines) // 2]["largest"],
          "costed_share": sum(r["us"] for r in rows if r["costed"]) / max(
              sum(r["us"] for r in rows), 1e-9), "groups": rows}


# ---- one call ------------------------------------------------------------------------------------


def trace_call(thunk, directory: str, calls: int) -> None:
  """`calls` synced calls of `thunk` in a trace under `directory` (replaced), each annotated."""
  shutil.rmtree(directory, ignore_errors=True)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # no Python frames: less host work in the trace
  options.enable_hlo_proto = False  # the HLO text is saved beside it instead
  with jax.profiler.trace(directory, profiler_options=options):
    for i in range(calls):
      with jax.profiler.TraceAnnotation(f"{MARKER}{i}"):
        jax.block_until_ready(thunk())


def profile_part(thunk, name: str, *, iterations: int, directory: str, args, bandwidth: float,
                 rate: float) -> dict:
  """Times `thunk` (after the warm-up that compiles), traces it, reduces the trace."""
  start = time.perf_counter()
  # As bench_decode times it: a looped call alone, a direct one PART_CALLS back to back.
  seconds = harness.time_one(thunk, repeats=args.repeats, warmup=args.warmup,
                             calls=1 if iterations > 1 else bench_decode.PART_CALLS) / iterations
  compiled = time.perf_counter() - start
  text = ""
  try:
    text = thunk.compiled().as_text()
  except Exception as exc:  # the kernels still group by name; only bytes and FLOPs are lost
    print(f"    {name}: no HLO ({type(exc).__name__}: {exc}); kernels grouped by name", flush=True)
  trace_call(thunk, directory, args.trace_repeats)
  if text:
    with gzip.open(os.path.join(directory, "module.hlo.txt.gz"), "wt", encoding="utf-8") as f:
      f.write(text)
  result = reduce_calls(read_trace(directory), hlo_costs(text) if text else {},
                        calls=args.trace_repeats, iterations=iterations, gap_us=args.gap_us,
                        bandwidth=bandwidth, rate=rate, module=module_name(text) if text else None)
  result.update(part=name, timed_s=seconds, trace_dir=directory,
                warmup_and_timing_s=compiled, profile_s=time.perf_counter() - start - compiled)
  return result


def gemm_cell(result: dict, weight_floor_s: float) -> str:
  """The GEMMs' ms per iteration × their floor: the ops with a dot (their own bytes and FLOPs),
  else kernels named like a GEMM against the call's weights at the copy rate (suffix w)."""
  gemms = [r for r in result.get("groups", []) if r["gemm"]]
  if not gemms:
    return "n/a"
  us = sum(r["us"] for r in gemms)
  if all(r["costed"] for r in gemms):
    return f"{us / 1e3:.3f} ({us / sum(r['floor_us'] for r in gemms):.2f})"
  return f"{us / 1e3:.3f} ({us / (weight_floor_s * 1e6):.2f}w)"


def kernel_table(result: dict, top: int) -> list[str]:
  rows = []
  for r in result["groups"][:top]:
    rows.append([r["group"][:72], f"{r['count']:.1f}", f"{r['us']:.1f}",
                 harness.cell(100 * r["share"] if r["share"] is not None else None),
                 harness.cell(r["mb"], 2), harness.cell(r["gflop"], 3),
                 harness.cell(r["x_floor"], 2), r["kernels"][0][:40]])
  rest = result["groups"][top:]
  if rest:
    us = sum(r["us"] for r in rest)
    rows.append([f"({len(rest)} more groups)", f"{sum(r['count'] for r in rest):.1f}",
                 f"{us:.1f}", harness.cell(100 * us / result["busy_us"]), "", "", "", ""])
  return harness.format_table(["kernel group (op, shape)", "n/iter", "µs/iter", "% busy", "MB",
                               "GFLOP", "× floor", "first kernel"], rows, markdown=True)


def describe(result: dict, floor: dict | None) -> list[str]:
  lines = [f"### B={result['batch']}, {result['part']}: timed {result['timed_s'] * 1e3:.3f} ms"
           + (f" (× floor {result['timed_s'] / floor['floor_s']:.2f}, floor "
              f"{floor['floor_s'] * 1e3:.3f} ms, {floor['bound']})" if floor else "")]
  if not result["calls"]:
    return lines + [f"no events in the trace ({result['source']})"]
  lines.append(
      f"trace: {result['source']}; {result['calls']} of {result['calls_traced']} calls (split by "
      f"{result['split']}; a call over {OUTLIER}× the median span left out), "
      f"{result['iterations']} iteration(s) a call; per iteration: span "
      f"{result['span_us'] / 1e3:.3f} ms, busy {result['busy_us'] / 1e3:.3f} ms "
      f"({result['busy_pct']:.1f} %), kernels summed {result['kernel_us'] / 1e3:.3f} ms, gaps "
      f"{result['gaps_us']:.1f} µs of which {result['big_gaps']:.1f} over "
      f"{result['gap_threshold_us']} µs ({result['big_gaps_us']:.1f} µs); HLO costs cover "
      f"{100 * result['costed_share']:.0f} % of kernel time")
  if result["largest_gaps"]:
    lines.append("largest gaps (a call): " + "; ".join(
        f"{g['us']:.1f} µs after {g['after'][:40]} before {g['before'][:40]}"
        for g in result["largest_gaps"]))
  return lines + kernel_table(result, result.get("top", 20))


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.graphs and GRAPHS_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GRAPHS_FLAG).strip()
  meta, bandwidth = harness.start_run(args, batches=args.batches, context=args.context,
                                      parts=args.parts, gamma=args.gamma, graphs=args.graphs,
                                      xla_flags=os.environ.get("XLA_FLAGS", ""))
  rate = meta["matmul_tflops"] * 1e12
  target, draft = bench_decode.build_models(args.small, args.gamma)
  jax.block_until_ready(nnx.state(target))
  os.makedirs(args.out, exist_ok=True)
  results, lines = [], []
  for batch in args.batches:
    part_floors = bench_decode.floors(
        bench_decode.part_costs(target, draft, batch, args.context), bandwidth, rate)
    # No context: the bytes of the weights alone, the GEMMs' floor where no HLO op maps.
    weight_floors = bench_decode.floors(
        bench_decode.part_costs(target, draft, batch, 0), bandwidth, rate)
    direct, makers, _ = bench_decode.round_parts(
        target, draft, batch, args.context, args,
        tm.cache_slots(args.context + 2 * (args.gamma + 1)))
    for name in args.parts:
      slug = re.sub(r"[^a-z]+", "_", name)
      directory = os.path.join(args.out, "trace", f"B{batch}_{slug}")
      thunk = None
      try:
        looped = name in bench_decode.LOOPED
        thunk = makers[name]() if looped else direct([name])[name]
        result = profile_part(thunk, name, iterations=bench_decode.LOOP if looped else 1,
                              directory=directory, args=args, bandwidth=bandwidth, rate=rate)
      except Exception as exc:  # the other calls' profiles still count; the failure is reported
        traceback.print_exc()
        result = {"part": name, "calls": 0, "error": bench_decode.describe_failure(exc)}
      finally:
        thunk = None  # its caches go before the next call's are built
        gc.collect()
      result.update(batch=batch, floor=part_floors.get(name),
                    weight_floor_s=weight_floors.get(name, {}).get("bytes_s"), top=args.top)
      results.append(result)
      if "error" in result:
        print(f"  B={batch} {name}: failed: {result['error']}", flush=True)
        continue
      text = describe(result, result["floor"])
      lines += text + [""]
      print("\n".join(text) + "\n", flush=True)

  header = ["B", "call", "timed ms (× floor)", "traced span ms", "busy %",
            f"gaps > {args.gap_us} µs", "GEMMs ms (× floor)", "largest group (% busy)"]
  rows = []
  for r in results:
    if "error" in r or not r["calls"]:
      rows.append([str(r["batch"]), r["part"], r.get("error", "no events")[:40]] + [""] * 5)
      continue
    floor = r["floor"]
    timed = f"{r['timed_s'] * 1e3:.3f}" + (f" ({r['timed_s'] / floor['floor_s']:.2f})"
                                           if floor else "")
    top = r["groups"][0]
    rows.append([str(r["batch"]), r["part"], timed, f"{r['span_us'] / 1e3:.3f}",
                 f"{r['busy_pct']:.1f}", f"{r['big_gaps']:.0f} / {r['big_gaps_us']:.0f} µs",
                 gemm_cell(r, r["weight_floor_s"] or 0.0) if r["weight_floor_s"] else "n/a",
                 f"{top['group'][:40]} ({100 * top['share']:.0f})"])
  with open(os.path.join(args.out, "profile.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  title = (f"bench_profile ({meta['device_kind']}, {'small' if args.small else 'Qwen3-4B'}, "
           f"context {args.context}, γ = {args.gamma}; per iteration; floors at "
           f"{bandwidth / 1e9:.1f} GB/s and {rate / 1e12:.1f} TFLOP/s; traced with command "
           f"buffers {'on' if args.graphs else 'off (op by op)'}; traces in {args.out}/trace):")
  harness.finish(title, header, rows, meta=meta, results=results, json_path=args.json,
                 markdown=True)
  return 0 if all("error" not in r and r["calls"] for r in results) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_decode.MEM_FRACTION)
  raise SystemExit(main())
