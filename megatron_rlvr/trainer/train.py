"""The RL training loop. ``train(cfg)`` runs on every rank (SPMD); ``rl_step`` reads as the algorithm:

sample prompts -> rollout -> rewards -> (dynamic-sampling refill) -> group advantages
-> behaviour log-probs (recompute) -> reference log-probs (if KL) -> mini-batch updates (megatron fwd/bwd,
optimizer step with clipping) -> weight sync to the engine -> metrics -> periodic eval -> checkpoint
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rlvr.algorithms import AlgorithmConfig
from megatron_rlvr.algorithms.reductions import reduction_of
from megatron_rlvr.config import RunConfig
from megatron_rlvr.data import PromptLoader, build_train_dataset, build_train_loader
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.megatron.parallel import (
    DistInfo,
    all_gather_objects,
    all_reduce_max,
    broadcast_object,
    init_distributed,
    local_world_size,
)
from megatron_rlvr.megatron.policy import (
    ModelSource,
    build_model,
    build_optimizer,
    load_tokenizer,
    model_args_for,
    resolve_model_source,
    wrap_ddp,
)
from megatron_rlvr.megatron.policy import current_lr as optimizer_lr
from megatron_rlvr.models.build import takes_block_attention_mask
from megatron_rlvr.models.fusions import detect
from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.rewards import RewardManager
from megatron_rlvr.rollout.engine import RolloutEngine, SamplingParams
from megatron_rlvr.rollout.mismatch import mismatch_metrics as token_mismatch
from megatron_rlvr.trainer.batch import batch_metrics, build_sequences, informative, warn_all_too_long
from megatron_rlvr.trainer.checkpointer import Checkpointer, PolicyState, export_hf_folder
from megatron_rlvr.trainer.diagnostics import forgetting_probe
from megatron_rlvr.trainer.engine_setup import build_engine, engine_sleeps, sleep_engine, wake_all, wake_weights
from megatron_rlvr.trainer.evaluation import PeriodicEval
from megatron_rlvr.trainer.generation import EngineInfo, engine_info, generate_groups, tokenize_prompts
from megatron_rlvr.trainer.plot import plot_runs
from megatron_rlvr.trainer.resume import prepare_run_dir_on_ranks
from megatron_rlvr.trainer.run_lock import release
from megatron_rlvr.trainer.signals import StopSignals, exit_code_for
from megatron_rlvr.trainer.step_metrics import RunLogger, read_metrics
from megatron_rlvr.trainer.token_loss import StatsSpec
from megatron_rlvr.trainer.update import UpdateContext, compute_logprobs, my_sequence_ids, policy_update, recompute_ids
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
    engine: RolloutEngine
    """This rank's rollout engine (transformers or vLLM)."""
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
    update_ctx: UpdateContext
    """Everything the mini-batch updates need besides the model."""
    checkpointer: Checkpointer
    """Saves and resumes this run's checkpoints."""
    evaluator: PeriodicEval
    """The run's evaluation benchmarks."""
    ref_model: GPTModel | None = None
    """Frozen reference policy (reference-KL algorithms)."""
    step: int = 0
    """The step being run."""
    start_step: int = 0
    """The step resumed from (0 for a fresh run)."""

    @property
    def algo(self) -> AlgorithmConfig:
        return self.cfg.algorithm

    @property
    def policy(self) -> PolicyState:
        """What a checkpoint holds besides the data position."""
        return PolicyState(self.model, self.optimizer, self.scheduler, self.args)


# ------------------------------------------------------------------------------------------------------------------
# One RL step
# ------------------------------------------------------------------------------------------------------------------


def rl_step(t: Trainer, step: int) -> dict[str, float]:
    """One RL step on every rank; returns the step's metrics (identical on every rank)."""

    t0 = time.perf_counter()
    all_groups, kept, m = collect_groups(t, step)  # sample prompts -> rollout -> rewards (+ dynamic-sampling refill)
    sleep_engine(t.engine, t.cfg.rollout.sleep_level)  # GPU: the engine frees its memory while the trainer runs
    m.update(batch_metrics(all_groups, t.algo))  # reward / accuracy / group / length curves of everything generated
    seqs, adv_metrics = build_sequences(kept, t.algo)  # group statistics -> advantages (the algorithm preset)
    m.update(adv_metrics)
    if not any(s.train for s in seqs):  # empty or all-truncated batch: nothing to learn from
        m.update(refresh_engine(t, updated=False))
        m.update({"train/skipped": 1.0, "train/skipped_empty": 1.0, "time/step_s": time.perf_counter() - t0})
        if not all_groups and m.get("data/prompts_too_long", 0) > 0:
            m["train/skipped_all_too_long"] = 1.0
            warn_all_too_long(t, step, m)
        return m
    t1 = time.perf_counter()
    old, ref, lp = behaviour_and_reference_logprobs(t, seqs)  # old log-probs (recompute), reference log-probs (KL)
    m.update(lp)
    m["time/logprobs_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    fused = old_logprobs_from_update(t)  # the first update's forward gives its old log-probs (no recompute pass)
    m.update(
        policy_update(t.update_ctx, t.model, t.optimizer, seqs, old, ref, ref_logits_fn(t), old_from_forward=fused)
    )
    m["time/update_s"] = time.perf_counter() - t1
    if fused:  # the recompute pass's metrics, now that ``old`` is complete
        m["logprobs/nonfinite"] = max(m["logprobs/nonfinite"], m.pop("logprobs/nonfinite_update"))
        m.update(mismatch_metrics(t, seqs, old))
    t.scheduler.step(increment=1)
    m.update(refresh_engine(t, updated=m.get("train/updates", 0) > 0))  # weight sync to the engine
    m.update(forgetting_probe(t, all_groups, step))  # diagnostics: this step's mastered prompts, updated policy
    m["train/skipped"] = float(m.get("train/updates", 0) == 0)
    m["optim/lr"] = current_lr(t)
    m["time/step_s"] = time.perf_counter() - t0
    m["perf/tokens_per_s"] = sum(s.length for s in seqs) / max(m["time/step_s"], 1e-9)
    m["perf/generated_tokens"] = float(sum(s.response_len for s in seqs))
    return m


def refresh_engine(t: Trainer, updated: bool) -> dict[str, float]:
    """Wake the engine's weights, stream the policy into it when it changed (or when sleep dropped the engine's
    copy), then wake the KV cache: weights and KV cache are never both allocated during the sync."""

    dropped = engine_sleeps(t.engine) and t.cfg.rollout.sleep_level == 2
    wake_weights(t.engine)
    m = sync_weights(t.engine, t.model, t.args, t.dist.pg) if (updated or dropped) else {}
    wake_all(t.engine)
    return m


def collect_groups(t: Trainer, step: int):
    """Sample prompts, roll out, score; with dynamic sampling keep informative groups and refill from more prompts
    (at most train.dynamic_sampling_max_rounds rounds). Returns (all groups generated, kept groups, metrics)."""

    cfg, need = t.cfg, t.cfg.train.prompts_per_step
    params = sampling_params(cfg)
    all_groups, kept, m = [], [], {"data/prompts_too_long": 0.0, "rollout/rounds": 0.0}
    for round_idx in range(cfg.train.dynamic_sampling_max_rounds if t.algo.dapo.dynamic_sampling else 1):
        examples = t.loader.next_batch(need)
        examples, ids, too_long = tokenize_prompts(examples, t.tokenizer, cfg.data, cfg.rollout.max_prompt_len)
        m["data/prompts_too_long"] += too_long
        groups, stats = generate_groups(
            t.engine,
            t.reward_manager,
            t.tokenizer,
            examples,
            ids,
            params,
            t.engine_info,
            seed=cfg.train.seed,
            step=step,
            round_idx=round_idx,
            gather=all_gather_objects,
            reward_max_error_frac=cfg.reward.max_error_frac,
            reward_fn=cfg.reward.fn,
        )
        for k, v in stats.items():
            m[k] = m.get(k, 0.0) + v
        m["rollout/rounds"] += 1
        all_groups.extend(groups)
        if not t.algo.dapo.dynamic_sampling:
            kept = groups
            break
        kept.extend(g for g, keep in zip(groups, informative(groups, t.algo)) if keep)
        if len(kept) >= need:
            break
    kept = kept[:need]
    m["rollout/kept_groups"] = float(len(kept))
    m["rollout/kept_frac"] = len(kept) / max(len(all_groups), 1)
    return all_groups, kept, m


def behaviour_and_reference_logprobs(t: Trainer, seqs):
    """Old log-probs (recomputed with the current weights, or the engine's) and reference log-probs (when a KL
    term is on), for this data-parallel rank's sequences; plus train/inference mismatch metrics."""

    ctx = t.update_ctx
    ids = my_sequence_ids(ctx, len(seqs))
    m: dict[str, float] = {}
    if t.cfg.rollout.old_logprobs == "recompute":
        fused = old_logprobs_from_update(t)
        todo = recompute_ids(ctx, len(seqs), fused)
        old, bad = {}, 0.0
        if todo:
            old, _, bad = compute_logprobs(ctx, t.model, seqs, todo)
        if not fused:
            m.update(mismatch_metrics(t, seqs, old))
    else:
        old = {i: torch.tensor(seqs[i].rollout_logprobs, dtype=torch.float32) for i in ids}
        bad = 0.0
    ref = None
    if t.ref_model is not None and t.algo.ref_kl.estimator != "exact":
        ref, _, bad_ref = compute_logprobs(ctx, t.ref_model, seqs, ids)
        bad = max(bad, bad_ref)
    m["logprobs/nonfinite"] = bad
    return old, ref, m


def old_logprobs_from_update(t: Trainer) -> bool:
    """Recomputed behaviour log-probs of the first mini-batch come from the first update's own forward."""
    return t.cfg.rollout.old_logprobs == "recompute" and t.cfg.train.old_logprobs_from_update


def mismatch_metrics(t: Trainer, seqs, old) -> dict[str, float]:
    """Train/inference mismatch of the behaviour policy (megatron_rlvr.rollout.mismatch definitions) over this
    data-parallel rank's response tokens, combined over ranks (means weighted by tokens)."""

    pairs = [(lp, seqs[i].rollout_logprobs) for i, lp in old.items()]
    pairs = [(a, b) for a, b in pairs if len(a) == len(b) and len(a) > 0]
    local = None
    if t.dist.is_last_stage and t.dist.tp_rank == 0 and pairs:
        with native_torch():  # CPU tensors of this rank's response tokens: no CUDA call, skip the shims' handler
            lt = torch.cat([a for a, _ in pairs])[None]
            lr = torch.tensor([x for _, b in pairs for x in b], dtype=torch.float32)[None]
            if bool(torch.isfinite(lt).all()):
                ones = torch.ones_like(lt, dtype=torch.bool)
                local = {k: float(v) for k, v in token_mismatch(lt, lr, ones).items()}
    parts = [p for p in all_gather_objects(local) if p is not None]
    if not parts:
        return {}
    n = sum(p["mismatch/tokens"] for p in parts)
    out = {"mismatch/tokens": n}
    for key in parts[0]:
        kind = reduction_of(key)  # as megatron_rlvr.rollout.mismatch declares it
        if kind == "max":
            out[key] = max(p[key] for p in parts)
        elif kind == "min":
            out[key] = min(p[key] for p in parts)
        elif key != "mismatch/tokens":
            out[key] = sum(p[key] * p["mismatch/tokens"] for p in parts) / max(n, 1)
    return out


def ref_logits_fn(t: Trainer):
    """For the exact reference KL: the reference model's logits shard of a micro-batch (PP = 1)."""

    if t.ref_model is None or t.algo.ref_kl.estimator != "exact":
        return None

    def fn(mb):
        with torch.no_grad():
            dev = t.dist.device
            mask = mb.get("attention_mask")  # packed rows (megatron_rlvr.trainer.microbatch)
            mask = None if mask is None else mask.to(dev)
            return t.ref_model(mb["tokens"].to(dev), mb["position_ids"].to(dev), mask)

    return fn


def sampling_params(cfg: RunConfig):

    r = cfg.rollout
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=r.max_response_len,
        stop=tuple(r.stop),
    )


def current_lr(t: Trainer) -> float:

    return optimizer_lr(t.optimizer)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


def train(cfg: RunConfig, run_dir: str | None = None) -> int:
    """Run (or resume) training on this rank; returns the process exit code (0 done, else a signal's code)."""

    t = setup(cfg, run_dir)
    try:
        for step in range(t.start_step + 1, cfg.schedule.steps + 1):
            t.step = step
            metrics = rl_step(t, step)
            if t.evaluator.due(step):
                metrics.update(run_eval(t))
            t.logger.log(step, metrics)
            stop = int(all_reduce_max(t.signals.code))  # every rank must agree on stopping at this step
            if stop:
                t.checkpointer.save(step, t.policy, t.loader)
                code = exit_code_for(stop, cfg.checkpoint.sigterm_exit_code, cfg.checkpoint.sigusr1_exit_code)
                if t.dist.is_logger:
                    print(
                        f"{StopSignals.name(stop)}: checkpoint of step {step} saved in {t.run_dir}/checkpoints; "
                        f"exiting with {code}",
                        flush=True,
                    )
                return code
            t.checkpointer.maybe_save(step, t.policy, t.loader)
        t.step = max(t.start_step, cfg.schedule.steps)
        if cfg.eval.at_end and t.evaluator.sets and not t.evaluator.due(t.step):
            t.logger.log(t.step, run_eval(t))
        finish(t)
        return 0
    finally:
        teardown(t)


def setup(cfg: RunConfig, run_dir: str | None) -> Trainer:
    """Build every component on this rank and resume from the newest checkpoint when there is one."""

    signals = StopSignals().install()
    par = cfg.parallel
    d = init_distributed(par.tp, par.pp, cfg.train.seed, cfg.launch.backend, cfg.launch.collective_timeout_s)
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads(cfg, d.world_size))
    run_dir = broadcast_object(run_dir or resolve_run_dir(cfg) if d.rank == 0 else None)

    # torchrun / srun (no launcher of ours): rank 0 locks the run dir, checks a resume's changed options, writes
    # config.yaml; after `megatron-rlvr train` launched us, the launcher has done all three
    prepare_run_dir_on_ranks(cfg, run_dir, d.rank, broadcast_object)
    # local rank 0 first: a GGUF model is converted (and cached) once per node, not by every rank at once
    if d.local_rank == 0:
        source = resolve_model_source(cfg.model)
    torch.distributed.barrier()
    if d.local_rank != 0:
        source = resolve_model_source(cfg.model)
    tokenizer = load_tokenizer(source)
    args = model_args_for(source, cfg.model, par, cfg.train)
    model = wrap_ddp(build_model(args, source, cfg.train.seed, d.pg), par.distributed_optimizer)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.schedule, par, cfg.model.dtype)
    ref_model = None
    if cfg.keeps_ref_model:
        ref_args = model_args_for(source, cfg.model, par, cfg.train)
        ref_model = build_model(ref_args, source, cfg.train.seed, d.pg, trainable=False)
    info = engine_info(d.rank, d.world_size, par.rollout_tp)
    engine = build_engine(cfg, source, tokenizer, d)
    reward_manager = RewardManager(cfg.reward) if info.leader else None
    dataset = build_train_dataset(cfg.data)
    loader = build_train_loader(cfg.data, cfg.train.prompts_per_step, dp_rank=0, dp_world=1, dataset=dataset)
    logger = RunLogger(
        run_dir,
        enabled=d.is_logger,
        tensorboard=cfg.logging.tensorboard,
        progress=cfg.logging.progress,
        total_steps=cfg.schedule.steps,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    update_ctx = UpdateContext(
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
        seq_multiple=d.tp_size if par.sequence_parallel_on(torch.cuda.is_available()) else 1,
        n_per_group=cfg.rollout.n,
        num_mini_batches=cfg.train.num_mini_batches,
        ppo_epochs=cfg.train.ppo_epochs,
        tis_cap=cfg.rollout.tis_cap,
        skip_nonfinite=cfg.train.skip_nonfinite,
        pack_rows=pack_rows_on(cfg, model, ref_model),
    )
    t = Trainer(
        cfg=cfg,
        run_dir=run_dir,
        dist=d,
        source=source,
        tokenizer=tokenizer,
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
        update_ctx=update_ctx,
        checkpointer=Checkpointer(
            run_dir, cfg.checkpoint, d.pg, d.rank, cfg.algorithm.name, last_step=cfg.schedule.steps
        ),
        evaluator=PeriodicEval(cfg.eval, cfg.data, 0, 0),  # loaded below, inside the clean-up guard
        ref_model=ref_model,
    )
    try:
        t.evaluator = PeriodicEval.from_run_config(cfg)
        t.start_step = t.checkpointer.resume(t.policy, t.loader)
    except BaseException:  # e.g. a refused resume: stop the engine and reward workers, free the run dir
        teardown(t)
        raise

    sync_weights(t.engine, t.model, t.args, t.dist.pg)  # the engine starts from the (loaded) policy weights
    if d.is_logger:
        logger.truncate_after(t.start_step)
        skipped = f", {dataset.n_malformed} malformed rows skipped" if dataset.n_malformed else ""
        print(f"megatron-rlvr: data: {len(dataset.examples)} training prompts{skipped}", flush=True)
        where = f"resumed from step {t.start_step}" if t.start_step else "starting"
        print(
            f"megatron-rlvr: {where} | {cfg.logging.name} | algorithm {cfg.algorithm.name} | world {d.world_size} "
            f"(tp {d.tp_size}, pp {d.pp_size}, dp {d.dp_size}) | {d.backend} | {fusions_line()} "
            f"| {'packed rows' if update_ctx.pack_rows else 'one sequence per row'} | run dir {run_dir}",
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


def resolve_run_dir(cfg: RunConfig) -> str:
    if cfg.logging.run_dir:
        return cfg.logging.run_dir
    if os.environ.get("RLVR_RUN_DIR"):
        return os.environ["RLVR_RUN_DIR"]
    return os.path.join("runs", f"{cfg.logging.name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


def run_eval(t: Trainer) -> dict[str, float]:
    """avg@k / pass@k on every eval file with the current engine weights; metrics namespaced eval/<name>/..."""
    return t.evaluator.run(t.engine, t.reward_manager, t.tokenizer, t.engine_info)


def finish(t: Trainer) -> None:
    """After the last step: final checkpoint, optional HF export, optional plot, and where everything is."""

    cfg = t.cfg
    ckpt_path = t.checkpointer.save(t.step, t.policy, t.loader) if cfg.checkpoint.save_at_end else None
    hf_dir = None
    if cfg.checkpoint.export_hf:
        hf_dir = export_hf_folder(t.run_dir, t.policy, t.source, t.tokenizer, t.dist.pg, t.dist.is_logger)
    if not t.dist.is_logger:
        return
    plot_path = None
    if cfg.logging.plot_at_end:
        try:
            plot_path = plot_runs([t.run_dir])
        except ImportError:  # matplotlib is optional
            pass
        except ValueError as e:  # e.g. no step trained: the summary below still says where everything is
            print(f"megatron-rlvr: no curves: {e}", flush=True)
    print(summary(t, ckpt_path, hf_dir, plot_path), flush=True)


def summary(t: Trainer, ckpt_path, hf_dir, plot_path) -> str:
    hist = [h for h in read_metrics(t.logger.path) if h.get("reward/mean") is not None]
    lines = [f"megatron-rlvr: finished {t.cfg.logging.name} ({t.cfg.algorithm.name}) at step {t.step}"]
    recs = read_metrics(t.logger.path)
    skipped = sum(1 for h in recs if h.get("train/skipped"))
    if recs and skipped:
        lines.append(f"  WARNING: {skipped} of {len(recs)} steps were skipped (no update); see the progress lines")
    if hist:
        w = max(1, min(5, len(hist) // 4 or 1))
        first = sum(h["reward/mean"] for h in hist[:w]) / w
        last = sum(h["reward/mean"] for h in hist[-w:]) / w
        secs = sum(h.get("time/step_s", 0.0) for h in hist)
        lines.append(
            f"  mean training reward: {first:.3f} (first {w} steps) -> {last:.3f} (last {w} steps); "
            f"{len(hist)} steps in {secs:.0f} s"
        )
    lines.append(f"  run dir:     {t.run_dir}")
    lines.append(f"  config:      {os.path.join(t.run_dir, 'config.yaml')}")
    lines.append(f"  metrics:     {t.logger.path}")
    if t.logger.tb_dir:
        lines.append(f"  tensorboard: {t.logger.tb_dir}")
    if ckpt_path:
        lines.append(f"  checkpoint:  {ckpt_path}")
    if hf_dir:
        lines.append(f"  HF model:    {hf_dir}  (transformers.AutoModelForCausalLM.from_pretrained)")
    if plot_path:
        lines.append(f"  curves:      {plot_path}")
    return "\n".join(lines)


def teardown(t: Trainer) -> None:

    release(t.run_dir)
    if t.reward_manager is not None:
        t.reward_manager.close()
    if t.engine is not None:
        t.engine.close()
    t.logger.close()
    t.signals.uninstall()
