"""Resume semantics (docs/training.md, "Resuming"): what a re-run of a run directory may change, and which
checkpoint it continues from.

- One-off options (``checkpoint.resume``, ``allow_changes``, ``fallback``: config.ONE_OFF_OPTIONS) act on this
  invocation only and are never written into the run's config.yaml.
- Options compared with the run's config.yaml when a checkpoint will be resumed: the ones in ``APPLIED_ON_RESUME``
  (length of the run, cadence, logging, eval, layout, reward-worker resources) are applied and listed; any other
  change (algorithm, model, data, rollout, train, optimizer, reward function) would silently turn the run into a
  different one, so it is refused with the list of differences, unless ``checkpoint.allow_changes=true``.
- Checkpoint choice: the newest complete checkpoint whose files match the sizes recorded at save time; a corrupt
  or incomplete one is reported by path and skipped for the previous one (``checkpoint.fallback=false``: refuse).
"""

from __future__ import annotations

import os

from megatron_rlvr.rundir.checkpointer import ResumeError, checkpoint_dir

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

    from megatron_rlvr.config import RunConfig
    from megatron_rlvr.config.loader import _plain

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
    from megatron_rlvr.models.checkpointing import list_checkpoints

    how = cfg.checkpoint.resume
    return how != "never" and (how != "auto" or bool(list_checkpoints(checkpoint_dir(run_dir))))


def check_resume_changes(cfg, run_dir: str) -> list[str]:
    """Compare ``cfg`` with ``<run_dir>/config.yaml`` before a resume; returns the applied changes as lines, raises
    ResumeError listing the refused ones."""
    import yaml

    from megatron_rlvr.config import ONE_OFF_OPTIONS, persisted_dict

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path) or not will_resume(cfg, run_dir):
        return []
    with open(path) as f:
        old = yaml.safe_load(f) or {}
    changes = [c for c in config_changes(old, persisted_dict(cfg)) if tuple(c[0].split(".", 1)) not in ONE_OFF_OPTIONS]
    applied = [c for c in changes if c[0].startswith(APPLIED_ON_RESUME)]
    refused = [c for c in changes if not c[0].startswith(APPLIED_ON_RESUME) and not _not_a_change(*c)]
    applied += [c for c in changes if not c[0].startswith(APPLIED_ON_RESUME) and _not_a_change(*c)]
    if refused and not cfg.checkpoint.allow_changes:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused[:12])
        more = f" (and {len(refused) - 12} more)" if len(refused) > 12 else ""
        raise ResumeError(
            f"{run_dir} has checkpoints to resume from, but these options differ from its config.yaml and would "
            f"change the run mid-way: {shown}{more}. Start a new run (logging.run_dir=NEW_DIR), resume unchanged, or "
            "pass checkpoint.allow_changes=true to apply them to the resumed run"
        )
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in applied + refused]
