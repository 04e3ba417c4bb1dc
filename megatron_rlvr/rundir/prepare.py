"""Preparing a run directory, written once for every way a run starts (the local launcher, a single process,
torchrun / srun ranks): choose it, lock it, check a resume's changed options against its config.yaml, write the
resolved config.yaml."""

from __future__ import annotations

import os
import time

from megatron_rlvr.config import RunConfig, dump_yaml
from megatron_rlvr.rundir.checkpointer import ResumeError
from megatron_rlvr.rundir.lock import RunLock, hold, hold_collective
from megatron_rlvr.rundir.resume import check_resume_changes


def resolve_run_dir(cfg: RunConfig) -> str:
    """``logging.run_dir``, else ``$RLVR_RUN_DIR``, else ``runs/<name>-<date>-<time>``."""
    if cfg.logging.run_dir:
        return cfg.logging.run_dir
    if os.environ.get("RLVR_RUN_DIR"):
        return os.environ["RLVR_RUN_DIR"]
    return os.path.join("runs", f"{cfg.logging.name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


def write_run_config(cfg: RunConfig, run_dir: str) -> str:
    """Check a resume's changed options (printing the applied ones; ResumeError for refused ones), then write the
    resolved config into ``run_dir/config.yaml``; returns its path. The run directory must be locked by the caller."""
    cfg.logging.run_dir = run_dir
    for line in check_resume_changes(cfg, run_dir):
        print(f"megatron-rlvr: resuming with a changed option: {line}", flush=True)
    path = os.path.join(run_dir, "config.yaml")
    try:
        dump_yaml(cfg, path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror}; choose a writable logging.run_dir") from None
    return path


def prepare_run_dir(cfg: RunConfig, run_dir: str) -> RunLock | None:
    """Lock ``run_dir`` (before anything in it is written: a live run's config stays intact) and write its config;
    returns the lock, which the caller releases (None: this process's launcher holds it and has prepared the run)."""
    lock = hold(run_dir)
    if lock is None:
        return None
    try:
        if lock.takeover_note():
            print(lock.takeover_note(), flush=True)
        write_run_config(cfg, run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def prepare_run_dir_on_ranks(cfg: RunConfig, run_dir: str, rank: int, broadcast) -> RunLock | None:
    """In every rank (torchrun / srun, no launcher of ours): rank 0 locks ``run_dir`` and writes its config as
    :func:`prepare_run_dir` does; errors are raised on every rank. Returns rank 0's lock (None elsewhere, and when a
    launcher holds the lock)."""
    lock = hold_collective(run_dir, rank, broadcast)
    err = None
    if lock is not None:
        try:
            write_run_config(cfg, run_dir)
        except Exception as e:  # on rank 0 alone: it must reach every rank, or they wait in the broadcast forever
            err = e if isinstance(e, ResumeError) else ResumeError(f"{run_dir}/config.yaml: {type(e).__name__}: {e}")
    err = broadcast(err)
    if err is not None:
        if lock is not None:
            lock.release()
        raise err
    return lock
