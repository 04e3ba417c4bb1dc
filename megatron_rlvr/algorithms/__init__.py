"""The RLVR algorithm library: group advantage estimators, per-token policy losses, regularisers, token credit,
loss aggregation with global normalisers, DAPO data-side pieces, presets and metrics. Pure tensor code (no Megatron
imports); see docs/algorithms.md for every formula, config key, default and source.

Trainer entry points:

- :func:`compute_advantages` (once per step, on the global rollout batch) -> (adv_G_n, metrics)
- :func:`mastered_rollouts` -> bool [G, n] for the MCPO hinge-KL
- :func:`local_normalizer_counts` per micro-batch, summed + all-reduced once -> :class:`LossNormalizers`
- :func:`compute_policy_loss` (per micro-batch) -> (loss, metrics)
- :func:`shape_rewards`, :func:`mask_truncated`, :func:`dynamic_sampling_keep` (DAPO)
"""

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages, group_stats, mastered_rollouts
from .aggregation import AGGREGATIONS, AggregationConfig, LossNormalizers, aggregate, local_normalizer_counts
from .config import AlgorithmConfig
from .cpgd import PolicyDriftConfig
from .dapo import DapoConfig, dynamic_sampling_keep, mask_truncated, overlong_penalty, shape_rewards
from .loss import PolicyLossInputs, compute_policy_loss
from .margin_credit import MarginCreditConfig, margin_credit_weights
from .mcpo import HingeKLConfig, hinge_kl_loss, implied_query_weight, mcpo_query_scale
from .policy_losses import POLICY_LOSSES, PolicyLossConfig
from .presets import PRESETS, preset
from .regularizers import KL_ESTIMATORS, EntropyConfig, RefKLConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "AdvantageConfig",
    "AggregationConfig",
    "AlgorithmConfig",
    "DapoConfig",
    "EntropyConfig",
    "HingeKLConfig",
    "LossNormalizers",
    "MarginCreditConfig",
    "PolicyDriftConfig",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "RefKLConfig",
    "aggregate",
    "compute_advantages",
    "compute_policy_loss",
    "dynamic_sampling_keep",
    "group_stats",
    "hinge_kl_loss",
    "implied_query_weight",
    "local_normalizer_counts",
    "margin_credit_weights",
    "mask_truncated",
    "mastered_rollouts",
    "mcpo_query_scale",
    "overlong_penalty",
    "preset",
    "shape_rewards",
]
