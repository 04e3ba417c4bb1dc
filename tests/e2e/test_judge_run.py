"""A tiny-preset run trained by a model judge (``reward.fn=judge``), launched by the CLI as a user runs it: the policy
learns the judge's preference.

The judge is the hand-built generative one of tests/judge_helpers.py, served by the transformers engine on the
rollout side: it replies "1" exactly when its input (question + response) ends in "7" (max_tokens 1, parse
``number``), whatever the prompt's digit. A random policy's responses end in "7" about 1/19 of the time; the mean
judge reward must rise from <= 0.2 to >= 0.6 within 20 steps, and, checked independently of the judge, the exported
policy must then answer most prompts greedily with a response that ends in "7".
"""

import json
import os
import subprocess
import sys

import judge_helpers
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 20


def test_policy_learns_the_judges_preference(tmp_path):
    judge = judge_helpers.save_last_token_judge(tmp_path / "judge", "generative", digit="7")
    run = tmp_path / "run"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.commands.cli",
        "train",
        "configs/tiny.yaml",
        f"logging.run_dir={run}",
        f"schedule.steps={STEPS}",
        "schedule.warmup_steps=5",
        "launch.nproc=1",
        "parallel.tp=1",
        "checkpoint.save_every=0",
        "logging.plot_at_end=false",
        "reward.fn=judge",
        f"reward.judge.model={judge}",
        "reward.judge.template='{question}{response}'",
        "reward.judge.chat=false",
        "reward.judge.parse=number",
        "reward.judge.max_tokens=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(run / "metrics.jsonl") as f:
        recs = {r["step"]: r for r in map(json.loads, f)}
    rewards = [recs[s]["reward/mean"] for s in range(1, STEPS + 1)]
    assert all(recs[s]["reward/n_judge_unparsed"] == 0 and recs[s]["reward/n_error"] == 0 for s in recs)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert first <= 0.2, f"a random policy ends in 7 about 1/19 of the time: {rewards}"
    assert last >= 0.6, f"the judge reward did not rise: {rewards}"

    # independent of the judge: the exported policy's greedy answers end in "7"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ends_in_7 = 0
    for d in range(10):
        ids = torch.tensor([tok(f"{d}=")["input_ids"]])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=0)
        ends_in_7 += tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).endswith("7")
    assert ends_in_7 >= 7, f"only {ends_in_7} of 10 greedy answers end in 7 (rewards {rewards})"
