"""``megatron-rlvr train [CONFIG | RUN_DIR] [key=value ...]``: validate the whole config before any rank starts,
prepare the run directory (``megatron_rlvr.rundir.prepare``), then train in this process (one rank), start
``launch.nproc`` local ranks (``megatron_rlvr.rundir.local_ranks``), or, under torchrun / srun (RANK / WORLD_SIZE or
SLURM_PROCID set), be one of the ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_rlvr.config import (
    ONE_OFF_OPTIONS,
    ConfigError,
    RunConfig,
    check_layout,
    default_world_size,
    load_run_config,
)
from megatron_rlvr.data import build_train_dataset
from megatron_rlvr.rundir.checkpointer import discard_pending_config
from megatron_rlvr.rundir.local_ranks import launch_local, start_parent_watchdog
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.prepare import config_to_start, prepare_run_dir, resolve_run_dir, run_dir_of_config, same_dir


def split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """(config path or None, overrides); a run directory stands for its config.yaml (resume it). A word that is not
    ``key=value`` (``train schedule.steps 5``) or a folder without config.yaml is one ConfigError saying what to
    type instead."""

    config, overrides = None, items
    if items and "=" not in items[0]:
        config, overrides = items[0], items[1:]
        if os.path.isdir(config):
            if not os.path.isfile(os.path.join(config, "config.yaml")):
                raise ConfigError(
                    f"{config} is a folder with no config.yaml in it: name a config file (e.g. configs/tiny.yaml) or "
                    "a run directory (a folder holding a run's config.yaml)"
                )
            config = os.path.join(config, "config.yaml")
        elif not os.path.exists(config) and _looks_like_a_key(config):
            value = overrides[0] if overrides and "=" not in overrides[0] else "VALUE"
            raise ConfigError(
                f"{config!r} is not a config file; options are given as key=value, one word: {config}={value}"
            )
    for i, word in enumerate(overrides):
        if "=" in word:
            continue
        after = overrides[i + 1] if i + 1 < len(overrides) and "=" not in overrides[i + 1] else "VALUE"
        before = overrides[i - 1] if i > 0 else None
        if _looks_like_a_key(word):
            hint = f"{word}={after}"
        elif before is not None and "=" not in before and _looks_like_a_key(before):
            hint = f"{before}={word}"
        else:
            hint = "section.key=value"
        raise ConfigError(f"{word!r} is not key=value: options are given as one word each, e.g. {hint}")
    return config, overrides


def _looks_like_a_key(word: str) -> bool:
    """``schedule.steps``: a dotted option name (a known section first), not a path."""

    sections = set(RunConfig.__dataclass_fields__)
    return "/" not in word and not word.endswith((".yaml", ".yml")) and word.split(".", 1)[0] in sections


def load_checked(config: str | None, overrides: list[str], world_size: int | None = None, check_data: bool = True):
    """Load + validate the config, including the layout for ``world_size`` ranks (default: the launch's) and, with
    ``check_data``, the training data (malformed rows are reported as file:line before any rank starts). Returns
    (cfg, world). A run directory's own config.yaml trains in that directory, wherever it was first started."""

    cfg = load_run_config(config, overrides)
    here = run_dir_of_config(config, overrides)
    if here is not None and not same_dir(here, cfg.logging.run_dir):  # another spelling of it is no change
        cfg.logging.run_dir = here
    world = world_size or default_world_size(cfg)
    check_layout(cfg, world)
    if check_data and cfg.data.train_files:
        build_train_dataset(cfg.data)
    return cfg, world


def one_off_overrides(cfg) -> list[str]:
    """The one-off options of this invocation (not in config.yaml) as overrides for the ranks' command line."""

    out = []
    for (section, key), default in ONE_OFF_OPTIONS.items():
        value = getattr(getattr(cfg, section), key)
        if value != default:
            out.append(f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


@dataclass
class PreparedRun:
    """A validated config and its prepared run directory (locked, config.yaml written)."""

    cfg: RunConfig
    run_dir: str
    config_path: str
    """What the ranks are started on: ``run_dir/config.yaml``, or a resume's pending config (``config_to_start``)."""
    world_size: int
    lock: RunLock | None
    """This process's lock of the run directory (None: its launcher holds it); release it when done."""
    written: bool = True
    """config.yaml was written (a dry run leaves an existing run's config.yaml as it was)."""


def prepare_run(
    config: str | None, overrides: list[str], world_size: int | None = None, dry_run: bool = False
) -> PreparedRun:
    """Load and validate the config, then prepare its run directory (megatron_rlvr.rundir.prepare; ``dry_run``: an
    existing run's directory is checked, not changed)."""

    cfg, world = load_checked(config, overrides, world_size)
    run_dir = resolve_run_dir(cfg)
    existed = os.path.isfile(os.path.join(run_dir, "config.yaml"))
    lock = prepare_run_dir(cfg, run_dir, dry_run)
    return PreparedRun(cfg, run_dir, config_to_start(run_dir), world, lock, written=not (dry_run and existed))


def train_main(args: list[str], dry_run: bool = False) -> int:
    from megatron_rlvr.megatron.parallel import env_rank_info  # megatron-core (seconds): only when joining a job

    config, overrides = split_config_and_overrides(args)
    joined = env_rank_info()
    if joined is not None:
        return _train_as_rank(config, overrides, joined)
    run = prepare_run(config, overrides, dry_run=dry_run)
    cfg, run_dir, path, world, lock = run.cfg, run.run_dir, run.config_path, run.world_size, run.lock
    if dry_run:
        if lock is not None:
            lock.release()
        kept = "" if run.written else " (dry run: the run's config.yaml left unchanged)"
        print(f"config OK: {world} rank(s), run dir {run_dir}, resolved config {path}{kept}")
        return 0

    try:
        if world == 1:
            from megatron_rlvr.trainer.schedules import train  # megatron-core (seconds): only in a process that trains

            return train(cfg, run_dir, lock=lock)

        threads = cfg.launch.cpu_threads(world)
        print(f"megatron-rlvr: launching {world} ranks ({cfg.launch.backend} backend), run dir {run_dir}", flush=True)
        return launch_local(
            ["train", path, *one_off_overrides(cfg)],
            world,
            master_addr=cfg.launch.master_addr,
            master_port=cfg.launch.master_port,
            threads=threads,
            lock_fd=lock.fd if lock is not None else None,
        )
    finally:  # a resume that stopped before its checkpoint loaded (a failure, a signal): config.yaml as it was
        discard_pending_config(run_dir)


def _train_as_rank(config: str | None, overrides: list[str], joined: dict) -> int:
    """This process is one rank of a launched job (our launcher, torchrun or srun)."""
    from megatron_rlvr.trainer.schedules import train  # megatron-core (seconds): only in a process that trains

    start_parent_watchdog()
    cfg, _ = load_checked(config, overrides, joined["world_size"], check_data=False)
    return train(cfg, cfg.logging.run_dir)
