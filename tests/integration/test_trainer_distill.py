"""On-policy distillation in the training loop, in-process on the shared 4-rank gloo pool (TP = 2 x DP = 2): a tiny
run exports its HF folder, then 2-step runs distil into a fresh student from that folder (sampled estimator, loss
mode), from another random-init tiny teacher (full-vocabulary estimator) and into LoRA students (advantage mode,
distillation alone; full estimator from the student's own base model); every step logs the distillation metrics.
A CP = 2 step logs the CP = 1 step's distillation metrics, and an EP = 2 step of a tiny MoE student the EP = 1
step's."""

import json
import math
import os
import sys

import trainer_helpers

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(run_root, runs, overrides):
    """``runs``: {run name: extra overrides}, in order (a later run may read an earlier one's export)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import train

    sys.path.insert(0, TESTS_DIR)
    codes = {}
    for name, extra in runs.items():
        cfg = load_run_config(None, [*overrides, *extra])
        codes[name] = train(cfg, os.path.join(run_root, name))
    return codes


def test_distillation_runs_log_their_metrics(dist_pool, tmp_path):
    """Each distillation run exits 0 and logs, at each of its 2 steps, a finite ``distill/kl_per_token`` and a
    ``distill/teacher_logprob_mean`` that is a log-probability (<= 0, above log(1/19) - 5 on the 19-token tiny
    vocabulary); a teacher that differs from the student gives KL > 0, and in loss mode (token-mean, one update per
    step) the loss term equals the logged mean KL. The start teacher (train.seed, the student's own start weights)
    gives a full-vocabulary KL of exactly 0 at step 1, before any update; so does the LoRA student's own base model
    as its teacher (a separate frozen copy; the adapters start at zero)."""
    teacher_dir = tmp_path / "teacher" / "hf"
    runs = {
        "teacher": ["checkpoint.export_hf=true", "schedule.steps=2"],
        "sampled_from_folder": [f"algorithm.distill.teacher={teacher_dir}"],
        "full_other_seed": [
            "algorithm.distill.teacher=tiny",
            "algorithm.distill.teacher_seed=7",
            "algorithm.distill.estimator=full",
        ],
        "full_same_start": ["algorithm.distill.teacher=tiny", "algorithm.distill.estimator=full"],
        "lora_full_base_teacher": [
            "algorithm.distill.teacher=tiny",
            "algorithm.distill.estimator=full",
            "model.lora.rank=8",
            "model.lora.alpha=16",
        ],
        "advantage_lora_alone": [
            "algorithm.distill.teacher=tiny",
            "algorithm.distill.teacher_seed=7",
            "algorithm.distill.mode=advantage",
            "algorithm.distill.reward_weight=0",
            "model.lora.rank=8",
            "model.lora.alpha=16",
        ],
    }
    codes = dist_pool.run(_train, tp=2, args=(str(tmp_path), runs, trainer_helpers.SMALL), timeout=600)[0]
    assert codes == {n: 0 for n in runs}
    assert (teacher_dir / "config.json").is_file()
    for name in runs:
        if name == "teacher":
            assert all("distill/kl_per_token" not in r for r in _records(tmp_path / name))
            continue
        recs = _records(tmp_path / name)
        assert [r["step"] for r in recs] == [1, 2], name
        for r in recs:
            kl, t_lp = r["distill/kl_per_token"], r["distill/teacher_logprob_mean"]
            assert math.isfinite(kl) and math.log(1 / 19) - 5 < t_lp <= 0, (name, r)
            if "loss/distill" in r:
                assert abs(r["loss/distill"] - kl) < 1e-5, (name, r)
        if name == "full_other_seed":
            assert all(r["distill/kl_per_token"] > 1e-4 for r in recs), recs
        if name in ("full_same_start", "lora_full_base_teacher"):
            assert recs[0]["distill/kl_per_token"] == 0.0
        if name == "advantage_lora_alone":
            assert all("loss/distill" not in r for r in recs)


DISTILL_KEYS = ("distill/kl_per_token", "distill/teacher_logprob_mean", "loss/distill")


def _same_step1_metrics(dist_pool, root, common, layouts):
    """1-step runs of both estimators at each of two ``layouts`` ({name: (pool layout kwargs, overrides)}): every
    run exits 0 and the step-1 distillation metrics of the two layouts agree to 1e-5 on the same batch (reward,
    response length); the KL is not 0 (the teacher differs from the student)."""
    runs = {est: [f"algorithm.distill.estimator={est}"] for est in ("full", "sampled")}
    recs = {}
    for name, (layout, overrides) in layouts.items():
        codes = dist_pool.run(_train, **layout, args=(str(root / name), runs, [*common, *overrides]), timeout=600)[0]
        assert codes == {n: 0 for n in runs}, (name, codes)
        recs[name] = {n: _records(root / name / n) for n in runs}
    a_name, b_name = layouts
    for est in runs:
        (a,), (b,) = recs[a_name][est], recs[b_name][est]
        assert a["reward/mean"] == b["reward/mean"] and a["response/length_mean"] == b["response/length_mean"]
        assert a["distill/kl_per_token"] > 1e-3, (est, a)
        for key in DISTILL_KEYS:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (est, key, a[key], b[key])


def test_distillation_step_at_cp2_matches_cp1(dist_pool, tmp_path):
    """Context parallelism with a teacher: 1-step runs at CP = 2 x DP = 2 and at CP = 1 x DP = 4 (TP = 1; the tiny
    student and teacher are drawn in HF layout from their seeds, so the weights are the same at both layouts, and
    each rollout sample has its own seeded generator, so is the batch), for the full-vocabulary estimator (the
    teacher's logits split over CP like the student's) and the sampled one (the teacher's log-probs from its own
    CP forward), with seq-mean-token-mean aggregation (per-sequence token counts completed over CP): the step-1
    distillation metrics agree to 1e-5, the batch (reward, response length) is the same, and the KL is not 0 (the
    teacher differs from the student)."""
    common = [
        *trainer_helpers.SMALL,
        "schedule.steps=1",
        "parallel.tp=1",
        "algorithm.distill.teacher=tiny",
        "algorithm.distill.teacher_seed=7",
        "algorithm.aggregation.mode=seq-mean-token-mean",
    ]
    layouts = {"cp1": ({}, ["parallel.cp=1"]), "cp2": ({"cp": 2}, ["parallel.cp=2"])}
    _same_step1_metrics(dist_pool, tmp_path, common, layouts)


def test_moe_distillation_step_at_ep2_matches_ep1(dist_pool, tmp_path):
    """Expert parallelism with a teacher: a tiny MoE student distilled from another random-init tiny MoE teacher
    (built at the policy's layout, its experts split over EP like the student's), 1-step runs at EP = 2 and EP = 1
    (DP = 4), both estimators: the same step-1 distillation metrics on the same batch, KL not 0."""
    common = [
        *trainer_helpers.SMALL,
        "schedule.steps=1",
        "parallel.tp=1",
        "model.name=tiny_moe",
        "algorithm.distill.teacher=tiny_moe",
        "algorithm.distill.teacher_seed=7",
    ]
    layouts = {"ep1": ({}, ["parallel.ep=1"]), "ep2": ({"ep": 2}, ["parallel.ep=2"])}
    _same_step1_metrics(dist_pool, tmp_path, common, layouts)
