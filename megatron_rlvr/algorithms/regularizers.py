"""Reference-model KL penalty and entropy bonus (the MCPO hinge-KL lives in :mod:`.mcpo`, the CPGD drift in
:mod:`.cpgd`).

Reference KL, per token, of KL(pi || pi_ref) with samples from pi (Schulman, "Approximating KL divergence", 2020),
x = logp - logp_ref:

- ``k1``: x                                  (unbiased, high variance, can be negative)
- ``k2``: x^2 / 2                            (biased, low variance)
- ``k3``: e^{-x} - 1 + x, clamped to <= ``k3_clamp`` (unbiased, >= 0; the clamp, 10 as in verl, bounds the
          value and gradient of a token the policy has moved far from the reference)

x is clamped to [-20, 20] first (zero gradient beyond; keeps e^{-x} finite).
- ``exact``: the full-vocabulary KL(pi || pi_ref) per token, computed by the vocab-parallel ops
          (``vocab_parallel_token_stats(..., other_logits_TV=ref_logits, want=("kl",))``) and passed in as
          ``ref_kl_BT``; its gradient flows through the ops to the logits.

The loss adds ``coef * aggregate(kl_BT)``; the entropy bonus subtracts ``coef * aggregate(entropy_BT)`` (entropy
from the ops, with gradient).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from megatron_rlvr.ops.kl import kl_estimator

from .algorithm_config import KL_ESTIMATOR_NAMES, RefKLConfig, check_registry

# The estimators are the ops' (megatron_rlvr.ops.kl, pure torch); log(ref/pi) is clamped to +-20 before them (as
# verl's low_var_kl), and the k3 value additionally to <= k3_clamp.
_LOG_RATIO_CLAMP = 20.0


def kl_k1(logp_BT: Tensor, ref_logp_BT: Tensor, cfg: RefKLConfig | None = None) -> Tensor:
    return kl_estimator(logp_BT, ref_logp_BT, "k1", clamp=_LOG_RATIO_CLAMP)


def kl_k2(logp_BT: Tensor, ref_logp_BT: Tensor, cfg: RefKLConfig | None = None) -> Tensor:
    return kl_estimator(logp_BT, ref_logp_BT, "k2", clamp=_LOG_RATIO_CLAMP)


def kl_k3(logp_BT: Tensor, ref_logp_BT: Tensor, cfg: RefKLConfig | None = None) -> Tensor:
    clamp = 10.0 if cfg is None else cfg.k3_clamp
    return kl_estimator(logp_BT, ref_logp_BT, "k3", clamp=_LOG_RATIO_CLAMP).clamp(max=clamp)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor, RefKLConfig | None], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
check_registry(KL_ESTIMATORS, KL_ESTIMATOR_NAMES, "ref_kl.estimator")


def ref_kl_per_token(cfg: RefKLConfig, logp_BT: Tensor, ref_logp_BT: Tensor | None, ref_kl_BT: Tensor | None) -> Tensor:
    """Per-token KL(pi || pi_ref) [B, T] by the configured estimator."""
    if cfg.estimator == "exact":
        if ref_kl_BT is None:
            raise ValueError(
                "RefKLConfig.estimator='exact' needs ref_kl_BT (per-token full-vocabulary KL from "
                "megatron_rlvr.ops vocab_parallel_token_stats(..., want=('kl',))) in the loss inputs"
            )
        return ref_kl_BT
    if ref_logp_BT is None:
        raise ValueError(
            f"RefKLConfig.estimator={cfg.estimator!r} needs ref_logp_BT (reference log-probs) in the loss inputs"
        )
    return KL_ESTIMATORS[cfg.estimator](logp_BT, ref_logp_BT.detach(), cfg)
