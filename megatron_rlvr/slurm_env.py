"""Rank / world size / rendezvous address of this process, from Slurm's environment (one srun task per GPU).

The trainer calls ``dist_env_from_slurm(os.environ)`` when it runs under srun and initialises torch.distributed
with ``init_method=f"tcp://{master_addr}:{master_port}"`` (or exports the values with ``export_torch_env`` and
uses ``env://``). The shell side (slurm/common.sh) computes MASTER_ADDR / MASTER_PORT the same way and exports
them, so both agree even where scontrol is unavailable inside a container:

  rank        = SLURM_PROCID      (global task id, 0 .. SLURM_NTASKS-1)
  world_size  = SLURM_NTASKS      (SLURM_STEP_NUM_TASKS inside a step that uses fewer tasks than the job)
  local_rank  = SLURM_LOCALID     (task id on this node = the GPU index to use)
  master_addr = $MASTER_ADDR if set, else the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST
                (what `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1` prints)
  master_port = $MASTER_PORT if set, else MASTER_PORT_BASE + SLURM_JOB_ID % MASTER_PORT_SPAN
                (a stable port per job, so a requeued job, which keeps its id, reuses it; two jobs sharing a
                node only collide if their ids are equal modulo the span)

    python -m megatron_rlvr.slurm_env      # prints the values as shell assignments (debugging aid)
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Mapping, MutableMapping

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 20000


def free_port() -> int:
    """A TCP port free on this host now (rendezvous of a local launch, the test harness)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_port_for_job(job_id: int | str) -> int:
    """The rendezvous port of a Slurm job; slurm/common.sh uses the same formula."""
    try:
        jid = int(str(job_id).split("_")[0])  # array jobs: "1234_5" -> 1234
    except ValueError:
        raise ValueError(f"SLURM_JOB_ID {job_id!r} is not an integer") from None
    return MASTER_PORT_BASE + jid % MASTER_PORT_SPAN


def _split_top_level(s: str) -> list[str]:
    """Split a hostlist on commas that are not inside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {s!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {s!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_ranges(body: str, where: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in hostlist {where!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # Slurm keeps the zero padding of the lower bound: gpu[001-010]
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in hostlist {where!r}")
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist expression ('gpu[001-003,007],login1', 'r[1-2]n[1-2]') into host names."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        m = re.search(r"\[([^\[\]]*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, suffix = part[: m.start()], part[m.end() :]
        for mid in _expand_ranges(m.group(1), hostlist):
            # the suffix may hold further bracket groups (cartesian product, as Slurm does)
            hosts += expand_hostlist(prefix + mid + suffix)
    return hosts


def _int(environ: Mapping[str, str], key: str) -> int:
    if key not in environ:
        raise ValueError(f"{key} is not set: not running as an srun task (launch with srun, see slurm/)")
    try:
        return int(environ[key])
    except ValueError:
        raise ValueError(f"{key}={environ[key]!r} is not an integer") from None


def dist_env_from_slurm(environ: Mapping[str, str] | None = None) -> dict:
    """dict(rank, world_size, local_rank, master_addr, master_port) of this srun task.

    Raises ValueError naming the variable when the environment is not that of an srun task or is inconsistent.
    """
    env = os.environ if environ is None else environ
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID")
    if world < 1 or not (0 <= rank < world):
        raise ValueError(f"SLURM_PROCID={rank} is outside 0..{world - 1} (world size {world})")
    if local_rank < 0 or local_rank > rank:
        raise ValueError(f"SLURM_LOCALID={local_rank} is inconsistent with SLURM_PROCID={rank}")

    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        addr = expand_hostlist(nodelist)[0]
    port_s = env.get("MASTER_PORT")
    if port_s:
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"MASTER_PORT={port_s!r} is not an integer") from None
    else:
        if "SLURM_JOB_ID" not in env:
            raise ValueError("neither MASTER_PORT nor SLURM_JOB_ID is set")
        port = master_port_for_job(env["SLURM_JOB_ID"])
    if not (1 <= port <= 65535):
        raise ValueError(f"master port {port} is out of range")
    return {"rank": rank, "world_size": world, "local_rank": local_rank, "master_addr": addr, "master_port": port}


def export_torch_env(dist: Mapping, environ: MutableMapping[str, str] | None = None) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for torch.distributed's env:// init."""
    env = os.environ if environ is None else environ
    env["RANK"] = str(dist["rank"])
    env["WORLD_SIZE"] = str(dist["world_size"])
    env["LOCAL_RANK"] = str(dist["local_rank"])
    env["MASTER_ADDR"] = str(dist["master_addr"])
    env["MASTER_PORT"] = str(dist["master_port"])


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--first-host"] and len(argv) == 2:
        print(expand_hostlist(argv[1])[0])
        return 0
    try:
        d = dist_env_from_slurm()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, v in d.items():
        print(f"{k.upper()}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
