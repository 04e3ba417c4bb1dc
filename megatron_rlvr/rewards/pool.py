"""A pool of reward worker processes with a per-item timeout, crash isolation, and hung-worker replacement.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill the one worker stuck on one item (sympy can
loop for minutes in C on adversarial model output) without tearing down the whole pool, and math-verify's own
timeouts use ``signal.alarm``, which only works in a process's main thread. So each worker here is a process
with its own pipe, scoring one item at a time in its main thread:

- the worker arms ``setitimer(ITIMER_REAL, timeout_s)`` around each item; the SIGALRM handler raises
  :class:`ItemTimeout` (a BaseException, so ``except Exception`` in user code cannot swallow it) -> status
  "timeout", reward 0, the worker lives on;
- the parent waits on all workers' sockets at once (a dead worker's socket reads EOF); an item still running
  ``kill_grace_s`` after its timeout (C code, a swallowed interrupt, a reset signal handler) gets its worker
  SIGKILLed and replaced;
- a worker that dies mid-item (segfault, ``os._exit``, OOM kill) -> status "error" and a replacement;
- an exception in the reward function -> status "error" with its message and traceback; the worker lives on;
- a non-finite reward -> status "nonfinite" (reward 0, counted on its own); a non-numeric one -> "error" showing
  the value;
- ``os._exit`` / ``sys.exit`` called by the reward function -> status "error": in a worker ``os._exit`` raises
  instead of ending the process (a replacement worker costs seconds of imports: a function exiting on every item
  made steps 40x slower);
- ``on_failure(index, result)`` is called the moment an item fails (e.g. the first timeout of a hanging function is
  reported at once, not after the whole batch).

Dispatch: a worker gets its items in chunks and sends each result back as soon as it has it, so the parent still
knows which item runs and since when (the kill deadline of the next item starts at the previous one's result). One
message per item each way made a worker wait for the parent after every item: a step's 64 cheap items took 64
round trips (tens of ms on a busy CPU, more than the scoring). Chunks follow guided self-scheduling: a chunk is
``ceil(pending / (2 * num_workers))`` items, so they shrink as the batch drains and the workers finish together;
a worker gets its next chunk while it still has one item to go (idle workers are served first), so it never waits
for the parent. When a worker is killed or dies, its unstarted items go back to the queue.

Hanging functions: in order, every hanging item would cost one timeout after another on its worker (a sleeping
reward held one step of the tiny preset for 664 s). So once an item of a batch has timed out, the rest of the batch
is scored at once: a worker forks one process per item (a copy with the function already imported: milliseconds,
not the seconds of a new worker), each with its own timer and kill deadline, and a worker scoring in order switches
to that for the rest of its chunk right after its timeout. A new item starts only while no running item's process
computes (Linux /proc state "R"), so items that hang asleep wait out their limits together while items that compute
still get the worker's CPU in turn; a batch whose every item hangs asleep ends after about two timeouts plus the
forks. An item that hangs while computing (C code) still costs its timeout in turn, as before.

``should_stop`` (a stop signal) is asked every STOP_POLL_S while a batch is scored: a SIGTERM does not wait for
the batch.

Workers are plain ``python -c`` subprocesses talking over a socketpair (a multiprocessing Connection), not
multiprocessing children: the caller's ``__main__`` is not re-imported in every worker (a training script's
torch/megatron imports would cost seconds and hundreds of MB per worker, and an unguarded script would recurse), and
they can be started from daemonic processes such as the ranks of the multi-process test harness.

No orphans: workers ignore SIGINT (the parent shuts them down), exit on EOF of their socket, and a watchdog thread
exits them if the parent process disappears (e.g. SIGKILLed); :meth:`ScoringPool.close` runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from megatron_rlvr.rewards.scorers import NonFiniteReward, build_scorer

__all__ = ["ItemResult", "ItemTimeout", "ScoringPool", "ScoringStopped", "score_inline"]


class ItemTimeout(BaseException):
    """Raised inside a worker by SIGALRM when an item exceeds its time limit."""


class ScoringStopped(Exception):
    """Scoring was abandoned because the caller's ``should_stop()`` returned True (a stop signal)."""


STOP_POLL_S = 0.2
"""How often a scoring loop asks ``should_stop()``."""
CONCURRENT_SLACK_S = 10.0
"""Extra seconds a worker scoring at once has, beyond an item's limit, to report (its own forks and kills)."""


@dataclass
class ItemResult:
    reward: float
    """The reward; 0.0 unless status is "ok"."""
    status: str
    """"ok", "timeout" (interrupted or killed at the limit), "error" (the function raised or returned a
    non-number, or the worker died), "nonfinite" (it returned NaN or +-inf), "unscored" (not scored: the batch
    was stopped early, too many of its items had failed) or "unparsed" (a judge's reply could not be read)."""
    error: str = ""
    """Short description of the error or timeout; empty when ok."""
    detail: str = ""
    """The reward function's traceback, when it raised."""


class ExitCalled(BaseException):
    """Raised in a reward worker instead of ending it when the reward function calls ``os._exit``."""


_REAL_EXIT = os._exit
_WORKER_PID: int | None = None
"""The reward worker's own pid: only there does os._exit raise."""


def _exit_raises(code=0):
    # A child forked by the reward function (multiprocessing's "fork" start method ends its children with
    # os._exit) must really exit: raising there would run it on as a second reader of the worker's pipe.
    if os.getpid() != _WORKER_PID:
        _REAL_EXIT(code)
    raise ExitCalled(f"the reward function called os._exit({code})")


def _on_alarm(signum, frame):
    raise ItemTimeout()


def _score_one(scorer, timeout_s: float, response: str, ground_truth: str, meta: dict | None) -> ItemResult:
    """Score one item in this process's main thread under a SIGALRM time limit."""
    try:
        # Re-armed per item: a reward function may have replaced the handler (math-verify's own timeouts do, and
        # restore it only when they finish; while one is active it also cancels this timer: the kill remains).
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            reward = scorer(response, ground_truth, meta)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return ItemResult(reward, "ok")
    except ItemTimeout:
        return ItemResult(0.0, "timeout", f"interrupted after {timeout_s:g} s", _short_traceback())
    except KeyboardInterrupt:  # only reachable inline (workers ignore SIGINT): Ctrl-C must still stop the run
        raise
    except BaseException as e:  # SystemExit from user code included: never let one item end the worker
        return _failure(e)


def _short_traceback() -> str:
    return "".join(traceback.format_exc(limit=-12))[-4000:]


def _failure(e: BaseException) -> ItemResult:
    status = "nonfinite" if isinstance(e, NonFiniteReward) else "error"
    return ItemResult(0.0, status, f"{type(e).__name__}: {e}"[:1000], _short_traceback())


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            _REAL_EXIT(3)
        time.sleep(1.0)


OUTPUT_CAP_BYTES = 1 << 20
"""What one reward worker may write to each of stdout and stderr over its life; the rest is dropped (with one note):
a reward function printing per item wrote 512 MB of log in two steps."""


def _forward_capped(read_fd: int, out_fd: int, cap: int, name: str) -> None:
    sent = 0
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        if sent < cap:
            part = chunk[: cap - sent]
            sent += len(part)
            os.write(out_fd, part)
            if sent >= cap:
                note = (
                    f"\nmegatron-rlvr: reward worker {os.getpid()}: {name} capped at {cap >> 20} MiB; the reward "
                    "function's further output is dropped\n"
                )
                os.write(out_fd, note.encode())
        # past the cap: keep reading (and dropping), so that the reward function never blocks on a full pipe


def _cap_output(cap: int) -> list[threading.Thread]:
    """Route this process's stdout and stderr (file descriptors 1 and 2: prints, C code, child processes) through
    pipes that forward at most ``cap`` bytes each."""
    threads = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.dup(fd)
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        t = threading.Thread(target=_forward_capped, args=(r, out, cap, name), daemon=True)
        t.start()
        threads.append(t)
    return threads


def _end_output(threads: list[threading.Thread]) -> None:
    """Flush, close the pipes' write ends and let the forwarders finish (the tail of the output is not lost)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        os.close(fd)
    for t in threads:
        t.join(timeout=2.0)


CONCURRENT_ITEMS = 64
"""Items a worker scores at once, each in its own forked process, once an item of the batch has timed out."""


CPU_POLL_S = 0.01
"""How often a worker scoring at once looks whether its items' processes still compute."""


def _computing(pid: int) -> bool:
    """Whether process ``pid`` is running or runnable (Linux /proc state "R"; a freshly forked item process counts
    until it computes no more or sleeps); True where /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return True


def _kill_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that forked it (the worker's main thread) ends, e.g. when the
    worker is killed as hung: an item's process stuck in C code must not outlive it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker kills its item processes itself when it exits
        pass


def _fork_item(scorer, timeout_s: float, item) -> tuple[int, Connection]:
    """Score ``item`` (idx, response, ground_truth, meta) in a forked copy of this worker, which has the reward
    function imported and warmed up already (a fork costs milliseconds, a new worker seconds); returns (pid, the read
    end its result comes back on)."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the item's process: score, send, exit (never return into the worker's loop)
        code = 0
        try:
            os.close(read_fd)
            _kill_with_parent()
            global _WORKER_PID
            _WORKER_PID = os.getpid()  # os._exit in the reward function raises here too
            _idx, response, ground_truth, meta = item
            result = _score_one(scorer, timeout_s, response, ground_truth, meta)
            Connection(write_fd, readable=False).send(result)
        except BaseException:
            code = 1
        finally:
            _REAL_EXIT(code)
    os.close(write_fd)
    return pid, Connection(read_fd, writable=False)


def _score_concurrently(conn: Connection, scorer, queue: deque, timeout_s: float, kill_grace_s: float) -> bool:
    """Score the items of ``queue`` at once (at most CONCURRENT_ITEMS at a time), each in a forked process with its
    own deadline, sending each result as soon as it is known; chunks that arrive meanwhile join ``queue``. Returns
    False when the parent asked the worker to exit (or went away)."""
    running: dict[Connection, tuple[int, int, float]] = {}  # read end -> (item index, pid, kill deadline)
    alive = True

    def finish(r: Connection, result: ItemResult | None) -> None:
        idx, pid, _ = running.pop(r)
        r.close()
        _, status = os.waitpid(pid, 0)
        if result is None:
            code = os.waitstatus_to_exitcode(status)
            result = ItemResult(0.0, "error", f"the item's scoring process died (exit code {code})")
        conn.send((idx, result))

    try:
        while alive and (queue or running):
            # A new item starts only while no item's process computes: items that hang asleep (a lock, the
            # network, a sleep) all wait out their limits together, while items that compute still get this
            # worker's one CPU in turn (dozens at once would stretch each past its limit: false timeouts).
            while queue and len(running) < CONCURRENT_ITEMS and not any(_computing(p) for _, p, _ in running.values()):
                item = queue.popleft()
                try:
                    pid, r = _fork_item(scorer, timeout_s, item)
                except OSError as e:  # no process could be started (process or memory limit)
                    conn.send((item[0], ItemResult(0.0, "error", f"could not fork a process for the item: {e}")))
                    continue
                running[r] = (item[0], pid, time.monotonic() + timeout_s + kill_grace_s)
            wait_s = max(0.0, min(d for _, _, d in running.values()) - time.monotonic()) if running else None
            if queue and running:  # waiting for the CPU: look again soon
                wait_s = min(wait_s, CPU_POLL_S)
            for r in wait([conn, *running], timeout=wait_s):
                if r is not conn:
                    try:
                        result = r.recv()
                    except (EOFError, OSError):  # it died without a result (segfault, OOM kill)
                        result = None
                    finish(r, result)
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:  # shut down
                    alive = False
                    break
                queue.extend(msg[1])
            now = time.monotonic()
            for r, (_, pid, deadline) in list(running.items()):
                if now >= deadline:  # C code, a swallowed interrupt: the item's process is killed, not the worker
                    os.kill(pid, signal.SIGKILL)
                    limit = timeout_s + kill_grace_s
                    finish(r, ItemResult(0.0, "timeout", f"its process was killed {limit:g} s after its start"))
    finally:
        for r, (_, pid, _) in running.items():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            r.close()
    return alive


def _worker_main(
    conn: Connection,
    fn: str,
    extraction: str,
    timeout_s: float,
    kill_grace_s: float,
    parent_pid: int,
    options: dict | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Slurm signals every process of a job step (USR1 before the time limit, TERM on scancel): the trainer decides
    # when to stop and shuts its workers down; a worker dying here would score a step's items 0 and break resume.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    global _WORKER_PID
    _WORKER_PID = os.getpid()
    os._exit = _exit_raises  # the worker's own exits below use _REAL_EXIT
    try:
        scorer = build_scorer(fn, extraction, options)
        scorer.warmup()
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    # capped from here on: start-up output (an import error, a crash while loading) stays whole
    sys.stdout.flush()
    sys.stderr.flush()
    forwarders = _cap_output(OUTPUT_CAP_BYTES)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        alive = msg is not None
        try:
            if alive and msg[0] == "concurrent":
                alive = _score_concurrently(conn, scorer, deque(msg[1]), timeout_s, kill_grace_s)
            elif alive:  # a chunk scored in order: each result goes back at once
                chunk = deque(msg[1])
                while chunk:
                    idx, response, ground_truth, meta = chunk.popleft()
                    result = _score_one(scorer, timeout_s, response, ground_truth, meta)
                    conn.send((idx, result))
                    if result.status == "timeout" and chunk:  # the function hangs: the rest at once
                        alive = _score_concurrently(conn, scorer, chunk, timeout_s, kill_grace_s)
                        break
        except (BrokenPipeError, OSError):
            return
        if not alive:
            # Skip interpreter teardown (seconds with sympy loaded): nothing to clean up but the std streams.
            _end_output(forwarders)
            _REAL_EXIT(0)


# The worker's entry point: sys.path comes from the parent before anything of ours is imported, so the worker finds
# the same packages (and the user's reward module) as the parent.
_BOOTSTRAP = """
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
init = conn.recv()
sys.path[:] = init["sys_path"]
from megatron_rlvr.rewards.pool import _worker_main
_worker_main(
    conn, init["fn"], init["extraction"], init["timeout_s"], init["kill_grace_s"], init["parent_pid"], init["options"]
)
"""


def _too_many_failed(n_failed: int, n: int, max_frac: float | None) -> bool:
    # the same comparison as the step's check (check_failure_fraction): failed / n > max_frac
    return max_frac is not None and n_failed / n > max_frac


def _unscored() -> ItemResult:
    return ItemResult(0.0, "unscored", "not scored: too many items of the batch had failed already")


def score_inline(
    scorer, timeout_s: float, items, max_failed_frac: float | None = None, should_stop: Callable[[], bool] | None = None
) -> list[ItemResult]:
    """Score in the calling process (``num_workers=0``). The timeout interrupts only Python code and only in the
    main thread; elsewhere it is not enforced. The caller's SIGALRM handler is restored afterwards.
    ``max_failed_frac``, ``should_stop``: as in :meth:`ScoringPool.score` (asked between items)."""
    main = threading.current_thread() is threading.main_thread()
    results = []
    n_failed = 0
    old = signal.signal(signal.SIGALRM, _on_alarm) if main else None
    try:
        for response, ground_truth, meta in items:
            if should_stop is not None and should_stop():
                raise ScoringStopped("scoring stopped: a stop was requested")
            if _too_many_failed(n_failed, len(items), max_failed_frac):
                results.append(_unscored())
                continue
            if main:
                results.append(_score_one(scorer, timeout_s, response, ground_truth, meta))
            else:
                try:
                    results.append(ItemResult(scorer(response, ground_truth, meta), "ok"))
                except Exception as e:
                    results.append(_failure(e))
            n_failed += results[-1].status != "ok"
    finally:
        if main:
            signal.signal(signal.SIGALRM, old)
    return results


class _Worker:
    def __init__(self, fn: str, extraction: str, timeout_s: float, kill_grace_s: float, options: dict | None = None):
        parent_sock, child_sock = socket.socketpair()
        self.conn = Connection(parent_sock.detach())
        child_fd = child_sock.detach()
        try:
            # close_fds (the default) keeps every other descriptor, e.g. a sibling's socket, out of the worker, so
            # each worker's socket reaches EOF exactly when that worker or the parent goes away.
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(child_fd)], pass_fds=(child_fd,))
        finally:
            os.close(child_fd)
        init = {
            "sys_path": list(sys.path),
            "fn": fn,
            "extraction": extraction,
            "timeout_s": timeout_s,
            "kill_grace_s": kill_grace_s,
            "parent_pid": os.getpid(),
            "options": options,
        }
        self.conn.send(init)
        self.started_at = time.monotonic()
        self.ready = False
        self.queue: deque[int] = deque()
        """Items sent and not answered yet, in the order the worker scores them (the first one is running)."""
        self.concurrent = False
        """The worker scores its items at once (after a timeout), each in its own process: they answer in any
        order, and the worker kills each at its own deadline."""
        self.deadline = 0.0
        """When the worker is killed: in order, the running item's start (the previous result, or the send) +
        timeout + grace; at once, the last result (or send) + timeout + grace + CONCURRENT_SLACK_S (the worker itself
        stopped answering)."""

    @property
    def item(self) -> int | None:
        """The item being scored (None when idle)."""
        return self.queue[0] if self.queue else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered within 10 s
            pass
        self.conn.close()


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def close_live_pools() -> None:
    """Close every pool not closed yet (runs at interpreter exit)."""
    for pool in list(_LIVE_POOLS):
        pool.close()


class ScoringPool:
    """``num_workers`` reward worker processes, started once and reused across :meth:`score` calls."""

    def __init__(
        self,
        fn: str,
        extraction: str,
        num_workers: int,
        timeout_s: float,
        kill_grace_s: float,
        start_timeout_s: float = 120.0,
        on_failure=None,
        options: dict | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        # options: a built-in reward's settings (RewardConfig.scorer_options), handed to every worker
        self._args = (fn, extraction, timeout_s, kill_grace_s, options)
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        """Workers replaced after a hang or crash, over the pool's lifetime."""
        self.on_failure = on_failure
        """Called as ``on_failure(index, ItemResult)`` the moment an item fails (before the batch is done)."""
        self._closed = False
        self._n_failed = 0
        self._hanging = False
        """An item of this batch has timed out: the rest is scored at once, each item in its own process."""
        self._workers: list[_Worker] = []
        _LIVE_POOLS.add(self)
        for _ in range(num_workers):
            self._workers.append(_Worker(*self._args))

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(*self._args)
        self.restarts += 1

    def _handle_message(self, i: int, results: list, pending: deque) -> None:
        w = self._workers[i]
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker is gone: its end of the socket closed
            self._on_death(i, results, pending)
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            self.close()
            raise RuntimeError(f"reward worker failed to start ({self._args[0]!r}): {msg[1]}")
        else:
            idx, result = msg
            self._set(results, idx, result)
            if w.queue and w.queue[0] == idx:
                w.queue.popleft()
            else:  # at once: any order
                w.queue.remove(idx)
            if result.status == "timeout":
                w.concurrent = True  # the worker scores the rest of its items at once from here on
            if not w.queue:
                w.concurrent = False
            # in order, the next item starts now; at once, the worker is alive and another item may start now
            w.deadline = time.monotonic() + self.timeout_s + self.kill_grace_s
            if w.concurrent:
                w.deadline += CONCURRENT_SLACK_S

    def _on_death(self, i: int, results: list, pending: deque) -> None:
        w = self._workers[i]
        try:
            code = w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # socket closed but the process lingers: treat as dead
            code = None
        if not w.ready:
            self.close()
            raise RuntimeError(f"reward worker died during start-up (exit code {code}); its stderr has the cause")
        if w.item is not None:
            self._set(results, w.queue.popleft(), ItemResult(0.0, "error", f"reward worker died (exit code {code})"))
        pending.extendleft(reversed(w.queue))  # its unstarted items, in their order, first in line
        self._replace(i)

    def _set(self, results: list, idx: int, result: ItemResult) -> None:
        results[idx] = result
        self._hanging = self._hanging or result.status == "timeout"
        if result.status != "ok":
            self._n_failed += 1
            if self.on_failure is not None:
                self.on_failure(idx, result)

    def _stop_now(self, n: int, max_failed_frac: float | None) -> bool:
        return _too_many_failed(self._n_failed, n, max_failed_frac)

    def _drop_busy(self, results: list, pending: deque) -> None:
        """Give every item not scored yet status "unscored"; busy workers are replaced (their items' processes
        die with them)."""
        for i, w in enumerate(self._workers):
            if w.queue:  # the running item(s) and the worker's unstarted ones
                for idx in w.queue:
                    results[idx] = _unscored()
                w.queue.clear()
                self._replace(i)
        for idx in pending:
            results[idx] = _unscored()
        pending.clear()

    def score(
        self,
        items: list[tuple[str, str, dict | None]],
        max_failed_frac: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ItemResult]:
        """Score ``items`` (response, ground_truth, metadata); results in input order. Never raises for a bad item;
        raises RuntimeError only if a worker cannot start at all (an environment or configuration problem).

        ``max_failed_frac``: once more than this fraction of ``items`` has failed, stop: the items not yet scored
        (queued or in flight; busy workers are replaced) get status "unscored".

        ``should_stop``: polled every STOP_POLL_S while scoring; when it returns True the batch is abandoned (busy
        workers are replaced) and :class:`ScoringStopped` is raised (a stop signal must not wait for a slow or
        hanging reward function)."""
        if self._closed:
            raise RuntimeError("ScoringPool is closed")
        results: list[ItemResult | None] = [None] * len(items)
        pending = deque(range(len(items)))
        self._n_failed = 0
        self._hanging = False
        frac = max_failed_frac
        while True:
            if should_stop is not None and should_stop():
                self._drop_busy(results, pending)
                raise ScoringStopped("scoring stopped: a stop was requested")
            if self._stop_now(len(items), frac):
                self._drop_busy(results, pending)
                break
            self._dispatch(items, pending, results)
            busy = [w for w in self._workers if w.item is not None]
            if not pending and not busy:
                break
            now = time.monotonic()
            deadlines = [w.deadline for w in busy] + [
                w.started_at + self.start_timeout_s for w in self._workers if not w.ready
            ]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
            if should_stop is not None:
                wait_s = min(wait_s, STOP_POLL_S)
            conn_of = {w.conn: i for i, w in enumerate(self._workers)}
            # A result that arrived just before its deadline counts: messages are read before deadlines are checked.
            for conn in wait(list(conn_of), timeout=wait_s):
                i = conn_of[conn]
                while self._workers[i].conn is conn:  # not replaced: read all it has sent so far
                    self._handle_message(i, results, pending)
                    if self._workers[i].conn is not conn or not conn.poll() or self._stop_now(len(items), frac):
                        break
                if self._stop_now(len(items), frac):  # items scored at once end together: count up to the limit
                    break
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.item is not None and now >= w.deadline and w.concurrent:  # the worker itself stopped answering
                    for idx in list(w.queue):
                        self._set(results, idx, ItemResult(0.0, "timeout", "its reward worker stopped answering"))
                    w.queue.clear()
                    self._replace(i)
                elif w.item is not None and now >= w.deadline:
                    limit = self.timeout_s + self.kill_grace_s
                    idx = w.queue.popleft()
                    pending.extendleft(reversed(w.queue))  # the killed worker's unstarted items
                    w.queue.clear()
                    self._set(
                        results, idx, ItemResult(0.0, "timeout", f"worker killed {limit:g} s after start of item")
                    )
                    self._replace(i)
                elif not w.ready and now >= w.started_at + self.start_timeout_s:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:g} s")
        return results  # type: ignore[return-value]

    def _dispatch(self, items: list, pending: deque, results: list) -> None:
        """Hand out pending items. In order (guided self-scheduling, see the module docstring): a worker gets a chunk
        when it has at most one item left, idle workers first. Once an item of the batch has timed out: everything
        pending at once, split over the ready workers that are idle or already scoring at once."""
        if not pending:
            return
        if not self._hanging:
            for w in sorted(self._workers, key=lambda w: len(w.queue)):  # idle workers first
                if w.ready and len(w.queue) <= 1 and pending:
                    size = max(1, math.ceil(len(pending) / (2 * len(self._workers))))
                    self._send_chunk(w, items, pending, results, size, concurrent=False)
            return
        takers = [w for w in self._workers if w.ready and (w.concurrent or not w.queue)]
        size = math.ceil(len(pending) / len(takers)) if takers else 0
        for w in takers:
            if pending:
                self._send_chunk(w, items, pending, results, size, concurrent=True)

    def _send_chunk(self, w: _Worker, items: list, pending: deque, results: list, size: int, concurrent: bool) -> None:
        """Send ``w`` the next ``size`` items of ``pending``, to be scored in order or at once."""
        chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
        msg = [(idx, *items[idx]) for idx in chunk]
        try:
            w.conn.send(("concurrent" if concurrent else "in order", msg))
        except (BrokenPipeError, ConnectionResetError):
            pending.extendleft(reversed(chunk))  # worker died while idle: its EOF is handled by the caller
            return
        except Exception:  # unpicklable metadata: pickling fails before anything is written
            good = []
            for idx, item in zip(chunk, msg):
                try:
                    pickle.dumps(item)
                    good.append(idx)
                except Exception as e:
                    err = f"cannot send item to worker: {type(e).__name__}: {e}"
                    self._set(results, idx, ItemResult(0.0, "error", err))
            pending.extendleft(reversed(good))
            if good:
                self._send_chunk(w, items, pending, results, len(good), concurrent)
            return
        limit = time.monotonic() + self.timeout_s + self.kill_grace_s
        if concurrent:  # its items start now (as many as CONCURRENT_ITEMS allows)
            w.deadline = max(w.deadline, limit + CONCURRENT_SLACK_S) if w.queue else limit + CONCURRENT_SLACK_S
            w.concurrent = True
        elif not w.queue:  # the chunk's first item starts now; else it starts at the running item's result
            w.deadline = limit
        w.queue.extend(chunk)

    def close(self) -> None:
        """Stop all workers (polite shutdown, then kill); idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                if w.item is None and w.proc.poll() is None:
                    w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
