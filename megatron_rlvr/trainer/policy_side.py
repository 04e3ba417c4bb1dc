"""The policy side of a rank: the Megatron policy being trained (model, optimizer, learning-rate schedule), the
frozen reference model, the settings of the update and of the log-prob passes, and the rank's parallel state. A
colocated rank builds it beside the rollout side; a training rank of the disaggregated layout builds only this (and
the run life), through the same :func:`build_policy_side`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rlvr.config import RunConfig, teacher_model_config
from megatron_rlvr.megatron.parallel import DistInfo, all_reduce_max
from megatron_rlvr.megatron.policy import build_model, build_optimizer, current_lr, model_args_for, wrap_ddp
from megatron_rlvr.megatron.routing import RoutingReplay
from megatron_rlvr.models.build import takes_block_attention_mask, uses_te_attention
from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.models.lora import BaseModelView
from megatron_rlvr.models.source import ModelSource, load_image_processor, load_tokenizer, resolve_model_source
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.rundir.checkpointer import PolicyState
from megatron_rlvr.trainer.token_loss import StatsSpec
from megatron_rlvr.trainer.update import UpdateSettings

ASYNC_TIS_CAP = 2.0
"""Truncated-IS cap of the behaviour -> proximal weight at rollout.max_staleness >= 1 when rollout.tis_cap is unset
(docs/algorithms.md, "Off-policy data")."""

if TYPE_CHECKING:  # heavy packages, for annotations only
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass
class PolicySide:
    """Everything the training half of a step touches on one rank."""

    cfg: RunConfig
    """The validated run config."""
    dist: DistInfo
    """This rank's place in the world and its Megatron process groups."""
    source: ModelSource
    """Where the policy's start weights and HF config come from (the export copies its files)."""
    tokenizer: Any
    """The policy's tokenizer: its pad id, and the HF export writes it."""
    image_processor: Any
    """A vision-language policy's image processor (images -> the tower's pixel values); None: text only."""
    args: MegatronModelArgs
    """The Megatron model arguments at this layout (shapes, mapping dims)."""
    model: DistributedDataParallel
    """Megatron DDP-wrapped policy."""
    optimizer: MegatronOptimizer
    """Megatron optimizer (distributed or not), with gradient clipping."""
    scheduler: OptimizerParamScheduler
    """Learning-rate schedule."""
    settings: UpdateSettings
    """Everything the mini-batch updates and log-prob passes need besides the models."""
    ref_model: GPTModel | BaseModelView | None = None
    """Frozen reference policy (reference-KL algorithms): its own model, or a LoRA policy with its adapters off."""
    teacher: GPTModel | None = None
    """Frozen distillation teacher (``algorithm.distill``): its own model at the policy's TP / PP layout, never the
    LoRA base."""

    @property
    def state(self) -> PolicyState:
        """What a checkpoint holds of the policy."""
        return PolicyState(self.model, self.optimizer, self.scheduler, self.args)

    def current_lr(self) -> float:
        return current_lr(self.optimizer)


def build_policy_side(cfg: RunConfig, dist: DistInfo, source: ModelSource) -> PolicySide:
    """The policy at this rank's layout with its start weights (the checkpoint's arrive by resume), its optimizer and
    schedule, the reference model when a KL term needs one, and the update settings."""
    par = cfg.parallel
    args = model_args_for(source, cfg.model, par, cfg.train)
    model = build_model(
        args, source, cfg.train.seed, dist.pg, lora=cfg.model.lora, freeze_vision=cfg.model.freeze_vision
    )
    model = wrap_ddp(model, par.distributed_optimizer)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.schedule, par, cfg.model.dtype)
    ref_model = None
    if cfg.keeps_ref_model and cfg.model.lora is not None:  # the base model is the policy with adapters off
        ref_model = BaseModelView(model)
    elif cfg.keeps_ref_model:
        ref_model = build_frozen_model(cfg, dist, source, cfg.model, cfg.train.seed)
    tokenizer = load_tokenizer(source)
    teacher = build_teacher(cfg, dist, tokenizer)
    settings = update_settings(cfg, dist, args, tokenizer, model, ref_model, teacher)
    return PolicySide(
        cfg=cfg,
        dist=dist,
        source=source,
        tokenizer=tokenizer,
        image_processor=load_image_processor(source),
        args=args,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        settings=settings,
        ref_model=ref_model,
        teacher=teacher,
    )


def build_frozen_model(cfg: RunConfig, dist: DistInfo, source: ModelSource, model_cfg, seed: int):
    """A frozen scorer model (the reference policy, a distillation teacher) at the policy's TP / PP layout: no
    gradients, no optimizer, eval mode."""
    args = model_args_for(source, model_cfg, cfg.parallel, cfg.train)
    return build_model(args, source, seed, dist.pg, trainable=False)


def build_teacher(cfg: RunConfig, dist: DistInfo, student_tokenizer):
    """The distillation teacher (None without ``algorithm.distill``); ValueError, naming both, when its tokenizer's
    vocabulary differs from the student's (the teacher must score the student's token ids)."""
    teacher_cfg = teacher_model_config(cfg)
    if teacher_cfg is None:
        return None
    source = resolve_model_source(teacher_cfg)
    check_same_vocabulary(student_tokenizer, load_tokenizer(source), cfg.model.name, cfg.algorithm.distill.teacher)
    seed = cfg.algorithm.distill.teacher_seed
    return build_frozen_model(cfg, dist, source, teacher_cfg, cfg.train.seed if seed is None else seed)


def check_same_vocabulary(student_tokenizer, teacher_tokenizer, student: str, teacher: str) -> None:
    """ValueError (one line naming both models) unless the two tokenizers map the same strings to the same ids."""
    sv, tv = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"algorithm.distill.teacher={teacher!r}: its tokenizer ({len(tv)} tokens) differs from the student "
            f"model {student!r}'s ({len(sv)} tokens), e.g. {diff}; the teacher must share the student's tokenizer"
        )


def update_settings(cfg: RunConfig, d: DistInfo, args: MegatronModelArgs, tokenizer, model, ref_model, teacher=None):
    """The update's and the log-prob passes' settings from the run config and the layout."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    routing = None if cfg.train.routing_replay == "none" else RoutingReplay(model, d.pg.tp, cfg.train.routing_replay)
    return UpdateSettings(
        algo=cfg.algorithm,
        spec=StatsSpec(
            tp_group=d.pg.tp if d.tp_size > 1 else None,
            vocab_size=args.dims.vocab_size,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.train.logits_chunk,
            impl=cfg.train.fused_statistics,
            cp_group=d.pg.cp if d.cp_size > 1 else None,
        ),
        pg=d.pg,
        device=d.device,
        pad_id=int(pad_id),
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        # SP splits s / cp over TP (MoE at TP > 1 switches SP on); CP cuts s into 2 x cp chunks
        seq_multiple=(d.tp_size if args.config.sequence_parallel else 1) * (2 * d.cp_size if d.cp_size > 1 else 1),
        n_per_group=cfg.rollout.n,
        num_mini_batches=cfg.train.num_mini_batches,
        ppo_epochs=cfg.train.ppo_epochs,
        correction=MismatchCorrectionConfig(tis_cap=tis_cap(cfg.rollout)),
        skip_nonfinite=cfg.train.skip_nonfinite,
        pack_rows=pack_rows_on(cfg, model, ref_model, teacher),
        routing=routing,
        thd=thd_on(cfg, d, model, ref_model, teacher),
        thd_multiple=d.tp_size if args.config.sequence_parallel else 1,
    )


def tis_cap(rollout) -> float | None:
    """The truncated-IS cap of the train/inference correction: ``rollout.tis_cap``; unset, at max_staleness >= 1 with
    recomputed (proximal) log-probs, ASYNC_TIS_CAP (decoupled PPO: the behaviour -> proximal weight is truncated);
    else None (no correction)."""
    if rollout.tis_cap is not None:
        return rollout.tis_cap
    if rollout.max_staleness >= 1 and rollout.old_logprobs == "recompute":
        return ASYNC_TIS_CAP
    return None


def pack_rows_on(cfg: RunConfig, model, *frozen) -> bool:
    """``train.pack_sequences`` where every rank's models (the policy, its frozen scorers) take a block-diagonal
    attention mask (ranks agree)."""
    if not cfg.train.pack_sequences or cfg.train.micro_batch_tokens is None:
        return False
    ok = all(takes_block_attention_mask(m) for m in (model, *frozen) if m is not None)
    return all_reduce_max(0.0 if ok else 1.0) == 0.0


def thd_on(cfg: RunConfig, d: DistInfo, model, *frozen) -> bool:
    """Packed sequences (THD) for ``train.pack_sequences`` at context parallelism > 1 where every rank's models run
    Transformer Engine's attention (which ignores a block-diagonal mask but takes ``cu_seqlens``) and PP = 1 (the
    packed stream's length varies by micro-batch); ranks agree."""
    if not cfg.train.pack_sequences or cfg.train.micro_batch_tokens is None or d.cp_size == 1 or d.pp_size > 1:
        return False
    ok = all(uses_te_attention(m) for m in (model, *frozen) if m is not None)
    return all_reduce_max(0.0 if ok else 1.0) == 0.0


def describe(policy: PolicySide) -> str:
    """The layout line of the start-up message."""
    d = policy.dist
    rows = "packed rows" if policy.settings.pack_rows else "one sequence per row"
    if policy.settings.thd:
        rows = "packed sequences (THD)"
    cp = f", cp {d.cp_size}" if d.cp_size > 1 else ""
    return f"world {d.world_size} (tp {d.tp_size}{cp}, pp {d.pp_size}, dp {d.dp_size}) | {d.backend} | {rows}"
