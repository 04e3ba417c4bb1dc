"""Local launch: ``megatron-rlvr train`` (and ``convert``) on one machine starts its own ranks as child processes
(the torchrun model:
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in their environment) running the same command on the
resolved config, and supervises them:

- SIGTERM, SIGUSR1, SIGINT and SIGHUP (a closed terminal or ssh session) sent to the launcher are forwarded to every
  rank (they checkpoint and exit with the signal's code, see megatron_rlvr/rundir/signals.py); the ranks live in
  their own process group, so a Ctrl-C in the terminal reaches them once, through the launcher;
- fail fast: when a rank exits with an error, the others get a few seconds to exit, then are killed (they would
  otherwise wait forever in a collective); the launcher exits with the first non-zero code;
- no orphans: each rank watches the launcher's pid and exits if the launcher dies (e.g. SIGKILL), and each rank's
  whole process group (what it started: checkpoint writers, reward workers) is ended with it;
- the dead rank is named: "rank 1 (pid 4242) was killed by SIGKILL", not only the survivors' gloo errors;
- ranks import the launcher's own ``megatron_rlvr`` (its installation is put first on ``sys.path``), never a
  checkout that happens to sit in the current directory (``python -m`` would put the cwd first);
- the run-directory lock (megatron_rlvr/rundir/lock.py) is inherited by every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import megatron_rlvr
from megatron_rlvr.rundir.lock import FD_ENV
from megatron_rlvr.rundir.signals import STOP_SIGNALS, detach_from_terminal, ignored_at_start
from megatron_rlvr.slurm_env import free_port

PARENT_ENV = "RLVR_LAUNCHER_PID"
FAIL_FAST_GRACE_S = 10.0


def start_parent_watchdog() -> None:
    """In a rank started by the local launcher: exit when the launcher process is gone."""
    pid = os.environ.get(PARENT_ENV)
    if not pid:
        return
    pid = int(pid)

    def watch():
        while True:
            if os.getppid() != pid:
                end_own_group()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="rlvr-launcher-watchdog", daemon=True).start()


def end_own_group() -> None:
    """In a rank that leads its own process group (the local launcher starts each so): SIGKILL the whole group, i.e.
    this rank and what it started (megatron-core's checkpoint writer and its resource tracker, reward workers),
    which would otherwise outlive it holding memory and the console's pipe."""
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)


def end_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group of every rank (each leads its own): a rank killed by SIGKILL (the OOM killer,
    fail-fast) leaves its children running, holding ~300 MB each and the launcher's stdout, so that
    ``train ... | tee log`` never returned."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(megatron_rlvr.__file__)))


# ``python -m megatron_rlvr.commands.cli`` would import megatron_rlvr from the cwd first (sys.path[0] = cwd). The rank's
# bootstrap puts the launcher's installation in front instead; the cwd stays on the path (after it) for user modules
# such as a reward function next to the config.
_RANK_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from megatron_rlvr.commands.cli import main; sys.exit(main())"
)


def rank_command(args: list[str]) -> list[str]:
    """The command line of one rank: ``megatron-rlvr ARGS`` with the launcher's ``megatron_rlvr``."""
    return [sys.executable, "-c", _RANK_BOOTSTRAP, _repo_root(), *args]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def rank_environment(rank: int, world_size: int, master_addr: str, master_port: int, threads: int) -> dict[str, str]:
    """The torchrun-style variables of one local rank (what ``megatron_rlvr.megatron.parallel.env_rank_info`` reads):
    every way this package starts local ranks (``launch_local``, the test harness) sets exactly these."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "OMP_NUM_THREADS": str(threads),
    }


def launch_local(
    args: list[str],
    world_size: int,
    *,
    master_addr: str,
    master_port: int,
    threads: int,
    lock_fd: int | None = None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run ``megatron-rlvr ARGS`` (e.g. ``train CONFIG k=v``, ``convert to-hf ...``) as ``world_size`` local ranks;
    returns the launcher's exit code. ``lock_fd``: a held run-directory lock, inherited by every rank;
    ``timeout_s``: the ranks are killed after that long (exit code 124)."""
    port = master_port or free_port()
    env_base = dict(os.environ)
    root = _repo_root()
    env_base["PYTHONPATH"] = root + (os.pathsep + env_base["PYTHONPATH"] if env_base.get("PYTHONPATH") else "")
    if lock_fd is not None:
        os.set_inheritable(lock_fd, True)
        env_base[FD_ENV] = str(lock_fd)
    env_base.update(extra_env or {})
    env_base[PARENT_ENV] = str(os.getpid())
    cmd = rank_command(list(args))
    procs: list[subprocess.Popen] = []
    fds = (lock_fd,) if lock_fd is not None else ()
    for rank in range(world_size):
        env = dict(env_base, **rank_environment(rank, world_size, master_addr, port, threads))
        procs.append(subprocess.Popen(cmd, env=env, process_group=0, pass_fds=fds))

    signalled: list[int] = []

    def forward(signum, frame):
        signalled.append(signum)
        if signum == signal.SIGHUP:
            detach_from_terminal()
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    forwarded = [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and ignored_at_start(s))]  # nohup: keep ignoring
    old = {s: signal.signal(s, forward) for s in forwarded}
    try:
        return _supervise(procs, signalled, timeout_s, own_groups=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        end_groups(procs)  # the ranks and anything they left behind
        for p in procs:
            p.wait()


def _supervise(
    procs: list[subprocess.Popen], signalled: list[int] | None = None, timeout_s=None, own_groups: bool = False
) -> int:
    """Wait for the ranks; returns the launcher's exit code. ``own_groups``: each rank leads its own process group,
    killed whole when the rank must be stopped."""

    def kill_all():
        for p in procs:
            if p.poll() is None:
                p.kill()
        if own_groups:
            end_groups(procs)
        for p in procs:
            p.wait()

    first_bad: int | None = None
    bad_since = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if deadline is not None and time.monotonic() > deadline:
            print(f"megatron-rlvr: the ranks ran longer than {timeout_s:.0f} s; stopping them", file=sys.stderr)
            kill_all()
            return 124
        codes = [p.poll() for p in procs]
        for rank, c in enumerate(codes):
            if c is not None and c != 0 and first_bad is None:
                first_bad, bad_since = c, time.monotonic()
                if signalled:  # a forwarded stop signal: the ranks' documented exit codes, not a failure
                    continue
                # the rank printed its error before it exited: above this line; the others' come before or after it
                others = (
                    " (its error, if any, is printed above; the other ranks' errors are its consequence)"
                    if len(procs) > 1 and c != 2
                    else ""
                )
                print(
                    f"megatron-rlvr: rank {rank} (pid {procs[rank].pid}) {describe_exit(c)}; stopping the job{others}",
                    file=sys.stderr,
                    flush=True,
                )
        if all(c is not None for c in codes):
            if first_bad is not None:
                return first_bad if first_bad > 0 else 128 - first_bad  # killed by signal -n -> 128 + n
            return 0
        if bad_since is not None and time.monotonic() - bad_since > FAIL_FAST_GRACE_S:
            kill_all()
            return first_bad if first_bad > 0 else 128 - first_bad
        time.sleep(0.2)
