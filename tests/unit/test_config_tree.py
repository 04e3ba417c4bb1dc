"""One config tree: ``plan``, ``train`` and the launcher read a run file with the same loader (megatron_rlvr.config),
so they accept and refuse exactly the same files; keys of older versions migrate; file checks are separable."""

import dataclasses
import glob
import os
from pathlib import Path

import pytest
import yaml

from megatron_rlvr.config import ConfigError, load_run_config, resolved_dict
from megatron_rlvr.planner import load_plan_config, plan_main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(glob.glob(str(REPO / "configs" / "**" / "*.yaml"), recursive=True))


def test_there_are_configs():
    assert len(CONFIGS) >= 7  # configs/*.yaml and configs/repro/*.yaml


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(p, REPO) for p in CONFIGS])
def test_plan_and_train_read_every_config_the_same_way(path):
    """Every shipped file loads with the trainer's loader (files on a cluster's paths need not exist here) and the
    planner plans exactly those sections: same layout, lengths, batch sizes, cluster."""
    run = load_run_config(path, check_files=False)
    plan = load_plan_config(path, warn=lambda msg: None)
    assert plan.parallel == run.parallel and plan.rollout == run.rollout and plan.train == run.train
    assert plan.cluster == run.cluster and plan.keeps_ref_model == run.keeps_ref_model
    assert plan.max_model_len == run.rollout.max_prompt_len + run.rollout.max_response_len


@pytest.mark.parametrize(
    "edit, message",
    [
        (("parallel", "tensor_parallel", 4), "unknown config key 'parallel.tensor_parallel'"),
        (("train", "prompts_per_stp", 4), "did you mean train.prompts_per_step?"),
        (("rollout", "max_response_len", "long"), "rollout.max_response_len must be an integer"),
        (("algorithm", "preset", "mcpp"), "did you mean 'mcpo'?"),
        (("cluster", "usable_fraction", 1.5), "cluster.usable_fraction must be in (0, 1]"),
        (("train", "mini_batch_prompts", 7), "does not divide train.prompts_per_step"),
    ],
)
def test_plan_and_train_refuse_the_same_bad_file_with_the_same_message(tmp_path, capsys, edit, message):
    raw = yaml.safe_load((REPO / "configs" / "mcpo_14b.yaml").read_text())
    section, key, value = edit
    raw.setdefault(section, {})[key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_run_config(str(bad), check_files=False)
    assert message in str(e.value)
    assert plan_main([str(bad)]) == 2
    assert message in capsys.readouterr().err


def test_same_defaults_for_plan_and_train():
    """A file that omits the rollout lengths plans the job train would run (they used to differ: 2048/8192 vs
    1024/1024)."""
    plan = load_plan_config("qwen2.5-7b")
    defaults = load_run_config(None, [], check_files=False)
    assert plan.rollout.max_prompt_len == type(defaults.rollout)().max_prompt_len
    assert plan.rollout.max_response_len == type(defaults.rollout)().max_response_len


def test_planner_only_keys_of_old_files_migrate_with_a_notice(tmp_path, capsys):
    """Before the merge, the planner's assumptions lived in the trainer's sections (rollout.overhead_gb, ...); an old
    run directory's config.yaml still loads, with the values moved to ``cluster``."""
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["rollout"]["overhead_gb"] = 3.5
    raw["train"]["offload_during_rollout"] = True
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump(raw))
    cfg = load_run_config(str(old))
    assert cfg.cluster.vllm_overhead_gb == 3.5 and cfg.cluster.offload_during_rollout is True
    err = capsys.readouterr().err
    assert "rollout.overhead_gb is now cluster.vllm_overhead_gb" in err
    assert "overhead_gb" not in resolved_dict(cfg)["rollout"]


def test_file_checks_are_separate_from_validation(tmp_path):
    """``check_files=False`` (plan, the launcher) accepts paths that do not exist here; train refuses them, naming
    the key. Value errors are refused either way."""
    over = ["data.train_files=[/nonexistent/train.jsonl]"]
    cfg = load_run_config(None, over, check_files=False)
    assert cfg.data.train_files == ["/nonexistent/train.jsonl"]
    with pytest.raises(ConfigError, match=r"data.train_files\[0\]: file not found"):
        load_run_config(None, over)
    with pytest.raises(ConfigError, match="unsupported file type"):
        load_run_config(None, ["data.train_files=[x.csv]"], check_files=False)
    with pytest.raises(ConfigError, match="not a built-in trainable model"):
        load_run_config(None, ["model.name=qwen2.5-7b"])
    assert load_run_config(None, ["model.name=qwen2.5-7b"], check_files=False).model.name == "qwen2.5-7b"


def test_shell_and_omegaconf_env_references(monkeypatch):
    monkeypatch.setenv("RLVR_T_DIR", "/x")
    monkeypatch.delenv("RLVR_T_UNSET", raising=False)
    cfg = load_run_config(
        None,
        ["logging.run_dir=${RLVR_T_DIR}/run", "logging.name=${RLVR_T_UNSET:-dflt}", "eval.files=[]"],
        check_files=False,
    )
    assert cfg.logging.run_dir == "/x/run" and cfg.logging.name == "dflt"
    cfg = load_run_config(None, ["logging.run_dir=${oc.env:RLVR_T_DIR}/r2"], check_files=False)
    assert cfg.logging.run_dir == "/x/r2"
    with pytest.raises(ConfigError, match="logging.run_dir: environment variable RLVR_T_UNSET is not set"):
        load_run_config(None, ["logging.run_dir=${RLVR_T_UNSET}/run"], check_files=False)


def test_config_tree_and_planner_do_not_import_torch():
    """``plan`` runs on a login node: loading and validating a full run file (algorithm, data, reward sections
    included) and planning it must not import torch or megatron."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_rlvr.planner import plan_main\n"
        f"rc = plan_main([{str(REPO / 'configs' / 'mcpo_14b.yaml')!r}])\n"
        "bad = [m for m in ('torch', 'megatron') if m in sys.modules]\n"
        "print('imported:', bad)\n"
        "sys.exit(rc or (3 if bad else 0))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "imported: []" in r.stdout


def test_fused_statistics_names_match_the_ops():
    """train.fused_statistics is validated torch-free against the names the ops accept."""
    from megatron_rlvr.config.sections import FUSED_STATISTICS
    from megatron_rlvr.ops import FUSED_STATISTICS_MODES

    assert tuple(FUSED_STATISTICS) == tuple(FUSED_STATISTICS_MODES)
    with pytest.raises(ConfigError, match="train.fused_statistics must be one of"):
        load_run_config(None, ["train.fused_statistics=triton"], check_files=False)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.train_files={a: 1}", "data.train_files must be a list, got {'a': 1}"),
        ("rollout.stop={a: 1}", "rollout.stop must be a list"),
        ("train.seed={x: 1}", "train.seed must be an integer"),
        ("train.prompts_per_step=null", "train.prompts_per_step must not be null"),
        ("algorithm.hinge_kl=[1]", "algorithm.hinge_kl"),
    ],
)
def test_wrong_shapes_name_the_key(override, message):
    """OmegaConf reports some shape errors (a mapping where a list belongs) without a key: the loader finds it."""
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [override], check_files=False)
    assert message in str(e.value)


def test_algorithm_preset_is_resolved_as_the_library_resolves_it():
    """algorithm.preset in a run config goes through algorithms.preset: the same spelling rules ("MCPO-margin" is
    the mcpo_margin preset) and the same did-you-mean message, prefixed by the key."""
    from megatron_rlvr.algorithms import preset

    run = load_run_config(None, ["algorithm.preset=MCPO-margin"], check_files=False)
    # the default run (configs/tiny.yaml) adds its entropy bonus to whichever preset is chosen
    algo = dataclasses.replace(run.algorithm, entropy=preset("mcpo_margin").entropy)
    assert algo == preset("mcpo_margin") and algo != preset("mcpo")
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["algorithm.preset=mcpp"], check_files=False)
    with pytest.raises(ValueError) as lib:
        preset("mcpp")
    assert str(e.value) == f"algorithm.preset: {lib.value}" and "did you mean 'mcpo'?" in str(e.value)


def test_checkpoint_sharding_type_is_checked_when_the_config_loads():
    """A misspelt checkpoint.sharding_type is refused at load time (it used to surface at the first save, after
    checkpoint.save_every steps), with the formats the save accepts; every one of those loads."""
    from megatron_rlvr.config.sections import SHARDING_TYPES

    with pytest.raises(ConfigError, match=r"checkpoint.sharding_type must be one of .*fully_reshardable"):
        load_run_config(None, ["checkpoint.sharding_type=fully_resharded"], check_files=False)
    for kind in SHARDING_TYPES:
        assert (
            load_run_config(None, [f"checkpoint.sharding_type={kind}"], check_files=False).checkpoint.sharding_type
            == kind
        )
