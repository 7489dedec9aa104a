"""dspark_jax: DSpark speculative decoding for JAX.

Public API (each name documented in its module):

* `SamplingParams` (sampling_params): per-row temperature, top-k, top-p, seed.
* `sample_step`, `row_keys`, `Stream` (sampling): one exact sampling step of a mixed batch.
* `MarkovHead`, `ConfidenceHead`, `markov_head_from_arrays`, `confidence_head_from_arrays` (heads).
* `DraftBlock`, `sample_block`, `sample_block_eager` (proposal): the γ-step block sampler.
* `FoldedSampling`, `GateDecision` (memory_gate): the build-time memory gate.
* `DraftSampler`, `build_draft_sampler` (draft_sampler): the compiled, routed draft proposer.
* `target_log_probs`, `sample_target` (target_law): the target's law (temperature, top-k, top-p).
* `verify`, `AcceptResult` (verification): lossless verification of a draft block.
* `TargetModel`, `TargetConfig` (target_model), `DSparkDraft`, `DraftConfig` (draft_model), `LayerShape`
  (layers): the models.
* `generate`, `GenerateResult` (decoding): speculative and autoregressive decoding as compiled loops.
* `law_checks`, `toy_markov`: exact reference laws, chi-square, and a toy pair for distribution checks.
"""

from dspark_jax.decoding import GenerateResult, generate
from dspark_jax.draft_model import DraftConfig, DSparkDraft
from dspark_jax.draft_sampler import DraftSampler, build_draft_sampler
from dspark_jax.layers import LayerShape
from dspark_jax.heads import (ConfidenceHead, MarkovHead, confidence_head_from_arrays,
                              markov_head_from_arrays)
from dspark_jax.memory_gate import FoldedSampling, GateDecision
from dspark_jax.proposal import DraftBlock, sample_block, sample_block_eager
from dspark_jax.sampling import Stream, row_keys, sample_step
from dspark_jax.sampling_params import SamplingParams
from dspark_jax.target_law import sample_target, target_log_probs
from dspark_jax.target_model import TargetConfig, TargetModel
from dspark_jax.verification import AcceptResult, verify

__version__ = "0.1.0"

__all__ = [
    "AcceptResult", "ConfidenceHead", "DSparkDraft", "DraftConfig", "GenerateResult", "LayerShape",
    "TargetConfig", "TargetModel", "generate", "DraftBlock", "DraftSampler", "FoldedSampling", "GateDecision", "MarkovHead",
    "SamplingParams", "Stream", "build_draft_sampler", "confidence_head_from_arrays",
    "markov_head_from_arrays", "row_keys", "sample_block", "sample_block_eager", "sample_step",
    "sample_target", "target_log_probs", "verify",
]
