"""Per-token policy losses on log-probs from the vocab-parallel ops.

Inputs (all [B, T]): ``logp_BT`` current policy log-prob of the sampled token (carries the gradient),
``old_logp_BT`` behaviour-policy log-prob (detached here), ``adv_BT`` per-token advantage (a per-sequence advantage
broadcast over its tokens, possibly reshaped by margin credit), ``mask_BT`` bool response mask. Each loss returns
the per-token loss [B, T] (0 on masked positions) and its metrics; :mod:`.aggregation` reduces it.
r = exp(logp - logp_old), the log-ratio clamped to [-20, 20] before exp (``log_ratio_clamp``) so an extreme token
cannot overflow to inf and turn masked-out gradients into NaN (0 * inf).

Registry :data:`POLICY_LOSSES`:

- ``ppo``:       l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))     (Schulman et al. 2017, eq. 7; with
                 eps_high = 0.28 this is DAPO's clip-higher, arXiv 2503.14476 eq. 10)
- ``dual_clip``: ppo, and for A < 0 additionally l = min(l, -c A), c = 3.0 (Ye et al., arXiv 1912.09729, eq. 5)
- ``cispo``:     l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp; ``eps_low=None`` = no lower bound
                 (MiniMax-M1, arXiv 2506.13585, eq. 4-5)
- ``gspo``:      s_i = exp(mean_t log r_it), token form s_it = sg(s_i) pi_t / sg(pi_t) (value s_i, gradient
                 s_i grad logp_t); l = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)) (GSPO, arXiv
                 2507.18071, eq. 7 and the GSPO-token eq. 13)
- ``pg``:        l = -A logp (REINFORCE)
- ``cpgd``:      clipped policy gradient without ratio factor (CPGD, arXiv 2505.12504), see :mod:`.cpgd`
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .algorithm_config import POLICY_LOSS_NAMES, PolicyLossConfig, check_registry
from .cpgd import cpgd_clipped_pg_per_token
from .metrics import masked_mean


def log_ratio(cfg: PolicyLossConfig, logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    """Clamped logp - logp_old (gradient flows to logp inside the clamp range)."""
    return (logp_BT - old_logp_BT.detach()).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def _clip_metrics(low_BT: Tensor, high_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    return {
        "loss/clip_frac_low": masked_mean(low_BT.double(), mask_BT),
        "loss/clip_frac_high": masked_mean(high_BT.double(), mask_BT),
    }


def ppo_clip_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (asymmetric: DAPO clip-higher)."""
    ratio = log_ratio(cfg, logp_BT, old_logp_BT).exp()
    loss = torch.maximum(-adv_BT * ratio, -adv_BT * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    r = ratio.detach()
    return loss, _clip_metrics((adv_BT < 0) & (r < 1.0 - cfg.eps_low), (adv_BT > 0) & (r > 1.0 + cfg.eps_high), mask_BT)


def dual_clip_ppo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: for A < 0 the loss is also capped at -c A (bounds the push-down of a token whose ratio
    already exploded)."""
    loss, metrics = ppo_clip_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT)
    neg = adv_BT < 0
    cap = -cfg.dual_clip_c * adv_BT
    dual = torch.where(neg, torch.minimum(loss, cap), loss)
    metrics["loss/dual_clip_frac"] = masked_mean((neg & (loss.detach() > cap)).double(), mask_BT)
    return dual, metrics


def cispo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight; every token keeps its gradient."""
    r = log_ratio(cfg, logp_BT, old_logp_BT).detach().exp()
    lo = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    w = r.clamp(min=lo, max=1.0 + cfg.eps_high)
    loss = -w * adv_BT * logp_BT
    low = torch.zeros_like(r, dtype=torch.bool) if lo is None else r < lo
    return loss, _clip_metrics(low, r > 1.0 + cfg.eps_high, mask_BT)


def gspo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: sequence-level ratio s_i = exp(mean_t log r_it) with the token-level stop-gradient form."""
    lr = torch.where(mask_BT, log_ratio(cfg, logp_BT, old_logp_BT), torch.zeros_like(logp_BT))
    len_B = mask_BT.sum(dim=1).clamp_min(1).to(lr.dtype)
    log_s_B = (lr.sum(dim=1) / len_B).detach()
    s = torch.exp(log_s_B[:, None] + logp_BT - logp_BT.detach())
    loss = torch.maximum(-adv_BT * s, -adv_BT * s.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    s_d = log_s_B.exp()[:, None].expand_as(lr)
    metrics = _clip_metrics(
        (adv_BT < 0) & (s_d < 1.0 - cfg.eps_low), (adv_BT > 0) & (s_d > 1.0 + cfg.eps_high), mask_BT
    )
    metrics["loss/seq_ratio_mean"] = masked_mean(s_d, mask_BT)
    return loss, metrics


def pg_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient -A logp (no importance ratio, no clip)."""
    zeros = torch.zeros_like(mask_BT)
    return -adv_BT * logp_BT, _clip_metrics(zeros, zeros, mask_BT)


def cpgd_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT) -> tuple[Tensor, dict[str, Tensor]]:
    """CPGD clipped policy gradient (see :mod:`.cpgd`)."""
    loss, low, high = cpgd_clipped_pg_per_token(logp_BT, old_logp_BT, adv_BT, cfg.eps_low, cfg.eps_high)
    return loss, _clip_metrics(low, high, mask_BT)


PolicyLossFn = Callable[[PolicyLossConfig, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_clip_loss,
    "dual_clip": dual_clip_ppo_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "pg": pg_loss,
    "cpgd": cpgd_loss,
}
check_registry(POLICY_LOSSES, POLICY_LOSS_NAMES, "policy_loss.name")
