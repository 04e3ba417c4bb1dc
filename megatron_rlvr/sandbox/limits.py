"""SandboxLimits (what one sandboxed run may use) and the guards this machine offers to enforce them.

Guards are detected once per process, the first time a sandbox runs (never at import): a probe process tries the
namespaces, and the pids cgroup is looked up. :func:`detect_guards` says which hold; docs/agentic.md ("The sandbox")
says what each one enforces and what remains where one is missing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["CGROUP_PIDS_ROOT", "Guards", "SandboxLimits", "detect_guards"]

CGROUP_PIDS_ROOT = "/sys/fs/cgroup/pids"
"""The cgroup-v1 pids hierarchy; sandbox runs get groups under ``megatron-rlvr-sandbox/`` there."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run (one program, one test case, one tool call) may use."""

    wall_s: float = 10.0
    """Wall-clock seconds from start to kill (the process group and everything it started)."""
    cpu_s: float = 10.0
    """CPU seconds of the main process (RLIMIT_CPU; each child process gets the same allowance)."""
    memory_mb: int = 1024
    """Address space per process in MiB (RLIMIT_AS): an allocation beyond it fails (Python: MemoryError)."""
    output_bytes: int = 1 << 16
    """Bytes kept of each of stdout and stderr; a program writing more is killed at once (status "output_limit")."""
    file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE); also caps what it can put on disk per file."""
    max_processes: int = 16
    """Processes and threads the run may have at once, the first included (pids cgroup, else RLIMIT_NPROC under its
    own user id). Must be >= 2 for the ``python`` tool (the interpreter and one helper thread of some modules)."""
    max_open_files: int = 64
    """File descriptors per process (RLIMIT_NOFILE)."""
    network: bool = False
    """Allow the network. False: the run gets its own empty network namespace (no interface but a down loopback), so
    every connect fails, to 127.0.0.1 included."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limits: {name} must be a number > 0, got {value!r}")
        for name, low in (
            ("memory_mb", 16),
            ("output_bytes", 1),
            ("file_bytes", 0),
            ("max_processes", 1),
            ("max_open_files", 8),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"sandbox limits: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.network, bool):
            raise ValueError(f"sandbox limits: network must be true or false, got {self.network!r}")


@dataclass(frozen=True)
class Guards:
    """Which isolation mechanisms this machine lets the sandbox use (all are applied when available)."""

    root: bool
    """The parent runs as root: the run can drop to a user id of its own (setuid), which is what makes files of
    others read-only to it, other processes unkillable, /proc/<pid>/environ of others unreadable, and RLIMIT_NPROC
    count (root ignores RLIMIT_NPROC)."""
    net_namespace: bool
    """unshare(CLONE_NEWNET) works (as root, or through an unprivileged user namespace): no network."""
    mount_namespace: bool
    """unshare(CLONE_NEWNS) works as root: the run gets private /tmp, /var/tmp and /dev/shm, and directories the
    interpreter needs that its own user id could not reach are bound in."""
    pids_cgroup: bool
    """The cgroup-v1 pids controller is writable: a per-run group caps processes (pids.max) and lets the parent
    kill every process of the run, also ones that left its process group (setsid)."""

    @property
    def own_user(self) -> bool:
        """The run drops to a user id of its own (needs root, and the mount namespace so the interpreter stays
        readable)."""
        return self.root and self.mount_namespace

    def names(self) -> tuple[str, ...]:
        """The guards held, by name (the rlimits and the process group always hold)."""
        held = ["rlimits", "process_group", "clean_env"]
        if self.own_user:
            held.append("own_user")
        if self.net_namespace:
            held.append("net_namespace")
        if self.mount_namespace:
            held.append("mount_namespace")
        if self.pids_cgroup:
            held.append("pids_cgroup")
        return tuple(held)


_PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
flags = int(sys.argv[1])
sys.exit(0 if libc.unshare(flags) == 0 else 1)
"""

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def _unshare_works(flags: int) -> bool:
    """Try ``unshare(flags)`` in a throw-away process (never in this one: it would move the caller itself)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, str(flags)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def _pids_cgroup_works() -> bool:
    base = os.path.join(CGROUP_PIDS_ROOT, "megatron-rlvr-sandbox")
    probe = os.path.join(base, f"probe-{os.getpid()}")
    try:
        os.makedirs(base, exist_ok=True)
        os.mkdir(probe)
        try:
            with open(os.path.join(probe, "pids.max"), "w") as f:
                f.write("4")
        finally:
            os.rmdir(probe)
    except OSError:
        return False
    return True


@functools.cache
def detect_guards() -> Guards:
    """The guards this machine offers, probed once per process (tens of milliseconds)."""
    root = os.geteuid() == 0
    if root:
        net = _unshare_works(CLONE_NEWNET)
        mount = _unshare_works(CLONE_NEWNS)
    else:  # an unprivileged user namespace gives a network namespace too; mounts there would not help (no setuid)
        net = _unshare_works(CLONE_NEWUSER | CLONE_NEWNET)
        mount = False
    return Guards(root=root, net_namespace=net, mount_namespace=mount, pids_cgroup=root and _pids_cgroup_works())
