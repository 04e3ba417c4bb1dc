"""Each rank's heartbeat in the run directory, read when a collective times out to name the rank that stopped.

A timed-out collective only tells the waiting rank that *some* peer did not arrive. Every rank's thread therefore
rewrites ``<run_dir>/.heartbeat/rank_N.json`` (its role, the step it is on, the time) every few seconds: a rank that
is stopped (SIGSTOP), frozen or on a dead node stops beating, while a rank blocked in a collective keeps beating
(torch's waits release the GIL). A file written by the thread of a live process is at most one interval old, so
one older than ``STALE_INTERVALS`` intervals names a rank that stopped, with the last step it reported. Files, not
the job's TCP store: the store lives in rank 0's process, which may be the one stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable

HEARTBEAT_DIR = ".heartbeat"
STALE_INTERVALS = 3
"""A heartbeat older than this many intervals is a rank that stopped beating."""


def interval_s(timeout_s: float) -> float:
    """Seconds between beats: a tenth of the collective timeout (so a rank that stopped is stale well before the
    timeout fires), between 1 s and 60 s (at the 600 s default, one small file write a minute per rank)."""
    return min(60.0, max(1.0, timeout_s / 10))


class Heartbeat:
    """The beating thread of one rank (``start`` / ``stop``); ``step``: the step the rank is on."""

    def __init__(self, run_dir: str, rank: int, role: str, every_s: float, step: Callable[[], int] | None = None):
        self.path = os.path.join(run_dir, HEARTBEAT_DIR, f"rank_{rank:05d}.json")
        self.rank, self.role, self.every_s = rank, role, every_s
        self.step_fn = step
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        """Write this rank's record now (best effort: a full disk must not end a run)."""
        step = self.step_fn() if self.step_fn is not None else self.step
        record = {"rank": self.rank, "role": self.role, "step": int(step), "time": time.time(), "every_s": self.every_s}
        record.update(pid=os.getpid(), host=socket.gethostname())
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beat()

    def stop(self) -> None:
        """End the thread and remove this rank's record (the folder too once it is empty): a finished run keeps
        none."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with contextlib.suppress(OSError):
            os.remove(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


_CURRENT: Heartbeat | None = None
_RUN_DIR: str | None = None
"""The run directory of this process's last heartbeat: read after it stopped too (a run's teardown stops it before
the error that ended the run is reported)."""


def start(run_dir: str, role: str, timeout_s: float, step: Callable[[], int] | None = None) -> Heartbeat | None:
    """Start this process's heartbeat (its global rank from ``RANK``; none in a one-process job, which has no
    peer to wait for); ``current_note`` reads the run's."""
    global _CURRENT, _RUN_DIR
    stop()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    _RUN_DIR = run_dir
    _CURRENT = Heartbeat(run_dir, int(os.environ.get("RANK", "0")), role, interval_s(timeout_s), step).start()
    return _CURRENT


def stop() -> None:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop()
    _CURRENT = None


def read_heartbeats(run_dir: str) -> list[dict]:
    """Every rank's last record (unreadable files skipped), by rank."""
    folder = os.path.join(run_dir, HEARTBEAT_DIR)
    out = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(folder, name)) as f:
                        out.append(json.load(f))
    return sorted(out, key=lambda r: r.get("rank", 0))


def _who(r: dict) -> str:
    return f"rank {r['rank']} ({r.get('role', '?')}, pid {r.get('pid', '?')} on {r.get('host', '?')})"


def stalled_note(records: list[dict], now: float | None = None) -> str:
    """What the heartbeats say about a hang, as a clause to append to a timeout message ('' when they say nothing):
    the ranks that stopped beating and the step each last reported."""
    if not records:  # (the reporting rank's own record may be gone: its run's teardown removed it)
        return ""
    now = time.time() if now is None else now
    stale = [r for r in records if now - r["time"] > STALE_INTERVALS * r.get("every_s", 60.0)]
    if stale:
        named = ", ".join(f"{_who(r)} at step {r['step']}, silent for {now - r['time']:.0f} s" for r in stale[:4])
        more = f" and {len(stale) - 4} more" if len(stale) > 4 else ""
        return f"; stopped: {named}{more}"
    if not stale:
        return "; every rank's heartbeat is current (none stopped: one is stuck inside a step, or it needs more time)"
    return ""


def current_note() -> str:
    """``stalled_note`` for this process's run ('' when it has no heartbeat)."""
    return stalled_note(read_heartbeats(_RUN_DIR)) if _RUN_DIR else ""
