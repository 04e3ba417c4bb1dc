"""GPT-OSS's harmony chat format (megatron_rlvr/data/harmony.py) with a local tokenizer built here: one token per
character plus harmony's markers as special tokens, and a chat template that renders harmony turns as GPT-OSS's does
(written for this test; no download):

- ``data.template: chat`` renders the prompt through the tokenizer's template, ending with ``<|start|>assistant``;
- the engines stop at ``<|return|>`` and ``<|call|>`` (``_eos_ids``), not at ``<|end|>`` (which closes the analysis);
- the reward reads the FINAL channel only: hand-written replies whose analysis channel holds the right or a wrong
  answer score by their final channel, a reply with no final channel scores 0, and characters that spell a marker
  in the text do not open a channel.
"""

from __future__ import annotations

import string
from types import SimpleNamespace

import pytest

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]

HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a test model.\\nReasoning: medium\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}"
    "{%- if messages[0].role in ('system', 'developer') -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' -}}"
    "{%- set rest = messages[1:] -%}{%- else -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- if m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
"""Harmony's prompt layout: a system header, the run's system prompt as a developer message, user turns, and the
generation prompt ``<|start|>assistant`` (the reply then opens its first channel itself)."""


def harmony_tokenizer():
    """One id per printable character (newline included), then the markers as special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<|endoftext|>", "<unk>"] + sorted(set(string.printable) - set("\r\x0b\x0c\t"))
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # Oniguruma: (?m) = dot-all
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.add_tokens(MARKERS, special_tokens=True)
    fast.chat_template = HARMONY_TEMPLATE
    return fast


def _ids(tok, *parts: str) -> list[int]:
    """Token ids of ``parts`` in order: a part that is a marker is its special token, any other part is encoded
    one character at a time (so text that spells a marker stays characters, as a model writing them would)."""
    out: list[int] = []
    for p in parts:
        if p in MARKERS:
            out.append(tok.convert_tokens_to_ids(p))
        else:
            out += [tok.convert_tokens_to_ids(c) for c in p]
    return out


def test_chat_template_renders_a_harmony_prompt():
    """``render_prompt(template='chat')`` on a harmony tokenizer gives the harmony prompt (hand-written expected
    string), with the run's system prompt as the developer message and the generation prompt last."""
    from megatron_rlvr.data.records import Example
    from megatron_rlvr.data.templates import render_prompt

    tok = harmony_tokenizer()
    ex = Example("What is 6*7?", "42", "hand", "0")
    text = render_prompt(ex, "chat", "{problem}", "Answer with a number.", tokenizer=tok)
    assert text == (
        "<|start|>system<|message|>You are a test model.\nReasoning: medium\n\n# Valid channels: analysis, "
        "commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer with a number.<|end|>"
        "<|start|>user<|message|>What is 6*7?<|end|><|start|>assistant"
    )
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[-10:] == _ids(tok, "<|start|>", "assistant")  # the markers are single tokens
    assert sum(i == tok.convert_tokens_to_ids("<|start|>") for i in ids) == 4


def test_stop_tokens_include_return_and_call():
    """The engines' stop ids for a harmony tokenizer: its EOS, ``<|return|>`` and ``<|call|>``, not ``<|end|>``;
    for the tiny character tokenizer nothing is added."""
    from megatron_rlvr.data.harmony import harmony_stop_ids, is_harmony
    from megatron_rlvr.families.tiny import tiny_tokenizer
    from megatron_rlvr.trainer.engine_setup import _eos_ids

    tok = harmony_tokenizer()
    source = SimpleNamespace(weights_dir=None, hf_config={"eos_token_id": tok.eos_token_id})
    got = _eos_ids(source, tok)
    ret, call, end = (tok.convert_tokens_to_ids(m) for m in ("<|return|>", "<|call|>", "<|end|>"))
    assert got == [tok.eos_token_id, ret, call] and end not in got
    tiny = tiny_tokenizer()
    assert not is_harmony(tiny) and harmony_stop_ids(tiny) == []
    assert _eos_ids(SimpleNamespace(weights_dir=None, hf_config={"eos_token_id": 1}), tiny) == [1]


REPLIES = {
    # (reply parts, the final channel's text)
    "analysis then final": (
        ["<|channel|>", "analysis", "<|message|>", "6*7 is 42, not 41.", "<|end|>", "<|start|>", "assistant",
         "<|channel|>", "final", "<|message|>", "The answer is 42.", "<|return|>"],
        "The answer is 42.",
    ),
    "right in analysis, wrong in final": (
        ["<|channel|>", "analysis", "<|message|>", "The answer is 42.", "<|end|>", "<|start|>", "assistant",
         "<|channel|>", "final", "<|message|>", "41", "<|return|>"],
        "41",
    ),
    "no final channel (cut inside the analysis)": (
        ["<|channel|>", "analysis", "<|message|>", "The answer is 42"],
        "",
    ),
    "marker spelled as text inside the analysis": (
        ["<|channel|>", "analysis", "<|message|>", "<|channel|>final<|message|>42", "<|end|>", "<|start|>",
         "assistant", "<|channel|>", "final", "<|message|>", "40", "<|return|>"],
        "40",
    ),
    "final cut by the length limit": (
        ["<|channel|>", "final", "<|message|>", "42"],
        "42",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REPLIES))
def test_the_reward_reads_the_final_channel_only(case):
    """From a hand-written reply, the text a sample's group carries (``rollout.groups._group``, what the reward
    scores) is its final channel's; GSM8K's numeric reward (lenient) on it gives 1 only when the FINAL answer is 42,
    whatever the analysis says. The plain decode (special tokens dropped) would score the analysis too."""
    from megatron_rlvr.data.harmony import final_channel_text
    from megatron_rlvr.data.records import Example
    from megatron_rlvr.rewards.builtin import REWARD_FNS
    from megatron_rlvr.rollout.engine import Completion, SamplingParams
    from megatron_rlvr.rollout.groups import Round, _group

    tok = harmony_tokenizer()
    parts, final = REPLIES[case]
    ids = _ids(tok, *parts)
    assert final_channel_text(tok, ids) == final
    completion = Completion(ids, [0.0] * len(ids), "stop", text=tok.decode(ids, skip_special_tokens=True))
    rnd = Round([Example("What is 6*7?", "42", "hand", "0")], [[5, 6]], SamplingParams(), seed=0, step=0, round_idx=0)
    group = _group(rnd, 0, SimpleNamespace(completions=[completion]), False, tok)
    assert group.texts == [final]
    reward = REWARD_FNS["gsm8k"](extraction="lenient")
    want = 1.0 if final.rstrip(".").endswith("42") else 0.0
    assert reward(group.texts[0], "42") == want
    if case == "right in analysis, wrong in final":  # what scoring the whole decoded reply would have done
        assert reward(completion.text, "42") == 0.0 and "42" in completion.text
    if case == "no final channel (cut inside the analysis)":
        assert reward(completion.text, "42") == 1.0  # the analysis alone would have been rewarded


def test_final_channel_text_refuses_a_tokenizer_without_markers():
    """A tokenizer without harmony's special tokens is refused in one line (and not treated as harmony)."""
    from megatron_rlvr.data.harmony import final_channel_text, reply_text
    from megatron_rlvr.families.tiny import tiny_tokenizer

    tiny = tiny_tokenizer()
    with pytest.raises(ValueError, match="needs a harmony tokenizer"):
        final_channel_text(tiny, [3, 4])
    assert reply_text(tiny, [4, 5], None) == "12" and reply_text(tiny, [4, 5], "given") == "given"
