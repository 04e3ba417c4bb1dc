"""The full algorithm configuration: one typed dataclass composing the per-component configs, each defined next to
the code it configures. Build one from a preset (:mod:`.presets`) or a nested dict (``AlgorithmConfig.from_dict``,
e.g. a YAML section); unknown keys are errors that name the key and list the valid ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .advantages import AdvantageConfig
from .aggregation import AggregationConfig
from .cpgd import PolicyDriftConfig
from .dapo import DapoConfig
from .margin_credit import MarginCreditConfig
from .mcpo import HingeKLConfig
from .policy_losses import PolicyLossConfig
from .regularizers import EntropyConfig, RefKLConfig


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
}
