"""The gloo harness: results come back from every rank, layouts are initialised as asked, a rank's exception
surfaces with its traceback, a hang ends at the timeout, and the pool recovers after either."""

import os
import time

import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedError, DistributedPool, run_distributed


def _layout_and_allreduce():
    from megatron.core import parallel_state as ps

    t = torch.tensor([float(torch.distributed.get_rank() + 1)])
    torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return dict(
        rank=torch.distributed.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp=ps.get_data_parallel_world_size(),
        tp_sum=t.item(),
        pid=os.getpid(),
    )


def _raise_on_rank1():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on rank one")
    torch.distributed.barrier()  # the other ranks block here: the harness must not hang on them
    return "unreachable"


def _hang():
    time.sleep(3600)


def test_layouts_results_and_reuse(dist_pool):
    out = dist_pool.run(_layout_and_allreduce, tp=2, pp=1)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["tp"] == 2 and o["dp"] == 2 and o["pp"] == 1 for o in out)
    # megatron puts consecutive ranks in one TP group: {0,1} and {2,3}
    assert [o["tp_sum"] for o in out] == [3.0, 3.0, 7.0, 7.0]
    out2 = dist_pool.run(_layout_and_allreduce, tp=1, pp=2)
    assert all(o["tp"] == 1 and o["pp"] == 2 and o["dp"] == 2 for o in out2)
    assert sorted(o["pp_rank"] for o in out2) == [0, 0, 1, 1]
    assert [o["pid"] for o in out] == [o["pid"] for o in out2], "the pool must reuse its ranks"


def test_exception_propagates_with_traceback_then_recovers(dist_pool):
    with pytest.raises(DistributedError) as err:
        dist_pool.run(_raise_on_rank1, timeout=60)
    msg = str(err.value)
    assert "rank 1" in msg and "ValueError: boom on rank one" in msg and "_raise_on_rank1" in msg
    out = dist_pool.run(_layout_and_allreduce, tp=4)
    assert [o["tp_sum"] for o in out] == [10.0] * 4


def test_timeout_kills_ranks_no_orphans():
    pool = DistributedPool(2)
    try:
        pids = [o["pid"] for o in pool.run(_layout_and_allreduce, tp=2)]
        with pytest.raises(TimeoutError, match="timed out"):
            pool.run(_hang, timeout=3)
        assert pool._procs == [], "timed-out ranks must be killed"
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        pool.close()


def test_run_distributed_one_shot():
    out = run_distributed(_layout_and_allreduce, world_size=2, tp=2)
    assert [o["tp_sum"] for o in out] == [3.0, 3.0]


def _start_grandchild():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    return child.pid


def test_killed_ranks_take_their_children_along():
    """A rank's own children (e.g. a checkpoint writer's Manager process) must not survive a timeout kill."""
    pool = DistributedPool(2)
    try:
        grandchildren = pool.run(_start_grandchild)
        with pytest.raises(TimeoutError):
            pool.run(_hang, timeout=2)
        time.sleep(0.5)
        for pid in grandchildren:
            try:
                os.kill(pid, 0)
                alive = open(f"/proc/{pid}/stat").read().split()[2] != "Z"
            except (ProcessLookupError, FileNotFoundError):
                alive = False
            assert not alive, f"grandchild {pid} outlived its killed rank"
    finally:
        pool.close()


def _make_groups_and_count_threads(n_new):
    import threading as th

    for _ in range(n_new):
        torch.distributed.new_group(ranks=list(range(torch.distributed.get_world_size())))
    return len(os.listdir(f"/proc/{os.getpid()}/task")), th.active_count()


def test_process_groups_do_not_accumulate(dist_pool):
    """Each gloo group keeps run-loop threads alive: groups a task makes, and those of a replaced layout, must be
    destroyed, or a long test session piles up hundreds of threads per rank."""
    first = dist_pool.run(_make_groups_and_count_threads, tp=2, args=(3,))
    for tp in (1, 2, 4, 1, 2):
        last = dist_pool.run(_make_groups_and_count_threads, tp=tp, args=(3,))
    for (t0, _), (t1, _) in zip(first, last):
        assert t1 <= t0 + 8, f"threads per rank grew from {t0} to {t1}"
