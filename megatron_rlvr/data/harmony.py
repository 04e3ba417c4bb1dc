"""GPT-OSS's chat format ("harmony"): what the reward reads from a reply, and where a reply stops.

A harmony prompt ends with ``<|start|>assistant`` (the tokenizer's own chat template renders it: ``data.template:
chat``). The policy then writes one or more messages, each ``<|channel|>NAME<|message|>TEXT`` closed by ``<|end|>``
(and the next one opened by ``<|start|>assistant``), e.g.::

    <|channel|>analysis<|message|>chain of thought<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>

The ``analysis`` channel is the chain of thought and the ``final`` channel the answer; ``<|return|>`` ends the reply
(``<|call|>`` ends a tool call on the ``commentary`` channel). So a reward must read the final channel only: an answer
written in the analysis channel is not the answer given. The markers are special tokens of GPT-OSS's tokenizer (its
``o200k_harmony`` encoding) and are dropped by ``decode(skip_special_tokens=True)``, which would glue the channels'
names and texts together; this module therefore reads the token ids, so that text which merely spells a marker
cannot open a channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHANNEL, MESSAGE, START, END, RETURN, CALL = (
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
)
MARKERS = (CHANNEL, MESSAGE, START, END, RETURN, CALL)
"""The harmony markers this module reads (all special tokens of a harmony tokenizer)."""
STOP_MARKERS = (RETURN, CALL)
"""Where a reply ends: the final answer (``<|return|>``) or a tool call (``<|call|>``). ``<|end|>`` only closes one
message (the analysis channel's, before the final one)."""


def _special_ids(tokenizer: Any) -> dict[str, int] | None:
    """marker -> token id when every harmony marker is ONE special token of ``tokenizer``, else None."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    # GPT-OSS's markers are added tokens marked special (not all of them are named special tokens)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    if not all(m in special for m in MARKERS):
        return None
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in MARKERS}
    if any(not isinstance(i, int) or i < 0 or i == getattr(tokenizer, "unk_token_id", None) for i in ids.values()):
        return None
    return ids


def is_harmony(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` speaks harmony: every marker of :data:`MARKERS` is a special token of its own."""
    return tokenizer is not None and _special_ids(tokenizer) is not None


def harmony_stop_ids(tokenizer: Any) -> list[int]:
    """The ids of ``<|return|>`` and ``<|call|>`` for a harmony tokenizer (stop tokens of its replies), else []."""
    ids = _special_ids(tokenizer) if tokenizer is not None else None
    return [] if ids is None else [ids[m] for m in STOP_MARKERS]


def final_channel_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of the LAST ``final``-channel message of a harmony reply (its tokens between ``<|message|>`` and the
    next ``<|end|>`` / ``<|return|>`` / ``<|call|>`` / ``<|start|>``, or the reply's end when it was cut by the
    length limit), decoded without special tokens; "" when the reply has no final message (e.g. it stopped inside
    the analysis channel): the analysis channel is never scored. A channel's name is the first word of the header
    between ``<|channel|>`` and ``<|message|>`` (``commentary json`` and ``final`` alike)."""
    ids = _special_ids(tokenizer)
    if ids is None:
        raise ValueError("final_channel_text needs a harmony tokenizer (its markers as special tokens)")
    channel, message = ids[CHANNEL], ids[MESSAGE]
    closers = {ids[END], ids[RETURN], ids[CALL], ids[START]}
    toks = [int(t) for t in token_ids]
    final: list[int] | None = None
    i, n = 0, len(toks)
    while i < n:
        if toks[i] != channel:
            i += 1
            continue
        j = i + 1
        while j < n and toks[j] != message and toks[j] not in closers and toks[j] != channel:
            j += 1
        if j >= n or toks[j] != message:  # a header without a message: no content
            i = j
            continue
        header = tokenizer.decode(toks[i + 1 : j], skip_special_tokens=True).strip()
        k = j + 1
        while k < n and toks[k] not in closers and toks[k] != channel:
            k += 1
        if header.split(" ")[0] == "final":
            final = toks[j + 1 : k]
        i = k
    return "" if final is None else tokenizer.decode(final, skip_special_tokens=True)


def reply_text(tokenizer: Any, token_ids: Sequence[int], text: str | None = None) -> str:
    """What a reward reads from a reply: for a harmony tokenizer its final channel (:func:`final_channel_text`),
    else the engine's ``text`` when it gave one, else the tokens decoded without special tokens."""
    if is_harmony(tokenizer):
        return final_channel_text(tokenizer, token_ids)
    return text if text is not None else tokenizer.decode(list(token_ids), skip_special_tokens=True)
