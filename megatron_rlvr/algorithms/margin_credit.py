"""MCPO margin credit: redistribute a sequence's advantage over its tokens by the policy's top-2 margin.

M_t = p1 - p2 is the detached gap between the two most likely tokens of the CURRENT policy at position t (from the
vocab-parallel ops, ``want=("margin",)``). A small margin marks a "forking" token where the policy was undecided; a
large margin a token it was sure of. The score

    s(M) = 1                                                   M <= tau_lo   (full credit)
           floor                                               M >= tau_hi   (floor credit)
           1 - (1 - floor) (M - tau_lo) / (tau_hi - tau_lo)    in between    (linear)

is renormalised per sequence, w_t = s_t / mean_{t' in y} s_t', so the mean weight over the response tokens is exactly
1 and the per-token advantage A_t = A w_t keeps the sequence's mean advantage A. Equal scores give w = 1 (uniform);
an all-zero score row (floor = 0 and every token confident) also falls back to uniform.

Defaults tau_lo = 0.3, tau_hi = 0.9, floor = 0.5 are OURS: the paper's values are not public. Rationale: in reasoning
traces most tokens have margins above 0.9 (near-deterministic continuations); 0.3 separates genuinely contested
choices; floor 0.5 caps the redistribution at 2x between a contested and a confident token, conservative enough not
to starve the confident bulk of the sequence of credit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import complete_seq_sum
from .algorithm_config import MarginCreditConfig
from .metrics import masked_max, masked_mean


def margin_score(cfg: MarginCreditConfig, margin_BT: Tensor) -> Tensor:
    """s(M) elementwise, in [floor, 1]."""
    frac = ((margin_BT - cfg.tau_lo) / (cfg.tau_hi - cfg.tau_lo)).clamp(0.0, 1.0)
    return 1.0 - (1.0 - cfg.floor) * frac


@torch.no_grad()
def margin_credit_weights(cfg: MarginCreditConfig, margin_BT: Tensor, mask_BT: Tensor, seq_sum=None) -> Tensor:
    """Per-token weights [B, T] (at least float32, detached): mean 1 over each row's valid tokens, 0 elsewhere.
    ``seq_sum`` (context parallelism, :data:`.aggregation.SeqSum`): the mean is over the whole sequence's tokens."""
    mask = mask_BT.bool()
    m = margin_BT.detach()
    m = m.to(torch.promote_types(m.dtype, torch.float32))
    s = torch.where(mask, margin_score(cfg, m), torch.zeros_like(m))
    total_B = complete_seq_sum(s.sum(dim=1), seq_sum)[:, None]
    len_B = complete_seq_sum(mask.sum(dim=1).to(m.dtype), seq_sum)[:, None]
    uniform = mask.to(m.dtype)
    w = torch.where(total_B > 0, s * len_B / total_B.clamp_min(1e-30), uniform)
    return torch.where(mask, w, torch.zeros_like(w))


def margin_credit_metrics(
    cfg: MarginCreditConfig, margin_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor
) -> dict[str, Tensor]:
    """Margin stats and credit spread (RMS of w - 1 over tokens: the pooled within-sequence std, as each sequence's
    weights have mean 1)."""
    mask = mask_BT.bool()
    return {
        "credit/margin_mean": masked_mean(margin_BT, mask),
        "credit/full_credit_frac": masked_mean((margin_BT <= cfg.tau_lo).double(), mask),
        "credit/floor_frac": masked_mean((margin_BT >= cfg.tau_hi).double(), mask),
        "credit/weight_max": masked_max(weights_BT, mask),
        "credit/upweighted_frac": masked_mean((weights_BT > 1.0).double(), mask),
        "credit/weight_spread": masked_mean((weights_BT - 1.0) ** 2, mask).sqrt(),
    }
