"""The training loop in-process on the shared 4-rank gloo pool (TP = 2 x DP = 2 unless stated): every algorithm
preset runs two steps; one step gives the same update at every parallel layout and micro-batch split; bad inputs
(a reward function that raises or hangs, NaN logits, an all-truncated batch, an empty batch) skip or degrade the step
with a clear metric and never crash or change the weights."""

import json
import os
import sys

import pytest
import trainer_helpers

from megatron_rlvr.algorithms import PRESETS

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers

SMALL = trainer_helpers.SMALL


VARIED_REWARD = "reward.fn=trainer_helpers:even_digit_reward"


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ rank functions


def _train_presets(run_root, runs, overrides):
    """``runs``: {run name: extra overrides}."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import train

    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    codes = {}
    for name, extra in runs.items():
        cfg = load_run_config(None, [*overrides, *extra])
        codes[name] = train(cfg, os.path.join(run_root, name))
    return codes


def _engine_checksum(t):
    return sum(float(p.detach().double().abs().sum()) for _, p in t.rollout.engine.named_parameters())


def _one_step(run_dir, overrides):
    """Step 1 at this layout: (its metrics, a checksum of the updated weights as the engine received them)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import rl_step, setup, teardown

    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    t = setup(load_run_config(None, overrides), run_dir)
    try:
        before = _engine_checksum(t)
        m = rl_step(t, 1)
        return m, before, _engine_checksum(t)
    finally:
        teardown(t)


def _bad_inputs(run_root, overrides):
    """NaN logits, an all-truncated batch and an empty (all filtered) batch, driven through rl_step directly."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.megatron.policy import params_checksum
    from megatron_rlvr.trainer import token_loss as loss_mod
    from megatron_rlvr.trainer.colocated import rl_step, setup, teardown

    out = {}
    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    t = setup(load_run_config(None, overrides), os.path.join(run_root, "nan"))
    real = loss_mod.token_stats
    try:
        out["step1"] = rl_step(t, 1)
        w1 = (params_checksum(t.policy.model), _engine_checksum(t))

        def nan_logits(logits, labels, spec, want, other=None):
            poisoned = logits.clone()
            if t.policy.dist.tp_rank == 1:  # NaN in ONE vocabulary shard only: the TP ranks must still agree to skip
                poisoned[0, 0, 0] = float("nan")
            return real(poisoned, labels, spec, want, other)

        loss_mod.token_stats = nan_logits
        out["nan"] = rl_step(t, 2)
        loss_mod.token_stats = real
        w2 = (params_checksum(t.policy.model), _engine_checksum(t))
        out["nan_weights_unchanged"] = w1 == w2
        out["after"] = rl_step(t, 3)
        out["after_weights_changed"] = (params_checksum(t.policy.model), _engine_checksum(t)) != w2

        # all truncated: no EOS can end a response, and DAPO overlong filtering masks truncated responses
        t.rollout.engine.eos_token_ids = ()
        t.policy.cfg.algorithm.dapo.mask_truncated = True  # the update context shares this AlgorithmConfig
        w3 = params_checksum(t.policy.model)
        out["truncated"] = rl_step(t, 4)
        out["truncated_weights_unchanged"] = params_checksum(t.policy.model) == w3
    finally:
        loss_mod.token_stats = real
        teardown(t)

    # empty batch: every reward is 0, so DAPO's dynamic sampling keeps no group in any round
    sys.path.insert(0, TESTS_DIR)
    cfg = load_run_config(None, [*overrides, "algorithm.preset=dapo", "reward.fn=trainer_helpers:zero_reward"])
    t = setup(cfg, os.path.join(run_root, "empty"))
    try:
        w = params_checksum(t.policy.model)
        out["empty"] = rl_step(t, 1)
        out["empty_weights_unchanged"] = params_checksum(t.policy.model) == w
    finally:
        teardown(t)
    return out


def _flaky_rewards(run_dir, overrides):
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import train

    sys.path.insert(0, TESTS_DIR)  # the reward workers import trainer_helpers by dotted path
    cfg = load_run_config(
        None,
        [
            *overrides,
            "reward.fn=trainer_helpers:flaky_reward",
            "reward.num_workers=1",
            "reward.timeout_s=1.0",
            "reward.kill_grace_s=0.5",
            "reward.extraction=full",
        ],
    )
    return train(cfg, run_dir)


# ------------------------------------------------------------------------------------------------ tests


def test_every_preset_runs_two_steps(dist_pool, tmp_path):
    """Each registry preset (GRPO, Dr.GRPO, DAPO, CISPO, GSPO, RLOO, REINFORCE++, CPGD, F-GRPO/DAPO/CISPO, MCPO,
    MCPO + margin) trains the tiny model for two steps at TP = 2 x DP = 2 with finite losses."""
    names = list(PRESETS)
    runs = {n: [f"algorithm.preset={n}"] for n in names}
    codes = dist_pool.run(_train_presets, tp=2, args=(str(tmp_path), runs, SMALL), timeout=600)[0]
    assert codes == {n: 0 for n in names}
    for name in names:
        recs = _records(tmp_path / name)
        assert [r["step"] for r in recs] == [1, 2], name
        trained = [r for r in recs if r.get("train/updates", 0) >= 1]
        assert trained, f"{name}: no update in two steps: {recs}"
        for r in trained:
            assert r["loss/total"] is not None and abs(r["loss/total"]) < 1e3, name
            assert r["train/skipped_nonfinite"] == 0, name
            if r["adv/abs_mean"] > 0:  # all-equal groups have zero advantage and a zero gradient
                assert r["optim/grad_norm"] > 0, name
        with open(tmp_path / name / "config.yaml") as f:
            assert f"name: {name}" in f.read()
    assert any("mcpo/hinge_kl" in r for r in _records(tmp_path / "mcpo"))
    assert any("credit/" in k for r in _records(tmp_path / "mcpo_margin") for k in r)
    assert any("drift/kl" in r for r in _records(tmp_path / "cpgd"))
    assert any("loss/ref_kl" in r for r in _records(tmp_path / "grpo"))  # GRPO's reference KL needs the ref model


LAYOUTS = {
    "tp2_dp2": (2, 1, []),
    "tp2_dp2_microbatched": (2, 1, ["train.micro_batch_tokens=10"]),
    "tp2_dp2_distopt": (2, 1, ["parallel.distributed_optimizer=true"]),
    "tp2_dp2_seqpar": (2, 1, ["parallel.sequence_parallel=true"]),
    "tp1_dp4": (1, 1, []),
    "tp1_pp2_dp2": (1, 2, []),
}


def test_one_step_is_the_same_at_every_layout(dist_pool, tmp_path):
    """Same seed, any (TP, PP, DP), micro-batch split or optimizer sharding: the same rollouts,
    loss and gradient norm, and the same updated weights in the engines. A wrong loss scale (megatron averages over
    micro-batches and DP ranks; the RLVR losses are global sums) or a wrong weight sync breaks this."""
    # a reward with variance in any batch: the exact-copy reward of a random policy can be 0 for all 32 samples
    base = [*SMALL, "train.prompts_per_step=8", "algorithm.preset=grpo", "optimizer.lr=1e-3", VARIED_REWARD]
    results = {}
    for name, (tp, pp, extra) in LAYOUTS.items():
        over = [*base, f"parallel.tp={tp}", f"parallel.pp={pp}", *extra]
        results[name] = dist_pool.run(_one_step, tp=tp, pp=pp, args=(str(tmp_path / name), over), timeout=300)
    ref_m, ref_before, ref_after = results["tp2_dp2"][0]
    assert ref_m["train/updates"] == 1 and ref_after != ref_before
    for name, per_rank in results.items():
        for m, before, after in per_rank:
            assert m["reward/mean"] == ref_m["reward/mean"], name
            assert m["loss/num_tokens"] == ref_m["loss/num_tokens"], name
            assert m["loss/total"] == pytest.approx(ref_m["loss/total"], rel=1e-4, abs=1e-7), name
            assert m["optim/grad_norm"] == pytest.approx(ref_m["optim/grad_norm"], rel=1e-4), name
            assert before == pytest.approx(ref_before, rel=1e-6), name
            assert after == pytest.approx(ref_after, rel=1e-6), name
    assert results["tp2_dp2_microbatched"][0][0]["loss/num_tokens"] == ref_m["loss/num_tokens"]


def test_nan_logits_and_empty_batches_skip_the_step(dist_pool, tmp_path):
    out = dist_pool.run(_bad_inputs, tp=2, args=(str(tmp_path), [*SMALL, VARIED_REWARD]), timeout=300)
    for o in out:
        assert o["step1"]["train/updates"] == 1
        nan = o["nan"]
        assert nan["train/skipped"] == 1 and nan["train/skipped_nonfinite"] == 1 and nan["train/updates"] == 0
        assert nan["logprobs/nonfinite"] == 1
        assert o["nan_weights_unchanged"], "a NaN step must leave trainer and engine weights untouched"
        assert o["after"]["train/updates"] == 1 and o["after_weights_changed"]
        trunc = o["truncated"]
        assert trunc["response/truncated_frac"] == 1.0
        assert trunc["train/skipped_empty"] == 1 and trunc["train/skipped"] == 1
        assert o["truncated_weights_unchanged"]
        empty = o["empty"]
        assert empty["rollout/kept_groups"] == 0 and empty["rollout/rounds"] == 4
        assert empty["train/skipped_empty"] == 1 and o["empty_weights_unchanged"]


def test_reward_function_that_raises_or_hangs_scores_zero_and_training_goes_on(dist_pool, tmp_path):
    run_dir = tmp_path / "flaky"
    over = [*SMALL, "train.prompts_per_step=8"]
    codes = dist_pool.run(_flaky_rewards, tp=2, args=(str(run_dir), over), timeout=300)
    assert codes == [0, 0, 0, 0]
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert sum(r["reward/n_error"] for r in recs) >= 1
    assert sum(r["reward/n_timeout"] for r in recs) >= 1
    assert all(r["train/skipped_nonfinite"] == 0 for r in recs if "train/skipped_nonfinite" in r)


def test_loop_options(dist_pool, tmp_path):
    """Loop variants beyond the presets: several mini-batches x epochs (off-policy ratios, clipping), the exact
    full-vocabulary reference KL through the ops, engine log-probs as the behaviour policy with truncated importance
    sampling, and periodic evaluation."""
    bench = tmp_path / "copy.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"{d}=", "answer": str(d)}) + "\n" for d in range(6)))
    runs = {
        "minibatches_x_epochs": ["algorithm.preset=dapo", "train.mini_batch_prompts=2", "train.ppo_epochs=2"],
        # a reward with variance: the update moves the policy away from the reference (all-zero rewards left it in
        # place, and an exact KL computed from the policy's own logits passed as well)
        "exact_ref_kl": ["algorithm.preset=grpo", "algorithm.ref_kl.estimator=exact", VARIED_REWARD],
        "rollout_logprobs_tis": ["rollout.old_logprobs=rollout", "rollout.tis_cap=2.0"],
        "eval": [f"eval.files=[{bench}]", "eval.every=2", "eval.k=2", "reward.extraction=lenient"],
    }
    codes = dist_pool.run(_train_presets, tp=2, args=(str(tmp_path), runs, SMALL), timeout=300)[0]
    assert codes == {n: 0 for n in runs}
    mb = _records(tmp_path / "minibatches_x_epochs")
    assert max(r.get("train/updates", 0) for r in mb) >= 2  # up to 2 mini-batches x 2 epochs per step
    assert any(r.get("loss/ratio_max", 1.0) != 1.0 for r in mb)  # later updates are off-policy
    kl = [r for r in _records(tmp_path / "exact_ref_kl") if "loss/ref_kl" in r]
    # exact KL(pi || ref): 0 before the first update (the reference is the start policy), > 0 after it
    assert [r["step"] for r in kl] == [1, 2] and abs(kl[0]["loss/ref_kl"]) < 1e-9 and kl[1]["loss/ref_kl"] > 1e-6, kl
    tis = _records(tmp_path / "rollout_logprobs_tis")
    assert all("mismatch/kl_k3" not in r for r in tis)  # no recompute: the engine's log-probs are the old policy
    assert all(r["train/skipped_nonfinite"] == 0 for r in tis)
    ev = _records(tmp_path / "eval")
    assert ev[-1]["step"] == 2 and "eval/copy/avg@2" in ev[-1] and "eval/copy/pass@2" in ev[-1]
    assert 0 <= ev[-1]["eval/copy/avg@2"] <= ev[-1]["eval/copy/pass@2"] <= 1
