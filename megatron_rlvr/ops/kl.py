"""Token-level estimators of KL(pi || ref) from log-prob pairs (J. Schulman, "Approximating KL divergence", 2020).

With the token sampled from pi and ``log r = logp_ref - logp`` (the log ratio ref / pi):

    k1 = logp - logp_ref                      = -log r              unbiased, high variance, can be negative
    k2 = 0.5 * (logp - logp_ref) ** 2         =  0.5 * (log r)^2    biased (low for nearby policies), always >= 0
    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
                                              = (r - 1) - log r     unbiased, always >= 0, low variance

k3 is the estimator of the GRPO paper (DeepSeekMath, Shao et al. 2024, eq. 4). exp(log r) overflows when the
reference is far more likely than the policy; ``clamp`` bounds log r to ``[-clamp, clamp]`` before the
exponential, as verl's "low_var_kl" does (there clamp = 20 on log r and 10 on the result); ``clamp=None`` turns
clamping off. All estimators are differentiable w.r.t. both inputs where they require grad.
For the exact per-token KL over the vocabulary use `vocab_parallel_kl`.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_estimator"]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1(x) - x = exp(x) - 1 - x without the cancellation of exp(x) - 1 for small x.
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}
"""Registry: estimator name -> function of log r = logp_ref - logp."""


def kl_estimator(
    logp_T: torch.Tensor, logp_ref_T: torch.Tensor, kind: str = "k3", clamp: float | None = 20.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs.

    Args:
        logp_T: log pi(token) ``[T]`` (any shape; broadcast with logp_ref_T).
        logp_ref_T: log ref(token), same shape.
        kind: "k1", "k2" or "k3" (formulas in the module docstring).
        clamp: if not None, log r = logp_ref - logp is clamped to ``[-clamp, clamp]`` before the estimator (keeps
            k3's exp finite; gradient is zero where the clamp is active). Applies to every kind.

    Returns:
        ``[T]`` estimates in the promoted dtype of the inputs (at least fp32).
    """
    fn = KL_ESTIMATORS.get(kind)
    if fn is None:
        raise ValueError(f"kl_estimator kind must be one of {sorted(KL_ESTIMATORS)}, got {kind!r}")
    if not (torch.is_tensor(logp_T) and torch.is_tensor(logp_ref_T)):
        raise ValueError("kl_estimator: logp_T and logp_ref_T must be tensors")
    if logp_T.shape != logp_ref_T.shape:
        raise ValueError(f"kl_estimator: logp_T shape {tuple(logp_T.shape)} != logp_ref_T {tuple(logp_ref_T.shape)}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"kl_estimator: clamp must be > 0 or None, got {clamp!r}")
    dtype = torch.promote_types(torch.promote_types(logp_T.dtype, logp_ref_T.dtype), torch.float32)
    log_ratio = logp_ref_T.to(dtype) - logp_T.to(dtype)
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return fn(log_ratio)
