"""Which schedule a run uses: the synchronous colocated one (``megatron_rlvr.trainer.colocated``, the default) or,
with ``parallel.rollout_ranks > 0``, the disaggregated one (``megatron_rlvr.trainer.disaggregated``). The two are
siblings over the same parts, stages and run-loop helpers; only this module knows both. With
``parallel.judge_ranks > 0`` the roles are made here, and the last judge_ranks ranks only serve the reward judge
(``megatron_rlvr.trainer.judge_setup.judge_role``)."""

from __future__ import annotations

from megatron_rlvr.config import RunConfig
from megatron_rlvr.megatron.roles import JUDGE, init_roles
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.trainer import colocated, disaggregated
from megatron_rlvr.trainer.judge_setup import judge_role


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None) -> int:
    """Run (or resume) training on this rank with the run's schedule; returns the process exit code."""
    par = cfg.parallel
    if par.judge_ranks:
        roles = init_roles(
            par.rollout_ranks, cfg.launch.backend, cfg.launch.collective_timeout_s, par.judge_ranks, par.rollout_tp
        )
        if roles.role == JUDGE:
            if lock is not None:  # a launcher's lock is held by the launcher; a judge rank never writes the run dir
                lock.release()
            return judge_role(cfg, roles)
        if par.rollout_ranks:
            return disaggregated.train(cfg, run_dir, lock, roles)
        return colocated.train(cfg, run_dir, lock, roles)
    if cfg.parallel.rollout_ranks:
        return disaggregated.train(cfg, run_dir, lock)
    return colocated.train(cfg, run_dir, lock)
