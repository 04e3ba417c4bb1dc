"""Context parallelism with Transformer Engine's attention (GPU only, 2+ GPUs; tools/gpu_check.sh): the first step of
the tiny preset at CP = 2 on 2 GPUs, for each ``parallel.cp_comm_type``, gives the loss, entropy and gradient norm of
the same step at CP = 1 on one GPU (the same weights and, the sampling seeds being per prompt, the same rollouts).
bf16: Transformer Engine's context-parallel attention runs its flash / fused kernels, which take no fp32. The CPU
suite checks the CPU attention's parity to fp32 rounding (tests/integration/test_context_parallel.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("loss/total", "loss/entropy", "optim/grad_norm", "loss/num_tokens")


def _first_step(run_dir, nproc, cp, comm):
    over = [
        f"logging.run_dir={run_dir}",
        "schedule.steps=1",
        "model.dtype=bfloat16",
        "parallel.tp=1",
        f"parallel.cp={cp}",
        f"parallel.cp_comm_type={comm}",
        f"launch.nproc={nproc}",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.plot_at_end=false",
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", "configs/tiny.yaml", *over]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())


@pytest.mark.gpu
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_transformer_engine_cp2_step_matches_cp1(tmp_path, comm):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("transformer_engine")
    ref = _first_step(tmp_path / "cp1", 1, 1, "p2p")
    got = _first_step(tmp_path / "cp2", 2, 2, comm)
    for k in COMPARED:
        assert got[k] == pytest.approx(ref[k], rel=2e-2, abs=1e-3), (comm, k, ref[k], got[k])
