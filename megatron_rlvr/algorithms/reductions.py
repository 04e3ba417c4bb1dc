"""How each loss metric is reduced over micro-batches, data-parallel ranks and mini-batch updates: one explicit
table, read by :func:`reduction_of`. What a key reduces as never depends on which modules were imported.

Kinds:
- ``mean`` (every key not in the table): mean over micro-batches and ranks weighted by each micro-batch's valid
  tokens (``loss/num_tokens``), e.g. clip fractions, entropy, approx KL.
- ``share``: the micro-batch's share of a loss normalised by GLOBAL token / sequence counts (algorithms.aggregation):
  summed over micro-batches and ranks within an update, averaged over updates (``loss/policy``, ``loss/num_tokens``).
- ``max`` / ``min``: the extreme over everything (``loss/ratio_max``, non-finite flags).

A new metric that is not a token-weighted mean gets a line here (``tests/unit/test_algorithms_reductions.py`` checks
each key against the module that emits it, and that a ``*_max`` / ``*_min`` key takes the extreme). Torch-free.
"""

from __future__ import annotations

from types import MappingProxyType

KINDS = ("mean", "share", "max", "min")

REDUCTIONS: MappingProxyType[str, str] = MappingProxyType(
    {
        # algorithms/loss.py: loss terms normalised by global counts add up over micro-batches and ranks
        "loss/policy": "share",
        "loss/total": "share",
        "loss/ref_kl": "share",
        "loss/entropy_bonus": "share",
        "loss/num_tokens": "share",
        "drift/kl": "share",
        "loss/distill": "share",
        "loss/ratio_max": "max",
        "loss/ratio_min": "min",
        # algorithms/mcpo.py: normalised by the global count of mastered sequences
        "mcpo/hinge_kl": "share",
        # algorithms/margin_credit.py
        "credit/weight_max": "max",
        # algorithms/metrics.py (advantage_metrics)
        "focal/weight_min": "min",
        # rollout/mismatch.py (mismatch_metrics)
        "mismatch/abs_prob_diff_max": "max",
        "mismatch/ratio_max": "max",
        "mismatch/ratio_min": "min",
        # trainer: ratio diagnostics, and one non-finite micro-batch flags the step
        "ratio/abs_log_ratio_max": "max",
        "async/staleness_max": "max",
        "moe/expert_bias_abs_max": "max",
        "moe/load_imbalance_max": "max",
        "async/sample_version_min": "min",
        "train/nonfinite": "max",
        # trainer: response lengths of the step's batch
        "response/length_max": "max",
        "response/length_min": "min",
        # trainer: multi-turn trajectories of the step's batch
        "agent/turns_max": "max",
    }
)
"""Every metric key that is not a token-weighted mean, with its reduction."""


def reduction_of(key: str) -> str:
    """The reduction of a metric key: its entry in :data:`REDUCTIONS`, else ``mean``."""
    return REDUCTIONS.get(key, "mean")
