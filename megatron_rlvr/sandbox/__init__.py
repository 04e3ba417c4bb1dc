"""A sandbox for code from the model or the user: programs, test cases and tool calls run in their own process with
limits (time, memory, output, processes), no network, their own user id and a private working directory where the
machine allows; the built-in tools (``python``, ``calculator``) and user tools that multi-turn rollouts call.

Nothing of the rest of the package is imported here: rewards and rollout both use it.
"""

from megatron_rlvr.sandbox.limits import Guards, SandboxLimits, detect_guards
from megatron_rlvr.sandbox.process import SandboxOutcome, call_function, run_argv, run_python

__all__ = ["Guards", "SandboxLimits", "SandboxOutcome", "call_function", "detect_guards", "run_argv", "run_python"]
