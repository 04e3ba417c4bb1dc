"""Rollout: generation engines fed by resharded trainer weights.

- ``engine``: the RolloutEngine interface, SamplingParams / Completion / RolloutOutput, and the log-prob convention
  (log_softmax(logits / T) over the full vocabulary, what the trainer recomputes).
- ``hf_engine``: the transformers engine (CPU in CI, numerical reference on GPU).
- ``vllm_engine``: the colocated vLLM engine (GPU; vllm==0.33.0; imported lazily, CPU machines never import vllm);
  ``vllm_platform``: what it needs of the vLLM platform.
- ``weight_stream``: megatron TP x PP shards -> full HF-named tensors in byte-bounded buckets, via the models
  package's single weight-mapping table.
- ``groups``: the rollout half of a step: prompts -> this rank's engine's share (``data.shard_range``) -> samples ->
  rewards -> all groups on every rank.
- ``mismatch``: train/inference mismatch metrics and optional corrections (truncated IS, ratio masking).
"""

from megatron_rlvr.rollout.engine import Completion, RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["Completion", "RolloutEngine", "RolloutOutput", "SamplingParams"]
