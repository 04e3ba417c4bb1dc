"""reward.fn=code (megatron_rlvr/rewards/code_reward.py) and the ``code`` data schema: a tiny APPS-style data set
written here loads into examples whose ground truth is their test cases; correct, wrong, crashing, looping and
escaping programs get the documented rewards (hand-counted passes), within the time budget, and leave no process
behind; the settings reach the scorer through RewardConfig, inline and in a reward worker."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from sandbox_helpers import live_sandbox_processes

from megatron_rlvr.data.files import load_examples
from megatron_rlvr.rewards import RewardConfig, RewardManager
from megatron_rlvr.rewards.code_reward import CodeReward, extract_program, normalize_tests, same_stdout
from megatron_rlvr.sandbox import detect_guards

STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7", "7\n"]}
CALL = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [-1, 1]], "outputs": [3, [7], 0]}

ADD_STDIO = "a, b = map(int, input().split())\nprint(a + b)"
SUB_STDIO = "a, b = map(int, input().split())\nprint(a - b)"


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


@pytest.fixture
def dataset(tmp_path):
    rows = [
        {"id": "apps-1", "question": "Add two numbers.", "input_output": json.dumps(STDIO), "solutions": "[...]"},
        {"question": "Write add(a, b).", "input_output": json.dumps(CALL), "starter_code": "def add(a, b):", "id": 2},
        {"problem": "Echo.", "tests": [{"input": "x\n", "output": "x\n"}], "difficulty": "easy"},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_code_schema_loads_apps_style_rows(dataset):
    """Detected as "code"; the answer is the normalised tests (an object, not the row's JSON text); reference
    solutions and the tests stay out of the metadata; APPS's starter code is appended to the prompt."""
    ds = load_examples(str(dataset))
    assert [e.id for e in ds] == ["apps-1", "2", ds[2].id]
    assert json.loads(ds[0].answer) == STDIO and json.loads(ds[1].answer) == CALL
    assert json.loads(ds[2].answer) == {"inputs": ["x\n"], "outputs": ["x\n"]}
    assert ds[1].prompt == "Write add(a, b).\n\ndef add(a, b):"
    assert "solutions" not in ds[0].metadata and "input_output" not in ds[0].metadata
    assert ds[2].metadata == {"difficulty": "easy"}


def test_bad_test_cases_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "input_output": '{"inputs": ["1"], "outputs": []}'}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'input_output': test cases: 'inputs' and 'outputs'"):
        load_examples(str(path))


def test_program_extraction_and_output_comparison():
    assert extract_program("```python\nfirst\n```\ntext\n```py\nsecond\n```") == "second\n"
    assert extract_program("```\nno language\n```") == "```\nno language\n```"  # the whole response
    assert extract_program("print(1)") == "print(1)"
    assert same_stdout("3  4 \n\n5\n", "3 4\n5") and not same_stdout("3 4 5", "3 4\n5")
    assert normalize_tests({"inputs": [["a", "b"]], "outputs": [["c"]]}) == {"inputs": ["a\nb"], "outputs": ["c"]}


ONE = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
"""One test: the escape cases print the right answer only when their escape worked."""


def _cases(tmp_path, port: int) -> list[tuple[str, str, dict, float, float | None]]:
    """(name, response, tests, reward with tests="fraction", with tests="all" or None: not run), counted by hand."""
    secret = tmp_path / "expected.json"
    secret.write_text(json.dumps(ONE))
    outside = tmp_path.parent / f"escaped-{os.getpid()}.txt"
    read_expected = f"import json\nprint(json.load(open({str(secret)!r}))['outputs'][0])"
    write_outside = f"open({str(outside)!r}, 'w').write('x')\n{ADD_STDIO}"
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n{ADD_STDIO}"
    two_of_three = "a, b = map(int, input().split())\nprint(a + b if b != -3 else 0)"
    return [
        ("correct", _fenced(ADD_STDIO), STDIO, 1.0, 1.0),
        ("wrong", _fenced(SUB_STDIO), STDIO, 0.0, 0.0),
        ("two of three", _fenced(two_of_three), STDIO, 2 / 3, 0.0),
        ("crashing", _fenced("raise RuntimeError('no')"), ONE, 0.0, None),
        ("looping", _fenced("while True:\n    pass"), STDIO, 0.0, None),
        ("reads the expected output", _fenced(read_expected), ONE, 0.0, None),
        ("writes outside", _fenced(write_outside), ONE, 0.0, None),
        ("opens a socket", _fenced(connect), ONE, 0.0, None),
        ("function", "def add(a, b):\n    return a + b", CALL, 1.0, None),
        (
            "method",
            _fenced("class Solution:\n    def add(self, a, b):\n        print(a)\n        return a + b"),
            CALL,
            1.0,
            None,
        ),
        ("wrong function", _fenced("def add(a, b):\n    return a * b"), CALL, 0.0, None),
        (
            "no such function",
            _fenced("def plus(a, b):\n    return a + b"),
            ONE | {"fn_name": "add", "inputs": [[1]]},
            0.0,
            None,
        ),
    ]


def test_code_reward_table(tmp_path):
    """Each program gets the hand-counted reward in both modes; looping ones cost at most the budget; escapes fail
    (no file written outside, no connection made), and nothing is left running."""
    guards = set(detect_guards().names())
    if not {"own_user", "mount_namespace", "net_namespace"} <= guards:
        pytest.skip(f"the escape cases need own_user, mount_namespace and net_namespace; this machine has {guards}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    try:
        cases = _cases(tmp_path, listener.getsockname()[1])
        # generous limits (a loaded machine must not fail a correct program), short ones for the looping case
        fraction = CodeReward(tests="fraction", test_timeout_s=10.0, budget_s=20.0, memory_mb=256)
        every = CodeReward(tests="all", test_timeout_s=10.0, budget_s=20.0, memory_mb=256)
        short = CodeReward(tests="fraction", test_timeout_s=1.0, budget_s=1.2, memory_mb=256)
        for name, response, tests, want_fraction, want_all in cases:
            gt = json.dumps(tests)
            scorer = short if name == "looping" else fraction
            start = time.monotonic()
            got = scorer(response, gt)
            took = time.monotonic() - start
            assert got == pytest.approx(want_fraction), name
            if scorer is short:  # three tests of 1 s each, cut by the 1.2 s budget
                assert took < short.budget_s + 3.0, (name, took)
            if want_all is not None:
                assert every(response, gt) == want_all, name
            assert live_sandbox_processes() == [], name
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert not (tmp_path.parent / f"escaped-{os.getpid()}.txt").exists()
    finally:
        listener.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_config_settings_reach_the_scorer(workers):
    """code_tests="all" turns the two-of-three program's 2/3 into 0, scored inline and in a reward worker (the
    settings travel with RewardConfig.scorer_options)."""
    two_of_three = _fenced("a, b = map(int, input().split())\nprint(a + b if b != -3 else 0)")
    gt = json.dumps(STDIO)
    for mode, want in (("fraction", 2 / 3), ("all", 0.0)):
        cfg = RewardConfig(fn="code", code_tests=mode, code_test_timeout_s=5.0, timeout_s=30.0, num_workers=workers)
        with RewardManager(cfg) as rm:
            rewards, stats = rm.score([two_of_three, "```python\nprint(\n```"], [gt, gt])
        assert rewards == pytest.approx([want, 0.0]) and stats["reward/n_error"] == 0, (mode, stats)


def test_reward_config_refuses_bad_code_settings():
    with pytest.raises(ValueError, match="reward.code_tests must be one of"):
        RewardConfig(fn="code", code_tests="most")
    with pytest.raises(ValueError, match="must be below 80% of reward.timeout_s"):
        RewardConfig(fn="code", code_test_timeout_s=9.0, timeout_s=10.0)
