"""On-policy distillation from a frozen teacher (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", GKD; Gu et al. 2024, MiniLLM): the student p_s samples, the teacher p_t
scores the student's own tokens, and the student minimises the per-token reverse KL on its own distribution,

    KL_t = KL(p_s(. | x_<t) || p_t(. | x_<t)) = sum_v p_s(v) (log p_s(v) - log p_t(v))

(the prefix x_<t is the student's own sample, treated as given). Two estimates of KL_t, two places to put it
(``DistillConfig``; formulas and gradients in docs/algorithms.md, "On-policy distillation"):

- ``full``: KL_t exactly over the whole vocabulary, from the vocab-parallel ops (``kl`` of the student's logits
  against the teacher's shard); a loss term whose gradient d KL_t / d z_v = p_s(v) (log p_s(v) - log p_t(v) - KL_t)
  flows through the ops.
- ``sampled``: x_t = log p_s(y_t) - log p_t(y_t) at the sampled token y_t ~ p_s, an unbiased estimate of KL_t.
  As a loss the term is ``r_t * sg(x_t)`` with r_t = p_s(y_t) / p_old(y_t) (the importance ratio, 1 on-policy):
  its value is x_t and its gradient r_t x_t grad log p_s(y_t), an unbiased estimate of grad KL_t (the naive
  loss x_t has gradient grad log p_s(y_t), whose expectation under p_s is zero). As an advantage (``mode:
  advantage``) the token's advantage gains -coef * (log p_old(y_t) - log p_t(y_t)) and the policy loss does the
  rest (the on-policy distillation of prime-rl, NeMo-RL and Thinking Machines).

The verifiable reward's advantage is scaled by ``reward_weight`` in both modes (0: distillation alone). Pure torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import AggregationConfig, LossNormalizers, SeqSum, aggregate
from .algorithm_config import DistillConfig
from .metrics import masked_mean


def _zero_off(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def distill_advantages(
    cfg: DistillConfig, adv_BT: Tensor, old_logp_BT: Tensor, teacher_logp_BT: Tensor | None, mask_BT: Tensor
) -> Tensor:
    """Per-token advantages [B, T] with distillation: ``reward_weight * adv_BT``, plus, in ``advantage`` mode,
    ``-coef * (old_logp - teacher_logp)`` (the negative sampled reverse KL of the behaviour policy, detached).
    Zero off the mask."""
    mask = mask_BT.bool()
    out = adv_BT.detach() * cfg.reward_weight
    if cfg.mode == "advantage":
        if teacher_logp_BT is None:
            raise ValueError("distill.mode=advantage needs the teacher's log-probs of the sampled tokens")
        kl = _zero_off(old_logp_BT.detach().to(out.dtype) - teacher_logp_BT.detach().to(out.dtype), mask)
        out = out - cfg.coef * kl
    return _zero_off(out, mask)


def sampled_reverse_kl_surrogate(
    logp_BT: Tensor, old_logp_BT: Tensor, teacher_logp_BT: Tensor, log_ratio_clamp: float
) -> Tensor:
    """Per-token ``r * sg(logp - teacher_logp)``, r = exp(logp - old_logp) with the log-ratio clamped to
    +-``log_ratio_clamp``: value logp - teacher_logp on-policy (r = 1), gradient r (logp - teacher_logp) grad logp,
    unbiased for the gradient of the per-token reverse KL when the tokens were sampled from p_old."""
    x = (logp_BT - teacher_logp_BT.detach()).detach()
    r = torch.exp((logp_BT - old_logp_BT.detach()).clamp(-log_ratio_clamp, log_ratio_clamp))
    return r * x


def distill_loss(
    cfg: DistillConfig,
    agg: AggregationConfig,
    norms: LossNormalizers,
    mask_BT: Tensor,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    teacher_logp_BT: Tensor | None,
    kl_BT: Tensor | None,
    log_ratio_clamp: float,
    seq_sum: SeqSum | None = None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """(coef * aggregated reverse-KL term, or None in ``advantage`` mode; metrics).

    ``kl_BT``: the exact per-token reverse KL (ops ``kl``, with gradient), for ``estimator=full``;
    ``teacher_logp_BT``: the teacher's log-prob of each sampled token (detached), for ``sampled`` and the metrics.
    ``seq_sum``: completes per-sequence sums when the sequences are split over ranks (context parallelism), as
    for every other aggregated term (aggregation.aggregate).
    Metrics: ``distill/kl_per_token`` (mean over the masked tokens of the exact KL when given, else of the sampled
    estimate logp - teacher_logp), ``distill/teacher_logprob_mean``, and ``loss/distill`` (the aggregated term)."""
    mask = mask_BT.bool()
    metrics: dict[str, Tensor] = {}
    if kl_BT is not None:
        metrics["distill/kl_per_token"] = masked_mean(kl_BT, mask)
    elif teacher_logp_BT is not None:
        metrics["distill/kl_per_token"] = masked_mean(logp_BT.detach() - teacher_logp_BT.detach(), mask)
    if teacher_logp_BT is not None:
        metrics["distill/teacher_logprob_mean"] = masked_mean(teacher_logp_BT, mask)
    if cfg.mode != "loss":
        return None, metrics
    if cfg.estimator == "full":
        if kl_BT is None:
            raise ValueError("distill.estimator=full needs the exact per-token KL (ops 'kl' against the teacher)")
        term_BT = _zero_off(kl_BT, mask)
    else:
        if teacher_logp_BT is None:
            raise ValueError("distill.estimator=sampled needs the teacher's log-probs of the sampled tokens")
        # masked positions of the inputs may hold anything: zero them before the exp (value and gradient)
        z = [_zero_off(t, mask) for t in (logp_BT, old_logp_BT, teacher_logp_BT)]
        term_BT = _zero_off(sampled_reverse_kl_surrogate(*z, log_ratio_clamp), mask)
    term = aggregate(term_BT, mask, agg, norms, seq_sum)
    metrics["loss/distill"] = term.detach().float()
    return cfg.coef * term, metrics
