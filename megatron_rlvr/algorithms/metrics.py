"""Namespaced metrics. Values are detached float32 0-dim tensors on the input's device (no host sync: logging,
reduction across ranks and ``.item()`` are the caller's).

Namespaces: ``adv/`` advantage stats, ``groups/`` group structure (mastered, all-wrong, zero-variance), ``reward/``
reward overall and by difficulty bucket (easy p > 0.8, hard p < 0.2, medium otherwise; p = rollout accuracy),
``focal/`` F-GRPO weights, ``mcpo/`` query weights (with a histogram) and hinge-KL, ``loss/`` policy-loss terms,
clip fractions, ratio stats and approximate KL, ``credit/`` margin-credit stats, ``drift/`` CPGD drift.
Empty buckets or selections report 0 (the matching ``*_frac`` metric is then 0 too).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Bin edges of the MCPO implied-query-weight histogram; the [0.49, 0.51) bin holds MCPO's 0.5 plateau.
QUERY_WEIGHT_HIST_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.49, 0.51, math.inf)

EASY_ACCURACY = 0.8
HARD_ACCURACY = 0.2


def _f(x: Tensor | float) -> Tensor:
    return torch.as_tensor(x).detach().to(torch.float32)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty); float32, detached."""
    m = mask.bool()
    return _f(torch.where(m, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device)).sum()) / _f(
        m.sum().clamp_min(1)
    )


def masked_max(x: Tensor, mask: Tensor, empty: float = 0.0) -> Tensor:
    m = mask.bool()
    v = torch.where(m, x.detach(), torch.full_like(x.detach(), -math.inf)).max() if x.numel() else _f(empty)
    return _f(torch.where(m.any(), v, torch.full_like(v, empty)))


def masked_min(x: Tensor, mask: Tensor, empty: float = 0.0) -> Tensor:
    return -masked_max(-x, mask, -empty)


def query_weight_histogram(q_G: Tensor, include_G: Tensor, prefix: str = "mcpo/query_weight_hist") -> dict[str, Tensor]:
    """Fraction of included groups per bin of :data:`QUERY_WEIGHT_HIST_EDGES`."""
    out = {}
    n = include_G.sum().clamp_min(1).to(torch.float32)
    edges = QUERY_WEIGHT_HIST_EDGES
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = include_G & (q_G >= lo) & (q_G < hi)
        hi_s = "inf" if math.isinf(hi) else f"{hi:g}"
        out[f"{prefix}/[{lo:g},{hi_s})"] = _f(in_bin.sum().to(torch.float32) / n)
    return out


def advantage_metrics(
    adv_G_n: Tensor,
    rewards_G_n: Tensor,
    valid_G_n: Tensor,
    accuracy_G: Tensor,
    stats,
    mastered_G: Tensor,
    focal_G: Tensor,
    query_weight_G: Tensor,
) -> dict[str, Tensor]:
    """Metrics of :func:`~megatron_rlvr.algorithms.advantages.compute_advantages`."""
    G = adv_G_n.shape[0]
    nonempty_G = stats.count_G > 0
    n_groups = _f(nonempty_G.sum().clamp_min(1))
    m = {
        "adv/mean": masked_mean(adv_G_n, valid_G_n),
        "adv/std": masked_mean((adv_G_n - masked_mean(adv_G_n, valid_G_n).to(adv_G_n.dtype)) ** 2, valid_G_n).sqrt(),
        "adv/abs_mean": masked_mean(adv_G_n.abs(), valid_G_n),
        "adv/max": masked_max(adv_G_n, valid_G_n),
        "adv/min": masked_min(adv_G_n, valid_G_n),
        "adv/nonzero_frac": masked_mean((adv_G_n != 0).double(), valid_G_n),
        "groups/count": _f(G),
        "groups/mastered_frac": _f((mastered_G & nonempty_G).sum()) / n_groups,
        "groups/all_wrong_frac": _f(((accuracy_G == 0) & nonempty_G).sum()) / n_groups,
        "groups/zero_variance_frac": _f((stats.zero_var_G & nonempty_G).sum()) / n_groups,
        "groups/accuracy_mean": masked_mean(accuracy_G, nonempty_G),
        "reward/mean": masked_mean(rewards_G_n, valid_G_n),
        "focal/weight_mean": masked_mean(focal_G, nonempty_G),
        "focal/weight_min": masked_min(focal_G, nonempty_G),
        "mcpo/query_weight_mean": masked_mean(query_weight_G, nonempty_G),
    }
    buckets = {
        "easy": accuracy_G > EASY_ACCURACY,
        "hard": accuracy_G < HARD_ACCURACY,
    }
    buckets["medium"] = ~buckets["easy"] & ~buckets["hard"]
    for name, sel_G in buckets.items():
        sel_G = sel_G & nonempty_G
        m[f"reward/{name}"] = masked_mean(rewards_G_n, valid_G_n & sel_G[:, None])
        m[f"reward/{name}_frac"] = _f(sel_G.sum()) / n_groups
    m.update(query_weight_histogram(query_weight_G, nonempty_G))
    return m
