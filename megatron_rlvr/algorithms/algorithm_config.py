"""The full algorithm configuration: one typed dataclass composing the per-component configs. They are all here, in
one torch-free module, so ``plan`` and the launchers validate a run file without importing torch; each component's
math (advantages.py, policy_losses.py, ...) imports its config from here. Build one from a preset (:mod:`.presets`)
or a nested dict (``AlgorithmConfig.from_dict``, e.g. a YAML section); unknown keys are errors that name the key and
list the valid ones."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

STD_KINDS = ("population", "unbiased")
"""Group standard deviation: population (divide by n) or unbiased (n - 1)."""
CPGD_WEIGHTS = ("equal", "std", "clip_filter_like")
"""CPGD advantage weights (cpgd.py)."""

# The names each registry of functions must hold (the registries live with their torch code and check themselves
# against these names at import; the config validates names without importing torch).
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "cpgd")
AGGREGATION_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSS_NAMES = ("ppo", "dual_clip", "cispo", "gspo", "pg", "cpgd")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
DISTILL_ESTIMATORS = ("sampled", "full")
"""On-policy distillation's reverse-KL estimate per token (distill.py)."""
DISTILL_MODES = ("loss", "advantage")
"""Where the distillation term enters: a loss term, or a per-token advantage term (distill.py)."""
DUAL_CLIP_LOSSES = ("ppo", "dual_clip", "gspo")
"""Policy losses whose negative-advantage branch ``policy_loss.dual_clip`` caps."""


def check_registry(registry: dict, names: tuple[str, ...], what: str) -> None:
    """A registry of functions holds exactly the names the config accepts (run at the registry's import)."""
    if tuple(registry) != names:
        raise RuntimeError(f"{what}: the registry {tuple(registry)} and the config's names {names} differ")


# advantages.py


@dataclass
class AdvantageConfig:
    """Group advantage estimator and the scalings composed on top of it."""

    estimator: str = "grpo"
    """One of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``cpgd``."""
    std: str = "population"
    """Std used by ``grpo``, ``reinforce_pp`` whitening and ``cpgd`` std weights: ``population`` or ``unbiased``."""
    eps: float = 1e-6
    """eps in (r - mean) / (std + eps) for ``grpo`` and the ``reinforce_pp`` whitening."""
    cpgd_weight: str = "std"
    """CPGD advantage weight: ``equal``, ``std`` or ``clip_filter_like`` (MM-EUREKA default ``std``)."""
    cpgd_std_eps: float = 1e-9
    """eps of the CPGD ``std`` weight (CPGD uses 1e-9)."""
    cpgd_weight_max: float = 3.0
    """Cap of the CPGD clip-filter-like weight (CPGD uses 3.0)."""
    focal_gamma: float = 0.0
    """F-GRPO exponent gamma; 0 reproduces the base estimator exactly (F-GRPO presets use 0.5)."""
    reward_correct: float = 1.0
    """R_correct: reward of a correct rollout (F-GRPO mu_pos; default correctness threshold)."""
    reward_wrong: float = 0.0
    """R_wrong: reward of a wrong rollout."""
    mcpo_query_weight: bool = False
    """Divide advantages by MCPO's scale(p) (p = rollout accuracy of the prompt)."""

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATOR_NAMES:
            raise ValueError(
                f"AdvantageConfig.estimator must be one of {sorted(ADVANTAGE_ESTIMATOR_NAMES)}, got {self.estimator!r}"
            )
        if self.std not in STD_KINDS:
            raise ValueError(f"AdvantageConfig.std must be one of {STD_KINDS}, got {self.std!r}")
        if self.cpgd_weight not in CPGD_WEIGHTS:
            raise ValueError(f"AdvantageConfig.cpgd_weight must be one of {CPGD_WEIGHTS}, got {self.cpgd_weight!r}")
        for name in ("eps", "cpgd_std_eps", "focal_gamma"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"AdvantageConfig.{name} must be a finite number >= 0, got {v}")
        if not (self.cpgd_weight_max >= 1 and math.isfinite(self.cpgd_weight_max)):
            raise ValueError(
                f"AdvantageConfig.cpgd_weight_max must be a finite number >= 1, got {self.cpgd_weight_max}"
            )
        if not (math.isfinite(self.reward_correct) and math.isfinite(self.reward_wrong)):
            raise ValueError("AdvantageConfig.reward_correct and reward_wrong must be finite")
        if not self.reward_correct > self.reward_wrong:
            raise ValueError(
                f"AdvantageConfig.reward_correct ({self.reward_correct}) must exceed reward_wrong ({self.reward_wrong})"
            )

    @property
    def correct_threshold(self) -> float:
        """A rollout whose reward is >= this counts as correct when the verifier's verdict is not at hand: the
        midpoint (R_correct + R_wrong) / 2."""
        return 0.5 * (self.reward_correct + self.reward_wrong)


# aggregation.py


@dataclass
class AggregationConfig:
    """How per-token loss terms are reduced to the micro-batch loss."""

    mode: str = "token-mean"
    """One of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``."""
    token_sum_norm: float | None = None
    """The constant C of ``seq-mean-token-sum-norm`` (Dr.GRPO uses the maximum response length); required by that
    mode and ignored by the others."""

    def __post_init__(self) -> None:
        if self.mode not in AGGREGATION_NAMES:
            raise ValueError(f"AggregationConfig.mode must be one of {sorted(AGGREGATION_NAMES)}, got {self.mode!r}")
        if self.mode == "seq-mean-token-sum-norm":
            if self.token_sum_norm is None or not (self.token_sum_norm > 0):
                raise ValueError(
                    "AggregationConfig.token_sum_norm must be a positive number (e.g. the maximum response length) "
                    f"when mode='seq-mean-token-sum-norm', got {self.token_sum_norm!r}"
                )


# policy_losses.py


@dataclass
class PolicyLossConfig:
    """Which per-token policy loss, and its clip ranges."""

    name: str = "ppo"
    """One of ``ppo``, ``dual_clip``, ``cispo``, ``gspo``, ``pg``, ``cpgd``."""
    eps_low: float | None = 0.2
    """Lower clip range (ratio >= 1 - eps_low; CPGD: log-ratio >= ln(1 - eps_low)). ``None`` only for ``cispo``
    (no lower bound on the IS weight, as in MiniMax-M1)."""
    eps_high: float = 0.2
    """Upper clip range (ratio <= 1 + eps_high). DAPO clip-higher: 0.28; GSPO: 4e-4; CISPO: 0.28 (ours)."""
    dual_clip_c: float = 3.0
    """Dual-clip constant c > 1 (``dual_clip``, or ``dual_clip: true``): a negative-advantage token's loss is capped
    at -c A, so its gradient is at most c |A|."""
    dual_clip: bool = False
    """Apply the dual clip to ``ppo`` or ``gspo`` (for GSPO the cap acts on the sequence ratio's token form). The
    ``dual_clip`` loss is ``ppo`` with this always on; other losses have no ratio to cap and refuse it."""
    log_ratio_clamp: float = 20.0
    """|logp - logp_old| is clamped to this before exp, for numerical safety (and gradient 0 beyond it)."""
    seq_log_ratio_clamp: float = 10.0
    """``gspo`` only: the sequence log-ratio log s_i = mean_t log r_it is clamped to <= this (verl's 10), so the
    loss is at most e^this |A| and its gradient is 0 above the clamp, as for a token past ``log_ratio_clamp``."""

    def __post_init__(self) -> None:
        if self.name not in POLICY_LOSS_NAMES:
            raise ValueError(f"PolicyLossConfig.name must be one of {sorted(POLICY_LOSS_NAMES)}, got {self.name!r}")
        if self.eps_low is None:
            if self.name != "cispo":
                raise ValueError(
                    f"PolicyLossConfig.eps_low=None (no lower clip) is only valid for 'cispo', not {self.name!r}"
                )
        elif not (0.0 <= self.eps_low < 1.0):
            raise ValueError(f"PolicyLossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if not (self.eps_high >= 0 and math.isfinite(self.eps_high)):
            raise ValueError(f"PolicyLossConfig.eps_high must be a finite number >= 0, got {self.eps_high}")
        if not (self.dual_clip_c > 1 and math.isfinite(self.dual_clip_c)):
            raise ValueError(f"PolicyLossConfig.dual_clip_c must be a finite number > 1, got {self.dual_clip_c}")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"PolicyLossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if not (self.seq_log_ratio_clamp > 0 and math.isfinite(self.seq_log_ratio_clamp)):
            raise ValueError(
                f"PolicyLossConfig.seq_log_ratio_clamp must be a finite number > 0, got {self.seq_log_ratio_clamp}"
            )
        if not isinstance(self.dual_clip, bool):
            raise ValueError(f"PolicyLossConfig.dual_clip must be true or false, got {self.dual_clip!r}")
        if self.dual_clip and self.name not in DUAL_CLIP_LOSSES:
            raise ValueError(
                f"PolicyLossConfig.dual_clip=true applies to {', '.join(DUAL_CLIP_LOSSES)} only, not {self.name!r} "
                "(it caps the loss of a ratio; this loss has none to cap)"
            )


# regularizers.py


@dataclass
class RefKLConfig:
    """KL penalty to a frozen reference policy."""

    coef: float = 0.0
    """Coefficient; 0 disables the term (then no reference log-probs are needed)."""
    estimator: str = "k3"
    """``k1``, ``k2``, ``k3`` (from per-token log-probs) or ``exact`` (full-vocabulary KL from the ops)."""
    k3_clamp: float = 10.0
    """Upper clamp of the k3 value (verl uses 10)."""

    def __post_init__(self) -> None:
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            raise ValueError(f"RefKLConfig.coef must be a finite number >= 0, got {self.coef}")
        if self.estimator not in (*KL_ESTIMATOR_NAMES, "exact"):
            raise ValueError(
                f"RefKLConfig.estimator must be one of {[*KL_ESTIMATOR_NAMES, 'exact']}, got {self.estimator!r}"
            )
        if not self.k3_clamp > 0:
            raise ValueError(f"RefKLConfig.k3_clamp must be > 0, got {self.k3_clamp}")


# regularizers.py


@dataclass
class EntropyConfig:
    """Entropy bonus."""

    coef: float = 0.0
    """Coefficient of the bonus (loss -= coef * aggregated entropy); 0 disables it."""

    def __post_init__(self) -> None:
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            raise ValueError(f"EntropyConfig.coef must be a finite number >= 0, got {self.coef}")


# mcpo.py


@dataclass
class HingeKLConfig:
    """MCPO hinge-KL regulariser on mastered prompts."""

    enabled: bool = False
    """Add the hinge-KL term to the loss (needs ``mastered_B`` in the loss inputs)."""
    beta: float = 1.0
    """Coefficient of the term (MCPO default 1.0)."""
    delta: float = 0.01
    """Half-width of the dead band on d = logp_new - logp_old (MCPO default 0.01)."""
    mastered_threshold: float = 1.0
    """A prompt is mastered when its rollout accuracy is >= this (1.0 = all rollouts correct)."""
    min_group_size: int = 2
    """...and it has at least this many valid rollouts (one lucky rollout is not mastery). Ours: 2."""

    def __post_init__(self) -> None:
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ValueError(f"HingeKLConfig.beta must be a finite number >= 0, got {self.beta}")
        if not (self.delta >= 0 and math.isfinite(self.delta)):
            raise ValueError(f"HingeKLConfig.delta must be a finite number >= 0, got {self.delta}")
        if not (0.0 < self.mastered_threshold <= 1.0):
            raise ValueError(f"HingeKLConfig.mastered_threshold must be in (0, 1], got {self.mastered_threshold}")
        if int(self.min_group_size) != self.min_group_size or self.min_group_size < 1:
            raise ValueError(f"HingeKLConfig.min_group_size must be an integer >= 1, got {self.min_group_size}")


# cpgd.py


@dataclass
class PolicyDriftConfig:
    """CPGD policy-drift regulariser."""

    coef: float = 0.0
    """Coefficient of the drift term; 0 disables it (the CPGD preset uses 0.01)."""
    clip: float = 2.0
    """c: the drift gradient weight r - 1 is capped at c (CPGD default 2.0)."""

    def __post_init__(self) -> None:
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            raise ValueError(f"PolicyDriftConfig.coef must be a finite number >= 0, got {self.coef}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"PolicyDriftConfig.clip must be a finite number > 0, got {self.clip}")


# margin_credit.py


@dataclass
class MarginCreditConfig:
    """Token credit from the top-2 margin (MCPO). Thresholds are ours (paper values not public)."""

    enabled: bool = False
    """Reweight per-token advantages by margin credit (needs ``margin_BT`` in the loss inputs)."""
    tau_lo: float = 0.3
    """Margins at or below this get full credit 1 (ours)."""
    tau_hi: float = 0.9
    """Margins at or above this get the floor credit (ours)."""
    floor: float = 0.5
    """Credit of confident tokens, in [0, 1] (ours)."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.tau_lo < self.tau_hi <= 1.0):
            raise ValueError(
                f"MarginCreditConfig needs 0 <= tau_lo < tau_hi <= 1, got tau_lo={self.tau_lo}, tau_hi={self.tau_hi}"
            )
        if not (0.0 <= self.floor <= 1.0):
            raise ValueError(f"MarginCreditConfig.floor must be in [0, 1], got {self.floor}")


# dapo.py


@dataclass
class DapoConfig:
    """DAPO reward shaping and sample filtering switches."""

    overlong_shaping: bool = False
    """Add the soft overlong penalty to rewards (DAPO preset: on)."""
    max_response_len: int = 20480
    """L_max in tokens (DAPO: 20480)."""
    overlong_buffer_len: int = 4096
    """L_buf in tokens (DAPO: 4096): the penalty ramps from 0 to -factor over the last L_buf tokens."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty (DAPO: 1.0)."""
    mask_truncated: bool = False
    """Zero the loss mask of truncated responses (overlong filtering; DAPO's alternative to shaping)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO preset: on)."""

    def __post_init__(self) -> None:
        if int(self.max_response_len) != self.max_response_len or self.max_response_len < 1:
            raise ValueError(f"DapoConfig.max_response_len must be a positive integer, got {self.max_response_len}")
        if int(self.overlong_buffer_len) != self.overlong_buffer_len or not (
            1 <= self.overlong_buffer_len <= self.max_response_len
        ):
            raise ValueError(
                f"DapoConfig.overlong_buffer_len must be an integer in [1, max_response_len={self.max_response_len}], "
                f"got {self.overlong_buffer_len}"
            )
        if not (self.overlong_penalty_factor >= 0 and math.isfinite(self.overlong_penalty_factor)):
            raise ValueError(
                f"DapoConfig.overlong_penalty_factor must be a finite number >= 0, got {self.overlong_penalty_factor}"
            )


# distill.py


@dataclass
class DistillConfig:
    """On-policy distillation from a frozen teacher: the student's own samples are scored by the teacher and the
    student minimises the per-token reverse KL(p_student || p_teacher) (docs/algorithms.md, "On-policy
    distillation"). Off unless ``teacher`` is set."""

    teacher: str | None = None
    """The teacher model, named as ``model.name`` / ``model.hf_path`` name the policy: a built-in tiny model
    (``tiny``), or an HF model folder (its weights and tokenizer). Loaded frozen on the training ranks at the
    policy's TP / PP layout, like the reference model; it may be larger than the student but must share its
    tokenizer. None: no distillation."""
    teacher_seed: int | None = None
    """Seed of a built-in tiny teacher's random init (None: ``train.seed``, i.e. the student's own start weights).
    Ignored for a teacher loaded from a folder."""
    estimator: str = "sampled"
    """``sampled``: log p_s(y) - log p_t(y) at the sampled token y only (the teacher's log-prob of y from a
    forward-only pass before the update); ``full``: the exact reverse KL over the whole vocabulary per token, from
    the teacher's logits shard in the same micro-batch (needs ``parallel.pp=1`` and ``mode=loss``)."""
    mode: str = "loss"
    """``loss``: add ``coef`` x the reverse KL, aggregated like every loss term, to the policy loss; ``advantage``:
    add ``-coef * (log p_s(y) - log p_t(y))`` to each token's advantage (``sampled`` only), as the on-policy
    distillation of prime-rl, NeMo-RL and Thinking Machines does."""
    coef: float = 1.0
    """Weight of the distillation term (> 0)."""
    reward_weight: float = 1.0
    """Weight of the verifiable reward's advantage (>= 0); 0: distillation alone."""

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    def __post_init__(self) -> None:
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher):
            raise ValueError(f"DistillConfig.teacher must be a model name or HF folder, got {self.teacher!r}")
        if self.teacher_seed is not None and (not isinstance(self.teacher_seed, int) or self.teacher_seed < 0):
            raise ValueError(f"DistillConfig.teacher_seed must be an integer >= 0 or null, got {self.teacher_seed!r}")
        if self.estimator not in DISTILL_ESTIMATORS:
            raise ValueError(f"DistillConfig.estimator must be one of {DISTILL_ESTIMATORS}, got {self.estimator!r}")
        if self.mode not in DISTILL_MODES:
            raise ValueError(f"DistillConfig.mode must be one of {DISTILL_MODES}, got {self.mode!r}")
        if not (isinstance(self.coef, (int, float)) and self.coef > 0 and math.isfinite(self.coef)):
            raise ValueError(f"DistillConfig.coef must be a finite number > 0, got {self.coef!r}")
        rw = self.reward_weight
        if not (isinstance(rw, (int, float)) and rw >= 0 and math.isfinite(rw)):
            raise ValueError(f"DistillConfig.reward_weight must be a finite number >= 0, got {rw!r}")
        if self.estimator == "full" and self.mode == "advantage":
            raise ValueError(
                "DistillConfig: estimator=full needs mode=loss (the exact KL over the vocabulary is a differentiable "
                "loss, not a per-token reward of the sampled token); use estimator=sampled for mode=advantage"
            )


@dataclass
class AlgorithmConfig:
    """Everything that defines an RLVR algorithm of the GRPO family."""

    name: str = "custom"
    """Label for logs (a preset sets its own name)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Group advantage estimator, F-GRPO focal scaling, MCPO query weights."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Per-token policy loss and its clip ranges."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """Reduction of every per-token term to the micro-batch loss (global normalisers)."""
    ref_kl: RefKLConfig = field(default_factory=RefKLConfig)
    """KL penalty to the reference policy (k1/k2/k3 or exact)."""
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    """Entropy bonus."""
    hinge_kl: HingeKLConfig = field(default_factory=HingeKLConfig)
    """MCPO hinge-KL on mastered prompts (also defines 'mastered' for metrics)."""
    drift: PolicyDriftConfig = field(default_factory=PolicyDriftConfig)
    """CPGD policy-drift regulariser."""
    margin_credit: MarginCreditConfig = field(default_factory=MarginCreditConfig)
    """MCPO top-2-margin token credit."""
    dapo: DapoConfig = field(default_factory=DapoConfig)
    """DAPO overlong shaping, truncation masking, dynamic sampling."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (off unless ``distill.teacher`` is set)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "name":
                if not isinstance(self.name, str) or not self.name:
                    raise ValueError(f"AlgorithmConfig.name must be a non-empty string, got {self.name!r}")
                continue
            v = getattr(self, f.name)
            if not isinstance(v, _SECTIONS[f.name]):
                raise ValueError(
                    f"AlgorithmConfig.{f.name} must be a {_SECTIONS[f.name].__name__}, got {type(v).__name__} "
                    "(use AlgorithmConfig.from_dict for nested dicts)"
                )
        if self.hinge_kl.enabled and self.dapo.dynamic_sampling:
            # DAPO's dynamic sampling (Sec. 3.2) keeps only groups with mixed rewards, i.e. drops every mastered
            # prompt: the hinge-KL, which acts on mastered prompts only, would silently never act.
            raise ValueError(
                "algorithm.hinge_kl.enabled=true with algorithm.dapo.dynamic_sampling=true: dynamic sampling drops "
                "every mastered prompt (all rollouts correct), so the hinge-KL would never see one; set "
                "algorithm.dapo.dynamic_sampling=false (as the mcpo preset does) or algorithm.hinge_kl.enabled=false"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: AlgorithmConfig | None = None) -> AlgorithmConfig:
        """Build from a nested dict, overriding ``base`` (defaults if None) field by field."""
        if not isinstance(d, dict):
            raise ValueError(f"AlgorithmConfig.from_dict expects a dict, got {type(d).__name__}")
        base = base or cls()
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            names = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"AlgorithmConfig: unknown key(s) {sorted(unknown)}; valid keys: {names}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            cur = getattr(base, f.name)
            if f.name not in d:
                kwargs[f.name] = cur
                continue
            new = d[f.name]
            if f.name == "name" or not isinstance(new, dict):
                kwargs[f.name] = new
                continue
            section = _SECTIONS[f.name]
            valid = {sf.name for sf in dataclasses.fields(section)}
            bad = set(new) - valid
            if bad:
                raise ValueError(f"AlgorithmConfig.{f.name}: unknown key(s) {sorted(bad)}; valid keys: {sorted(valid)}")
            kwargs[f.name] = dataclasses.replace(cur, **new)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "advantage": AdvantageConfig,
    "policy_loss": PolicyLossConfig,
    "aggregation": AggregationConfig,
    "ref_kl": RefKLConfig,
    "entropy": EntropyConfig,
    "hinge_kl": HingeKLConfig,
    "drift": PolicyDriftConfig,
    "margin_credit": MarginCreditConfig,
    "dapo": DapoConfig,
    "distill": DistillConfig,
}
