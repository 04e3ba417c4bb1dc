"""Tool-call formats: how calls are found in an assistant turn and how their results are rendered as observation
token ids.

``hermes`` (Qwen2.5 / Qwen3, Hermes): the assistant writes

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37*58"}}
    </tool_call>

one block per call (several per turn allowed) and ends its turn; the results come back as a ``tool`` message, which
these templates render inside a user turn as ``<tool_response>...</tool_response>`` blocks (consecutive tool
messages share one user turn) followed by the generation prompt. The observation text is taken from the model's
OWN chat template: the conversation ``[user, assistant(MARK), tool(r1), ..., tool(rk)]`` rendered with the
generation prompt, from just after MARK. When the assistant turn ended with the EOS token the template writes there
(``<|im_end|>``), that part is already in the trajectory and is not repeated. A template that cannot render tool
messages is refused for this format (use ``plain``).

``plain`` (any tokenizer, no template; documented in docs/agentic.md): the same ``<tool_call>BODY</tool_call>``
blocks, the turn stops at ``</tool_call>`` (one call per turn), and the observation is
``<tool_response>RESULT</tool_response>`` appended directly. BODY is the JSON object above or, bare, the argument of
the environment's only tool (``<tool_call>37*58</tool_call>`` calls the calculator with that expression).

Both formats tokenize the observation text on its own (``add_special_tokens=False``) and append the ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_FORMATS = ("auto", "hermes", "plain")
"""``agent.tool_format`` values; ``auto``: hermes when the chat template renders tool messages, else plain."""

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_MARK = "\x00MARK\x00"


@dataclass(frozen=True)
class ParsedCall:
    """One call found in an assistant turn: a tool name and its arguments, or why it could not be read."""

    name: str
    """The tool's name (empty when malformed)."""
    arguments: Any
    """A dict of arguments (JSON body), or the bare body text (plain format's single-tool shorthand)."""
    error: str | None = None
    """Why the call is malformed (None: readable)."""


def parse_calls(text: str, max_calls: int) -> list[ParsedCall]:
    """The ``<tool_call>`` blocks of ``text`` in order (at most ``max_calls``; an unclosed ``<tool_call>`` is one
    malformed call)."""
    calls: list[ParsedCall] = []
    for m in _CALL_RE.finditer(text):
        calls.append(_parse_body(m.group(1).strip()))
        if len(calls) >= max_calls:
            return calls
    rest = text[text.rfind(CALL_CLOSE) + len(CALL_CLOSE) :] if CALL_CLOSE in text else text
    if CALL_OPEN in rest:
        calls.append(ParsedCall("", None, f"unclosed {CALL_OPEN} (no {CALL_CLOSE})"))
    return calls[:max_calls]


def _parse_body(body: str) -> ParsedCall:
    if not body.startswith("{"):
        return ParsedCall("", body)  # bare: the environment's only tool, with the body as its argument
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ParsedCall("", None, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall("", None, 'the call must be a JSON object with a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return ParsedCall(obj["name"], None, '"arguments" is a string that is not JSON')
    if not isinstance(args, dict):
        return ParsedCall(obj["name"], None, '"arguments" must be a JSON object')
    return ParsedCall(obj["name"], args)


class ToolFormat:
    """Renders tool results as observation ids for one tokenizer (see the module docstring)."""

    def __init__(self, kind: str, tokenizer):
        if kind not in TOOL_FORMATS:
            raise ValueError(f"agent.tool_format must be one of {TOOL_FORMATS}, got {kind!r}")
        self.tokenizer = tokenizer
        renders = template_renders_tools(tokenizer)
        if kind == "auto":
            kind = "hermes" if renders else "plain"
        if kind == "hermes" and not renders:
            raise ValueError(
                "agent.tool_format=hermes: this tokenizer's chat template does not render tool messages "
                "(role 'tool'); use agent.tool_format=plain (docs/agentic.md)"
            )
        self.kind = kind
        eos = tokenizer.eos_token_id
        self._eos_text = tokenizer.decode([eos]) if eos is not None else None

    @property
    def stop(self) -> tuple[str, ...]:
        """Extra stop strings of an assistant turn: plain ends the turn at the call; hermes at the template's EOS."""
        return (CALL_CLOSE,) if self.kind == "plain" else ()

    def observation_ids(self, results: list[str], action_ids: tuple[int, ...]) -> list[int]:
        """The ids appended after an action whose calls produced ``results`` (observation texts, in call order)."""
        text = self.observation_text(results, ended_with_eos=bool(action_ids) and action_ids[-1] == self._eos_id)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def _eos_id(self):
        return self.tokenizer.eos_token_id

    def observation_text(self, results: list[str], ended_with_eos: bool) -> str:
        if self.kind == "plain":
            return "".join(f"{RESPONSE_OPEN}{r}{RESPONSE_CLOSE}" for r in results)
        msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK}]
        msgs += [{"role": "tool", "content": r} for r in results]
        full = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        tail = full[full.index(_MARK) + len(_MARK) :]
        if ended_with_eos and self._eos_text and tail.startswith(self._eos_text):
            tail = tail[len(self._eos_text) :]  # the turn's own EOS token already closed the assistant message
        return tail


def template_renders_tools(tokenizer) -> bool:
    """The tokenizer's chat template renders a ``tool`` message (its content appears in the output)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": _MARK},
    ]
    try:
        out = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises on role 'tool' does not render it
        return False
    return _MARK in out
