"""DeepSpec's own PyTorch DSpark training step, timed at `bench_train`'s shapes: the baseline for it.

What this owns: building DeepSpec's drafter and a random transformers target, running one training
step of DeepSpec's code, timing it and counting its FLOPs as `bench_train` does. DeepSpec
(github.com/deepseek-ai/DeepSpec, the paper authors' code) is not part of this repository: pass a
copy of its files with ``--deepspec DIR``; DIR goes on ``sys.path`` and everything of DeepSpec is
imported from there, lazily (this module imports without it). Needs only torch, transformers and
numpy (plus PyYAML, which transformers requires); JAX is not imported.

Shapes (default): a ``Qwen3ForCausalLM`` with random bf16 weights of the Qwen3-4B shape (36 layers,
E 2560, SwiGLU 9728, 32 / 8 heads of 128, V 151936, tied embeddings), frozen, and DeepSpec's
``Qwen3DSparkModel`` built by its ``build_draft_config`` from its recipe
``config/dspark/dspark_qwen3_4b.py`` (read from DIR: 5 layers reading target layers 1, 9, 17, 25, 33,
block 7, vanilla Markov head r = 256, confidence head with the Markov features, loss 0.1·CE +
0.9·TV + 1.0·BCE with position weights exp(-(k-1)/4), AdamW lr 6e-4, weight decay 0, clipping 1.0,
bf16, ``torch_compile=True``), embedding and LM head copied from the target and frozen by
DeepSpec's ``initialize_embeddings_and_head``. ``--batch`` sequences of ``--seq-len`` random tokens,
every position a response token (loss mask all ones), ``--anchors`` blocks each (the recipe's
``num_anchors`` overridden). Defaults: DeepSpec's Qwen3-4B recipe per device, one sequence of 4096
tokens, 512 anchors. ``--small``: `bench_decode`'s tiny pair (2-layer target, E 32, V 512; a
1-layer draft reading the embedding output and layer 0, r = 32), 2 x 64 tokens, 8 anchors.

The step, DeepSpec's pieces called as they are:

1. the target's features: ``run_target_forward_with_hooks`` of DeepSpec's
   ``scripts/data/prepare_target_cache.py`` (the target backbone's sdpa forward, no grad, hooks on
   the feature layers; its ``last_hidden_state`` is what the draft's loss reads the target's law
   from). DeepSpec's trainer does not run the target: it reads these tensors from a target cache
   written offline by that script (about 38 TB for the Qwen3-4B recipe). Here they are computed
   on the fly inside the timed step, as `bench_train` computes its target's forward every step;
2. ``Qwen3DSparkModel.forward`` (its anchor sampling ``sample_anchor_positions``, flex-attention
   block mask, blocks, the target's logits at the gathered positions through the frozen LM head)
   and ``compute_dspark_loss``: exactly ``Qwen3DSparkTrainer.run_batch``'s two calls, with the
   recipe's loss weights. The draft is wrapped in ``torch.compile(dynamic=True)`` as DeepSpec's
   ``BaseTrainer`` does when the recipe says ``torch_compile`` (``--no-compile``: eager);
3. ``loss.backward()``, gradient clipping to the recipe's ``max_grad_norm``, and DeepSpec's
   ``BF16Optimizer.step`` (float32 master copies, ``torch.optim.AdamW`` with the recipe's lr and
   weight decay, its warmup-cosine schedule, the bf16 parameters written back).

Attention: DeepSpec trains only with flex attention (``TRAIN_ATTN_IMPLEMENTATION`` in its Qwen3
draft config; the mask is a flex ``BlockMask``), so that is what runs; it offers no sdpa/eager
training path. The target runs with sdpa, as DeepSpec's cache writer loads it. No DeepSpec import
is stubbed and none of its code is patched; two things are ours:

* a single-process ``gloo`` process group (an in-memory store, no network): DeepSpec's loss reads
  ``dist.get_world_size()`` (1 here, so it reduces nothing);
* CPU ONLY (any device but CUDA, i.e. the ``--small`` smoke check): torch's flex attention has no
  backward on the CPU, so there the draft's attention is transformers' sdpa over the dense mask
  that DeepSpec's own ``BlockMask`` describes (`cpu_attention`). On a GPU, DeepSpec's flex
  attention runs unchanged; the record's ``attention`` says which ran.

Where this differs from ``train.py`` (``BaseTrainer.train``) and why:

* target features computed in the step (above) instead of read from disk through DeepSpec's
  ``CacheDataset`` / ``CUDAPrefetcher``: the same work as `bench_train`, and no 38 TB cache;
* no FSDP wrapper: the recipe's ``no_shard`` FSDP on one device has nothing to shard or reduce; its
  ``MixedPrecision`` casts to bf16, which the parameters already are. Gradients are clipped with
  ``torch.nn.utils.clip_grad_norm_`` (what ``FSDP.clip_grad_norm_`` computes on one rank);
* one optimizer step per micro-batch: the recipe accumulates gradients to a global batch of 512
  sequences (64 micro-batches per optimizer step on 8 GPUs); like `bench_train` this times
  forward, backward and the optimizer step together every step;
* metrics: DeepSpec's ``add_metric`` buffers are cleared after each step (the trainer flushes them
  every ``logging_steps``) instead of being all-gathered and printed; checkpointing, logging, the
  data loader and the tokenizer are left out; the draft is randomly initialised
  (``post_init``), not loaded.

Reported (median of ``--repeats`` steps after ``--warmup``; each step ends with
``torch.cuda.synchronize``, on the CPU wall time): sequence tokens/s (``batch·seq_len`` per step),
block tokens/s (``batch·anchors·γ``), model FLOPs counted exactly as `bench_train` counts them
(target ``2·P_t·B·L``, P_t its layers plus the LM head; draft ``6·P_d·B·A·γ``, P_d its layers,
``fc``, the LM head and the Markov head's W2; attention not counted, so the MFU is a lower bound;
the same count as `bench_train`'s although DeepSpec applies the target's LM head only at the
``B·A·γ`` gathered positions, not at all ``B·L``), MFU against this run's bf16 matmul rate (a
[n, n] bf16 product timed with torch: n = 8192 on a GPU, 1024 on a CPU, 256 with ``--small``), and
peak memory (``torch.cuda.max_memory_allocated`` from the built models on: their weights, the
optimizer state, the step's activations; not the transient of initialising the weights). The
record holds the date, the device, versions, this repository's commit and the DeepSpec commit
(``--deepspec-commit``, else ``git`` in DIR's own ``.git``, else "unknown").

  python -m benchmarks.bench_train_deepspec --small --deepspec _deepspec     # CPU smoke check
  python -m benchmarks.bench_train_deepspec --deepspec _deepspec --deepspec-commit SHA --json out.json
  python -m benchmarks.bench_train_deepspec --deepspec _deepspec --batch 2 --seq-len 2048 --anchors 64
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

RECIPE = os.path.join("config", "dspark", "dspark_qwen3_4b.py")
"""DeepSpec's Qwen3-4B DSpark recipe, relative to ``--deepspec``."""
CACHE_WRITER = os.path.join("scripts", "data", "prepare_target_cache.py")
"""DeepSpec's target-cache writer, relative to ``--deepspec``: its target forward is called."""
TOTAL_STEPS = 1000
"""Length of the optimizer's schedule (its warmup is the recipe's ratio of it): only the learning
rate's value depends on it, not the step's work."""
MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
SMALL_MATMUL_SIZE = 256

TARGET_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
"""Qwen3-4B's shape (its config.json), as `bench_decode`'s default target has it."""
TARGET_SMALL = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    max_position_embeddings=256, tie_word_embeddings=True)
"""`bench_decode`'s ``--small`` target."""
DRAFT_SMALL = dict(num_draft_layers=1, target_layer_ids=[-1, 0], markov_rank=32,
                   mask_token_id=TARGET_SMALL["vocab_size"] - 1)
"""`bench_decode`'s ``--small`` draft, as overrides of the recipe's model fields."""
DTYPES = ("bf16", "f32")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--deepspec", required=True, metavar="DIR",
                      help="a copy of DeepSpec's files (holding deepspec/, config/, scripts/data/)")
  parser.add_argument("--deepspec-commit", default=None,
                      help="the DeepSpec commit DIR holds (default: git in DIR, else unknown)")
  parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 1)")
  parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (4096)")
  parser.add_argument("--anchors", type=int, default=None, help="blocks per sequence (512)")
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes: a smoke check that takes seconds on a CPU")
  parser.add_argument("--repeats", type=int, default=None, help="timed steps (5; --small: 3)")
  parser.add_argument("--warmup", type=int, default=None,
                      help="untimed steps first (2; --small: 1); the first compiles")
  parser.add_argument("--device", default=None, help="torch device (default cuda if available)")
  parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                      help="weights and activations (DeepSpec's precision; default bf16)")
  parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                      help="torch.compile the draft as DeepSpec's trainer does (default: the "
                      "recipe's torch_compile; off with --small)")
  parser.add_argument("--json", metavar="PATH", help="also write the record and result to PATH")
  args = parser.parse_args(argv)
  args.batch = args.batch or (2 if args.small else 1)
  args.seq_len = args.seq_len or (64 if args.small else 4096)
  args.anchors = args.anchors or (8 if args.small else 512)
  args.repeats = args.repeats or (3 if args.small else 5)
  args.warmup = args.warmup or (1 if args.small else 2)
  if min(args.batch, args.seq_len, args.anchors, args.repeats, args.warmup) < 1:
    parser.error("--batch, --seq-len, --anchors, --repeats and --warmup: each must be >= 1")
  if not os.path.isdir(os.path.join(args.deepspec, "deepspec")):
    parser.error(f"--deepspec: {args.deepspec!r} holds no deepspec/ package")
  return args


# ---- DeepSpec, imported from --deepspec ----------------------------------------------------------


def import_deepspec(directory: str) -> SimpleNamespace:
  """DeepSpec's pieces this step calls, imported from `directory` (put first on ``sys.path``)."""
  directory = os.path.abspath(directory)
  if directory not in sys.path:
    sys.path.insert(0, directory)
  from deepspec.modeling.dspark import loss
  from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config
  from deepspec.utils import config, metrics, optim

  # A script, not a module of the package: loaded from its file (it sets the same process-wide
  # options as DeepSpec's train.py: USE_TORCH and friends, float32 matmul precision "high").
  spec = importlib.util.spec_from_file_location("deepspec_prepare_target_cache",
                                                os.path.join(directory, CACHE_WRITER))
  cache_writer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cache_writer)
  return SimpleNamespace(Qwen3DSparkModel=Qwen3DSparkModel, build_draft_config=build_draft_config,
                         compute_dspark_loss=loss.compute_dspark_loss,
                         BF16Optimizer=optim.BF16Optimizer, to_config_node=config.to_config_node,
                         reset_metrics=metrics.reset,
                         target_forward=cache_writer.run_target_forward_with_hooks)


def read_recipe(directory: str) -> dict[str, dict]:
  """The literal fields of the recipe's ``model`` and ``train`` dicts (`RECIPE`), read without
  running it (it imports DeepSpec's trainer, which needs tensorboard)."""
  with open(os.path.join(directory, RECIPE), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  recipe = {}
  for node in tree.body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("model", "train")
        and isinstance(node.value, ast.Call)):
      fields = {}
      for keyword in node.value.keywords:
        try:
          fields[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:  # e.g. trainer_cls: a class, not a value this step reads
          pass
      recipe[node.targets[0].id] = fields
  missing = {"model", "train"} - set(recipe)
  if missing:
    raise ValueError(f"{RECIPE}: no {' or '.join(sorted(missing))} dict found")
  return recipe


def deepspec_commit(args: argparse.Namespace) -> str:
  """``--deepspec-commit``, else the HEAD of DIR's own ``.git`` (not of a repository around DIR),
  else "unknown"."""
  if args.deepspec_commit:
    return args.deepspec_commit
  if os.path.exists(os.path.join(args.deepspec, ".git")):
    return _git_head(args.deepspec) or "unknown"
  return "unknown"


def _git_head(directory: str) -> str | None:
  try:
    return subprocess.run(["git", "-C", directory, "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def init_process_group() -> None:
  """A one-process ``gloo`` group on an in-memory store (DeepSpec's loss asks its world size)."""
  import torch.distributed as dist
  if not dist.is_initialized():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# ---- the models ---------------------------------------------------------------------------------


def torch_dtype(name: str):
  import torch
  return {"bf16": torch.bfloat16, "f32": torch.float32}[name]


@contextlib.contextmanager
def _building(device, dtype):
  """New tensors on `device` in `dtype` (as ``from_pretrained(dtype=...)`` builds a model)."""
  import torch
  previous = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      yield
  finally:
    torch.set_default_dtype(previous)


def build_target(small: bool, device, dtype):
  """A frozen random ``Qwen3ForCausalLM`` (`TARGET_4B` or `TARGET_SMALL`), sdpa attention, built on
  `device` in `dtype`."""
  import torch
  import transformers
  config = transformers.Qwen3Config(**(TARGET_SMALL if small else TARGET_4B))
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  with _building(device, dtype):
    target = transformers.Qwen3ForCausalLM(config)
  return target.eval().requires_grad_(False)


def model_args(ds: SimpleNamespace, recipe: dict, args: argparse.Namespace):
  """The recipe's model fields (`DRAFT_SMALL` over them with ``--small``), ``--anchors`` anchors,
  as the attribute-and-``in`` node DeepSpec's config builder reads."""
  fields = dict(recipe["model"], num_anchors=args.anchors)
  if args.small:
    fields.update(DRAFT_SMALL)
  return ds.to_config_node(fields)


def build_draft(ds: SimpleNamespace, target, fields, device, dtype):
  """DeepSpec's draft (``build_draft_config`` of the target's config, ``Qwen3DSparkModel``), its
  embedding and LM head the target's, frozen (``initialize_embeddings_and_head``), in training
  mode on `device` in `dtype`. Off CUDA its attention is `CPU_ATTENTION` (`cpu_attention`)."""
  import torch
  config = ds.build_draft_config(target_config=target.config, model_args=fields)
  if device.type != "cuda":
    register_cpu_attention()
    config._attn_implementation = CPU_ATTENTION
  torch.manual_seed(1)
  with torch.device(device):
    draft = ds.Qwen3DSparkModel(config)
  draft = draft.to(device=device, dtype=dtype)
  draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                       lm_head=target.get_output_embeddings(), freeze=True)
  return draft.train()


# ---- CPU ONLY: not DeepSpec's attention --------------------------------------------------------
# torch's flex attention has no backward on the CPU ("FlexAttention does not support backward on
# CPU"), and DeepSpec trains only with flex attention. So that the --small smoke check runs on a
# CPU, there (and only off CUDA) the draft's attention is sdpa over the dense mask that DeepSpec's
# own BlockMask describes (its mask_mod evaluated at every query and key). On a GPU DeepSpec's flex
# attention runs unchanged; the record says which ran ("attention").

CPU_ATTENTION = "bench_train_deepspec_cpu_dense_sdpa"


def cpu_attention(module, query, key, value, attention_mask, **kwargs):
  """transformers' sdpa attention with the element mask of the flex ``BlockMask``
  `attention_mask` (fully masked rows, DeepSpec's dropped blocks, give NaN here; flex gives 0)."""
  from torch.nn.attention.flex_attention import create_mask
  from transformers.integrations.sdpa_attention import sdpa_attention_forward
  mask = create_mask(attention_mask.mask_mod, query.shape[0], None, query.shape[-2],
                     key.shape[-2], device=query.device)
  return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def register_cpu_attention() -> None:
  from transformers import AttentionInterface
  AttentionInterface.register(CPU_ATTENTION, cpu_attention)


def _elements(*modules) -> int:
  return int(sum(p.numel() for module in modules for p in module.parameters()))


def model_flops(target, draft, batch: int, length: int, anchors: int) -> dict[str, float]:
  """`bench_train.model_flops` of these models: ``{"target", "draft", "total"}``, with P_t the
  target's layers plus its LM head, P_d the draft's layers, ``fc``, LM head and Markov W2."""
  head = target.get_output_embeddings().weight.numel()
  target_params = _elements(target.model.layers) + head
  draft_params = (_elements(draft.layers, draft.fc) + draft.lm_head.weight.numel()
                  + draft.markov_head.markov_w2.weight.numel())
  out = {"target": 2.0 * target_params * batch * length,
         "draft": 6.0 * draft_params * batch * anchors * draft.block_size,
         "target_params": target_params, "draft_params": draft_params}
  out["total"] = out["target"] + out["draft"]
  return out


# ---- the step -----------------------------------------------------------------------------------


def build_step(ds: SimpleNamespace, recipe: dict, target, draft, batch: int, length: int,
               compile_draft: bool):
  """A thunk running one training step (module docstring) on random tokens, returning the loss."""
  import torch
  model_fields, train = recipe["model"], recipe["train"]
  device = next(draft.parameters()).device
  generator = torch.Generator().manual_seed(0)
  input_ids = torch.randint(0, target.config.vocab_size - 1, (batch, length),
                            generator=generator).to(device)
  attention_mask = torch.ones((batch, length), dtype=torch.long, device=device)
  loss_mask = torch.ones((batch, length), dtype=torch.uint8, device=device)
  model = torch.compile(draft, dynamic=True) if compile_draft else draft
  optimizer = ds.BF16Optimizer(draft, lr=float(train["lr"]), total_steps=TOTAL_STEPS,
                               warmup_ratio=float(train["warmup_ratio"]),
                               weight_decay=float(train["weight_decay"]))
  trainable = [p for p in draft.parameters() if p.requires_grad]

  def step():
    features = ds.target_forward(target_model=target.model, input_ids=input_ids,
                                 attention_mask=attention_mask,
                                 target_layer_ids=draft.target_layer_ids)
    outputs = model(input_ids=input_ids, target_hidden_states=features.target_hidden_states,
                    loss_mask=loss_mask,
                    target_last_hidden_states=features.target_last_hidden_states)
    loss = ds.compute_dspark_loss(
        outputs=outputs, loss_decay_gamma=model_fields["loss_decay_gamma"],
        ce_loss_alpha=float(model_fields["ce_loss_alpha"]),
        l1_loss_alpha=float(model_fields["l1_loss_alpha"]),
        confidence_head_alpha=float(model_fields["confidence_head_alpha"]))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, float(train["max_grad_norm"]))
    optimizer.step()
    ds.reset_metrics()
    return float(loss.detach()), float(grad_norm)

  return step


def synchronizer(device):
  import torch
  if device.type == "cuda":
    return lambda: torch.cuda.synchronize(device)
  return lambda: None


def time_steps(step, sync, *, repeats: int, warmup: int) -> tuple[float, list[float], float]:
  """(median seconds per step, every timed sample, the last loss): `warmup` untimed steps, then
  `repeats` steps, each timed alone between two device syncs."""
  for _ in range(warmup):
    step()
  sync()
  samples, loss = [], float("nan")
  for _ in range(repeats):
    start = time.perf_counter()
    loss, _ = step()
    sync()
    samples.append(time.perf_counter() - start)
  return statistics.median(samples), samples, loss


def matmul_rate(device, n: int) -> float:
  """This device's bf16 matrix rate in FLOP/s: ``2·n³`` over the median of 5 samples of 10
  back-to-back [n, n] @ [n, n] bf16 products (after 2 untimed), as `harness.matmul_rate` times."""
  import torch
  sync = synchronizer(device)
  generator = torch.Generator().manual_seed(0)
  a, b = (torch.randn((n, n), generator=generator).to(device, torch.bfloat16) for _ in range(2))
  for _ in range(2):
    torch.matmul(a, b)
  sync()
  samples = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(10):
      torch.matmul(a, b)
    sync()
    samples.append((time.perf_counter() - start) / 10)
  return 2 * n**3 / statistics.median(samples)


# ---- the record ---------------------------------------------------------------------------------


def device_name(device) -> str:
  import torch
  if device.type == "cuda":
    return torch.cuda.get_device_name(device)
  return f"{device.type} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def metadata(args: argparse.Namespace, device, compile_draft: bool) -> dict:
  import torch
  import transformers
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return {
      "device": device_name(device), "torch": torch.__version__,
      "transformers": transformers.__version__, "python": sys.version.split()[0],
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "git_commit": _git_head(repo) or os.environ.get("GIT_COMMIT", "unknown"),
      "deepspec_commit": deepspec_commit(args), "deepspec_dir": os.path.abspath(args.deepspec),
      "batch": args.batch, "seq_len": args.seq_len, "anchors": args.anchors,
      "dtype": args.dtype, "compile": compile_draft, "small": args.small,
      "repeats": args.repeats, "warmup": args.warmup,
  }


def describe_failure(exc: BaseException) -> str:
  """One line: the exception's type and its message's first line."""
  text = str(exc).strip().splitlines()
  return f"{type(exc).__name__}: {text[0] if text else ''}"


def format_table(header: list[str], rows: list[list[str]]) -> list[str]:
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
  return [line(header), "-" * len(line(header))] + [line(r) for r in rows]


def _size(nbytes: int) -> str:
  return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def run(args: argparse.Namespace, ds: SimpleNamespace, recipe: dict, device, meta: dict) -> dict:
  """Builds the models, times the step; the result (``error`` set where a part failed)."""
  import torch
  dtype = torch_dtype(args.dtype)
  result = {"seconds": None, "samples": None, "loss": None, "model_flops": None,
            "peak_bytes": None, "error": None}
  try:
    target = build_target(args.small, device, dtype)
    draft = build_draft(ds, target, model_args(ds, recipe, args), device, dtype)
    meta["attention"] = draft.config._attn_implementation
    if device.type == "cuda":  # the peak from here: the models as built, then the steps
      torch.cuda.reset_peak_memory_stats(device)
    result["model_flops"] = flops = model_flops(target, draft, args.batch, args.seq_len,
                                                args.anchors)
    print(f"P_t {flops['target_params']:,}, P_d {flops['draft_params']:,} parameters; model FLOPs "
          f"per step {flops['total'] / 1e12:.3f} T (target {flops['target'] / 1e12:.3f}, draft "
          f"{flops['draft'] / 1e12:.3f}); draft attention {meta['attention']}", flush=True)
    step = build_step(ds, recipe, target, draft, args.batch, args.seq_len, meta["compile"])
    seconds, samples, loss = time_steps(step, synchronizer(device), repeats=args.repeats,
                                        warmup=args.warmup)
    result.update(seconds=seconds, samples=samples, loss=loss)
    print(f"step times (s): {', '.join(f'{t:.4f}' for t in samples)}; last loss {loss:.4f}",
          flush=True)
  except Exception as exc:  # noqa: BLE001 - reported (e.g. out of memory), not raised
    import traceback
    traceback.print_exc()
    result["error"] = describe_failure(exc)
  if device.type == "cuda":
    result["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
  if result["seconds"] is not None:
    seconds = result["seconds"]
    result.update(sequence_tokens_per_s=args.batch * args.seq_len / seconds,
                  block_tokens_per_s=args.batch * args.anchors * meta["gamma"] / seconds,
                  mfu=result["model_flops"]["total"] / seconds / (meta["matmul_tflops"] * 1e12))
  return result


def main(argv=None) -> int:
  args = parse_args(argv)
  import torch
  device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
  ds = import_deepspec(args.deepspec)
  recipe = read_recipe(args.deepspec)
  compile_draft = (args.compile if args.compile is not None
                   else bool(recipe["train"].get("torch_compile")) and not args.small)
  init_process_group()
  meta = metadata(args, device, compile_draft)
  meta["gamma"] = int(recipe["model"]["block_size"])
  print(f"device {meta['device']}; torch {meta['torch']}; transformers {meta['transformers']}; "
        f"{meta['date_utc']}; commit {meta['git_commit']}; DeepSpec {meta['deepspec_commit']}",
        flush=True)
  n = SMALL_MATMUL_SIZE if args.small else MATMUL_SIZE.get(device.type, MATMUL_SIZE["cuda"])
  meta["matmul_tflops"] = matmul_rate(device, n) / 1e12
  print(f"bf16 matmul ({n}^3) {meta['matmul_tflops']:.1f} TFLOP/s; draft compiled: "
        f"{compile_draft}; median of {args.repeats} steps after {args.warmup}", flush=True)
  result = run(args, ds, recipe, device, meta)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"meta": meta, "results": result}, f, indent=2)
      f.write("\n")
  cell = lambda key, fmt: "-" if result.get(key) is None else fmt.format(result[key])
  flops = result["model_flops"]
  rows = [[str(args.batch), str(args.seq_len), str(args.anchors), str(meta["gamma"]),
           cell("seconds", "{:.4f}"), cell("sequence_tokens_per_s", "{:.0f}"),
           cell("block_tokens_per_s", "{:.0f}"),
           "-" if flops is None else f"{flops['total'] / 1e12:.2f}", cell("mfu", "{:.3f}"),
           "-" if result["peak_bytes"] is None else _size(result["peak_bytes"]),
           (result["error"] or "")[:40]]]
  print()
  print(f"bench_train_deepspec ({meta['device']}; one DeepSpec DSpark training step, "
        f"{args.dtype}, compiled {compile_draft}, {meta.get('attention', '?')}; MFU against this run's bf16 matmul rate "
        f"{meta['matmul_tflops']:.1f} TFLOP/s; DeepSpec {meta['deepspec_commit'][:12]})")
  for text in format_table(["B", "L", "A", "γ", "s/step", "seq tok/s", "block tok/s", "TFLOP",
                            "MFU", "peak", "error"], rows):
    print(text)
  sys.stdout.flush()
  import torch.distributed as dist
  dist.destroy_process_group()
  return int(result["error"] is not None)


if __name__ == "__main__":
  raise SystemExit(main())
