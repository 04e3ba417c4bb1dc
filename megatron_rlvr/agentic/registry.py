"""``agent.environment`` -> an :class:`~megatron_rlvr.agentic.environment.Environment` (one registry for the
built-in tool-calling environment and user factories)."""

from __future__ import annotations

import importlib

from megatron_rlvr.agentic.agent_config import AgentConfig
from megatron_rlvr.agentic.arithmetic_env import ArithmeticToolEnvironment
from megatron_rlvr.agentic.environment import AgentSetup, Environment
from megatron_rlvr.agentic.tool_env import ToolEnvironment
from megatron_rlvr.agentic.tool_format import ToolFormat
from megatron_rlvr.sandbox.tools import ToolBox


def build_environment(agent: AgentConfig, tokenizer) -> Environment:
    """The run's environment (``agent.environment`` must be set)."""
    if agent.environment in ("tools", "arithmetic_tools"):
        return _tool_environment(agent, tokenizer)
    factory = load_factory(agent.environment)
    env = factory(AgentSetup(tokenizer=tokenizer, config=agent))
    if not isinstance(env, Environment):
        raise ValueError(
            f"agent.environment={agent.environment!r} returned a {type(env).__name__}, not an Environment "
            "(megatron_rlvr.agentic.environment)"
        )
    return env


def _tool_environment(agent: AgentConfig, tokenizer) -> ToolEnvironment:
    """``tools``, or ``arithmetic_tools`` (its shaping terms for terse arithmetic, agentic/arithmetic_env.py)."""
    try:
        tools = ToolBox(agent.tools, agent.sandbox)
    except ValueError as e:
        raise ValueError(f"agent.tools: {e}") from None
    cls = ArithmeticToolEnvironment if agent.environment == "arithmetic_tools" else ToolEnvironment
    return cls(tools, ToolFormat(agent.tool_format, tokenizer), agent.max_calls_per_turn)


def load_factory(spec: str):
    """The function ``pkg.module:factory`` names; ValueError naming ``agent.environment`` otherwise."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent.environment={spec!r}: expected 'pkg.module:factory' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"agent.environment={spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"agent.environment={spec!r}: {module_name!r} has no function {attr!r}")
    return fn
