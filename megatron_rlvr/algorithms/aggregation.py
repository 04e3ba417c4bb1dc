"""Loss aggregation over a micro-batch with GLOBAL normalisers.

Every per-token loss term ``values_BT`` [B, T] (policy loss, drift, reference KL, entropy) is reduced to a scalar by
one of four modes. The divisor is never the micro-batch's own token or sequence count: it is the count over the whole
mini-batch (every DP rank, every micro-batch), i.e. :func:`local_normalizer_counts` summed over all of it. The trainer
holds the whole batch on every rank (the rollout ends in an all-gather), so it counts the mini-batch locally, with no
communication; a trainer that held only its shard would sum its micro-batches' counts and all-reduce them (SUM) over
data parallelism once per mini-batch. Each micro-batch's loss is then ``sum(contributions) / global_norm``, so
summing the gradients of all micro-batches on all ranks gives exactly the full-batch gradient, however the batch is
split (the verl/TRL bug class where each micro-batch divides by its own count and short micro-batches get up-weighted).

Modes (``l_it`` the per-token value, ``m_it`` the response mask, ``|y_i| = sum_t m_it``):

- ``token-mean``:               sum_{i,t} m_it l_it / N_tok                     (DAPO eq. 8)
- ``seq-mean-token-mean``:      sum_i (1/|y_i|) sum_t m_it l_it / N_seq         (GRPO, DeepSeekMath eq. 3)
- ``seq-mean-token-sum``:       sum_i sum_t m_it l_it / N_seq
- ``seq-mean-token-sum-norm``:  sum_{i,t} m_it l_it / (N_seq * C)                (Dr.GRPO, C = max response length)

``N_tok`` counts valid response tokens and ``N_seq`` counts sequences with at least one valid token (empty or fully
masked rows contribute nothing and are not counted). A zero global count gives a zero loss, never NaN.

Sequences split over ranks (context parallelism): each rank holds some positions of every sequence and sums only
those. A token-level sum then stays this rank's share of the loss, but a per-sequence quantity (``|y_i|`` of
``seq-mean-token-mean``) must be the whole sequence's: ``seq_sum`` (a :data:`SeqSum`) completes such per-sequence
sums over the ranks (None: every sequence is whole here).

Gradient semantics: the returned loss is "sum-reduced": the full-batch gradient is the SUM of the gradients of all
micro-batches on all DP ranks. A framework that averages gradients over DP ranks or divides each micro-batch loss by
the number of micro-batches must undo that scaling (multiply by dp_size and/or num_microbatches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .algorithm_config import AGGREGATION_NAMES, AggregationConfig, check_registry

SeqSum = Callable[[Tensor], Tensor]
"""Completes per-sequence sums over the ranks that share the sequences (context parallelism): given this rank's
sums over the positions it holds, [B], returns the sums over whole sequences, [B] (detached values: counts and
detached statistics only). The Megatron glue builds it (megatron_rlvr.megatron.context_parallel.sequence_sum)."""


def complete_seq_sum(x_B: Tensor, seq_sum: SeqSum | None) -> Tensor:
    """``x_B`` [B] summed over the whole sequences (``seq_sum`` None: they are whole here already)."""
    return x_B if seq_sum is None else seq_sum(x_B)


@dataclass
class LossNormalizers:
    """Global (whole mini-batch, all DP ranks) counts used as loss divisors."""

    num_tokens: float
    """Valid response tokens in the global batch."""
    num_seqs: float
    """Sequences with at least one valid response token in the global batch."""
    num_mastered_seqs: float = 0.0
    """Sequences of mastered prompts (MCPO hinge-KL) with at least one valid token in the global batch."""

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_seqs", "num_mastered_seqs"):
            v = float(getattr(self, name))
            if not (v >= 0.0) or v == float("inf"):
                raise ValueError(f"LossNormalizers.{name} must be a finite count >= 0, got {v}")
            setattr(self, name, v)
        if self.num_seqs > self.num_tokens:
            raise ValueError(
                f"LossNormalizers: num_seqs ({self.num_seqs}) > num_tokens ({self.num_tokens}); every counted "
                "sequence has at least one valid token"
            )
        if self.num_mastered_seqs > self.num_seqs:
            raise ValueError(
                f"LossNormalizers: num_mastered_seqs ({self.num_mastered_seqs}) > num_seqs ({self.num_seqs})"
            )

    @classmethod
    def from_counts(cls, counts: Tensor) -> LossNormalizers:
        """From the counts of the whole mini-batch: :func:`local_normalizer_counts` summed over it, shape [3]."""
        if counts.shape != (3,):
            raise ValueError(f"LossNormalizers.from_counts expects a [3] tensor, got shape {tuple(counts.shape)}")
        tok, seq, mastered = (float(x) for x in counts.detach().double().cpu().tolist())
        return cls(num_tokens=tok, num_seqs=seq, num_mastered_seqs=mastered)

    @classmethod
    def from_batch(cls, mask_BT: Tensor, mastered_B: Tensor | None = None) -> LossNormalizers:
        """When the given batch IS the global batch (single rank, single micro-batch; tests)."""
        return cls.from_counts(local_normalizer_counts(mask_BT, mastered_B))


def local_normalizer_counts(mask_BT: Tensor, mastered_B: Tensor | None = None) -> Tensor:
    """[3] float64: (valid tokens, non-empty sequences, non-empty mastered sequences) of this micro-batch.

    Summed over the whole mini-batch (every micro-batch of every DP rank) they give :class:`LossNormalizers` through
    :meth:`LossNormalizers.from_counts`; the trainer, which holds the whole batch on every rank, counts the same from
    its sequences' lengths (no communication).
    """
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be [B, T], got shape {tuple(mask_BT.shape)}")
    return normalizer_counts_from_lengths(mask_BT.bool().sum(dim=1), mastered_B)


def normalizer_counts_from_lengths(len_B: Tensor, mastered_B: Tensor | None = None) -> Tensor:
    """[3] float64: (valid tokens, non-empty sequences, non-empty mastered sequences) of sequences with ``len_B``
    [B] valid (loss-masked) tokens each: what :func:`local_normalizer_counts` gives for their masks, without them."""
    if len_B.dim() != 1:
        raise ValueError(f"len_B must be [B], got shape {tuple(len_B.shape)}")
    nonempty_B = len_B > 0
    if mastered_B is None:
        mastered = torch.zeros_like(nonempty_B)
    else:
        if mastered_B.shape != nonempty_B.shape:
            raise ValueError(f"mastered_B must be [B]={tuple(nonempty_B.shape)}, got {tuple(mastered_B.shape)}")
        mastered = mastered_B.bool() & nonempty_B
    return torch.stack([len_B.sum(), nonempty_B.sum(), mastered.sum()]).to(torch.float64)


def _masked_sum_per_seq(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    # where, not multiply: a padded position may hold inf/NaN and NaN * 0 = NaN.
    return torch.where(mask_BT, values_BT, torch.zeros_like(values_BT)).sum(dim=1)


def _token_mean(values_BT: Tensor, mask_BT: Tensor, norms: LossNormalizers, cfg: AggregationConfig, seq_sum) -> Tensor:
    return _masked_sum_per_seq(values_BT, mask_BT).sum() / max(norms.num_tokens, 1.0)


def _seq_mean_token_mean(
    values_BT: Tensor, mask_BT: Tensor, norms: LossNormalizers, cfg: AggregationConfig, seq_sum
) -> Tensor:
    # |y_i| of the WHOLE sequence: a rank holding part of it divides its part of the sum by the full length
    len_B = complete_seq_sum(mask_BT.sum(dim=1).to(values_BT.dtype), seq_sum).clamp_min(1)
    return (_masked_sum_per_seq(values_BT, mask_BT) / len_B).sum() / max(norms.num_seqs, 1.0)


def _seq_mean_token_sum(
    values_BT: Tensor, mask_BT: Tensor, norms: LossNormalizers, cfg: AggregationConfig, seq_sum
) -> Tensor:
    return _masked_sum_per_seq(values_BT, mask_BT).sum() / max(norms.num_seqs, 1.0)


def _seq_mean_token_sum_norm(
    values_BT: Tensor, mask_BT: Tensor, norms: LossNormalizers, cfg: AggregationConfig, seq_sum
) -> Tensor:
    return _masked_sum_per_seq(values_BT, mask_BT).sum() / (max(norms.num_seqs, 1.0) * float(cfg.token_sum_norm))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, LossNormalizers, AggregationConfig, SeqSum | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
check_registry(AGGREGATIONS, AGGREGATION_NAMES, "aggregation.mode")


def aggregate(
    values_BT: Tensor,
    mask_BT: Tensor,
    cfg: AggregationConfig,
    norms: LossNormalizers,
    seq_sum: SeqSum | None = None,
) -> Tensor:
    """Reduce per-token ``values_BT`` [B, T] to this micro-batch's share of the global-batch loss (0-dim);
    ``seq_sum``: completes per-sequence sums when the sequences are split over ranks (module docstring)."""
    if values_BT.shape != mask_BT.shape or values_BT.dim() != 2:
        raise ValueError(
            f"aggregate: values_BT {tuple(values_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must both be [B, T]"
        )
    return AGGREGATIONS[cfg.mode](values_BT, mask_BT.bool(), norms, cfg, seq_sum)
