"""Starting and ending the processes a test launches (the local launcher, a `megatron-rlvr train` run, a helper
script) so that nothing outlives the test.

A launcher's ranks lead their own process groups (the launcher starts each so), so killing the launcher, or even its
process group, leaves a rank that does not watch its parent running for good: the SIGHUP test's rank, started while
SIGHUP was ignored, kept polling after the test failed. Here a launched command is

- started in a new session (``start_new_session``): it and everything it starts, ranks in their own groups included,
  share a session id, which is how :func:`end_session` finds them all;
- started with the default dispositions of the stop signals: a signal ignored in the test process (pytest under
  ``nohup``, a test that set SIG_IGN and failed before restoring it) is inherited across exec and would make a
  signal test's ranks ignore the very signal the test sends.

``conftest.py`` marks every process of the test session with :data:`SESSION_ENV` and fails the session, naming
their command lines, when any is still alive at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil

SESSION_ENV = "RLVR_TEST_SESSION"
"""Set by conftest.py for the whole test session; every process the suite starts inherits it."""

_DEFAULTS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE)

# Sets the signals back to their defaults, then becomes the command (same pid): exec keeps only ignored
# dispositions, and these are the ones a test may have ignored.
_RESET_AND_EXEC = (
    "import os, signal, sys\n"
    f"for s in {[int(s) for s in _DEFAULTS]}:\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def start(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` in a new session with the stop signals at their defaults. End it
    with :func:`end_session` (or use :func:`launched`)."""
    if popen_kwargs.pop("start_new_session", True) is not True:
        raise ValueError("process_helpers.start always starts a new session")
    return subprocess.Popen([sys.executable, "-c", _RESET_AND_EXEC, *cmd], start_new_session=True, **popen_kwargs)


def session_members(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (zombies included: they are gone once reaped)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def end_session(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL ``proc`` (started by :func:`start`) and every process of its session, then reap ``proc``. Safe to
    call when it already exited."""
    members = session_members(proc.pid)
    with contextlib.suppress(psutil.Error):
        members += psutil.Process(proc.pid).children(recursive=True)  # in case one left the session
    for p in members:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    psutil.wait_procs([p for p in members if p.pid != proc.pid], timeout=timeout)


@contextlib.contextmanager
def launched(cmd: list[str], **popen_kwargs):
    """``with launched(cmd, ...) as proc:`` -> :func:`start`, and :func:`end_session` on the way out, however the
    block ends."""
    proc = start(cmd, **popen_kwargs)
    try:
        yield proc
    finally:
        end_session(proc)


def leftover_processes(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment carries ``SESSION_ENV=marker``, except the
    multiprocessing helpers of this process (forkserver, resource tracker), which end with it."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid == me or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(SESSION_ENV) != marker:
                continue
            cmd = " ".join(p.cmdline())
            if p.ppid() == me and ("multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd):
                continue
            out.append(p)
        except (psutil.Error, OSError):
            pass
    return out
