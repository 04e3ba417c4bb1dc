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


# ------------------------------------------------------------------------------------ processes a test launches

_LAUNCHER_LIKE = """
import signal, subprocess, sys, time
# a rank as the local launcher starts it: its own process group, and it does not watch its parent
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
print(int(signal.getsignal(signal.SIGHUP) == signal.SIG_DFL), rank.pid, flush=True)
time.sleep(600)
"""


def test_a_launched_command_gets_default_signals_and_ending_it_ends_its_ranks_groups():
    """The SIGHUP fault test's rank, started while SIGHUP was ignored in the test process, ignored the SIGHUP the
    test sent and kept running after the test, because the test killed only the launcher (the rank leads its own
    process group). A command started by process_helpers gets SIGHUP at its default although the test process
    ignores it, and ending it ends every process of its session, the rank in its own group included."""
    import signal
    import subprocess
    import sys

    from process_helpers import SESSION_ENV, end_session, leftover_processes, start

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does to the test process
    try:
        launcher = start([sys.executable, "-c", _LAUNCHER_LIKE], stdout=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGHUP, old)
    try:
        default, rank = map(int, launcher.stdout.readline().split())
        assert default == 1
        assert os.getpgid(rank) == rank != os.getpgid(launcher.pid)
        mine = {p.pid for p in leftover_processes(os.environ[SESSION_ENV])}
        assert {launcher.pid, rank} <= mine
    finally:
        end_session(launcher)
    mine = {p.pid for p in leftover_processes(os.environ[SESSION_ENV])}
    assert launcher.pid not in mine and rank not in mine


_LEAKY_TEST = """
import subprocess, sys


def test_leaks():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # LEAKED-BY-TEST"], start_new_session=True)
"""


def test_the_session_fails_naming_a_process_a_test_left_running(tmp_path):
    """The end-of-session check: a pytest session whose only test passes but leaves a process running (in its own
    session, so no process-group kill reaches it) fails, prints the process's command line, and kills it. Without
    the check the session passed and the process ran for its whole 600 s."""
    import subprocess
    import sys

    import psutil

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where conftest.py is
    (tmp_path / "test_leak.py").write_text(_LEAKY_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    env.pop("RLVR_TEST_SESSION", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert "1 passed" in text, text[-3000:]
    assert out.returncode == 1, text[-3000:]
    assert "process(es) started by the test session are still running" in text and "LEAKED-BY-TEST" in text
    left = [p for p in psutil.process_iter(["cmdline"]) if "LEAKED-BY-TEST" in " ".join(p.info["cmdline"] or [])]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
