"""Resume semantics (docs/training.md, "Resuming"): what a re-run of a run directory may change, and which
checkpoint it continues from.

- One-off options (``checkpoint.resume``, ``allow_changes``, ``fallback``: config.ONE_OFF_OPTIONS) act on this
  invocation only and are never written into the run's config.yaml.
- Options compared with the run's config.yaml when a checkpoint will be resumed: the ones in ``APPLIED_ON_RESUME``
  (length of the run, cadence, logging, eval, layout, reward-worker resources) are applied and listed; any other
  change (algorithm, model, data, rollout, train, optimizer, reward function) would silently turn the run into a
  different one, so it is refused with the list of differences, unless ``checkpoint.allow_changes=true``.
- LoRA adapters are also compared with the checkpoint's own metadata (config.yaml may not be what the checkpoint was
  saved with): a rank or target list that differs is refused even with ``allow_changes`` (the saved tensors have
  their shapes), another alpha, dropout or sync is a change like any other.
- Checkpoint choice: the newest complete checkpoint whose files match the sizes recorded at save time; a corrupt
  or incomplete one is reported by path and skipped for the previous one (``checkpoint.fallback=false``: refuse).
"""

from __future__ import annotations

import os

from megatron_rlvr.config import ONE_OFF_OPTIONS, RunConfig, persisted_dict
from megatron_rlvr.config.loader import _plain
from megatron_rlvr.config.lora_config import adapter_changes, adapter_refusal
from megatron_rlvr.models.checkpointing import META_FILE, list_checkpoints, read_meta
from megatron_rlvr.rundir.checkpointer import ResumeError, candidates, checkpoint_dir

APPLIED_ON_RESUME = (
    "schedule.steps",
    "checkpoint.",
    "logging.",
    "eval.",
    "launch.",
    "parallel.",
    "cluster.",
    "reward.num_workers",
    "reward.timeout_s",
    "reward.kill_grace_s",
    "reward.start_timeout_s",
    "reward.max_error_frac",
)
"""Prefixes of dotted options a resumed run may change; they take effect from the resumed step on."""


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every option that differs between two resolved configs."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


_NO_DEFAULT = object()


def field_default(dotted: str):
    """The dataclass default of a dotted RunConfig option (as plain YAML data), or ``_NO_DEFAULT``."""
    import dataclasses
    import typing

    cls, parts = RunConfig, dotted.split(".")
    for i, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        f = fields.get(name)
        if f is None:
            return _NO_DEFAULT
        if i < len(parts) - 1:
            try:
                cls = typing.get_type_hints(cls).get(name)
            except Exception:  # an annotation that does not resolve: no default known, the change is reported
                return _NO_DEFAULT
            continue
        if f.default is not dataclasses.MISSING:
            return _plain(f.default)
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            return _plain(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
    return _NO_DEFAULT


def _not_a_change(key: str, old, new) -> bool:
    """A config.yaml written by an older version lacks the options added since (at their defaults nothing changed)
    and may hold options since removed (nothing this version could apply)."""
    return new == "<unset>" or (old == "<unset>" and field_default(key) == new)


def will_resume(cfg, run_dir: str) -> bool:

    how = cfg.checkpoint.resume
    return how != "never" and (how != "auto" or bool(list_checkpoints(checkpoint_dir(run_dir))))


def checkpoint_to_resume(cfg, run_dir: str) -> str | None:
    """The checkpoint a resume will start from, as far as can be told before loading it: the newest complete one
    named by ``checkpoint.resume`` (the loader may still fall back to an older one if its files are damaged)."""

    how = cfg.checkpoint.resume
    if how == "never":
        return None
    if how != "auto" and os.path.isfile(os.path.join(how, META_FILE)):
        return how
    found = candidates(checkpoint_dir(run_dir)) if how == "auto" else candidates(how)
    found = found or ([] if how == "auto" else candidates(os.path.join(how, "checkpoints")))
    return found[0] if found else None


def _checkpoint_adapter_changes(cfg, ckpt: str | None) -> list[tuple[str, object, object]]:
    """The adapter settings that differ from checkpoint ``ckpt``'s own; ResumeError if its adapters cannot fit."""
    import dataclasses

    if ckpt is None:
        return []
    try:
        saved = read_meta(ckpt).get("lora")
    except (OSError, ValueError):  # unreadable metadata: the loader reports the checkpoint as damaged
        return []
    current = dataclasses.asdict(cfg.model.lora) if cfg.model.lora is not None else None
    refusal = adapter_refusal(saved, current, ckpt)
    if refusal:
        raise ResumeError(refusal)
    return adapter_changes(saved, current)


def check_resume_changes(cfg, run_dir: str) -> list[str]:
    """Compare ``cfg`` with ``<run_dir>/config.yaml`` and with the adapter settings of the checkpoint it resumes
    before a resume; returns the applied changes as lines, raises ResumeError listing the refused ones."""
    import yaml

    if not will_resume(cfg, run_dir):
        return []
    path = os.path.join(run_dir, "config.yaml")
    changes = []
    if os.path.isfile(path):
        with open(path) as f:
            old = yaml.safe_load(f) or {}
        changes = config_changes(old, persisted_dict(cfg))
        changes = [c for c in changes if tuple(c[0].split(".", 1)) not in ONE_OFF_OPTIONS]
    ckpt = checkpoint_to_resume(cfg, run_dir)
    from_ckpt = _checkpoint_adapter_changes(cfg, ckpt)
    if from_ckpt:  # what the checkpoint was saved with wins over what config.yaml says
        keys = {k for k, _, _ in from_ckpt}
        changes = sorted([c for c in changes if c[0] not in keys] + from_ckpt)
    applied = [c for c in changes if c[0].startswith(APPLIED_ON_RESUME)]
    refused = [c for c in changes if not c[0].startswith(APPLIED_ON_RESUME) and not _not_a_change(*c)]
    applied += [c for c in changes if not c[0].startswith(APPLIED_ON_RESUME) and _not_a_change(*c)]
    if refused and not cfg.checkpoint.allow_changes:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused[:12])
        more = f" (and {len(refused) - 12} more)" if len(refused) > 12 else ""
        source = f"its config.yaml or from checkpoint {ckpt}" if from_ckpt else "its config.yaml"
        raise ResumeError(
            f"{run_dir} has checkpoints to resume from, but these options differ from {source} and would "
            f"change the run mid-way: {shown}{more}. Start a new run (logging.run_dir=NEW_DIR), resume unchanged, or "
            "pass checkpoint.allow_changes=true to apply them to the resumed run"
        )
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in applied + refused]
