"""Run diagnostics (megatron_rlvr.trainer.diagnostics) against hand-computed cases; the forgetting probe inside a
real (tiny, 2-rank) training run is tests/e2e/test_diagnostics_run.py."""

import math

import pytest
import torch

from megatron_rlvr.config.sections import DiagnosticsConfig
from megatron_rlvr.trainer.diagnostics import (
    forgetting_metrics,
    probe_selection,
    ratio_quantile_metrics,
)


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

        def score(self, texts, gts, *rest, **kw):
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
