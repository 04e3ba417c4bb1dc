"""``megatron-rlvr tool``: call one tool exactly as a multi-turn rollout does, and show what the policy would see.

megatron-rlvr tool python FILE                 run FILE's program in the sandbox ("-": standard input)
megatron-rlvr tool calculator "EXPR"           exact arithmetic
megatron-rlvr tool pkg.mod:fn '{"k": "v"}'     a user tool with JSON keyword arguments
megatron-rlvr tool --describe NAME ...          the JSON tool descriptions a chat template gets
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_tool_parser", "tool_main"]


def add_tool_parser(sub) -> None:
    t = sub.add_parser(
        "tool",
        help="call a tool (python, calculator, pkg.mod:fn) as a rollout does",
        description=__doc__.split("\n\n")[0],
    )
    t.add_argument("name", help="python, calculator, or a user tool pkg.mod:function")
    t.add_argument(
        "arg",
        nargs="*",
        help="python: a program file ('-': stdin); calculator: the expression; a user tool: its arguments as JSON; "
        "with --describe: more tool names",
    )
    t.add_argument("--describe", action="store_true", help="print the tools' JSON descriptions instead of calling")
    t.add_argument("--wall-s", type=float, default=10.0, help="wall-clock limit in seconds (default 10)")
    t.add_argument("--cpu-s", type=float, default=10.0, help="CPU-time limit in seconds (default 10)")
    t.add_argument("--memory-mb", type=int, default=1024, help="address space per process in MiB (default 1024)")
    t.add_argument("--max-processes", type=int, default=16, help="processes and threads at once (default 16)")
    t.add_argument("--output-bytes", type=int, default=1 << 16, help="bytes kept of stdout / stderr (default 65536)")
    t.add_argument("--network", action="store_true", help="allow the network (default: none)")
    t.set_defaults(func=tool_main)


def _arguments(name: str, args: list[str]) -> dict:
    if name == "python":
        if len(args) != 1:
            raise ValueError("tool python: give one program file (or '-' for standard input)")
        path = args[0]
        if path == "-":
            return {"code": sys.stdin.read()}
        with open(path, encoding="utf-8") as f:
            return {"code": f.read()}
    if name == "calculator":
        if not args:
            raise ValueError('tool calculator: give the expression, e.g. "(2**64 - 1) / 3"')
        return {"expression": " ".join(args)}
    if len(args) > 1:
        raise ValueError(f'tool {name}: give its arguments as one JSON object, e.g. \'{{"text": "hi"}}\'')
    if not args:
        return {}
    try:
        value = json.loads(args[0])
    except ValueError as e:
        raise ValueError(f"tool {name}: the arguments are not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"tool {name}: the arguments must be a JSON object, got {type(value).__name__}")
    return value


def tool_main(ns: argparse.Namespace) -> int:
    from megatron_rlvr.sandbox import SandboxLimits, detect_guards
    from megatron_rlvr.sandbox.tools import ToolBox

    limits = SandboxLimits(
        wall_s=ns.wall_s,
        cpu_s=ns.cpu_s,
        memory_mb=ns.memory_mb,
        max_processes=ns.max_processes,
        output_bytes=ns.output_bytes,
        network=ns.network,
    )
    if ns.describe:
        box = ToolBox([ns.name, *ns.arg], limits)
        print(json.dumps(box.describe(), indent=2))
        return 0
    box = ToolBox([ns.name], limits)
    result = box.call(box.names[0], _arguments(ns.name, ns.arg))
    print(result.text.rstrip("\n"))
    guards = ",".join(detect_guards().names()) if ns.name != "calculator" else "in-process"
    print(f"[tool {box.names[0]}: status {result.status}, {result.seconds:.3f} s, guards {guards}]", file=sys.stderr)
    return 0 if result.ok else 1
