"""Graceful stop on SIGTERM / SIGUSR1 / SIGINT / SIGHUP: finish the current step, checkpoint, exit with a set code.

The handler only records the signal. At the end of every step all ranks agree on it with one MAX all-reduce (ranks
see a signal at slightly different times; the decision must be collective, or one rank would block in a
collective the others never enter), then every rank saves its checkpoint shards and exits.

Exit codes (the contract with slurm/common.sh and docs/running-on-slurm.md):

- SIGUSR1 (Slurm's time-limit warning, ``#SBATCH --signal=USR1@180``): ``$RLVR_REQUEUE_EXIT_CODE`` (75 when the
  Slurm scripts run us), else 75 (EX_TEMPFAIL): "checkpointed, requeue me".
- SIGTERM: 0 ("saved and stopped cleanly"), also under Slurm: ``scancel`` sends SIGTERM and a cancelled job must
  not requeue itself, while Slurm's own preemption (PreemptMode=REQUEUE) requeues the job without our help.
- SIGINT (Ctrl-C): 130 after the checkpoint; a second Ctrl-C interrupts immediately.
- SIGHUP (the terminal or ssh session went away): 129 after the checkpoint. The terminal is gone, so from then on
  stdout / stderr go to /dev/null unless they are regular files (a write to a hung-up terminal or to the dead end
  of ``| tee`` would fail the save). A process started under ``nohup`` (SIGHUP ignored) keeps ignoring it.
Each default can be overridden in the config (``checkpoint.sigterm_exit_code`` / ``checkpoint.sigusr1_exit_code``).
"""

from __future__ import annotations

import os
import signal
import stat

# Codes in the all-reduced flag: 0 none; larger wins when ranks disagree (SIGUSR1 = requeue is the strongest ask).
_CODES = {signal.SIGINT: 1, signal.SIGHUP: 2, signal.SIGTERM: 3, signal.SIGUSR1: 4}
_NAMES = {code: signal.Signals(sig).name for sig, code in _CODES.items()}
REQUEUE_DEFAULT = 75
STOP_SIGNALS = tuple(_CODES)
"""The signals that stop a run with a checkpoint (the local launcher forwards exactly these to its ranks)."""


def detach_from_terminal() -> None:
    """After SIGHUP: point stdout / stderr at /dev/null unless they are regular files (the terminal or the pipe
    they wrote to is gone; a write there would raise and lose the checkpoint)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)


def ignored_at_start(sig: int) -> bool:
    """``sig`` was ignored when this process started (``nohup`` ignores SIGHUP): leave it ignored."""
    return signal.getsignal(sig) == signal.SIG_IGN


class StopSignals:
    """Installs the handlers (main thread only) and remembers the strongest signal received."""

    def __init__(self):
        self.code = 0
        self._old: dict[int, object] = {}
        self._installed = False

    def install(self) -> StopSignals:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (e.g. in some test harnesses)
        for sig in _CODES:
            if sig == signal.SIGHUP and ignored_at_start(sig):
                continue
            self._old[sig] = signal.signal(sig, self._handle)
        self._installed = True
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.code == _CODES[signal.SIGINT]:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        if signum == signal.SIGHUP:
            detach_from_terminal()
        self.code = max(self.code, _CODES[signum])

    def uninstall(self) -> None:
        if self._installed:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._installed = False

    @staticmethod
    def name(code: int) -> str:
        return _NAMES.get(int(code), "none")


def exit_code_for(code: int, sigterm_exit_code: int | None, sigusr1_exit_code: int | None, environ=None) -> int:
    """The process exit code after a checkpoint triggered by the (all-reduced) signal ``code``."""
    env = os.environ if environ is None else environ
    requeue = int(env["RLVR_REQUEUE_EXIT_CODE"]) if env.get("RLVR_REQUEUE_EXIT_CODE") else None
    if code == _CODES[signal.SIGUSR1]:
        return sigusr1_exit_code if sigusr1_exit_code is not None else (requeue or REQUEUE_DEFAULT)
    if code == _CODES[signal.SIGTERM]:
        return sigterm_exit_code if sigterm_exit_code is not None else 0
    if code == _CODES[signal.SIGINT]:
        return 130
    if code == _CODES[signal.SIGHUP]:
        return 128 + signal.SIGHUP
    return 0
