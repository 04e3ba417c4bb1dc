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


def test_probe_resamples_exactly_the_mastered_groups_and_the_control_uses_the_pre_update_policy():
    """The probe re-samples this step's mastered groups (at most forgetting_prompts, batch order), not others; the
    control samples the same prompts with the same seeds before the update; forget/drop is their difference. An
    engine whose answers depend on the prompt and on whether it was updated makes a wrong selection visible."""
    from types import SimpleNamespace

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.data import Example
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput
    from megatron_rlvr.rollout.groups import Group, engine_info
    from megatron_rlvr.trainer.batch import RolloutBatch, group_rewards
    from megatron_rlvr.trainer.diagnostics import forgetting_control, forgetting_probe

    cfg = load_run_config(
        None, ["rollout.n=4", "diagnostics.forgetting_every=1", "diagnostics.forgetting_prompts=2",
               "diagnostics.forgetting_rollouts=3"],
    )  # fmt: skip
    # groups 0, 2, 3 mastered (4/4 correct), group 1 not: probed are 0 and 2 (the first two), prompt ids 10 and 12
    step_rewards = [[1.0] * 4, [1.0, 0.0, 1.0, 1.0], [1.0] * 4, [1.0] * 4]
    groups = [
        Group(Example(prompt=str(i), answer="right", source="t", id=f"p{i}"), [10 + i], [[1]] * 4, [[0.0]] * 4,
              ["stop"] * 4, ["right"] * 4, r)
        for i, r in enumerate(step_rewards)
    ]  # fmt: skip
    rolled = RolloutBatch(groups, list(range(4)), group_rewards(groups, cfg.algorithm), policy_version=0)

    class Engine:
        """Correct answers per prompt id: before the update 3/3 (prompt 10) and 2/3 (12), after it 1/3 and 2/3."""

        def __init__(self):
            self.calls, self.right = [], {10: 3, 12: 2}

        def generate(self, prompts, params, prompt_keys=None):
            self.calls.append(([list(p) for p in prompts], params.n, params.seed))
            texts = lambda p: ["right"] * self.right.get(p[0], 0) + ["wrong"] * (params.n - self.right.get(p[0], 0))
            return [RolloutOutput(p, [Completion([1], [0.0], "stop", text=x) for x in texts(p)]) for p in prompts]

    class Rewards:
        report_now = True

        def score(self, texts, gts, *rest):
            rewards = [float(x == g) for x, g in zip(texts, gts)]
            return rewards, {"reward/n_items": float(len(rewards))}

        def take_pending(self):
            return []

        def report_gathered(self, items):
            pass

    engine = Engine()
    t = SimpleNamespace(
        cfg=cfg, algo=cfg.algorithm, engine=engine, reward_manager=Rewards(), tokenizer=None,
        engine_info=engine_info(0, 1, 1),
    )  # fmt: skip
    control = forgetting_control(t, rolled, 1, gather=lambda obj: [obj])
    engine.right = {10: 1, 12: 2}  # the update and the weight sync
    m = forgetting_probe(t, rolled, 1, control, gather=lambda obj: [obj])
    assert [c[0] for c in engine.calls] == [[[10], [12]], [[10], [12]]]  # exactly the mastered groups, both times
    assert engine.calls[0][1:] == engine.calls[1][1:] and engine.calls[0][1] == 3  # same n and seed
    assert m["forget/probe_prompts"] == 2
    assert m["forget/control_accuracy"] == pytest.approx(5 / 6) and m["forget/probe_accuracy"] == pytest.approx(3 / 6)
    assert m["forget/drop"] == pytest.approx(2 / 6)
    assert m["forget/control_still_mastered_frac"] == 0.5 and m["forget/still_mastered_frac"] == 0.0
    assert forgetting_probe(t, rolled, 1, gather=lambda obj: [obj]).keys().isdisjoint({"forget/drop"})


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
    drop = [r["forget/control_accuracy"] - r["forget/probe_accuracy"] - r["forget/drop"] for r in probed]
    assert max(map(abs, drop)) < 1e-9
    assert all(r["ratio/q50"] > 0 and r["ratio/q99"] >= r["ratio/q1"] for r in recs if "ratio/q50" in r)
    assert any(r.get("ratio/abs_log_ratio_max", 0.0) > 0 for r in recs)  # the second mini-batch is off-policy
