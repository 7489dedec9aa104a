"""dspark_jax: DSpark speculative decoding for JAX.

Public API (each name documented in its module):

* `SamplingParams` (sampling.params): per-row temperature, top-k, top-p, seed.
* `sample_step`, `row_keys`, `Stream` (sampling.sampler): one exact sampling step of a mixed batch.
* `MarkovHead`, `ConfidenceHead`, `markov_head_from_arrays`, `confidence_head_from_arrays` (draft.heads).
* `DraftBlock`, `sample_block`, `sample_block_eager` (draft.block): the γ-step block sampler.
* `FoldedSampling`, `GateDecision` (draft.memory_gate): the build-time memory gate.
* `DraftSampler`, `build_draft_sampler` (draft.proposer): the compiled, routed draft proposer.
* `target_log_probs`, `sample_target` (sampling.target_law): the target's law (temperature, top-k, top-p).
* `verify`, `AcceptResult` (verification): lossless verification of a draft block.
* `TargetModel`, `TargetConfig` (models.target), `DSparkDraft`, `DraftConfig` (models.draft), `LayerShape`
  (models.layers): the models.
* `logits` (models.target): the target's logits of a cache-free forward (Hugging Face's
  ``model(input_ids).logits``).
* `load_pretrained`, `save_pretrained` (formats.pretrained): a Hugging Face Qwen3 target and a
  DeepSpec DSpark / DFlash draft, read from and written to their directories.
* `draft_proposal` (decoding.draft_proposal): the draft block proposed after given tokens, as inside
  `generate`.
* `generate`, `GenerateResult` (decoding): speculative and autoregressive decoding as compiled loops;
  `decode`, `DecodeOutput`: the same loop as a pure function, for the user's own jit and vmap;
  `Engine`, `QueueResult`, `PromptResult` (decoding.queue): any number of prompts through S slots
  refilled as rows finish (also ``generate(..., max_batch_size=S)``).
* `schedules` (scheduling.schedules): verify-length schedules `Schedule(init, update)`: `fixed`,
  `threshold`, `prefix` (Algorithm 1), `top_k` (lagged budget); `load_sps`, `save_sps`.
* `profile_sps` (scheduling.profile): the target's verify steps per second at each verify batch
  size, the throughput table `schedules.prefix`/`top_k` read (saved with `schedules.save_sps`).
* `calibration` (scheduling.calibration): Sequential Temperature Scaling `fit_sts`; `ece`,
  `reliability`, `auc` of the cumulative survival.
* `Tokenizer`, `load_tokenizer` (text.tokenizer): a model directory's tokenizer with its special
  tokens, stop ids and chat template; `generate_text`, `TextResult` (text.generation): text in, text
  out, with stop strings.
* `load_shipped`, `load_shipped_tokenizer` (formats.shipped): the trained pair shipped in
  ``dspark_jax/assets`` and its tokenizer.
* `shard`, `make_mesh` (parallel.placement): sharded copies of a target and draft on a device mesh
  (tensor parallelism over axis "tp", replicas over "dp"); `load_pretrained(..., mesh=mesh)` loads
  straight into shards (docs/sharding.md).
* `dspark_jax.testing`: exact reference laws, chi-square, and a toy pair for distribution checks.
"""

from dspark_jax.decoding import (DecodeOutput, Engine, GenerateResult, PromptResult, QueueResult,
                                 decode, generate)
from dspark_jax.draft.block import DraftBlock, sample_block, sample_block_eager
from dspark_jax.decoding.draft_proposal import draft_proposal
from dspark_jax.draft.heads import (ConfidenceHead, MarkovHead, confidence_head_from_arrays,
                                    markov_head_from_arrays)
from dspark_jax.draft.memory_gate import FoldedSampling, GateDecision
from dspark_jax.draft.proposer import DraftSampler, build_draft_sampler
from dspark_jax.formats.pretrained import load_pretrained, save_pretrained
from dspark_jax.models.draft import DraftConfig, DSparkDraft
from dspark_jax.models.layers import LayerShape
from dspark_jax.formats.shipped import load_shipped, load_shipped_tokenizer
from dspark_jax.models.target import TargetConfig, TargetModel, logits
from dspark_jax.parallel.placement import make_mesh, shard
from dspark_jax.sampling.params import SamplingParams
from dspark_jax.sampling.sampler import Stream, row_keys, sample_step
from dspark_jax.sampling.target_law import sample_target, target_log_probs
from dspark_jax.scheduling import calibration, schedules
from dspark_jax.scheduling.profile import profile_sps
from dspark_jax.text import TextResult, Tokenizer, generate_text, load_tokenizer
from dspark_jax.verification import AcceptResult, verify

__version__ = "0.1.0"

__all__ = [
    "AcceptResult", "build_draft_sampler", "confidence_head_from_arrays", "ConfidenceHead",
    "decode", "DecodeOutput", "Engine", "PromptResult", "QueueResult", "DraftBlock",
    "DraftConfig", "DraftSampler", "DSparkDraft",
    "FoldedSampling", "GateDecision", "generate", "GenerateResult", "LayerShape", "logits",
    "markov_head_from_arrays", "MarkovHead", "row_keys", "sample_block", "sample_block_eager",
    "sample_step", "sample_target", "SamplingParams", "Stream", "target_log_probs", "TargetConfig",
    "TargetModel", "verify", "calibration", "schedules", "load_pretrained", "save_pretrained",
    "draft_proposal", "generate_text", "load_shipped", "load_shipped_tokenizer", "load_tokenizer",
    "TextResult", "Tokenizer", "profile_sps", "make_mesh", "shard",
]
