"""Tiny, offline vision-language models: Qwen2.5-VL and Qwen3-VL of width 128 over a character tokenizer that has
Qwen's vision special tokens, with a chat template and an image processor. Nothing comes from the hub.

- Tokenizer: a ``tokenizers`` WordLevel model over characters plus ``<|im_start|> <|im_end|> <|vision_start|>
  <|vision_end|> <|image_pad|> <|video_pad|> <|endoftext|> <unk>``, wrapped in ``PreTrainedTokenizerFast``.
- Chat template: Qwen2-VL's, reduced to string content or a list of ``{"type": "image" | "text"}`` parts; each image
  part becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per image: the processor, or vLLM, expands
  it to the image's number of merged patches).
- Image processor: ``Qwen2VLImageProcessorPil`` (PIL, no torchvision) capped at 112 x 112 pixels, so an image is at
  most 16 tokens for Qwen2.5-VL (patch 14, merge 2) and 9 for Qwen3-VL (patch 16).
- Models: 2 language layers of width 128 (4 heads of 32: vLLM's CPU attention refuses a head size of 16; 2 KV heads
  so TP=2 divides them) and a 2-block vision tower of width 64 whose output width is the language width.
  ``mrope_section`` splits the 16 rotary frequencies of a head into (temporal, height, width) = (4, 6, 6), the
  proportions of Qwen2.5-VL-7B's (16, 24, 24).

The processor class is :func:`megatron_rlvr.families.vl_processor.vl_processor`.
"""

from __future__ import annotations

import os

from megatron_rlvr.families.vl_processor import vl_processor

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
)
CHARS = tuple("0123456789+-*=?.,:;!'()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n")

VL_KINDS = ("qwen2_5_vl", "qwen3_vl")
"""The two tiny VL families: Qwen2.5-VL (contiguous M-RoPE) and Qwen3-VL (interleaved M-RoPE, DeepStack)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's chat template reduced to what the tiny models need (no tools, no video)."""

MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def tiny_vl_tokenizer():
    """The character-level tokenizer with Qwen's chat and vision special tokens (eos ``<|im_end|>``, pad
    ``<|endoftext|>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # "(?m)." splits into single characters ('.' does not match a newline, so newlines are matched on their own by
    # the isolated behaviour); the Oniguruma engine refuses "(?s)"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:7]),
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_image_processor(kind: str = "qwen2_5_vl"):
    """Qwen2-VL's PIL image processor with the tiny models' patch size and a 112 x 112 pixel cap."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _check_kind(kind)
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16 if kind == "qwen3_vl" else 14,
        temporal_patch_size=2,
        merge_size=2,
    )


def _check_kind(kind: str) -> None:
    if kind not in VL_KINDS:
        raise ValueError(f"tiny VL kind must be one of {VL_KINDS}, got {kind!r}")


def tiny_vl_hf_config(kind: str = "qwen2_5_vl"):
    """The transformers config object of a tiny VL model of family ``kind`` (from :func:`tiny_vl_config_dict`)."""
    from transformers import AutoConfig

    config = tiny_vl_config_dict(kind)
    return AutoConfig.for_model(config.pop("model_type"), **config)


TINY_VL_MODELS = {"tiny_vl": "qwen2_5_vl", "tiny_vl3": "qwen3_vl"}
"""The built-in vision-language models by ``model.name`` -> their kind (the ``tiny_vl`` preset's policy)."""


def tiny_vl_config_dict(kind: str = "qwen2_5_vl") -> dict:
    """The HF config of a tiny VL model of family ``kind`` as a plain dict, without transformers (the run config is
    checked torch-free); :func:`tiny_vl_hf_config` makes the transformers config object of it."""
    _check_kind(kind)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    hidden, heads = 128, 4
    pad, eos = vocab["<|endoftext|>"], vocab["<|im_end|>"]
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6])
    text = dict(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        model_type=f"{kind}_text",
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        in_channels=3,
    )
    if kind == "qwen2_5_vl":
        text.update(use_sliding_window=False, rope_parameters=rope)
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1], model_type="qwen2_5_vl")
        arch = "Qwen2_5_VLForConditionalGeneration"
    else:
        text.update(head_dim=hidden // heads, rope_parameters=dict(rope, mrope_interleaved=True))
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0], model_type="qwen3_vl")
        arch = "Qwen3VLForConditionalGeneration"
    return dict(
        architectures=[arch],
        model_type=kind,
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )


def save_tiny_vl(path: str | os.PathLike, kind: str = "qwen2_5_vl", seed: int = 0) -> str:
    """Write a random tiny VL checkpoint of family ``kind`` as a complete Hugging Face folder (config, safetensors,
    tokenizer, chat template, image processor) into ``path``; returns it.

    Weights are drawn from N(0, 0.08^2) (norm weights 1 + N(0, 0.2^2)) with ``seed``, large enough that the two
    models' outputs depend visibly on every weight (transformers' 0.02 init makes the vision tower's contribution
    nearly vanish, which would hide a wrong image path in a comparison)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    _check_kind(kind)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok = tiny_vl_tokenizer()
    cls = Qwen2_5_VLForConditionalGeneration if kind == "qwen2_5_vl" else Qwen3VLForConditionalGeneration
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(tiny_vl_hf_config(kind)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    proc = vl_processor(kind, image_processor=tiny_image_processor(kind), tokenizer=tok)
    proc.save_pretrained(path)
    return path
