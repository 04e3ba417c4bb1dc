"""Process-group set-up for a training process: join torch.distributed (launched by ``megatron-rlvr train``,
torchrun or srun), initialise megatron's model-parallel groups, and a few small collectives the loop uses.

Every function here takes what it needs as arguments; the process groups are read from megatron's parallel_state
exactly once (``ProcessGroupCollection.use_mpu_process_groups``) and then passed around.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """This rank's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    pg: Any
    """megatron ProcessGroupCollection (tp, pp, dp, ...)."""
    device: torch.device

    @property
    def tp_rank(self) -> int:
        return self.pg.tp.rank()

    @property
    def tp_size(self) -> int:
        return self.pg.tp.size()

    @property
    def pp_rank(self) -> int:
        return self.pg.pp.rank()

    @property
    def pp_size(self) -> int:
        return self.pg.pp.size()

    @property
    def dp_rank(self) -> int:
        return self.pg.dp.rank()

    @property
    def dp_size(self) -> int:
        return self.pg.dp.size()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logger(self) -> bool:
        """Global rank 0 prints and writes files."""
        return self.rank == 0


def env_rank_info(environ=None) -> dict | None:
    """rank / world_size / local_rank / master address from torchrun-style variables (RANK, WORLD_SIZE, ...) or an srun
    task's Slurm variables; None when this process is not one rank of a launched job."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(env.get("MASTER_PORT", 29500)),
        }
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env):
        from megatron_rlvr.slurm_env import dist_env_from_slurm

        return dist_env_from_slurm(env)
    return None


def local_world_size(world_size: int, environ=None) -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE (our launcher, torchrun), else Slurm's tasks on this node, else all."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        v = env.get(key, "")
        head = v.split("(")[0].split(",")[0]  # Slurm writes e.g. "2(x4)" for 2 tasks on each of 4 nodes
        if head.isdigit():
            return int(head)
    return world_size


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("launch.backend=nccl needs CUDA; use gloo on this machine")
    return name


def init_distributed(tp: int, pp: int, seed: int, backend: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join (or reuse) the default process group and (re-)initialise megatron's model parallel groups for (tp, pp).

    Reuse: inside a process that already initialised torch.distributed (tests, notebooks), its group is kept; the
    megatron groups are rebuilt only when the layout differs.
    """
    from megatron_rlvr.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    if not dist.is_initialized():
        info = env_rank_info()
        if info is not None and "RANK" not in os.environ:  # an srun task: give everything the torchrun variables
            from megatron_rlvr.slurm_env import export_torch_env

            export_torch_env(info)
        if info is None:
            info = {"rank": 0, "world_size": 1, "local_rank": 0, "master_addr": "127.0.0.1", "master_port": 0}
            if info["master_port"] == 0:
                from megatron_rlvr.slurm_env import free_port

                info["master_port"] = free_port()
        backend = resolve_backend(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(info["local_rank"] % max(torch.cuda.device_count(), 1))
        dist.init_process_group(
            backend,
            init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
            rank=info["rank"],
            world_size=info["world_size"],
            timeout=timedelta(seconds=timeout_s),
        )
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"parallel.tp x parallel.pp = {tp * pp} does not divide the world size {world}")
    init_model_parallel(tp, pp, seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return DistInfo(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        backend=dist.get_backend(),
        pg=ProcessGroupCollection.use_mpu_process_groups(),
        device=device,
    )


def init_model_parallel(tp: int, pp: int, seed: int, on_rebuild=None) -> None:
    """(Re-)initialise megatron's model-parallel groups for (tp, pp) on an initialised default process group (kept
    when the layout is unchanged; ``on_rebuild()`` runs after the old ones are destroyed), then seed torch and
    megatron's model-parallel RNG tracker. The trainer and the test harness (megatron_rlvr.testing) both use it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
        )
        if not same:
            parallel_state.destroy_model_parallel()
            if on_rebuild is not None:
                on_rebuild()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


# The object and scalar collectives below return at once in a one-process world (or group): a step calls several
# (the rollout's gather, the loss metrics', the mismatch metrics', the finite-gradients and stop checks), and each
# costs a pickle round trip and two gloo collectives, ~1 ms on a busy CPU, for nothing. Their callers get the object
# itself rather than a copy; they build it for the call and do not change it afterwards.


def broadcast_object(obj, src: int = 0, group=None):
    """``obj`` of rank ``src`` on every rank."""
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (in rank order of ``group``)."""
    if dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_max(value: float, group=None) -> float:
    if dist.get_world_size(group) == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def all_reduce_sum_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM all-reduce of a (contiguous) tensor; returns it."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
