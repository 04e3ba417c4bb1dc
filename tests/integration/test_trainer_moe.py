"""The trainer on the tiny mixture-of-experts model (``configs/tiny_moe.yaml``: a 2-layer Qwen3-MoE, 4 experts,
top-2) in-process on the shared 4-rank gloo pool: it learns the copy task at EP = 2; MCPO, CPGD and F-GRPO run two
steps at TP = 2 x EP = 2 (sequence parallel, vocab-parallel statistics over TP), F-GRPO with routing replay R2."""

import math
import os

import pytest
import trainer_helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "tiny_moe.yaml")
# the preset's first loop (16 prompts in one update, lr 3e-3 constant, no warm-up or entropy bonus): the one 50 steps
# were sized for
NO_WARMUP = [
    "schedule.warmup_steps=0",
    "algorithm.entropy.coef=0",
    "train.prompts_per_step=16",
    "train.mini_batch_prompts=null",
    "optimizer.lr=3e-3",
    "schedule.lr_decay=constant",
]


@pytest.mark.slow
def test_tiny_moe_learns_at_ep2(dist_pool, tmp_path):
    """TP = 1, EP = 2, DP = 4: a random policy is right ~1/19 of the time; 50 steps of MCPO reach a mean reward
    >= 0.8 over the last 5 (80 steps of the preset reach 0.99)."""
    # the preset's loop before its warm-up and entropy bonus: the loop this 50-step check was sized for
    overrides = [*trainer_helpers.QUIET, "schedule.steps=50", "launch.nproc=4", *NO_WARMUP]
    codes = dist_pool.run(
        trainer_helpers.train_runs, tp=1, ep=2, args=(CONFIG, str(tmp_path), {"learn": []}, overrides), timeout=900
    )[0]
    assert codes == {"learn": 0}
    rewards = [r["reward/mean"] for r in trainer_helpers.records(tmp_path / "learn")]
    assert len(rewards) == 50
    assert sum(rewards[:5]) / 5 <= 0.2, rewards[:5]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards


def test_moe_presets_run_two_steps_at_tp2_ep2(dist_pool, tmp_path):
    """MCPO (mastered prompts, hinge KL), CPGD (policy drift; with the router's aux and z-loss) and F-GRPO (focal
    weights; here with R2 and two epochs so the update replays recorded routes, and with R3, the engine's routes) on
    MoE layers split over EP with vocab-parallel statistics over TP = 2: finite losses, a gradient, their own metrics,
    the router terms' values and the replay metrics; with the learning rate at 0 R2 finds no disagreement although the
    update packs its micro-batches unlike the behaviour pass."""
    runs = {
        "mcpo": ["algorithm.preset=mcpo"],
        "cpgd": ["algorithm.preset=cpgd", "train.moe_aux_loss_coeff=0.01", "train.moe_z_loss_coeff=0.001"],
        "f_grpo": ["algorithm.preset=f_grpo", "train.routing_replay=r2", "train.ppo_epochs=2"],
        # R3: the transformers engine returns its routes, every trainer forward replays them
        "r3": [
            "algorithm.preset=f_grpo",
            "train.routing_replay=r3",
            "train.ppo_epochs=2",
            "diagnostics.replay_mismatch=true",
        ],
        # weights that never move: every replayed route is the router's own choice, whatever the packing
        "r2_frozen": [
            "algorithm.preset=f_grpo",
            "train.routing_replay=r2",
            "optimizer.lr=0",
            "train.mini_batch_prompts=2",
            "train.old_logprobs_from_update=false",
        ],
    }
    overrides = [
        *trainer_helpers.SMALL,
        "parallel.tp=2",
        "launch.nproc=4",
        "reward.fn=trainer_helpers:even_digit_reward",
    ]
    codes = dist_pool.run(
        trainer_helpers.train_runs, tp=2, ep=2, args=(CONFIG, str(tmp_path), runs, overrides), timeout=600
    )[0]
    assert codes == {n: 0 for n in runs}
    for name in ("mcpo", "cpgd", "f_grpo"):
        recs = trainer_helpers.records(tmp_path / name)
        assert [r["step"] for r in recs] == [1, 2], name
        trained = [r for r in recs if r.get("train/updates", 0) >= 1]
        assert trained, f"{name}: no update in two steps"
        for r in trained:
            assert math.isfinite(r["loss/total"]) and r["train/skipped_nonfinite"] == 0, name
            if r["adv/abs_mean"] > 0:
                assert r["optim/grad_norm"] > 0, name
    assert any("mcpo/hinge_kl" in r for r in trainer_helpers.records(tmp_path / "mcpo"))
    assert any("drift/kl" in r for r in trainer_helpers.records(tmp_path / "cpgd"))
    # the router terms' values are logged per step when switched on
    # (tests/integration/test_moe_router_loss.py checks them)
    for r in trainer_helpers.records(tmp_path / "cpgd"):
        if r.get("train/updates", 0) >= 1:
            assert 0.5 < r["moe/aux_loss"] < 4 and r["moe/z_loss"] > 0, r
    assert not any("moe/aux_loss" in r or "moe/z_loss" in r for r in trainer_helpers.records(tmp_path / "mcpo"))
    replayed = [r for r in trainer_helpers.records(tmp_path / "f_grpo") if r.get("routing/replayed_tokens", 0) > 0]
    assert replayed and all(0 <= r["routing/disagree_tokens"] <= 1 for r in replayed)
    for r in trainer_helpers.records(tmp_path / "r3"):
        # same weights in engine and trainer (fp32): the engine's routes are the trainer's own choice, and the
        # log-probs agree with and without replay
        assert r["routing/replayed_tokens"] > 0 and r["routing/engine_disagree_tokens"] <= 0.01, r
        assert r["mismatch/abs_prob_diff_max"] < 1e-4 and r["mismatch_noreplay/abs_prob_diff_max"] < 1e-4, r
    frozen = trainer_helpers.records(tmp_path / "r2_frozen")
    assert all(r["routing/replayed_tokens"] > 0 and r["routing/disagree_tokens"] == 0 for r in frozen), frozen
