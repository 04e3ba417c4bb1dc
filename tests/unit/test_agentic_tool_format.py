"""Tool-call formats (agentic/tool_format.py): parsing calls out of an assistant turn, and the observation text of
tool results in the hermes format (rendered by the model's own chat template, against hand-written expected strings
of the Qwen2.5 / Qwen3 layout) and in the plain format."""

import pytest

from megatron_rlvr.agentic.tool_format import ParsedCall, ToolFormat, parse_calls, template_renders_tools
from megatron_rlvr.families.tiny import tiny_tokenizer
from megatron_rlvr.families.tiny_vl import tiny_vl_tokenizer

QWEN_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The Qwen2.5 / Qwen3 chat templates' layout of tool messages, reduced: consecutive tool messages share one user
turn, each in a <tool_response> block."""


def qwen_like_tokenizer():
    tok = tiny_vl_tokenizer()  # character level, <|im_start|> / <|im_end|> specials, eos <|im_end|>
    tok.chat_template = QWEN_TOOL_TEMPLATE
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])  # as Qwen's vocabulary has
    return tok


def test_calls_are_parsed_in_order_and_bad_ones_say_why():
    text = (
        'I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>37*58</tool_call><tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "y"'
    )
    calls = parse_calls(text, max_calls=10)
    assert calls[0] == ParsedCall("calculator", {"expression": "2+3"})
    assert calls[1] == ParsedCall("python", {"code": "print(1)"})  # arguments written as a JSON string
    assert calls[2] == ParsedCall("", "37*58")  # bare: the only tool's argument
    assert "not valid JSON" in calls[3].error
    assert calls[4] == ParsedCall("", "[1]")  # not an object: bare text
    assert calls[5].name == "x" and "must be a JSON object" in calls[5].error
    assert "unclosed" in calls[6].error
    assert len(calls) == 7
    assert len(parse_calls(text, max_calls=2)) == 2
    assert parse_calls("no call here </tool_call>", 4) == []


def test_hermes_observation_is_the_templates_tool_turn():
    """One result after a turn that ended with <|im_end|> (the EOS): the template's user turn with one
    <tool_response> block and the next generation prompt, without repeating the <|im_end|>; two results share one
    user turn; a turn that did not end with the EOS gets the template's <|im_end|> first."""
    tok = qwen_like_tokenizer()
    assert template_renders_tools(tok)
    fmt = ToolFormat("auto", tok)
    assert fmt.kind == "hermes" and fmt.stop == ()
    one = "\n<|im_start|>user\n<tool_response>\n2146\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.observation_text(["2146"], ended_with_eos=True) == one
    two = (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fmt.observation_text(["1", "2"], ended_with_eos=True) == two
    assert fmt.observation_text(["2146"], ended_with_eos=False) == "<|im_end|>" + one
    eos = tok.eos_token_id
    ids = fmt.observation_ids(["2146"], action_ids=(5, eos))
    assert ids == tok(one, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == one


def test_plain_format_and_templates_without_tools():
    """The tiny tokenizer has no chat template: auto gives plain (stop at </tool_call>, results in
    <tool_response> blocks); hermes is refused naming the option."""
    tok = tiny_tokenizer()
    assert not template_renders_tools(tok)
    fmt = ToolFormat("auto", tok)
    assert fmt.kind == "plain" and fmt.stop == ("</tool_call>",)
    assert fmt.observation_text(["7", "x"], ended_with_eos=False) == "<tool_response>7</tool_response>" * 1 + (
        "<tool_response>x</tool_response>"
    )
    with pytest.raises(ValueError, match="agent.tool_format=hermes"):
        ToolFormat("hermes", tok)
    with pytest.raises(ValueError, match="agent.tool_format must be one of"):
        ToolFormat("json", tok)


def test_tool_environment_runs_calls_and_turns_every_error_into_an_observation():
    """The tools environment on tiny_tools (plain format) with the real calculator: a bare call and a JSON call
    give the exact product; a malformed call, an unknown tool and bad arguments give 'error: ...' observations
    counted by status; a turn without a call ends the episode."""
    from megatron_rlvr.agentic.agent_config import AgentConfig
    from megatron_rlvr.agentic.environment import Action
    from megatron_rlvr.agentic.registry import build_environment
    from megatron_rlvr.data.records import Example

    tok = tiny_tokenizer("tiny_tools")
    env = build_environment(AgentConfig(environment="tools", tools=["calculator"]), tok)
    assert env.stop == ("</tool_call>",)
    from megatron_rlvr.rollout.multiturn import MultiTurn

    multi = MultiTurn.build(env, tok, max_turns=3, budget=32, max_turn_tokens=12)  # a one-token stop is a stop id
    assert multi.stop == () and multi.stop_token_ids == (tok.convert_tokens_to_ids("</tool_call>"),)
    ep = env.start(Example(prompt="37*58=", answer="2146", source="t", id="0"))

    def act(text):
        ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
        return ep.step(Action(ids, text, "stop"))

    for text in (
        "<tool_call>37*58</tool_call>",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "37*58"}}</tool_call>',
    ):
        obs = act(text)
        assert not obs.done and tok.decode(obs.token_ids) == "<tool_response>2146</tool_response>"
        assert [(c.tool, c.status) for c in obs.tool_calls] == [("calculator", "ok")]
    cases = {
        "<tool_call>{bad</tool_call>": ("<malformed>", "malformed", "not valid JSON"),
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': ("search", "unknown_tool", "unknown tool"),
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>': (
            "calculator", "bad_arguments", "bad arguments"),
        "<tool_call>2**99999999</tool_call>": ("calculator", None, "error"),
    }  # fmt: skip
    for text, (tool, status, said) in cases.items():
        obs = act(text)
        assert not obs.done
        assert obs.tool_calls[0].tool == tool and obs.tool_calls[0].status != "ok", text
        if status:
            assert obs.tool_calls[0].status == status, (text, obs.tool_calls)
        # the observation's text is readable by the policy's tokenizer only where it has the characters: compare
        # against the environment's own text, rendered by the format
        text_obs, _ = env.run(parse_calls(text, 4)[0])
        assert said in text_obs and text_obs.startswith("error"), text_obs
    assert act("2146").done


def test_hermes_tools_are_described_in_the_rendered_prompt():
    """With the hermes format the tools environment hands its tool descriptions to the chat template (tools=),
    which writes them into the prompt; the plain format describes none."""
    from megatron_rlvr.agentic.agent_config import AgentConfig
    from megatron_rlvr.agentic.registry import build_environment
    from megatron_rlvr.data.records import Example
    from megatron_rlvr.data.templates import render_prompt

    tok = qwen_like_tokenizer()
    tok.chat_template = (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t.function.name + ':' }}"
        "{{- t.function.parameters.required | join(',') + ';' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
        + QWEN_TOOL_TEMPLATE
    )
    env = build_environment(AgentConfig(environment="tools", tools=["calculator", "python"]), tok)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calculator", "python"]
    text = render_prompt(Example(prompt="2+2", answer="4", source="t", id="0"), "chat", "{problem}", None, tok,
                         list(env.tool_schemas))  # fmt: skip
    assert text.startswith("<|im_start|>system\ncalculator:expression;python:code;<|im_end|>\n<|im_start|>user\n2+2")
    plain = build_environment(AgentConfig(environment="tools", tools=["calculator"]), tiny_tokenizer("tiny_tools"))
    assert plain.tool_schemas == ()
