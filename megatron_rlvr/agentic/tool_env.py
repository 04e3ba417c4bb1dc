"""The built-in tool-calling environment (``agent.environment: tools``).

Each assistant turn is searched for tool calls in the configured format (``megatron_rlvr.agentic.tool_format``). A
turn without a call ends the episode: it is the answer. Otherwise every call runs (at most
``agent.max_calls_per_turn``, in order) and the results are rendered as one observation. Nothing the policy writes
raises: a malformed call, an unknown tool, bad arguments, a tool failure or a sandbox limit each become an error
observation (``error: ...``) that the policy can learn from, and each is counted by its status.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_rlvr.agentic.environment import Action, Environment, Episode, Observation, ToolCallRecord
from megatron_rlvr.agentic.tool_format import ParsedCall, ToolFormat, parse_calls
from megatron_rlvr.data.records import Example


class ToolRunner(Protocol):
    """What the environment needs of a tool box (``megatron_rlvr.sandbox.tools.ToolBox``)."""

    names: tuple[str, ...]

    def call(self, name: str, arguments: Any):
        """A result with ``text`` (the observation), ``ok``, ``status`` and ``seconds``; never raises for bad
        input."""
        ...

    def describe(self) -> list[dict]:
        """JSON-schema tool descriptions (``{"function": {"name", "parameters": {"required": [...]}}}``)."""
        ...


class ToolEpisode(Episode):
    def __init__(self, env: ToolEnvironment):
        self.env = env

    def step(self, action: Action) -> Observation:
        env = self.env
        calls = parse_calls(action.text, env.max_calls_per_turn)
        if not calls:
            return Observation(done=True)
        texts, records = [], []
        for call in calls:
            text, record = env.run(call)
            texts.append(text)
            records.append(record)
        ids = env.format.observation_ids(texts, action.token_ids)
        return Observation(token_ids=tuple(ids), done=False, tool_calls=tuple(records))


class ToolEnvironment(Environment):
    """Tool calls in the assistant's text, run by ``tools``, results appended in ``format``."""

    def __init__(self, tools: ToolRunner, format: ToolFormat, max_calls_per_turn: int = 4):
        self.tools = tools
        self.format = format
        self.max_calls_per_turn = max_calls_per_turn
        self.stop = format.stop
        # the chat template describes the tools in the prompt where it has a tool format of its own
        self.tool_schemas = tuple(tools.describe()) if format.kind == "hermes" else ()
        self._required = {
            d["function"]["name"]: list(d["function"]["parameters"]["required"]) for d in tools.describe()
        }

    def start(self, example: Example) -> Episode:
        return ToolEpisode(self)

    def run(self, call: ParsedCall) -> tuple[str, ToolCallRecord]:
        """One call's observation text and record; errors become ``error: ...`` texts."""
        if call.error is not None:
            return f"error: {call.error}", ToolCallRecord(call.name or "<malformed>", "malformed")
        name, args = call.name, call.arguments
        if not name:  # a bare body: the only tool's only required argument
            if len(self.tools.names) != 1:
                msg = (
                    f'a bare call needs exactly one tool; write {{"name": ..., "arguments": {{...}}}} ({self._known()})'
                )
                return f"error: {msg}", ToolCallRecord("<malformed>", "malformed")
            name = self.tools.names[0]
            required = self._required[name]
            if len(required) != 1:
                return f"error: a bare call needs a tool of one argument; {name} takes {required}", ToolCallRecord(
                    name, "malformed"
                )
            args = {required[0]: args}
        result = self.tools.call(name, args)
        text = result.text if result.ok or result.text.startswith("error") else f"error: {result.text}"
        return text, ToolCallRecord(name, result.status, float(result.seconds))

    def _known(self) -> str:
        return "tools: " + ", ".join(self.tools.names)
