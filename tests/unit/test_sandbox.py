"""The sandbox for code from the model or the user (megatron_rlvr/sandbox): each hostile program of the table ends as
a clear status within its limits and leaves no process behind; the guards this machine has are the ones that hold;
the calculator is exact (checked against Python's own fraction arithmetic) and refuses anything but arithmetic; the
ToolBox turns every bad call into an observation, never an exception."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from sandbox_helpers import left_behind, live_sandbox_processes, proc_table

from megatron_rlvr.sandbox import SandboxLimits, detect_guards, run_python
from megatron_rlvr.sandbox.calculator import CalculatorError, calculate, format_value
from megatron_rlvr.sandbox.limits import CGROUP_PIDS_ROOT
from megatron_rlvr.sandbox.process import _SANDBOX_UID_BASE, sweep_stale_runs
from megatron_rlvr.sandbox.tools import ToolBox

LIMITS = SandboxLimits(wall_s=20, cpu_s=20, memory_mb=256, output_bytes=1 << 16, max_processes=8)
"""Generous time: a loaded machine must not turn an error into a timeout."""
SHORT = SandboxLimits(wall_s=1.5, cpu_s=1.5, memory_mb=256, output_bytes=1 << 16, max_processes=8)
"""For the cases that run into the time limit."""
SLACK_S = 5.0
"""Start-up and clean-up beyond a limit: the test machine may be shared and loaded (load 25 on 2 cores seen)."""


def _needs(guard: str) -> None:
    if guard not in detect_guards().names():
        pytest.skip(f"this machine has no {guard} guard (see docs/agentic.md, 'The sandbox')")


def _run(code: str, **kw):
    out = run_python(code, kw.pop("limits", LIMITS), **kw)
    assert left_behind(out) == [], f"processes left behind: {left_behind(out)}"
    return out


def test_a_plain_program_gets_its_stdin_and_a_clean_environment():
    """stdout, stdin and the exit status come through; the environment is PATH, LANG, HOME and the BLAS thread
    counts only."""
    out = _run("import os, sys\nprint(sys.stdin.read().upper())\nprint(sorted(os.environ))\nsys.exit(3)", stdin="abc")
    assert out.status == "error" and out.exit_code == 3 and out.signal is None
    names = ["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH"]
    assert out.stdout.splitlines() == ["ABC", str(names)]
    ok = _run("print('hi')")
    assert ok.status == "ok" and ok.stdout == "hi\n" and ok.exit_code == 0 and not ok.truncated


def test_infinite_loop_times_out():
    out = _run("while True:\n    pass", limits=SHORT)
    assert out.status == "timeout" and out.signal == signal.SIGKILL
    assert SHORT.wall_s - 0.1 <= out.seconds <= SHORT.wall_s + SLACK_S


def test_fork_bomb_is_capped():
    _needs_any = {"pids_cgroup", "own_user"} & set(detect_guards().names())
    if not _needs_any:
        pytest.skip("no process cap on this machine (neither the pids cgroup nor an own user id)")
    out = _run("import os\nwhile True:\n    os.fork()")
    assert out.status == "process_limit", (out.status, out.message, out.error_line)
    assert out.seconds <= SHORT.wall_s + SLACK_S


def test_memory_hog_gets_memory_error():
    out = _run("x = bytearray(1 << 30)\nprint('allocated')")
    assert out.status == "memory" and "allocated" not in out.stdout and out.error_line == "MemoryError"


def test_100mb_of_output_is_cut_at_the_cap():
    """The program is killed at the cap: the parent holds at most output_bytes, long before 100 MB are written (and
    long before the wall limit: a bound of half of it, as the machine may be loaded; 1.7 s was seen at load ~5)."""
    out = _run("import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)")
    assert out.status == "output_limit" and out.truncated
    assert len(out.stdout) == LIMITS.output_bytes and set(out.stdout) == {"x"}
    assert out.seconds < LIMITS.wall_s / 2


def test_writing_outside_its_directory(tmp_path):
    """Its own directory is writable; a directory of the parent's user outside /tmp is not (own user id); the
    parent's /tmp is hidden (mount namespace: the test's tmp_path is not even there) and what the program writes in
    its private /tmp never reaches the parent's."""
    _needs("own_user")
    _needs("mount_namespace")
    parents = Path(__file__).resolve().parent / f".sandbox-write-test-{os.getpid()}"
    parents.mkdir(mode=0o755)
    try:
        targets = [parents / "escaped.txt", tmp_path / "escaped.txt", Path(f"/tmp/rlvr-sandbox-test-{os.getpid()}.txt")]
        code = f"""
open("mine.txt", "w").write("ok")
print(open("mine.txt").read())
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, "w").write("escaped")
        print("wrote")
    except OSError as e:
        print("refused", type(e).__name__)
"""
        out = _run(code)
        assert out.status == "ok", out.stderr
        assert out.stdout.splitlines() == ["ok", "refused PermissionError", "refused FileNotFoundError", "wrote"]
        assert not any(t.exists() for t in targets)
    finally:
        for t in parents.iterdir():
            t.unlink()
        parents.rmdir()


def test_the_parents_environment_stays_secret(monkeypatch):
    """A secret in the parent's environment is neither inherited nor readable through /proc (own user id)."""
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("RLVR_SANDBOX_TEST_SECRET", secret)
    code = """
import os
print(dict(os.environ))
for pid in [os.getppid()] + [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        print(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
    except OSError:
        pass
"""
    out = _run(code)
    assert out.status == "ok", out.stderr
    if "own_user" not in detect_guards().names():
        assert secret not in out.stdout.splitlines()[0]  # only the environment itself is scrubbed then
        pytest.skip("without an own user id the parent's /proc/<pid>/environ is readable")
    assert secret not in out.stdout and "RLVR_SANDBOX_TEST_SECRET" not in out.stdout


def test_killing_its_parent_fails():
    _needs("own_user")  # without it the program could kill this test process
    out = _run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')")
    assert out.status == "error" and "PermissionError" in out.error_line and "sent" not in out.stdout


def test_no_network_even_to_localhost():
    _needs("net_namespace")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        out = _run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        assert out.status == "error" and "connected" not in out.stdout
        assert "Network is unreachable" in out.error_line or "Connection refused" in out.error_line, out.error_line
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_a_process_that_leaves_the_group_is_killed_too():
    """setsid takes a child out of the process group; the cgroup or the own user id still finds it."""
    if not {"pids_cgroup", "own_user"} & set(detect_guards().names()):
        pytest.skip("without the pids cgroup or an own user id a setsid child can outlive the run")
    out = _run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    assert out.status == "ok" and out.stdout == "parent done\n" and out.seconds < SHORT.wall_s


def test_an_exception_in_the_parent_still_kills_the_run():
    """A SIGALRM raising in the parent mid-run (what the reward pool's per-item timeout does) kills everything."""
    _needs("own_user")

    class Interrupted(BaseException):
        pass

    def raise_(*_):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, raise_)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            run_python("import os, time\nos.fork()\ntime.sleep(30)", SandboxLimits(wall_s=20, cpu_s=20))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert live_sandbox_processes() == []


STALE_RUN = """
from megatron_rlvr.sandbox import SandboxLimits, run_python
run_python("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\ntime.sleep(120)", SandboxLimits(wall_s=120))
"""


def test_a_run_whose_parent_was_killed_is_swept():
    """A parent SIGKILLed mid-run (a hung reward worker) never reaches its clean-up: the run's main process dies
    with it (PR_SET_PDEATHSIG), and what it left (a setsid child) is killed by the next process's first run
    (sweep_stale_runs), which also removes the dead run's cgroup."""
    _needs("own_user")
    _needs("pids_cgroup")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, "-c", STALE_RUN], env=env, start_new_session=True)
    low = _SANDBOX_UID_BASE + (parent.pid << 6)

    def theirs() -> list[int]:
        return [pid for pid, _, uid, state in proc_table() if state != "Z" and low <= uid < low + 64]

    try:
        deadline = time.monotonic() + 60
        while len(theirs()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(theirs()) == 2, theirs()
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while len(theirs()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(theirs()) == 1  # the main process died with its parent; the setsid child lives on
    assert sweep_stale_runs.__wrapped__() >= 1
    assert theirs() == []
    assert not [n for n in os.listdir(f"{CGROUP_PIDS_ROOT}/megatron-rlvr-sandbox") if n.startswith(f"{parent.pid}-")]


def test_guards_are_reported():
    """The guards a run reports are the ones detected; root gets the own user id only with a mount namespace."""
    g = detect_guards()
    out = _run("pass")
    assert out.guards == g.names()
    assert {"rlimits", "process_group", "clean_env"} <= set(g.names())
    assert g.own_user == (g.root and g.mount_namespace)
    assert (out.uid is not None) == g.own_user


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"wall_s": 0}, "wall_s must be a number > 0"),
        ({"memory_mb": 8}, "memory_mb must be an int >= 16"),
        ({"max_processes": True}, "max_processes must be an int"),
        ({"network": "no"}, "network must be true or false"),
    ],
)
def test_limits_are_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        SandboxLimits(**kw)


# --------------------------------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------------------------------

F = Fraction
CALC_TABLE = [
    ("1 + 2 * 3", F(1) + F(2) * F(3)),
    ("2**100 - 1", F(2) ** 100 - 1),
    ("-(3 - 5) * 4", -(F(3) - F(5)) * F(4)),
    ("1/3 + 1/6", F(1, 3) + F(1, 6)),
    ("0.1 + 0.2", F(1, 10) + F(2, 10)),
    ("(2/3) ** -2", F(2, 3) ** -2),
    ("-7 // 2", F(-7 // 2)),
    ("-7 % 3", F(-7 % 3)),
    ("7.5 // 2", F(F(15, 2) // 2)),
    ("5 % 1.5", F(5) % F(3, 2)),
    ("10**30 // 7 % 1000", F(10**30 // 7 % 1000)),
    ("3.5e2 / 7", F(350, 7)),
    ("(-1) ** (10**9 + 1)", F(-1)),
    ("123456789 ** 5 * 987654321", F(123456789**5 * 987654321)),
    ("+4 - -4", F(8)),
]


@pytest.mark.parametrize("expr, expected", CALC_TABLE, ids=[e for e, _ in CALC_TABLE])
def test_calculator_is_exact(expr, expected):
    assert calculate(expr) == expected


def test_calculator_formats_exactly():
    assert format_value(calculate("2**70")) == str(2**70)
    assert format_value(calculate("1/8")) == "0.125"
    assert format_value(calculate("-5/2")) == "-2.5"
    assert format_value(calculate("3/400")) == "0.0075"
    assert format_value(calculate("1/3")) == "1/3 (about 0.333333333333)"


@pytest.mark.parametrize(
    "expr, message",
    [
        ("x + 1", "found a name"),
        ("__import__('os').system('true')", "found a function call"),
        ("(1).real", "found an attribute"),
        ("[1, 2][0]", "found a subscript"),
        ("[1, 2]", "found a List"),
        ("1 < 2", "found a comparison"),
        ("'a' * 3", "found the literal"),
        ("2 ** 0.5", "only integer exponents"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "too large"),
        ("1e999999999", "exceeds"),
        ("(" * 400 + "1" + ")" * 400, "nested too deeply|not a valid expression"),
        ("1 +", "not a valid expression"),
        ("", "empty"),
    ],
)
def test_calculator_refuses(expr, message):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=message):
        calculate(expr)
    assert time.monotonic() - start < 1.0


# --------------------------------------------------------------------------------------------------------------
# ToolBox
# --------------------------------------------------------------------------------------------------------------

USER_TOOLS = '''
import os

def shout(text: str, times: int = 1) -> str:
    """Repeat the text in capitals."""
    return " ".join([text.upper()] * times)

def whoami() -> str:
    return str(os.getuid())

def not_text(x: int) -> str:
    return x

def broken(x: int) -> str:
    raise RuntimeError(f"broken on {x}")
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    name = f"sandbox_user_tools_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_toolbox_turns_every_bad_call_into_an_observation(user_tools):
    box = ToolBox(
        ["python", "calculator", f"{user_tools}:shout", f"{user_tools}:not_text", f"{user_tools}:broken"], SHORT
    )
    assert box.names == ("python", "calculator", "shout", "not_text", "broken")
    cases = [
        ("python", {"code": "print(6 * 7)"}, "ok", "42\n"),
        ("python", json.dumps({"code": "1/0"}), "error", "error: ZeroDivisionError: division by zero"),
        ("python", {"code": "while True: pass"}, "timeout", f"error: ran past wall_s={SHORT.wall_s:g} s: killed"),
        ("python", "{not json", "bad_arguments", "error: the arguments of python are not valid JSON"),
        ("python", [1], "bad_arguments", "must be a JSON object"),
        ("python", {"code": 5}, "bad_arguments", "'code' must be a string"),
        ("calculator", {"expression": "2**64 // 3"}, "ok", str(2**64 // 3)),
        ("calculator", {"expression": "os.system('x')"}, "error", "error: only numbers"),
        ("calculator", {}, "bad_arguments", "missing ['expression']"),
        ("search", {"q": "x"}, "unknown_tool", "error: unknown tool 'search'; the tools are: python, calculator"),
        ("shout", {"text": "hi", "times": 2}, "ok", "HI HI"),
        ("shout", {"txt": "hi"}, "bad_arguments", "missing ['text']; unexpected ['txt']"),
        ("not_text", {"x": 1}, "error", "error: TypeError: the tool returned int, not a str"),
        ("broken", {"x": 3}, "error", "error: RuntimeError: broken on 3"),
    ]
    for name, args, status, text in cases:
        r = box.call(name, args)
        assert r.status == status and r.ok == (status == "ok"), (name, args, r)
        assert (r.text.startswith("error: ") and text in r.text) if status != "ok" else r.text == text, (name, r.text)
    assert live_sandbox_processes() == []


def test_user_tools_run_in_the_sandbox_under_their_own_user(user_tools):
    _needs("own_user")
    box = ToolBox([f"{user_tools}:whoami"], LIMITS)
    r = box.call("whoami", {})
    assert r.ok and int(r.text) != os.getuid()


def test_toolbox_describes_its_tools_and_refuses_bad_names(user_tools):
    box = ToolBox(["calculator", f"{user_tools}:shout"], LIMITS)
    shout = box.describe()[1]["function"]
    assert shout == {
        "name": "shout",
        "description": "Repeat the text in capitals.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
            "required": ["text"],
        },
    }
    assert box.describe()[0]["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        ToolBox(["shell"], LIMITS)
    with pytest.raises(ValueError, match="cannot load it in the sandbox: ModuleNotFoundError"):
        ToolBox(["no_such_module_xyz:fn"], LIMITS)
    with pytest.raises(ValueError, match="two tools are called 'python'"):
        ToolBox(["python", "python"], LIMITS)
