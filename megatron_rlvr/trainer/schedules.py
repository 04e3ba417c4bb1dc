"""Which schedule a run uses: the synchronous colocated one (``megatron_rlvr.trainer.colocated``, the default) or,
with ``parallel.rollout_ranks > 0``, the disaggregated one (``megatron_rlvr.trainer.disaggregated``). The two are
siblings over the same parts, stages and run-loop helpers; only this module knows both."""

from __future__ import annotations

from megatron_rlvr.config import RunConfig
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.trainer import colocated, disaggregated


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None) -> int:
    """Run (or resume) training on this rank with the run's schedule; returns the process exit code."""
    if cfg.parallel.rollout_ranks:
        return disaggregated.train(cfg, run_dir, lock)
    return colocated.train(cfg, run_dir, lock)
