"""``megatron-rlvr``: the command line.

    megatron-rlvr train [CONFIG] [key=value ...]     train (default CONFIG: configs/tiny.yaml); re-running a run
                                                     directory's config.yaml resumes it from its newest checkpoint
    megatron-rlvr eval MODEL [--files F ...]         avg@k / pass@k of an HF folder (or a run dir's exported hf/)
    megatron-rlvr convert ...                        checkpoint conversion (megatron_rlvr.models' convert tool)
    megatron-rlvr plan CONFIG ...                    parallel layout check and per-GPU memory estimate
    megatron-rlvr plot RUN_DIR [RUN_DIR ...]         PNG curves of one run, or several overlaid

``train`` validates the whole config before any rank starts, writes the resolved config into the run directory,
then on one machine starts ``launch.nproc`` ranks (gloo on CPU, NCCL on GPU); under torchrun (RANK / WORLD_SIZE
set) or srun (SLURM_PROCID set) this process is one of the ranks and joins the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings


def _quiet() -> None:
    # Expected on CPU machines, once per module per process: noise in every rank's log.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="megatron")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        path = items[0]
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.yaml")):
            path = os.path.join(path, "config.yaml")  # a run directory: resume it
        return path, items[1:]
    return None, items


# ----------------------------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------------------------


def prepare_run(config: str | None, overrides: list[str], world_size: int | None = None):
    """Load + validate the config (including the layout for ``world_size`` ranks and the data files), choose the
    run directory, lock it (megatron_rlvr/trainer/run_lock.py), check a resume against the run's config.yaml
    (megatron_rlvr/trainer/resume.py), write the resolved config there. Returns (cfg, run_dir, config_path,
    world_size); the lock stays held by this process (``run_lock.release(run_dir)`` frees it)."""
    from megatron_rlvr.config import check_layout, default_world_size, dump_yaml, load_run_config
    from megatron_rlvr.trainer import run_lock
    from megatron_rlvr.trainer.resume import check_resume_changes
    from megatron_rlvr.trainer.train import resolve_run_dir

    cfg = load_run_config(config, overrides)
    world = world_size or default_world_size(cfg)
    check_layout(cfg, world)
    if cfg.data.train_files:  # malformed rows are reported (file:line) now, not after the ranks started
        from megatron_rlvr.data import build_train_dataset

        build_train_dataset(cfg.data)
    run_dir = resolve_run_dir(cfg)
    cfg.logging.run_dir = run_dir
    lock = run_lock.hold(run_dir)  # before anything in the run dir is written: a live run's config stays intact
    try:
        if lock is not None and lock.takeover_note():
            print(lock.takeover_note(), flush=True)
        for line in check_resume_changes(cfg, run_dir):
            print(f"megatron-rlvr: resuming with a changed option: {line}", flush=True)
        path = os.path.join(run_dir, "config.yaml")
        try:
            dump_yaml(cfg, path)
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror}; choose a writable logging.run_dir") from None
    except BaseException:
        run_lock.release(run_dir)
        raise
    return cfg, run_dir, path, world


def one_off_overrides(cfg) -> list[str]:
    """The one-off options of this invocation (not in config.yaml) as overrides for the ranks' command line."""
    from megatron_rlvr.config import ONE_OFF_OPTIONS

    out = []
    for (section, key), default in ONE_OFF_OPTIONS.items():
        value = getattr(getattr(cfg, section), key)
        if value != default:
            out.append(f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def cmd_train(ns: argparse.Namespace) -> int:
    from megatron_rlvr.megatron.parallel import env_rank_info
    from megatron_rlvr.trainer import run_lock

    config, overrides = _split_config_and_overrides(ns.args)
    joined = env_rank_info()
    if joined is not None:
        return _train_as_rank(config, overrides, joined)
    cfg, run_dir, path, world = prepare_run(config, overrides)
    if ns.dry_run:
        run_lock.release(run_dir)
        print(f"config OK: {world} rank(s), run dir {run_dir}, resolved config {path}")
        return 0
    if world == 1:
        from megatron_rlvr.trainer.train import train

        _quiet()
        return train(cfg, run_dir)
    from megatron_rlvr.trainer.spawn import launch_local

    threads = cfg.launch.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    print(f"megatron-rlvr: launching {world} ranks ({cfg.launch.backend} backend), run dir {run_dir}", flush=True)
    lock = run_lock._HELD.get(os.path.realpath(run_dir))
    return launch_local(
        path,
        world,
        master_addr=cfg.launch.master_addr,
        master_port=cfg.launch.master_port,
        threads=threads,
        overrides=one_off_overrides(cfg),
        lock_fd=lock.fd if lock is not None else None,
    )


def _train_as_rank(config: str | None, overrides: list[str], joined: dict) -> int:
    """This process is one rank of a launched job (our launcher, torchrun or srun)."""
    from megatron_rlvr.config import check_layout, load_run_config
    from megatron_rlvr.trainer.spawn import start_parent_watchdog
    from megatron_rlvr.trainer.train import train

    _quiet()
    start_parent_watchdog()
    cfg = load_run_config(config, overrides)
    check_layout(cfg, joined["world_size"])
    code = train(cfg, cfg.logging.run_dir)
    return code


# ----------------------------------------------------------------------------------------------------------------
# other subcommands
# ----------------------------------------------------------------------------------------------------------------


def cmd_plot(ns: argparse.Namespace) -> int:
    try:
        from megatron_rlvr.trainer.plot import plot_runs
    except ImportError as e:
        print(f"megatron-rlvr plot: needs matplotlib ({e}): pip install matplotlib", file=sys.stderr)
        return 2
    try:
        path = plot_runs(ns.run_dirs, out=ns.out)
    except ValueError as e:
        print(f"megatron-rlvr plot: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from megatron_rlvr.trainer.eval_cli import eval_main

    return eval_main(ns)


def cmd_plan(argv: list[str]) -> int:
    from megatron_rlvr.planner import plan_main

    return plan_main(argv)


def cmd_convert(argv: list[str]) -> int:
    from megatron_rlvr.models.convert import convert_main  # in the installed package (tools/ is a thin wrapper)

    return int(convert_main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-rlvr",
        description=__doc__.split("\n\n")[0],
        epilog="--debug (anywhere) or RLVR_DEBUG=1: show full tracebacks instead of one-line errors",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (default config: configs/tiny.yaml)")
    t.add_argument("args", nargs="*", help="[CONFIG.yaml | RUN_DIR] [section.key=value ...]")
    t.add_argument("--dry-run", action="store_true", help="validate the config, write it to the run dir, stop")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="avg@k / pass@k on jsonl benchmarks")
    e.add_argument("model", help="HF model folder, or a run directory (its exported hf/ folder)")
    e.add_argument("--files", nargs="+", required=True, help="benchmark .jsonl/.parquet files")
    e.add_argument("--k", type=int, default=4, help="samples per problem (default 4)")
    e.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--max-tokens", type=int, default=1024, help="generation limit (default 1024)")
    e.add_argument("--max-prompt-len", type=int, default=2048)
    e.add_argument("--max-problems", type=int, default=None, help="first N problems of each file")
    run_default = "a run directory's own setting, else "
    e.add_argument("--reward", default=None, help=f"reward fn: math, gsm8k, or a dotted path ({run_default}math)")
    e.add_argument("--extraction", default=None, help=f"answer extraction: boxed, lenient, full ({run_default}boxed)")
    e.add_argument("--template", default=None, help=f"prompt template: chat or plain ({run_default}chat)")
    e.add_argument("--prompt-template", default=None, help="text around the problem, with {problem}")
    e.add_argument("--tokenizer", default=None, help="tokenizer folder, when MODEL has none")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--batch-rows", type=int, default=64, help="sequences decoded together")
    e.add_argument("--out", default=None, help="also write the results as JSON here")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="PNG curves of one or more runs")
    p.add_argument("run_dirs", nargs="+", help="run directories (several are overlaid)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run dir>/curves.png)")
    p.set_defaults(func=cmd_plot)

    sub.add_parser("plan", help="check a parallel layout and estimate per-GPU memory", add_help=False)
    sub.add_parser("convert", help="convert checkpoints (megatron <-> HF)", add_help=False)
    return ap


def _user_errors() -> tuple:
    """Exceptions that are the user's to fix: their message names the file, field or option and the fix."""
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.trainer.run_lock import RunDirLocked

    return (
        ValueError,
        RunDirLocked,
        RewardFailure,
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
    )


def _report(command: str, e: BaseException) -> None:
    """One clear line instead of a traceback; an unexpected error's traceback goes to a file named in the line."""
    import tempfile
    import traceback

    msg = str(e).strip() or type(e).__name__
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.trainer.resume import ResumeError
    from megatron_rlvr.trainer.run_lock import RunDirLocked

    collective = (RewardFailure, ResumeError, RunDirLocked)  # raised identically on every rank: rank 0 says it
    if isinstance(e, collective) and os.environ.get("RANK", "0") != "0":
        return
    if isinstance(e, _user_errors()):
        print(f"megatron-rlvr {command}: error: {msg}", file=sys.stderr, flush=True)
        return
    parallel = sys.modules.get("megatron_rlvr.megatron.parallel")  # loaded: a collective may have timed out
    if parallel is not None:
        msg = parallel.collective_timeout_message(e) or msg
    fd, path = tempfile.mkstemp(prefix=f"megatron-rlvr-{command}-", suffix=".traceback.txt")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(e, file=f)
    first = msg.splitlines()[0][:300]
    print(
        f"megatron-rlvr {command}: error: {type(e).__name__}: {first} (traceback in {path}; --debug or RLVR_DEBUG=1 "
        "prints it)",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("RLVR_DEBUG", "") not in ("", "0")
    if "--debug" in argv:  # anywhere on the line, for every subcommand
        argv.remove("--debug")
        debug = True
        os.environ["RLVR_DEBUG"] = "1"  # the ranks of a local launch inherit it
    command = argv[0] if argv else ""
    try:
        # plan / convert own their argument parsing
        if argv and argv[0] == "plan":
            return cmd_plan(argv[1:])
        if argv and argv[0] == "convert":
            return cmd_convert(argv[1:])
        ns = build_parser().parse_args(argv)
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print(f"megatron-rlvr {command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        if debug:
            raise
        _report(command, e)
        return 2 if isinstance(e, _user_errors()) else 1


if __name__ == "__main__":
    sys.exit(main())
