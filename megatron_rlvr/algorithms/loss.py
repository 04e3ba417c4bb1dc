"""The per-micro-batch entry point: :func:`compute_policy_loss`.

Layout convention: padded [B, T] tensors (B sequences of this micro-batch, T response positions) with a bool
response mask; per-token statistics come from the vocab-parallel ops (``megatron_rlvr.ops``) reshaped to [B, T].
Masked positions may hold anything (garbage, inf, NaN): they are replaced by 0 before any arithmetic, so they get
neither loss nor gradient.

    loss = aggregate(policy_loss_BT)                       # PPO / DAPO / dual-clip / CISPO / GSPO / PG / CPGD
         + drift.coef   * aggregate(drift_BT)              # CPGD policy drift
         + ref_kl.coef  * aggregate(kl_BT)                 # reference KL (k1/k2/k3/exact)
         - entropy.coef * aggregate(entropy_BT)            # entropy bonus
         + hinge-KL over mastered sequences                # MCPO
         + distill.coef * aggregate(reverse_kl_BT)         # on-policy distillation, mode=loss (distill.py)

with the per-token advantage A_BT = adv_B (broadcast) or adv_BT, times the margin-credit weights when enabled. With
distillation the caller composes adv_BT by :func:`.distill.distill_advantages` (the reward's weight, and in
``advantage`` mode the teacher's per-token term).
Every aggregate divides by GLOBAL counts (:class:`LossNormalizers`), so micro-batch losses and gradients simply add
up to the full-batch ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import LossNormalizers, SeqSum, aggregate
from .algorithm_config import AlgorithmConfig
from .cpgd import policy_drift_per_token
from .distill import distill_loss
from .margin_credit import margin_credit_metrics, margin_credit_weights
from .mcpo import hinge_kl_loss
from .metrics import masked_max, masked_mean, masked_min
from .policy_losses import POLICY_LOSSES, log_ratio
from .regularizers import ref_kl_per_token


@dataclass
class PolicyLossInputs:
    """One micro-batch. All [B, T] tensors share the shape of ``mask_BT``."""

    logp_BT: Tensor
    """Current-policy log-prob of each sampled token (ops ``logprob``; carries the gradient)."""
    old_logp_BT: Tensor
    """Behaviour-policy log-prob (detached)."""
    mask_BT: Tensor
    """Response-token mask (bool or 0/1)."""
    adv_B: Tensor | None = None
    """Per-sequence advantage [B] (exactly one of adv_B / adv_BT)."""
    adv_BT: Tensor | None = None
    """Per-token advantage [B, T]."""
    ref_logp_BT: Tensor | None = None
    """Reference-policy log-probs, for the k1/k2/k3 reference KL."""
    ref_kl_BT: Tensor | None = None
    """Exact per-token KL(pi || pi_ref) from the ops (``kl``), for ``RefKLConfig.estimator='exact'``."""
    entropy_BT: Tensor | None = None
    """Per-token entropy from the ops, for the entropy bonus."""
    margin_BT: Tensor | None = None
    """Detached top-2 margin p1 - p2 from the ops, for margin credit."""
    mastered_B: Tensor | None = None
    """bool [B]: the sequence's prompt is mastered, for the MCPO hinge-KL."""
    seq_sum: SeqSum | None = None
    """Context parallelism: completes per-sequence sums over the ranks that share the sequences (each holds some of
    their positions; the others are out of ``mask_BT``). None: the sequences are whole here."""
    teacher_logp_BT: Tensor | None = None
    """The distillation teacher's log-prob of each sampled token (detached), for ``distill``."""
    distill_kl_BT: Tensor | None = None
    """Exact per-token reverse KL(pi || teacher) over the vocabulary from the ops (``kl``, with gradient), for
    ``distill.estimator='full'``."""

    def __post_init__(self) -> None:
        if self.mask_BT.dim() != 2:
            raise ValueError(f"PolicyLossInputs.mask_BT must be [B, T], got shape {tuple(self.mask_BT.shape)}")
        shape = tuple(self.mask_BT.shape)
        for name in (
            "logp_BT",
            "old_logp_BT",
            "adv_BT",
            "ref_logp_BT",
            "ref_kl_BT",
            "entropy_BT",
            "margin_BT",
            "teacher_logp_BT",
            "distill_kl_BT",
        ):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(
                    f"PolicyLossInputs.{name} must have the shape of mask_BT {shape}, got {tuple(t.shape)}"
                )
        for name in ("adv_B", "mastered_B"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape[:1]:
                raise ValueError(f"PolicyLossInputs.{name} must be [B]=({shape[0]},), got {tuple(t.shape)}")
        if (self.adv_B is None) == (self.adv_BT is None):
            raise ValueError("PolicyLossInputs: give exactly one of adv_B (per sequence) or adv_BT (per token)")
        if not self.logp_BT.is_floating_point():
            raise ValueError(f"PolicyLossInputs.logp_BT must be floating point, got {self.logp_BT.dtype}")


def _clean(x: Tensor | None, mask: Tensor) -> Tensor | None:
    """x with masked-out positions replaced by 0 (value and gradient), so padding garbage cannot leak NaN."""
    if x is None:
        return None
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def compute_policy_loss(
    cfg: AlgorithmConfig, inputs: PolicyLossInputs, norms: LossNormalizers
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the global-batch loss (0-dim, differentiable) and its metrics."""
    mask = inputs.mask_BT.bool()
    seq_sum = inputs.seq_sum
    logp = _clean(inputs.logp_BT, mask)
    old = _clean(inputs.old_logp_BT.detach(), mask)
    if inputs.adv_BT is not None:
        adv = _clean(inputs.adv_BT.detach().to(logp.dtype), mask)
    else:
        adv = _clean(inputs.adv_B.detach().to(logp.dtype)[:, None].expand_as(logp), mask)
    metrics: dict[str, Tensor] = {}

    if cfg.margin_credit.enabled:
        if inputs.margin_BT is None:
            raise ValueError("margin_credit.enabled needs margin_BT (ops 'margin') in PolicyLossInputs")
        margin = _clean(inputs.margin_BT.detach(), mask)
        w = margin_credit_weights(cfg.margin_credit, margin, mask, seq_sum)
        adv = adv * w.to(adv.dtype)
        metrics.update(margin_credit_metrics(cfg.margin_credit, margin, w, mask))

    pl_BT, pl_metrics = POLICY_LOSSES[cfg.policy_loss.name](cfg.policy_loss, logp, old, adv, mask, seq_sum)
    pg_loss = aggregate(pl_BT, mask, cfg.aggregation, norms, seq_sum)
    loss = pg_loss
    metrics["loss/policy"] = pg_loss.detach().float()
    metrics.update(pl_metrics)

    if cfg.drift.coef > 0:
        drift_BT, capped = policy_drift_per_token(logp, old, cfg.drift.clip, cfg.policy_loss.log_ratio_clamp)
        drift = aggregate(drift_BT, mask, cfg.aggregation, norms, seq_sum)
        loss = loss + cfg.drift.coef * drift
        metrics["drift/kl"] = drift.detach().float()
        metrics["drift/capped_frac"] = masked_mean(capped.double(), mask)

    if cfg.ref_kl.coef > 0:
        kl_BT = ref_kl_per_token(cfg.ref_kl, logp, _clean(inputs.ref_logp_BT, mask), _clean(inputs.ref_kl_BT, mask))
        ref_kl = aggregate(kl_BT, mask, cfg.aggregation, norms, seq_sum)
        loss = loss + cfg.ref_kl.coef * ref_kl
        metrics["loss/ref_kl"] = ref_kl.detach().float()

    if cfg.entropy.coef > 0:
        if inputs.entropy_BT is None:
            raise ValueError("entropy.coef > 0 needs entropy_BT (ops 'entropy') in PolicyLossInputs")
        ent = aggregate(_clean(inputs.entropy_BT, mask), mask, cfg.aggregation, norms, seq_sum)
        loss = loss - cfg.entropy.coef * ent
        metrics["loss/entropy_bonus"] = ent.detach().float()
    if inputs.entropy_BT is not None:
        metrics["loss/entropy"] = masked_mean(inputs.entropy_BT, mask)

    if cfg.hinge_kl.enabled:
        if inputs.mastered_B is None:
            raise ValueError("hinge_kl.enabled needs mastered_B (see advantages.mastered_rollouts) in PolicyLossInputs")
        hinge, h_metrics = hinge_kl_loss(
            cfg.hinge_kl, logp, old, mask, inputs.mastered_B.bool(), norms, cfg.policy_loss.log_ratio_clamp, seq_sum
        )
        loss = loss + hinge
        metrics.update(h_metrics)

    if cfg.distill.enabled:
        d_loss, d_metrics = distill_loss(
            cfg.distill,
            cfg.aggregation,
            norms,
            mask,
            logp,
            old,
            _clean(inputs.teacher_logp_BT, mask),
            _clean(inputs.distill_kl_BT, mask),
            cfg.policy_loss.log_ratio_clamp,
            seq_sum,
        )
        if d_loss is not None:
            loss = loss + d_loss
        metrics.update(d_metrics)

    with torch.no_grad():
        lr = log_ratio(cfg.policy_loss, logp, old)
        ratio = lr.exp()
        metrics["loss/total"] = loss.detach().float()
        metrics["loss/approx_kl"] = masked_mean(torch.expm1(lr) - lr, mask)  # k3 estimate of KL(pi_old || pi)
        metrics["loss/ratio_mean"] = masked_mean(ratio, mask)
        metrics["loss/ratio_max"] = masked_max(ratio, mask, empty=1.0)
        metrics["loss/ratio_min"] = masked_min(ratio, mask, empty=1.0)
        metrics["loss/adv_token_mean"] = masked_mean(adv, mask)
        metrics["loss/num_tokens"] = mask.sum().float()
    return loss, metrics
