"""The ``tiny`` preset's model and tokenizer, built in code (no download).

- Tokenizer: character level, a ``tokenizers`` WordLevel model over digits, the arithmetic operators and a few
  specials, wrapped in ``transformers.PreTrainedTokenizerFast`` (so it saves/loads like any HF tokenizer and the
  exported HF folder is self-contained). Every character is one token; decoding concatenates.
- Model: a 2-layer Qwen2 (QKV bias, SwiGLU, RMSNorm, RoPE; 2 heads of 32) of width 64 whose vocabulary is that
  tokenizer's.
  Qwen2 rather than Llama because its QKV bias exercises one more mapping rule on every weight sync.

The task (``configs/tiny.yaml``): the procedural ``copy`` task in terse style, "7=" -> "7" and then EOS (reward
``exact_stop``). A random model answers so with probability ~1/|V|^2 (well under 1%); a working RL pipeline drives
that to ~1 within a few dozen steps, and a broken one (no weight sync, wrong advantage sign, wrong log-probs) cannot.
"""

from __future__ import annotations

import os

TINY_NAME = "tiny"

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARS = tuple("0123456789+-*=? ")
"""Every non-special token: digits, operators, '=', '?' and space (the terse procedural prompts use only these)."""

TINY_MODEL = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    # head_dim = 64 / 2 = 32: vLLM's CPU attention kernels support head sizes 32, 64, 80, ... only (16 is refused),
    # and rollout.engine=vllm must run this preset on CPU
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    use_sliding_window=False,
    attention_dropout=0.0,
)
"""HF config fields of the tiny model (vocab and special ids are filled in from the tokenizer)."""


def tiny_vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (pad=0, eos=1, unk=2, then one id per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=tiny_vocab(), unk_token="<unk>"))
    # one pre-token per character (Oniguruma "(?m)." also matches newlines, which become <unk>)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate without the WordLevel default's spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=64
    )
    fast.padding_side = "left"
    return fast


def tiny_hf_config(tokenizer=None) -> dict:
    """The tiny model's HF config as a dict (what ``config.json`` of its export holds)."""
    tokenizer = tokenizer or tiny_tokenizer()
    cfg = dict(TINY_MODEL)
    cfg.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    return cfg


def save_tiny_tokenizer(path: str | os.PathLike) -> str:
    """Write the tiny tokenizer's HF files into ``path`` (created); returns it."""
    os.makedirs(path, exist_ok=True)
    tiny_tokenizer().save_pretrained(os.fspath(path))
    return os.fspath(path)
