"""Which schedule a run uses: the synchronous colocated one (``megatron_rlvr.trainer.colocated``, the default) or,
with ``parallel.rollout_ranks > 0``, the disaggregated one (``megatron_rlvr.trainer.disaggregated``)."""

from __future__ import annotations

from megatron_rlvr.config import RunConfig
from megatron_rlvr.rundir.lock import RunLock


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None) -> int:
    """Run (or resume) training on this rank with the run's schedule; returns the process exit code."""
    if cfg.parallel.rollout_ranks:
        from megatron_rlvr.trainer.disaggregated import train as train_disaggregated

        return train_disaggregated(cfg, run_dir, lock)
    from megatron_rlvr.trainer.colocated import train as train_colocated

    return train_colocated(cfg, run_dir, lock)
