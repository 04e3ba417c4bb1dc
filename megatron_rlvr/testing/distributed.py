"""Run a function on N gloo ranks with megatron parallel state initialised: the multi-process test harness.

Spawning a rank and importing megatron-core costs ~15 s on a 2-core machine: ranks fork from a forkserver that has
imported torch and megatron-core once, and a :class:`DistributedPool` keeps N ranks alive and runs many checks on
them, re-initialising megatron's parallel state whenever the requested (TP, PP) layout changes. Guarantees:

- any rank's exception is re-raised in the caller with that rank's traceback;
- every call finishes: a per-call timeout kills the ranks (a rank blocked in a collective cannot be recovered),
  and the next call spawns fresh ones;
- no orphans: ranks are killed on ``close()`` and at interpreter exit, and a watchdog thread in each rank exits
  it if the parent process disappears (e.g. pytest killed with SIGKILL).

``fn`` must be picklable (a module-level function); its return value must be picklable (tensors are fine).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rlvr.megatron.cpu_shims import apply_cpu_shims
from megatron_rlvr.megatron.parallel import init_model_parallel
from megatron_rlvr.rundir.local_ranks import rank_environment
from megatron_rlvr.slurm_env import free_port


class DistributedError(RuntimeError):
    """A rank raised; the message carries its traceback."""


# Expected on CPU machines, once per module per process: noise in every test log.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

_PRELOAD = [
    "megatron_rlvr.testing.distributed",
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
]


def _context():
    """A forkserver that has imported torch and megatron-core once: each rank then starts in ~1 s instead of paying
    ~15 s of imports on a 2-core machine. The ranks themselves are fresh forks of that clean server (no CUDA, no
    threads, no process group), so they are as isolated as spawned processes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _watch_parent(parent_pid: int) -> None:
    # Ranks are children of the forkserver, not of the caller, so watch the caller's pid directly.
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        time.sleep(1.0)


def _destroy_groups(keep: frozenset = frozenset()) -> None:
    """Destroy every process group but WORLD and ``keep``. Why: each gloo group owns a TCP pair and run-loop
    threads per peer that live as long as the group; a long-lived rank that re-initialises megatron for many layouts
    (and runs code that makes its own groups) otherwise accumulates hundreds of busy threads and slows the machine."""
    world = dist.group.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world and pg not in keep:
            dist.destroy_process_group(pg)


def init_megatron_parallel(
    tp: int, pp: int, seed: int = 1234, ep: int = 1, etp: int | None = None, cp: int = 1
) -> frozenset:
    """(Re-)initialise megatron's model-parallel groups for (tp, cp, pp) and the experts' (ep, etp; etp None: tp) and
    seed every RNG, as the trainer does
    (trainer.distributed.init_model_parallel), destroying a previous layout's extra groups. Returns the process
    groups that exist afterwards (the layout's own), so groups a task creates beyond them can be destroyed after it."""
    init_model_parallel(tp, pp, seed, on_rebuild=_destroy_groups, ep=ep, etp=etp, cp=cp)
    return frozenset(c10d._world.pg_map)


def _worker(rank: int, world_size: int, port: int, tasks, results, parent_pid: int, pg_timeout_s: float) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # 2 cores shared by up to 4 ranks: more intra-op threads only thrash.
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ.update(rank_environment(rank, world_size, "127.0.0.1", port, threads))
    try:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        apply_cpu_shims()
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    except BaseException:
        results.put((None, rank, False, pickle.dumps(traceback.format_exc())))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, payload = task
        try:
            fn, (tp, pp, ep, etp, cp), seed, args, kwargs = pickle.loads(payload)
            layout_groups = init_megatron_parallel(tp, pp, seed, ep=ep, etp=etp, cp=cp)
            out = fn(*args, **kwargs)
            _destroy_groups(keep=layout_groups)
            results.put((task_id, rank, True, pickle.dumps(out)))
        except BaseException:
            results.put((task_id, rank, False, pickle.dumps(traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class DistributedPool:
    """``world_size`` persistent gloo ranks; ``run(fn, tp=, pp=, ep=, etp=, cp=)`` executes ``fn`` on all of them.

    Ranks are spawned lazily on the first ``run`` and again after a failure or timeout.
    """

    def __init__(self, world_size: int, pg_timeout_s: float = 600.0):
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size must be in 1..8 for CPU tests, got {world_size}")
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self._procs: list[mp.Process] = []
        self._tasks: list[Any] = []
        self._results = None
        self._next_id = 0

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, os.getpid(), self.pg_timeout_s),
                # Not daemonic: ranks must be able to start children (dist_checkpointing's writer, reward workers).
                # Cleanup is guaranteed by atexit below and by each rank's parent watchdog.
                daemon=False,
                name=f"rlvr-rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(_kill_all, list(self._procs))

    def close(self) -> None:
        """Stop the ranks: politely, then by force. Safe to call twice."""
        for q in self._tasks:
            with _suppress():
                q.put(None)
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        _kill_all(self._procs)
        for p in self._procs:
            p.join(timeout=5.0)
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running ---------------------------------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        cp: int = 1,
        args: tuple = (),
        kwargs: dict | None = None,
        seed: int = 1234,
        timeout: float = 300.0,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank under a (tp, cp, pp) layout with ``ep`` expert-parallel ranks
        and expert TP ``etp`` (None: tp); return the per-rank results."""
        if self.world_size % (tp * cp * pp) != 0:
            raise ValueError(f"tp*cp*pp={tp * cp * pp} does not divide world_size={self.world_size}")
        if self.world_size % (ep * (tp if etp is None else etp) * pp) != 0:
            raise ValueError(f"ep*etp*pp does not divide world_size={self.world_size}")
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, (tp, pp, ep, etp, cp), seed, args, kwargs or {}))
        for q in self._tasks:
            q.put((task_id, payload))

        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_until = None  # after the first error, others are likely blocked in a collective with the failed rank
        while len(outputs) + len(errors) < self.world_size:
            try:
                tid, rank, ok, blob = self._results.get(timeout=1.0)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline or (grace_until is not None and now > grace_until):
                    break
                dead = [p for p in self._procs if not p.is_alive()]
                if dead and grace_until is None:
                    errors[-1] = "rank process(es) died without reporting: " + ", ".join(
                        f"{p.name} (exit code {p.exitcode})" for p in dead
                    )
                    grace_until = now + 3.0
                continue
            if tid is not None and tid != task_id:  # stale result of an earlier, aborted task
                continue
            if ok:
                outputs[rank] = pickle.loads(blob)
            else:  # tid None: the rank failed while starting up
                errors[rank] = pickle.loads(blob)
                grace_until = grace_until or time.monotonic() + 3.0

        if errors or len(outputs) < self.world_size:
            self._kill()
            missing = sorted(set(range(self.world_size)) - set(outputs) - set(errors))
            if errors:
                text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise DistributedError(
                    f"{fn.__name__} failed on ranks {sorted(errors)} (tp={tp}, cp={cp}, pp={pp}, ep={ep}, etp={etp}):"
                    f"\n{text}"
                )
            raise TimeoutError(f"{fn.__name__} timed out after {timeout:.0f}s; ranks {missing} did not finish")
        return [outputs[r] for r in range(self.world_size)]


def _kill_all(procs: list) -> None:
    """Kill ranks together with their descendants (e.g. dist_checkpointing's multiprocessing Manager, reward
    workers): a killed rank cannot shut its children down, and they would outlive the test run as orphans."""
    import psutil

    for p in procs:
        if not p.is_alive():
            continue
        try:
            children = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        p.kill()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
    args: tuple = (),
    kwargs: dict | None = None,
    seed: int = 1234,
    timeout: float = 300.0,
) -> list[Any]:
    """One-shot: spawn ``world_size`` ranks, run ``fn`` once, shut them down."""
    with DistributedPool(world_size) as pool:
        return pool.run(fn, tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, args=args, kwargs=kwargs, seed=seed, timeout=timeout)
