"""The multi-turn episode interface: an environment answers each assistant turn with an observation.

A trajectory is one token-id sequence, ``prompt, action 1, observation 1, action 2, ..., action K``: the engine
continues from the exact ids of the trajectory so far, and an observation is rendered and tokenized on its own and
appended (nothing is ever decoded and re-encoded, so the trainer trains on exactly the ids the engine sampled). The
rollout loop (``megatron_rlvr.rollout.multiturn``) drives it:

    episode = environment.start(example)
    while True:
        action = engine continues the trajectory          # assistant tokens: loss mask 1, with their log-probs
        observation = episode.step(action)                # observation tokens: loss mask 0
        if observation.done: break
        trajectory += observation.token_ids
    episode.close()

An environment is built once per run (``agent.environment``: ``tools`` for the built-in tool-calling environment, or
``pkg.module:factory``, a function of ``(AgentSetup)`` returning an :class:`Environment`); its episodes must not
raise for anything the policy writes: a malformed action is an observation the policy can learn from.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.data.records import Example


@dataclass(frozen=True)
class Action:
    """One assistant turn, exactly as the engine sampled it."""

    token_ids: tuple[int, ...]
    """The turn's generated ids (with the EOS / stop token that ended it)."""
    text: str
    """The turn decoded (for parsing tool calls; never re-encoded)."""
    finish_reason: str
    """The engine's: ``stop`` (EOS, stop token or string) or ``length`` (the turn's token limit)."""


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a turn, for the step's metrics."""

    tool: str
    """The tool's name as the policy wrote it (``<malformed>`` when the call could not be parsed)."""
    status: str
    """``ok`` or why not: ``malformed``, ``unknown_tool``, ``bad_arguments``, ``error``, ``timeout``, ``memory``,
    ``output_limit``, ``process_limit``, ... (the sandbox's statuses)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one action."""

    token_ids: tuple[int, ...] = ()
    """Ids appended to the trajectory after the action (rendered by the chat template's tool format and tokenized
    on their own); carry no loss. Ignored when ``done``."""
    done: bool = False
    """The episode ended (the policy answered, or the environment ended it)."""
    reward_terms: Mapping[str, float] = field(default_factory=dict)
    """Optional per-turn reward terms; a trajectory's reward is its verifier reward plus the sum of all its turns'
    terms (docs/agentic.md)."""
    tool_calls: tuple[ToolCallRecord, ...] = ()
    """The calls this action made (metrics: calls by tool, errors, timeouts, sandbox limits)."""


class Episode(abc.ABC):
    """One trajectory's environment state."""

    @abc.abstractmethod
    def step(self, action: Action) -> Observation:
        """The observation after ``action``; must not raise for anything the policy wrote."""

    def close(self) -> None:  # noqa: B027 - most episodes hold nothing to release
        """Release what the episode holds (called once, also when a limit ends the trajectory)."""


class Environment(abc.ABC):
    """Starts one episode per trajectory."""

    stop: tuple[str, ...] = ()
    """Stop strings that end an assistant turn besides the tokenizer's EOS (the tool format's)."""
    tool_schemas: tuple[dict, ...] = ()
    """JSON-schema descriptions of the tools the policy may call, passed to the chat template (``tools=``) when
    prompts are rendered with ``data.template: chat`` (the Qwen templates list them in the system turn)."""

    @abc.abstractmethod
    def start(self, example: Example) -> Episode:
        """A fresh episode for one sample of ``example``."""

    def demonstration(self, example: Example) -> tuple[str, ...] | None:
        """A demonstration for ``example`` (off-policy guidance, ``agent.guidance``): the assistant turns of a right
        trajectory, each as the policy would write it (stop string included), or None when this environment has
        none (the default). The rollout replays them through the same token-in / token-out path as sampled turns
        (``megatron_rlvr.rollout.multiturn.demonstrate``): each turn tokenized on its own, the last one ended by the
        tokenizer's EOS, the observations this environment answers them with appended, so ids and loss masks are
        what a sampled trajectory of the same text would have."""
        return None

    def close(self) -> None:  # noqa: B027 - most environments hold nothing to release
        """Release what the environment holds (the run is over)."""


@dataclass(frozen=True)
class AgentSetup:
    """What a user environment factory (``agent.environment: pkg.module:factory``) is given."""

    tokenizer: Any
    """The policy's tokenizer: observations are tokenized on their own with it."""
    config: Any
    """The run's ``agent`` section (``megatron_rlvr.agentic.agent_config.AgentConfig``)."""
