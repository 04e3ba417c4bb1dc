"""Every algorithm preset trains a LoRA policy (the tiny model, adapters on every target, TP = 2 x DP = 2): two
steps with finite losses and updates; the reference policy of KL terms is the policy with its adapters off (no
second model), so GRPO's reference KL is 0 (to rounding) at the first update (the adapters start at B = 0) and positive
once they moved."""

import json
import os

from megatron_rlvr.algorithms import PRESETS

LORA = ["model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=1e-2"]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train_presets_lora(run_root, names, overrides):
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import train

    codes = {}
    for name in names:
        cfg = load_run_config(None, [*overrides, f"algorithm.preset={name}"])
        codes[name] = train(cfg, os.path.join(run_root, name))
    return codes


def test_every_preset_trains_a_lora_policy(dist_pool, tmp_path):
    import trainer_helpers

    names = list(PRESETS)
    codes = dist_pool.run(
        _train_presets_lora, tp=2, args=(str(tmp_path), names, [*trainer_helpers.SMALL, *LORA]), timeout=900
    )[0]
    assert codes == {n: 0 for n in names}
    for name in names:
        recs = _records(tmp_path / name)
        assert [r["step"] for r in recs] == [1, 2], name
        trained = [r for r in recs if r.get("train/updates", 0) >= 1]
        assert trained, f"{name}: no update in two steps"
        for r in trained:
            assert r["loss/total"] is not None and abs(r["loss/total"]) < 1e3, name
            assert r["train/skipped_nonfinite"] == 0, name
            assert r["mismatch/abs_prob_diff_max"] < 1e-4, name  # the engine runs the merged adapters
            if r["adv/abs_mean"] > 0:
                assert r["optim/grad_norm"] > 0, name
    grpo = _records(tmp_path / "grpo")
    kl = [r.get("loss/ref_kl") for r in grpo]
    assert abs(kl[0]) < 1e-10 and kl[1] is not None and kl[1] > 1e-8, kl
    assert any("mcpo/hinge_kl" in r for r in _records(tmp_path / "mcpo"))
