"""Every repro script (tools/repro, docs/results.md) runs end to end in its seconds-long --quick mode and writes its
outputs; the closed form of Pr(B_tau) matches a hand-computed value; the at-scale config parses with the diagnostics
section. The full experiments are NOT run here (docs/results.md has their commands)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _run(script, out, *extra):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "repro", script), "--quick", "--out", str(out), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_pr_b_tau_closed_form_hand_case():
    from tools.repro.pr_b_tau import closed_form

    # N = 2, mu = 0.5, tau = 0.1: 0.9^2 - 0.4^2 - 0.5^2 = 0.81 - 0.16 - 0.25 = 0.40
    assert closed_form(2, 0.5, 0.1) == pytest.approx(0.40)
    assert closed_form(1, 0.5, 0.1) == pytest.approx(0.0)  # one rollout never has mixed rewards


def test_pr_b_tau_quick(tmp_path):
    out = _run("pr_b_tau.py", tmp_path)
    res = json.load(open(tmp_path / "pr_b_tau.json"))
    assert len(res["rows"]) == 9 and os.path.isfile(tmp_path / "pr_b_tau.png")
    assert res["max_abs_z"] < 5, out  # 2000 trials: the MC agrees with the closed form


def test_categorical_sim_quick(tmp_path):
    _run("categorical_sim.py", tmp_path)
    res = json.load(open(tmp_path / "categorical_sim.json"))
    assert {r["algo"] for r in res["results"]} == {"grpo", "f_grpo_g1"}
    for r in res["results"]:
        assert all(0.0 <= q <= 1.0 for q in r["Q_pos_curve_mean"]) and r["M_ret_curve_mean"][0] == 1.0


def test_minirl_quick_all_comparisons(tmp_path):
    _run("minirl.py", tmp_path, "--comparison", "all")
    for name in ("mcpo_vs_dapo", "cpgd_stability", "margin_credit", "fgrpo_passk"):
        assert os.path.isfile(tmp_path / f"{name}.png")
        table = open(tmp_path / f"{name}.md").read()
        assert "held-out pass@1" in table
        res = json.load(open(tmp_path / f"{name}.json"))["results"]
        assert all(len(v) == 1 for v in res.values())


def test_scale_config_parses_with_diagnostics():
    from megatron_rlvr.config import load_run_config

    cfg = load_run_config(
        os.path.join(REPO, "configs", "repro", "scale.yaml"),
        [
            "model.name=tiny",
            "model.hf_path=null",
            "model.dtype=float32",
            "rollout.engine=hf",
            "rollout.max_prompt_len=16",
            "rollout.max_response_len=16",
        ],
    )
    assert cfg.diagnostics.forgetting_every == 1 and cfg.diagnostics.forgetting_rollouts == 8


def test_smollm2_held_out_set_is_disjoint_from_training_prompts():
    from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples
    from tools.repro.smollm2_arith_data import TRAIN, held_out

    rows = held_out(64)
    train = {e.prompt for e in generate_examples(ProceduralConfig(seed=0, **TRAIN))}
    assert len(rows) == 64 and len({r["problem"] for r in rows}) == 64
    assert not {r["problem"] for r in rows} & train
    for r in rows:  # "What is a + b?" with its sum as the answer
        a, b = (int(x) for x in r["problem"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert int(r["answer"]) == a + b


def test_smollm2_eval_interval_and_paired_compare(tmp_path):
    from tools.repro.smollm2_eval import bootstrap_mean_ci, compare

    assert bootstrap_mean_ci([0.25] * 10) == (0.25, 0.25)
    # 64 problems, half always right: mean 0.5, normal-approximation half width 1.96 * sqrt(0.25 / 64) = 0.1225
    lo, hi = bootstrap_mean_ci([0.0, 1.0] * 32)
    assert lo == pytest.approx(0.5 - 0.1225, abs=0.03) and hi == pytest.approx(0.5 + 0.1225, abs=0.03)
    before = {"file": "f.jsonl", "avg_at_k": 0.25, "per_problem": [0.0, 0.5, 0.25, 0.25]}
    after = {"file": "f.jsonl", "avg_at_k": 0.5, "per_problem": [0.5, 0.5, 0.75, 0.25]}
    for name, r in (("b.json", before), ("a.json", after)):
        (tmp_path / name).write_text(json.dumps(r))
    c = compare(str(tmp_path / "b.json"), str(tmp_path / "a.json"))
    assert c["diff"] == pytest.approx(0.25) and (c["problems_better"], c["problems_worse"]) == (2, 0)
    assert c["diff_ci95"][0] <= c["diff"] <= c["diff_ci95"][1]
    (tmp_path / "short.json").write_text(json.dumps({**after, "per_problem": [0.5]}))
    with pytest.raises(ValueError, match="not evals of the same problems"):
        compare(str(tmp_path / "b.json"), str(tmp_path / "short.json"))


def test_smollm2_config_parses_and_matches_the_eval_prompt(tmp_path):
    from megatron_rlvr.config import load_run_config
    from tools.repro.smollm2_arith_data import PROMPT_TEMPLATE, TRAIN

    held = tmp_path / "arith_eval.jsonl"
    held.write_text(json.dumps({"problem": "What is 1 + 23?", "answer": "24"}) + "\n")
    cfg = load_run_config(
        os.path.join(REPO, "configs", "repro", "smollm2_arith.yaml"),
        ["model.name=tiny", "model.gguf=null", "rollout.engine=hf", "rollout.max_prompt_len=16"]
        + ["rollout.max_response_len=16", f"eval.files=[{held}]"],
    )
    assert cfg.data.prompt_template == PROMPT_TEMPLATE  # the training prompts and the held-out eval ask the same way
    proc = cfg.data.procedural
    assert {k: getattr(proc, k) for k in TRAIN} == TRAIN
    assert cfg.algorithm.name == "mcpo" and cfg.launch.nproc == 1
