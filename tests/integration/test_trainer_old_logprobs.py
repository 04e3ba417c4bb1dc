"""Behaviour log-probs from the update's own forward (train.old_logprobs_from_update, the default) against the
reference path that recomputes them in a separate no-grad pass first (=false), at TP = 2 x DP = 2.

The fused path is exact by construction: on the first update the ratio is exactly 1 (old = logp.detach()). The
recompute path is exact only up to the forward's own float noise: on CPU a no-grad forward and a grad-mode forward
of the same micro-batch differ by up to ~5e-7 in a log-prob (different kernels), so its first-update ratios are
1 +- 1e-7. Hence: fused ratios are exactly 1; every metric and gradient equals the reference path's to float32
noise (tolerances far below any algorithmic difference: a wrong old log-prob moves ratios, losses and gradients
by orders of magnitude more); later mini-batches / epochs use the pre-update log-probs (ratios != 1)."""

import os
import sys

import pytest
import trainer_helpers

from megatron_rlvr.algorithms import PRESETS

SMALL = [
    "train.prompts_per_step=4",
    "rollout.n=4",
    *trainer_helpers.DENSE_TINY,
    *trainer_helpers.QUIET,
    "optimizer.lr=1e-2",
    # reward variance in every batch (the exact-copy reward of a random policy can be 0 for all 16 samples, and then
    # there is no gradient to compare and DAPO's dynamic sampling drops groups)
    "reward.fn=trainer_helpers:even_digit_reward",
]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers
NOT_COMPARED = trainer_helpers.NOT_COMPARED


def _assert_same_metrics(m_fused: dict, m_ref: dict, where: str) -> None:
    assert set(m_fused) == set(m_ref), (where, set(m_fused) ^ set(m_ref))
    for k, v in m_ref.items():
        # mismatch/* (trainer vs engine log-probs of the same weights) are float noise themselves, ~1e-8 and below
        assert m_fused[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (where, k, v, m_fused[k])


def _spy_recompute(record):
    """Wrap compute_logprobs where the trainer calls it (trainer.stages imports it from trainer.update) to record
    which ids it recomputes with the policy (the DDP-wrapped model; the frozen reference model is not wrapped)."""
    from megatron_rlvr.trainer import stages as train
    from megatron_rlvr.trainer import update

    real = update.compute_logprobs

    def spy(ctx, model, seqs, ids, with_entropy=False, **kw):
        if type(model).__name__ == "DistributedDataParallel":
            record.append(list(ids))
        return real(ctx, model, seqs, ids, with_entropy, **kw)

    update.compute_logprobs = train.compute_logprobs = spy

    def undo():
        update.compute_logprobs = train.compute_logprobs = real

    return undo


def _per_preset(run_root, presets, overrides):
    """Per preset: step 1 twice on one trainer, the reference path then the fused one
    (trainer_helpers.step_once_per_setting: same weights, prompts and rollouts)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import setup

    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    out = {}
    for name in presets:
        t = setup(load_run_config(None, [*overrides, f"algorithm.preset={name}"]), os.path.join(run_root, name))

        def apply(t, fused):
            t.policy.cfg.train.old_logprobs_from_update = fused

        out[name] = trainer_helpers.step_once_per_setting(t, (False, True), apply, _spy_recompute)
    return out


def _real_updates(run_root, runs, overrides):
    """Per run: one real step (optimizer included) on a fresh trainer each for the reference path and the fused one:
    (metrics, ids recomputed, checksum of the updated weights)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.megatron.policy import params_checksum
    from megatron_rlvr.trainer.colocated import rl_step, setup, teardown

    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    out = {}
    for name, extra in runs.items():
        for fused in (False, True):
            over = [*overrides, *extra, f"train.old_logprobs_from_update={str(fused).lower()}"]
            t = setup(load_run_config(None, over), os.path.join(run_root, f"{name}-{fused}"))
            asked: list[list[int]] = []
            undo = _spy_recompute(asked)
            try:
                m = rl_step(t, 1)
                out[(name, fused)] = (
                    {k: v for k, v in m.items() if not k.startswith(NOT_COMPARED)},
                    asked,
                    params_checksum(t.policy.model),
                )
            finally:
                undo()
                teardown(t)
    return out


def test_fused_old_logprobs_match_the_recompute_path_for_every_preset(dist_pool, tmp_path):
    """One mini-batch, one epoch: the fused path runs no recompute pass at all, yet every metric (loss terms,
    ratios, clip fractions, entropy, mismatch between trainer and engine log-probs, the non-finite flag) and every
    gradient equals the reference path's exactly."""
    names = list(PRESETS)
    per_rank = dist_pool.run(_per_preset, tp=2, args=(str(tmp_path), names, SMALL), timeout=600)
    for rank, out in enumerate(per_rank):
        for name in names:
            (m_ref, g_ref, asked_ref), (m_fused, g_fused, asked_fused) = out[name][False], out[name][True]
            assert asked_ref and sum(map(len, asked_ref)) > 0, name
            assert asked_fused == [], f"{name}: the fused path must not recompute with one mini-batch"
            _assert_same_metrics(m_fused, m_ref, f"{name} rank {rank}")
            assert m_fused["loss/ratio_max"] == m_fused["loss/ratio_min"] == 1.0, name  # exact by construction
            assert "mismatch/kl_k3" in m_fused and m_fused["logprobs/nonfinite"] == 0, name
            assert len(g_ref) == len(g_fused) == 1, name
            diff = float((g_fused[0] - g_ref[0]).norm())
            assert diff <= 1e-4 * float(g_ref[0].norm()) + 1e-9, f"{name}: gradients differ by {diff}"
            if m_ref.get("adv/abs_mean", 0) > 0:
                assert g_ref[0].abs().sum() > 0, name  # a real gradient was compared


def test_later_minibatches_and_epochs_use_the_pre_update_log_probs(dist_pool, tmp_path):
    """2 mini-batches x 2 epochs (and with truncated IS on the recomputed log-probs): only the first mini-batch's
    sequences skip the recompute pass; the second mini-batch and the second epoch train against the log-probs of
    the policy before the first optimizer step (ratios != 1), exactly as the reference path does, down to the
    updated weights."""
    mb = ["train.mini_batch_prompts=2", "train.ppo_epochs=2"]
    runs = {"dapo_mb2_ep2": ["algorithm.preset=dapo", *mb], "grpo_tis_mb2_ep2": ["rollout.tis_cap=1.5", *mb]}
    per_rank = dist_pool.run(_real_updates, tp=2, args=(str(tmp_path), runs, SMALL), timeout=600)
    for out in per_rank:
        for name in runs:
            m_ref, asked_ref, w_ref = out[(name, False)]
            m_fused, asked_fused, w_fused = out[(name, True)]
            assert m_ref["train/updates"] == 4, name
            assert m_ref.get("loss/ratio_max", 1.0) != 1.0, name  # later updates are off-policy
            _assert_same_metrics(m_fused, m_ref, name)
            assert w_fused == pytest.approx(w_ref, rel=1e-6), name
            ref_ids, fused_ids = sorted(sum(asked_ref, [])), sorted(sum(asked_fused, []))
            assert fused_ids and set(fused_ids) < set(ref_ids), name  # the second mini-batch is still recomputed
            # the first mini-batch is groups 0-1 of 4, i.e. sequences 0..7: exactly this rank's ones were skipped
            assert set(ref_ids) - set(fused_ids) == {i for i in ref_ids if i < 8}, name
