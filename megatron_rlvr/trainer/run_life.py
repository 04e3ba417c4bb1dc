"""The run life of a training rank: the run directory and its lock, the metrics log, stop signals, checkpoints and
periodic evaluation, and the steps (where the run resumed, which step runs). Built by :func:`build_run_life` on the
ranks that train; a rank that only rolls out holds only its stop signals."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.config import RunConfig
from megatron_rlvr.data import PromptLoader
from megatron_rlvr.eval.benchmarks import PeriodicEval
from megatron_rlvr.megatron.parallel import DistInfo, broadcast_object, init_distributed, local_world_size
from megatron_rlvr.rundir import heartbeat
from megatron_rlvr.rundir.checkpointer import Checkpointer, PolicyState
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.metrics_log import RunLogger
from megatron_rlvr.rundir.prepare import prepare_run_dir_on_ranks, resolve_run_dir
from megatron_rlvr.rundir.signals import StopSignals


@dataclass
class RunLife:
    """The run's life on one training rank."""

    cfg: RunConfig
    """The validated run config."""
    run_dir: str
    """Run directory (config.yaml, metrics.jsonl, checkpoints, export)."""
    is_logger: bool
    """This rank writes the logs and says what happens (global rank 0)."""
    logger: RunLogger
    """metrics.jsonl / TensorBoard / progress line (rank 0 writes)."""
    signals: StopSignals
    """SIGTERM / SIGUSR1 handling (checkpoint, then exit)."""
    checkpointer: Checkpointer
    """Saves and resumes this run's checkpoints."""
    evaluator: PeriodicEval
    """The run's evaluation benchmarks."""
    lock: RunLock | None = None
    """The run directory's lock when this process holds it (None: another rank or the launcher does)."""
    start_step: int = 0
    """The step resumed from (0 for a fresh run)."""
    step: int = 0
    """The step being run (after the loop: the last step)."""
    warned_all_too_long: bool = False
    """The run has said once that every prompt of a step was too long."""

    def resume(self, policy: PolicyState, loader: PromptLoader) -> int:
        """Load the newest checkpoint into ``policy`` and ``loader`` (none: a fresh run); the step it resumed from.
        The metrics log forgets the steps after it (they are run again)."""
        self.start_step = self.checkpointer.resume(policy, loader)
        if self.is_logger:
            self.logger.truncate_after(self.start_step)
        return self.start_step

    def close(self) -> None:
        heartbeat.stop()
        if self.lock is not None:
            self.lock.release()
        self.logger.close()
        self.signals.uninstall()


def start_rank(cfg: RunConfig) -> DistInfo:
    """Join the job (process groups at the run's layout) and set a CPU rank's torch threads."""
    par = cfg.parallel
    d = init_distributed(
        par.tp,
        par.pp,
        cfg.train.seed,
        cfg.launch.backend,
        cfg.launch.collective_timeout_s,
        ep=par.ep,
        etp=par.etp,
        cp=par.cp,
    )
    set_cpu_threads(cfg, d.world_size)
    return d


def set_cpu_threads(cfg: RunConfig, world_size: int) -> None:
    """A CPU rank's torch intra-op threads (``LaunchConfig.cpu_threads``); GPU ranks keep torch's default."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.launch.cpu_threads(local_world_size(world_size)))


def build_run_life(
    cfg: RunConfig, d: DistInfo, run_dir: str | None, lock: RunLock | None, signals: StopSignals
) -> RunLife:
    """The run directory agreed by every rank (rank 0's choice), prepared once: under torchrun / srun (no launcher
    of ours) rank 0 locks it, checks a resume's changed options and writes config.yaml; after `megatron-rlvr train`
    launched the ranks, the launcher has done all three (``lock``: the lock when this process holds it)."""
    run_dir = broadcast_object(run_dir or resolve_run_dir(cfg) if d.rank == 0 else None)
    if lock is None:
        lock = prepare_run_dir_on_ranks(cfg, run_dir, d.rank, broadcast_object)
    logger = RunLogger.for_run(cfg, run_dir, enabled=d.is_logger)
    try:
        evaluator = PeriodicEval.from_run_config(cfg)
    except BaseException:  # e.g. an unreadable eval file: free the run dir
        logger.close()
        if lock is not None:
            lock.release()
        raise
    checkpointer = Checkpointer(run_dir, cfg.checkpoint, d.pg, d.rank, cfg.algorithm.name, last_step=cfg.schedule.steps)
    life = RunLife(cfg, run_dir, d.is_logger, logger, signals, checkpointer, evaluator, lock)
    # read when a collective times out, to name the rank that stopped and its last step
    heartbeat.start(run_dir, "training", cfg.launch.collective_timeout_s, step=lambda: life.step)
    return life
