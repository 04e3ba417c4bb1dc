"""Megatron glue for the policy: build the GPTModel of this rank from its model source (megatron_rlvr.models.source),
wrap it in megatron's DistributedDataParallel, and build megatron's optimizer and learning-rate scheduler."""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_rlvr.config import ModelConfig, OptimizerConfig, ParallelConfig, ScheduleConfig, TrainConfig
from megatron_rlvr.families.table import routed_experts, vl_family_of, vl_saved_name
from megatron_rlvr.megatron.context_parallel import cp_core_attention
from megatron_rlvr.megatron.router_loss import record_expert_loads
from megatron_rlvr.models.build import build_gpt_model, unwrap
from megatron_rlvr.models.hf_config import hf_config_object, megatron_model_args
from megatron_rlvr.models.hf_loading import load_hf_weights
from megatron_rlvr.models.lora import attach_lora
from megatron_rlvr.models.mapping import VISION_MODULE
from megatron_rlvr.models.source import ModelSource

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_args_for(source: ModelSource, model_cfg: ModelConfig, par: ParallelConfig, train: TrainConfig):
    """megatron_rlvr.models MegatronModelArgs for this run's layout (recompute settings included)."""
    overrides: dict[str, Any] = {}
    if train.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if routed_experts(source.hf_config):
        overrides.update(
            ep_size=par.ep,
            etp_size=par.expert_tp,
            moe_dispatcher=par.moe_dispatcher,
            moe_aux_loss_coeff=train.moe_aux_loss_coeff,
            moe_z_loss_coeff=train.moe_z_loss_coeff,
            moe_expert_bias_update_rate=train.moe_expert_bias_update_rate,
        )
    args = megatron_model_args(
        source.hf_config,
        tp_size=par.tp,
        pp_size=par.pp,
        dtype=_DTYPES[model_cfg.dtype],
        sequence_parallel=par.sequence_parallel_on(torch.cuda.is_available()),
        cp_size=par.cp,
        cp_comm_type=par.cp_comm_type,
        **overrides,
    )
    if train.moe_expert_bias_update_rate > 0 and not getattr(args.config, "moe_router_enable_expert_bias", False):
        raise ValueError(
            "train.moe_expert_bias_update_rate > 0 needs routers with an expert bias (DeepSeek-V3's "
            f"e_score_correction_bias); {source.hf_config.get('architectures')} has none"
        )
    return args


TINY_VISION_STD = 0.08
"""Init scale of a built-in tiny VL model's vision tower (its norms: 1 + N(0, 0.2^2)). At transformers' 0.02 the
tower's features of different images differ so little that the 2-layer language model needs hundreds of supervised
steps before its answer depends on the image at all (tens at 0.08); RL from scratch never gets there."""


def random_hf_state_dict(hf_config: dict, seed: int, vision_std: float | None = None) -> dict[str, torch.Tensor]:
    """A randomly initialised HF state dict (transformers' own init for the architecture) that depends only on
    (config, seed): loading it through the weight mapping gives the same model at EVERY parallel layout (megatron's
    own init draws per-rank tensors whose values depend on TP/PP and the padded vocabulary). Materialises the full
    model on each rank: meant for small from-scratch models such as ``tiny``. ``vision_std``: a vision-language
    model's tower drawn from N(0, vision_std^2) instead (see TINY_VISION_STD), with the same seed."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl = vl_family_of(hf_config)
    auto = AutoModelForCausalLM if vl is None else AutoModelForImageTextToText
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        hf = auto.from_config(hf_config_object(hf_config), dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    if vl is not None and vision_std is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                norm = "norm" in name or "ln_q" in name
                p.copy_(
                    1.0 + 0.2 * torch.randn(p.shape, generator=g)
                    if norm
                    else vision_std * torch.randn(p.shape, generator=g)
                )
    rename = (lambda k: k) if vl is None else (lambda k: vl_saved_name(vl[1], k))
    return {rename(k): v.detach().clone() for k, v in hf.state_dict().items()}


def build_model(
    args, source: ModelSource, seed: int, pg, *, trainable: bool = True, lora=None, freeze_vision: bool = False
):
    """This rank's GPTModel (Float16Module-wrapped for bf16) with the start weights: the HF folder's, or a random
    init that depends only on (config, seed), identical at every layout (:func:`random_hf_state_dict`). ``lora``
    (a LoRAConfig): freeze the weights and add adapters (megatron_rlvr.models.lora). ``freeze_vision``: a
    vision-language model's tower gets no gradient (megatron's DDP and optimizer then leave it out)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    cp_attention = cp_core_attention() if args.config.context_parallel_size > 1 else None  # used without TE
    model = build_gpt_model(args, pg_collection=pg, cp_core_attention=cp_attention)
    weights = source.weights_dir
    if weights is None:
        weights = random_hf_state_dict(source.hf_config, seed, vision_std=TINY_VISION_STD if source.is_tiny else None)
    load_hf_weights(unwrap(model), args, weights, pg_collection=pg)
    if freeze_vision:
        tower = getattr(unwrap(model), VISION_MODULE, None)
        if tower is None and args.vision is None:
            raise ValueError("freeze_vision: the model has no vision tower (not a vision-language model)")
        for p in tower.parameters() if tower is not None else ():  # no tower on later pipeline stages
            p.requires_grad_(False)
    if lora is not None and trainable:
        attach_lora(model, lora, args, pg_collection=pg, seed=seed, base=source.weights_dir)
    if not trainable:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def wrap_ddp(model, distributed_optimizer: bool):
    """megatron DistributedDataParallel around the model, with the schedule hooks set on its config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,  # the trainer detects non-finite steps itself and skips them
    )
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    record_expert_loads(ddp)  # routers with an expert bias: keep each optimizer step's loads for the metrics
    return ddp


def build_optimizer(ddp_model, opt: OptimizerConfig, sched: ScheduleConfig, par: ParallelConfig, dtype: str):
    """megatron's optimizer (Adam, grad clipping) and OptimizerParamScheduler (warm-up + constant/linear/cosine)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=dtype == "bfloat16",
        params_dtype=_DTYPES[dtype],
        use_distributed_optimizer=par.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(mcfg, [ddp_model])
    if not torch.cuda.is_available():
        _use_fused_cpu_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if sched.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=min(opt.min_lr, opt.lr),
        lr_warmup_steps=sched.warmup_steps,
        lr_decay_steps=max(sched.steps, sched.warmup_steps + 1),
        lr_decay_style=sched.lr_decay,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(sched.steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _torch_optimizers(optimizer):
    """The torch optimizers inside megatron's wrapper (a ChainedOptimizer holds one wrapper per param-group set)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if isinstance(torch_opt, torch.optim.Optimizer):
            yield torch_opt


def _use_fused_cpu_adam(optimizer) -> None:
    """Without Transformer Engine or Apex (every CPU run) megatron steps ``torch.optim.AdamW``, and torch defaults
    to its per-parameter for-loop form for CPU tensors (the foreach / fused defaults are CUDA-only): about 12 small
    ops per parameter per step, each also through the CPU shims' handler. torch's fused CPU kernel (torch >= 2.4)
    is one vectorised pass per parameter, the same update up to float rounding (tests/integration/test_cpu_shims.py)."""
    for torch_opt in _torch_optimizers(optimizer):
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        if any(p.device.type != "cpu" or not p.is_floating_point() for p in params):
            continue
        for group in torch_opt.param_groups:
            group["fused"], group["foreach"] = True, False
        torch_opt.defaults["fused"], torch_opt.defaults["foreach"] = True, False


def current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return 0.0


@torch.no_grad()
def params_checksum(model) -> float:
    """Sum of |w| over this rank's parameters (float64): a cheap "did the weights change" probe for tests/logs."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        total += p.detach().double().abs().sum().cpu()
    return float(total)


def hf_dir_of(run_dir: str) -> str:
    return os.path.join(run_dir, "hf")
