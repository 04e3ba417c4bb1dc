"""Loading a run config: YAML file -> overrides -> environment interpolation -> typed, validated ``RunConfig``.

The library is OmegaConf (structured configs): it merges the YAML file and the ``key=value`` overrides onto each
section's dataclass schema, checks keys and types against the annotations, converts YAML scalars (``1e-6`` read as
a string by YAML 1.1 becomes a float), resolves ``${oc.env:VAR,default}`` interpolation and instantiates the
dataclasses, which then run their own ``__post_init__`` validation. What stays here is only what is specific to
this project: the ``algorithm`` section starts from a named preset instead of the dataclass defaults; our error
messages name the dotted key and suggest the closest valid one; the shell form ``${VAR:-default}`` (used by the
cluster configs since the first version) is accepted as a spelling of OmegaConf's ``${oc.env:VAR,default}``; keys
moved since an older version are migrated with a notice, so an old run directory's config.yaml still loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from megatron_rlvr.algorithms import AlgorithmConfig
from megatron_rlvr.algorithms import preset as algorithm_preset
from megatron_rlvr.config.run import ConfigError, RunConfig, check_teacher, model_hf_config, validate_cross_section

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.yaml"
)
"""``megatron-rlvr train`` without a CONFIG runs this file (the tiny preset)."""

MOVED_KEYS = {
    "rollout.overhead_gb": "cluster.vllm_overhead_gb",
    "rollout.sleep_residual_gb": "cluster.vllm_sleep_residual_gb",
    "train.overhead_gb": "cluster.train_overhead_gb",
    "train.offload_during_rollout": "cluster.offload_during_rollout",
}
"""Planner-only keys that lived in the trainer's sections before the config trees were merged (old -> new)."""

REMOVED_KEYS = {"model.spec": "give the model as model.name (a built-in spec), model.hf_config or model.hf_path"}
"""Keys of older versions that no longer exist, with what to use instead."""

ONE_OFF_OPTIONS = {
    ("checkpoint", "resume"): "auto",
    ("checkpoint", "allow_changes"): False,
    ("checkpoint", "fallback"): True,
}
"""Options that apply to one invocation only: written into config.yaml at their defaults, so a later plain resume
of the run directory does not repeat them (e.g. go back to an old checkpoint.resume=PATH)."""

_SECTIONS = {f.name: f for f in dataclasses.fields(RunConfig)}
_HINTS = typing.get_type_hints(RunConfig)


# ----------------------------------------------------------------------------------------------------------------
# Errors in our words
# ----------------------------------------------------------------------------------------------------------------


def _unknown_key_error(where: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
    full = f"{where}.{key}" if where else key
    return ConfigError(
        f"unknown config key {full!r}{hint} (valid keys in {where or 'the top level'}: {', '.join(valid)})"
    )


def _field_at(cls, parts: list[str]):
    """(parent dataclass, field name, annotation) of a dotted key path below ``cls``; None where it leaves the tree."""
    hint = None
    for i, name in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if name not in hints:
            return cls, name, None
        hint = hints[name]
        if i < len(parts) - 1:
            cls = _strip_optional(hint)
    return cls, parts[-1], hint


def _strip_optional(hint):
    """``X | None`` -> X (other annotations unchanged)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind_of(hint) -> str | None:
    """What a value of this annotation must be, in words (None for dataclasses and anything else)."""
    base = _strip_optional(hint)
    origin = typing.get_origin(base)
    if base in _KINDS:
        return _KINDS[base]
    if origin in (list, tuple):
        return "a list"
    return "a mapping" if dict in (base, origin) else None


def _translate(e: OmegaConfBaseException, cls, where: str, data: dict) -> ConfigError:
    """An OmegaConf error -> ConfigError naming the dotted key, with a did-you-mean for unknown keys."""
    rel = str(getattr(e, "full_key", "") or "")
    parts = [p for p in re.split(r"\.|\[", rel.replace("]", "")) if p]
    full = (f"{where}.{rel}" if where else rel) if rel else where
    msg = str(e).split("\n")[0]
    if isinstance(e, InterpolationResolutionError):
        m = re.search(r"Environment variable '([^']+)' not found", msg)
        if m:
            var = m.group(1)
            return ConfigError(f"{full}: environment variable {var} is not set (use ${{{var}:-default}})")
        return ConfigError(f"{full}: {msg}")
    found = _field_at(cls, parts) if parts else None
    if isinstance(e, ConfigKeyError) and found is not None and found[2] is None:
        parent = ".".join([where, *parts[:-1]])
        return _unknown_key_error(parent, parts[-1], [f.name for f in dataclasses.fields(found[0]) if f.init])
    if found is not None and found[2] is not None:
        kind = _kind_of(found[2])
        value = data
        for p in parts:
            value = value.get(p) if isinstance(value, dict) else None
        if value is None and "None" in msg:
            return ConfigError(f"{full} must not be null")
        if kind:
            return ConfigError(f"{full} must be {kind}, got {value!r}")
    return ConfigError(f"invalid {full}: {msg}")


# ----------------------------------------------------------------------------------------------------------------
# dict -> dataclass
# ----------------------------------------------------------------------------------------------------------------


def _scalars_to_lists(cls, data: dict) -> dict:
    """A single string where the schema has a list (``eval.files: a.jsonl``, ``rollout.stop: "\\n"``) is a list of
    one: the form users write most."""
    if not dataclasses.is_dataclass(cls):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        hint = hints.get(key)
        if hint is None:
            continue
        base = _strip_optional(hint)
        if typing.get_origin(base) is list and isinstance(value, str):
            out[key] = [value]
        elif dataclasses.is_dataclass(base) and isinstance(value, dict):
            out[key] = _scalars_to_lists(base, value)
    return out


def build_section(cls, data: Any, where: str, base: Any = None):
    """One section (a dataclass) from its YAML mapping, merged onto ``base`` (an instance) or the class defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}: {data!r}")
    data = _scalars_to_lists(cls, data)
    schema = OmegaConf.structured(base if base is not None else cls)
    try:
        node = OmegaConf.merge(schema, data)
    except (OmegaConfBaseException, TypeError) as e:
        raise _merge_error(e, schema, cls, where, data) from None
    try:
        return OmegaConf.to_object(node)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise _translate(e, cls, where, data) from None
    except (ValueError, TypeError) as e:  # the dataclass's own __post_init__ validation
        raise ConfigError(f"invalid {where}: {e}") from None


def _merge_error(e: Exception, schema, cls, where: str, data: dict) -> ConfigError:
    """A merge error in our words. One without a key (a mapping where a list belongs raises a bare TypeError) is
    narrowed down by merging the section's keys one at a time."""
    if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
        return _translate(e, cls, where, data)
    for key, value in data.items():
        try:
            OmegaConf.merge(schema, {key: value})
        except (OmegaConfBaseException, TypeError) as e_key:
            if isinstance(e_key, OmegaConfBaseException) and getattr(e_key, "full_key", None):
                return _translate(e_key, cls, where, data)
            hint = typing.get_type_hints(cls).get(key) if dataclasses.is_dataclass(cls) else None
            kind = _kind_of(hint) if hint is not None else None
            if kind:
                return ConfigError(f"{where}.{key} must be {kind}, got {value!r}")
            return ConfigError(f"invalid {where}.{key}: {str(e_key).splitlines()[0]}")
    return ConfigError(f"invalid {where}: {str(e).splitlines()[0]}")


def build_algorithm(data: Any) -> AlgorithmConfig:
    """``algorithm:`` section -> AlgorithmConfig: ``preset`` (default grpo) then nested overrides of its fields."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"algorithm must be a mapping (preset: <name> plus overrides), got {data!r}")
    data = dict(data)
    name = data.pop("preset", None)
    if name is None:
        base = AlgorithmConfig() if data else algorithm_preset("grpo")
    else:
        try:
            base = algorithm_preset(str(name))
        except ValueError as e:
            raise ConfigError(f"algorithm.preset: {e}") from None
    return build_section(AlgorithmConfig, data, "algorithm", base=base)


def build_run_config(raw: dict, check_files: bool = True) -> RunConfig:
    """RunConfig from a nested dict (a parsed YAML file with overrides applied). ``check_files=False`` skips what
    reads the filesystem (the ``check_files`` methods and the model's config.json when it is not there)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a run config must be a mapping of sections, got {type(raw).__name__}")
    for key in raw:
        if key not in _SECTIONS:
            raise _unknown_key_error("", str(key), list(_SECTIONS))
    kwargs: dict[str, Any] = {}
    for name in _SECTIONS:  # in order: a section's own validation must not depend on a later one
        value = raw.get(name)
        kwargs[name] = build_algorithm(value) if name == "algorithm" else build_section(_HINTS[name], value, name)
    cfg = RunConfig(**kwargs)
    if check_files:
        check_run_files(cfg)
    try:
        hf = model_hf_config(cfg.model)
    except ConfigError:
        if check_files:
            raise
        hf = {}
    validate_cross_section(cfg, hf)
    check_teacher(cfg, hf, check_files)
    return cfg


def check_run_files(cfg: RunConfig) -> None:
    """Every file and module the run reads exists (each section's ``check_files``); ConfigError naming the key."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        check = getattr(section, "check_files", None)
        if check is None:
            continue
        try:
            check()
        except ConfigError:
            raise
        except (ValueError, ImportError, OSError) as e:
            raise ConfigError(f"invalid {f.name}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# Files, overrides, environment, migration
# ----------------------------------------------------------------------------------------------------------------


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], YAML-typed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=20)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``key=value`` overrides (YAML-typed values) to a nested dict in place; returns it.

    ``algorithm.preset=X`` on a resolved config (its ``algorithm`` section expanded: ``name``, no ``preset``)
    replaces the whole section: the expanded fields of the old algorithm would otherwise override every field of
    the new preset, silently keeping the old algorithm. It is applied before the other overrides, so
    ``algorithm.<field>=...`` on the same command line refines the new preset."""
    parsed = [parse_override(item) for item in overrides]
    for parts, _value in parsed:
        if parts == ["algorithm", "preset"] and isinstance(raw.get("algorithm"), dict):
            if "preset" not in raw["algorithm"] and "name" in raw["algorithm"]:  # expanded by dump_yaml
                raw["algorithm"] = {}
    parsed.sort(key=lambda pv: pv[0] != ["algorithm", "preset"])  # stable: the preset first, then the rest in order
    for parts, value in parsed:
        node = raw
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {'.'.join(parts)!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def migrate(raw: dict, where: str = "config", warn=None) -> dict:
    """Move keys of older versions (``MOVED_KEYS``) to their place, with a notice; refuse removed ones with what to
    use instead. In place; returns ``raw``."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    for old, new in MOVED_KEYS.items():
        sec, key = old.split(".")
        if isinstance(raw.get(sec), dict) and key in raw[sec]:
            value = raw[sec].pop(key)
            nsec, nkey = new.split(".")
            target = raw.setdefault(nsec, {}) or {}
            raw[nsec] = target
            target.setdefault(nkey, value)
            warn(f"megatron-rlvr: {where}: {old} is now {new} (moved; please update the file)")
    for old, instead in REMOVED_KEYS.items():
        sec, key = old.split(".")
        if isinstance(raw.get(sec), dict) and raw[sec].get(key) is not None:
            raise ConfigError(f"{where}: {old} is no longer supported: {instead}")
        if isinstance(raw.get(sec), dict):
            raw[sec].pop(key, None)
    return raw


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a run config must be a mapping of sections, got {type(raw).__name__}")
    return raw


_SHELL_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def shell_refs_to_omegaconf(obj):
    """``${VAR}`` / ``${VAR:-default}`` -> OmegaConf's ``${oc.env:VAR}`` / ``${oc.env:VAR,'default'}``."""
    if isinstance(obj, dict):
        return {k: shell_refs_to_omegaconf(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shell_refs_to_omegaconf(v) for v in obj]
    if not isinstance(obj, str) or "${" not in obj:
        return obj

    def sub(m):
        if m.group(2) is None:
            return f"${{oc.env:{m.group(1)}}}"
        default = m.group(2).replace("\\", "\\\\").replace("'", "\\'")
        return f"${{oc.env:{m.group(1)},'{default}'}}"

    return _SHELL_REF.sub(sub, obj)


def expand_env(raw: dict, where: str = "") -> dict:
    """A plain dict with every ``${VAR:-default}`` / ``${oc.env:VAR,default}`` reference resolved (OmegaConf);
    an unset variable without a default is a ConfigError naming the key."""
    try:
        return OmegaConf.to_container(OmegaConf.create(shell_refs_to_omegaconf(raw)), resolve=True)
    except OmegaConfBaseException as e:
        raise _translate(e, None, where, raw) from None


def load_raw(path: str | None = None, overrides: list[str] | None = None) -> tuple[str, dict]:
    """(path, the file's dict with overrides applied, old keys migrated, env references in OmegaConf form)."""
    path = path or DEFAULT_CONFIG
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    return path, shell_refs_to_omegaconf(migrate(raw, path))


def load_run_config(path: str | None = None, overrides: list[str] | None = None, check_files: bool = True) -> RunConfig:
    """Read a YAML run config (default: configs/tiny.yaml), apply overrides, resolve environment references and
    validate everything; ``check_files=False`` does not require the files it names to exist here (``plan``)."""
    path, raw = load_raw(path, overrides)
    cfg = build_run_config(raw, check_files)
    if not cfg.logging.name:
        cfg.logging.name = os.path.splitext(os.path.basename(path))[0]
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Writing the resolved config
# ----------------------------------------------------------------------------------------------------------------


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def resolved_dict(cfg: RunConfig) -> dict:
    """The fully expanded config as plain YAML-able data; ``build_run_config`` of it gives the same run."""
    return _plain(dataclasses.asdict(cfg))


def persisted_dict(cfg: RunConfig) -> dict:
    """``resolved_dict`` with the one-off options at their defaults: what a run directory's config.yaml holds."""
    d = resolved_dict(cfg)
    for (section, key), default in ONE_OFF_OPTIONS.items():
        d[section][key] = default
    return d


RESOLVED_HEADER = "# Resolved megatron-rlvr run config"
"""The first line of every config.yaml that ``dump_yaml`` writes (how a run directory's own config is recognised)."""


def is_resolved_config(path: str) -> bool:
    """``path`` is a config.yaml written by ``dump_yaml`` (a run directory's resolved config)."""
    try:
        with open(path) as f:
            return f.readline().startswith(RESOLVED_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def dump_yaml(cfg: RunConfig, path: str) -> None:
    """Write the resolved config (atomic rename), one-off options at their defaults."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{RESOLVED_HEADER} (every default expanded). Re-run: megatron-rlvr train THIS_FILE\n")
        yaml.safe_dump(persisted_dict(cfg), f, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)
