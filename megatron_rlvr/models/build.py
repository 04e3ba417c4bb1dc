"""Build a megatron-core GPTModel for an HF model family at a (TP, PP, EP, ETP) layout, and run it to logits.

Layer spec: Transformer-Engine's when ``transformer_engine`` imports and CUDA is available (GPU runs), megatron-core's
local spec otherwise (torch RMSNorm, local DotProductAttention with a causal mask, the same masking HF applies).
bf16/fp16 models are wrapped in ``Float16Module`` (it casts inputs and keeps torch norms in the model dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rlvr.models.hf_config import MegatronModelArgs, yarn_attributes
from megatron_rlvr.models.vision import vl_gpt_model_class


def te_available() -> bool:
    """True when Transformer-Engine imports and a GPU is present (TE kernels are CUDA-only)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def layer_spec(args: MegatronModelArgs, use_te: bool | None = None, pp_rank: int = 0, cp_core_attention=None):
    """ModuleSpec of one decoder layer (dense models), or the block spec of pipeline stage ``pp_rank`` (MoE models:
    MoE and dense layers per ``moe_layer_freq``). ``use_te=None`` picks TE when available.

    Context parallelism (``context_parallel_size > 1``): TE's attention does it itself (``cp_comm_type``); megatron's
    local attention refuses it, so without TE the local spec takes ``cp_core_attention`` as its core attention (the
    fenced megatron_rlvr.megatron.context_parallel.cp_core_attention(), which the trainer passes).

    MoE experts: Transformer Engine's grouped GEMM (``TEGroupedMLP``) where TE runs, else megatron's
    ``SequentialMLP`` (one GEMM per local expert; CPU).

    Multi-latent attention always uses megatron's local spec, amended (``_mla_local_spec``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    cfg = args.config
    if use_te is None:
        use_te = te_available() and not getattr(cfg, "multi_latent_attention", False)
    if getattr(cfg, "multi_latent_attention", False):
        if use_te:
            raise ValueError("multi-latent attention is built from megatron's local layer spec (use_te=False)")
        _mla_without_te()
    if cfg.context_parallel_size > 1 and (cfg.num_moe_experts or getattr(cfg, "multi_latent_attention", False)):
        raise ValueError("context parallelism is supported for dense models with standard attention only")
    if cfg.num_moe_experts:
        if cfg.moe_grouped_gemm and not use_te:
            raise ValueError("moe_grouped_gemm needs the Transformer Engine layer spec (use_te)")
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank
        )
        return _mla_local_spec(spec) if getattr(cfg, "multi_latent_attention", False) else spec
    if getattr(cfg, "multi_latent_attention", False):
        return _mla_local_spec(
            gpt_layer_specs.get_gpt_layer_local_spec(
                num_experts=None, multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
            )
        )
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.config.qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.config.qk_layernorm, normalization="RMSNorm"
    )
    if cfg.context_parallel_size > 1:
        if cp_core_attention is None:
            raise ValueError(
                f"context_parallel_size={cfg.context_parallel_size} without Transformer Engine needs a context-parallel"
                " core attention (cp_core_attention=megatron_rlvr.megatron.context_parallel.cp_core_attention())"
            )
        spec.submodules.self_attention.submodules.core_attention = cp_core_attention
    return spec


def _mla_without_te() -> None:
    """megatron-core 0.16's multi_latent_attention.py imports megatron.core.extensions.transformer_engine, which
    imports even without Transformer Engine (it puts a MagicMock in TE's place), so the module believes TE is there
    and ``MultiLatentAttention.__init__`` fails on ``isinstance(self.linear_proj, TELinear)`` (a mock, not a type).
    attention.py checks ``import transformer_engine`` first; do the same."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _mla_core_attention():
    """megatron's local ``DotProductAttention`` for MLA layers. ``MLASelfAttention`` passes ``k_channels`` /
    ``v_channels`` (the q/k head width nope + rope differs from the value head width), which only TE's attention
    accepts; the local forward is shape-generic in the q/k width, only its output width must be v_head_dim * heads.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    global _MLA_CORE
    if _MLA_CORE is None:

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *a, k_channels=None, v_channels=None, **kw):
                super().__init__(*a, **kw)
                if v_channels is not None:
                    self.hidden_size_per_attention_head = v_channels
                    self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        _MLA_CORE = MLADotProductAttention
    return _MLA_CORE


_MLA_CORE = None


def _mla_local_spec(spec):
    """The local layer (or block) spec with MLA's core attention swapped for ``_mla_core_attention`` and its two down
    projections (``linear_q_down_proj``, ``linear_kv_down_proj``) whole on every TP rank, as in TE's spec.

    The local spec makes them column-parallel and all-gathers their outputs over TP; the backward of that gather
    keeps each rank's own slice of the gradient, but the gradient of the shared RoPE key (``k_pos_emb``) differs
    between ranks (each holds other heads' contribution), so the other ranks' parts are lost: measured, the
    gradient of every layer below the last one is then off by 1-20 % at TP=2. With whole projections the RoPE key is
    all-gathered over the sequence, whose backward reduce-scatters (sums) the heads' contributions; the weights are
    flagged ``sequence_parallel`` so megatron sums their gradients over TP."""
    from megatron.core.transformer import multi_latent_attention

    linear = multi_latent_attention.Linear  # the plain replicated linear MLASelfAttention accepts
    if linear is None:
        raise RuntimeError("megatron.core.post_training.modelopt.layers.Linear did not import: MLA cannot be built")
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attn = layer.submodules.self_attention
        if type(attn.submodules).__name__ == "MLASelfAttentionSubmodules":
            attn.submodules.core_attention = _mla_core_attention()
            attn.submodules.linear_q_down_proj = linear
            attn.submodules.linear_kv_down_proj = linear
    return spec


def _expert_output_clone(module, inputs, output):
    """Forward hook of an expert's ``linear_fc2``: its output as a fresh tensor."""
    out, bias = output
    return out.clone(), bias


def _fix_expert_biases(gpt) -> int:
    """Two megatron-core 0.16 bugs of MoE experts with biases (GPT-OSS); returns the number of experts fixed.

    1. ``MLP.forward`` adds an expert's fc2 bias in place (``output += output_bias * per_token_scale``,
       transformer/mlp.py) on the output of ``RowParallelLinear``, which its TP reduction returns as a view; autograd
       refuses to modify that view in place ("Output 0 of _ReduceFromModelParallelRegion is a view and is being
       modified inplace"), so such a model cannot train. A forward hook on each local expert's ``linear_fc2`` hands
       ``MLP.forward`` a clone instead (one copy of the expert's output).
    2. ``RowParallelLinear`` flags its bias ``sequence_parallel``, so ``finalize_model_grads`` sums its gradient over
       the TP group. An expert's bias (expert TP 1, the only size megatron allows with biases) already has its whole
       gradient where its expert lives, and under expert parallelism the TP peers hold other experts: the sum adds
       another expert's gradient (measured at TP=2 x EP=2: every fc2 bias gradient wrong). Its weight is never
       summed over TP; the bias is treated the same (the flag cleared)."""
    from megatron.core.transformer.mlp import MLP

    n = 0
    for name, module in gpt.named_modules():
        if isinstance(module, MLP) and ".local_experts." in f".{name}." and module.linear_fc2.bias is not None:
            module.linear_fc2.register_forward_hook(_expert_output_clone)
            module.linear_fc2.bias.sequence_parallel = False
            n += 1
    return n


MLA_LATENT_NORM_EPS = 1e-6
"""transformers (and DeepSeek's own code) build ``q_a_layernorm`` / ``kv_a_layernorm`` with the RMSNorm default eps
1e-6, not ``rms_norm_eps`` (Moonlight: 1e-5); megatron gives every norm ``layernorm_epsilon``."""


def _set_mla_latent_norm_eps(gpt) -> None:
    for layer in getattr(gpt.decoder, "layers", []) if hasattr(gpt, "decoder") else []:
        attn = layer.self_attention
        for norm in (getattr(attn, "q_layernorm", None), getattr(attn, "kv_layernorm", None)):
            if norm is not None and hasattr(norm, "eps"):
                norm.eps = MLA_LATENT_NORM_EPS


def _apply_rope_scaling(gpt, args: MegatronModelArgs) -> None:
    """Llama-3 scaling with the checkpoint's own low/high frequency factors and original context length.

    GPTModel's ``rope_scaling`` flag passes only ``factor`` to ``RotaryEmbedding._apply_scaling`` (the rest are
    hard-coded to Llama-3.1's 1 / 4 / 8192; Llama-3.2 and others differ), so we recompute ``inv_freq`` with megatron's
    own function and every HF parameter. ``inv_freq`` is a plain attribute: it is not in state dicts or checkpoints.
    """
    rope = args.rope
    if rope.kind != "llama3" or not hasattr(gpt, "rotary_pos_emb"):
        return
    rot = gpt.rotary_pos_emb
    dim = args.config.kv_channels
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
    rot.inv_freq = rot._apply_scaling(
        base,
        factor=rope.factor,
        low_freq_factor=rope.low_freq_factor,
        high_freq_factor=rope.high_freq_factor,
        original_max_position_embeddings=rope.original_max_position_embeddings,
    )


def build_gpt_model(
    args: MegatronModelArgs,
    *,
    pg_collection=None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool | None = None,
    parallel_output: bool = True,
    wrap_float16: bool = True,
    cp_core_attention=None,
):
    """The GPTModel of this pipeline stage (``Float16Module``-wrapped for bf16/fp16 unless ``wrap_float16=False``).

    ``cp_core_attention``: the core attention of a context-parallel model without Transformer Engine (``layer_spec``).

    ``pg_collection``: megatron ``ProcessGroupCollection`` (default: megatron's initialised parallel_state groups).
    ``pre_process`` / ``post_process`` default to first / last pipeline stage of ``pg_collection.pp``.
    ``parallel_output=True`` keeps logits split over TP ([b, s, V_pad/tp]); see ``gather_vocab_parallel``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pp_group = pg_collection.pp
    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    tp_size = pg_collection.tp.size()
    cp_size = pg_collection.cp.size()
    cfg = args.config
    if cfg.tensor_model_parallel_size != tp_size or cfg.pipeline_model_parallel_size != pp_size:
        raise ValueError(
            f"model args are for TP={cfg.tensor_model_parallel_size}, PP={cfg.pipeline_model_parallel_size} but the "
            f"process groups are TP={tp_size}, PP={pp_size}; rebuild them with megatron_model_args(tp_size=, pp_size=)"
        )
    if cfg.context_parallel_size != cp_size:
        raise ValueError(
            f"model args are for CP={cfg.context_parallel_size} but the process groups are CP={cp_size}; rebuild them "
            "with megatron_model_args(cp_size=)"
        )
    if pre_process is None:
        pre_process = pp_rank == 0
    if post_process is None:
        post_process = pp_rank == pp_size - 1
    rope = args.rope
    cls, extra = GPTModel, {"position_embedding_type": "rope"}
    yarn = yarn_attributes(rope, mla=getattr(cfg, "multi_latent_attention", False))
    if yarn:  # GPT-OSS, dense YaRN: megatron's YaRN embedding reads its settings from config attributes (not fields)
        for name, value in yarn.items():
            setattr(cfg, name, value)
        extra = {"position_embedding_type": "yarn"}
    if args.vision is not None:
        if pp_size > 1:
            raise ValueError(
                "vision-language models run with pipeline parallelism 1 (parallel.pp=1): the vision tower and "
                "its multimodal positions are not passed between pipeline stages"
            )
        cls, extra = vl_gpt_model_class(), {"vision": args.vision}
    model = cls(
        config=cfg,
        transformer_layer_spec=layer_spec(args, use_te, pp_rank=pp_rank, cp_core_attention=cp_core_attention),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=args.share_embeddings_and_output_weights,
        rotary_base=rope.theta,
        rotary_percent=rope.percent,
        seq_len_interpolation_factor=rope.factor if rope.kind == "linear" else None,
        pg_collection=pg_collection,
        **extra,
    )
    _apply_rope_scaling(model, args)
    if getattr(cfg, "multi_latent_attention", False):
        _set_mla_latent_norm_eps(model)
    if cfg.num_moe_experts and cfg.add_bias_linear:
        _fix_expert_biases(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if wrap_float16 and (cfg.bf16 or cfg.fp16):
        model = Float16Module(cfg, model)
    return model


def unwrap(model) -> torch.nn.Module:
    """The GPTModel inside Float16Module / DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def takes_block_attention_mask(model) -> bool:
    """True when every attention layer of ``model`` applies the ``attention_mask`` it is given as is: megatron's
    local DotProductAttention with the unfused softmax and no sliding window (the fused causal-softmax kernel, TE's
    attention and sliding windows build their own causal mask and ignore a block-diagonal one)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    gpt = unwrap(model)
    cfg = gpt.config
    if getattr(cfg, "masked_softmax_fusion", False) or getattr(cfg, "window_size", None) is not None:
        return False
    cores = [m.core_attention for m in gpt.modules() if hasattr(m, "core_attention")]
    local = (DotProductAttention, _MLA_CORE) if _MLA_CORE is not None else (DotProductAttention,)
    # the context-parallel core attention (megatron_rlvr.megatron.context_parallel) re-indexes a given mask's key
    # columns and applies it as the parent does
    return all(type(c) in local or getattr(type(c), "applies_given_mask", False) for c in cores)


def uses_te_attention(model) -> bool:
    """True when every attention layer of ``model`` is Transformer Engine's (``TEDotProductAttention``): the
    attention that takes packed sequences (THD, megatron's ``PackedSeqParams``) at any context-parallel size."""
    cores = [m.core_attention for m in unwrap(model).modules() if hasattr(m, "core_attention")]
    return bool(cores) and all(type(c).__name__ == "TEDotProductAttention" for c in cores)


def gather_vocab_parallel(logits: torch.Tensor, tp_group, vocab_size: int | None = None) -> torch.Tensor:
    """[..., V_pad/tp] on each TP rank -> [..., V_pad] (or [..., vocab_size] with the padding dropped)."""
    if tp_group.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size] if vocab_size is not None else logits


def forward_logits(
    model,
    input_ids: Sequence[torch.Tensor] | torch.Tensor,
    *,
    pg_collection=None,
    vocab_size: int | None = None,
) -> list[torch.Tensor] | None:
    """Forward-only logits through megatron's pipeline schedule (the path the trainer uses; PP=1 included).

    ``input_ids``: one [b, s] tensor per micro-batch (all the same shape), or a single [b, s] tensor.
    Returns, on the last pipeline stage, a list of [b, s, V] float tensors (TP-gathered; ``vocab_size`` drops the
    padding); None on other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    batches = [input_ids] if isinstance(input_ids, torch.Tensor) else list(input_ids)
    if not batches:
        raise ValueError("forward_logits: no micro-batches")
    shape = batches[0].shape
    if any(b.shape != shape for b in batches) or len(shape) != 2:
        raise ValueError(
            f"forward_logits: every micro-batch must be [b, s] of one shape, got {[b.shape for b in batches]}"
        )
    mbs, seq = shape
    device = next(model.parameters()).device
    tp_group = pg_collection.tp

    def forward_step(data_iterator, model_chunk):
        tokens = next(data_iterator).to(device)
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, -1)
        out = model_chunk(tokens, position_ids, None)

        def collect(output_tensor):
            full = gather_vocab_parallel(output_tensor.float(), tp_group, vocab_size)
            # the schedule scales the returned "loss" in place: hand it a throwaway scalar
            return torch.zeros((), device=output_tensor.device), {"logits": full.detach().clone()}

        return out, collect

    fwd_bwd = get_forward_backward_func(pp_size=pg_collection.pp.size())
    with torch.no_grad():
        data = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=True,
        )
    if pg_collection.pp.rank() != pg_collection.pp.size() - 1:
        return None
    return [d["logits"] for d in data]
