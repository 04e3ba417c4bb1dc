"""Shared fixtures: one persistent pool of 4 gloo ranks for every multi-process test (spawn + megatron import
costs ~15 s, so the whole session pays it once), the `gpu` marker's skip, and the end-of-session check that no
process the suite started is still running (every process it starts carries ``RLVR_TEST_SESSION`` in its
environment; see process_helpers.py)."""

import os
import time
import uuid

import process_helpers
import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedPool

SESSION_MARKER = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
os.environ[process_helpers.SESSION_ENV] = SESSION_MARKER


@pytest.fixture(scope="session")
def dist_pool():
    pool = DistributedPool(world_size=4)
    yield pool
    pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the session, naming their command lines, when a process the suite started is still alive: such a
    process (a rank whose launcher was killed, a helper a failed test did not end) can run for good, holding memory,
    ports and run directories. Reward workers of managers left open are shut down first, as at interpreter exit."""
    from megatron_rlvr.rewards.pool import close_live_pools

    close_live_pools()
    # what was just killed may still be exiting (a rank's parent watchdog polls every 0.5 s)
    deadline = time.monotonic() + 5.0
    left = process_helpers.leftover_processes(SESSION_MARKER)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = process_helpers.leftover_processes(SESSION_MARKER)
    if not left:
        return
    lines = [f"{len(left)} process(es) started by the test session are still running (now killed):"]
    for p in left:
        try:
            lines.append(f"  pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:400]}")
            p.kill()
        except Exception as e:  # noqa: BLE001 - it may have exited meanwhile
            lines.append(f"  pid {p.pid}: {type(e).__name__}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True, bold=True)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
