"""Finding what a sandbox run may have left running: processes of its process group or of its own user id.

Zombies (dead processes their new parent, init, has not reaped yet) hold no resources and are not counted."""

from __future__ import annotations

import os

from megatron_rlvr.sandbox.process import _SANDBOX_UID_BASE


def proc_table() -> list[tuple[int, int, int, str]]:
    """(pid, process group, real uid, state) of every process /proc shows."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                after = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        rows.append((int(entry), int(after[2]), uid, after[0]))
    return rows


def live_processes(pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` or running as ``uid``."""
    return [
        pid
        for pid, group, owner, state in proc_table()
        if state != "Z" and ((pgid is not None and group == pgid) or (uid is not None and owner == uid))
    ]


def live_sandbox_processes() -> list[int]:
    """Live processes under any user id this test process's sandbox runs were given (guard own_user)."""
    low = _SANDBOX_UID_BASE + (os.getpid() << 6)
    return [pid for pid, _, owner, state in proc_table() if state != "Z" and low <= owner < low + 64]


def left_behind(outcome) -> list[int]:
    """What a finished run left running: its process group, its user id, and any sandbox user id of this process."""
    return sorted(set(live_processes(outcome.pid, outcome.uid)) | set(live_sandbox_processes()))
