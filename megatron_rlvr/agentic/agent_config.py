"""AgentConfig: multi-turn rollouts (the run's ``agent`` section; docs/agentic.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlvr.agentic.tool_format import TOOL_FORMATS
from megatron_rlvr.sandbox.limits import SandboxLimits

BUILTIN_ENVIRONMENTS = ("", "tools", "arithmetic_tools")
"""``agent.environment`` built-ins: "" (single-turn rollouts), the tool-calling environment, and that environment
with shaping terms for terse arithmetic (megatron_rlvr.agentic.arithmetic_env)."""


GUIDANCE_MODES = ("none", "all_wrong")
"""``agent.guidance`` values."""


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


@dataclass
class AgentConfig:
    """Multi-turn rollouts: which environment answers the assistant's turns, and the limits of a trajectory."""

    environment: str = ""
    """"" (default): one completion per sample, no turns. ``tools``: the built-in tool-calling environment
    (``agent.tools``). ``arithmetic_tools``: ``tools`` plus small shaping terms for terse procedural arithmetic
    (the tiny tool preset, megatron_rlvr.agentic.arithmetic_env). ``pkg.module:factory``: a user environment,
    ``factory(AgentSetup) -> Environment`` (megatron_rlvr.agentic.environment)."""
    tools: list[str] = field(default_factory=list)
    """Tools of the ``tools`` environment: ``python`` (sandboxed code), ``calculator`` (exact arithmetic) or a user
    tool ``pkg.module:function`` (keyword arguments in, a string out; run in the sandbox)."""
    tool_format: str = "auto"
    """How calls are written and results rendered: ``hermes`` (the Qwen2.5 / Qwen3 chat templates'
    ``<tool_call>`` / ``<tool_response>``), ``plain`` (the documented template-free format) or ``auto`` (hermes when
    the chat template renders tool messages)."""
    max_turns: int = 4
    """Most assistant turns per trajectory; a trajectory still calling tools after its last turn ends there
    (counted in ``agent/cut_max_turns``; its last turn's calls run, but their observation is not appended)."""
    max_turn_tokens: int | None = None
    """Most tokens per assistant turn (None: rollout.max_response_len). A turn cut there ends the trajectory with
    finish reason 'length'."""
    max_calls_per_turn: int = 4
    """Most tool calls run per assistant turn (later ones in the same turn are ignored)."""
    guidance: str = "none"
    """Off-policy guidance with the environment's demonstrations (``Environment.demonstration``; LUFFY, Yan et al.
    2025). ``none`` (not ``off``: YAML reads that as false): on-policy samples only. ``all_wrong``: a group whose
    samples all score below ``algorithm.advantage.correct_threshold`` gets its last sample replaced by the
    demonstration of its prompt (where the environment has one), and the group's advantages are computed with it.
    Its behaviour log-probs come from the trainer (``rollout.old_logprobs: recompute``); ``reward/mean``,
    ``reward/accuracy`` and ``agent/*`` count the policy's samples only, ``guidance/demos`` the demonstrations
    (docs/algorithms.md)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """What one tool call may use (time, memory, output, processes, network; docs/agentic.md, "The sandbox")."""

    def __post_init__(self) -> None:
        if not isinstance(self.environment, str):
            raise ValueError(f"agent.environment must be a string, got {self.environment!r}")
        if self.environment not in BUILTIN_ENVIRONMENTS and ":" not in self.environment:
            raise ValueError(
                f"agent.environment must be one of {BUILTIN_ENVIRONMENTS[1:]} or 'pkg.module:factory', "
                f"got {self.environment!r}"
            )
        if isinstance(self.tools, str):
            self.tools = [self.tools]
        if not all(isinstance(t, str) and t for t in self.tools):
            raise ValueError(f"agent.tools must be a list of tool names, got {self.tools!r}")
        if self.environment in ("tools", "arithmetic_tools") and not self.tools:
            raise ValueError(
                f"agent.environment={self.environment} needs at least one tool in agent.tools (python, calculator, ...)"
            )
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"agent.tool_format must be one of {TOOL_FORMATS}, got {self.tool_format!r}")
        if self.guidance not in GUIDANCE_MODES:
            hint = " (YAML reads off as false: write none)" if self.guidance in (False, "False") else ""
            raise ValueError(f"agent.guidance must be one of {GUIDANCE_MODES}, got {self.guidance!r}{hint}")
        _positive_int("agent.max_turns", self.max_turns)
        _positive_int("agent.max_calls_per_turn", self.max_calls_per_turn)
        if self.max_turn_tokens is not None:
            _positive_int("agent.max_turn_tokens", self.max_turn_tokens)

    @property
    def multi_turn(self) -> bool:
        return self.environment != ""
