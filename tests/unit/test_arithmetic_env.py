"""The ``arithmetic_tools`` environment (agentic/arithmetic_env.py): the tools environment on tiny_tools with the
real calculator, plus its shaping terms, checked against hand-computed values for whole episodes; and the bound
that keeps ``reward/accuracy`` exact."""

import pytest

from megatron_rlvr.agentic.agent_config import AgentConfig
from megatron_rlvr.agentic.arithmetic_env import (
    ANSWER_BONUS,
    CALL_BONUS,
    COPY_BONUS,
    MAX_SHAPING,
    ArithmeticToolEnvironment,
    match_fraction,
)
from megatron_rlvr.agentic.environment import Action
from megatron_rlvr.agentic.registry import build_environment
from megatron_rlvr.algorithms.algorithm_config import AdvantageConfig
from megatron_rlvr.data.records import Example
from megatron_rlvr.families.tiny import tiny_tokenizer

TOK = tiny_tokenizer("tiny_tools")


def _env():
    return build_environment(AgentConfig(environment="arithmetic_tools", tools=["calculator"]), TOK)


def _episode(prompt="37*58=", answer="2146"):
    env = _env()
    ep = env.start(Example(prompt=prompt, answer=answer, source="t", id="0"))

    def act(text):
        ids = tuple(TOK(text, add_special_tokens=False)["input_ids"])
        return ep.step(Action(ids, text, "stop"))

    return act


def test_match_fraction_counts_same_position_characters_over_the_longer_string():
    """Hand-computed: equal strings 1, one wrong character of five 4/5, a prefix of five 2/5, extra characters
    count against (5 right of 7), nothing in common 0."""
    assert match_fraction("37*58", "37*58") == 1.0
    assert match_fraction("37*59", "37*58") == pytest.approx(4 / 5)
    assert match_fraction("37", "37*58") == pytest.approx(2 / 5)
    assert match_fraction("37*5811", "37*58") == pytest.approx(5 / 7)
    assert match_fraction("99", "37") == 0.0


def test_the_right_call_then_the_copied_result_earns_every_term():
    """The worked example of docs/agentic.md: '<tool_call>37*58</tool_call>' runs the calculator (observation
    '<tool_response>2146</tool_response>', ids of the tokenizer) with tool_call + full call_copy; the answer '2146'
    adds the full answer_copy; the terms sum to MAX_SHAPING."""
    act = _episode()
    obs = act("<tool_call>37*58</tool_call>")
    assert not obs.done and TOK.decode(obs.token_ids) == "<tool_response>2146</tool_response>"
    assert [(c.tool, c.status) for c in obs.tool_calls] == [("calculator", "ok")]
    assert dict(obs.reward_terms) == {"tool_call": CALL_BONUS, "call_copy": COPY_BONUS}
    end = act("2146")
    assert end.done and dict(end.reward_terms) == {"answer_copy": ANSWER_BONUS}
    assert CALL_BONUS + COPY_BONUS + ANSWER_BONUS == pytest.approx(MAX_SHAPING)


def test_partial_calls_earn_partial_terms_and_no_answer_term():
    """A call with one wrong digit ('37*59', ok): call_copy 4/5 of COPY_BONUS, and its result (2183) is not the
    question's, so the answer earns no answer_copy even when it copies that result; a later call earns nothing."""
    act = _episode()
    obs = act("<tool_call>37*59</tool_call>")
    assert TOK.decode(obs.token_ids) == "<tool_response>2183</tool_response>"
    assert dict(obs.reward_terms) == pytest.approx({"tool_call": CALL_BONUS, "call_copy": COPY_BONUS * 4 / 5})
    assert dict(act("<tool_call>37*58</tool_call>").reward_terms) == {}
    assert dict(act("2183").reward_terms) == {}


def test_answer_copy_is_graded_by_position_after_the_right_call():
    """After the right call, an answer with the first two of four digits right earns half the answer term; a
    failed first call ('37*', a calculator error) earns 3/5 of call_copy, no tool_call and no answer term."""
    act = _episode()
    act("<tool_call>37*58</tool_call>")
    assert dict(act("2199").reward_terms) == pytest.approx({"answer_copy": ANSWER_BONUS / 2})
    act = _episode()
    obs = act("<tool_call>37*</tool_call>")
    assert obs.tool_calls[0].status != "ok" and not obs.done
    assert dict(obs.reward_terms) == pytest.approx({"call_copy": COPY_BONUS * 3 / 5})
    assert dict(act("2146").reward_terms) == {}


def test_no_call_or_a_malformed_call_earns_nothing():
    """An answer without a call ends the episode without terms; an unclosed call is malformed and earns none."""
    assert dict(_episode()("2146").reward_terms) == {}
    obs = _episode()("<tool_call>37*58")
    assert obs.tool_calls[0].status == "malformed" and dict(obs.reward_terms) == {}


def test_shaping_alone_never_counts_as_correct():
    """reward/accuracy and MCPO's mastered prompts read 'reward >= the correctness threshold' (the midpoint of the
    default right/wrong rewards, 0.5): a wrong answer with every shaping term stays below it, a right one above."""
    threshold = AdvantageConfig().correct_threshold
    assert 0.0 + MAX_SHAPING < threshold <= 1.0 + 0.0


def test_bad_setups_are_refused_in_one_line():
    """A sentence-style prompt (no 'EXPR=') names the environment and the example; two tools are refused."""
    with pytest.raises(ValueError, match="arithmetic_tools: example '0' has prompt 'What is 3 \\+ 5\\?'"):
        _env().start(Example(prompt="What is 3 + 5?", answer="8", source="t", id="0"))
    with pytest.raises(ValueError, match="exactly one tool"):
        build_environment(AgentConfig(environment="arithmetic_tools", tools=["calculator", "python"]), TOK)
    assert isinstance(_env(), ArithmeticToolEnvironment)


def test_a_call_after_other_text_earns_no_call_terms():
    """A right call after other text ('5<tool_call>37*58</tool_call>') still runs (the tools environment's parsing)
    but earns no term: the call must open its turn, so the expression sits at a fixed distance from the call."""
    obs = _episode()("5<tool_call>37*58</tool_call>")
    assert [(c.tool, c.status) for c in obs.tool_calls] == [("calculator", "ok")] and dict(obs.reward_terms) == {}
