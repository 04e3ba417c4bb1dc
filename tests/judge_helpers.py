"""Judge checkpoints for the model-judged reward tests, built in code over the tiny character tokenizer.

``save_last_token_judge``: a 2-layer Qwen2 whose attention and MLP outputs are zeroed, so the final hidden state at a
position is the normalised embedding of that position's token alone (a bigram model). Token ``digit`` embeds as
e0, every other token as e1; the final RMSNorm maps c*e_k to sqrt(H)*e_k. So

- generative (Qwen2ForCausalLM): the next token after "...7" is "1" (lm_head row of "1" = e0), after anything else
  "0" (row of "0" = e1), by a margin of ``margin``: with max_tokens=1 the judge replies "1" exactly when its input
  ends in ``digit``;
- scalar (Qwen2ForSequenceClassification, num_labels=1): score = e0 / sqrt(H), so the logit at the last token is 1.0
  when the input ends in ``digit`` and 0.0 otherwise.
"""

from __future__ import annotations

import os

import torch

from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_hf_config, tiny_tokenizer


def _config(architecture: str, **extra):
    from transformers import Qwen2Config

    d = tiny_hf_config(tiny_tokenizer())
    d["architectures"] = [architecture]
    d.pop("dtype", None)
    d.update(extra)
    return Qwen2Config(**d)


def _zero_blocks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


@torch.no_grad()
def save_last_token_judge(path, kind: str, digit: str = "7", margin: float = 4.0) -> str:
    """Write the judge described in the module docstring (``kind`` "generative" or "scalar") and the tiny
    tokenizer into ``path``; returns it."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tok = tiny_tokenizer()
    vocab = tok.get_vocab()
    if kind == "generative":
        model = Qwen2ForCausalLM(_config("Qwen2ForCausalLM"))
    else:
        model = Qwen2ForSequenceClassification(_config("Qwen2ForSequenceClassification", num_labels=1))
    _zero_blocks(model)
    H = model.config.hidden_size
    emb = model.model.embed_tokens.weight
    emb.zero_()
    emb[:, 1] = 1.0
    emb[vocab[digit], 1] = 0.0
    emb[vocab[digit], 0] = 1.0
    model.model.norm.weight.fill_(1.0)
    if kind == "generative":
        head = model.lm_head.weight
        head.zero_()
        head[vocab["1"], 0] = margin / H**0.5
        head[vocab["0"], 1] = margin / H**0.5
    else:
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1.0 / H**0.5
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(os.fspath(path))
    save_tiny_tokenizer(path)
    return os.fspath(path)


def save_random_judge(path, kind: str = "generative", seed: int = 0) -> str:
    """A randomly initialised tiny Qwen2 (causal LM, or a one-output classifier for ``kind="scalar"``) and the tiny
    tokenizer in ``path``."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    if kind == "generative":
        model = Qwen2ForCausalLM(_config("Qwen2ForCausalLM"))
    else:
        model = Qwen2ForSequenceClassification(_config("Qwen2ForSequenceClassification", num_labels=1))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(os.fspath(path))
    save_tiny_tokenizer(path)
    return os.fspath(path)
