"""Hugging Face config -> megatron-core ``TransformerConfig`` + ``GPTModel`` arguments, per model family.

Supported families live in one registry (``FAMILIES``): Llama (incl. Llama-3 rope scaling), Qwen2/2.5 (QKV bias), Qwen3
(per-head q/k RMSNorm), the mixture-of-experts Qwen3-MoE and Qwen2-MoE (shared expert with a sigmoid gate), and
DeepSeek-V3 (multi-latent attention with YaRN, sigmoid routing with the aux-loss-free expert bias, group-limited top-k,
ungated shared experts, dense first layers; V2 with its softmax router), GLM-4.5 (DeepSeek-V3's MoE with
grouped-query attention: q/k/v biases, optional qk-norm, RoPE on part of each head) and GPT-OSS (attention sinks,
per-layer sliding windows, linear biases, the clamped SwiGLU, YaRN; ``gpt_oss_settings``). Anything else, or any config
feature these models do not implement exactly (sliding window, attention/MLP biases on Llama, partial rotary outside
GLM-4.5, non-SiLU activations, unsupported rope types), is a ValueError naming the field, so a model never silently
computes something different from its HF reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rlvr.families.table import (
    FAMILIES,
    VL_FAMILIES,
    GptOssFields,
    MlaFields,
    gpt_oss_fields,
    has_qk_norm,
    has_qkv_bias,
    mla_fields,
    moe_fields,
    padded_vocab,
    rotary_fraction,
    vl_text_config,
)
from megatron_rlvr.models.fusions import detect as detect_fusions
from megatron_rlvr.models.fusions import fusion_flags
from megatron_rlvr.models.mapping import ModelDims
from megatron_rlvr.models.vision import vision_param_names, vision_spec


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings in megatron's vocabulary."""

    theta: float
    """Base period (HF rope_theta)."""
    kind: str = "default"
    """'default', 'linear' (position interpolation), 'llama3', or 'yarn' (multi-latent attention: its settings are
    in the MLA config, see ``mla_settings``; GPT-OSS and the dense families: megatron's ``YarnRotaryEmbedding``, see
    ``yarn_attributes``)."""
    factor: float = 1.0
    """Scaling factor for 'linear' / 'llama3' / 'yarn'."""
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 only: context length of the unscaled model."""
    percent: float = 1.0
    """Share of each head's dims that RoPE rotates (HF ``partial_rotary_factor``, megatron's ``rotary_percent``):
    the first ``percent * head_dim`` dims in the rotate-half layout, the rest pass through (GLM-4.5: 0.5)."""
    beta_fast: float = 32.0
    """yarn (not MLA) only: rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn (not MLA) only: rotations below which a frequency is divided by ``factor`` (interpolated)."""
    truncate: bool = True
    """yarn (not MLA) only: the correction range is rounded to whole dims (HF ``truncate``; GPT-OSS: false)."""
    mscale: float | None = None
    """yarn (not MLA) only: with ``mscale_all_dim``, the attention factor is get_mscale(f, mscale) /
    get_mscale(f, mscale_all_dim); None: 0.1 ln(factor) + 1 (transformers' rule)."""
    mscale_all_dim: float | None = None
    """yarn (not MLA) only: see ``mscale``."""


@dataclass
class MegatronModelArgs:
    """Everything needed to build the megatron GPTModel for one HF model at one parallel layout."""

    config: Any
    """megatron.core.transformer.TransformerConfig."""
    dims: ModelDims
    """Shapes for the weight mapping."""
    architecture: str
    """HF architectures[0]."""
    rope: RopeSpec
    """Rotary embedding settings."""
    max_sequence_length: int
    """HF max_position_embeddings."""
    hf_config: dict = field(repr=False, default_factory=dict)
    """The HF config as a dict (written back verbatim on export)."""
    vision: Any = None
    """models.vision.VisionSpec of a vision-language model (the language model is then ``text_config``'s); None:
    a text-only model."""

    @property
    def padded_vocab_size(self) -> int:
        return self.dims.padded_vocab_size

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.dims.tie_word_embeddings


def load_hf_config(source) -> dict:
    """HF config as a plain dict from a model folder, a config.json path, a ``PretrainedConfig`` or a dict."""
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"HF config not found: {path}")
    with open(path) as f:
        return json.load(f)


def _get(cfg: dict, name: str, default=None):
    return cfg[name] if cfg.get(name) is not None else default


def _rope_params(cfg: dict) -> tuple[dict, float, str]:
    """(rope parameters, theta, rope type) of an HF config: transformers >= 5 stores everything in rope_parameters;
    older config.json files use rope_theta + rope_scaling (``type`` for ``rope_type``)."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return params, float(theta), kind


def _rope_spec(cfg: dict) -> RopeSpec:
    params, theta, kind = _rope_params(cfg)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("HF config: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return RopeSpec(theta=float(theta))
    if kind == "linear":
        return RopeSpec(theta=float(theta), kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeSpec(
            theta=float(theta),
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn":
        return dense_yarn_spec(cfg, params, theta)
    raise ValueError(f"HF config: rope type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def dense_yarn_spec(cfg: dict, params: dict, theta: float) -> RopeSpec:
    """YaRN (Peng et al. 2023, arXiv:2309.00071) of a dense Llama / Qwen2 / Qwen3 config, in megatron's
    ``YarnRotaryEmbedding`` terms (``yarn_attributes``; GPTModel's ``position_embedding_type="yarn"``).

    Per frequency, a ramp between the original (extrapolated) and the ``factor``-divided (interpolated) inverse
    frequency over the dims whose wavelength fits between ``beta_fast`` and ``beta_slow`` rotations of the original
    context; cos / sin times the attention factor 0.1 ln(factor) + 1, or mscale's ratio when both ``mscale`` and
    ``mscale_all_dim`` are set: transformers' ``_compute_yarn_parameters`` for every setting accepted here. Refused
    by name: an explicit ``attention_factor`` (megatron derives it) and a missing original context length."""
    if params.get("attention_factor") is not None:
        raise ValueError(
            "HF config: rope_scaling.attention_factor is not supported with yarn (megatron derives it from factor)"
        )
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("HF config: yarn rope scaling needs rope_scaling.original_max_position_embeddings")
    factor = params.get("factor") or cfg["max_position_embeddings"] / orig
    if float(factor) < 1.0:
        raise ValueError(f"HF config: yarn rope_scaling.factor={factor} must be >= 1")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # transformers uses the pair only when both are set and non-zero
    return RopeSpec(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale=float(mscale) if both else None,
        mscale_all_dim=float(mscale_all_dim) if both else None,
    )


def mla_settings(cfg: dict, mla: MlaFields) -> tuple[dict[str, Any], RopeSpec]:
    """megatron ``MLATransformerConfig`` fields of a multi-latent-attention config, and its RopeSpec.

    Names: megatron's ``qk_head_dim`` is transformers' ``qk_nope_head_dim`` and ``qk_pos_emb_head_dim`` its
    ``qk_rope_head_dim``. ``qk_layernorm`` builds the q / kv latent RMSNorms (``q_a_layernorm`` /
    ``kv_a_layernorm``). RoPE: ``default`` or ``yarn``; YaRN's attention factor (on cos / sin) and the softmax scale
    ``mscale(factor, mscale_all_dim)^2 / sqrt(nope + rope)`` are transformers' (``_compute_yarn_parameters``,
    ``yarn_apply_mscale``) for the settings accepted here; the others are refused by name.
    """
    params, theta, kind = _rope_params(cfg)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("HF config: partial_rotary_factor != 1 is not supported")
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.v_head_dim,
        qk_layernorm=True,
        rotary_base=theta,
        apply_rope_fusion=False,  # megatron's fused MLA RoPE is a CUDA kernel for YaRN only
    )
    if kind == "default":
        out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        return out, RopeSpec(theta=theta)
    if kind != "yarn":
        raise ValueError(f"HF config: rope type {kind!r} is not supported with multi-latent attention (default, yarn)")
    if params.get("attention_factor") is not None:
        raise ValueError("HF config: rope_parameters.attention_factor is not supported (it is derived from mscale)")
    if params.get("truncate", True) is not True:
        raise ValueError("HF config: rope_parameters.truncate=false is not supported with multi-latent attention")
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("HF config: yarn rope scaling needs original_max_position_embeddings")
    factor = params.get("factor") or cfg["max_position_embeddings"] / orig
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        # transformers then uses the attention factor 0.1 ln(factor) + 1 (megatron: mscale=1 over mscale_all_dim=0)
        # and scales the softmax by mscale_all_dim only when it is set
        if mscale_all_dim:
            raise ValueError("HF config: yarn with mscale_all_dim but no mscale is not supported")
        mscale, mscale_all_dim = 1.0, 0.0
    out.update(
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
    )
    return out, RopeSpec(theta=theta, kind="yarn", factor=float(factor), original_max_position_embeddings=int(orig))


def megatron_model_args(
    hf_config,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 128,
    padded_vocab_size: int | None = None,
    sequence_parallel: bool = False,
    perform_initialization: bool = True,
    fusions: bool | None = None,
    ep_size: int = 1,
    etp_size: int | None = None,
    moe_dispatcher: str | None = None,
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: float = 0.0,
    moe_expert_bias_update_rate: float = 0.0,
    cp_size: int = 1,
    cp_comm_type: str = "p2p",
    **config_overrides,
) -> MegatronModelArgs:
    """Translate an HF causal-LM config into megatron's TransformerConfig and GPTModel arguments.

    ``padded_vocab_size`` overrides the padding rule (checkpoints keep the padded size they were saved with, so a
    reload at another TP uses the saved value; it must then be divisible by ``tp_size``).
    ``fusions``: megatron's kernel fusions; None: those the installed stack supports on this device (all off on
    CPU), False: all off (the reference an unfused GPU step is checked against).
    ``config_overrides`` go straight into TransformerConfig (e.g. ``recompute_granularity``).

    Mixture-of-experts families (``moe_settings`` for the full list of megatron fields): ``ep_size`` experts are
    split over the expert-parallel group, each expert's inner width over ``etp_size`` (None: megatron's default,
    ``tp_size``); ``moe_dispatcher`` is the token dispatcher (``alltoall``, ``allgather``; None: alltoall);
    ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` turn on the router's load-balancing and z-loss terms (0: off, the
    RL default). With TP > 1 megatron trains MoE layers only under sequence parallelism, so it is switched on.
    ``moe_expert_bias_update_rate``: for routers with an expert bias (DeepSeek-V3), the step of megatron's
    aux-loss-free bias update after each optimizer step (0: the checkpoint's bias stays as it is).

    Multi-latent attention families (DeepSeek-V3) get an ``MLATransformerConfig`` (``mla_settings``).

    ``cp_size``: context parallelism (sequences split over ``cp_size`` ranks); ``cp_comm_type``: how Transformer
    Engine's attention exchanges keys and values then (``p2p``, ``a2a``, ``all_gather``). Dense text models only.
    """
    cfg = load_hf_config(hf_config)
    full_cfg = cfg
    vision = vision_spec(cfg)
    if vision is not None:  # the language model is a text family's; M-RoPE and the tower come on top
        cfg = vl_text_config(cfg)
        config_overrides = {"mrope_section": list(vision.mrope_section), "apply_rope_fusion": False, **config_overrides}
    arch, fam = _text_family(cfg)
    cfg, rotary_percent = _partial_rotary(cfg, fam)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")

    moe = moe_fields(cfg, fam)
    mla = mla_fields(cfg, fam)
    if cp_size > 1 and (vision is not None or moe is not None or mla is not None):
        kind = "vision-language" if vision is not None else "mixture-of-experts" if moe is not None else "MLA"
        raise ValueError(f"context parallelism (parallel.cp={cp_size}) supports dense text models, not {kind} models")
    if cp_size > 1:
        config_overrides = {"context_parallel_size": cp_size, "cp_comm_type": cp_comm_type, **config_overrides}
    dims = _model_dims(cfg, fam, moe, mla, vision, tp_size, pp_size, vocab_multiple, padded_vocab_size)
    dims.check_tp(tp_size)
    if etp_size is None and fam.gpt_oss:
        etp_size = 1  # megatron biases MoE experts only at expert TP 1
    elif fam.gpt_oss and etp_size != 1:
        raise ValueError(
            f"expert tensor parallel size {etp_size}: GPT-OSS's expert biases need expert TP 1 (set parallel.etp=1)"
        )
    etp_size = tp_size if etp_size is None else etp_size
    dims.check_ep(ep_size, etp_size if dims.is_moe else 1)
    moe_kwargs = {}
    if dims.is_moe:
        # MLA layers are built from megatron's local spec (models/build.py), whose experts are SequentialMLP
        grouped = fusions is not False and detect_fusions().grouped_gemm and mla is None and not fam.gpt_oss
        moe_kwargs = moe_settings(
            moe, ep_size=ep_size, etp_size=etp_size, dispatcher=moe_dispatcher, aux_loss_coeff=moe_aux_loss_coeff,
            z_loss_coeff=moe_z_loss_coeff, grouped_gemm=grouped, expert_bias_update_rate=moe_expert_bias_update_rate,
        )  # fmt: skip
    # MoE layers train at TP > 1 only under sequence parallelism; MLA's whole down projections' gradients likewise
    sequence_parallel = sequence_parallel or (tp_size > 1 and (dims.is_moe or mla is not None))
    if fam.gpt_oss:  # sinks, sliding windows, biases, the clamped SwiGLU and YaRN
        from megatron.core.transformer import TransformerConfig

        fused = fusion_flags(fusions)["bias_activation_fusion"]
        config_cls = TransformerConfig
        mla_kwargs, rope = gpt_oss_settings(cfg, gpt_oss_fields(cfg), fused=fused)
    else:
        config_cls, mla_kwargs, rope = _attention_settings(cfg, mla)
    if rotary_percent != 1.0:
        if rope.kind != "default":
            raise ValueError(f"HF config: partial_rotary_factor with rope type {rope.kind!r} is not supported")
        rope = dataclasses.replace(rope, percent=rotary_percent)
    if yarn_attributes(rope, mla=mla is not None):
        # TE's fused RoPE drops YaRN's attention factor on packed (THD) inputs (megatron-core's
        # rope_utils.apply_rotary_pos_emb passes no mscale to fused_apply_rotary_pos_emb_thd): the unfused one has it
        config_overrides = {"apply_rope_fusion": False, **config_overrides}
    kwargs = _transformer_kwargs(cfg, dims, fusions, tp_size, pp_size, dtype, sequence_parallel, perform_initialization)
    config = config_cls(**{**kwargs, **moe_kwargs, **mla_kwargs, **config_overrides})
    for name, value in yarn_attributes(rope, mla=mla is not None).items():
        setattr(config, name, value)
    return MegatronModelArgs(
        config=config,
        dims=dims,
        architecture=(full_cfg.get("architectures") or [arch])[0],
        rope=rope,
        max_sequence_length=int(_get(cfg, "max_position_embeddings", 4096)),
        hf_config=full_cfg,
        vision=vision,
    )


GPT_OSS_DEFAULT_THETA = 150000.0
"""RoPE base of a GPT-OSS config that names none (transformers' ``GptOssConfig.default_theta``; 10000 elsewhere)."""


def quick_gelu_eager(y: torch.Tensor) -> torch.Tensor:
    """megatron's ``quick_gelu``, ``y * sigmoid(1.702 y)``, without the ``torch.compile`` megatron wraps it in: on CPU
    (no fusions) the compiled function recompiles for every new token count an expert receives."""
    return y * torch.sigmoid(1.702 * y)


def gpt_oss_settings(cfg: dict, oss: GptOssFields, fused: bool = False) -> tuple[dict[str, Any], RopeSpec]:
    """megatron TransformerConfig fields of a GPT-OSS config and its RopeSpec (transformers' modeling_gpt_oss).

    - Sinks: ``softmax_type="learnable"``, one learned logit per head in ``core_attention.softmax_offset`` joining
      each row's softmax and dropped from its output (transformers' ``sinks``), split over TP by heads.
    - Sliding window: transformers' ``sliding_window=w`` lets a query see itself and the ``w - 1`` keys before it,
      megatron's ``window_size=(w - 1, 0)``; ``window_attn_skip_freq`` as a per-layer list (1: sliding).
    - Experts: ``quick_gelu`` (``y * sigmoid(1.702 y)``, ``swiglu_alpha`` is refused otherwise; megatron's own
      function where ``fused`` bias-activation kernels run, which recognise it by identity) on the gate,
      times ``up + 1`` (``glu_linear_offset``), both clamped by ``activation_func_clamp_value`` as transformers clamps
      them (gate above, up both sides).
    - Biases: ``add_bias_linear`` (q/k/v/o, router, expert fc1/fc2).
    - RoPE: YaRN (or plain); its settings are not TransformerConfig fields but attributes megatron reads with
      ``getattr`` (``yarn_attributes``), ``truncate=false`` is ``yarn_correction_range_round_to_int=False``.
    - Quantisation: an MXFP4 checkpoint's experts are dequantised on load (models/mxfp4.py); other methods refused.
    """
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(
            f"HF config: quantization_config.quant_method={quant.get('quant_method')!r} is not supported for "
            "gpt_oss (mxfp4 checkpoints are dequantised on load)"
        )
    out: dict[str, Any] = dict(
        softmax_type="learnable",
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=True,
        activation_func=quick_gelu if fused else quick_gelu_eager,
        glu_linear_offset=1.0,
        activation_func_clamp_value=oss.swiglu_limit,
    )
    if any(oss.sliding_layers):
        out.update(window_size=(oss.sliding_window - 1, 0), window_attn_skip_freq=[int(s) for s in oss.sliding_layers])
    params, theta, kind = _rope_params(cfg)
    if params.get("rope_theta", cfg.get("rope_theta")) is None:
        theta = GPT_OSS_DEFAULT_THETA
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("HF config: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return out, RopeSpec(theta=theta)
    if kind != "yarn":
        raise ValueError(f"HF config: rope type {kind!r} is not supported for gpt_oss (default, yarn)")
    if params.get("attention_factor") is not None:
        raise ValueError(
            "HF config: rope_parameters.attention_factor is not supported (megatron derives it from factor)"
        )
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("HF config: yarn rope scaling needs original_max_position_embeddings")
    factor = params.get("factor") or cfg["max_position_embeddings"] / orig
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # transformers uses the pair only when both are set and non-zero
    return out, RopeSpec(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale=float(mscale) if both else None,
        mscale_all_dim=float(mscale_all_dim) if both else None,
    )


def yarn_attributes(rope: RopeSpec, mla: bool = False) -> dict[str, Any]:
    """The ``yarn_*`` attributes megatron's ``GPTModel(position_embedding_type="yarn")`` and ``Attention`` read from
    the config with ``getattr`` (empty unless a non-MLA YaRN model). They are not dataclass fields, so
    ``dataclasses.replace`` and field-wise serialisation drop them: ``models/build.py`` sets them again from the
    RopeSpec before it builds the model."""
    if rope.kind != "yarn" or mla:
        return {}
    return dict(
        yarn_rotary_scaling_factor=rope.factor,
        yarn_original_max_position_embeddings=rope.original_max_position_embeddings,
        yarn_beta_fast=rope.beta_fast,
        yarn_beta_slow=rope.beta_slow,
        yarn_mscale=rope.mscale,
        yarn_mscale_all_dim=rope.mscale_all_dim,
        yarn_correction_range_round_to_int=rope.truncate,
    )


def _attention_settings(cfg: dict, mla):
    """(the TransformerConfig class, its attention arguments, the RoPE spec): multi-latent attention families get an
    MLATransformerConfig with their latent ranks and YaRN (``mla_settings``), the others the plain one."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig  # megatron-core: only once building

    if mla is None:
        return TransformerConfig, {}, _rope_spec(cfg)
    mla_kwargs, rope = mla_settings(cfg, mla)
    return MLATransformerConfig, mla_kwargs, rope


def _partial_rotary(cfg: dict, fam) -> tuple[dict, float]:
    """(the config without its partial rotary factor, the factor) for a family whose RoPE may rotate part of each
    head (GLM-4.5: transformers' ``apply_rotary_pos_emb`` rotates the first ``factor * head_dim`` dims in the
    rotate-half layout, as megatron's ``rotary_percent`` does); other families keep the config as it is and
    ``_rope_spec`` refuses a partial factor."""
    if fam.partial_rotary is None:
        return cfg, 1.0
    factor = rotary_fraction(cfg, fam)
    out = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
    if isinstance(cfg.get("rope_parameters"), dict):
        out["rope_parameters"] = {k: v for k, v in cfg["rope_parameters"].items() if k != "partial_rotary_factor"}
    return out, factor


def _text_family(cfg: dict):
    """(architecture, its family row) of a text HF config, refusing what the megatron model cannot express (another
    architecture, biases, sliding-window attention, an activation other than SiLU)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in FAMILIES:
        raise ValueError(f"HF config: architectures={archs!r} is not supported; supported: {sorted(FAMILIES)}")
    fam = FAMILIES[arch]
    for name in fam.bias_fields:
        if cfg.get(name):
            raise ValueError(f"HF config: {arch} with {name}=True is not supported")
    if fam.sliding_window_field and cfg.get(fam.sliding_window_field):
        raise ValueError(f"HF config: {arch} with {fam.sliding_window_field}=True is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"HF config: hidden_act={act!r} is not supported (SwiGLU with silu only)")
    return arch, fam


def _model_dims(
    cfg: dict, fam, moe, mla, vision, tp_size: int, pp_size: int, vocab_multiple: int, padded_vocab_size: int | None
) -> ModelDims:
    """The model's shapes from a text HF config (``moe``: its MoE fields or None; ``mla``: its multi-latent
    attention fields or None; ``vision``: its VisionSpec or None); the layers must divide over ``pp_size`` stages,
    the vocabulary is padded for ``tp_size``."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    head_dim = int(_get(cfg, "head_dim", hidden // heads))
    if mla is not None:  # every head has its own keys and values (expanded from the shared latent)
        kv_heads, head_dim = heads, mla.v_head_dim
    layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    if pp_size <= 0 or layers % pp_size:
        raise ValueError(f"pipeline parallel size {pp_size} does not divide num_hidden_layers={layers}")
    if padded_vocab_size is None:
        padded_vocab_size = padded_vocab(vocab, tp_size, vocab_multiple)
    return ModelDims(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=vocab,
        padded_vocab_size=int(padded_vocab_size),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=has_qkv_bias(cfg, fam),
        qk_layernorm=has_qk_norm(cfg, fam),
        num_experts=moe.experts if moe else 0,
        moe_ffn_hidden_size=moe.expert_ffn if moe else 0,
        shared_expert_ffn=moe.shared_expert_ffn if moe else 0,
        moe_layers=moe.moe_layers if moe else (),
        shared_expert_gate=moe.shared_expert_gate if moe else True,
        expert_bias=moe.expert_bias if moe else False,
        gpt_oss=fam.gpt_oss,
        **(_mla_dims(mla) if mla is not None else {}),
        **(_vision_dims(vision, vision_param_names(vision)) if vision is not None else {}),
    )


def _transformer_kwargs(
    cfg: dict,
    dims: ModelDims,
    fusions: bool | None,
    tp_size: int,
    pp_size: int,
    dtype: torch.dtype,
    sequence_parallel: bool,
    perform_initialization: bool,
) -> dict[str, Any]:
    """TransformerConfig arguments of a dense text model from its HF config, shapes, layout and dtype (the MoE
    settings come on top)."""
    return dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(cfg, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_layernorm,
        # HF applies attention dropout only in training with attention_dropout > 0; RL policies train without it.
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        rotary_interleaved=False,  # HF rotate_half layout
        attention_softmax_in_fp32=True,
        # Fused kernels need CUDA (and TE / Apex for some): on exactly where detected, off on CPU (models/fusions.py).
        **fusion_flags(fusions),
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=perform_initialization,
    )


def _mla_dims(mla: MlaFields) -> dict[str, Any]:
    """ModelDims fields of a multi-latent-attention model."""
    return dict(
        mla=True,
        q_lora_rank=mla.q_lora_rank or 0,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
    )


def _vision_dims(vision, names: tuple[str, ...]) -> dict[str, Any]:
    """ModelDims fields of a vision-language model: where its tensors are in the checkpoint, the tower's names."""
    fam = VL_FAMILIES[next(a for a, f in VL_FAMILIES.items() if f.kind == vision.kind)]
    return dict(hf_lm_prefix=fam.lm_prefix, vision_prefix=fam.vision_prefix, vision_names=names)


MOE_DISPATCHERS = ("alltoall", "allgather")
"""Token dispatchers that run here (megatron's ``flex`` needs DeepEP / HybridEP, CUDA-only)."""


def moe_settings(
    moe,
    *,
    ep_size: int,
    etp_size: int,
    dispatcher: str | None = None,
    aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
    grouped_gemm: bool = False,
    expert_bias_update_rate: float = 0.0,
) -> dict[str, Any]:
    """megatron TransformerConfig fields of an MoE family (``moe``: ``families.table.MoeFields``).

    Router, exactly as transformers computes it: softmax over all experts in fp32, top-k, and with
    ``norm_topk_prob`` the k probabilities renormalised. Renormalised softmax-then-top-k equals megatron's top-k on
    the logits followed by a softmax over the k (``moe_router_pre_softmax=False``); without renormalisation it is
    megatron's ``moe_router_pre_softmax=True`` (softmax first, then top-k, no rescaling).
    Dense layers (``mlp_only_layers`` / ``decoder_sparse_step``) become megatron's per-layer ``moe_layer_freq`` list.

    DeepSeek-V3 (sigmoid scores): megatron's ``moe_router_score_function="sigmoid"`` with the expert bias added for
    the choice only (``moe_router_enable_expert_bias``), renormalised top-k weights (transformers'
    ``norm_topk_prob=True``, the only setting ``families.table`` accepts), ``moe_router_num_groups`` /
    ``moe_router_group_topk`` and ``moe_router_topk_scaling_factor`` (megatron applies it with sigmoid scores too,
    moe_utils.topk_routing_with_score_function); the shared experts have no gate.
    Load balancing: megatron's aux loss (``moe_aux_loss_coeff``) and z-loss are added to the GRADIENT only (an
    autograd hook scales them in backward); the loss the step returns does not include them.
    """
    dispatcher = dispatcher or "alltoall"
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"MoE token dispatcher must be one of {MOE_DISPATCHERS}, got {dispatcher!r}")
    for name, v in (
        ("moe_aux_loss_coeff", aux_loss_coeff),
        ("moe_z_loss_coeff", z_loss_coeff),
        ("moe_expert_bias_update_rate", expert_bias_update_rate),
    ):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    layer_freq = 1 if all(moe.moe_layers) else [int(x) for x in moe.moe_layers]
    out = dict(
        num_moe_experts=moe.experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn,
        moe_layer_freq=layer_freq,
        moe_router_pre_softmax=not moe.norm_topk_prob and moe.score_function == "softmax",
        moe_router_score_function=moe.score_function,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_z_loss_coeff=float(z_loss_coeff) if z_loss_coeff > 0 else None,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=etp_size,
    )
    if moe.shared_expert_ffn:
        out.update(
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn, moe_shared_expert_gate=moe.shared_expert_gate
        )
    if moe.expert_bias:
        out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=float(expert_bias_update_rate))
    if moe.num_groups:
        out.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.scaling_factor is not None:
        out.update(moe_router_topk_scaling_factor=moe.scaling_factor)
    return out


def hf_config_object(hf_config: dict):
    """A transformers config object of an HF config dict (for building the transformers model of it)."""
    from transformers import AutoConfig

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    for k in ("transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    return AutoConfig.for_model(model_type, **cfg)
