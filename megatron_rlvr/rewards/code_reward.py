"""The ``code`` reward: the program in a response, run against the example's test cases in the sandbox.

Test cases (the example's ground truth: a JSON string, as the ``code`` data schema writes it) come in the two layouts
APPS / CodeContests / TACO store:

- standard input / output: ``{"inputs": [stdin, ...], "outputs": [expected stdout, ...]}``; the program reads the
  input and its output must equal the expected one token by token on each line (trailing spaces, blank lines and
  line endings do not count);
- function call: ``{"fn_name": name, "inputs": [[arg, ...], ...], "outputs": [expected, ...]}``; the program defines
  ``name`` (a function, or a method of a class ``Solution``, LeetCode style), which is called with the arguments;
  its JSON-round-tripped result must equal the expected value (or ``[result]`` must: APPS wraps some outputs in a
  list).

Each test runs in its own sandbox process (:mod:`megatron_rlvr.sandbox`); a test's expected output is never given
to the program: it gets the input only, and the comparison happens here. A crash, a timeout, a memory or output
overflow, a refused fork fails that test. ``tests="fraction"`` rewards the share of tests passed, ``"all"`` gives 1.0
only when every test passes (and stops at the first failure). The tests of one response run within ``budget_s``
in all; tests left when it is spent fail (the reward pool's own ``reward.timeout_s`` must never be what ends a
looping program: that would count as a reward failure, not as a wrong program).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from megatron_rlvr.sandbox import SandboxLimits, run_python

__all__ = ["CODE_TEST_MODES", "CodeReward", "CodeTests", "extract_program", "normalize_tests", "same_stdout"]

CODE_TEST_MODES = ("fraction", "all")
"""``reward.code_tests``: the share of tests passed, or 1.0 only when all pass."""

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_RESULT_MARK = "@@code-reward-result@@"


def extract_program(response: str) -> str:
    """The last fenced ```python block of the response (```py and ```python3 too), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass(frozen=True)
class CodeTests:
    """One example's test cases."""

    inputs: list
    """Standard input texts, or argument lists (function-call style)."""
    outputs: list
    """Expected standard outputs, or expected return values."""
    fn_name: str | None = None
    """The function called (function-call style); None for standard input / output."""


def _text(value, what: str) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # some sets store lines
        return "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string (or a list of lines), got {type(value).__name__}")
    return value


def normalize_tests(raw) -> dict:
    """Test cases from a data row (a dict, its JSON text, or a list of ``{"input", "output"}``) in the one layout
    the reward reads: ``{"inputs": [...], "outputs": [...]}`` plus ``"fn_name"`` for function-call tests."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"test cases are not valid JSON: {e}") from None
    if isinstance(raw, list):  # [{"input": ..., "output": ...}, ...]
        if not all(isinstance(t, dict) and "input" in t and "output" in t for t in raw):
            raise ValueError("a list of test cases must hold {'input': ..., 'output': ...} objects")
        raw = {"inputs": [t["input"] for t in raw], "outputs": [t["output"] for t in raw]}
    if not isinstance(raw, dict) or "inputs" not in raw or "outputs" not in raw:
        raise ValueError("test cases need 'inputs' and 'outputs' (and 'fn_name' for function-call tests)")
    inputs, outputs, fn_name = raw["inputs"], raw["outputs"], raw.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("test cases: 'inputs' and 'outputs' must be non-empty lists of the same length")
    if fn_name is not None:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"test cases: 'fn_name' must be a Python name, got {fn_name!r}")
        if not all(isinstance(a, list) for a in inputs):
            raise ValueError("function-call test cases: each input must be a list of arguments")
        return {"fn_name": fn_name, "inputs": inputs, "outputs": outputs}
    return {
        "inputs": [_text(v, f"input {i}") for i, v in enumerate(inputs)],
        "outputs": [_text(v, f"output {i}") for i, v in enumerate(outputs)],
    }


def parse_tests(ground_truth: str) -> CodeTests:
    norm = normalize_tests(ground_truth)
    return CodeTests(norm["inputs"], norm["outputs"], norm.get("fn_name"))


def same_stdout(got: str, expected: str) -> bool:
    """Equal outputs: the same whitespace-separated tokens on each non-blank line."""

    def lines(text: str) -> list[list[str]]:
        return [ln.split() for ln in text.splitlines() if ln.strip()]

    return lines(got) == lines(expected)


_HARNESS = """
import json, os, sys
args = json.loads(sys.stdin.read())
space = {"__name__": "solution"}
with open("solution.py") as f:
    exec(compile(f.read(), "solution.py", "exec"), space)
fn = space.get(FN_NAME)
if fn is None and isinstance(space.get("Solution"), type):
    fn = getattr(space["Solution"](), FN_NAME, None)
if not callable(fn):
    raise NameError(f"the program defines no function {FN_NAME!r}")
result = fn(*args)
try:
    text = json.dumps(result)
except (TypeError, ValueError):
    text = json.dumps(repr(result))
sys.stdout.flush()
os.write(1, ("\\n" + MARK + text + "\\n").encode())
"""


def _call_result(stdout: str):
    """The function's JSON result: the last line that carries the harness's mark."""
    for line in reversed(stdout.split("\n")):
        if line.startswith(_RESULT_MARK):
            try:
                return True, json.loads(line[len(_RESULT_MARK) :])
            except ValueError:
                return False, None
    return False, None


def _same_value(got, expected) -> bool:
    return got == expected or [got] == expected


class CodeReward:
    """``reward.fn=code``: the share of the example's test cases the response's program passes (``tests="all"``:
    1.0 only when every one passes). The extraction setting does not apply (the program is the last ```python
    block, else the whole response)."""

    OUTPUT_BYTES = 1 << 20
    """What a test's program may print (a longer output fails the test)."""

    def __init__(
        self,
        extraction: str = "boxed",
        tests: str = "fraction",
        test_timeout_s: float = 2.0,
        memory_mb: int = 1024,
        budget_s: float = 8.0,
    ):
        if tests not in CODE_TEST_MODES:
            raise ValueError(f"code reward: tests must be one of {CODE_TEST_MODES}, got {tests!r}")
        if not budget_s > 0:
            raise ValueError(f"code reward: budget_s must be > 0, got {budget_s!r}")
        self.tests = tests
        self.budget_s = float(budget_s)
        self.limits = SandboxLimits(
            wall_s=test_timeout_s, cpu_s=test_timeout_s, memory_mb=memory_mb, output_bytes=self.OUTPUT_BYTES
        )

    @staticmethod
    def has_answer(response: str, extraction: str) -> bool:
        """A program to run was found (``reward/n_no_answer`` counts the others): a fenced python block, or a
        non-blank response."""
        return bool(extract_program(response).strip())

    def run_tests(self, program: str, cases: CodeTests) -> list[bool]:
        """Pass / fail per test case, in order (tests not run, after an "all" failure or past the budget: False)."""
        passed: list[bool] = []
        end = time.monotonic() + self.budget_s
        harness = None
        if cases.fn_name is not None:
            harness = _HARNESS.replace("FN_NAME", repr(cases.fn_name)).replace("MARK", repr(_RESULT_MARK))
        for inp, expected in zip(cases.inputs, cases.outputs):
            left = end - time.monotonic()
            if left < 0.05 or (self.tests == "all" and passed and not passed[-1]):
                passed.append(False)
                continue
            wall = min(self.limits.wall_s, left)
            limits = SandboxLimits(
                wall_s=wall, cpu_s=wall, memory_mb=self.limits.memory_mb, output_bytes=self.OUTPUT_BYTES
            )
            if harness is None:
                out = run_python(program, limits, stdin=inp)
                passed.append(out.status == "ok" and same_stdout(out.stdout, expected))
            else:
                out = run_python(harness, limits, stdin=json.dumps(inp), files={"solution.py": program})
                found, value = _call_result(out.stdout) if out.status == "ok" else (False, None)
                passed.append(found and _same_value(value, expected))
        return passed

    def __call__(self, response: str, ground_truth: str, **metadata) -> float:
        cases = parse_tests(ground_truth)
        passed = self.run_tests(extract_program(response), cases)
        if self.tests == "all":
            return 1.0 if all(passed) else 0.0
        return sum(passed) / len(passed)
