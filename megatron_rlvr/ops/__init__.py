"""Vocab-parallel token statistics over tensor-parallel logits shards, and token-level KL estimators."""

from megatron_rlvr.ops.kl import KL_ESTIMATORS, kl_estimator
from megatron_rlvr.ops.vocab_parallel import (
    FUSED_STATISTICS_MODES,
    STAT_NAMES,
    get_fused_statistics,
    set_fused_statistics,
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
    "get_fused_statistics",
    "kl_estimator",
    "set_fused_statistics",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_logprobs",
    "vocab_parallel_token_stats",
    "vocab_parallel_top2_margin",
]
