"""The folded draft-block loop in PyTorch, captured in a CUDA graph: the comparison for bench_sampler.

This is the approach the SGLang implementation takes (SPEC §5, §9), written from the math, not from
their code: per step, gather ``W1[x_prev]``, multiply with ``W2`` (bias), add the step's base logits,
store the corrected logits in the logits dtype, then sample with the exponential race
``argmax(softmax(L / T) / E)`` using a per-step [B, V] float32 noise buffer ``E ~ Exp(1)`` (greedy rows:
``argmax(L)``). The γ steps are captured once in a ``torch.cuda.CUDAGraph`` and replayed.

`time_cuda_graph` returns the median per-replay time of back-to-back replays (CUDA events), so it is
comparable with bench_sampler's "b2b" columns. It needs torch with CUDA; `available()` says whether
this process has it.
"""

from __future__ import annotations

import statistics

import numpy as np


def available() -> bool:
  try:
    import torch
  except ImportError:
    return False
  return bool(torch.cuda.is_available())


def time_cuda_graph(w1: np.ndarray, w2: np.ndarray, base_logits: np.ndarray, anchor: np.ndarray,
                    temperature: np.ndarray, *, repeats: int = 30, warmup: int = 5,
                    replays_per_sample: int = 10) -> dict:
  """Captures and times the γ-step loop.

  Args:
    w1: [V, r] and w2: [r, V] head weights (float32 NumPy; cast to bf16 on the GPU).
    base_logits: [B, γ, V] float32 NumPy (cast to bf16).
    anchor: [B] int anchors. temperature: [B] float (0 = greedy row).

  Returns:
    {"us": median µs per replay, "tokens": [B, γ] tokens of one replay}.
  """
  import torch

  device = torch.device("cuda")
  dtype = torch.bfloat16
  w1_t = torch.as_tensor(w1, device=device).to(dtype)
  w2_t = torch.as_tensor(w2, device=device).to(dtype)
  base = torch.as_tensor(np.array(base_logits), device=device).to(dtype)
  batch, gamma, vocab = base.shape
  anchor_t = torch.as_tensor(anchor, device=device, dtype=torch.long)
  temps = torch.as_tensor(temperature, device=device, dtype=torch.float32)
  greedy = temps < 1e-5
  inv_t = 1.0 / temps.clamp_min(1e-5)

  tokens = torch.empty((batch, gamma), device=device, dtype=torch.long)
  corrected = torch.empty((batch, gamma, vocab), device=device, dtype=dtype)
  noise = torch.empty((batch, vocab), device=device, dtype=torch.float32)
  torch.cuda.manual_seed(0)  # the default CUDA generator is registered with graph capture

  def loop():
    prev = anchor_t
    for k in range(gamma):
      bias = w1_t[prev] @ w2_t                                   # [B, V] bf16 GEMM
      logits = (base[:, k].float() + bias.float()).to(dtype)
      corrected[:, k] = logits
      probs = torch.softmax(logits.float() * inv_t[:, None], dim=-1)
      noise.exponential_()
      sampled = torch.argmax(probs / noise, dim=-1)
      prev = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
      tokens[:, k] = prev

  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for _ in range(3):  # warm up allocations and kernels before capture
      loop()
  torch.cuda.current_stream().wait_stream(stream)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    loop()

  for _ in range(warmup):
    graph.replay()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays_per_sample):
      graph.replay()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) * 1e3 / replays_per_sample)   # ms -> µs
  return {"us": statistics.median(times), "tokens": tokens.cpu().numpy()}
