"""Helpers of the Slurm tests (tests/e2e/test_slurm.py: the single-node cluster of tools/slurm_local.sh;
tests/e2e/test_slurm_multinode.py: the multi-node cluster of tools/slurm_cluster.sh): finding a running cluster,
submitting slurm/ scripts, waiting for job states and log lines, and finding the process of one task.

A missing cluster skips the tests that need it, unless MEGATRON_RLVR_REQUIRE_SLURM=1 (CI), which makes it a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from process_helpers import SESSION_ENV

REPO = Path(__file__).resolve().parents[1]
REQUIRE_SLURM = os.environ.get("MEGATRON_RLVR_REQUIRE_SLURM") == "1"
CLUSTER_SH = REPO / "tools" / "slurm_cluster.sh"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _conf_from_env_file(env_file: Path) -> str | None:
    if env_file.exists():
        m = re.search(r"export SLURM_CONF=(\S+)", env_file.read_text())
        if m:
            return m.group(1).strip("'\"")
    return None


def single_node_conf() -> str | None:
    """SLURM_CONF of the single-node cluster: $SLURM_CONF, else tools/slurm_local.sh's env file."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    return _conf_from_env_file(Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/megatron-rlvr-slurm")) / "env.sh")


def cluster_dir() -> Path:
    return Path(os.environ.get("SLURM_CLUSTER_DIR", "/tmp/megatron-rlvr-slurm-cluster"))


def multi_node_conf() -> str | None:
    """SLURM_CONF of tools/slurm_cluster.sh's cluster (its env file; never $SLURM_CONF, the single-node one)."""
    return _conf_from_env_file(cluster_dir() / "env.sh")


def _node_states(env) -> tuple[dict[str, str], str]:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=30)
    states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
    return states, f"sinfo rc={r.returncode}, states={states}, {r.stderr.strip()[:200]}"


def _skip_or_fail(why: str, how: str):
    if REQUIRE_SLURM:
        pytest.fail(f"MEGATRON_RLVR_REQUIRE_SLURM=1 but {why}; start it with: {how}")
    pytest.skip(f"{why} ({how})")


def clean_env(conf: str) -> dict[str, str]:
    env = {**os.environ, "SLURM_CONF": conf}
    for k in [k for k in env if k.startswith(("SLURM_JOB", "SBATCH_", "SRUN_"))]:
        del env[k]  # do not leak an outer allocation into the submissions
    return env


def single_node_env() -> dict[str, str]:
    """Environment for sbatch/scontrol on the single-node cluster; skips (or fails under CI) when there is none."""
    how = "bash tools/slurm_local.sh start"
    conf = single_node_conf()
    if not shutil.which("sbatch"):
        _skip_or_fail("sbatch not installed", how)
    if not conf:
        _skip_or_fail("no SLURM_CONF and no tools/slurm_local.sh env file", how)
    env = clean_env(conf)
    states, detail = _node_states(env)
    if not any(s.rstrip("*") in ("idle", "mixed", "allocated", "completing") for s in states.values()):
        _skip_or_fail(f"Slurm not usable ({detail})", how)
    return env


def multi_node_env(min_nodes: int = 3) -> dict[str, str]:
    """Environment for sbatch/scontrol on tools/slurm_cluster.sh's cluster, all of whose nodes are idle (a node left
    down by an earlier test is restarted); skips (or fails under CI) when there is none or it is too small. The
    node faults need root (namespaces, links)."""
    how = "bash tools/slurm_cluster.sh start"
    conf = multi_node_conf()
    if not shutil.which("sbatch"):
        _skip_or_fail("sbatch not installed", how)
    if not conf:
        _skip_or_fail(f"no multi-node cluster ({cluster_dir()}/env.sh missing)", how)
    if os.geteuid() != 0:
        _skip_or_fail("the multi-node tests inject node faults, which needs root", how)
    env = clean_env(conf)
    states, detail = _node_states(env)
    if len(states) < min_nodes:
        _skip_or_fail(f"the multi-node tests need {min_nodes} nodes ({detail})", how)
    heal_cluster(env)
    return env


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """bash tools/slurm_cluster.sh ARGS (node faults, restarts, hosts files). A slurmd it restarts belongs to the
    cluster (started and stopped around the suite, by .ci/run), not to the test: it runs without the test session's
    marker, so the end-of-session check does not take it for a process a test left behind."""
    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}
    r = subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=120, env=env)
    if check:
        assert r.returncode == 0, f"slurm_cluster.sh {' '.join(args)}: rc={r.returncode}\n{r.stdout}{r.stderr}"
    return r


def heal_cluster(env) -> None:
    """Every node back to normal: its hosts file, its link and slurmd (restart waits until it is idle)."""
    states, detail = _node_states(env)
    for node, state in sorted(states.items()):
        cluster("hosts", node, "normal")
        if state.rstrip("*~#") != "idle" or state.endswith("*"):
            cluster("restart", node)
    states, detail = _node_states(env)
    assert all(s == "idle" for s in states.values()), detail


SUBMITTED: list[tuple[dict, str]] = []


def cancel_submitted() -> None:
    """scancel every job submitted so far (a no-op for finished ones): a failed test must not leave its job
    occupying the nodes (the next jobs would only queue)."""
    while SUBMITTED:
        env, job = SUBMITTED.pop()
        subprocess.run(["scancel", job], env=env, capture_output=True)


def submit(env, tmp: Path, cmd: str, script="slurm/tiny_cpu.sh", extra_env=None, sbatch_args=()) -> tuple[str, Path]:
    log = tmp / "job.out"
    e = {**env, "RLVR_CMD": cmd, "RLVR_RUN_DIR": str(tmp / "run"), **(extra_env or {})}
    argv = ["sbatch", "--parsable", f"--output={log}", *sbatch_args, script]
    r = subprocess.run(argv, cwd=REPO, env=e, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    SUBMITTED.append((env, job))
    return job, log


def job_info(env, job_id: str) -> dict[str, str]:
    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dict(tok.split("=", 1) for tok in r.stdout.split() if "=" in tok)


def wait_state(env, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(env, job_id)
        if info["JobState"] in states:
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"job {job_id} still {info['JobState']} after {timeout}s (wanted {states})")
        time.sleep(0.25)


def wait_for_log(log: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text()) if log.exists() else None
        if m:
            return m
        time.sleep(0.2)
    pytest.fail(f"{pattern!r} not in {log} after {timeout}s:\n{log.read_text() if log.exists() else '(no log)'}")


def hostnames(env, hostlist: str) -> list[str]:
    r = subprocess.run(["scontrol", "show", "hostnames", hostlist], env=env, capture_output=True, text=True, check=True)
    return r.stdout.split()


def task_program_pid(env, job_id: str, task: int) -> tuple[int, str, str]:
    """PID of the program that global task `task` of the job's first step runs (not slurm/common.sh's per-task bash
    wrapper, nor the program's own children such as reward workers), the node it runs on, and the `scontrol listpids`
    output. `scontrol listpids JOB NODE` asks that node's slurmstepd (run off the nodes, as here on the machine of a
    multi-node cluster, the node must be named); PIDs are this machine's (no PID namespaces).
    listpids columns: PID JOBID STEPID LOCALID GLOBALID."""
    for node in hostnames(env, job_info(env, job_id)["NodeList"]):
        r = subprocess.run(["scontrol", "listpids", job_id, node], env=env, capture_output=True, text=True, check=True)
        rows = [line.split() for line in r.stdout.splitlines()[1:]]
        # only the process slurmstepd started for the task (the wrapper) carries its task id; descendants show "-"
        roots = [int(row[0]) for row in rows if len(row) == 5 and row[2] != "batch" and row[4] == str(task)]
        if not roots:
            continue
        assert len(roots) == 1, (r.stdout, roots)
        step_pids = [int(row[0]) for row in rows if len(row) == 5 and row[2] != "batch"]

        def ppid(pid: int) -> int:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

        children = [pid for pid in step_pids if ppid(pid) == roots[0]]
        assert len(children) == 1, (r.stdout, children)
        return children[0], node, r.stdout
    pytest.fail(f"task {task} of job {job_id} not found by scontrol listpids on any of its nodes")


def show_job(tag: str, env, job_id: str, log: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """Print the `scontrol show job` summary and the job log's key lines (visible with pytest -s / -rA)."""
    info = job_info(env, job_id)
    keys = ("JobId", "JobName", "JobState", "Reason", "Restarts", "ExitCode", "RunTime", "NodeList", "NumTasks")
    print(f"\n[{tag}] scontrol show job {job_id}: " + " ".join(f"{k}={info.get(k, '?')}" for k in keys))
    text = log.read_text() if log.exists() else ""
    for line in text.splitlines():
        if any(re.search(p, line) for p in patterns):
            print(f"[{tag}] {log.name}: {line}")
    return info


@contextlib.contextmanager
def cancel_on_error(env, job_id: str):
    """scancel the job when the block fails, so a broken test does not leave a long job occupying the nodes."""
    try:
        yield
    except BaseException:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
        raise


def log_time(line: str) -> float:
    """Epoch seconds of a slurm/common.sh log line '[YYYY-mm-dd HH:MM:SS] ...' (local time, whole seconds)."""
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]", line)
    assert m, line
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"the trainer writes metrics.jsonl into RLVR_RUN_DIR ({run_dir})"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
