"""A tiny-preset colocated run whose reward judge is served by a rank of its own (``parallel.judge_ranks=1``: 2
ranks, one training and one judge rank), launched by the CLI as a user runs it.

The reward is a mix, as in test_judge_vllm_run.py: the last-token judge of tests/judge_helpers.py (replies "1"
exactly when its input ends in "7"), weight +1, served by the judge rank, and the rule
``judge_helpers.last_token_is_7`` (1 exactly when the response's last token under the judge's tokenizer is "7"),
weight -1, scored on the training rank. Each item's reward is 0 exactly when the judge rank's verdict equals the
rule's, so every step's mean reward must be 0 with no judge error, timeout or unreadable reply, while the rule's log
shows responses that end in "7" and others that do not. The judge rank says it served and stopped; after the run
exits 0 no rank of it is left running.
"""

import ast
import json
import os
import subprocess
import sys

import judge_helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError):
            continue
        if text in cmdline and not zombie:
            found.append(int(pid))
    return found


def test_a_colocated_run_scored_by_a_judge_rank(tmp_path, monkeypatch):
    judge = judge_helpers.save_last_token_judge(tmp_path / "judge", "generative", digit="7")
    run, log = tmp_path / "run", tmp_path / "rule.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["JUDGE_HELPERS_LOG"] = str(log)
    env["JUDGE_HELPERS_TOKENIZER"] = judge
    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.commands.cli",
        "train",
        "configs/tiny.yaml",
        f"logging.run_dir={run}",
        f"schedule.steps={STEPS}",
        "launch.nproc=2",
        "parallel.tp=1",
        "parallel.judge_ranks=1",
        "train.prompts_per_step=16",
        "checkpoint.save_every=0",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.plot_at_end=false",
        "logging.tensorboard=off",
        "reward.fn=mix",
        "reward.mix=[{fn: judge, weight: 1.0}, {fn: 'judge_helpers:last_token_is_7', weight: -1.0}]",
        f"reward.judge.model={judge}",
        "reward.judge.template='{question}{response}'",
        "reward.judge.chat=false",
        "reward.judge.parse=number",
        "reward.judge.max_tokens=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _processes_naming(str(run)) == [], "a rank outlived the run"
    assert "judge rank 0 (global rank 1): serving reward.judge to 1 engine leader(s)" in out, out[-3000:]
    assert f"judge rank 0 (global rank 1): stopped after {STEPS} requests" in out, out[-3000:]
    with open(run / "metrics.jsonl") as f:
        recs = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(recs) == list(range(1, STEPS + 1))
    for s, r in recs.items():
        assert r["reward/n_error"] == 0 and r["reward/n_timeout"] == 0 and r["reward/n_judge_unparsed"] == 0, r
        assert abs(r["reward/mean"]) < 1e-9, f"step {s}: the judge rank disagreed with the rule: {r['reward/mean']}"
    with open(log) as f:
        responses = [ast.literal_eval(line) for line in f]  # reprs written by the rule
    monkeypatch.setenv("JUDGE_HELPERS_TOKENIZER", judge)
    monkeypatch.delenv("JUDGE_HELPERS_LOG", raising=False)
    sevens = sum(judge_helpers.last_token_is_7(x, "") for x in responses)
    assert len(responses) == STEPS * 16 * 8 and 0 < sevens < len(responses), (sevens, len(responses))
