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
folders on ``sys.path`` (pyproject ``pythonpath``), so test file names must stay unique across the tiers."""

from pathlib import Path

import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedPool

TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")


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
