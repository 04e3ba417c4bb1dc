"""Multi-node Slurm: the slurm/ scripts and the real trainer across nodes, on tools/slurm_cluster.sh's cluster (3
nodes, each a network namespace on one machine with its own address, host name and /etc/hosts; CI starts it next to
the single-node one). The jobs use 2 nodes, one task each; the third node is the spare a requeued job moves to.

1. Rendezvous whatever a node's host name resolves to: every node's /etc/hosts maps its own name to 127.0.1.1 (the
   Debian / Ubuntu default), where gloo, left alone, binds to loopback and tells its peers so ("connectFullMesh
   failed"). A 2 x 2-task stand-in all-reduce, then the real trainer with DP=2 across the 2 nodes: both COMPLETE, and
   every node's rank reports its bridge interface.
2. The real trainer with TP=2 across the 2 nodes; the second node crashes (unplugged, every process killed) after a
   checkpoint: the survivor gives up its collective after launch.collective_timeout_s with the message, slurmctld
   sets the node DOWN (SlurmdTimeout + 2 x MessageTimeout), requeues the job onto the spare node, and the trainer
   resumes from the newest checkpoint the first attempt completed, and COMPLETES.
3. A stopped rank (SIGSTOP on the second node): the other rank leaves its collective after
   launch.collective_timeout_s with the message, srun ends the step, the job is FAILED (not hung for 30 minutes).
The single-node fail-fast test also runs on this cluster (tests/e2e/test_slurm.py). Skipped when the cluster is not
running, unless MEGATRON_RLVR_REQUIRE_SLURM=1 (CI). Each test prints its timings (pytest -s / -rA).
"""

import os
import re
import signal
import time
from pathlib import Path

import pytest
from slurm_helpers import (
    DONE,
    cancel_on_error,
    cancel_submitted,
    cluster,
    heal_cluster,
    hostnames,
    job_info,
    log_time,
    metrics,
    multi_node_env,
    show_job,
    submit,
    task_program_pid,
    wait_for_log,
    wait_state,
)

from megatron_rlvr.models.checkpointing import checkpoint_problem, list_checkpoints

NET = "10."  # tools/slurm_cluster.sh's private /24 (SLURM_CLUSTER_NET 10.77.0 unless overridden)
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1")
# Short enough that a survivor of a node crash gives up before slurmctld declares the node DOWN (~25-30 s with the
# cluster's SlurmdTimeout=10 / MessageTimeout=10), long enough for the ranks' start-up skew on a busy 2-core machine
# (it also bounds the rendezvous).
COLLECTIVE_TIMEOUT_S = 20
TRAIN_OPTS = "checkpoint.export_hf=false logging.plot_at_end=false logging.tensorboard=off"
TIMEOUT_MESSAGE = (
    f"a collective waited longer than launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S} s: another rank is hung or "
    "stopped, or its node is down"
)


@pytest.fixture(scope="module")
def multi():
    return multi_node_env()


@pytest.fixture(autouse=True)
def _heal(request):
    """Each test starts on a healthy cluster and leaves no job, dead node or loopback hosts file behind."""
    env = request.getfixturevalue("multi")
    yield
    cancel_submitted()
    heal_cluster(env)


def _socket_lines(text: str) -> dict[str, str]:
    """{node: interface line} of the trainer's / stand-in's rendezvous report, one per node."""
    out = {}
    for m in re.finditer(r"rank \d+ on (node\d+): rendezvous (\S+), gloo/NCCL sockets on (\S+) \((\S+),", text):
        out[m.group(1)] = m.group(0)
    return out


def _check_sockets(text: str, nodes: list[str]) -> None:
    lines = _socket_lines(text)
    assert sorted(lines) == sorted(nodes), (lines, text)
    for line in lines.values():
        ip = re.search(r"sockets on eth0 \((\S+),", line)
        assert ip and ip.group(1).startswith(NET) and not ip.group(1).startswith("127."), line


def test_rendezvous_when_host_names_resolve_to_loopback(multi, tmp_path):
    t0 = time.monotonic()
    nodes = ["node1", "node2", "node3"]
    for node in nodes:
        cluster("hosts", node, "loopback")
    # the trap is armed: on each node its own name resolves to 127.0.1.1, the others' to their bridge addresses
    r = cluster("exec", "node2", "getent", "hosts", "node2", "node1")
    assert re.search(r"^127\.0\.1\.1\s+node2$", r.stdout, re.M) and re.search(r"^10\.\S+\s+node1$", r.stdout, re.M), r

    # a 2 x 2-task gloo all-reduce: two ranks per node, pairs within and across nodes
    job, log = submit(
        multi,
        tmp_path,
        "python tests/slurm_standin.py allreduce",
        sbatch_args=("--nodes=2", "--ntasks=4", "--ntasks-per-node=2"),
    )
    info = wait_state(multi, job, DONE, timeout=90)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert text.count("ALLREDUCE_OK") == 4 and "all_reduce sum 10 expected 10" in text, text
    job_nodes = hostnames(multi, info["NodeList"])
    assert len(job_nodes) == 2
    for m in re.finditer(r"rank (\d)/4 local (\d)", text):
        assert int(m.group(2)) == int(m.group(1)) % 2, text  # block distribution: local ranks 0, 1 on each node
    assert len(_socket_lines(text)) == 2, text  # one line per node (any rank of it)
    _check_sockets(text, job_nodes)
    print(f"\n[loopback] stand-in all-reduce, 4 ranks on {info['NodeList']}: {time.monotonic() - t0:.1f} s")
    for line in _socket_lines(text).values():
        print(f"[loopback] {line}")

    # the real trainer, DP=2 across the two nodes
    t1 = time.monotonic()
    steps = 6
    cmd = f"megatron-rlvr train configs/tiny.yaml parallel.tp=1 schedule.steps={steps} {TRAIN_OPTS}"
    (tmp_path / "dp").mkdir()
    job, log = submit(multi, tmp_path / "dp", cmd, sbatch_args=TWO_NODES)
    with cancel_on_error(multi, job):
        info = wait_state(multi, job, DONE, timeout=240)
    text = log.read_text()
    show_job("loopback-dp", multi, job, log, (r"MASTER_ADDR", r"sockets on", r"world 2", r"finished"))
    print(f"[loopback-dp] trainer DP=2 across nodes: {time.monotonic() - t1:.1f} s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert "world 2 (tp 1, pp 1, dp 2)" in text and f"finished tiny (mcpo) at step {steps}" in text, text
    # MASTER_ADDR is the first node's NodeAddr (the same on every node), not its name, which resolves to 127.0.1.1
    # on that node
    master = re.search(r"^MASTER_ADDR=(\S+)$", text, re.M).group(1)
    assert master.startswith(NET), master
    _check_sockets(text, hostnames(multi, info["NodeList"]))
    recs = metrics(tmp_path / "dp" / "run")
    assert [r["step"] for r in recs] == list(range(1, steps + 1)), recs


def test_node_crash_requeues_the_trainer_onto_the_spare_node_and_it_resumes(multi, tmp_path):
    steps, every = 60, 10
    cmd = (
        f"megatron-rlvr train configs/tiny.yaml schedule.steps={steps} checkpoint.save_every={every} "
        f"checkpoint.keep_last=3 launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S} {TRAIN_OPTS}"
    )
    t0 = time.monotonic()
    job, log = submit(multi, tmp_path, cmd, sbatch_args=TWO_NODES)
    run_dir = tmp_path / "run"
    with cancel_on_error(multi, job):
        wait_state(multi, job, {"RUNNING", *DONE}, timeout=60)
        # a step past the first checkpoint: the second node then dies mid-run with a checkpoint behind it
        wait_for_log(log, rf"(?m)^step {every + 2}/", timeout=240)
        first_nodes = hostnames(multi, job_info(multi, job)["NodeList"])
        assert len(first_nodes) == 2
        victim = first_nodes[1]  # not the batch script's node
        spare = next(n for n in ("node1", "node2", "node3") if n not in first_nodes)
        t_crash = time.monotonic()
        cluster("crash", victim)
        step_at_crash = max(int(s) for s in re.findall(r"(?m)^step (\d+)/", log.read_text()))
        # the requeued job starts again (the batch script logs restart=1) before its trainer can save anything:
        # the newest complete checkpoint now is the one the first attempt left
        wait_for_log(log, r"restart=1", timeout=120)
        t_restart = time.monotonic()
        complete = [s for s, p in list_checkpoints(str(run_dir / "checkpoints")) if checkpoint_problem(p) is None]
        assert complete, list((run_dir / "checkpoints").iterdir())
        k = max(complete)
        info = wait_state(multi, job, DONE, timeout=300)
    t_done = time.monotonic()
    text = log.read_text()
    patterns = (
        r"restart=",
        r"sockets on",
        r"collective",
        r"srun: error",
        r"NODE FAILURE",
        r"resumed from",
        r"finished",
    )
    show_job("node-crash", multi, job, log, patterns)
    first, second = text.split("restart=1", 1)

    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", (info, text)
    # requeued onto the spare node: the surviving node and the spare, not the crashed one
    second_nodes = hostnames(multi, info["NodeList"])
    assert spare in second_nodes and victim not in second_nodes, (first_nodes, second_nodes)
    assert f"nodes={info['NodeList']} tasks=2 restart=1" in text, text
    # the survivor left its collective after the configured timeout, with the message, rather than hanging
    assert TIMEOUT_MESSAGE in first, first
    assert f"Node failure on {victim}" in first, first
    # resumed exactly from the newest checkpoint the first attempt completed, then trained to the end
    assert every <= k <= step_at_crash, (k, step_at_crash)
    assert f"megatron-rlvr: resumed from step {k} |" in second, second
    assert re.search(rf"(?m)^step {k + 1}/{steps} \|", second) and not re.search(rf"(?m)^step {k}/", second), second
    assert f"finished tiny (mcpo) at step {steps}" in second, second
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, steps + 1)), [r["step"] for r in recs]
    restart_at = log_time(next(line for line in text.splitlines() if "restart=1" in line))
    assert all(r["wall_time"] < restart_at for r in recs[:k]), "steps up to the checkpoint are the first attempt's"
    assert all(r["wall_time"] >= restart_at for r in recs[k:]), "steps after it were trained again after the restart"
    print(
        f"[node-crash] crash of {victim} at step {step_at_crash} -> restart on {info['NodeList']} "
        f"{t_restart - t_crash:.1f} s later -> resumed from step {k} -> COMPLETED {t_done - t_crash:.1f} s after the "
        f"crash; test {t_done - t0:.1f} s"
    )


def test_stopped_rank_ends_the_job_after_the_collective_timeout(multi, tmp_path):
    cmd = (
        f"megatron-rlvr train configs/tiny.yaml schedule.steps=2000 checkpoint.save_every=0 "
        f"launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S} {TRAIN_OPTS}"
    )
    t0 = time.monotonic()
    job, log = submit(multi, tmp_path, cmd, sbatch_args=TWO_NODES)
    pid = None
    try:
        with cancel_on_error(multi, job):
            wait_for_log(log, r"(?m)^step 3/", timeout=240)
            pid, node, _ = task_program_pid(multi, job, 1)
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            assert argv[1].endswith("megatron-rlvr") and argv[2] == "train", argv
            t_stop = time.monotonic()
            os.kill(pid, signal.SIGSTOP)  # a hung rank: alive, its sockets open, silent
            info = wait_state(multi, job, DONE, timeout=COLLECTIVE_TIMEOUT_S + 90)
        elapsed = time.monotonic() - t_stop
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    show_job("sigstop", multi, job, log, (r"collective", r"srun: error", r"FAILED"))
    print(f"[sigstop] rank 1 (pid {pid} on {node}) stopped; job {info['JobState']} {elapsed:.1f} s later")
    print(f"[sigstop] test {time.monotonic() - t0:.1f} s")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, text)
    first_node = hostnames(multi, info["NodeList"])[0]
    assert TIMEOUT_MESSAGE in text and f"{first_node}: task 0: Exited with exit code 1" in text, text
    # ended by the timeout (rank 0 waited for it), and soon after it (exits and srun's clean-up on a busy machine)
    assert COLLECTIVE_TIMEOUT_S - 2 <= elapsed <= COLLECTIVE_TIMEOUT_S + 60, elapsed
