"""Run diagnostics (megatron_rlvr.trainer.diagnostics) against hand-computed cases, and the forgetting probe inside a
real (tiny, 2-rank) training run."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_rlvr.config.sections import DiagnosticsConfig
from megatron_rlvr.trainer.diagnostics import (
    forgetting_metrics,
    probe_selection,
    ratio_quantile_metrics,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ratio_quantiles_match_a_hand_computed_case():
    # response tokens with ratios 0.5, 1, 2, 4 (sorted); masked positions hold garbage that must be ignored
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(2.0), math.log(0.5), float("nan")], [math.log(4.0), 0.0, 50.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    m = ratio_quantile_metrics(logp, old, mask, quantiles=(0.5, 0.99, 0.001))
    # linear interpolation on [0.5, 1, 2, 4]: q at position q * 3
    assert m["ratio/q50"] == pytest.approx(1.5)
    assert m["ratio/q99"] == pytest.approx(2.0 + 0.97 * 2.0)
    assert m["ratio/q0.1"] == pytest.approx(0.5 + 0.003 * 0.5)
    assert m["ratio/out_of_band_frac"] == pytest.approx(0.75)  # 0.5, 2, 4 are outside |r - 1| <= 0.2
    assert m["ratio/abs_log_ratio_max"] == pytest.approx(math.log(4.0))


def test_ratio_quantiles_on_policy_and_empty():
    x = torch.randn(3, 5)
    m = ratio_quantile_metrics(x, x.clone(), torch.ones(3, 5, dtype=torch.bool))
    assert all(v == 1.0 for k, v in m.items() if k.startswith("ratio/q"))
    assert m["ratio/out_of_band_frac"] == 0.0 and m["ratio/abs_log_ratio_max"] == 0.0
    e = ratio_quantile_metrics(x, x + 1, torch.zeros(3, 5, dtype=torch.bool))
    assert e["ratio/q50"] == 1.0 and e["ratio/out_of_band_frac"] == 0.0


def test_forgetting_metrics_hand_case():
    c = torch.tensor([[True, True, True], [True, False, True]])
    m = forgetting_metrics(c)
    assert m["forget/probe_accuracy"] == pytest.approx(5 / 6)
    assert m["forget/still_mastered_frac"] == pytest.approx(0.5)
    assert m["forget/probe_prompts"] == 2.0
    assert forgetting_metrics(torch.zeros(0, 4, dtype=torch.bool)) == {"forget/probe_prompts": 0.0}
    with pytest.raises(ValueError, match=r"\[P, m\]"):
        forgetting_metrics(torch.ones(3, dtype=torch.bool))


def test_probe_selection_and_config():
    assert probe_selection(torch.tensor([False, True, True, False, True]), 2) == [1, 2]
    assert probe_selection(torch.zeros(4, dtype=torch.bool), 3) == []
    cfg = DiagnosticsConfig(forgetting_every=3)
    assert [s for s in range(1, 10) if cfg.probe_due(s)] == [3, 6, 9]
    assert not DiagnosticsConfig().probe_due(5)  # off by default
    with pytest.raises(ValueError, match="diagnostics.forgetting_rollouts"):
        DiagnosticsConfig(forgetting_rollouts=0)
    with pytest.raises(ValueError, match="diagnostics.forgetting_every"):
        DiagnosticsConfig(forgetting_every=-1)


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
    assert all(r["ratio/q50"] > 0 and r["ratio/q99"] >= r["ratio/q1"] for r in recs if "ratio/q50" in r)
    assert any(r.get("ratio/abs_log_ratio_max", 0.0) > 0 for r in recs)  # the second mini-batch is off-policy
