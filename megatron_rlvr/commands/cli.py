"""``megatron-rlvr``: the command line.

    megatron-rlvr train [CONFIG] [key=value ...]     train (default CONFIG: configs/tiny.yaml); re-running a run
                                                     directory's config.yaml resumes it from its newest checkpoint
    megatron-rlvr eval MODEL [--files F ...]         avg@k / pass@k of an HF folder (or a run dir's exported hf/)
    megatron-rlvr convert ...                        checkpoint conversion (megatron_rlvr.models' convert tool)
    megatron-rlvr plan CONFIG ...                    parallel layout check and per-GPU memory estimate
    megatron-rlvr plot RUN_DIR [RUN_DIR ...]         PNG curves of one run, or several overlaid
    megatron-rlvr tool NAME [ARG]                    call a tool (python FILE, calculator EXPR, pkg.mod:fn JSON) in
                                                     the sandbox, as a multi-turn rollout does

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


# ----------------------------------------------------------------------------------------------------------------
# other subcommands
# ----------------------------------------------------------------------------------------------------------------


def cmd_plot(ns: argparse.Namespace) -> int:
    try:
        from megatron_rlvr.rundir.plot import plot_runs  # matplotlib is optional: only for this command
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


def cmd_train(ns: argparse.Namespace) -> int:
    from megatron_rlvr.commands.train_cli import train_main  # each command imports its own stack when it runs

    _quiet()
    return train_main(ns.args, dry_run=ns.dry_run)


def cmd_eval(ns: argparse.Namespace) -> int:
    from megatron_rlvr.commands.eval_cli import eval_main  # each command imports its own stack when it runs

    return eval_main(ns)


def cmd_plan(argv: list[str]) -> int:
    from megatron_rlvr.planner import plan_main  # each command imports its own stack when it runs

    return plan_main(argv)


def cmd_convert(argv: list[str]) -> int:
    from megatron_rlvr.commands.convert_cli import convert_main  # each command imports its own stack when it runs

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
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, write it to a new run dir (an existing run is left unchanged), stop",
    )
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
    e.add_argument("--batch-rows", type=int, default=None, help="sequences decoded together (default: hf 64, vllm 256)")
    e.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="generation engine (default hf)")
    e.add_argument("--tp", type=int, default=1, help="vLLM tensor parallelism: ranks (devices) per engine")
    e.add_argument(
        "--gpu-memory-utilization", type=float, default=0.85, help="vLLM on CUDA: fraction of GPU memory (0.85)"
    )
    e.add_argument("--out", default=None, help="also write the results as JSON here")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="PNG curves of one or more runs")
    p.add_argument("run_dirs", nargs="+", help="run directories (several are overlaid)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run dir>/curves.png)")
    p.set_defaults(func=cmd_plot)

    from megatron_rlvr.commands.tool_cli import add_tool_parser  # argparse only: the sandbox loads when it runs

    add_tool_parser(sub)

    sub.add_parser("plan", help="check a parallel layout and estimate per-GPU memory", add_help=False)
    sub.add_parser("convert", help="convert checkpoints (megatron <-> HF)", add_help=False)
    return ap


def _user_errors() -> tuple:
    """Exceptions that are the user's to fix: their message names the file, field or option and the fix."""
    # on an error only: the CLI's start imports no command's stack
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.rundir.lock import RunDirLocked

    return (
        ValueError,
        RunDirLocked,
        RewardFailure,
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
    )


def _disk_full(e: BaseException) -> OSError | None:
    """The full disk or exhausted quota that ``e`` is (or was caused by): the user's to fix, not an internal error (a
    conversion or export on a full disk took the unexpected-error path: rc 1 and a traceback file)."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        # safetensors' SafetensorError ("I/O error: No space left on device (os error 28)") carries no errno
        text = str(e)
        for code in (errno.ENOSPC, errno.EDQUOT):
            if os.strerror(code) in text:
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, _user_errors()) or _disk_full(e) is not None


def _report(command: str, e: BaseException) -> None:
    """One clear line instead of a traceback; an unexpected error's traceback goes to a file named in the line."""
    import tempfile
    import traceback

    msg = str(e).strip() or type(e).__name__
    # on an error only: the CLI's start imports no command's stack (the checkpointer's is torch's)
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.rundir import heartbeat
    from megatron_rlvr.rundir.checkpointer import CheckpointSaveError, ResumeError
    from megatron_rlvr.rundir.lock import RunDirLocked

    # raised identically on every rank: rank 0 says it (a reward failure: the rank that scoring named, which in a
    # disaggregated run is a rollout rank; rank 0, a training rank, then only sees its channel close)
    collective = (RewardFailure, ResumeError, RunDirLocked, CheckpointSaveError)
    speaker = e.speaker if isinstance(e, RewardFailure) else None
    if speaker is not None:
        if not speaker:
            return
    elif isinstance(e, collective) and os.environ.get("RANK", "0") != "0":
        return
    if isinstance(e, _user_errors()):
        print(f"megatron-rlvr {command}: error: {msg}", file=sys.stderr, flush=True)
        return
    full = _disk_full(e)
    if full is not None:
        first = msg.splitlines()[0][:300]
        if full is not e and full.strerror not in first:
            first += f" ({full})"
        print(
            f"megatron-rlvr {command}: error: {first}; free space (or choose an output folder on another disk) and "
            "run the command again",
            file=sys.stderr,
            flush=True,
        )
        return
    parallel = sys.modules.get("megatron_rlvr.megatron.parallel")  # loaded: a collective may have timed out
    bridge = sys.modules.get("megatron_rlvr.rollout.bridge")
    note = ""  # a wait that timed out: which rank stopped beating, at which step
    if bridge is not None and isinstance(e, bridge.PeerLost):  # names the channel: kept, not the generic timeout
        note = heartbeat.current_note()
    elif parallel is not None and parallel.collective_timeout_message(e):
        msg, note = parallel.collective_timeout_message(e), heartbeat.current_note()
    fd, path = tempfile.mkstemp(prefix=f"megatron-rlvr-{command}-", suffix=".traceback.txt")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(e, file=f)
    first = msg.splitlines()[0][:300] + note
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
        if argv and argv[0] == "train" and "--dry-run" in argv[2:]:  # `train CONFIG --dry-run k=v`: anywhere
            argv.remove("--dry-run")
            argv.insert(1, "--dry-run")
        ns = build_parser().parse_args(argv)
        ns.argv = argv  # what a command that starts ranks hands them
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print(f"megatron-rlvr {command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # torch.distributed's CheckpointException is a BaseException, not an Exception
        if debug:
            raise
        _report(command, e)
        return 2 if _is_user_error(e) else 1


if __name__ == "__main__":
    sys.exit(main())
