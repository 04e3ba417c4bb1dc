"""The forgetting probe and the ratio statistics of run diagnostics (megatron_rlvr.trainer.diagnostics) inside a
real (tiny, 2-rank) training run; the hand-computed cases are tests/unit/test_diagnostics.py."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_probe_and_ratio_stats_are_logged_by_a_training_run(tmp_path):
    """10 tiny steps with the probe every step and 2 mini-batches (so ratios move off 1): the probe logs a prompt
    count each step, and accuracy in [0, 1] whenever some prompt was mastered; ratio quantiles are logged. "Mastered"
    is lowered to >= 1 of 2 rollouts correct so that a near-random policy has mastered prompts to probe."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO)
    args = [
        f"logging.run_dir={run}",
        "schedule.steps=10",
        "rollout.n=2",
        "algorithm.hinge_kl.mastered_threshold=0.5",
        "train.mini_batch_prompts=8",
        "diagnostics.forgetting_every=1",
        "diagnostics.forgetting_prompts=4",
        "diagnostics.forgetting_rollouts=3",
        "checkpoint.save_every=100",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.plot_at_end=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(recs) == 10 and all("forget/probe_prompts" in r for r in recs)
    probed = [r for r in recs if r["forget/probe_prompts"] > 0]
    assert probed, "no prompt had a correct rollout in 10 steps"
    assert all(0.0 <= r["forget/probe_accuracy"] <= 1.0 and r["forget/probe_prompts"] <= 4 for r in probed)
    drop = [r["forget/control_accuracy"] - r["forget/probe_accuracy"] - r["forget/drop"] for r in probed]
    assert max(map(abs, drop)) < 1e-9
    assert all(r["ratio/q50"] > 0 and r["ratio/q99"] >= r["ratio/q1"] for r in recs if "ratio/q50" in r)
    assert any(r.get("ratio/abs_log_ratio_max", 0.0) > 0 for r in recs)  # the second mini-batch is off-policy
