"""What the planner plans: a run config (the same file ``train`` reads, loaded by the same code) plus the model's
shapes. Files the run names need not exist here (``plan`` often runs on a laptop or login node for a cluster's
paths): they are reported as warnings; the model's shapes then come from its built-in spec."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_rlvr.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    build_run_config,
    check_run_files,
    load_run_config,
    model_hf_config,
    teacher_model_config,
)
from megatron_rlvr.families.table import BUILTIN_SPECS, ModelSpec, get_model_spec, model_spec_from_hf_config
from megatron_rlvr.families.tiny import TINY_MODELS
from megatron_rlvr.planner.memory import PlanConfig


def model_spec_for(run: RunConfig, m=None) -> ModelSpec:
    """The shapes of the run's model (or of the model config ``m``): its HF config when readable here (tiny,
    hf_path, hf_config, gguf), else the built-in spec of ``model.name``."""
    m = run.model if m is None else m
    try:
        hf = model_hf_config(m)
    except ConfigError as e:
        if m.name and m.name not in TINY_MODELS:
            try:
                return get_model_spec(m.name)
            except ValueError:
                pass
        raise ConfigError(
            f"{e}; and model.name={m.name!r} is not a built-in spec ({', '.join(sorted(BUILTIN_SPECS))}), so the "
            "planner cannot size the model"
        ) from None
    return model_spec_from_hf_config(hf, name=m.name if m.name not in TINY_MODELS or m.is_tiny else None)


def _vision_trainable(run: RunConfig) -> bool:
    """Whether the run trains a vision-language model's tower: not when ``model.vision.freeze`` is set."""
    freeze = getattr(getattr(run.model, "vision", None), "freeze", None)
    return not bool(freeze)


def teacher_spec_for(run: RunConfig, student: ModelSpec, warn=None) -> ModelSpec | None:
    """The distillation teacher's shapes (None without distillation): its HF config when readable here, else its
    built-in spec; else, with a warning, the student's (a teacher folder that exists only on the cluster)."""
    teacher = teacher_model_config(run)
    if teacher is None:
        return None
    try:
        return model_spec_for(run, teacher)
    except ConfigError:
        warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        warn(
            f"algorithm.distill.teacher={run.algorithm.distill.teacher!r} is neither readable here nor a built-in "
            "spec: planned at the student's size"
        )
        return student


def plan_config_from_run(run: RunConfig, spec: ModelSpec | None = None, warn=None) -> PlanConfig:
    """The planner's view of a run config: its own sections, the model's spec, the reference model resolved, the
    distillation teacher's spec."""
    spec = spec or model_spec_for(run)
    teacher = teacher_spec_for(run, spec, warn)
    return PlanConfig(
        teacher=teacher,
        teacher_logits=teacher is not None and run.algorithm.distill.estimator == "full",
        vision_trainable=_vision_trainable(run),
        model=spec,
        parallel=run.parallel,
        rollout=run.rollout,
        train=run.train,
        cluster=run.cluster,
        ref_model=run.keeps_ref_model,
        dtype=run.model.dtype,
        lora=run.model.lora,
    )


def load_plan_config(source: str | Path, overrides: Sequence[str] = (), warn=None) -> PlanConfig:
    """PlanConfig from a run-config YAML (validated exactly as ``train`` validates it, except that missing files are
    warnings), or from a built-in model name / HF config.json (file or folder) with the default run sections, except
    that the model is planned in bfloat16 (what a GPU run of such a model sets) unless ``model.dtype`` is given."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    p = Path(source).expanduser()
    if p.suffix in (".yaml", ".yml"):
        run = load_run_config(str(p), list(overrides), check_files=False)
        try:
            check_run_files(run)
        except ConfigError as e:
            warn(f"{e} (not needed for the plan; `train` refuses to start without it)")
        return plan_config_from_run(run, warn=warn)
    raw = apply_overrides({}, list(overrides))
    model = raw.get("model", {})
    if not isinstance(model, dict) or set(model) - {"dtype"}:
        raise ConfigError(
            "model.* overrides other than model.dtype need a run-config YAML; give the model as the CONFIG argument"
        )
    raw["model"] = {"name": str(source), "dtype": model.get("dtype", "bfloat16")}
    run = build_run_config(raw, check_files=False)
    if p.suffix == ".json" or p.is_dir():
        try:
            spec = model_spec_from_hf_config(p)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        try:
            spec = get_model_spec(str(source))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return plan_config_from_run(run, spec, warn=warn)


def run_dir_config(path: str) -> str:
    """A run directory stands for its config.yaml (as with ``train``)."""
    return os.path.join(path, "config.yaml") if os.path.isdir(path) and os.path.isfile(f"{path}/config.yaml") else path
