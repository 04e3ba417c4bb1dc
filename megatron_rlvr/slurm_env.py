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

In a job that spans nodes, ``prepare_rendezvous`` also pins the network interface of gloo's and NCCL's sockets
(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless already set) to the one this node uses to reach the other nodes of
the job. Left alone, gloo binds to the address that this node's host name resolves to and hands it to its peers:
on a node whose /etc/hosts maps its own name to 127.0.1.1 (the Debian / Ubuntu default) every rank advertises a
loopback address and the first collective fails ("Gloo connectFullMesh failed ... remote=[127.0.1.1]"). It also
refuses, with the reason, a MASTER_ADDR that resolves to a loopback address on a node other than rank 0's (the
rendezvous would otherwise wait for the whole timeout).

    python -m megatron_rlvr.slurm_env      # prints the values as shell assignments (debugging aid)
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import socket
import struct
import sys
from collections.abc import Mapping, MutableMapping

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 20000


LOCAL_PORTS = (24000, 32000)
"""Where :func:`free_port` looks: below Linux's default ephemeral range (32768-60999), from which the kernel hands
out the source ports of outgoing connections. A port taken from that range can be handed to some other process's
connection between the moment it is found free and the moment rank 0 listens on it (EADDRINUSE under load). Above
the ports of Slurm jobs' rendezvous that a local test cluster's first job ids give (MASTER_PORT_BASE + job id)."""


def free_port() -> int:
    """A TCP port free on this host now (rendezvous of a local launch, the test harness): a random one of
    LOCAL_PORTS that binds, else one the kernel picks."""
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(*LOCAL_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


# ------------------------------------------------------------------------------------------------------------------
# Network interface and rendezvous address of a job that spans nodes
# ------------------------------------------------------------------------------------------------------------------

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _ipv4_addresses(host: str) -> list[str]:
    """IPv4 addresses of ``host`` as this node resolves it (its /etc/hosts, DNS), in resolver order; [] if none."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def route_source_address(address: str) -> str | None:
    """The local address this host's routing table uses to reach IPv4 ``address`` (a UDP ``connect`` sends
    nothing); None when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """{interface name: its (primary) IPv4 address} of this host's interfaces that have one."""
    import fcntl

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: struct ifreq = 16-byte name, then a sockaddr_in (address at bytes 20..24)
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def _default_route_interface() -> str | None:
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    for row in rows:
        if len(row) > 3 and row[1] == "00000000" and int(row[3], 16) & 1:  # destination 0.0.0.0, flag RTF_UP
            return row[0]
    return None


def job_hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """The nodes of this srun step (else of the job) from Slurm's environment; [] outside Slurm."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return expand_hostlist(nodelist) if nodelist else []


def spans_nodes(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this job's ranks live on more than one node: LOCAL_WORLD_SIZE < WORLD_SIZE where a launcher says so
    (torchrun; ``megatron-rlvr train``'s own launch is one node, also inside a larger allocation), else more than one
    node in Slurm's node list (srun tasks)."""
    env = os.environ if environ is None else environ
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit():
        return int(local) < int(world)
    return len(job_hosts(env)) > 1


def on_rank0_node(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs on the node of global rank 0 (srun --distribution=block: the step's first node;
    torchrun: node rank 0)."""
    env = os.environ if environ is None else environ
    for key in ("SLURM_NODEID", "GROUP_RANK", "NODE_RANK"):
        if env.get(key, "").isdigit():
            return int(env[key]) == 0
    return True


def socket_interface(environ: Mapping[str, str] | None = None) -> tuple[str, str, str] | None:
    """(interface, its address, how it was found) for gloo's / NCCL's sockets in a job that spans nodes: the
    interface of the route to another node of the job (resolved here, loopback answers skipped), else of the route
    to MASTER_ADDR, else of the default route. None on a single node or when no interface is found."""
    env = os.environ if environ is None else environ
    if not spans_nodes(env):
        return None
    me = env.get("SLURMD_NODENAME") or socket.gethostname()
    targets = [(h, f"the route to {h}") for h in job_hosts(env) if h != me]
    if env.get("MASTER_ADDR"):
        targets.append((env["MASTER_ADDR"], f"the route to MASTER_ADDR={env['MASTER_ADDR']}"))
    by_address = {a: name for name, a in interface_addresses().items()}
    for host, how in targets:
        for address in _ipv4_addresses(host):
            if _is_loopback(address):
                continue
            src = route_source_address(address)
            if src and not _is_loopback(src) and src in by_address:
                return by_address[src], src, how
    name = _default_route_interface()
    if name:
        address = interface_addresses().get(name)
        if address:
            return name, address, "the default route"
    return None


def check_master_addr(dist: Mapping, environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError when MASTER_ADDR cannot be rank 0's address from this node: it resolves to nothing, or only
    to loopback addresses on a node that is not rank 0's (the rendezvous would wait for its whole timeout)."""
    env = os.environ if environ is None else environ
    addr = str(dist["master_addr"])
    addresses = _ipv4_addresses(addr)
    if not addresses:
        try:
            socket.getaddrinfo(addr, None)  # an IPv6-only name is fine
            return
        except (OSError, UnicodeError):
            raise ValueError(f"MASTER_ADDR={addr} does not resolve on this node ({socket.gethostname()})") from None
    if spans_nodes(env) and not on_rank0_node(env) and all(_is_loopback(a) for a in addresses):
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        raise ValueError(
            f"MASTER_ADDR={addr} resolves to the loopback address {addresses[0]} on {node}, which is not the node of "
            "rank 0: export MASTER_ADDR as an address of rank 0's node that every node can reach"
        )


def prepare_rendezvous(dist: Mapping, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Before torch.distributed starts in a job that spans nodes: check MASTER_ADDR (``check_master_addr``) and pin
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (each unless already set) to ``socket_interface()``. Returns a line that
    says what was chosen (None on a single node: nothing to choose)."""
    env = os.environ if environ is None else environ
    if not spans_nodes(env):
        return None
    check_master_addr(dist, env)
    where = f"rank {dist['rank']} on {env.get('SLURMD_NODENAME') or socket.gethostname()}"
    rendezvous = f"rendezvous {dist['master_addr']}:{dist['master_port']}"
    preset = {k: env[k] for k in SOCKET_IFNAME_VARS if env.get(k)}
    if len(preset) == len(SOCKET_IFNAME_VARS):
        return f"{where}: {rendezvous}, sockets as set: " + " ".join(f"{k}={v}" for k, v in preset.items())
    found = socket_interface(env)
    if found is None:
        return f"{where}: {rendezvous}, no interface found for gloo/NCCL sockets (set GLOO_SOCKET_IFNAME)"
    name, address, how = found
    for k in SOCKET_IFNAME_VARS:
        if not env.get(k):
            env[k] = name
    kept = "".join(f", {k}={v} kept" for k, v in preset.items())
    return f"{where}: {rendezvous}, gloo/NCCL sockets on {name} ({address}, {how}){kept}"


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
