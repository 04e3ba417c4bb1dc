"""Multi-turn trajectories in the trainer at TP = 2 with packed rows: observation tokens carry no loss.

One trainer, step 1 run once per setting on the same weights, prompts and rollouts (trainer_helpers
.step_once_per_setting), each setting rewriting the step's multi-turn groups as they leave the rollout:
- ``garbage``: the engine log-probs at observation positions set to +5 (rollout.old_logprobs=rollout, so a ratio
  that read them would explode): the metrics and gradients equal the unchanged step's bit for bit;
- ``trail_a`` / ``trail_b``: three observation tokens appended after every trajectory, different content, same
  length: bit-identical to each other (nothing after a sampled token reaches its loss);
- ``unmasked`` (control): the loss mask dropped, observations trained as if sampled: the gradients differ;
- ``assistant`` (control): one sampled token of one trajectory changed: the gradients differ.
The trained-token count of the loss equals the sum of the loss masks of the trained sequences (an independent count)."""

import dataclasses
import os
import sys

import torch
import trainer_helpers

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVER = [
    "parallel.tp=2",
    "train.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_prompt_len=8",
    "rollout.max_response_len=12",
    "rollout.old_logprobs=rollout",
    "agent.environment=trainer_helpers:scripted_env",
    "agent.max_turn_tokens=5",
    "train.pack_sequences=true",
    "train.micro_batch_tokens=48",
    "reward.fn=trainer_helpers:even_digit_reward",
    "reward.extraction=lenient",
    "train.mini_batch_prompts=null",
    "schedule.warmup_steps=0",
    "algorithm.entropy.coef=0",
    "optimizer.lr=1e-2",
    *trainer_helpers.QUIET,
]


def _rewrite(setting):
    def fn(g):
        g = dataclasses.replace(g)
        if setting == "garbage":
            g.logprobs = [[lp if m else 5.0 for lp, m in zip(lps, mask)] for lps, mask in zip(g.logprobs, g.loss_masks)]
        elif setting in ("trail_a", "trail_b"):
            extra = [3, 4, 5] if setting == "trail_a" else [9, 8, 7]
            g.response_ids = [r + extra for r in g.response_ids]
            g.logprobs = [lp + [0.0] * 3 for lp in g.logprobs]
            g.loss_masks = [m + [0] * 3 for m in g.loss_masks]
        elif setting == "unmasked":
            g.loss_masks = []
        elif setting == "assistant":
            j = next(k for k, m in enumerate(g.loss_masks[0]) if m)
            g.response_ids = [list(r) for r in g.response_ids]
            g.response_ids[0][j] = 3 if g.response_ids[0][j] != 3 else 4
        return g

    return fn


def _steps(run_root, settings):
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.rollout import groups
    from megatron_rlvr.trainer.colocated import setup

    sys.path.insert(0, TESTS_DIR)
    t = setup(load_run_config("configs/tiny.yaml", OVER), os.path.join(run_root, "run"))
    real = groups._trajectory_group
    current = {"setting": None}

    def apply(t, setting):
        current["setting"] = setting

    def spy(record):
        def patched(*a, **k):
            g = _rewrite(current["setting"])(real(*a, **k))
            record.append(g)
            return g

        groups._trajectory_group = patched
        return lambda: setattr(groups, "_trajectory_group", real)

    out = trainer_helpers.step_once_per_setting(t, settings, apply, spy)
    return {s: (m, g, [(grp.loss_masks, grp.response_ids) for grp in seen]) for s, (m, g, seen) in out.items()}


def test_observation_tokens_carry_no_loss_at_tp2_with_packing(dist_pool, tmp_path):
    settings = ("none", "garbage", "trail_a", "trail_b", "unmasked", "assistant")
    per_rank = dist_pool.run(_steps, tp=2, args=(str(tmp_path), settings), timeout=900)
    # each rank's engine rolls out its share of the prompts: the step's trajectories are all ranks' together
    every_mask = [m for out in per_rank for masks, _ in out["none"][2] for m in masks]
    assert any(0 in m for m in every_mask), "no trajectory had an observation"
    for out in per_rank:
        m0, g0, _ = out["none"]
        assert len(g0) >= 1
        for s in ("garbage",):
            m, g, _ = out[s]
            assert m == m0, s
            assert all(torch.equal(a, b) for a, b in zip(g, g0)), s
        ma, ga, _ = out["trail_a"]
        mb, gb, _ = out["trail_b"]
        assert ma == mb
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        for s in ("unmasked", "assistant"):
            _, g, _ = out[s]
            assert any(not torch.equal(a, b) for a, b in zip(g, g0)), f"{s}: the control changed nothing"
        diff = {s: max(float((a - b).abs().max()) for a, b in zip(out[s][1], g0)) for s in ("garbage", "unmasked")}
        diff["assistant"] = max(float((a - b).abs().max()) for a, b in zip(out["assistant"][1], g0))
        print(f"masked means no gradient (TP=2, packed): max |grad - grad(no change)| {diff}")
        # every trajectory trains here (no truncation masking in grpo): the loss counts exactly the mask's ones
        assert m0["loss/num_tokens"] == float(sum(sum(m) for m in every_mask)), (len(every_mask), every_mask)
