"""Shared fixtures: one persistent pool of 4 gloo ranks for every multi-process test (spawn + megatron import
costs ~15 s, so the whole session pays it once), and the `gpu` marker's skip."""

import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedPool


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
