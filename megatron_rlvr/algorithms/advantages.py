"""Group advantage estimators: rewards grouped by prompt -> one advantage per rollout.

Convention: ``rewards_G_n`` [G, n] holds the n rollouts of each of G prompts; ``valid_G_n`` (bool, optional) marks
the rollouts that exist (groups may be ragged, e.g. after a failed generation); ``correct_G_n`` (bool, optional) is
the verifier's verdict. Invalid rollouts are excluded from every statistic and get advantage 0. All arithmetic runs
in float64 (rewards are tiny tensors), the result is returned in the rewards' floating dtype (float32 for integer
rewards). The trainer flattens ``adv_G_n`` row-major to per-sequence ``adv_B`` (B = G * n).

Call :func:`compute_advantages` on the GLOBAL rollout batch (all DP ranks; rewards are cheap to all-gather): the
REINFORCE++ whitening and the CPGD clip-filter-like weight are batch statistics.

Estimators (registry :data:`ADVANTAGE_ESTIMATORS`), with mean/std over a group's valid rollouts:

- ``grpo``:          A = (r - mean) / (std + eps)                 (DeepSeekMath, arXiv 2402.03300, Sec. 4.1.2)
- ``dr_grpo``:       A = r - mean                                 (Dr.GRPO, arXiv 2503.20783, Sec. 3.2)
- ``rloo``:          A = r - mean_{j != i} r_j = n/(n-1) (r - mean) (Ahmadian et al., arXiv 2402.14740)
- ``reinforce_pp``:  c = r - mean, then batch whitening A = (c - mean_b(c)) / (std_b(c) + eps) over all valid
                     rollouts of the batch (REINFORCE++-baseline, arXiv 2501.03262; sequence-level whitening)
- ``cpgd``:          CPGD weights (``equal``, ``std``, ``clip_filter_like``), see :mod:`.cpgd`

Zero-variance groups (all valid rewards bit-identical, including single-rollout groups) get advantage exactly 0 for
every estimator: detected by max == min, not by std > 0, because a float mean of identical values can differ from
them in the last bit and (r - mean)/(std + eps) would then be O(1) noise.

Then, composable on top of any estimator (in this order): F-GRPO focal scaling (:mod:`.focal`) and MCPO
query-weight rebalancing (:mod:`.mcpo`).

Std default: POPULATION (divide by n). Reasons: (1) MCPO's identity "implied query weight = 0.5 on (0.5, 1)" holds
exactly with population std only; (2) for binary rewards the population std is sqrt(p(1 - p)), the quantity the
GRPO-family papers analyse; (3) a single valid rollout gives std 0 (advantage 0) instead of 0/0. ``std="unbiased"``
(Bessel, torch.std's default as used by TRL/verl) is available: it shrinks every GRPO advantage by sqrt((n-1)/n).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .algorithm_config import ADVANTAGE_ESTIMATOR_NAMES, AdvantageConfig, HingeKLConfig, check_registry
from .cpgd import cpgd_weighted_advantages
from .focal import focal_weight
from .mcpo import implied_query_weight, mastered_groups, mcpo_query_scale

if TYPE_CHECKING:
    from .algorithm_config import AlgorithmConfig


@dataclass
class GroupStats:
    """Per-group statistics over valid rollouts (float64)."""

    count_G: Tensor
    """Valid rollouts per group."""
    mean_G: Tensor
    """Mean reward (0 for an empty group)."""
    std_G: Tensor
    """Population or unbiased std (0 when undefined)."""
    zero_var_G: Tensor
    """bool: all valid rewards identical, or fewer than one valid rollout."""
    centered_G_n: Tensor
    """r - mean on valid rollouts of non-zero-variance groups, exactly 0 elsewhere."""


def group_stats(rewards_G_n: Tensor, valid_G_n: Tensor, std_kind: str) -> GroupStats:
    """Masked group statistics; ``rewards_G_n`` float64 [G, n], ``valid_G_n`` bool [G, n]."""
    zero = torch.zeros_like(rewards_G_n)
    r = torch.where(valid_G_n, rewards_G_n, zero)
    count = valid_G_n.sum(dim=1)
    mean = r.sum(dim=1) / count.clamp_min(1)
    rmax = torch.where(valid_G_n, r, torch.full_like(r, -math.inf)).amax(dim=1)
    rmin = torch.where(valid_G_n, r, torch.full_like(r, math.inf)).amin(dim=1)
    zero_var = (count == 0) | (rmax == rmin)
    keep = valid_G_n & ~zero_var[:, None]
    centered = torch.where(keep, r - mean[:, None], zero)
    ddof = 1 if std_kind == "unbiased" else 0
    var = (centered**2).sum(dim=1) / (count - ddof).clamp_min(1)
    std = torch.where(count > ddof, var.sqrt(), torch.zeros_like(var))
    return GroupStats(count_G=count, mean_G=mean, std_G=std, zero_var_G=zero_var, centered_G_n=centered)


def grpo_advantages(cfg: AdvantageConfig, stats: GroupStats, valid_G_n: Tensor) -> Tensor:
    """(r - mean) / (std + eps)."""
    return stats.centered_G_n / (stats.std_G[:, None] + cfg.eps)


def dr_grpo_advantages(cfg: AdvantageConfig, stats: GroupStats, valid_G_n: Tensor) -> Tensor:
    """r - mean (no std division: Dr.GRPO removes the question-level difficulty bias)."""
    return stats.centered_G_n


def rloo_advantages(cfg: AdvantageConfig, stats: GroupStats, valid_G_n: Tensor) -> Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j = n/(n - 1) (r_i - mean); groups with n < 2 are zero-variance."""
    n = stats.count_G.to(stats.centered_G_n.dtype)
    return stats.centered_G_n * (n / (n - 1).clamp_min(1))[:, None]


def reinforce_pp_advantages(cfg: AdvantageConfig, stats: GroupStats, valid_G_n: Tensor) -> Tensor:
    """Group-mean baseline, then whitening over all valid rollouts of the batch."""
    c = stats.centered_G_n
    n = valid_G_n.sum()
    if int(n) == 0:
        return c
    mean_b = c[valid_G_n].mean()
    ddof = 1 if cfg.std == "unbiased" else 0
    if int(n) <= ddof:
        return torch.zeros_like(c)
    std_b = ((c[valid_G_n] - mean_b) ** 2).sum().div(int(n) - ddof).sqrt()
    return (c - mean_b) / (std_b + cfg.eps)


def cpgd_advantages(cfg: AdvantageConfig, stats: GroupStats, valid_G_n: Tensor) -> Tensor:
    """CPGD-weighted group-centred rewards."""
    return cpgd_weighted_advantages(
        cfg.cpgd_weight, stats.centered_G_n, stats.std_G, stats.zero_var_G, cfg.cpgd_std_eps, cfg.cpgd_weight_max
    )


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageConfig, GroupStats, Tensor], Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "cpgd": cpgd_advantages,
}
check_registry(ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_NAMES, "advantage.estimator")


def _check_inputs(
    rewards_G_n: Tensor, valid_G_n: Tensor | None, correct_G_n: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    if rewards_G_n.dim() != 2:
        raise ValueError(f"rewards_G_n must be [G, n] (prompts x rollouts), got shape {tuple(rewards_G_n.shape)}")
    if rewards_G_n.numel() == 0:
        raise ValueError(f"rewards_G_n is empty (shape {tuple(rewards_G_n.shape)}): no rollouts to score")
    for name, t in (("valid_G_n", valid_G_n), ("correct_G_n", correct_G_n)):
        if t is not None and t.shape != rewards_G_n.shape:
            raise ValueError(
                f"{name} must have the shape of rewards_G_n {tuple(rewards_G_n.shape)}, got {tuple(t.shape)}"
            )
    valid = torch.ones_like(rewards_G_n, dtype=torch.bool) if valid_G_n is None else valid_G_n.bool()
    r = rewards_G_n.to(torch.float64)
    bad = valid & ~torch.isfinite(r)
    if bool(bad.any()):
        g, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"rewards_G_n has a non-finite reward {rewards_G_n[g, i].item()} at group {g}, rollout {i}: fix the "
            "reward function or mark the rollout invalid in valid_G_n"
        )
    return r, valid, None if correct_G_n is None else correct_G_n.bool()


def rollout_accuracy(
    cfg: AdvantageConfig, rewards_G_n: Tensor, valid_G_n: Tensor, correct_G_n: Tensor | None
) -> Tensor:
    """Fraction [G] (float64) of a group's valid rollouts that are correct. Without the verifier's ``correct_G_n``, a
    rollout is correct when its reward >= (R_correct + R_wrong) / 2 (pass ``correct_G_n`` when rewards are shaped)."""
    if correct_G_n is None:
        correct_G_n = rewards_G_n >= cfg.correct_threshold
    hits = (correct_G_n & valid_G_n).sum(dim=1).to(torch.float64)
    return hits / valid_G_n.sum(dim=1).clamp_min(1).to(torch.float64)


def mastered_rollouts(
    cfg: AlgorithmConfig, rewards_G_n: Tensor, *, valid_G_n: Tensor | None = None, correct_G_n: Tensor | None = None
) -> Tensor:
    """bool [G, n]: valid rollouts of mastered prompts; flatten to ``mastered_B`` for
    the MCPO hinge-KL."""
    r, valid, correct = _check_inputs(rewards_G_n, valid_G_n, correct_G_n)
    acc = rollout_accuracy(cfg.advantage, r, valid, correct)
    return mastered_groups(cfg.hinge_kl, acc, valid.sum(dim=1))[:, None] & valid


def compute_advantages(
    cfg: AlgorithmConfig, rewards_G_n: Tensor, *, valid_G_n: Tensor | None = None, correct_G_n: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages [G, n] for the global batch and their metrics.

    Estimator (registry) -> x F-GRPO focal weight g(x) -> / MCPO scale(p) -> invalid rollouts set to 0.
    """
    from .metrics import advantage_metrics  # local: metrics imports this module's helpers

    acfg: AdvantageConfig = cfg.advantage
    r, valid, correct = _check_inputs(rewards_G_n, valid_G_n, correct_G_n)
    stats = group_stats(r, valid, acfg.std)
    adv = ADVANTAGE_ESTIMATORS[acfg.estimator](acfg, stats, valid)
    focal_G = focal_weight(stats.mean_G, acfg.focal_gamma, acfg.reward_correct, acfg.reward_wrong)
    adv = adv * focal_G[:, None]  # gamma = 0: g = 1 exactly, the base estimator is unchanged bit for bit
    acc = rollout_accuracy(acfg, r, valid, correct)
    if acfg.mcpo_query_weight:
        adv = adv / mcpo_query_scale(acc)[:, None]
    adv = torch.where(valid & ~stats.zero_var_G[:, None], adv, torch.zeros_like(adv))
    hinge: HingeKLConfig = cfg.hinge_kl
    mastered_G = mastered_groups(hinge, acc, stats.count_G)
    metrics = advantage_metrics(adv, r, valid, acc, stats, mastered_G, focal_G, implied_query_weight(adv, valid))
    out_dtype = rewards_G_n.dtype if rewards_G_n.is_floating_point() else torch.float32
    return adv.to(out_dtype), metrics
