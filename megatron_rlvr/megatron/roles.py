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

Judge ranks (``parallel.judge_ranks``): the LAST ``judge_ranks`` ranks (after the rollout ranks) serve the reward
judge. They work with either layout: the scorers are the engine leaders of the ranks that roll out (the rollout
ranks, or with ``rollout_ranks=0`` the training ranks, colocated). Each (scorer, judge rank) pair gets a gloo group of
two (``judge_links``; the scorer is its rank 0), for ``megatron_rlvr.rollout.judge_ranks``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.megatron.parallel import env_rank_info, resolve_backend
from megatron_rlvr.slurm_env import export_torch_env

TRAIN, ROLLOUT, JUDGE = "train", "rollout", "judge"


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
    judge_ranks: int = 0
    """The last this-many ranks serve the reward judge."""
    rollout_tp: int = 1
    """Ranks per rollout engine (parallel.rollout_tp): the scorers are the first rank of each engine."""
    judge_links: list = field(default_factory=list)
    """Pair groups {scorer, judge rank}: on a scorer one per judge rank, on a judge rank one per scorer (in the
    orders of ``judge_global_ranks`` / ``scorer_ranks``); empty elsewhere."""

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
        self.judge_links = []
        gc.collect()
        self.store.set(f"bridge/closed/{self.rank}", "1")
        self.store.wait([f"bridge/closed/{r}" for r in range(self.world_size)], timedelta(seconds=timeout_s))

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks - self.judge_ranks

    @property
    def role(self) -> str:
        if self.rank < self.train_ranks:
            return TRAIN
        return ROLLOUT if self.rank < self.train_ranks + self.rollout_ranks else JUDGE

    @property
    def role_rank(self) -> int:
        """Rank within this role's default group."""
        return self.rank - self._role_start(self.role)

    @property
    def role_size(self) -> int:
        return {TRAIN: self.train_ranks, ROLLOUT: self.rollout_ranks, JUDGE: self.judge_ranks}[self.role]

    def _role_start(self, role: str) -> int:
        return {TRAIN: 0, ROLLOUT: self.train_ranks, JUDGE: self.train_ranks + self.rollout_ranks}[role]

    @property
    def scorer_ranks(self) -> list[int]:
        """Global ranks that score rewards: the first rank of each engine among the ranks that roll out."""
        first, count = (self.train_ranks, self.rollout_ranks) if self.rollout_ranks else (0, self.train_ranks)
        return list(range(first, first + count, self.rollout_tp))

    @property
    def judge_global_ranks(self) -> list[int]:
        """Global ranks of the judge ranks."""
        return list(range(self.world_size - self.judge_ranks, self.world_size))

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


def init_roles(
    rollout_ranks: int, backend: str = "auto", timeout_s: float = 600.0, judge_ranks: int = 0, rollout_tp: int = 1
) -> Roles:
    """Join the job's rendezvous store, make this role's default process group and the groups between the roles.
    Call before anything else touches torch.distributed (megatron_rlvr.megatron.parallel.init_distributed then
    keeps the role's group)."""
    if dist.is_initialized():
        raise RuntimeError("init_roles: torch.distributed is already initialised; the roles need a fresh process")
    info = rendezvous_info()
    rank, world = info["rank"], info["world_size"]
    if rollout_ranks < 0 or judge_ranks < 0 or rollout_ranks + judge_ranks == 0:
        raise ValueError(f"init_roles: needs parallel.rollout_ranks or parallel.judge_ranks > 0 (world of {world})")
    if rollout_ranks + judge_ranks >= world:
        raise ValueError(
            f"parallel.rollout_ranks={rollout_ranks} + parallel.judge_ranks={judge_ranks} must leave a training rank "
            f"in a world of {world}"
        )
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
        judge_ranks=judge_ranks,
        rollout_tp=rollout_tp,
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
    if rollout_ranks and rank in (0, n_train):
        roles.data = _gloo(store, "data", 0 if rank == 0 else 1, 2, timeout)
    if rollout_ranks and (rank == 0 or n_train <= rank < n_train + rollout_ranks):
        weights_rank = 0 if rank == 0 else rank - n_train + 1
        make = _nccl if backend == "nccl" else _gloo
        roles.weights = make(store, "weights", weights_rank, rollout_ranks + 1, timeout)
    roles.judge_links = judge_pair_groups(store, rank, roles.scorer_ranks, roles.judge_global_ranks, timeout)
    return roles


def judge_pair_groups(store, rank: int, scorers: list[int], judges: list[int], timeout: timedelta) -> list:
    """This rank's gloo groups of two {scorer, judge rank} (the scorer is group rank 0): on a scorer one per judge
    rank, on a judge rank one per scorer, each in the order given; empty on other ranks. Every rank joins its pairs
    in one global order (scorer, then judge rank), so no two ranks wait on each other's rendezvous."""
    links = []
    for s, scorer in enumerate(scorers):
        for j, judge in enumerate(judges):
            if rank in (scorer, judge):
                links.append(_gloo(store, f"judge/{s}/{j}", 0 if rank == scorer else 1, 2, timeout))
    return links


def _gloo(store, name: str, rank: int, size: int, timeout: timedelta):
    return dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/{name}/", store), rank, size, timeout)


def _nccl(store, name: str, rank: int, size: int, timeout: timedelta):  # pragma: no cover - GPUs only
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"bridge/{name}/", store), rank, size, opts)
