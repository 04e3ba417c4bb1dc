"""Per-token policy losses on log-probs from the vocab-parallel ops.

Inputs (all [B, T]; ``seq_sum``, see :data:`.aggregation.SeqSum`, only where a loss sums over a sequence):
``logp_BT`` current policy log-prob of the sampled token (carries the gradient),
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
- ``gspo``:      s_i = exp(min(mean_t log r_it, L)), L = ``seq_log_ratio_clamp`` (10, as verl); token form
                 s_it = sg(s_i) pi_t / sg(pi_t) (value s_i, gradient s_i grad logp_t, 0 where the clamp acts);
                 l = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)) (GSPO, arXiv 2507.18071, eq. 7 and
                 the GSPO-token eq. 13)
- ``pg``:        l = -A logp (REINFORCE)
- ``cpgd``:      clipped policy gradient without ratio factor (CPGD, arXiv 2505.12504), see :mod:`.cpgd`

``dual_clip: true`` adds the dual clip to ``ppo`` or ``gspo``. Bounds of the per-token gradient |d l_t / d logp_t|
(docs/algorithms.md, "Gradient bounds"; tests/unit/test_algorithms_ratio_bounds.py holds every loss to them):
``ppo`` e^20 |A| (A < 0, r up to the log-ratio clamp), with the dual clip max(c, 1 + eps_high) |A|; ``cispo``
(1 + eps_high) |A|; ``gspo`` e^L |A|, with the dual clip max(c, 1 + eps_high) |A|; ``pg`` and ``cpgd`` |A|.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .aggregation import complete_seq_sum
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


def _dual_clip(cfg, loss_BT, adv_BT, mask_BT, metrics: dict[str, Tensor]) -> Tensor:
    """For A < 0 the loss is also capped at -c A (Ye et al., arXiv 1912.09729, eq. 5): a token whose ratio already
    exploded is not pushed down harder than c |A|, and past the cap its gradient is 0."""
    neg = adv_BT < 0
    cap = -cfg.dual_clip_c * adv_BT
    metrics["loss/dual_clip_frac"] = masked_mean((neg & (loss_BT.detach() > cap)).double(), mask_BT)
    return torch.where(neg, torch.minimum(loss_BT, cap), loss_BT)


def _ppo(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, dual: bool) -> tuple[Tensor, dict[str, Tensor]]:
    ratio = log_ratio(cfg, logp_BT, old_logp_BT).exp()
    loss = torch.maximum(-adv_BT * ratio, -adv_BT * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    r = ratio.detach()
    low, high = (adv_BT < 0) & (r < 1.0 - cfg.eps_low), (adv_BT > 0) & (r > 1.0 + cfg.eps_high)
    metrics = _clip_metrics(low, high, mask_BT)
    if dual:
        loss = _dual_clip(cfg, loss, adv_BT, mask_BT, metrics)
    return loss, metrics


def ppo_clip_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (asymmetric: DAPO clip-higher); dual-clipped when ``cfg.dual_clip``."""
    return _ppo(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, dual=cfg.dual_clip)


def dual_clip_ppo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: ``ppo`` with the dual clip on."""
    return _ppo(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, dual=True)


def cispo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight; every token keeps its gradient."""
    r = log_ratio(cfg, logp_BT, old_logp_BT).detach().exp()
    lo = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    w = r.clamp(min=lo, max=1.0 + cfg.eps_high)
    loss = -w * adv_BT * logp_BT
    low = torch.zeros_like(r, dtype=torch.bool) if lo is None else r < lo
    return loss, _clip_metrics(low, r > 1.0 + cfg.eps_high, mask_BT)


def gspo_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: sequence-level ratio s_i = exp(min(mean_t log r_it, L)) with the token-level stop-gradient form;
    dual-clipped when ``cfg.dual_clip``.

    The clamp at L = ``seq_log_ratio_clamp`` bounds the sequence ratio. Without it a negative-advantage sequence whose
    tokens all drifted to the per-token clamp would weigh e^20 |A| in loss and gradient (the unclipped branch of the
    PPO-style max is the pessimistic one for A < 0, so the eps clip never bounds it); clamped, the loss is at most
    e^L |A| and, the clamp having gradient 0 outside its range, such a sequence gets no gradient, as verl's GSPO
    (same L = 10). Below, s -> 0 bounds itself (the gradient of a sequence with A > 0 is A s).

    ``seq_sum`` completes the per-sequence log-ratio sum and length over the ranks that share a sequence (context
    parallelism): s_i is the whole sequence's on every rank."""
    lr = torch.where(mask_BT, log_ratio(cfg, logp_BT, old_logp_BT), torch.zeros_like(logp_BT))
    len_B = complete_seq_sum(mask_BT.sum(dim=1).to(lr.dtype), seq_sum).clamp_min(1)
    log_s_B = complete_seq_sum(lr.sum(dim=1).detach(), seq_sum) / len_B
    log_s_BT = (log_s_B[:, None] + logp_BT - logp_BT.detach()).clamp(max=cfg.seq_log_ratio_clamp)
    s = log_s_BT.exp()
    loss = torch.maximum(-adv_BT * s, -adv_BT * s.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    s_d = s.detach()
    metrics = _clip_metrics(
        (adv_BT < 0) & (s_d < 1.0 - cfg.eps_low), (adv_BT > 0) & (s_d > 1.0 + cfg.eps_high), mask_BT
    )
    metrics["loss/seq_ratio_mean"] = masked_mean(s_d, mask_BT)
    capped = (log_s_B > cfg.seq_log_ratio_clamp)[:, None].expand_as(lr)
    metrics["loss/seq_ratio_clamped_frac"] = masked_mean(capped.double(), mask_BT)
    if cfg.dual_clip:
        loss = _dual_clip(cfg, loss, adv_BT, mask_BT, metrics)
    return loss, metrics


def pg_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient -A logp (no importance ratio, no clip)."""
    zeros = torch.zeros_like(mask_BT)
    return -adv_BT * logp_BT, _clip_metrics(zeros, zeros, mask_BT)


def cpgd_loss(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
    """CPGD clipped policy gradient (see :mod:`.cpgd`)."""
    loss, low, high = cpgd_clipped_pg_per_token(logp_BT, old_logp_BT, adv_BT, cfg.eps_low, cfg.eps_high)
    return loss, _clip_metrics(low, high, mask_BT)


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""(cfg, logp_BT, old_logp_BT, adv_BT, mask_BT, seq_sum=None) -> (per-token loss [B, T], metrics)."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_clip_loss,
    "dual_clip": dual_clip_ppo_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "pg": pg_loss,
    "cpgd": cpgd_loss,
}
check_registry(POLICY_LOSSES, POLICY_LOSS_NAMES, "policy_loss.name")
