"""The RLVR algorithm library: group advantage estimators, per-token policy losses, regularisers, token credit,
loss aggregation with global normalisers, DAPO data-side pieces, presets and metrics. Pure tensor code (no Megatron
imports); see docs/algorithms.md for every formula, config key, default and source.

Trainer entry points:

- :func:`compute_advantages` (once per step, on the global rollout batch) -> (adv_G_n, metrics)
- :func:`mastered_rollouts` -> bool [G, n] for the MCPO hinge-KL
- :func:`local_normalizer_counts` per micro-batch (or :func:`normalizer_counts_from_lengths` of the sequences),
  summed over the whole mini-batch -> :class:`LossNormalizers`
- :func:`compute_policy_loss` (per micro-batch) -> (loss, metrics)
- :func:`shape_rewards`, :func:`mask_truncated`, :func:`dynamic_sampling_keep` (DAPO)
"""

import importlib

_EXPORTS = {
    "ADVANTAGE_ESTIMATORS": "advantages",
    "AGGREGATIONS": "aggregation",
    "AdvantageConfig": "algorithm_config",
    "AggregationConfig": "algorithm_config",
    "AlgorithmConfig": "algorithm_config",
    "DapoConfig": "algorithm_config",
    "DistillConfig": "algorithm_config",
    "EntropyConfig": "algorithm_config",
    "HingeKLConfig": "algorithm_config",
    "KL_ESTIMATORS": "regularizers",
    "LossNormalizers": "aggregation",
    "MarginCreditConfig": "algorithm_config",
    "POLICY_LOSSES": "policy_losses",
    "PRESETS": "presets",
    "PolicyDriftConfig": "algorithm_config",
    "PolicyLossConfig": "algorithm_config",
    "PolicyLossInputs": "loss",
    "RefKLConfig": "algorithm_config",
    "aggregate": "aggregation",
    "compute_advantages": "advantages",
    "compute_policy_loss": "loss",
    "dynamic_sampling_keep": "dapo",
    "group_stats": "advantages",
    "hinge_kl_loss": "mcpo",
    "implied_query_weight": "mcpo",
    "local_normalizer_counts": "aggregation",
    "normalizer_counts_from_lengths": "aggregation",
    "margin_credit_weights": "margin_credit",
    "mask_truncated": "dapo",
    "mastered_rollouts": "advantages",
    "mcpo_query_scale": "mcpo",
    "overlong_penalty": "dapo",
    "preset": "presets",
    "shape_rewards": "dapo",
}
"""Public name -> submodule. Loaded on first use (PEP 562), so the torch-free configs (``.config``, ``.presets``)
import without torch."""


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
    "DistillConfig",
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
    "normalizer_counts_from_lengths",
    "overlong_penalty",
    "preset",
    "shape_rewards",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
