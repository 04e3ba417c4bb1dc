"""MCPO: Mastery-Consolidated Policy Optimization (Liao et al., arXiv 2604.16972).

Two pieces, both from the paper's equations:

1. Query-weight rebalancing. With binary rewards and population std, a GRPO group of accuracy p gives each correct
   rollout A = (1 - p)/sigma and each wrong one A = -p/sigma, sigma = sqrt(p(1 - p)). The implied query weight
   (positive advantage mass per rollout, = half the mean |A| since group advantages sum to zero) is
   q(p) = p(1 - p)/sigma = sqrt(p(1 - p)): 0.5 at p = 0.5, shrinking to 0 as p -> 1. MCPO divides the advantage by

       scale(p) = 1                   for p <= 0.5
                  2 sqrt(p (1 - p))   for p > 0.5

   so q(p) = 0.5 exactly for every p in (0.5, 1) (this identity needs POPULATION std; the unbiased std gives
   0.5 sqrt((n-1)/n)). p = 1 (mastered) has zero advantage anyway; its scale is defined as 1 to avoid 0/0.

2. Hinge-KL on mastered prompts (all rollouts correct; threshold and minimum group size configurable). With
   d_t = logp_new - logp_old and k3(d) = e^d - d - 1,

       phi(d) = 0                    if |d| <= delta
                k3(d) - k3(delta)    if d > delta
                k3(d) - k3(-delta)   if d < -delta

   per sequence (1/|y|) sum_t phi(d_t), averaged over mastered sequences of the GLOBAL batch, times beta. phi is
   continuous at +-delta, and inside the band both its value and its gradient are exactly zero (torch.where routes
   no gradient into the unselected branches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import LossNormalizers, SeqSum, complete_seq_sum
from .algorithm_config import HingeKLConfig


def mcpo_query_scale(accuracy_G: Tensor) -> Tensor:
    """scale(p) [G]: 1 for p <= 0.5 (and p = 1), 2 sqrt(p(1 - p)) for p in (0.5, 1)."""
    p = accuracy_G
    majority = (p > 0.5) & (p < 1.0)
    safe = torch.where(majority, p, torch.full_like(p, 0.5))  # keeps sqrt's argument > 0 in the unselected branch
    return torch.where(majority, 2.0 * torch.sqrt(safe * (1.0 - safe)), torch.ones_like(p))


def implied_query_weight(adv_G_n: Tensor, valid_G_n: Tensor) -> Tensor:
    """q [G] = half the mean |A| over a group's valid rollouts (= the positive advantage mass per rollout for any
    zero-sum group advantage). For binary-reward GRPO with population std, q = sqrt(p(1 - p))."""
    cnt = valid_G_n.sum(dim=1).clamp_min(1).to(adv_G_n.dtype)
    return 0.5 * torch.where(valid_G_n, adv_G_n.abs(), torch.zeros_like(adv_G_n)).sum(dim=1) / cnt


def mastered_groups(cfg: HingeKLConfig, accuracy_G: Tensor, count_G: Tensor) -> Tensor:
    """bool [G]: accuracy >= mastered_threshold and at least min_group_size valid rollouts."""
    return (accuracy_G >= cfg.mastered_threshold) & (count_G >= cfg.min_group_size)


def _k3(d: Tensor) -> Tensor:
    return torch.expm1(d) - d


def hinge_phi(d_BT: Tensor, delta: float) -> Tensor:
    """phi(d) elementwise (see module docstring)."""
    zero = torch.zeros_like(d_BT)
    k3_pos = _k3(torch.tensor(delta, dtype=d_BT.dtype, device=d_BT.device))
    k3_neg = _k3(torch.tensor(-delta, dtype=d_BT.dtype, device=d_BT.device))
    # Each branch only sees values in its own region, so no branch can overflow where it is not selected.
    upper = torch.where(d_BT > delta, d_BT, zero + delta)
    lower = torch.where(d_BT < -delta, d_BT, zero - delta)
    return torch.where(d_BT > delta, _k3(upper) - k3_pos, torch.where(d_BT < -delta, _k3(lower) - k3_neg, zero))


def hinge_phi_bounded(d_BT: Tensor, delta: float, cap: float = 20.0) -> Tensor:
    """phi(d) with a bounded surrogate above ``cap``: phi(cap) + phi'(cap) (d - cap), its tangent at cap.

    Clamping d before phi (as the policy ratio is clamped) would zero the gradient of exactly the most drifted
    mastered tokens, the ones the hinge exists to pull back. Below -cap nothing overflows (e^d -> 0, the gradient
    tends to -1), so phi is exact there; above +cap the tangent keeps the restoring gradient e^cap - 1 (finite in
    fp32/bf16) and stays continuous with its first derivative at cap.
    """
    cap_t = torch.tensor(cap, dtype=d_BT.dtype, device=d_BT.device)
    inner = torch.where(d_BT > cap, cap_t.expand_as(d_BT), d_BT)  # no exp of more than cap anywhere
    excess = torch.where(d_BT > cap, d_BT - cap, torch.zeros_like(d_BT))
    return hinge_phi(inner, delta) + torch.expm1(cap_t) * excess


def hinge_kl_loss(
    cfg: HingeKLConfig,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    mask_BT: Tensor,
    mastered_B: Tensor,
    norms: LossNormalizers,
    log_ratio_clamp: float = 20.0,
    seq_sum: SeqSum | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """beta * sum_{i mastered} (1/|y_i|) sum_t phi(d_it) / N_mastered_global, and its metrics; phi is replaced by
    its tangent above ``log_ratio_clamp`` (:func:`hinge_phi_bounded`), never clamped to a zero gradient.

    ``mask_BT`` bool [B, T]; ``mastered_B`` bool [B]. Returns (0-dim loss, metrics). ``seq_sum`` (context
    parallelism): |y_i| is the whole sequence's length.
    """
    mask = mask_BT.bool() & mastered_B.bool()[:, None]
    d = logp_BT - old_logp_BT.detach()
    d = torch.where(mask, d, torch.zeros_like(d))
    phi = hinge_phi_bounded(d, cfg.delta, log_ratio_clamp)
    len_B = complete_seq_sum(mask.sum(dim=1).to(phi.dtype), seq_sum).clamp_min(1)
    per_seq = torch.where(mask, phi, torch.zeros_like(phi)).sum(dim=1) / len_B
    loss = cfg.beta * per_seq.sum() / max(norms.num_mastered_seqs, 1.0)
    with torch.no_grad():
        n_tok = mask.sum().clamp_min(1).to(torch.float32)
        metrics = {
            "mcpo/hinge_kl": (per_seq.sum() / max(norms.num_mastered_seqs, 1.0)).detach().float(),
            "mcpo/mastered_abs_d": (d.abs().float() * mask).sum() / n_tok,
            "mcpo/hinge_active_frac": ((d.abs() > cfg.delta) & mask).sum().float() / n_tok,
            "mcpo/mastered_token_frac": mask.sum().float() / mask_BT.bool().sum().clamp_min(1).float(),
        }
    return loss, metrics
