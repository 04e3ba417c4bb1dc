"""Every repro script (tools/repro, issue 13) runs end to end in its seconds-long --quick mode and writes its outputs;
the closed form of Pr(B_tau) matches a hand-computed value; the at-scale config parses with the diagnostics section.
The full experiments are NOT run here (docs/results.md has their commands)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
