"""The ``model.lora`` section: low-rank adapters on the policy's linear layers (the base weights stay frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""Megatron linears that can carry an adapter: the fused query/key/value projection, the attention output
projection, the (gate/up) MLP input and the MLP output. In Hugging Face names: q/k/v_proj, o_proj, gate/up_proj,
down_proj."""

MLA_LORA_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")
"""The projections of multi-latent attention (DeepSeek-V2/V3), besides ``proj`` (o_proj): in Hugging Face names
q_a_proj (query down projection), q_b_proj (query up projection; q_proj when ``q_lora_rank`` is null),
kv_a_proj_with_mqa (latent and shared RoPE key down projection) and kv_b_proj (key/value up projection)."""

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
    """Which linears get adapters, among ``qkv``, ``proj``, ``fc1``, ``fc2``; on multi-latent attention ``q_a``,
    ``q_b``, ``kv_a``, ``kv_b`` in place of ``qkv``."""
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
        bad = [t for t in targets if t not in LORA_TARGETS + MLA_LORA_TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ValueError(
                f"model.lora.targets must be distinct names among {LORA_TARGETS + MLA_LORA_TARGETS} (at least one), "
                f"got {targets}"
            )
        if self.init not in LORA_INITS:
            raise ValueError(f"model.lora.init must be one of {LORA_INITS}, got {self.init!r}")
        if self.sync not in LORA_SYNCS:
            raise ValueError(f"model.lora.sync must be one of {LORA_SYNCS}, got {self.sync!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


LORA_SHAPE_FIELDS = ("rank", "targets")
"""Settings that give the adapters their tensors (shapes, which linears): a checkpoint's adapters fit no others."""
LORA_RESUMED_FIELDS = ("alpha", "dropout", "sync")
"""Settings that change how saved adapters are used (a resume that changes them needs checkpoint.allow_changes)."""


def adapter_refusal(saved: dict | None, current: dict | None, ckpt: str) -> str | None:
    """Why the adapters of checkpoint ``ckpt`` (``saved``: the ``model.lora`` settings recorded in its metadata, None
    for a full-weight checkpoint) cannot be loaded into a policy with ``current`` settings, in one line; None if they
    fit. No option makes them fit: the checkpoint's tensors have their shapes."""
    if saved is None and current is None:
        return None
    if saved is None:
        return (
            f"checkpoint {ckpt} holds full weights, not LoRA adapters: model.lora cannot be added to a run on resume; "
            "resume without model.lora, or start a new run (logging.run_dir=NEW_DIR)"
        )
    if current is None:
        return (
            f"checkpoint {ckpt} holds LoRA adapters (rank {saved.get('rank')}, targets {saved.get('targets')}) and "
            "this run has no model.lora: resume with the run's model.lora section, or start a new run "
            "(logging.run_dir=NEW_DIR)"
        )
    for key in LORA_SHAPE_FIELDS:
        was, now = saved.get(key), current.get(key)
        if was is not None and was != now:
            return (
                f"model.lora.{key}={_show(now)} does not fit checkpoint {ckpt}, whose adapters were saved with "
                f"model.lora.{key}={_show(was)} (the adapters' tensors have that shape; checkpoint.allow_changes "
                f"cannot change it): resume with model.lora.{key}={_show(was)}, or start a new run "
                "(logging.run_dir=NEW_DIR)"
            )
    return None


def adapter_changes(saved: dict | None, current: dict | None) -> list[tuple[str, object, object]]:
    """(option, the checkpoint's value, this run's value) for every ``LORA_RESUMED_FIELDS`` setting that differs."""
    if not saved or not current:
        return []
    return [
        (f"model.lora.{k}", saved[k], current.get(k))
        for k in LORA_RESUMED_FIELDS
        if k in saved and saved[k] != current.get(k)
    ]


def _show(value) -> str:
    return "[" + ",".join(value) + "]" if isinstance(value, list) else str(value)
