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


_TOKENIZERS: dict = {}


def last_token_is_7(response: str, ground_truth: str, **metadata) -> float:
    """A rule reward (user-function signature) that says what the last-token judge with digit "7" says of a
    response: 1.0 when the response's last token under the judge's own tokenizer (the folder named by
    $JUDGE_HELPERS_TOKENIZER) is "7", else 0.0 (the judge sees the question first, which ends in "=", so an empty
    response scores 0 for both). The tokenizer, not ``str.endswith``: the tiny tokenizer loaded back from a folder
    drops spaces, so the judge reads "27 " as ending in 7. Each response is appended to the file named by
    $JUDGE_HELPERS_LOG when set (one repr per line), so a test can count what was scored."""
    from transformers import AutoTokenizer

    folder = os.environ["JUDGE_HELPERS_TOKENIZER"]
    tok = _TOKENIZERS.get(folder) or _TOKENIZERS.setdefault(folder, AutoTokenizer.from_pretrained(folder))
    log = os.environ.get("JUDGE_HELPERS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(repr(response) + "\n")
    ids = tok(response)["input_ids"]
    return 1.0 if ids and ids[-1] == tok.convert_tokens_to_ids("7") else 0.0


def greedy_replies(folder: str, questions, responses, max_new_tokens: int = 3) -> list[str]:
    """The independent reference of a generative judge's replies: transformers' own greedy decode in float64 of
    ``question + response`` for each item (the judge tests render their template as exactly that)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    replies = []
    for q, r in zip(questions, responses):
        ids = torch.tensor([tok(q + r)["input_ids"]])
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=0
        )
        replies.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return replies
