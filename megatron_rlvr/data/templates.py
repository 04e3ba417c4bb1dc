"""Prompt rendering: the tokenizer's chat template, or a plain-text template.

The returned text is the full model input up to where the response starts. Tokenize it with
``add_special_tokens=False``: chat templates already contain their BOS/role tokens.

Examples with images (vision-language policies): the user turn becomes a list of parts, ``{"type": "image"}`` where
each ``<image>`` marker of the problem is (else all images first) and ``{"type": "text", "text": ...}`` around them;
a Qwen-VL chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for each image part, ONE pad per image
(the processor, or vLLM, expands it to the image's patches). The plain template writes that placeholder itself.
"""

from __future__ import annotations

from typing import Any

from megatron_rlvr.data.images import IMAGE_MARKER
from megatron_rlvr.data.records import Example

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "IMAGE_PLACEHOLDER", "TEMPLATES", "prompt_messages", "render_prompt"]

DEFAULT_PROMPT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
"""The instruction used by Qwen2.5-Math and the MCPO/DAPO-style evaluations; ``{problem}`` is replaced."""

TEMPLATES = ("chat", "plain")

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What a Qwen-VL chat template writes for one image; the plain template writes it for each image."""


def _fill(template: str, problem: str) -> str:
    # str.replace, not str.format: templates contain LaTeX braces such as \boxed{}.
    return template.replace("{problem}", problem)


def _parts(text: str) -> list[dict[str, str]]:
    """A text with ``<image>`` markers as chat content parts: an image part per marker, text parts between."""
    out: list[dict[str, str]] = []
    for i, piece in enumerate(text.split(IMAGE_MARKER)):
        if i:
            out.append({"type": "image"})
        if piece:
            out.append({"type": "text", "text": piece})
    return out


def _with_image_parts(messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """User/system string contents with markers become part lists; without any marker the images go first in the
    first user turn."""
    if not any(isinstance(m["content"], str) and IMAGE_MARKER in m["content"] for m in messages):
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError("an example with images needs a user turn to put them in")
        m = messages[first_user]
        messages[first_user] = {**m, "content": IMAGE_MARKER * n_images + m["content"]}
    return [{**m, "content": _parts(m["content"])} if IMAGE_MARKER in m["content"] else m for m in messages]


def prompt_messages(example: Example, prompt_template: str = DEFAULT_PROMPT_TEMPLATE, system_prompt: str | None = None):
    """Chat messages for ``example``: its own messages verbatim (DAPO), else one user turn with the problem in
    ``prompt_template``; ``system_prompt`` is prepended when given and the messages have no system turn. With
    images, turns holding them have a list of image / text parts (module docstring)."""
    if isinstance(example.prompt, list):
        messages = [dict(m) for m in example.prompt]
    else:
        messages = [{"role": "user", "content": _fill(prompt_template, example.prompt)}]
    if example.images:
        messages = _with_image_parts(messages, len(example.images))
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    example: Example,
    template: str = "chat",
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    system_prompt: str | None = None,
    tokenizer: Any = None,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for ``example``.

    - ``chat``: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` on :func:`prompt_messages`;
      ``tools`` (JSON-schema tool descriptions, multi-turn rollouts with tools) are passed on as its ``tools=``, which
      the Qwen2.5 / Qwen3 templates write into the system turn.
    - ``plain``: the problem in ``prompt_template`` (chat-format examples: their message contents joined by blank
      lines, used as they are since they carry their own instruction), with ``system_prompt`` in front if given.
    """
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.template='chat' needs a tokenizer with a chat_template; this tokenizer has none: use "
                "data.template='plain'"
            )
        messages = prompt_messages(example, prompt_template, system_prompt)
        kw = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        if not isinstance(text, str):  # some versions return a list for batched input
            raise ValueError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text
    if template == "plain":
        if isinstance(example.prompt, list):
            body = "\n\n".join(m["content"] for m in example.prompt)
        else:
            body = _fill(prompt_template, example.prompt)
        if example.images:
            if IMAGE_MARKER not in body:
                body = IMAGE_MARKER * len(example.images) + body
            body = body.replace(IMAGE_MARKER, IMAGE_PLACEHOLDER)
        return body if system_prompt is None else f"{system_prompt}\n\n{body}"
    raise ValueError(f"data.template must be one of {TEMPLATES}, got {template!r}")
