"""F-GRPO focal scaling of group advantages (Plyusov et al., "F-GRPO: Don't Let Your Policy Learn the Obvious and
Forget the Rare", arXiv 2602.06717, Sec. 4).

Any group-relative advantage of prompt x is multiplied by

    g(x) = (1 - mu_pos(x)) ** gamma,     mu_pos(x) = (mean_r(x) - R_wrong) / (R_correct - R_wrong)  clamped to [0, 1]

which down-weights prompts the policy already solves often. ``gamma = 0`` gives g = 1 exactly (``0 ** 0 == 1``), so
the base estimator is reproduced bit for bit. The clamp keeps g real when shaped rewards (e.g. the DAPO overlong
penalty) leave [R_wrong, R_correct].
"""

from __future__ import annotations

from torch import Tensor


def focal_weight(mean_reward_G: Tensor, gamma: float, reward_correct: float, reward_wrong: float) -> Tensor:
    """g(x) per group [G] from the group's mean reward over its valid rollouts."""
    if not reward_correct > reward_wrong:
        raise ValueError(f"focal_weight: reward_correct ({reward_correct}) must exceed reward_wrong ({reward_wrong})")
    if not gamma >= 0:
        raise ValueError(f"focal_weight: gamma must be >= 0, got {gamma}")
    mu_pos = ((mean_reward_G - reward_wrong) / (reward_correct - reward_wrong)).clamp(0.0, 1.0)
    return (1.0 - mu_pos).pow(gamma)
