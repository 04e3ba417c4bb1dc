"""The ``model.lora`` section: low-rank adapters on the policy's linear layers (the base weights stay frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""Megatron linears that can carry an adapter: the fused query/key/value projection, the attention output
projection, the (gate/up) MLP input and the MLP output. In Hugging Face names: q/k/v_proj, o_proj, gate/up_proj,
down_proj."""

LORA_INITS = ("kaiming", "gaussian")
"""How A starts (B always starts at zero, so a fresh adapter leaves the model unchanged): ``kaiming`` is PEFT's
default (uniform in +-1/sqrt(fan_in)), ``gaussian`` draws A from N(0, 1/r)."""

LORA_SYNCS = ("merged", "adapter")
"""How the rollout engine receives the policy: ``merged`` streams W + (alpha/r) B A (any engine, the same weights the
trainer uses); ``adapter`` loads the base weights once and then only the adapter folder (vLLM ``LoRARequest``)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA) on the policy's Megatron linears."""

    rank: int = 16
    """Adapter rank r."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B A to each target weight."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (0 keeps the statistics of the update exact)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which linears get adapters, among ``qkv``, ``proj``, ``fc1``, ``fc2``."""
    init: str = "kaiming"
    """Initialisation of A: ``kaiming`` or ``gaussian``."""
    sync: str = "merged"
    """How the rollout engine gets the adapted policy: ``merged`` or ``adapter`` (vLLM only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"model.lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = list(self.targets)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ValueError(
                f"model.lora.targets must be distinct names among {LORA_TARGETS} (at least one), got {targets}"
            )
        if self.init not in LORA_INITS:
            raise ValueError(f"model.lora.init must be one of {LORA_INITS}, got {self.init!r}")
        if self.sync not in LORA_SYNCS:
            raise ValueError(f"model.lora.sync must be one of {LORA_SYNCS}, got {self.sync!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank
