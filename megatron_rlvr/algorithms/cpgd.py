"""CPGD: Clipped Policy Gradient optimisation with policy Drift (Liu et al., "CPGD: Toward Stable Rule-based
Reinforcement Learning for Language Models", arXiv 2505.12504; reference code github.com/ModalMinds/MM-EUREKA).

Three pieces:

1. Advantage weights (applied to the group-centred reward r - mean):
   - ``equal``:            A = r - mean
   - ``std``:              A = (r - mean) / (std + 1e-9)
   - ``clip_filter_like``: A = (r - mean) * w, one w for all groups of the batch: if some of the B groups have zero
     reward variance, w = min(B / (B - #zero-variance groups), 3.0), else 1. It restores the gradient scale that
     filtering zero-variance groups out would have given. Zero-variance groups have A = 0 either way.
2. Clipped policy gradient (no ratio factor; the clip acts on the log-ratio):
       A > 0:   l = -A * min(logp, logp_old + ln(1 + eps))
       A <= 0:  l = -A * max(logp, logp_old + ln(1 - eps))
   so a token stops receiving gradient once its log-ratio left the trust region in the advantage's direction.
3. Policy drift: a term with value k3(d) = e^d - d - 1 (an estimate of KL(pi_old || pi), d = logp - logp_old) and
   gradient clamp(r - 1, max = c) * grad logp with r = exp(sg(logp) - logp_old): the k3 gradient, capped once
   r > 1 + c. Implemented as sg(k3(d)) + sg(clamp(r - 1, max=c)) * (logp - sg(logp)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .algorithm_config import CPGD_WEIGHTS


def cpgd_weighted_advantages(
    kind: str,
    centered_G_n: Tensor,
    std_G: Tensor,
    zero_var_G: Tensor,
    std_eps: float = 1e-9,
    weight_max: float = 3.0,
) -> Tensor:
    """CPGD advantage [G, n] from group-centred rewards (zero-variance groups must already be 0 in ``centered``)."""
    if kind == "equal":
        return centered_G_n
    if kind == "std":
        return centered_G_n / (std_G[:, None] + std_eps)
    if kind == "clip_filter_like":
        num_groups = zero_var_G.numel()
        num_zero = int(zero_var_G.sum())
        w = 1.0 if num_zero in (0, num_groups) else min(num_groups / (num_groups - num_zero), weight_max)
        return centered_G_n * w
    raise ValueError(f"AdvantageConfig.cpgd_weight must be one of {CPGD_WEIGHTS}, got {kind!r}")


def cpgd_clipped_pg_per_token(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token CPGD loss [B, T] and the (low, high) clip-active boolean maps."""
    old = old_logp_BT.detach()
    upper = old + math.log1p(eps_high)
    lower = old + math.log1p(-eps_low)
    pos = adv_BT > 0
    loss = torch.where(pos, -adv_BT * torch.minimum(logp_BT, upper), -adv_BT * torch.maximum(logp_BT, lower))
    clipped_high = pos & (logp_BT.detach() > upper)
    clipped_low = (adv_BT < 0) & (logp_BT.detach() < lower)
    return loss, clipped_low, clipped_high


def policy_drift_per_token(
    logp_BT: Tensor, old_logp_BT: Tensor, clip: float, log_ratio_clamp: float = 20.0
) -> tuple[Tensor, Tensor]:
    """Per-token drift term [B, T] (value k3(d), gradient clamp(r - 1, max=clip) * grad logp) and the boolean map of
    tokens whose drift weight is capped."""
    d = (logp_BT.detach() - old_logp_BT.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)
    r_minus_1 = torch.expm1(d)
    weight = r_minus_1.clamp(max=clip)
    value = r_minus_1 - d  # k3(d) = e^d - 1 - d
    return value + weight * (logp_BT - logp_BT.detach()), r_minus_1 > clip
