"""Packed sequences (THD) under context parallelism with Transformer Engine's attention (GPU only, 2+ GPUs;
tools/gpu_check.sh): the first step of the tiny preset at CP = 2 with ``train.pack_sequences`` runs the THD path
(each micro-batch's sequences packed end to end, each padded to a multiple of 2 x cp and split into its own zig-zag
chunks, megatron's ``PackedSeqParams`` into TE's attention and the THD rotary embedding; the run header says
``packed sequences (THD)``) and gives the loss, entropy, token count and gradient norm of the same step at CP = 1
on one GPU (one sequence per row there: TE's attention takes no block-diagonal mask), and of CP = 2 without packing
([b, s] rows split on the sequence). bf16 (TE's context-parallel kernels take no fp32). The index logic is covered
on CPU by tests/unit/test_context_parallel_thd.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("loss/total", "loss/entropy", "optim/grad_norm", "loss/num_tokens")
THD_HEADER = "packed sequences (THD)"


def _first_step(run_dir, nproc, cp, pack: bool):
    over = [
        f"logging.run_dir={run_dir}",
        "schedule.steps=1",
        "model.dtype=bfloat16",
        "parallel.tp=1",
        f"parallel.cp={cp}",
        "parallel.cp_comm_type=p2p",
        f"train.pack_sequences={'true' if pack else 'false'}",
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
        return json.loads(f.readline()), proc.stdout + proc.stderr


@pytest.mark.gpu
def test_transformer_engine_thd_cp2_step_matches_cp1():
    """CP = 2 with packed sequences (THD, TE) = CP = 1 = CP = 2 unpacked, on the first step's metrics (bf16
    tolerances, as tests/e2e/test_context_parallel_gpu.py); the THD run really took the THD path."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("transformer_engine")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ref, _ = _first_step(os.path.join(tmp, "cp1"), 1, 1, pack=True)
        rows, rows_log = _first_step(os.path.join(tmp, "cp2rows"), 2, 2, pack=False)
        got, log = _first_step(os.path.join(tmp, "cp2thd"), 2, 2, pack=True)
    assert THD_HEADER in log and THD_HEADER not in rows_log, log[-2000:]
    for k in COMPARED:
        assert got[k] == pytest.approx(ref[k], rel=2e-2, abs=1e-3), (k, ref[k], got[k])
        assert got[k] == pytest.approx(rows[k], rel=2e-2, abs=1e-3), (k, rows[k], got[k])
