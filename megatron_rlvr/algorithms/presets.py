"""Named algorithm presets: one registry dict from name to a builder of an :class:`AlgorithmConfig`.

Each builder's docstring states its source and which defaults are the paper's and which are ours. Use
``preset("dapo", advantage={"focal_gamma": 0.5})`` to override fields (nested dicts, validated).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from .algorithm_config import (
    AdvantageConfig,
    AggregationConfig,
    AlgorithmConfig,
    DapoConfig,
    HingeKLConfig,
    PolicyDriftConfig,
    PolicyLossConfig,
    RefKLConfig,
)

#: Focal exponent gamma of the F-GRPO preset (Plyusov et al., "F-GRPO", arXiv 2602.06717).
F_GRPO_GAMMA = 0.5


def grpo() -> AlgorithmConfig:
    """GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300, eq. 3 and Sec. 4.1.2): A = (r - mean)/(std + eps),
    PPO clip eps = 0.2, per-sequence token mean, k3 reference KL with beta = 0.04 (the paper's). Population std is
    ours (see :mod:`.advantages`)."""
    return AlgorithmConfig(
        name="grpo",
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="seq-mean-token-mean"),
        ref_kl=RefKLConfig(coef=0.04, estimator="k3"),
    )


def dr_grpo() -> AlgorithmConfig:
    """Dr.GRPO (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783, eq. 3): A = r - mean (no std),
    token sums divided by a constant (the max response length; ours: 4096, set it to your generation limit), PPO
    clip 0.2, no KL (beta = 0 as in the paper)."""
    return AlgorithmConfig(
        name="dr_grpo",
        advantage=AdvantageConfig(estimator="dr_grpo"),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="seq-mean-token-sum-norm", token_sum_norm=4096.0),
    )


def dapo() -> AlgorithmConfig:
    """DAPO (Yu et al., arXiv 2503.14476): GRPO advantages, clip-higher eps_low = 0.2 / eps_high = 0.28, token-mean
    loss, no KL, soft overlong punishment with L_max = 20480 and L_buf = 4096, dynamic sampling (all the paper's)."""
    return AlgorithmConfig(
        name="dapo",
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.28),
        aggregation=AggregationConfig(mode="token-mean"),
        dapo=DapoConfig(overlong_shaping=True, max_response_len=20480, overlong_buffer_len=4096, dynamic_sampling=True),
    )


def cispo() -> AlgorithmConfig:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): GRPO advantages, stop-gradient IS weight clipped above only
    (no lower bound, as in the paper), token-mean over the batch (the paper's 1/sum|o_i|), no KL. eps_high = 0.28 is
    ours (the paper does not publish its value; 0.28 follows DAPO)."""
    return AlgorithmConfig(
        name="cispo",
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(name="cispo", eps_low=None, eps_high=0.28),
        aggregation=AggregationConfig(mode="token-mean"),
    )


def gspo() -> AlgorithmConfig:
    """GSPO (Zheng et al., arXiv 2507.18071, eq. 5-7): sequence-level ratio exp(mean_t log r), clip range
    eps_low = 3e-4, eps_high = 4e-4 (the paper's), per-sequence mean (1/G sum_i), GRPO advantages, no KL."""
    return AlgorithmConfig(
        name="gspo",
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(name="gspo", eps_low=3e-4, eps_high=4e-4),
        aggregation=AggregationConfig(mode="seq-mean-token-mean"),
    )


def rloo() -> AlgorithmConfig:
    """RLOO (Ahmadian et al., arXiv 2402.14740): leave-one-out baseline. The PPO clip 0.2 surrogate (for several
    updates per batch) and token-mean aggregation are ours (the paper's single-update REINFORCE equals it
    on-policy), no KL."""
    return AlgorithmConfig(
        name="rloo",
        advantage=AdvantageConfig(estimator="rloo"),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="token-mean"),
    )


def reinforce_pp() -> AlgorithmConfig:
    """REINFORCE++-baseline (Hu et al., arXiv 2501.03262): group-mean baseline then batch whitening, PPO clip 0.2,
    token-mean. KL: k2 reference KL in the loss with coef 1e-3 is ours (the paper's recipes vary)."""
    return AlgorithmConfig(
        name="reinforce_pp",
        advantage=AdvantageConfig(estimator="reinforce_pp"),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="token-mean"),
        ref_kl=RefKLConfig(coef=1e-3, estimator="k2"),
    )


def cpgd() -> AlgorithmConfig:
    """CPGD (Liu et al., arXiv 2505.12504): clipped policy gradient eps = 0.2, policy drift coef 0.01 with cap
    c = 2.0 (this project's default, see PolicyDriftConfig.clip), std advantage weight (MM-EUREKA's default
    ``STD_weight``; 1e-9 eps), per-sequence token mean (MM-EUREKA's masked_mean(dim=-1).mean()), no reference KL."""
    return AlgorithmConfig(
        name="cpgd",
        advantage=AdvantageConfig(estimator="cpgd", cpgd_weight="std"),
        policy_loss=PolicyLossConfig(name="cpgd", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="seq-mean-token-mean"),
        drift=PolicyDriftConfig(coef=0.01, clip=2.0),
    )


def _focal(base: AlgorithmConfig, name: str) -> AlgorithmConfig:
    return AlgorithmConfig.from_dict({"name": name, "advantage": {"focal_gamma": F_GRPO_GAMMA}}, base=base)


def f_grpo() -> AlgorithmConfig:
    """F-GRPO (Plyusov et al., arXiv 2602.06717): :func:`grpo` advantages times (1 - mu_pos)^gamma, gamma = 0.5.
    The F-GRPO paper's GRPO baseline trains without KL; so does this preset."""
    return _focal(AlgorithmConfig.from_dict({"ref_kl": {"coef": 0.0}}, base=grpo()), "f_grpo")


def f_dapo() -> AlgorithmConfig:
    """F-DAPO: :func:`dapo` (arXiv 2503.14476) + focal scaling gamma = 0.5 (F-GRPO, arXiv 2602.06717, Sec. 5)."""
    return _focal(dapo(), "f_dapo")


def f_cispo() -> AlgorithmConfig:
    """F-CISPO: :func:`cispo` (arXiv 2506.13585) + focal scaling gamma = 0.5 (F-GRPO, arXiv 2602.06717, Sec. 5)."""
    return _focal(cispo(), "f_cispo")


def mcpo() -> AlgorithmConfig:
    """MCPO (Liao et al., arXiv 2604.16972): GRPO advantages with POPULATION std divided by the MCPO query scale,
    hinge-KL on mastered prompts (beta = 1.0, delta = 0.01; mastered = all rollouts correct), PPO clip 0.2. The
    base objective's aggregation (token-mean) and no reference KL are ours (MCPO applies on top of GRPO-style
    objectives; the hinge-KL is the only KL-type term)."""
    return AlgorithmConfig(
        name="mcpo",
        advantage=AdvantageConfig(estimator="grpo", std="population", mcpo_query_weight=True),
        policy_loss=PolicyLossConfig(name="ppo", eps_low=0.2, eps_high=0.2),
        aggregation=AggregationConfig(mode="token-mean"),
        hinge_kl=HingeKLConfig(enabled=True, beta=1.0, delta=0.01, mastered_threshold=1.0),
    )


def mcpo_margin() -> AlgorithmConfig:
    """MCPO + margin credit (MCPO, arXiv 2604.16972): :func:`mcpo` with the top-2-margin token credit (thresholds
    ours: tau_lo = 0.3, tau_hi = 0.9, floor = 0.5; see :mod:`.margin_credit`)."""
    return AlgorithmConfig.from_dict({"name": "mcpo_margin", "margin_credit": {"enabled": True}}, base=mcpo())


PRESETS: dict[str, Callable[[], AlgorithmConfig]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "dapo": dapo,
    "cispo": cispo,
    "gspo": gspo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "cpgd": cpgd,
    "f_grpo": f_grpo,
    "f_dapo": f_dapo,
    "f_cispo": f_cispo,
    "mcpo": mcpo,
    "mcpo_margin": mcpo_margin,
}


def preset_key(name: str) -> str:
    """The PRESETS key of ``name``: case, spaces, '-' and '+' do not matter ("MCPO + margin" -> mcpo_margin). An
    unknown name is a ValueError that suggests the closest preset."""
    key = str(name).strip().lower().replace(" ", "").replace("-", "_").replace("+", "_")
    if key not in PRESETS:
        close = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} (available: {', '.join(PRESETS)})")
    return key


def preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """The named preset (see :func:`preset_key`) with nested overrides, e.g. ``preset("cpgd", drift={"coef": 0.02})``;
    the ``algorithm:`` section of a run config is this preset with its other keys as overrides."""
    cfg = PRESETS[preset_key(name)]()
    return AlgorithmConfig.from_dict(overrides, base=cfg) if overrides else cfg
