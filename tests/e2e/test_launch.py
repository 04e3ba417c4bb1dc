"""nemo-run launcher (launch/run.py).

- The per-task wrapper: executed with bash against a fake `megatron-rlvr` and a fake `scontrol` on PATH, it runs
  the trainer command in the repo and requeues the job from rank 0 only when the trainer exits 75.
- launch/ imports without nemo_run and says how to install it.
- With nemo_run installed: `--dryrun` renders the sbatch script for configs/mcpo_14b.yaml (4 nodes x 8 tasks,
  --signal=USR1@180, --requeue, srun --kill-on-bad-exit=1) with no cluster; skipped when nemo_run is absent.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.run import task_script

REPO = Path(__file__).resolve().parents[2]


def _fake_bin(tmp_path: Path, trainer_rc: int) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "megatron-rlvr").write_text(f'#!/bin/sh\necho "trainer: $* in $(pwd)"\nexit {trainer_rc}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/scontrol.calls\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    "trainer_rc, procid, requeued", [(75, "0", True), (75, "1", False), (1, "0", False), (0, "0", False)]
)
def test_task_script_requeues_only_on_exit_75_from_rank_0(tmp_path, trainer_rc, procid, requeued):
    bin_dir = _fake_bin(tmp_path, trainer_rc)
    script = tmp_path / "task.sh"
    script.write_text(task_script(REPO, "configs/mcpo_14b.yaml", ["train.seed=1"]))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RLVR_VENV": "",  # keep the fake trainer first on PATH
        "SLURM_JOB_ID": "99",
        "SLURM_JOB_NAME": "rlvr-mcpo-14b",
        "SLURM_PROCID": procid,
    }
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == trainer_rc
    assert f"trainer: train configs/mcpo_14b.yaml train.seed=1 in {REPO}" in r.stdout
    calls = tmp_path / "scontrol.calls"
    assert calls.exists() == requeued
    if requeued:
        assert calls.read_text().split() == ["requeue", "99"]


def test_launch_imports_without_nemo_run():
    code = (
        "import sys; sys.modules['nemo_run'] = None\n"
        "import launch.run as lr\n"
        "try:\n    lr.import_nemo_run()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install nemo-run==0.11.1 leptonai==0.27.3" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("nemo_run") is None, reason="nemo_run not installed (launch extra)")
def test_nemo_run_slurm_dryrun_renders_sbatch(tmp_path):
    cmd = [sys.executable, "-m", "launch.run", "--config", "configs/mcpo_14b.yaml", "--executor", "slurm"]
    cmd += ["--dryrun", "--base-dir", str(tmp_path), "--partition", "gpu", "train.seed=7"]
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "plan: Qwen2.5-14B TP=4 PP=1 rollout TP=2 on 4x8 GPUs" in out and "fits" in out
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=USR1@180",
        "#SBATCH --requeue",
        "export TORCHX_MAX_RETRIES=0",  # nemo-run's requeue-on-any-failure stays off
    ):
        assert line in out.splitlines(), line
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "--distribution=block" in srun
    assert "megatron-rlvr train configs/mcpo_14b.yaml train.seed=7" in out  # the task script
    assert '[ "$rc" -eq 75 ] && [ "${SLURM_PROCID:-}" = 0 ]' in out


def test_launch_refuses_layout_that_does_not_fit(tmp_path):
    cmd = [sys.executable, "-m", "launch.run", "--config", "configs/mcpo_14b.yaml", "--executor", "slurm"]
    cmd += ["--dryrun", "--base-dir", str(tmp_path), "parallel.tp=1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert "DOES NOT FIT" in r.stdout and "refusing to launch" in r.stderr


def test_launch_plans_the_disaggregated_config_per_role(tmp_path):
    """configs/mcpo_14b_disagg.yaml: the launcher's plan check sizes both roles and refuses a rollout rank over its
    memory (the dry run itself needs nemo_run; the check runs before it)."""
    cmd = [sys.executable, "-m", "launch.run", "--config", "configs/mcpo_14b_disagg.yaml", "--executor", "slurm"]
    cmd += ["--dryrun", "--base-dir", str(tmp_path), "rollout.gpu_memory_utilization=0.95"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rollout TP=1 on 8 rollout ranks (8 engines) on 3x8 GPUs" in r.stdout and "DOES NOT FIT" in r.stdout
    assert "a rollout rank needs 78.0 GiB" in r.stdout and "refusing to launch" in r.stderr
