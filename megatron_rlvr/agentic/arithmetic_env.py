"""The ``arithmetic_tools`` environment: the tools environment for terse procedural arithmetic ("37*58="), with
small shaping terms that make the tool protocol learnable from random weights (configs/tiny_tools.yaml).

Calls run exactly as in ``tools`` (:class:`~megatron_rlvr.agentic.tool_env.ToolEnvironment`); the episode also knows
the question, so it can add three per-trajectory reward terms (``Observation.reward_terms``, added to the verifier's
exact reward):

- ``call_copy`` (``COPY_BONUS`` x m / max(len(body), len(expression))): the first call opens its turn (nothing
  before ``<tool_call>``: the expression then sits at a fixed distance) and its body (closed, readable) has m
  characters equal to the question's expression (the terse prompt before its ``=``) at the same positions;
  graded, so that each copied character has a group-relative signal of its own, and extra characters count
  against it;
- ``tool_call`` (``CALL_BONUS``): that call also ran ok (a valid expression: ``7*`` is not);
- ``answer_copy`` (``ANSWER_BONUS`` x the same fraction against the result): the answer turn (a turn without a
  call) after a first call that was exactly the question's expression, scored against that call's result.

``demonstration``: the tool path itself (the call of exactly the question's expression, then the calculator's
result), for off-policy guidance (``agent.guidance``).

Why graded: from random weights the exact protocol (call marker, expression, close marker, then the result and
EOS) is never sampled (~23^-12 for ``37*58`` and the tiny vocabulary), and an all-or-nothing bonus per stage is
not sampled either. The terms reward only the tool protocol: what to call (the question as written) and copying
what the tool said for it; no term compares anything the policy wrote with the gold answer. Measurements, and what
they do not yet achieve, in docs/agentic.md ("The tiny tool preset").

The terms sum to at most ``MAX_SHAPING`` < 0.5, so with rewards 1 (right) and 0 (wrong) and the default correctness
threshold 0.5 a trajectory counts as correct (``reward/accuracy``, MCPO's mastered prompts) exactly when the
verifier said so.
"""

from __future__ import annotations

from megatron_rlvr.agentic.environment import Action, Episode, Observation
from megatron_rlvr.agentic.tool_env import ToolEnvironment
from megatron_rlvr.agentic.tool_format import CALL_CLOSE, CALL_OPEN, ParsedCall, parse_calls
from megatron_rlvr.data.records import Example

CALL_BONUS = 0.05
"""``tool_call``: the first call ran ok."""
COPY_BONUS = 0.2
"""``call_copy`` at most (the first call's body is exactly the question's expression)."""
ANSWER_BONUS = 0.15
"""``answer_copy`` at most (the answer is exactly the right call's result)."""
MAX_SHAPING = CALL_BONUS + COPY_BONUS + ANSWER_BONUS
"""The most the terms add to a trajectory (0.4: below the correctness threshold 0.5, see the module docstring)."""


def question_expression(example: Example) -> str:
    """The expression a terse arithmetic prompt asks for: ``"37*58="`` -> ``"37*58"``. ValueError naming the example
    otherwise (this environment is for ``data.procedural`` arithmetic with ``style: terse``)."""
    p = example.prompt
    if not isinstance(p, str) or not p.endswith("=") or len(p) < 2 or "=" in p[:-1]:
        raise ValueError(
            f"agent.environment=arithmetic_tools: example {example.id!r} has prompt {p!r}; it needs terse "
            "arithmetic prompts 'EXPR=' (data.procedural.task: arithmetic, style: terse)"
        )
    return p[:-1]


def match_fraction(text: str, target: str) -> float:
    """The characters of ``text`` equal to ``target``'s at the same position, over the longer length (1 exactly when
    ``text == target``; extra characters lower it)."""
    longest = max(len(text), len(target))
    return sum(a == b for a, b in zip(text, target)) / longest if longest else 1.0


class ArithmeticToolEpisode(Episode):
    def __init__(self, env: ArithmeticToolEnvironment, expression: str):
        self.env = env
        self.expression = expression
        self.called = False
        self.result: str | None = None
        """The result of a first call that was exactly the question's expression (None: no such call)."""

    def step(self, action: Action) -> Observation:
        calls = parse_calls(action.text, self.env.max_calls_per_turn)
        if not calls:  # the answer
            terms = {}
            if self.result is not None:
                terms["answer_copy"] = ANSWER_BONUS * match_fraction(action.text.strip(), self.result)
            return Observation(done=True, reward_terms=terms)
        texts, records = [], []
        for call in calls:
            text, record = self.env.run(call)
            texts.append(text)
            records.append(record)
        terms = {}
        if not self.called:
            self.called = True
            first = calls[0]
            if first.error is None and action.text.startswith(CALL_OPEN):
                body = first.arguments if isinstance(first.arguments, str) else ""
                terms["call_copy"] = COPY_BONUS * match_fraction(body, self.expression)
                if records[0].status == "ok":
                    terms["tool_call"] = CALL_BONUS
                    if body == self.expression:
                        self.result = texts[0].strip()
        ids = self.env.format.observation_ids(texts, action.token_ids)
        return Observation(token_ids=tuple(ids), tool_calls=tuple(records), reward_terms=terms)


class ArithmeticToolEnvironment(ToolEnvironment):
    """``tools`` plus the shaping terms of the module docstring; needs the plain tool format and one tool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.format.kind != "plain" or len(self.tools.names) != 1:
            raise ValueError(
                "agent.environment=arithmetic_tools needs agent.tool_format plain (or auto on a tokenizer without a "
                f"tool template) and exactly one tool in agent.tools, got {self.format.kind} and "
                f"{list(self.tools.names)}"
            )

    def start(self, example: Example) -> Episode:
        return ArithmeticToolEpisode(self, question_expression(example))

    def demonstration(self, example: Example) -> tuple[str, ...] | None:
        """The tool path for ``example`` (off-policy guidance): the call of exactly the question's expression, then
        the calculator's result for it as the answer (the tool is run here; the replay runs it again for the
        observation). None when the tool does not answer it (an expression the calculator refuses)."""
        expression = question_expression(example)
        text, record = self.run(ParsedCall("", expression, None))
        if record.status != "ok":
            return None
        return (f"{CALL_OPEN}{expression}{CALL_CLOSE}", text.strip())
