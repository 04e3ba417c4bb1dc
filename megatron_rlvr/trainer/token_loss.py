"""Per-micro-batch functions evaluated on the last pipeline stage: token statistics from the TP-sharded logits
through the vocab-parallel ops, then either the RLVR loss (megatron_rlvr.algorithms) or plain log-probs
(behaviour / reference policy, forward only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.algorithms import AlgorithmConfig, LossNormalizers, PolicyLossInputs, compute_policy_loss
from megatron_rlvr.algorithms.distill import distill_advantages
from megatron_rlvr.megatron.context_parallel import sequence_sum
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.trainer.context_split import ContextParallelMicroBatch
from megatron_rlvr.trainer.diagnostics import ratio_quantile_metrics
from megatron_rlvr.trainer.microbatch import MicroBatch, importance_weights, unpack_values


@dataclass
class StatsSpec:
    """How token statistics are computed from a logits shard."""

    tp_group: object
    """TP process group (None for an unsharded vocabulary)."""
    vocab_size: int
    """True vocabulary size (padding ids excluded)."""
    temperature: float
    """The rollout sampling temperature: log-probs are of softmax(logits / T), the distribution sampled from."""
    chunk_size: int
    """Tokens per chunk of the ops."""
    impl: str = "eager"
    """Implementation of the ops: ``eager`` or ``compiled`` (``train.fused_statistics``)."""
    cp_group: object = None
    """Context-parallel process group (None without CP): micro-batches come split over it
    (trainer.context_split), per-sequence sums and forward-only log-probs are completed over it."""


def token_stats(logits_bsv: torch.Tensor, labels_bs: torch.Tensor, spec: StatsSpec, want, other_logits_bsv=None):
    """({stat: [b, s]} over the FULL vocabulary from this rank's shard, nonfinite).

    ``nonfinite`` is True on every TP rank when any rank's logits shard holds NaN/inf (one MAX all-reduce over TP,
    so the ranks agree); the statistics are then computed from zeroed logits (finite, meaningless) and the caller
    skips the step. The ops themselves refuse non-finite results; this keeps a NaN step a skipped step, not a crash.
    Module-level so tests can wrap it."""
    b, s, v = logits_bsv.shape
    bad = ~torch.isfinite(logits_bsv).all()
    if other_logits_bsv is not None:
        bad = bad | ~torch.isfinite(other_logits_bsv).all()
    flag = bad.to(torch.float32).reshape(1)
    if spec.tp_group is not None:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=spec.tp_group)
    nonfinite = bool(flag.item() > 0)
    if nonfinite:
        logits_bsv = torch.where(torch.isfinite(logits_bsv), logits_bsv, torch.zeros_like(logits_bsv)) * 0.0
        if other_logits_bsv is not None:
            other_logits_bsv = torch.zeros_like(other_logits_bsv)
    out = vocab_parallel_token_stats(
        logits_bsv.reshape(b * s, v),
        tp_group=spec.tp_group,
        token_ids_T=labels_bs.reshape(-1).to(logits_bsv.device),
        other_logits_TV=None if other_logits_bsv is None else other_logits_bsv.reshape(b * s, v),
        temperature=spec.temperature,
        vocab_size=spec.vocab_size,
        want=tuple(want),
        chunk_size=spec.chunk_size,
        impl=spec.impl,
    )
    return {k: t.view(b, s) for k, t in out.items()}, nonfinite


@dataclass(frozen=True)
class TokenLogprobs:
    """What a forward-only micro-batch gives (behaviour / reference log-probs)."""

    logp_BT: torch.Tensor
    """[b, s] float32 on the CPU: log-probs of the labels (one sequence per row)."""
    entropy_BT: torch.Tensor | None
    """[b, s] float32 on the CPU, when asked for; else None."""
    nonfinite: bool
    """A non-finite logit or log-prob on a response token."""


@dataclass(frozen=True)
class MicroBatchLoss:
    """What the training loss of one micro-batch hands back besides the loss itself."""

    metrics: dict[str, float]
    """Loss terms, ratio statistics, ``train/nonfinite`` (reduced by algorithms.reductions)."""
    first_forward_logp_BT: torch.Tensor | None = None
    """The fused path only (``old_from_forward``): this forward's own log-probs [b, s], float32 on the CPU, which
    ARE the behaviour log-probs of the micro-batch (later epochs and the mismatch metrics use them); else None."""


def _nonfinite(x: torch.Tensor, mask: torch.Tensor) -> bool:
    return bool((~torch.isfinite(x) & mask).any())


def _whole_sequences(values_BT: torch.Tensor, mb: MicroBatch, spec: StatsSpec) -> torch.Tensor:
    """Per-position values [..., n, s] of the whole micro-batch on every CP rank: each rank's values where it holds
    the position, summed over the CP group (the ranks' positions are disjoint). Without CP: ``values_BT`` itself."""
    if not isinstance(mb, ContextParallelMicroBatch) or mb.cp_size == 1:
        return values_BT
    held = mb.held.to(values_BT.device)
    out = torch.where(held, values_BT.detach().float(), torch.zeros((), device=values_BT.device)).contiguous()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=spec.cp_group)
    return out


def _ratio_quantiles(logp_BT, old_BT, mask_BT, mb: MicroBatch, spec: StatsSpec) -> dict[str, float]:
    """trainer.diagnostics.ratio_quantile_metrics of the micro-batch. Quantiles do not add up over ranks: with
    context parallelism every CP rank computes them over the WHOLE sequences (its peers' positions summed in), so
    the token-weighted merge over ranks gives the CP = 1 values."""
    if isinstance(mb, ContextParallelMicroBatch) and mb.cp_size > 1:
        stacked = torch.stack([logp_BT.detach().float(), old_BT.float(), mask_BT.float()])  # [3, n, s]
        logp_BT, old_BT, mask_BT = _whole_sequences(stacked, mb, spec).unbind(0)
        mask_BT = mask_BT > 0.5
    return ratio_quantile_metrics(logp_BT, old_BT, mask_BT)


def logprob_fn(spec: StatsSpec, with_entropy: bool):
    """Forward-only statistics: returns (0, TokenLogprobs)."""

    def fn(mb: MicroBatch, logits_bsv):
        want = ("logprob", "entropy") if with_entropy else ("logprob",)
        with native_torch():  # no CUDA calls in here: skip the CPU shims' per-call handler
            st, bad = token_stats(logits_bsv, mb.labels, spec, want)
            st = {k: unpack_values(v, mb) for k, v in st.items()}  # packed rows -> one sequence per row
        mask = mb.mask.to(logits_bsv.device)
        bad = bool(bad or _nonfinite(st["logprob"], mask))
        st = {k: _whole_sequences(v, mb, spec) for k, v in st.items()}  # CP: every rank gets every position
        out = TokenLogprobs(
            logp_BT=st["logprob"].detach().float().cpu(),
            entropy_BT=st["entropy"].detach().float().cpu() if with_entropy else None,
            nonfinite=bad,
        )
        return torch.zeros((), device=logits_bsv.device), out

    return fn


def _correction_metrics(is_BT: torch.Tensor, mask_BT: torch.Tensor, correction) -> dict[str, float]:
    """The mean importance weight of the mismatch correction and the share of tokens at its cap."""
    if not bool(mask_BT.any()):
        return {"mismatch/is_weight_mean": 1.0, "mismatch/tis_clip_frac": 0.0}
    cap = correction.tis_cap if correction is not None else None
    clipped = (is_BT[mask_BT] >= cap).double().mean() if cap is not None else 0.0
    return {"mismatch/is_weight_mean": float(is_BT[mask_BT].double().mean()), "mismatch/tis_clip_frac": float(clipped)}


def policy_loss_fn(
    algo: AlgorithmConfig,
    norms: LossNormalizers,
    spec: StatsSpec,
    ref_logits_fn=None,
    *,
    old_from_forward: bool = False,
    correction: MismatchCorrectionConfig | None = None,
    teacher_logits_fn=None,
):
    """The training loss of one micro-batch: (sum-reduced loss, MicroBatchLoss).

    ``ref_logits_fn(mb)`` gives the reference model's logits shard when ``algo.ref_kl.estimator == 'exact'``;
    ``teacher_logits_fn(mb)`` the distillation teacher's when ``algo.distill.estimator == 'full'`` (the exact
    reverse KL against it then comes from the ops, with its gradient; with ``sampled`` the teacher's log-probs come
    with the micro-batch, ``mb.teacher_logp``).

    ``old_from_forward``: the behaviour policy IS the policy being updated (recomputed old log-probs, first
    mini-batch of the first epoch: no optimizer step yet), so the old log-probs are this forward's own log-probs,
    detached -- what a separate no-grad recompute pass gives (up to float noise), without that pass. The result
    then also holds them (``MicroBatchLoss.first_forward_logp_BT``) for later epochs and the mismatch metrics, and
    the mismatch ``correction`` (truncated IS) is computed from them (else its weights come with the micro-batch).
    """
    exact_kl = algo.ref_kl.coef > 0 and algo.ref_kl.estimator == "exact"
    seq_sum = sequence_sum(spec.cp_group)  # context parallelism: per-sequence sums over the CP group
    distill = algo.distill
    full_distill = distill.enabled and distill.estimator == "full"

    def fn(mb: MicroBatch, logits_bsv):
        want = ["logprob", "entropy"]
        if algo.margin_credit.enabled:
            want.append("margin")
        other = None
        if exact_kl:
            want.append("kl")
            other = ref_logits_fn(mb)
        teacher = teacher_logits_fn(mb) if full_distill else None
        with native_torch():  # the statistics and the loss make no CUDA calls (the frozen forwards above may)
            return _policy_loss(mb, logits_bsv, want, other, teacher)

    def _teacher_stats(mb: MicroBatch, logits_bsv, teacher_bsv):
        """(teacher log-probs of the labels [n, s], exact reverse KL [n, s] or None, nonfinite)."""
        if teacher_bsv is None:
            if mb.teacher_logp is None:
                raise ValueError("algorithm.distill.estimator=sampled: the micro-batch carries no teacher log-probs")
            return mb.teacher_logp.to(logits_bsv.device), None, False
        kl, bad_kl = token_stats(logits_bsv, mb.labels, spec, ("kl",), teacher_bsv)
        with torch.no_grad():
            t_lp, bad_t = token_stats(teacher_bsv, mb.labels, spec, ("logprob",))
        return unpack_values(t_lp["logprob"], mb), unpack_values(kl["kl"], mb), bad_kl or bad_t

    def _policy_loss(mb: MicroBatch, logits_bsv, want, other, teacher):
        dev = logits_bsv.device
        st, bad_logits = token_stats(logits_bsv, mb.labels, spec, want, other)
        st = {k: unpack_values(v, mb) for k, v in st.items()}  # packed rows -> one sequence per row
        teacher_logp = distill_kl = None
        if distill.enabled:
            teacher_logp, distill_kl, bad_teacher = _teacher_stats(mb, logits_bsv, teacher)
            bad_logits = bad_logits or bad_teacher
        mask = mb.mask.to(dev)
        logp = st["logprob"]
        rollout_BT = mb.rollout_logp.to(dev)
        if old_from_forward:
            # zeros off the mask, as the recompute path's scatter leaves them (padding is masked anyway)
            old_BT = torch.where(mask, logp.detach().float(), torch.zeros((), dtype=torch.float32, device=dev))
            corrected = correction is not None and correction.enabled
            is_BT = importance_weights(old_BT, rollout_BT, mask, correction, mb.demo) if corrected else None
        else:
            old_BT = mb.old_logp.to(dev)
            is_BT = None if mb.is_weight is None else mb.is_weight.to(dev)
        if distill.enabled:  # the reward's weight, and the teacher's per-token term in advantage mode
            seq_adv_BT = mb.adv.to(dev)[:, None].expand(mask.shape)
            adv_B, adv_BT = None, distill_advantages(distill, seq_adv_BT, old_BT, teacher_logp, mask)
            if is_BT is not None:
                adv_BT = adv_BT * is_BT
        elif is_BT is not None:
            adv_B, adv_BT = None, mb.adv.to(dev)[:, None] * is_BT
        else:
            adv_B, adv_BT = mb.adv.to(dev), None
        inputs = PolicyLossInputs(
            logp_BT=logp,
            old_logp_BT=old_BT,
            mask_BT=mask,
            adv_B=adv_B,
            adv_BT=adv_BT,
            ref_logp_BT=mb.ref_logp.to(dev) if algo.ref_kl.coef > 0 and not exact_kl else None,
            ref_kl_BT=st.get("kl"),
            entropy_BT=st["entropy"],
            margin_BT=st.get("margin"),
            mastered_B=mb.mastered.to(dev),
            seq_sum=seq_sum,
            teacher_logp_BT=teacher_logp,
            distill_kl_BT=distill_kl,
        )
        loss, metrics = compute_policy_loss(algo, inputs, norms)
        bad = bad_logits or _nonfinite(logp, mask) or not bool(torch.isfinite(loss))
        info = {k: float(v) for k, v in metrics.items()}
        info.update(_ratio_quantiles(logp, inputs.old_logp_BT, mask, mb, spec))  # diagnostics: ratio dynamics (CPGD)
        if is_BT is not None:  # how much the mismatch correction reweights (token-weighted over the step)
            info.update(_correction_metrics(is_BT, mask, correction))
        info["train/nonfinite"] = float(bad)
        if bad:
            # keep the backward finite-or-not as it is: the step is skipped after the all-reduce of this flag
            info = {k: (v if v == v and abs(v) != float("inf") else 0.0) for k, v in info.items()}
            info["train/nonfinite"] = 1.0
        first = _whole_sequences(logp.detach().float(), mb, spec).cpu() if old_from_forward else None
        return loss, MicroBatchLoss(metrics=info, first_forward_logp_BT=first)

    return fn
