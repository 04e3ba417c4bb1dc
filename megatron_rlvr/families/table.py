"""Model architectures, torch-free: the one model-family table and the shape specs the planner's memory model uses.

- ``FAMILIES``: every supported HF decoder family (Llama, Qwen2/2.5, Qwen3, and the mixture-of-experts Qwen2-MoE,
  Qwen3-MoE, DeepSeek-V2/V3 with multi-latent attention, GLM-4.5 and GPT-OSS), keyed by ``architectures[0]``, with what
  distinguishes it.
  ``models/hf_config.py`` builds megatron models from it, the planner derives a :class:`ModelSpec` from it, so the
  two accept exactly the same models.
- ``ModelSpec``: the shapes of a decoder-only transformer, dense or mixture-of-experts, with a :class:`VisionSpec`
  for a vision-language model's tower; ``BUILTIN_SPECS`` for planning without a checkpoint (values from each model's
  official HF config.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MEGATRON_VOCAB_DIVISIBLE_BY = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``; the padded vocab is a multiple of this times TP."""


def padded_vocab(vocab_size: int, tp_size: int, multiple: int = MEGATRON_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads V up to a multiple of ``multiple * tp`` so every TP rank holds an equal, aligned vocab shard
    (megatron.training's _vocab_size_with_padding)."""
    if multiple <= 0:
        raise ValueError(f"vocab padding multiple must be positive, got {multiple}")
    m = multiple * tp_size
    return -(-vocab_size // m) * m


# ----------------------------------------------------------------------------------------------------------------
# Model families
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """What distinguishes one HF decoder family in megatron terms."""

    model_type: str
    """HF ``model_type`` of the family."""
    qkv_bias: bool
    """q/k/v projections have a bias (Qwen2)."""
    qk_layernorm: bool
    """Per-head RMSNorm on q and k (Qwen3)."""
    bias_fields: tuple[str, ...] = ()
    """HF config fields that must be False (bias variants megatron's dense GPT does not map 1:1)."""
    sliding_window_field: str | None = None
    """HF config field that must be False (sliding-window attention is not implemented)."""
    moe: bool = False
    """Mixture-of-experts MLPs (softmax router, top-k, SwiGLU experts); see :func:`moe_fields`."""
    shared_expert: bool = False
    """Each MoE layer also has one shared SwiGLU expert whose output is scaled by a sigmoid gate (Qwen2-MoE)."""
    qkv_bias_field: str | None = None
    """HF config field saying whether q/k/v carry a bias (Qwen2-MoE's ``qkv_bias``); None: ``qkv_bias`` decides."""
    mla: bool = False
    """Multi-latent attention (DeepSeek-V2/V3): low-rank q and kv projections, decoupled RoPE dims; see
    :func:`mla_fields`."""
    deepseek_moe: str = ""
    """DeepSeek's MoE (``n_routed_experts``, the first ``first_k_dense_replace`` layers dense, ungated shared experts,
    ``routed_scaling_factor``) with its router: ``sigmoid`` (V3: sigmoid scores whose top-k is chosen with the
    ``e_score_correction_bias`` added, the aux-loss-free balancing, and group-limited top-k by ``n_group`` /
    ``topk_group``) or ``softmax`` (V2: softmax over all experts, greedy top-k, never renormalised); empty: none."""
    qk_norm_field: str | None = None
    """HF config field saying whether queries and keys get a per-head RMSNorm (GLM-4.5's ``use_qk_norm``); None:
    ``qk_layernorm`` decides."""
    partial_rotary: float | None = None
    """The family's default ``partial_rotary_factor`` (GLM-4.5: RoPE on the first half of each head's dims, in the
    rotate-half layout; transformers fills in 0.5 when the config has none); None: only full rotary is accepted."""
    gpt_oss: bool = False
    """GPT-OSS: learned attention sinks, sliding-window attention on the layers ``layer_types`` names, biases on
    q/k/v/o, the router and the experts, a router that takes the top-k of the biased logits and softmaxes over those
    k, clamped SwiGLU experts (``swiglu_limit``, ``swiglu_alpha``, ``up + 1``) stored fused with gate and up
    interleaved, and YaRN; see :func:`gpt_oss_fields`."""


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", qkv_bias=False, qk_layernorm=False, bias_fields=("attention_bias", "mlp_bias")),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, qk_layernorm=False, sliding_window_field="use_sliding_window"),
    "Qwen3ForCausalLM": Family(
        "qwen3",
        qkv_bias=False,
        qk_layernorm=True,
        bias_fields=("attention_bias",),
        sliding_window_field="use_sliding_window",
    ),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe",
        qkv_bias=False,
        qk_layernorm=True,
        bias_fields=("attention_bias",),
        sliding_window_field="use_sliding_window",
        moe=True,
    ),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe",
        qkv_bias=True,
        qk_layernorm=False,
        sliding_window_field="use_sliding_window",
        moe=True,
        shared_expert=True,
        qkv_bias_field="qkv_bias",
    ),
    # DeepSeek-V3 (also Moonlight-16B-A3B and Kimi-K2, which reuse the architecture)
    "DeepseekV3ForCausalLM": Family(
        "deepseek_v3",
        qkv_bias=False,
        qk_layernorm=False,
        bias_fields=("attention_bias",),
        moe=True,
        mla=True,
        deepseek_moe="sigmoid",
    ),
    # DeepSeek-V2 and V2-Lite (greedy top-k; V2's group_limited_greedy is refused, see _deepseek_moe_fields)
    "DeepseekV2ForCausalLM": Family(
        "deepseek_v2",
        qkv_bias=False,
        qk_layernorm=False,
        bias_fields=("attention_bias", "mlp_bias"),
        moe=True,
        mla=True,
        deepseek_moe="softmax",
    ),
    # GLM-4.5 / GLM-4.5-Air: grouped-query attention with q/k/v biases, optional per-head qk-norm and RoPE on part
    # of each head; DeepSeek-V3's MoE and router (sigmoid scores, e_score_correction_bias, groups, shared experts)
    "Glm4MoeForCausalLM": Family(
        "glm4_moe",
        qkv_bias=False,
        qk_layernorm=False,
        qkv_bias_field="attention_bias",
        qk_norm_field="use_qk_norm",
        moe=True,
        deepseek_moe="sigmoid",
        partial_rotary=0.5,
    ),
    # OpenAI gpt-oss-20b / gpt-oss-120b
    "GptOssForCausalLM": Family("gpt_oss", qkv_bias=True, qk_layernorm=False, moe=True, gpt_oss=True),
}
"""The supported families, keyed by HF ``architectures[0]`` (the trainer, the exporter and the planner all read it)."""


def family_of(cfg: dict, where: str = "HF config") -> tuple[str, Family]:
    """(architecture, Family) of an HF config dict; ValueError naming the config when unsupported. The architecture
    comes from ``architectures[0]``, else from ``model_type`` (configs written by hand often omit architectures)."""
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in FAMILIES:
            raise ValueError(f"{where}: architectures={archs!r} is not supported; supported: {sorted(FAMILIES)}")
        return arch, FAMILIES[arch]
    mtype = cfg.get("model_type")
    for arch, fam in FAMILIES.items():
        if fam.model_type == mtype:
            return arch, fam
    supported = ", ".join(sorted(f.model_type for f in FAMILIES.values()))
    raise ValueError(f"{where}: model_type {mtype!r} is not supported (dense decoder-only: {supported})")


@dataclass(frozen=True)
class VLFamily:
    """A vision-language architecture: an HF vision tower beside the language model of a text family, whose
    rotary embedding is multimodal (M-RoPE: separate temporal / height / width position ids per frequency band)."""

    kind: str
    """Short name (``qwen2_5_vl`` / ``qwen3_vl``), the processor kind of ``families.vl_processor``."""
    text_architecture: str
    """The text family (a ``FAMILIES`` key) of the language model in ``text_config``."""
    lm_prefix: str
    """Prefix of the language model's tensors in the saved checkpoint, in place of the text family's ``model.``."""
    vision_prefix: str
    """Prefix of the vision tower's tensors in the saved checkpoint."""
    interleaved_mrope: bool
    """Frequency bands interleaved t,h,w,t,h,w,... (Qwen3-VL) instead of contiguous sections (Qwen2-VL / 2.5-VL)."""
    deepstack: bool
    """Features of early vision blocks are added to the hidden states at image positions after the first language
    layers (Qwen3-VL's DeepStack)."""


VL_FAMILIES: dict[str, VLFamily] = {
    # transformers' save_pretrained writes Qwen2.5-VL's language model under Qwen2's own names
    "Qwen2_5_VLForConditionalGeneration": VLFamily(
        "qwen2_5_vl", "Qwen2ForCausalLM", "model.", "visual.", interleaved_mrope=False, deepstack=False
    ),
    "Qwen3VLForConditionalGeneration": VLFamily(
        "qwen3_vl",
        "Qwen3ForCausalLM",
        "model.language_model.",
        "model.visual.",
        interleaved_mrope=True,
        deepstack=True,
    ),
}
"""The supported vision-language architectures, keyed by HF ``architectures[0]``."""


def vl_family_of(cfg: dict) -> tuple[str, VLFamily] | None:
    """(architecture, VLFamily) of a vision-language HF config dict; None for a text-only config."""
    archs = cfg.get("architectures") or []
    if archs and archs[0] in VL_FAMILIES:
        return archs[0], VL_FAMILIES[archs[0]]
    for arch, fam in VL_FAMILIES.items():
        if not archs and cfg.get("model_type") == fam.kind:
            return arch, fam
    return None


def vl_saved_name(fam: VLFamily, name: str) -> str:
    """transformers' in-memory parameter name of a VL model (``model.language_model.*``, ``model.visual.*``) -> the
    name its ``save_pretrained`` writes (and the weight stream sends)."""
    for memory, saved in (("model.language_model.", fam.lm_prefix), ("model.visual.", fam.vision_prefix)):
        if name.startswith(memory):
            return saved + name[len(memory) :]
    return name


def vl_text_config(cfg: dict, where: str = "HF config") -> dict:
    """The language model's config of a vision-language HF config dict as a text-family config (its
    ``architectures`` set to the text family, ``tie_word_embeddings`` from the top level where transformers keeps
    it). Raises ValueError for a text-only config or one without ``text_config``."""
    found = vl_family_of(cfg)
    if found is None:
        raise ValueError(f"{where}: not a vision-language config (architectures={cfg.get('architectures')!r})")
    arch, fam = found
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: {arch} needs a text_config section")
    if not isinstance(cfg.get("vision_config"), dict):
        raise ValueError(f"{where}: {arch} needs a vision_config section")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return dict(text, architectures=[fam.text_architecture], tie_word_embeddings=bool(tie))


def has_qkv_bias(cfg: dict, fam: Family) -> bool:
    """Whether q/k/v carry a bias in this config (a family default, a per-config field, or Llama's attention_bias)."""
    if fam.qkv_bias_field is not None:
        return bool(cfg.get(fam.qkv_bias_field, fam.qkv_bias))
    return fam.qkv_bias or bool(cfg.get("attention_bias", False))


def routed_experts(cfg: dict) -> int:
    """Routed experts per MoE layer of an HF text config, under any family's name (Qwen's ``num_experts``,
    transformers 5's ``num_local_experts``, DeepSeek's and GLM-4.5's ``n_routed_experts``); 0 for a dense model."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def has_qk_norm(cfg: dict, fam: Family) -> bool:
    """Whether queries and keys get a per-head RMSNorm in this config (a family default or a per-config field)."""
    if fam.qk_norm_field is not None:
        return bool(cfg.get(fam.qk_norm_field, fam.qk_layernorm))
    return fam.qk_layernorm


def rotary_fraction(cfg: dict, fam: Family, where: str = "HF config") -> float:
    """The share of each head's dims that RoPE rotates (``partial_rotary_factor`` in ``rope_parameters``, or at the
    top level of older config.json files; the family's default when absent). ValueError for a partial factor in a
    family that rotates whole heads, or a factor that does not give an even number of rotated dims."""
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None:
        factor = fam.partial_rotary if fam.partial_rotary is not None else 1.0
    factor = float(factor)
    if factor == 1.0:
        return factor
    if fam.partial_rotary is None:
        raise ValueError(f"{where}: partial_rotary_factor={factor} is not supported for {fam.model_type}")
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    rotated = int(head_dim * factor)
    if not 0 < factor < 1 or rotated % 2 or rotated != head_dim * factor:
        raise ValueError(
            f"{where}: partial_rotary_factor={factor} must rotate an even number of the head_dim={head_dim} dims"
        )
    return factor


@dataclass(frozen=True)
class MoeFields:
    """The mixture-of-experts settings of an HF config, in plain numbers (shared by megatron and the planner)."""

    experts: int
    """Routed experts per MoE layer (hub Qwen configs: ``num_experts``; transformers 5 writes ``num_local_experts``)."""
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    expert_ffn: int
    """Inner width of one routed expert (``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """Renormalise the top-k probabilities to sum to 1 (HF softmax over all experts, then top-k, then divide)."""
    moe_layers: tuple[bool, ...]
    """Per layer: True for an MoE layer, False for a dense MLP (``mlp_only_layers``, ``decoder_sparse_step``)."""
    shared_expert_ffn: int = 0
    """Inner width of the shared expert (Qwen2-MoE ``shared_expert_intermediate_size``; DeepSeek
    ``n_shared_experts * moe_intermediate_size``); 0: none."""
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE; DeepSeek: no gate)."""
    score_function: str = "softmax"
    """Router scores: ``softmax`` over all experts, or ``sigmoid`` per expert (DeepSeek-V3)."""
    expert_bias: bool = False
    """A per-expert bias is added to the scores for the top-k choice only (DeepSeek-V3's ``e_score_correction_bias``,
    the aux-loss-free balancing of arXiv:2408.15664); the weights are the unbiased scores."""
    num_groups: int | None = None
    """Group-limited routing: the experts form this many equal groups (``n_group``); None: no group limit."""
    group_topk: int | None = None
    """Groups a token may use (``topk_group``), chosen by the sum of each group's two best biased scores."""
    scaling_factor: float | None = None
    """The routed experts' weights are multiplied by this (``routed_scaling_factor``); None: 1."""
    linear_bias: bool = False
    """The router and every expert's projections carry biases (GPT-OSS)."""


def _deepseek_moe_fields(cfg: dict, fam: Family, where: str) -> MoeFields:
    """DeepSeek's MoE settings (transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter`` and ``*MoE``).
    Layer ``i`` is an MoE layer when ``i >= first_k_dense_replace`` (transformers ignores ``moe_layer_freq``; a value
    other than 1 is refused)."""
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    for name, v in (("n_routed_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok"))):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {fam.model_type} needs {name} > 0, got {v!r}")
    for name in ("moe_intermediate_size", "first_k_dense_replace"):
        if name not in cfg:
            raise ValueError(f"{where}: {fam.model_type} needs {name}")
    experts, top_k = int(experts), int(cfg["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be in 1..n_routed_experts={experts}")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{where}: {fam.model_type} moe_layer_freq={cfg['moe_layer_freq']} is not supported (1 only)")
    if fam.deepseek_moe == "softmax":
        return _deepseek_v2_router(cfg, fam, where, experts, top_k)
    # config keys that only the original DeepSeek code (and vLLM) read: refuse values that would route otherwise
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{where}: {fam.model_type} scoring_func={cfg['scoring_func']!r}; only sigmoid is supported")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"{where}: {fam.model_type} topk_method={cfg['topk_method']!r}; only noaux_tc is supported")
    if not cfg.get("norm_topk_prob", True) or top_k == 1:
        # megatron renormalises sigmoid top-k weights for top_k > 1 and never for top_k == 1
        raise ValueError(
            f"{where}: {fam.model_type} with norm_topk_prob={cfg.get('norm_topk_prob')} and num_experts_per_tok="
            f"{top_k} is not supported (sigmoid routing needs norm_topk_prob=true and num_experts_per_tok > 1)"
        )
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    groups = group_topk = None
    if n_group > 1 and topk_group < n_group:  # otherwise every group is always selected: no limit
        if experts % n_group or experts // n_group < 2:
            raise ValueError(f"{where}: n_group={n_group} must split n_routed_experts={experts} into groups of >= 2")
        if topk_group < 1 or top_k % topk_group or top_k // topk_group != 2:
            # transformers scores a group by the sum of its 2 best biased scores; megatron's group_limited_topk sums
            # its best top_k / topk_group: the same rule only when that is 2 (DeepSeek-V3: 8 / 4)
            raise ValueError(
                f"{where}: group-limited routing with num_experts_per_tok={top_k}, topk_group={topk_group} is not "
                "supported (megatron scores a group by its best num_experts_per_tok / topk_group experts, "
                "transformers by its best 2: they agree only when num_experts_per_tok == 2 * topk_group)"
            )
        groups, group_topk = n_group, topk_group
    return _deepseek_fields(
        cfg,
        experts,
        top_k,
        norm_topk_prob=True,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups,
        group_topk=group_topk,
    )


def _deepseek_fields(cfg: dict, experts: int, top_k: int, **router) -> MoeFields:
    """The MoE fields both DeepSeek generations share (expert widths, shared experts without a gate, dense first
    layers, the routed scaling factor), with the generation's ``router`` fields."""
    first_dense = int(cfg["first_k_dense_replace"])
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    return MoeFields(
        experts=experts,
        top_k=top_k,
        expert_ffn=int(cfg["moe_intermediate_size"]),
        moe_layers=tuple(i >= first_dense for i in range(int(cfg["num_hidden_layers"]))),
        shared_expert_ffn=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
        shared_expert_gate=False,
        scaling_factor=None if scale == 1.0 else scale,
        **router,
    )


def _deepseek_v2_router(cfg: dict, fam: Family, where: str, experts: int, top_k: int) -> MoeFields:
    """DeepSeek-V2's router as transformers computes it: softmax over all experts, greedy top-k, the k weights never
    renormalised (transformers ignores ``norm_topk_prob``), times ``routed_scaling_factor``: megatron's
    ``moe_router_pre_softmax=True`` with the scaling factor. ``group_limited_greedy`` scores a group by its best
    expert, which megatron cannot do; it is accepted only where it selects every group (then it is greedy)."""
    method = cfg.get("topk_method") or "greedy"
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"{where}: {fam.model_type} topk_method={method!r} is not supported (greedy)")
    if method == "group_limited_greedy" and n_group > 1 and topk_group < n_group:
        raise ValueError(
            f"{where}: {fam.model_type} topk_method=group_limited_greedy with n_group={n_group}, topk_group="
            f"{topk_group} is not supported (megatron cannot score a group by its best expert)"
        )
    if cfg.get("norm_topk_prob"):
        raise ValueError(
            f"{where}: {fam.model_type} norm_topk_prob=true is not supported (transformers never renormalises "
            "DeepSeek-V2's top-k weights, vLLM does: the engines would disagree)"
        )
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"{where}: {fam.model_type} scoring_func={cfg['scoring_func']!r}; only softmax is supported")
    return _deepseek_fields(cfg, experts, top_k, norm_topk_prob=False)


def moe_fields(cfg: dict, fam: Family, where: str = "HF config") -> MoeFields | None:
    """The MoE settings of an HF config of an MoE family (None for dense families). Qwen: layer ``i`` is an MoE layer
    when it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers' Qwen2/3-MoE rule);
    DeepSeek: see ``_deepseek_moe_fields``."""
    if not fam.moe:
        return None
    if fam.deepseek_moe:
        return _deepseek_moe_fields(cfg, fam, where)
    if fam.gpt_oss:
        return _gpt_oss_moe_fields(cfg, fam, where)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{where}: {fam.model_type} needs num_experts (or num_local_experts)")
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        if name not in cfg:
            raise ValueError(f"{where}: {fam.model_type} needs {name}")
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    pattern = tuple(int(experts) > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
    top_k = int(cfg["num_experts_per_tok"])
    if int(experts) > 0 and not 1 <= top_k <= int(experts):
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if fam.shared_expert else 0
    if fam.shared_expert and shared <= 0:
        raise ValueError(f"{where}: {fam.model_type} needs shared_expert_intermediate_size > 0")
    return MoeFields(
        experts=int(experts),
        top_k=top_k,
        expert_ffn=int(cfg["moe_intermediate_size"]),
        # transformers' Qwen2-MoE and Qwen3-MoE configs both default norm_topk_prob to False
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=pattern,
        shared_expert_ffn=shared,
    )


GPT_OSS_SWIGLU_ALPHA = 1.702
"""The only sigmoid gain of GPT-OSS's SwiGLU megatron computes: its ``quick_gelu`` is ``y * sigmoid(1.702 y)`` (the
fused GPU kernel too)."""

GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssFields:
    """GPT-OSS's attention and expert settings of an HF config (``GptOssForCausalLM``), in plain numbers."""

    sliding_window: int
    """Keys a sliding layer's query sees, itself included (HF ``sliding_window``; megatron's window is
    ``(sliding_window - 1, 0)``)."""
    sliding_layers: tuple[bool, ...]
    """Per layer: True for sliding-window attention, False for full (HF ``layer_types``; the hub models slide on
    even layers)."""
    swiglu_limit: float
    """Clamp of the experts' gate (above) and up projection (both sides) before the SwiGLU (``swiglu_limit``)."""


def gpt_oss_fields(cfg: dict, where: str = "HF config") -> GptOssFields:
    """The GPT-OSS settings of an HF config, refusing by name what megatron cannot compute as transformers does:
    ``swiglu_alpha`` other than 1.702, ``attention_bias=false`` (megatron's ``add_bias_linear`` puts biases on the
    output projection and the experts together), unknown ``layer_types``. Any pattern of sliding and full layers is
    expressible (megatron takes a per-layer list)."""
    layers = int(cfg["num_hidden_layers"])
    alpha = cfg.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
    if alpha is None or abs(float(alpha) - GPT_OSS_SWIGLU_ALPHA) > 1e-12:
        raise ValueError(
            f"{where}: swiglu_alpha={alpha!r} is not supported (megatron's quick_gelu has the fixed gain "
            f"{GPT_OSS_SWIGLU_ALPHA})"
        )
    limit = cfg.get("swiglu_limit", 7.0)
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        raise ValueError(f"{where}: swiglu_limit must be a positive number, got {limit!r}")
    if cfg.get("attention_bias", True) is not True:
        raise ValueError(
            f"{where}: gpt_oss with attention_bias={cfg.get('attention_bias')!r} is not supported (megatron's "
            "add_bias_linear biases the attention output and the experts together)"
        )
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers
        types = [GPT_OSS_LAYER_TYPES[i % 2] for i in range(layers)]
    if len(types) != layers or any(t not in GPT_OSS_LAYER_TYPES for t in types):
        raise ValueError(f"{where}: layer_types must list {layers} entries of {GPT_OSS_LAYER_TYPES}, got {types!r}")
    sliding = tuple(t == "sliding_attention" for t in types)
    window = cfg.get("sliding_window")
    if any(sliding) and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}: sliding layers need sliding_window >= 1, got {window!r}")
    return GptOssFields(sliding_window=int(window or 0), sliding_layers=sliding, swiglu_limit=float(limit))


def _gpt_oss_moe_fields(cfg: dict, fam: Family, where: str) -> MoeFields:
    """GPT-OSS's MoE (transformers' ``GptOssTopKRouter`` / ``GptOssExperts``): every layer is an MoE layer of
    ``num_local_experts`` experts of width ``intermediate_size``; the router takes the top-k of its biased logits and
    softmaxes over those k, which is renormalised softmax-then-top-k (megatron's ``moe_router_pre_softmax=False``)."""
    gpt_oss_fields(cfg, where)
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    top_k = cfg.get("num_experts_per_tok")
    for name, v in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {fam.model_type} needs {name} > 0, got {v!r}")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be in 1..num_local_experts={experts}")
    return MoeFields(
        experts=experts,
        top_k=top_k,
        expert_ffn=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=(True,) * int(cfg["num_hidden_layers"]),
        linear_bias=True,
    )


@dataclass(frozen=True)
class MlaFields:
    """Multi-latent attention shapes of an HF config (DeepSeek-V2/V3), in transformers' names."""

    q_lora_rank: int | None
    """Rank of the query's low-rank projection (``q_a_proj``); None: a full ``q_proj`` (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (``kv_a_proj_with_mqa`` minus the RoPE part)."""
    qk_nope_head_dim: int
    """Per-head query/key width without RoPE (megatron's ``qk_head_dim``)."""
    qk_rope_head_dim: int
    """Per-head query width with RoPE, and of the single key RoPE head shared by all heads (megatron's
    ``qk_pos_emb_head_dim``)."""
    v_head_dim: int
    """Per-head value width."""


def mla_fields(cfg: dict, fam: Family, where: str = "HF config") -> MlaFields | None:
    """The multi-latent attention shapes of an HF config of an MLA family (None otherwise). Refuses
    ``rope_interleave=false``: megatron's MLA always reads the RoPE dims as interleaved pairs (transformers' hub
    default)."""
    if not fam.mla:
        return None
    dims = {}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = cfg.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {fam.model_type} needs {name} > 0, got {v!r}")
        dims[name] = v
    q = cfg.get("q_lora_rank")
    if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q <= 0):
        raise ValueError(f"{where}: q_lora_rank must be a positive int or null, got {q!r}")
    if dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"{where}: qk_rope_head_dim={dims['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    if cfg.get("rope_interleave", True) is not True:
        raise ValueError(
            f"{where}: rope_interleave={cfg.get('rope_interleave')!r} is not supported (megatron's multi-latent "
            "attention reads the RoPE dims as interleaved pairs, rope_interleave=true)"
        )
    return MlaFields(q_lora_rank=q, **dims)


# ----------------------------------------------------------------------------------------------------------------
# Model specs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionSpec:
    """Shape of a Qwen-VL vision tower (HF ``vision_config``): a ViT over ``patch_size`` x ``patch_size`` x
    ``temporal_patch_size`` patches, then a merger that concatenates ``spatial_merge_size``^2 neighbouring patches
    into one language-model token of width ``out_hidden``."""

    kind: str
    """``qwen2_5_vl`` (RMSNorm, SwiGLU MLP, conv without bias) or ``qwen3_vl`` (LayerNorm, GELU MLP, conv with bias,
    learned position embeddings, DeepStack mergers)."""
    depth: int
    """ViT blocks (HF ``depth``)."""
    hidden: int
    """ViT width (HF ``hidden_size``)."""
    ffn: int
    """ViT MLP inner width (HF ``intermediate_size``)."""
    heads: int
    """ViT attention heads (HF ``num_heads``)."""
    out_hidden: int
    """Width of a merged token: the language model's hidden size (HF ``out_hidden_size``)."""
    patch_size: int = 14
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger concatenates this squared neighbouring patches into one language token."""
    in_channels: int = 3
    """Image channels."""
    num_position_embeddings: int = 0
    """Learned position embeddings (Qwen3-VL); 0: none (Qwen2.5-VL's rotary only)."""
    deepstack_layers: int = 0
    """DeepStack mergers (Qwen3-VL: one per ``deepstack_visual_indexes`` entry)."""

    def __post_init__(self):
        if self.kind not in ("qwen2_5_vl", "qwen3_vl"):
            raise ValueError(f"vision spec: kind must be qwen2_5_vl or qwen3_vl, got {self.kind!r}")
        for f in ("depth", "hidden", "ffn", "heads", "out_hidden", "patch_size", "spatial_merge_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"vision spec: {f} must be a positive integer, got {v!r}")

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU MLP (gate, up, down) in the blocks; else a 2-matrix GELU MLP."""
        return self.kind == "qwen2_5_vl"

    @property
    def merged_width(self) -> int:
        """Width of the merger's input: ``spatial_merge_size``^2 patches concatenated."""
        return self.hidden * self.spatial_merge_size**2

    def block_params(self) -> int:
        """Parameters of one ViT block: two norms, fused QKV and output projection (with biases), the MLP (biases)."""
        h, f = self.hidden, self.ffn
        norms = 2 * h if self.kind == "qwen2_5_vl" else 4 * h  # RMSNorm weight / LayerNorm weight + bias
        attn = h * 3 * h + 3 * h + h * h + h
        mlp = (2 * (h * f + f) + f * h + h) if self.gated_mlp else (h * f + f + f * h + h)
        return norms + attn + mlp

    def merger_params(self, postshuffle_norm: bool = False) -> int:
        """A patch merger: a norm over one patch (Qwen3-VL's DeepStack mergers: over the merged width), then
        Linear(merged, merged) + GELU + Linear(merged, out_hidden), with biases."""
        m, h = self.merged_width, self.hidden
        width = m if postshuffle_norm else h
        norm = width if self.kind == "qwen2_5_vl" else 2 * width
        return norm + m * m + m + m * self.out_hidden + self.out_hidden

    def param_count(self) -> int:
        """Every parameter of the tower (as ``sum(p.numel() for p in visual.parameters())``)."""
        conv = self.in_channels * self.temporal_patch_size * self.patch_size**2 * self.hidden
        conv += self.hidden if self.kind == "qwen3_vl" else 0  # Qwen3-VL's patch conv has a bias
        pos = self.num_position_embeddings * self.hidden
        deepstack = self.deepstack_layers * self.merger_params(postshuffle_norm=True)
        return conv + pos + self.depth * self.block_params() + self.merger_params() + deepstack

    def activation_bytes_per_block(self, patches: int, dtype_bytes: int = 2) -> int:
        """Bytes one ViT block saves for backward for ``patches`` patches: the language layer's count of
        ``activation_bytes_per_layer`` (planner) with full multi-head attention (q = k = v = h) and no tensor
        parallelism (the tower is a plain module, replicated): per patch, in 2-byte units, norm inputs 2h + 2h,
        QKV and MLP inputs 2h + 2h, q, k, v 6h, attention output 2h, MLP 6f (SwiGLU) or 4f (fc1 output and GELU
        output), = 16h + 6f or 16h + 4f."""
        h, f = self.hidden, self.ffn
        per_patch_2b = 16 * h + (6 * f if self.gated_mlp else 4 * f)
        return patches * per_patch_2b * dtype_bytes // 2


def vision_spec_from_hf_config(vision_config: dict, kind: str) -> VisionSpec:
    """VisionSpec from an HF ``vision_config`` dict of a ``kind`` model."""
    v = vision_config
    return VisionSpec(
        kind=kind,
        depth=int(v["depth"]),
        hidden=int(v["hidden_size"]),
        ffn=int(v["intermediate_size"]),
        heads=int(v["num_heads"]),
        out_hidden=int(v["out_hidden_size"]),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        num_position_embeddings=int(v.get("num_position_embeddings", 0)) if kind == "qwen3_vl" else 0,
        deepstack_layers=len(v.get("deepstack_visual_indexes") or ()) if kind == "qwen3_vl" else 0,
    )


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 family: RMSNorm, RoPE, GQA, SwiGLU)."""

    name: str
    """Display name."""
    hidden: int
    """Model width h (HF ``hidden_size``)."""
    ffn: int
    """MLP inner width f (HF ``intermediate_size``)."""
    layers: int
    """Number of transformer layers L (HF ``num_hidden_layers``)."""
    heads: int
    """Number of attention (query) heads a (HF ``num_attention_heads``)."""
    kv_heads: int
    """Number of key/value heads, i.e. GQA query groups (HF ``num_key_value_heads``)."""
    vocab: int
    """Vocabulary size V of the checkpoint, before Megatron's padding (HF ``vocab_size``)."""
    head_dim: int = 0
    """Per-head width d (HF ``head_dim``); 0 means hidden // heads."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one matrix (HF ``tie_word_embeddings``)."""
    qkv_bias: bool = False
    """Q, K and V projections carry a bias (always on for Qwen2/2.5; HF ``attention_bias`` for Llama/Qwen3)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys, one weight of size d each (Qwen3)."""
    gated_mlp: bool = True
    """SwiGLU MLP (gate, up, down: 3 matrices). False: a 2-matrix MLP (GeLU)."""
    experts: int = 0
    """Routed experts per MoE layer (HF ``num_experts``); 0: a dense model."""
    top_k: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    expert_ffn: int = 0
    """Inner width of one routed SwiGLU expert (HF ``moe_intermediate_size``)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True for an MoE layer, False for a dense MLP of width ``ffn``; empty: every layer when ``experts``."""
    shared_expert_ffn: int = 0
    """Inner width of a shared SwiGLU expert in every MoE layer (Qwen2-MoE: one; DeepSeek: n_shared_experts as one
    MLP); 0: none."""
    shared_expert_gate: bool = True
    """The shared expert has a [1, h] sigmoid gate (Qwen2-MoE); DeepSeek's shared experts have none."""
    router_bias: bool = False
    """Each router has a per-expert score-correction bias of E values (DeepSeek-V3's ``e_score_correction_bias``)."""
    mla: MlaFields | None = None
    """Multi-latent attention shapes (DeepSeek); None: grouped-query attention of ``heads`` x ``head_dim``."""
    attention_sinks: bool = False
    """Each attention head has one learned sink logit (GPT-OSS ``sinks``, ``heads`` values per layer)."""
    linear_bias: bool = False
    """The attention output projection, the router and every expert's projections carry biases (GPT-OSS: ``h`` for
    o_proj, ``E`` for the router, ``2 f_e + h`` per expert)."""
    vision: VisionSpec | None = None
    """The vision tower of a vision-language model (on the first pipeline stage); None: text only."""

    def __post_init__(self):
        for f in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model spec {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"model spec {self.name!r}: hidden ({self.hidden}) is not divisible by heads ({self.heads}); "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.head_dim < 0:
            raise ValueError(f"model spec {self.name!r}: head_dim must be positive, got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model spec {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.experts:
            if not 1 <= self.top_k <= self.experts or self.expert_ffn <= 0:
                raise ValueError(
                    f"model spec {self.name!r}: an MoE spec needs 1 <= top_k <= experts and expert_ffn > 0 (got "
                    f"top_k={self.top_k}, experts={self.experts}, expert_ffn={self.expert_ffn})"
                )
            if not self.moe_layers:
                object.__setattr__(self, "moe_layers", (True,) * self.layers)
            if len(self.moe_layers) != self.layers:
                raise ValueError(f"model spec {self.name!r}: moe_layers has {len(self.moe_layers)} entries, not L")

    @property
    def is_moe(self) -> bool:
        """Some layer's MLP is a mixture of experts."""
        return any(self.moe_layers)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def q_dim(self) -> int:
        """Width of all query heads, a * d (not always hidden: 4096 vs 2560 for Qwen3-4B)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads, kv_heads * d."""
        return self.kv_heads * self.head_dim

    def layer_params(self) -> dict[str, int]:
        """Parameters of ONE transformer layer, split into TP-sharded matrices/biases and replicated norms.

        Multi-latent attention: ``qkv_w`` holds the TP-split up projections (``q_b_proj`` or ``q_proj`` [a (n + r),
        ...] and ``kv_b_proj`` [a (n + v), c_kv]), ``out_w`` the output projection [h, a v]; ``attn_rep`` the down
        projections (``q_a_proj`` [c_q, h], ``kv_a_proj_with_mqa`` [c_kv + r, h]) and the two latent norms, whole
        on every TP rank (n, r, v: the nope, rope and value head widths; c_q, c_kv: the q and kv LoRA ranks)."""
        h, f = self.hidden, self.ffn
        mlp_w = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        # GPT-OSS's small vectors counted with the norms: the o_proj bias (replicated over TP like them) and the
        # sinks (split over TP by heads: a few hundred values, not worth a key of their own)
        norms += (h if self.linear_bias else 0) + (self.heads if self.attention_sinks else 0)
        m = self.mla
        if m is not None:
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q_up = (m.q_lora_rank or h) * self.heads * qk
            kv_up = m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim)
            down = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            down += (h + 1) * m.q_lora_rank if m.q_lora_rank else 0
            out_w = self.heads * m.v_head_dim * h
            return {"qkv_w": q_up + kv_up, "qkv_b": 0, "out_w": out_w, "mlp_w": mlp_w, "norms": norms, "attn_rep": down}
        qkv_w = h * (self.q_dim + 2 * self.kv_dim)
        qkv_b = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        out_w = self.q_dim * h
        return {"qkv_w": qkv_w, "qkv_b": qkv_b, "out_w": out_w, "mlp_w": mlp_w, "norms": norms, "attn_rep": 0}

    def attn_activation_width(self) -> int:
        """Elements per token one layer's attention saves for backward and splits over TP: q, k, v and the attention
        output (GQA: q_dim + 2 kv_dim + q_dim; MLA: each head's q and k of width n + r, v and output of width v)."""
        m = self.mla
        if m is None:
            return 2 * self.q_dim + 2 * self.kv_dim
        return self.heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * m.v_head_dim)

    def kv_cache_elems_per_token(self, rollout_tp: int) -> int:
        """KV-cache elements per token of one engine GPU over all layers: K and V of max(1, kv_heads / rollout_tp)
        heads; multi-latent attention caches the compressed latent and the shared RoPE key instead (c_kv + r per
        layer, on every rank), as vLLM and transformers do."""
        if self.mla is not None:
            return self.layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return 2 * self.layers * max(1, self.kv_heads // rollout_tp) * self.head_dim

    def moe_layer_params(self) -> dict[str, int]:
        """Parameters of the MLP of ONE MoE layer (zeros for a dense model): the router [E, h] (replicated over TP),
        the routed experts (3 h f_e each: gate, up, down; split over EP x expert TP) and the shared expert with its
        [1, h] gate where it has one (split over TP like a dense MLP); the router's score-correction bias counts
        with the router."""
        if not self.experts:
            return {"router": 0, "experts": 0, "shared": 0}
        h = self.hidden
        shared = 3 * h * self.shared_expert_ffn + (h if self.shared_expert_gate else 0) if self.shared_expert_ffn else 0
        biases = (self.experts if self.router_bias else 0) + (self.experts if self.linear_bias else 0)
        router = h * self.experts + biases
        return {"router": router, "experts": self.experts * self.expert_params(), "shared": shared}

    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down of ``h x f_e`` (+ GPT-OSS's biases, ``2 f_e + h``)."""
        h, f = self.hidden, self.expert_ffn
        return 3 * h * f + ((2 * f + h) if self.linear_bias else 0)

    def param_count(self) -> int:
        """Total parameters of the HF checkpoint (unpadded vocab), embeddings + L layers + final norm + LM head (+ the
        vision tower). An MoE layer has the dense layer's attention and norms and the MoE MLP instead of the dense
        one."""
        emb = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else emb
        lp = self.layer_params()
        moe_mlp = sum(self.moe_layer_params().values())
        dense_layer = sum(lp.values())
        moe_layer = dense_layer - lp["mlp_w"] + moe_mlp
        n_moe = self.n_moe_layers
        tower = self.vision.param_count() if self.vision is not None else 0
        return emb + (self.layers - n_moe) * dense_layer + n_moe * moe_layer + self.hidden + head + tower

    def active_param_count(self) -> int:
        """Parameters one token passes through: ``param_count`` with only ``top_k`` routed experts per MoE layer
        (the figure in an MoE model's name, e.g. 3.3 B of Qwen3-30B-A3B)."""
        if not self.is_moe:
            return self.param_count()
        idle = (self.experts - self.top_k) * self.expert_params()
        return self.param_count() - self.n_moe_layers * idle

    def padded_vocab(self, tp: int, divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY) -> int:
        """Megatron pads V up to a multiple of divisible_by * TP so every TP rank holds an equal, aligned shard."""
        return padded_vocab(self.vocab, tp, divisible_by)


def _spec(**kw) -> ModelSpec:
    return ModelSpec(**kw)


# Values from the official HF config.json of each model (Qwen/..., meta-llama/... on huggingface.co).
# Qwen2 attention always has q/k/v biases (modeling_qwen2 builds them with bias=True); Llama and Qwen3 follow
# "attention_bias": false. Qwen3 adds q_norm/k_norm (RMSNorm of size head_dim) in every layer.
BUILTIN_SPECS: dict[str, ModelSpec] = {
    # Qwen/Qwen2.5-1.5B: hidden_size 1536, intermediate_size 8960, num_hidden_layers 28, num_attention_heads 12,
    # num_key_value_heads 2, vocab_size 151936, tie_word_embeddings true.
    "qwen2.5-1.5b": _spec(
        name="Qwen2.5-1.5B",
        hidden=1536,
        ffn=8960,
        layers=28,
        heads=12,
        kv_heads=2,
        vocab=151936,
        qkv_bias=True,
        tied_embeddings=True,
    ),
    # Qwen/Qwen2.5-7B: hidden_size 3584, intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
    # num_key_value_heads 4, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-7b": _spec(
        name="Qwen2.5-7B", hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4, vocab=152064, qkv_bias=True
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct: text as Qwen2.5-7B (hidden_size 3584, intermediate_size 18944, num_hidden_layers
    # 28, num_attention_heads 28, num_key_value_heads 4, vocab_size 152064, untied; mrope_section [16, 24, 24]);
    # vision_config depth 32, hidden_size 1280, intermediate_size 3420, num_heads 16, out_hidden_size 3584,
    # patch_size 14, temporal_patch_size 2, spatial_merge_size 2 (window_size 112, fullatt_block_indexes
    # [7, 15, 23, 31]: attention windows do not change the parameter or activation count).
    "qwen2.5-vl-7b": _spec(
        name="Qwen2.5-VL-7B",
        hidden=3584,
        ffn=18944,
        layers=28,
        heads=28,
        kv_heads=4,
        vocab=152064,
        qkv_bias=True,
        vision=VisionSpec(kind="qwen2_5_vl", depth=32, hidden=1280, ffn=3420, heads=16, out_hidden=3584),
    ),
    # Qwen/Qwen2.5-14B: hidden_size 5120, intermediate_size 13824, num_hidden_layers 48, num_attention_heads 40,
    # num_key_value_heads 8, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-14b": _spec(
        name="Qwen2.5-14B", hidden=5120, ffn=13824, layers=48, heads=40, kv_heads=8, vocab=152064, qkv_bias=True
    ),
    # Qwen/Qwen2.5-32B: hidden_size 5120, intermediate_size 27648, num_hidden_layers 64, num_attention_heads 40,
    # num_key_value_heads 8, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-32b": _spec(
        name="Qwen2.5-32B", hidden=5120, ffn=27648, layers=64, heads=40, kv_heads=8, vocab=152064, qkv_bias=True
    ),
    # meta-llama/Llama-3.1-8B: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, vocab_size 128256, attention_bias false, tie false.
    "llama-3.1-8b": _spec(name="Llama-3.1-8B", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    # meta-llama/Llama-3.1-70B: hidden_size 8192, intermediate_size 28672, num_hidden_layers 80,
    # num_attention_heads 64, num_key_value_heads 8, vocab_size 128256, attention_bias false, tie false.
    "llama-3.1-70b": _spec(name="Llama-3.1-70B", hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    # Qwen/Qwen3-4B-Base: hidden_size 2560, intermediate_size 9728, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, attention_bias false, tie_word_embeddings true.
    "qwen3-4b": _spec(
        name="Qwen3-4B",
        hidden=2560,
        ffn=9728,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
        tied_embeddings=True,
    ),
    # Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, attention_bias false, tie_word_embeddings false.
    "qwen3-8b": _spec(
        name="Qwen3-8B",
        hidden=4096,
        ffn=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    ),
    # Qwen/Qwen3-32B: hidden_size 5120, intermediate_size 25600, num_hidden_layers 64, num_attention_heads 64,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, attention_bias false, tie_word_embeddings false,
    # max_position_embeddings 40960 (longer contexts with YaRN rope scaling, Qwen's model card).
    "qwen3-32b": _spec(
        name="Qwen3-32B",
        hidden=5120,
        ffn=25600,
        layers=64,
        heads=64,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    ),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, intermediate_size 6144 (unused: no dense layer),
    # num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 768, decoder_sparse_step 1, mlp_only_layers [], norm_topk_prob
    # true, vocab_size 151936, tie_word_embeddings false. 30.53 B parameters, 3.35 B active.
    "qwen3-30b-a3b": _spec(
        name="Qwen3-30B-A3B",
        hidden=2048,
        ffn=6144,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
        experts=128,
        top_k=8,
        expert_ffn=768,
    ),
    # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, intermediate_size 12288 (unused), num_hidden_layers 94,
    # num_attention_heads 64, num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size 1536, decoder_sparse_step 1, mlp_only_layers [], norm_topk_prob true, vocab_size 151936,
    # tie_word_embeddings false. 235.1 B parameters, 22.1 B active.
    "qwen3-235b-a22b": _spec(
        name="Qwen3-235B-A22B",
        hidden=4096,
        ffn=12288,
        layers=94,
        heads=64,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
        experts=128,
        top_k=8,
        expert_ffn=1536,
    ),
    # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, intermediate_size 18432 (the first_k_dense_replace 3
    # dense layers), num_hidden_layers 61, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 256, num_experts_per_tok 8,
    # moe_intermediate_size 2048, n_shared_experts 1, moe_layer_freq 1, n_group 8, topk_group 4, vocab_size 129280,
    # tie_word_embeddings false (its multi-token-prediction layer, 14 B more in the checkpoint, is not counted).
    # 671.0 B parameters, 37.6 B active (published: 671 B / 37 B).
    "deepseek-v3": _spec(
        name="DeepSeek-V3",
        hidden=7168,
        ffn=18432,
        layers=61,
        heads=128,
        kv_heads=128,
        vocab=129280,
        experts=256,
        top_k=8,
        expert_ffn=2048,
        moe_layers=(False,) * 3 + (True,) * 58,
        shared_expert_ffn=2048,
        shared_expert_gate=False,
        router_bias=True,
        mla=MlaFields(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    ),
    # moonshotai/Moonlight-16B-A3B config.json (DeepseekV3ForCausalLM): hidden_size 2048, intermediate_size 11264,
    # num_hidden_layers 27, first_k_dense_replace 1, num_attention_heads 16, q_lora_rank null, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 64, num_experts_per_tok 6,
    # moe_intermediate_size 1408, n_shared_experts 2, n_group 1, topk_group 1, vocab_size 163840, untied.
    # 15.96 B parameters, 2.91 B active; without the two embedding matrices 15.29 B / 2.24 B, the paper's figures
    # (arXiv:2502.16982; marketed as 16 B / 3 B).
    "moonlight-16b-a3b": _spec(
        name="Moonlight-16B-A3B",
        hidden=2048,
        ffn=11264,
        layers=27,
        heads=16,
        kv_heads=16,
        vocab=163840,
        experts=64,
        top_k=6,
        expert_ffn=1408,
        moe_layers=(False,) + (True,) * 26,
        shared_expert_ffn=2816,
        shared_expert_gate=False,
        router_bias=True,
        mla=MlaFields(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    ),
    # zai-org/GLM-4.5-Air config.json (Glm4MoeForCausalLM): hidden_size 4096, intermediate_size 10944 (the
    # first_k_dense_replace 1 dense layer), num_hidden_layers 46, num_attention_heads 96, num_key_value_heads 8,
    # head_dim 128, attention_bias true, use_qk_norm false, partial_rotary_factor 0.5, n_routed_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 1408, n_shared_experts 1, n_group 1, topk_group 1,
    # routed_scaling_factor 1.0, vocab_size 151552, untied; num_nextn_predict_layers 1 (its multi-token-prediction
    # layer is in the checkpoint but not counted here: the policy is the causal LM).
    # 106.85 B parameters, 13.42 B active; without the two embedding matrices 12.18 B active (published: 106 B / 12 B;
    # the MTP layer would add 2.38 B).
    "glm-4.5-air": _spec(
        name="GLM-4.5-Air",
        hidden=4096,
        ffn=10944,
        layers=46,
        heads=96,
        kv_heads=8,
        head_dim=128,
        vocab=151552,
        qkv_bias=True,
        experts=128,
        top_k=8,
        expert_ffn=1408,
        moe_layers=(False,) + (True,) * 45,
        shared_expert_ffn=1408,
        shared_expert_gate=False,
        router_bias=True,
    ),
    # zai-org/GLM-4.5 config.json (Glm4MoeForCausalLM): hidden_size 5120, intermediate_size 12288, num_hidden_layers
    # 92, first_k_dense_replace 3, num_attention_heads 96, num_key_value_heads 8, head_dim 128, attention_bias true,
    # use_qk_norm true, partial_rotary_factor 0.5, n_routed_experts 160, num_experts_per_tok 8, moe_intermediate_size
    # 1536, n_shared_experts 1, n_group 1, topk_group 1, routed_scaling_factor 2.5, vocab_size 151552, untied;
    # num_nextn_predict_layers 1 (not counted, as above).
    # 352.80 B parameters, 33.63 B active; without the two embedding matrices 32.08 B active (published: 355 B / 32 B;
    # the MTP layer would add 3.99 B, 356.79 B in all).
    "glm-4.5": _spec(
        name="GLM-4.5",
        hidden=5120,
        ffn=12288,
        layers=92,
        heads=96,
        kv_heads=8,
        head_dim=128,
        vocab=151552,
        qkv_bias=True,
        qk_norm=True,
        experts=160,
        top_k=8,
        expert_ffn=1536,
        moe_layers=(False,) * 3 + (True,) * 89,
        shared_expert_ffn=1536,
        shared_expert_gate=False,
        router_bias=True,
    ),
    # openai/gpt-oss-20b config.json (GptOssForCausalLM): hidden_size 2880, intermediate_size 2880 (each expert),
    # num_hidden_layers 24, num_attention_heads 64, num_key_value_heads 8, head_dim 64, num_local_experts 32,
    # num_experts_per_tok 4, vocab_size 201088, sliding_window 128 (even layers), attention_bias true,
    # tie_word_embeddings false; sinks, q/k/v/o, router and expert biases. 20.91 B parameters, 4.19 B active; the
    # model card's 3.61 B active leaves out the input embedding (a lookup, not a matmul).
    "gpt-oss-20b": _spec(
        name="gpt-oss-20b",
        hidden=2880,
        ffn=2880,
        layers=24,
        heads=64,
        kv_heads=8,
        head_dim=64,
        vocab=201088,
        qkv_bias=True,
        experts=32,
        top_k=4,
        expert_ffn=2880,
        attention_sinks=True,
        linear_bias=True,
    ),
    # openai/gpt-oss-120b config.json: as gpt-oss-20b with num_hidden_layers 36 and num_local_experts 128.
    # 116.83 B parameters, 5.71 B active; the model card's 5.13 B active leaves out the input embedding.
    "gpt-oss-120b": _spec(
        name="gpt-oss-120b",
        hidden=2880,
        ffn=2880,
        layers=36,
        heads=64,
        kv_heads=8,
        head_dim=64,
        vocab=201088,
        qkv_bias=True,
        experts=128,
        top_k=4,
        expert_ffn=2880,
        attention_sinks=True,
        linear_bias=True,
    ),
}


def _spec_key(name: str) -> str:
    key = name.strip().lower().split("/")[-1]
    for suffix in ("-instruct", "-base"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    return key.replace("meta-llama-", "llama-")


def get_model_spec(name: str) -> ModelSpec:
    """Built-in spec by name; accepts HF ids and -Instruct variants (same architecture)."""
    key = _spec_key(name)
    if key not in BUILTIN_SPECS:
        raise ValueError(f"unknown model {name!r}; built-in specs: {', '.join(sorted(BUILTIN_SPECS))}")
    return BUILTIN_SPECS[key]


def model_spec_from_hf_config(source: str | Path | dict, name: str | None = None) -> ModelSpec:
    """ModelSpec from an HF config.json (path, folder holding one, or the parsed dict)."""
    where = "config dict"
    if not isinstance(source, dict):
        p = Path(source)
        if p.is_dir():
            p = p / "config.json"
        where = str(p)
        try:
            source = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"HF config not found: {p}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from None
    cfg = source
    vision = None
    vl = vl_family_of(cfg)
    if vl is not None:  # a vision-language model: its language model's config plus the tower
        text = vl_text_config(cfg, where)  # raises without text_config / vision_config
        vision = vision_spec_from_hf_config(cfg["vision_config"], vl[1].kind)
        name = name or cfg.get("_name_or_path") or None
        cfg = text
    _, fam = family_of(cfg, where)
    mtype = fam.model_type
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r}; only SwiGLU (silu) MLPs are supported")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    moe = moe_fields(cfg, fam, where)
    mla = mla_fields(cfg, fam, where)
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or Path(where).parent.name or mtype,
        hidden=cfg["hidden_size"],
        ffn=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
        vocab=cfg["vocab_size"],
        head_dim=0 if mla else cfg.get("head_dim") or 0,
        # transformers' Llama/Qwen2/Qwen3/Mistral config classes default tie_word_embeddings to False.
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=has_qkv_bias(cfg, fam),
        qk_norm=has_qk_norm(cfg, fam),
        experts=moe.experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        expert_ffn=moe.expert_ffn if moe else 0,
        moe_layers=moe.moe_layers if moe else (),
        shared_expert_ffn=moe.shared_expert_ffn if moe else 0,
        shared_expert_gate=moe.shared_expert_gate if moe else True,
        router_bias=moe.expert_bias if moe else False,
        mla=mla,
        attention_sinks=fam.gpt_oss,
        linear_bias=moe.linear_bias if moe else False,
        vision=vision,
    )
