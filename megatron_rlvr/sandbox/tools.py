"""The tools a multi-turn rollout calls: built-ins ``python`` and ``calculator``, and user tools ``pkg.mod:function``.

``ToolBox.call`` never raises for what the model sends: bad JSON, unknown tools, missing or extra arguments, code that
crashes, loops, forks or floods its output each end as a :class:`ToolResult` whose text the policy reads. User tools
are imported and called in a sandbox process (:func:`megatron_rlvr.sandbox.process.call_function`), never in the
caller; their keyword arguments come from the model, their return value must be a str.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_rlvr.sandbox.calculator import CalculatorError, calculate, format_value
from megatron_rlvr.sandbox.limits import SandboxLimits
from megatron_rlvr.sandbox.process import SandboxOutcome, call_function, describe_function, run_python

__all__ = ["BUILTIN_TOOLS", "ToolBox", "ToolResult"]


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gave the policy."""

    text: str
    """The observation text the policy sees (an error becomes a readable message, never an exception)."""
    ok: bool
    """False for any error (bad arguments, unknown tool, tool failure, limits)."""
    status: str
    """"ok", "error", "bad_arguments", "unknown_tool", or a sandbox status: "timeout", "memory", "output_limit",
    "process_limit", "sandbox_error"."""
    seconds: float
    """Wall time of the call."""


_PYTHON_SPEC = {
    "description": "Run a Python 3 program in a sandbox (no network, limited time and memory) and return what it "
    "prints to standard output, followed by the error if it fails. Print what you need to see.",
    "properties": {"code": {"type": "string", "description": "The complete Python program."}},
    "required": ["code"],
}
_CALCULATOR_SPEC = {
    "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses. Integers "
    "stay exact; / gives an exact fraction.",
    "properties": {"expression": {"type": "string", "description": "For example (2**64 - 1) / 3"}},
    "required": ["expression"],
}
BUILTIN_TOOLS = {"python": _PYTHON_SPEC, "calculator": _CALCULATOR_SPEC}
"""Built-in tool name -> description, parameters and required arguments."""

_JSON_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "list": "array",
    "dict": "object",
}


@dataclass(frozen=True)
class _UserTool:
    module: str
    function: str
    spec: dict
    accepts_any: bool
    """The function takes ``**kwargs``: any argument name is passed on."""


def _user_tool(name: str, limits: SandboxLimits) -> tuple[str, _UserTool]:
    module, _, function = name.partition(":")
    if not module or not function or not all(p.isidentifier() for p in (*module.split("."), *function.split("."))):
        raise ValueError(f"tool {name!r}: a user tool is named 'package.module:function'")
    out = describe_function(module, function, limits)
    if out.status != "ok":
        raise ValueError(f"tool {name!r}: cannot load it in the sandbox: {out.error_line or out.message}")
    info = out.result
    props, required, any_kw = {}, [], False
    for p in info["params"]:
        if p["kind"] == "VAR_KEYWORD":
            any_kw = True
        elif p["kind"] in ("VAR_POSITIONAL", "POSITIONAL_ONLY"):
            raise ValueError(f"tool {name!r}: parameter {p['name']!r} cannot be passed by keyword")
        else:
            kind = _JSON_TYPES.get(p["annotation"])
            props[p["name"]] = {"type": kind} if kind else {}
            if p["required"]:
                required.append(p["name"])
    doc = info["doc"].strip() or f"The user tool {name}."
    spec = {"description": doc, "properties": props, "required": required}
    return function.rpartition(".")[2], _UserTool(module, function, spec, any_kw)


class ToolBox:
    """Tools by name: "python", "calculator", or user tools "pkg.mod:function" (called by the function's name).

    A user tool is imported once in a sandbox here to read its parameters (a ValueError names a tool that cannot be
    loaded); each call imports it again in a fresh sandbox process.
    """

    def __init__(self, names: Sequence[str], limits: SandboxLimits, observation_chars: int = 4000):
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise ValueError(f"tools: a non-empty list of tool names, got {names!r}")
        if not isinstance(limits, SandboxLimits):
            raise ValueError(f"tools: limits must be a SandboxLimits, got {type(limits).__name__}")
        if not isinstance(observation_chars, int) or observation_chars < 100:
            raise ValueError(f"tools: observation_chars must be an int >= 100, got {observation_chars!r}")
        self.limits = limits
        self.observation_chars = observation_chars
        self._specs: dict[str, dict] = {}
        self._user: dict[str, _UserTool] = {}
        for raw in names:
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"tools: tool names are non-empty strings, got {raw!r}")
            name = raw.strip()
            if name in BUILTIN_TOOLS:
                call_name, spec = name, BUILTIN_TOOLS[name]
            elif ":" in name:
                call_name, tool = _user_tool(name, limits)
                self._user[call_name] = tool
                spec = tool.spec
            else:
                raise ValueError(
                    f"tools: unknown tool {name!r}; built-ins are {sorted(BUILTIN_TOOLS)}, a user tool is "
                    "'package.module:function'"
                )
            if call_name in self._specs:
                raise ValueError(f"tools: two tools are called {call_name!r}")
            self._specs[call_name] = spec
        self.names: tuple[str, ...] = tuple(self._specs)
        """The names the model calls the tools by (a user tool: its function's name)."""

    def describe(self) -> list[dict]:
        """JSON-schema tool descriptions, as chat templates take them (``tools=``)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": spec["description"],
                    "parameters": {
                        "type": "object",
                        "properties": {k: dict(v) for k, v in spec["properties"].items()},
                        "required": list(spec["required"]),
                    },
                },
            }
            for name, spec in self._specs.items()
        ]

    def _cap(self, text: str) -> str:
        if len(text) <= self.observation_chars:
            return text
        return text[: self.observation_chars] + f"\n[... cut at {self.observation_chars} characters]"

    def call(self, name: str, arguments: object) -> ToolResult:
        """Run one tool call. ``arguments``: a dict, or its JSON text."""
        start = time.monotonic()

        def done(text: str, status: str) -> ToolResult:
            return ToolResult(self._cap(text), status == "ok", status, time.monotonic() - start)

        try:
            if not isinstance(name, str) or name not in self._specs:
                return done(
                    f"error: unknown tool {str(name)[:80]!r}; the tools are: {', '.join(self.names)}", "unknown_tool"
                )
            args = arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as e:
                    return done(f"error: the arguments of {name} are not valid JSON: {e}", "bad_arguments")
            if not isinstance(args, Mapping):
                return done(
                    f"error: the arguments of {name} must be a JSON object, got {type(args).__name__}", "bad_arguments"
                )
            spec = self._specs[name]
            missing = [k for k in spec["required"] if k not in args]
            tool = self._user.get(name)
            extra = [] if tool is not None and tool.accepts_any else [k for k in args if k not in spec["properties"]]
            if missing or extra:
                what = "; ".join(
                    s for s in (f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "") if s
                )
                return done(
                    f"error: bad arguments for {name} ({what}); it takes {sorted(spec['properties'])}", "bad_arguments"
                )
            if name == "python":
                return self._python(args["code"], done)
            if name == "calculator":
                return self._calculator(args["expression"], done)
            return self._call_user(tool, dict(args), done)
        except Exception as e:  # a bug here must not end the rollout: the policy sees it, the status says it
            return done(f"error: the tool failed: {type(e).__name__}: {e}", "error")

    def _python(self, code: object, done) -> ToolResult:
        if not isinstance(code, str):
            return done(
                f"error: bad arguments for python ('code' must be a string, got {type(code).__name__})", "bad_arguments"
            )
        out = run_python(code, self.limits)
        return done(_observation(out, out.stdout, self.observation_chars), out.status)

    def _calculator(self, expression: object, done) -> ToolResult:
        if not isinstance(expression, str):
            return done(
                f"error: bad arguments for calculator ('expression' must be a string, got {type(expression).__name__})",
                "bad_arguments",
            )
        try:
            return done(format_value(calculate(expression)), "ok")
        except CalculatorError as e:
            return done(f"error: {e}", "error")

    def _call_user(self, tool: _UserTool, args: dict, done) -> ToolResult:
        try:
            json.dumps(args)
        except (TypeError, ValueError) as e:
            return done(f"error: the arguments are not JSON values: {e}", "bad_arguments")
        out = call_function(tool.module, tool.function, args, self.limits)
        if out.status == "ok":
            return done(out.result["result"], "ok")
        return done(_observation(out, out.stdout, self.observation_chars), out.status)


def _observation(out: SandboxOutcome, stdout: str, chars: int) -> str:
    """stdout (its head, when long), then what went wrong: the error's last line, or why the run was stopped; the
    error is always kept, within ``chars`` characters in all."""
    if out.status == "ok":
        reason = ""
    elif out.status == "error" and out.error_line:
        reason = f"error: {out.error_line}"
    else:
        reason = f"error: {out.message or out.status}"
    reason = reason[: chars // 2]
    room = chars - len(reason) - 40
    text = stdout
    if len(text) > room or (out.truncated and out.status == "output_limit"):
        text = text[: max(0, room)] + f"\n[... output cut at {min(len(text), max(0, room))} characters]"
    if not reason:
        return text if text.strip() else "(no output)"
    return (text.rstrip("\n") + "\n" if text.strip() else "") + reason
