"""Slurm scripts and rank mapping, no Slurm needed (a real cluster: tests/e2e/test_slurm.py).

Rendering: slurm/mcpo_14b.sh run in dry-run mode under a simulated 4-node allocation (the SLURM_* variables sbatch
would set for its own #SBATCH lines); then the environment srun gives each of the 32 tasks goes through
megatron_rlvr.slurm_env.dist_env_from_slurm: ranks 0..31, world 32, local ranks 0..7 per node, one rendezvous
address (the node of rank 0) and port, identical in the shell and the Python derivation. slurm/mcpo_14b_disagg.sh
likewise (3 nodes; the last node's ranks are the rollout ranks; its header's layout table is the planner's).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import REPO

from megatron_rlvr.slurm_env import (
    check_master_addr,
    dist_env_from_slurm,
    expand_hostlist,
    interface_addresses,
    master_port_for_job,
    on_rank0_node,
    prepare_rendezvous,
    route_source_address,
    socket_interface,
    spans_nodes,
)


def sbatch_directives(script: Path) -> dict[str, str]:
    out = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def dry_run(script: str, env_extra: dict[str, str]) -> dict[str, str]:
    """Run an sbatch script with RLVR_DRY_RUN=1 and parse its KEY=value lines and its 'SRUN: ...' line."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "RLVR_DRY_RUN": "1", **env_extra}
    if "SLURM_CONF" in os.environ:  # lets scontrol expand the host list when a cluster is configured
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    r = subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("SRUN: "):
            out["SRUN"] = line[len("SRUN: ") :]
        elif "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


def test_expand_hostlist_matches_slurm_syntax():
    assert expand_hostlist("gpu[001-003,007],login1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("a[8-11]") == ["a8", "a9", "a10", "a11"]
    assert expand_hostlist("localhost") == ["localhost"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_hostlist("gpu[1-2")
    if shutil.which("scontrol") and "SLURM_CONF" in os.environ:
        for hl in ("gpu-a[07-08],gpu-b[10-11]", "r[1-2]n[1-2]", "gpu[001-003,007],login1"):
            r = subprocess.run(["scontrol", "show", "hostnames", hl], capture_output=True, text=True, timeout=10)
            assert r.stdout.split() == expand_hostlist(hl), hl


def test_dist_env_errors_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID is not set"):
        dist_env_from_slurm({})
    with pytest.raises(ValueError, match=r"SLURM_PROCID=4 is outside 0..3"):
        dist_env_from_slurm({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"})
    with pytest.raises(ValueError, match="MASTER_ADDR nor SLURM_JOB_NODELIST"):
        dist_env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})


def test_mcpo_14b_renders_rank_world_address_for_4_nodes():
    script = REPO / "slurm" / "mcpo_14b.sh"
    d = sbatch_directives(script)
    nodes, per_node = int(d["nodes"]), int(d["ntasks-per-node"])
    assert (nodes, per_node) == (4, 8) and d["gpus-per-node"] == "8"
    assert d["signal"] == "USR1@180" and "requeue" in d and d["output"] == "logs/%x-%j.out"

    hosts_expr, job_id = "gpu-a[07-08],gpu-b[10-11]", "1234567"
    hosts = expand_hostlist(hosts_expr)
    # what sbatch exports for `--nodes=4 --ntasks-per-node=8`
    alloc = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "mcpo-14b",
        "SLURM_JOB_NODELIST": hosts_expr,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
    }
    out = dry_run(str(script), {**alloc, "RLVR_OVERRIDES": "train.seed=3"})
    assert out["MASTER_ADDR"] == "gpu-a07"
    assert int(out["MASTER_PORT"]) == master_port_for_job(job_id) == 20000 + 1234567 % 20000
    assert out["RLVR_RUN_DIR"] == f"{REPO}/runs/mcpo-14b-{job_id}"
    srun = out["SRUN"].split()
    assert srun[0] == "srun" and srun[-4:] == ["megatron-rlvr", "train", "configs/mcpo_14b.yaml", "train.seed=3"]
    for flag in ("--kill-on-bad-exit=1", "--distribution=block", "--nodes=4", "--ntasks=32", "--ntasks-per-node=8"):
        assert flag in srun, flag
    assert not any(a.startswith("--container") for a in srun)

    # srun --distribution=block: tasks 0..7 on the first node, 8..15 on the second, ...
    seen = []
    for task in range(nodes * per_node):
        task_env = {
            **alloc,
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task % per_node),
            "SLURM_NODEID": str(task // per_node),
            "SLURMD_NODENAME": hosts[task // per_node],
            "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
            "SLURM_STEP_NODELIST": hosts_expr,
            "MASTER_ADDR": out["MASTER_ADDR"],
            "MASTER_PORT": out["MASTER_PORT"],
        }
        d_shell = dist_env_from_slurm(task_env)
        # the Python derivation alone (e.g. inside a container without the exported values) must agree
        d_py = dist_env_from_slurm({k: v for k, v in task_env.items() if not k.startswith("MASTER_")})
        assert d_py == d_shell
        seen.append((d_shell, task_env["SLURMD_NODENAME"]))
    assert sorted(d["rank"] for d, _ in seen) == list(range(32))
    assert {d["world_size"] for d, _ in seen} == {32}
    for n in range(nodes):
        assert sorted(d["local_rank"] for d, host in seen if host == hosts[n]) == list(range(8))
    assert {(d["master_addr"], d["master_port"]) for d, _ in seen} == {("gpu-a07", int(out["MASTER_PORT"]))}
    rank0_host = next(host for d, host in seen if d["rank"] == 0)
    assert rank0_host == out["MASTER_ADDR"]  # the TCP store is served by rank 0: it must live on MASTER_ADDR


def test_container_flags_and_other_scripts_render():
    alloc = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "16",
        "SLURM_NTASKS_PER_NODE": "8",
    }
    out = dry_run("slurm/dapo_7b.sh", {**alloc, "CONTAINER_IMAGE": "/images/rlvr.sqsh"})
    srun = out["SRUN"].split()
    assert "--container-image=/images/rlvr.sqsh" in srun
    assert f"--container-mounts={REPO}:{REPO}" in srun and f"--container-workdir={REPO}" in srun
    assert srun[-3:] == ["megatron-rlvr", "train", "configs/dapo_7b.yaml"]
    d = sbatch_directives(REPO / "slurm" / "qwen3_30b_a3b.sh")
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("4", "8", "8")
    assert d["signal"] == "USR1@180" and "requeue" in d and d["output"] == "logs/%x-%j.out"
    four = {**alloc, "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS": "32"}
    out = dry_run("slurm/qwen3_30b_a3b.sh", {**four, "RLVR_OVERRIDES": "train.routing_replay=r2"})
    srun = out["SRUN"].split()
    assert srun[-4:] == ["megatron-rlvr", "train", "configs/qwen3_30b_a3b.yaml", "train.routing_replay=r2"]
    assert "--nodes=4" in srun and "--ntasks=32" in srun and out["MASTER_ADDR"] == "n1"
    out = dry_run("slurm/cpgd_vl_7b.sh", alloc)
    assert out["SRUN"].split()[-3:] == ["megatron-rlvr", "train", "configs/cpgd_qwen2_5_vl_7b.yaml"]
    d = sbatch_directives(REPO / "slurm" / "cpgd_vl_7b.sh")
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("2", "8", "8") and d["signal"] == "USR1@180"
    out = dry_run("slurm/tiny_cpu.sh", {**alloc, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"})
    assert out["SRUN"].split()[-3:] == ["megatron-rlvr", "train", "configs/tiny.yaml"]
    d = sbatch_directives(REPO / "slurm" / "tiny_cpu.sh")
    assert d["ntasks"] == "2" and "gpus-per-node" not in d


def test_mcpo_14b_disagg_renders_the_last_node_as_the_rollout_ranks_and_matches_its_plan():
    """slurm/mcpo_14b_disagg.sh: 3 nodes x 8 tasks; srun's block distribution puts ranks 16..23 on the third node,
    which are the config's parallel.rollout_ranks (the last ranks); the config validates for that world, and the
    layout table in the script's header is the planner's (its chosen row and a refused one)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.config.run import check_disaggregated_layout
    from megatron_rlvr.planner import format_search, load_plan_config, search_layouts

    script = REPO / "slurm" / "mcpo_14b_disagg.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    d = sbatch_directives(script)
    nodes, per_node = int(d["nodes"]), int(d["ntasks-per-node"])
    assert (nodes, per_node) == (3, 8) and d["gpus-per-node"] == "8"
    assert d["signal"] == "USR1@180" and "requeue" in d and d["output"] == "logs/%x-%j.out"
    hosts_expr = "gpu[01-03]"
    alloc = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "mcpo-14b-disagg",
        "SLURM_JOB_NODELIST": hosts_expr,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
    }
    out = dry_run(str(script), alloc)
    srun = out["SRUN"].split()
    assert srun[-3:] == ["megatron-rlvr", "train", "configs/mcpo_14b_disagg.yaml"]
    for flag in ("--kill-on-bad-exit=1", "--distribution=block", "--nodes=3", "--ntasks=24"):
        assert flag in srun, flag
    cfg = load_run_config(str(REPO / "configs" / "mcpo_14b_disagg.yaml"), check_files=False)
    world = nodes * per_node
    check_disaggregated_layout(cfg, world)  # (the model's own checks need its files: tests/unit/test_planner.py)
    R = cfg.parallel.rollout_ranks
    assert R == per_node and cfg.rollout.max_staleness >= 1
    hosts = expand_hostlist(hosts_expr)
    for task in range(world):
        env = {**alloc, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % per_node)}
        env.update({"SLURM_NODEID": str(task // per_node), "SLURMD_NODENAME": hosts[task // per_node]})
        rank = dist_env_from_slurm(env)["rank"]
        assert (rank >= world - R) == (env["SLURMD_NODENAME"] == hosts[-1]), rank  # rollout ranks = the last node
    table = format_search(
        search_layouts(load_plan_config(REPO / "configs" / "mcpo_14b_disagg.yaml", warn=lambda _: None))
    )
    rows = [" ".join(line.split()) for line in table.splitlines()]
    header = [" ".join(line.lstrip("# ").split()) for line in script.read_text().splitlines() if line.startswith("#  ")]
    chosen = next(r for r in rows if r.endswith("<- chosen"))
    assert chosen in header, (chosen, header)
    refused = next(r for r in header if " no: " in r)
    assert any(r.startswith(refused.split(" no:")[0]) for r in rows), refused


def test_rendezvous_preparation_without_a_cluster():
    """slurm_env.prepare_rendezvous on fake environments (the multi-node tests run it for real): nothing to choose on
    one node; a loopback MASTER_ADDR refused on a node other than rank 0's; socket variables already set are kept;
    without a peer address (here every name resolves to loopback) the default route's interface is chosen. Only
    /etc/hosts names are resolved: no lookup leaves the machine."""
    dist = {"rank": 1, "master_addr": "localhost", "master_port": 20001}
    one = {"SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost", "SLURM_NODEID": "0"}
    assert not spans_nodes(one) and socket_interface(one) is None and prepare_rendezvous(dist, one) is None
    assert not any(k.endswith("SOCKET_IFNAME") for k in one)
    assert spans_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert not spans_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) and not spans_nodes({})
    # our own launcher inside a 2-node allocation: its ranks are on one node
    assert not spans_nodes({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "SLURM_JOB_NODELIST": "n[1-2]"})

    two = {"SLURM_JOB_NODELIST": "localhost,thisnode", "SLURMD_NODENAME": "thisnode", "SLURM_NODEID": "1"}
    assert spans_nodes(two) and not on_rank0_node(two)
    with pytest.raises(ValueError, match=r"MASTER_ADDR=localhost resolves to the loopback address 127\.0\.0\.1 on "):
        prepare_rendezvous(dist, dict(two))
    check_master_addr(dist, {**two, "SLURMD_NODENAME": "localhost", "SLURM_NODEID": "0"})  # rank 0's own node

    preset = {**two, "SLURM_NODEID": "0", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib1"}
    note = prepare_rendezvous(dist, preset)
    assert preset["GLOO_SOCKET_IFNAME"] == "ib0" and preset["NCCL_SOCKET_IFNAME"] == "ib1"
    assert note.endswith("sockets as set: GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib1"), note

    assert interface_addresses().get("lo") == "127.0.0.1" and route_source_address("127.0.0.1") == "127.0.0.1"
    env = {**two, "SLURM_NODEID": "0", "GLOO_SOCKET_IFNAME": "ib0"}
    found = socket_interface(env)
    note = prepare_rendezvous(dist, env)
    if found is None:  # a machine without a default route
        assert "no interface found" in note and "NCCL_SOCKET_IFNAME" not in env, note
    else:
        name, address, how = found
        assert how == "the default route" and interface_addresses()[name] == address and name != "lo"
        assert env["NCCL_SOCKET_IFNAME"] == name and env["GLOO_SOCKET_IFNAME"] == "ib0", env
        assert f"sockets on {name} ({address}, the default route), GLOO_SOCKET_IFNAME=ib0 kept" in note, note


def test_collective_timeout_option_and_message():
    """launch.collective_timeout_s: validated, default 600 s, and a timed-out collective's error becomes a message
    naming it (the multi-node tests fire it for real: a stopped rank, a crashed node)."""
    import torch

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.config.sections import LaunchConfig
    from megatron_rlvr.megatron import parallel

    assert LaunchConfig().collective_timeout_s == parallel.DEFAULT_COLLECTIVE_TIMEOUT_S == 600.0
    assert load_run_config(None, ["launch.collective_timeout_s=45"]).launch.collective_timeout_s == 45
    for bad in ("0", "-1", "inf", "true"):
        with pytest.raises(ValueError, match="launch.collective_timeout_s must be a "):
            load_run_config(None, [f"launch.collective_timeout_s={bad}"])

    saved = parallel._COLLECTIVE_TIMEOUT_S
    try:
        parallel._COLLECTIVE_TIMEOUT_S = None  # no process group yet: nothing to explain
        gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation")
        assert parallel.collective_timeout_message(gloo) is None
        parallel._COLLECTIVE_TIMEOUT_S = 20.0
        msg = parallel.collective_timeout_message(gloo)
        assert msg.startswith("a collective waited longer than launch.collective_timeout_s=20 s: another rank is hung")
        nccl = RuntimeError(
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
            "Timeout(ms)=20000) ran for 20001 milliseconds before timing out."
        )
        assert parallel.collective_timeout_message(nccl) == msg
        store = torch.distributed.DistStoreError("Timed out after 21 seconds waiting for clients. 1/2 clients joined.")
        assert parallel.collective_timeout_message(store).startswith("the rendezvous did not complete within launch")
        assert parallel.collective_timeout_message(RuntimeError("[gloo/pair.cc:589] Connection closed by peer")) is None
        assert parallel.collective_timeout_message(RuntimeError("engine step timed out")) is None  # not ours
        assert parallel.collective_timeout_message(ValueError("timed out")) is None
        assert len(msg) < 300  # the CLI's error line keeps the first 300 characters
    finally:
        parallel._COLLECTIVE_TIMEOUT_S = saved


def test_tools_7b_renders_and_its_header_is_the_planners_table():
    """slurm/tools_qwen2_5_7b.sh (multi-turn rollouts with the Python tool): 1 node x 8 tasks running its config, and
    the layout table in its header is the planner's (the chosen row and a refused one)."""
    from megatron_rlvr.planner import format_search, load_plan_config, search_layouts

    script = REPO / "slurm" / "tools_qwen2_5_7b.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    d = sbatch_directives(script)
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("1", "8", "8") and d["signal"] == "USR1@180"
    alloc = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "8",
             "SLURM_NTASKS_PER_NODE": "8"}  # fmt: skip
    assert dry_run(str(script), alloc)["SRUN"].split()[-3:] == [
        "megatron-rlvr",
        "train",
        "configs/tools_qwen2_5_7b.yaml",
    ]
    table = format_search(
        search_layouts(load_plan_config(REPO / "configs" / "tools_qwen2_5_7b.yaml", warn=lambda _: None))
    )
    rows = [" ".join(line.split()) for line in table.splitlines()]
    header = [" ".join(line.lstrip("# ").split()) for line in script.read_text().splitlines() if line.startswith("#  ")]
    chosen = next(r for r in rows if r.endswith("<- chosen"))
    assert chosen in header, (chosen, header)
    refused = [r for r in header if " no: " in r]
    assert refused and all(any(row.startswith(r.split(" no:")[0]) for row in rows) for r in refused), refused


@pytest.mark.parametrize("name, nodes, cp", [("long_qwen3_8b_32k", 2, 2), ("long_qwen3_32b_64k", 8, 4)])
def test_long_trace_scripts_render_and_their_headers_are_the_planners_table(name, nodes, cp):
    """slurm/long_*.sh (32k / 64k responses): N nodes x 8 tasks running their config; the layout table in the header
    is the planner's (the chosen row and the refused ones), the chosen layout is the config's and uses context
    parallelism, and no layout without it fits (the reason the config needs cp > 1)."""
    from megatron_rlvr.planner import format_search, load_plan_config, search_layouts

    script = REPO / "slurm" / f"{name}.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    d = sbatch_directives(script)
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == (str(nodes), "8", "8") and d[
        "signal"
    ] == "USR1@180"
    alloc = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": f"n[1-{nodes}]", "SLURM_JOB_NUM_NODES": str(nodes),
             "SLURM_NTASKS": str(8 * nodes), "SLURM_NTASKS_PER_NODE": "8"}  # fmt: skip
    assert dry_run(str(script), alloc)["SRUN"].split()[-3:] == ["megatron-rlvr", "train", f"configs/{name}.yaml"]
    cfg = load_plan_config(REPO / "configs" / f"{name}.yaml", warn=lambda _: None)
    plans = search_layouts(cfg)
    chosen = next(p for p in plans if p.fits).config.parallel
    par = cfg.parallel
    assert (chosen.tp, chosen.cp, chosen.pp, chosen.rollout_tp) == (par.tp, par.cp, par.pp, par.rollout_tp)
    assert par.cp == cp and not any(p.fits for p in plans if p.config.parallel.cp == 1)
    rows = [" ".join(line.split()) for line in format_search(plans).splitlines()]
    header = [" ".join(line.lstrip("# ").split()) for line in script.read_text().splitlines() if line.startswith("#  ")]
    start = header.index(rows[0].split(" (GiB")[0])  # the column names, then the rows
    table = [r for r in header[start + 1 :] if r[0].isdigit()]
    assert len(table) >= 4
    assert [r for r in table if r.endswith("<- chosen")] == [next(r for r in rows if r.endswith("<- chosen"))]
    refused = [r for r in table if " no: " in r]
    assert refused and all(any(row.startswith(r.split(" no:")[0] + " no:") for row in rows) for r in refused), refused
    assert all(r in rows for r in table if r.endswith(" fits")), table


def test_free_port_is_below_the_ephemeral_range_and_binds():
    """A local launch's rendezvous port comes from LOCAL_PORTS (below the kernel's ephemeral range, which hands
    ports to other processes' outgoing connections) and can be listened on; a taken port is never returned."""
    import socket

    from megatron_rlvr.slurm_env import LOCAL_PORTS, free_port

    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert LOCAL_PORTS[1] <= lo
    for _ in range(20):
        port = free_port()
        assert LOCAL_PORTS[0] <= port < LOCAL_PORTS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
            assert free_port() != port


def test_moonlight_renders_on_one_node_and_its_header_is_the_planners_table():
    """slurm/moonlight_16b_a3b.sh (DeepSeek-V3 layout, the first MoE run of that family): 1 node x 8 tasks running
    its config; the config validates with the trainer's loader; every row of the layout table in the header is a
    row of `plan --search` on that config (same numbers, same verdict), the row marked chosen is the config's layout
    and fits, and the refused rows are refused by the search."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.planner import format_search, load_plan_config, search_layouts

    script = REPO / "slurm" / "moonlight_16b_a3b.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    d = sbatch_directives(script)
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("1", "8", "8") and d["signal"] == "USR1@180"
    assert "requeue" in d and d["output"] == "logs/%x-%j.out"
    alloc = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "8",
             "SLURM_NTASKS_PER_NODE": "8"}  # fmt: skip
    srun = dry_run(str(script), {**alloc, "RLVR_OVERRIDES": "train.moe_expert_bias_update_rate=1e-3"})["SRUN"].split()
    assert srun[-4:] == [
        "megatron-rlvr",
        "train",
        "configs/moonlight_16b_a3b.yaml",
        "train.moe_expert_bias_update_rate=1e-3",
    ]
    assert "--nodes=1" in srun and "--ntasks=8" in srun
    path = REPO / "configs" / "moonlight_16b_a3b.yaml"
    run = load_run_config(str(path), check_files=False)
    assert run.model.name == "moonlight-16b-a3b" and run.model.hf_path.endswith("/Moonlight-16B-A3B-Instruct")
    cfg = load_plan_config(path, warn=lambda _: None)
    assert cfg.model.name == "Moonlight-16B-A3B" and cfg.model.mla is not None
    rows = [" ".join(line.split()) for line in format_search(search_layouts(cfg)).splitlines()]
    header = [" ".join(line.lstrip("# ").split()) for line in script.read_text().splitlines() if line.startswith("#  ")]
    start = header.index(rows[0].split(" (GiB")[0])  # the column names, then the rows
    table = [r for r in header[start + 1 :] if r[0].isdigit()]
    assert len(table) >= 6
    searched = {r.removesuffix(" <- chosen") for r in rows}
    for r in table:  # a fitting row may carry a note after "fits"
        assert (r.split(" fits")[0] + " fits" if " fits" in r else r) in searched, r
    chosen = [r for r in table if r.endswith("<- chosen")]
    p = run.parallel
    assert len(chosen) == 1 and chosen[0].split()[:5] == [str(x) for x in (p.tp, p.pp, p.rollout_tp, 8 // p.tp, p.ep)]
    assert " fits" in chosen[0] and any(" no: " in r for r in table)
