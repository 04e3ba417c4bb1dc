"""The trainer's components on one rank: :class:`Trainer` holds everything a running step touches, built once by
:func:`setup` (process groups, policy and optimizer, reference model, rollout engine, reward workers, data, logging,
checkpoints; resuming from the newest checkpoint) and released by :func:`teardown`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.algorithms import AlgorithmConfig
from megatron_rlvr.config import RunConfig
from megatron_rlvr.data import PromptLoader, build_train_dataset, build_train_loader
from megatron_rlvr.eval.benchmarks import PeriodicEval
from megatron_rlvr.megatron.parallel import (
    DistInfo,
    all_reduce_max,
    broadcast_object,
    init_distributed,
    local_world_size,
)
from megatron_rlvr.megatron.policy import (
    ModelSource,
    build_model,
    build_optimizer,
    load_image_processor,
    load_tokenizer,
    model_args_for,
    resolve_model_source,
    wrap_ddp,
)
from megatron_rlvr.megatron.policy import current_lr as optimizer_lr
from megatron_rlvr.megatron.routing import RoutingReplay
from megatron_rlvr.models.build import takes_block_attention_mask
from megatron_rlvr.models.fusions import detect
from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.rewards import RewardManager
from megatron_rlvr.rollout.engine import RolloutEngine
from megatron_rlvr.rollout.groups import EngineInfo, engine_info
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.rundir.checkpointer import Checkpointer, PolicyState
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.metrics_log import RunLogger
from megatron_rlvr.rundir.prepare import prepare_run_dir_on_ranks, resolve_run_dir
from megatron_rlvr.rundir.signals import StopSignals
from megatron_rlvr.trainer.engine_setup import build_engine
from megatron_rlvr.trainer.token_loss import StatsSpec
from megatron_rlvr.trainer.update import UpdateSettings
from megatron_rlvr.trainer.weights import sync_weights

if TYPE_CHECKING:  # heavy or optional packages, for annotations only
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import PreTrainedTokenizerBase


@dataclass
class Trainer:
    """Everything a running step touches, built once by :func:`setup`."""

    cfg: RunConfig
    """The validated run config."""
    run_dir: str
    """Run directory (config.yaml, metrics.jsonl, checkpoints, export)."""
    dist: DistInfo
    """This rank's place in the world and its Megatron process groups."""
    source: ModelSource
    """Where the policy's weights, HF config and tokenizer come from."""
    tokenizer: PreTrainedTokenizerBase
    """The policy's tokenizer (prompts in, responses out)."""
    args: MegatronModelArgs
    """The Megatron model arguments at this layout (shapes, mapping dims)."""
    model: DistributedDataParallel
    """Megatron DDP-wrapped policy."""
    optimizer: MegatronOptimizer
    """Megatron optimizer (distributed or not), with gradient clipping."""
    scheduler: OptimizerParamScheduler
    """Learning-rate schedule."""
    engine: RolloutEngine | None
    """This rank's rollout engine (transformers or vLLM); None on the disaggregated layout's training ranks."""
    engine_info: EngineInfo
    """Which engine this rank belongs to and whether it leads it."""
    reward_manager: RewardManager | None
    """Reward workers (engine leaders only)."""
    loader: PromptLoader
    """Resumable prompt loader."""
    logger: RunLogger
    """metrics.jsonl / TensorBoard / progress line (rank 0 writes)."""
    signals: StopSignals
    """SIGTERM / SIGUSR1 handling (checkpoint, then exit)."""
    update_settings: UpdateSettings
    """Everything the mini-batch updates and log-prob passes need besides the model."""
    checkpointer: Checkpointer
    """Saves and resumes this run's checkpoints."""
    evaluator: PeriodicEval
    """The run's evaluation benchmarks."""
    image_processor: Any = None
    """The image processor of a vision-language policy (images -> the tower's pixel values); None: text only."""
    ref_model: GPTModel | None = None
    """Frozen reference policy (reference-KL algorithms)."""
    lock: RunLock | None = None
    """The run directory's lock when this process holds it (None: another rank or the launcher does)."""
    step: int = 0
    """The step being run."""
    start_step: int = 0
    """The step resumed from (0 for a fresh run)."""
    policy_version: int = 0
    """The last step whose update the engines' weights include (RolloutBatch.policy_version)."""
    warned_all_too_long: bool = False
    """The run has said once that every prompt of a step was too long."""

    @property
    def algo(self) -> AlgorithmConfig:
        return self.cfg.algorithm

    def current_lr(self) -> float:
        return optimizer_lr(self.optimizer)

    @property
    def policy(self) -> PolicyState:
        """What a checkpoint holds besides the data position."""
        return PolicyState(self.model, self.optimizer, self.scheduler, self.args)


def setup(cfg: RunConfig, run_dir: str | None, lock: RunLock | None = None, with_engine: bool = True) -> Trainer:
    """Build every component on this rank and resume from the newest checkpoint when there is one.
    ``with_engine=False``: no rollout engine nor reward workers (the disaggregated layout's training ranks)."""

    signals = StopSignals().install()
    par = cfg.parallel
    d = init_distributed(
        par.tp, par.pp, cfg.train.seed, cfg.launch.backend, cfg.launch.collective_timeout_s, ep=par.ep, etp=par.etp
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads(cfg, d.world_size))
    run_dir = broadcast_object(run_dir or resolve_run_dir(cfg) if d.rank == 0 else None)

    # torchrun / srun (no launcher of ours): rank 0 locks the run dir, checks a resume's changed options, writes
    # config.yaml; after `megatron-rlvr train` launched us, the launcher has done all three
    if lock is None:
        lock = prepare_run_dir_on_ranks(cfg, run_dir, d.rank, broadcast_object)
    # local rank 0 first: a GGUF model is converted (and cached) once per node, not by every rank at once
    if d.local_rank == 0:
        source = resolve_model_source(cfg.model)
    torch.distributed.barrier()
    if d.local_rank != 0:
        source = resolve_model_source(cfg.model)
    tokenizer = load_tokenizer(source)
    image_processor = load_image_processor(source)
    args = model_args_for(source, cfg.model, par, cfg.train)
    model = build_model(args, source, cfg.train.seed, d.pg, lora=cfg.model.lora, freeze_vision=cfg.model.freeze_vision)
    model = wrap_ddp(model, par.distributed_optimizer)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.schedule, par, cfg.model.dtype)
    ref_model = None
    if cfg.keeps_ref_model and cfg.model.lora is not None:  # the base model is the policy with adapters off
        from megatron_rlvr.models.lora import BaseModelView

        ref_model = BaseModelView(model)
    elif cfg.keeps_ref_model:
        ref_args = model_args_for(source, cfg.model, par, cfg.train)
        ref_model = build_model(ref_args, source, cfg.train.seed, d.pg, trainable=False)
    info = engine_info(d.rank, d.world_size, par.rollout_tp)
    engine = build_engine(cfg, source, tokenizer, d) if with_engine else None
    reward_manager = RewardManager(cfg.reward) if info.leader and with_engine else None
    dataset = build_train_dataset(cfg.data)
    loader = build_train_loader(cfg.data, cfg.train.prompts_per_step, dp_rank=0, dp_world=1, dataset=dataset)
    logger = RunLogger.for_run(cfg, run_dir, enabled=d.is_logger)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    update_settings = UpdateSettings(
        algo=cfg.algorithm,
        spec=StatsSpec(
            tp_group=d.pg.tp if d.tp_size > 1 else None,
            vocab_size=args.dims.vocab_size,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.train.logits_chunk,
            impl=cfg.train.fused_statistics,
        ),
        pg=d.pg,
        device=d.device,
        pad_id=int(pad_id),
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        seq_multiple=d.tp_size if args.config.sequence_parallel else 1,  # MoE at TP > 1 switches SP on
        n_per_group=cfg.rollout.n,
        num_mini_batches=cfg.train.num_mini_batches,
        ppo_epochs=cfg.train.ppo_epochs,
        correction=MismatchCorrectionConfig(tis_cap=cfg.rollout.tis_cap),
        skip_nonfinite=cfg.train.skip_nonfinite,
        pack_rows=pack_rows_on(cfg, model, ref_model),
        routing=None if cfg.train.routing_replay == "none" else RoutingReplay(model, d.pg.tp, cfg.train.routing_replay),
    )
    t = Trainer(
        cfg=cfg,
        run_dir=run_dir,
        dist=d,
        source=source,
        tokenizer=tokenizer,
        image_processor=image_processor,
        args=args,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        engine_info=info,
        reward_manager=reward_manager,
        loader=loader,
        logger=logger,
        signals=signals,
        update_settings=update_settings,
        checkpointer=Checkpointer(
            run_dir, cfg.checkpoint, d.pg, d.rank, cfg.algorithm.name, last_step=cfg.schedule.steps
        ),
        evaluator=PeriodicEval(cfg.eval, cfg.data, 0, 0),  # loaded below, inside the clean-up guard
        ref_model=ref_model,
        lock=lock,
    )
    try:
        t.evaluator = PeriodicEval.from_run_config(cfg)
        t.start_step = t.checkpointer.resume(t.policy, t.loader)
        t.policy_version = t.start_step
    except BaseException:  # e.g. a refused resume: stop the engine and reward workers, free the run dir
        teardown(t)
        raise

    if with_engine:
        sync_weights(t.engine, t.model, t.args, t.dist.pg)  # the engine starts from the (loaded) policy weights
    if d.is_logger:
        logger.truncate_after(t.start_step)
        skipped = f", {dataset.n_malformed} malformed rows skipped" if dataset.n_malformed else ""
        print(f"megatron-rlvr: data: {len(dataset.examples)} training prompts{skipped}", flush=True)
        where = f"resumed from step {t.start_step}" if t.start_step else "starting"
        print(
            f"megatron-rlvr: {where} | {cfg.logging.name} | algorithm {cfg.algorithm.name} | world {d.world_size} "
            f"(tp {d.tp_size}, pp {d.pp_size}, dp {d.dp_size}) | {d.backend} | {fusions_line()} "
            f"| {'packed rows' if update_settings.pack_rows else 'one sequence per row'} | run dir {run_dir}",
            flush=True,
        )
    return t


def pack_rows_on(cfg: RunConfig, model, ref_model) -> bool:
    """``train.pack_sequences`` where every rank's models take a block-diagonal attention mask (ranks agree)."""

    if not cfg.train.pack_sequences or cfg.train.micro_batch_tokens is None:
        return False
    ok = all(takes_block_attention_mask(m) for m in (model, ref_model) if m is not None)
    return all_reduce_max(0.0 if ok else 1.0) == 0.0


def fusions_line() -> str:

    return detect().describe()


def cpu_threads(cfg: RunConfig, world_size: int) -> int:
    """torch intra-op threads of a CPU rank: launch.threads_per_rank, else $OMP_NUM_THREADS, else the node's cores
    split between its ranks (more threads than cores only thrash)."""

    if cfg.launch.threads_per_rank:
        return cfg.launch.threads_per_rank
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size(world_size)))


def teardown(t: Trainer) -> None:

    if t.lock is not None:
        t.lock.release()
    if t.reward_manager is not None:
        t.reward_manager.close()
    if t.engine is not None:
        t.engine.close()
    t.logger.close()
    t.signals.uninstall()
