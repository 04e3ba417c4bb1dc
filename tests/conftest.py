"""Shared fixtures and the test tiers.

Tiers, one folder each, marked automatically from the folder (``-m unit`` selects the same tests as
``tests/unit``):

- ``unit``: in one process, seconds each; what to run while editing (``pytest -q tests/unit``).
- ``integration``: several ranks over gloo through the shared ``dist_pool`` below, or other multi-process harnesses
  (reward workers, the local launcher) driven in-process.
- ``e2e``: whole runs as a user starts them (``megatron-rlvr train`` / ``eval`` in a subprocess), real vLLM engines,
  Slurm jobs and the launcher.

The ``gpu`` marker (a CUDA GPU: skipped without one) cuts across the tiers; ``tools/gpu_check.sh`` runs those.

The helpers beside this file (trainer_helpers, slurm_helpers, slurm_standin) are importable from every tier, and so
is every test module (``from test_ops_math import reference_stats``): pytest puts this folder and the three tier
folders on ``sys.path`` (pyproject ``pythonpath``), so test file names must stay unique across the tiers.

At the end of the session no process the suite started may still be running (every process it starts carries
``RLVR_TEST_SESSION`` in its environment; see process_helpers.py)."""

import os
import time
import uuid
from pathlib import Path

import process_helpers
import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedPool

SESSION_MARKER = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
os.environ[process_helpers.SESSION_ENV] = SESSION_MARKER
TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")


@pytest.fixture
def one_torch_thread():
    """Torch on one intra-op thread for the test (modules with tiny matmuls use it through ``pytestmark``): on 2
    shared cores extra threads only add contention (10x slower under load)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def dist_pool():
    """One persistent pool of 4 gloo ranks for every multi-process test: spawn + megatron import costs ~15 s, so the
    whole session pays it once."""
    pool = DistributedPool(world_size=4)
    yield pool
    pool.close()


def _tier(item) -> str | None:
    try:
        parts = Path(str(item.path)).resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which reads these markers
def pytest_collection_modifyitems(config, items):
    outside = set()
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        elif Path(str(item.path)).resolve().parent == TESTS_DIR:
            outside.add(Path(str(item.path)).name)
    if outside:
        raise pytest.UsageError(
            f"tests/{', tests/'.join(sorted(outside))}: a test file belongs in tests/unit, tests/integration or "
            'tests/e2e (docs/architecture.md, "Tests")'
        )
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
    _end_in_process_services()
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


def _end_in_process_services() -> None:
    """End the helpers this test process owns and would end at interpreter exit anyway (torch.compile's worker
    pool, W&B's service process), so that the check above sees only what a test left behind: each of them watches
    this process and exits with it, which a leaked rank does not."""
    import sys

    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
