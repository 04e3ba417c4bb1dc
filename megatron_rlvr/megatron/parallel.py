"""Process-group set-up for a training process: join torch.distributed (launched by ``megatron-rlvr train``,
torchrun or srun), initialise megatron's model-parallel groups, and a few small collectives the loop uses.

Every function here takes what it needs as arguments; the process groups are read from megatron's parallel_state
exactly once (``ProcessGroupCollection.use_mpu_process_groups``) and then passed around.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.config.sections import LaunchConfig
from megatron_rlvr.megatron.cpu_shims import apply_cpu_shims
from megatron_rlvr.slurm_env import dist_env_from_slurm, export_torch_env, free_port, prepare_rendezvous

DEFAULT_COLLECTIVE_TIMEOUT_S: float = LaunchConfig.collective_timeout_s
"""launch.collective_timeout_s's default: 10 minutes, as Megatron-LM's --distributed-timeout-minutes."""
_COLLECTIVE_TIMEOUT_S: float | None = None
"""The timeout init_distributed gave the process groups of this process."""


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
    def cp_rank(self) -> int:
        return self.pg.cp.rank()

    @property
    def cp_size(self) -> int:
        return self.pg.cp.size()

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


def init_distributed(
    tp: int,
    pp: int,
    seed: int,
    backend: str = "auto",
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
) -> DistInfo:
    """Join (or reuse) the default process group and (re-)initialise megatron's model parallel groups for (tp, cp,
    pp) and the experts' (ep, etp; etp None: tp).

    ``timeout_s`` (launch.collective_timeout_s) bounds every collective of the default group and of megatron's
    groups, and the rendezvous: a rank waiting longer for a hung, stopped or unreachable peer raises (gloo; NCCL's
    watchdog aborts the process), ``collective_timeout_message`` turns that error into a clear message, and the job
    ends instead of hanging.
    In a job that spans nodes the rendezvous address is checked and gloo's / NCCL's socket interface is chosen
    first (megatron_rlvr.slurm_env.prepare_rendezvous); local rank 0 of each node prints the choice.

    Reuse: inside a process that already initialised torch.distributed (tests, notebooks), its group is kept; the
    megatron groups are rebuilt only when the layout differs.
    """
    global _COLLECTIVE_TIMEOUT_S
    apply_cpu_shims()
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"collective timeout must be a positive number of seconds, got {timeout_s!r}")
    _COLLECTIVE_TIMEOUT_S = float(timeout_s)
    if not dist.is_initialized():
        info = env_rank_info()
        if info is not None and "RANK" not in os.environ:  # an srun task: give everything the torchrun variables
            export_torch_env(info)
        if info is not None:
            note = prepare_rendezvous(info)
            if note and info["local_rank"] == 0:
                print(f"megatron-rlvr: {note}", flush=True)
        if info is None:
            info = {"rank": 0, "world_size": 1, "local_rank": 0, "master_addr": "127.0.0.1", "master_port": 0}
            if info["master_port"] == 0:
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
    if world % (tp * cp * pp):
        raise ValueError(
            f"parallel.tp x parallel.cp x parallel.pp = {tp * cp * pp} does not divide the world size {world}"
        )
    init_model_parallel(tp, pp, seed, ep=ep, etp=etp, timeout_s=timeout_s, cp=cp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return DistInfo(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        backend=dist.get_backend(),
        pg=ProcessGroupCollection.use_mpu_process_groups(),
        device=device,
    )


def check_expert_layout(world: int, tp: int, pp: int, ep: int, etp: int) -> None:
    """ValueError unless megatron can build the expert groups: the experts' own decomposition of the world is
    etp x ep x expert-dp x pp, so etp x ep x pp must divide the world size."""
    for name, v in (("ep", ep), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"parallel.{name} must be a positive int, got {v!r}")
    if world % (etp * ep * pp):
        raise ValueError(
            f"parallel.etp x parallel.ep x parallel.pp = {etp * ep * pp} does not divide the world size {world}"
        )


def init_model_parallel(
    tp: int,
    pp: int,
    seed: int,
    on_rebuild=None,
    ep: int = 1,
    etp: int | None = None,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    cp: int = 1,
) -> None:
    """(Re-)initialise megatron's model-parallel groups for (tp, cp, pp) and the experts' (ep, etp; etp None: tp) on
    an initialised default process group (kept when the layout is unchanged; ``on_rebuild()`` runs after the old ones
    are destroyed), then seed torch and megatron's model-parallel RNG tracker. The trainer and the test harness
    (megatron_rlvr.testing) both use it. ``timeout_s``: the collective timeout of the new groups (megatron's own
    default is 30 minutes). ``cp``: context-parallel size; megatron orders the dense grid tp-cp-dp-pp, so the ranks of
    a CP group are tp apart, and its data-parallel-with-CP group (``dp_cp``) is the one gradients are reduced over."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    etp = tp if etp is None else etp
    if dist.get_world_size() % (tp * cp * pp):
        raise ValueError(
            f"parallel.tp x parallel.cp x parallel.pp = {tp * cp * pp} does not divide the world size "
            f"{dist.get_world_size()}"
        )
    check_expert_layout(dist.get_world_size(), tp, pp, ep, etp)
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
            and parallel_state.get_context_parallel_world_size() == cp
            and parallel_state.get_expert_model_parallel_world_size() == ep
            and parallel_state.get_expert_tensor_parallel_world_size() == etp
        )
        if not same:
            parallel_state.destroy_model_parallel()
            if on_rebuild is not None:
                on_rebuild()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=timeout_s / 60.0,  # only ever used as timedelta(minutes=...)
        )
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


# A collective that ran past the process group's timeout: gloo's "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed
# out waiting 10000ms for recv operation to complete" (a plain RuntimeError), the TCP store's DistStoreError "Timed
# out after 11 seconds waiting for clients", NCCL's watchdog "WorkNCCL(...) ran for N milliseconds before timing out".
_TIMEOUT_RE = re.compile(r"timed out|before timing out", re.IGNORECASE)
_FROM_DIST_RE = re.compile(r"gloo|nccl|c10d", re.IGNORECASE)
_RENDEZVOUS_RE = re.compile(r"waiting for clients|clients joined", re.IGNORECASE)


def collective_timeout_message(e: BaseException) -> str | None:
    """A clear one-line explanation when ``e`` is a torch.distributed timeout of this process's groups; else None."""
    if _COLLECTIVE_TIMEOUT_S is None or not isinstance(e, RuntimeError) or not _TIMEOUT_RE.search(str(e)):
        return None
    if not (isinstance(e, dist.DistError) or _FROM_DIST_RE.search(str(e))):
        return None  # a timeout of something else (an engine, a file system)
    limit = f"launch.collective_timeout_s={_COLLECTIVE_TIMEOUT_S:g} s"
    if _RENDEZVOUS_RE.search(str(e)):
        return (
            f"the rendezvous did not complete within {limit}: a rank did not start, or cannot reach "
            f"MASTER_ADDR={os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        )
    return (
        f"a collective waited longer than {limit}: another rank is hung or stopped, or its node is down; this rank "
        "exits so that the job ends (raise the option if a step legitimately keeps ranks waiting longer)"
    )
