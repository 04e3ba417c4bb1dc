"""Roles of the disaggregated layout: the first ``world - parallel.rollout_ranks`` ranks train (Megatron), the last
``parallel.rollout_ranks`` ranks run rollout engines. One SPMD job, launched the usual ways (local ranks, torchrun,
srun): every rank reads the same torch.distributed variables and joins one rendezvous store.

Each role gets its OWN default process group (``torch.distributed`` then means "my role": megatron's groups, the
checkpointer's and the logger's collectives on the training ranks, the rollout all-gather on the rollout ranks), so a
role never waits in a collective of the other. The roles talk over two dedicated groups, used directly (their
methods, not ``torch.distributed.*``):

- ``data``: {training rank 0, rollout rank 0}: rollout batches, point to point;
- ``weights``: {training rank 0} + every rollout rank: versioned weight publishes, broadcast from training rank 0.

Gloo everywhere on CPU. On GPUs the weights group is NCCL (buckets go GPU to GPU); the data group stays gloo (pickled
Python objects on the host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.megatron.parallel import env_rank_info, resolve_backend
from megatron_rlvr.slurm_env import export_torch_env

TRAIN, ROLLOUT = "train", "rollout"


@dataclass
class Roles:
    """This rank's role and the groups between the roles."""

    rank: int
    """Global rank."""
    world_size: int
    """All ranks of the job (both roles)."""
    rollout_ranks: int
    """The last this-many ranks run rollout engines."""
    data: Any = None
    """ProcessGroup {training rank 0 (group rank 0), rollout rank 0 (group rank 1)}; None on other ranks."""
    weights: Any = None
    """ProcessGroup {training rank 0 (group rank 0), rollout ranks 1..R}; None on the other training ranks."""
    store: Any = None
    """The job's rendezvous store (served by global rank 0)."""
    local_rank: int = 0
    """This rank's index on its node (both roles counted)."""
    timeout_s: float = 600.0
    """Longest wait at a barrier of the whole job (launch.collective_timeout_s)."""

    def barrier(self, name: str) -> None:
        """Wait until every rank of the job (both roles) has reached the barrier ``name`` (a store barrier: the
        roles share no process group)."""
        self.store.set(f"barrier/{name}/{self.rank}", "1")
        self.store.wait([f"barrier/{name}/{r}" for r in range(self.world_size)], timedelta(seconds=self.timeout_s))

    def close(self, timeout_s: float) -> None:
        """Destroy the groups between the roles and wait until every rank of the job has (a store barrier). A gloo
        group left to interpreter exit while its peer's process exits too aborts now and then in its destructor
        (SIGABRT, "terminate called without an active exception": measured on torch 2.13 in about one exit in
        six), which would turn a finished run's exit code into 134. Call it only at a clean end, once nothing of
        this rank uses the groups (receiving threads ended and their references dropped)."""
        import gc

        self.data = self.weights = None
        gc.collect()
        self.store.set(f"bridge/closed/{self.rank}", "1")
        self.store.wait([f"bridge/closed/{r}" for r in range(self.world_size)], timedelta(seconds=timeout_s))

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def role(self) -> str:
        return TRAIN if self.rank < self.train_ranks else ROLLOUT

    @property
    def role_rank(self) -> int:
        """Rank within this role's default group."""
        return self.rank if self.role == TRAIN else self.rank - self.train_ranks

    @property
    def role_size(self) -> int:
        return self.train_ranks if self.role == TRAIN else self.rollout_ranks

    @property
    def leader(self) -> bool:
        """Rank 0 of its role: the end of the data channel."""
        return self.role_rank == 0


def rendezvous_info() -> dict:
    """rank / world_size / local_rank / master address of this launched rank (local ranks, torchrun or srun)."""
    info = env_rank_info()
    if info is None:
        raise RuntimeError(
            "parallel.rollout_ranks > 0 needs a launched job of several ranks (megatron-rlvr train with "
            "launch.nproc, torchrun or srun); this process is not one rank of a job"
        )
    if "RANK" not in os.environ:  # an srun task: give everything the torchrun variables
        export_torch_env(info)
    return info


def init_roles(rollout_ranks: int, backend: str = "auto", timeout_s: float = 600.0) -> Roles:
    """Join the job's rendezvous store, make this role's default process group and the two groups between the roles.
    Call before anything else touches torch.distributed (megatron_rlvr.megatron.parallel.init_distributed then
    keeps the role's group)."""
    if dist.is_initialized():
        raise RuntimeError("init_roles: torch.distributed is already initialised; the roles need a fresh process")
    info = rendezvous_info()
    rank, world = info["rank"], info["world_size"]
    if not 0 < rollout_ranks < world:
        raise ValueError(f"parallel.rollout_ranks={rollout_ranks} must leave a training rank in a world of {world}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        info["master_addr"], info["master_port"], world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    roles = Roles(
        rank=rank,
        world_size=world,
        rollout_ranks=rollout_ranks,
        store=store,
        local_rank=info["local_rank"],
        timeout_s=timeout_s,
    )
    backend = resolve_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(info["local_rank"] % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"role/{roles.role}/", store),
        rank=roles.role_rank,
        world_size=roles.role_size,
        timeout=timeout,
    )
    n_train = roles.train_ranks
    if rank in (0, n_train):
        roles.data = _gloo(store, "data", 0 if rank == 0 else 1, 2, timeout)
    if rank == 0 or rank >= n_train:
        weights_rank = 0 if rank == 0 else rank - n_train + 1
        make = _nccl if backend == "nccl" else _gloo
        roles.weights = make(store, "weights", weights_rank, rollout_ranks + 1, timeout)
    return roles


def _gloo(store, name: str, rank: int, size: int, timeout: timedelta):
    return dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/{name}/", store), rank, size, timeout)


def _nccl(store, name: str, rank: int, size: int, timeout: timedelta):  # pragma: no cover - GPUs only
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"bridge/{name}/", store), rank, size, opts)
