"""Vocab-parallel token statistics over tensor-parallel logits shards, and token-level KL estimators."""

from megatron_rlvr.ops.kl import KL_ESTIMATORS, kl_estimator
from megatron_rlvr.ops.vocab_parallel import (
    FUSED_STATISTICS_MODES,
    STAT_NAMES,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
    vocab_parallel_top2_margin,
)

__all__ = [
    "FUSED_STATISTICS_MODES",
    "KL_ESTIMATORS",
    "STAT_NAMES",
    "kl_estimator",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_logprobs",
    "vocab_parallel_token_stats",
    "vocab_parallel_top2_margin",
]
