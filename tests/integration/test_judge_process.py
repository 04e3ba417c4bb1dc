"""A generative judge in a child process (rollout/judge_process.py, ``reward.judge.isolate`` with the transformers
engine, the same code path as ``engine=vllm``): its replies against transformers' own greedy decode, and the failure
paths -- a batch past the wall-clock limit (the child is killed and replaced, the items time out), a child killed
from outside (the batch's items are errors, the next batch is judged by a fresh child), a judge that cannot load
its model (given up after ``max_restarts`` failures in a row, then every item is an error at once), a parent that
dies without closing its judge (the child exits by itself) -- each scores 0 and is counted, never a crash, and no
judge process is left running."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import judge_helpers
import pytest
import torch

from megatron_rlvr.rewards import RewardConfig, RewardManager
from megatron_rlvr.rewards.judge_config import JudgeConfig
from megatron_rlvr.trainer.judge_setup import build_judge

PLAIN = dict(template="{question}{response}", chat=False, isolate=True)
QUESTIONS, RESPONSES = ["1=", "3=", "4="], ["7", "3", "17"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return {
        "last7": judge_helpers.save_last_token_judge(root / "g7", "generative"),
        "random": judge_helpers.save_random_judge(root / "rg", "generative", seed=3),
    }


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def judged(cfg: JudgeConfig):
    rc = RewardConfig(fn="judge", judge=cfg, num_workers=0)
    judge = build_judge(rc, torch.device("cpu"))
    return judge, RewardManager(rc, report=lambda text: None, judge=judge)


def test_isolated_judge_replies_are_transformers_greedy_decodes_of_the_same_weights(judges):
    """The child's replies to a batch are exactly ``model.generate``'s greedy replies to each prompt alone (float64
    reference), the rewards the parser's reading of them; after close the child is gone."""
    judge, rm = judged(JudgeConfig(model=judges["random"], parse="number", max_tokens=3, **PLAIN))
    questions, responses = ["1=", "23=", "4+5=", "6="], ["1", "23", "9", ""]
    with rm:
        rewards, stats = rm.score(responses, ["0"] * 4, questions=questions)
        pid = judge.process.pid
        assert alive(pid)
    assert not alive(pid)
    expected = judge_helpers.greedy_replies(judges["random"], questions, responses)
    assert judge.last_replies == expected
    assert stats["reward/n_error"] == 0 and stats["reward/n_timeout"] == 0


def test_a_batch_past_the_limit_or_a_killed_child_scores_0_and_a_fresh_child_judges_the_next(judges):
    """One judge through both failures. A warm child, then a batch whose wall-clock limit has passed as soon as it is
    sent (a clock that jumps): every item scores 0 in reward/n_timeout and the child that held the batch is killed
    and replaced (restarts=1). Then SIGKILL to that replacement from outside: the next batch's items all score 0 in
    reward/n_error (restarts=2). The batch after is judged correctly by a third child (the last-token judge: 1
    exactly for responses ending in 7); after close no child is left."""
    judge, rm = judged(JudgeConfig(model=judges["last7"], parse="number", max_tokens=1, timeout_s=60, **PLAIN))
    with rm:
        assert rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)[0] == [1.0, 0.0, 1.0]
        first = judge.process.pid
        ticks = iter([0.0])
        judge.clock = lambda: next(ticks, 1e9)  # the deadline is 60, every later reading is past it
        rewards, stats = rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)
        assert rewards == [0.0, 0.0, 0.0] and stats["reward/n_timeout"] == 3 and stats["reward/n_error"] == 0
        assert not alive(first) and judge.process.restarts == 1
        judge.clock = time.monotonic
        second = judge.process.pid
        os.kill(second, signal.SIGKILL)
        rewards, stats = rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)
        assert rewards == [0.0, 0.0, 0.0] and stats["reward/n_error"] == 3 and stats["reward/n_timeout"] == 0
        assert judge.process.restarts == 2 and judge.process.unreachable is None
        rewards, stats = rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)
        third = judge.process.pid
        assert rewards == [1.0, 0.0, 1.0] and stats["reward/n_error"] == 0 and stats["reward/n_timeout"] == 0
    assert len({first, second, third}) == 3 and not any(alive(p) for p in (first, second, third))


def test_a_judge_that_cannot_load_is_given_up_after_max_restarts(judges, tmp_path):
    """A judge folder whose weights are garbage (its tokenizer loads in the parent, the model fails in the child):
    with max_restarts=2 the first batch fails and restarts the child, the second fails and gives the judge up; a third
    batch scores 0 in reward/n_error at once, and no judge process is left."""
    broken = tmp_path / "broken"
    shutil.copytree(judges["last7"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    judge, rm = judged(JudgeConfig(model=str(broken), parse="number", max_tokens=1, max_restarts=2, **PLAIN))
    pids = []
    with rm:
        for _ in range(2):
            pids.append(judge.process.pid)
            rewards, stats = rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)
            assert rewards == [0.0, 0.0, 0.0] and stats["reward/n_error"] == 3
        assert "given up after 2 failures in a row" in judge.process.unreachable
        assert judge.process.pid is None and not any(alive(p) for p in pids)
        t0 = time.monotonic()
        rewards, stats = rm.score(RESPONSES, ["0"] * 3, questions=QUESTIONS)
        assert stats["reward/n_error"] == 3 and time.monotonic() - t0 < 1.0
    assert judge.process.pid is None


def test_the_child_exits_when_its_parent_is_killed(judges, tmp_path):
    """A parent that starts a judge process and is then SIGKILLed (no close, no atexit) while a forked helper of it
    still holds its end of the socket (so the child sees no end of file): the child notices the parent's death by
    itself within a few seconds and exits, so a killed rank leaves no judge behind."""
    script = textwrap.dedent(
        f"""
        import os, time
        from megatron_rlvr.rollout.judge_process import JudgeProcess
        p = JudgeProcess(dict(engine="hf", model={judges["last7"]!r}, device="cpu", max_batch_rows=4))
        helper = os.fork()
        if helper == 0:  # holds a copy of the parent's end of the socket
            time.sleep(600)
            os._exit(0)
        print(p.pid, helper, flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    child = helper = None
    try:
        child, helper = map(int, parent.stdout.readline().split())
        assert alive(child)
        time.sleep(1.0)  # past the child's start-up of its watcher
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(child)
    finally:
        parent.kill()
        for pid in (child, helper):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
