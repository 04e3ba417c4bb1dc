"""Preparing a run directory, written once for every way a run starts (the local launcher, a single process,
torchrun / srun ranks): choose it, lock it, check a resume's changed options against its config.yaml, write the
resolved config.yaml."""

from __future__ import annotations

import os
import time

from megatron_rlvr.config import RunConfig, dump_yaml
from megatron_rlvr.config.loader import is_resolved_config
from megatron_rlvr.rundir.checkpointer import ResumeError, discard_pending_config, pending_config
from megatron_rlvr.rundir.lock import RunLock, hold, hold_collective
from megatron_rlvr.rundir.resume import check_resume_changes, will_resume


def run_dir_of_config(config_path: str | None, overrides: list[str]) -> str | None:
    """The run directory a run's own ``config.yaml`` belongs to: the folder it is in. A run is located by where its
    config is, not by the ``logging.run_dir`` recorded inside: a copied, moved or renamed run directory (or one
    resumed from another working directory, its recorded path being relative) must resume in place, never write
    into the path it was first started at. None for any other config file, and when ``logging.run_dir=`` is given
    on the command line (that wins)."""
    if not config_path or any(o.split("=", 1)[0].strip() == "logging.run_dir" for o in overrides):
        return None
    if os.path.basename(config_path) != "config.yaml" or not is_resolved_config(config_path):
        return None
    return os.path.normpath(os.path.dirname(config_path) or ".")


def same_dir(a: str, b: str | None) -> bool:
    """``a`` and ``b`` name the same existing directory."""
    try:
        return bool(b) and os.path.samefile(a, b)
    except OSError:
        return False


def resolve_run_dir(cfg: RunConfig) -> str:
    """``logging.run_dir``, else ``$RLVR_RUN_DIR``, else ``runs/<name>-<date>-<time>``."""
    if cfg.logging.run_dir:
        return cfg.logging.run_dir
    if os.environ.get("RLVR_RUN_DIR"):
        return os.environ["RLVR_RUN_DIR"]
    return os.path.join("runs", f"{cfg.logging.name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


PREVIOUS_RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "tensorboard",
    "wandb",
    "wandb_run_id",
    "hf",
    "curves.png",
    "config.yaml",
)
"""What a run writes into its directory; ``checkpoint.resume=never`` on a run that has some sets them aside."""


def set_aside_previous_run(run_dir: str) -> str | None:
    """``checkpoint.resume=never`` on a directory that holds a run (checkpoints or metrics): move that run's outputs
    into ``run_dir/previous-run-<time>/`` (a rename, nothing copied or lost). Left in place, the new run's
    metrics.jsonl replaced the old one's while the old, newer checkpoints stayed: the next plain resume continued from
    the old run's newest step and keep-last pruned the new run's checkpoints. Returns the folder (None: no run)."""
    if not any(os.path.exists(os.path.join(run_dir, n)) for n in ("checkpoints", "metrics.jsonl")):
        return None
    base = os.path.join(run_dir, f"previous-run-{time.strftime('%Y%m%d-%H%M%S')}")
    dest, i = base, 1
    while os.path.exists(dest):
        i += 1
        dest = f"{base}-{i}"
    os.makedirs(dest)
    for name in PREVIOUS_RUN_OUTPUTS:
        if os.path.exists(os.path.join(run_dir, name)):
            os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def config_to_start(run_dir: str) -> str:
    """The config file the ranks of a prepared run start on: a resume's pending config (it becomes config.yaml once
    the checkpoint has loaded), else config.yaml."""
    pending = pending_config(run_dir)
    return pending if os.path.isfile(pending) else os.path.join(run_dir, "config.yaml")


def write_run_config(cfg: RunConfig, run_dir: str, dry_run: bool = False) -> str:
    """Check a resume's changed options (printing the applied ones; ResumeError for refused ones), set aside a
    previous run's outputs when this one starts over (``checkpoint.resume=never``), then write the resolved config;
    returns the path written. A new run's goes into ``run_dir/config.yaml``; a resume's into its pending config
    (``config_to_start``), which the checkpointer makes the run's config.yaml once the checkpoint has loaded and
    discards if it fails, so that a failed resume changes nothing in the run. The run directory must be locked by
    the caller. ``dry_run``: check only, an existing run's directory is left exactly as it was (a fresh one gets
    its config.yaml)."""
    cfg.logging.run_dir = run_dir
    for line in check_resume_changes(cfg, run_dir):
        print(f"megatron-rlvr: resuming with a changed option: {line}", flush=True)
    path = os.path.join(run_dir, "config.yaml")
    if dry_run and os.path.exists(path):
        return path
    discard_pending_config(run_dir)  # a killed resume's
    if not dry_run and will_resume(cfg, run_dir):
        path = pending_config(run_dir)
    if cfg.checkpoint.resume == "never":
        aside = set_aside_previous_run(run_dir)
        if aside is not None:
            print(
                f"megatron-rlvr: checkpoint.resume=never: starting over; the earlier run's checkpoints, metrics and "
                f"config moved to {aside} (delete it when no longer needed)",
                flush=True,
            )
    try:
        dump_yaml(cfg, path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror}; choose a writable logging.run_dir") from None
    return path


def prepare_run_dir(cfg: RunConfig, run_dir: str, dry_run: bool = False) -> RunLock | None:
    """Lock ``run_dir`` (before anything in it is written: a live run's config stays intact) and write its config
    (``dry_run``: see ``write_run_config``); returns the lock, which the caller releases (None: this process's
    launcher holds it and has prepared the run)."""
    lock = hold(run_dir)
    if lock is None:
        return None
    try:
        if lock.takeover_note():
            print(lock.takeover_note(), flush=True)
        write_run_config(cfg, run_dir, dry_run)
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
