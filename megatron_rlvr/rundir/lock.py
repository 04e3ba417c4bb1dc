"""Run-directory lock: one training run per run directory.

Two runs writing one run directory corrupt it (interleaved metrics, each deleting the other's checkpoints), so the
first process to start a run takes an exclusive ``flock`` on ``<run_dir>/.rlvr-lock`` and writes who it is (pid,
host, start time, Slurm job id) into the file; a second run is refused with that information.

- Held by the launcher and its ranks: the local launcher passes the locked descriptor to every rank
  (``pass_fds``; a flock belongs to the open file, shared by every process that inherited it), so the lock stays
  held while any of them lives, e.g. ranks finishing a checkpoint after the launcher was SIGKILLed. Under
  torchrun / srun (no launcher of ours) global rank 0 takes it.
- Stale locks: the kernel drops a flock when the last process holding it dies, whatever the cause (SIGKILL, OOM,
  node reboot for a local disk; NFS clients release it through the lock manager), so a lock file left by a dead run
  is simply taken over, with a note naming the dead holder. A Slurm requeue starts the job again only after every
  task of the previous allocation has ended, so its restart finds the lock free the same way.
- File systems without flock (some FUSE/NFS setups answer ENOLCK/EOPNOTSUPP): the holder file alone decides: a
  holder on this host whose pid is gone, or one from an earlier attempt of the same Slurm job
  (SLURM_RESTART_COUNT lower than ours), is stale; any other holder refuses the run.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import time

LOCK_NAME = ".rlvr-lock"
FD_ENV = "RLVR_RUN_LOCK_FD"
"""Set by the local launcher for its ranks: the inherited descriptor of the held lock."""


class RunDirLocked(RuntimeError):
    """Another live run holds the run directory."""


def _me() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def _read_holder(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def describe(holder: dict | None) -> str:
    if not holder:
        return "an unknown process (the lock file is empty)"
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('started')}{job})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def holder_is_stale(holder: dict | None, me: dict | None = None) -> bool:
    """Without flock: is the recorded holder certainly gone?"""
    me = me or _me()
    if not holder:
        return True
    if holder.get("host") == me["host"]:
        return not _pid_alive(int(holder.get("pid", 0) or 0))
    job = holder.get("slurm_job_id")
    return (
        bool(job)
        and job == me["slurm_job_id"]
        and int(holder.get("slurm_restart_count", 0)) < me["slurm_restart_count"]
    )


class RunLock:
    """An acquired lock; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: str, fd: int, previous: dict | None, flocked: bool):
        self.path = path
        self.fd = fd
        self.previous = previous
        """The stale holder taken over, if the lock file named one."""
        self.flocked = flocked

    def release(self) -> None:
        """Clear the holder record (a clean exit leaves no stale note for the next run) and unlock."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
            if self.flocked:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1

    def takeover_note(self) -> str | None:
        if self.previous and int(self.previous.get("pid", -1)) != os.getpid():
            return f"megatron-rlvr: took over the stale lock of {self.path} left by {describe(self.previous)}: gone"
        return None


def acquire(run_dir: str) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process; raises RunDirLocked naming the live holder."""
    path = os.path.join(run_dir, LOCK_NAME)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirLocked(f"logging.run_dir {run_dir} is a file, not a directory; choose another logging.run_dir")
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirLocked(
            f"cannot create the run directory lock {path}: {e.strerror}; choose a writable logging.run_dir"
        ) from None
    previous = _read_holder(fd)
    flocked = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirLocked(
            f"run directory {run_dir} is in use by another run: {describe(previous)}. Wait for it to finish or stop "
            f"it, or train into another directory (logging.run_dir=...)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        flocked = False  # no flock on this file system: the holder file decides
        if previous and not holder_is_stale(previous):
            os.close(fd)
            raise RunDirLocked(
                f"run directory {run_dir} is in use by another run: {describe(previous)} (this file system has no "
                f"flock, so a holder on another host cannot be checked; if it is certainly gone, delete {path})"
            ) from None
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(_me()) + "\n").encode())
        os.fsync(fd)
    except OSError as e:  # full disk, quota: closing the descriptor also drops the flock
        os.close(fd)
        raise RunDirLocked(
            f"cannot write the run directory lock {path}: {e.strerror}; free space there or choose another "
            "logging.run_dir"
        ) from None
    return RunLock(path, fd, previous, flocked)


def inherited(run_dir: str) -> bool:
    """In a rank of the local launcher: the launcher's lock on ``run_dir`` reached us (descriptor in FD_ENV)."""
    fd = os.environ.get(FD_ENV)
    if not fd or not fd.isdigit():
        return False
    try:
        st = os.fstat(int(fd))
        own = os.stat(os.path.join(run_dir, LOCK_NAME))
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def hold(run_dir: str) -> RunLock | None:
    """Acquire ``run_dir`` for this process unless its launcher already holds it (inherited descriptor); returns the
    new lock, which the caller owns and releases (an exit of the process releases it too)."""
    if inherited(run_dir):
        return None
    lock = acquire(run_dir)
    atexit.register(lock.release)  # a clean exit clears the holder record; the kernel drops the flock anyway
    return lock


def hold_collective(run_dir: str, rank: int, broadcast) -> RunLock | None:
    """In every rank: rank 0 holds the lock (unless its launcher does); a refusal is raised on every rank (one rank
    alone raising would leave the others blocked in the next collective). Returns rank 0's new lock (None on other
    ranks and when a launcher holds it)."""
    err, lock = None, None
    if rank == 0:
        try:
            lock = hold(run_dir)
            if lock is not None and lock.takeover_note():
                print(lock.takeover_note(), flush=True)
        except Exception as e:  # raised on rank 0 alone, it would leave the other ranks waiting in the broadcast
            err = str(e) if isinstance(e, RunDirLocked) else f"cannot lock the run directory {run_dir}: {e}"
    err = broadcast(err)
    if err:
        raise RunDirLocked(err)
    return lock
