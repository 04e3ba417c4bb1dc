"""Slurm scripts and rank mapping.

1. Rendering: slurm/mcpo_14b.sh run in dry-run mode under a simulated 4-node allocation (the SLURM_* variables
   sbatch would set for its own #SBATCH lines); then the environment srun gives each of the 32 tasks goes
   through megatron_rlvr.launch_env.dist_env_from_slurm: ranks 0..31, world 32, local ranks 0..7 per node, one
   rendezvous address (the node of rank 0) and port, identical in the shell and the Python derivation.
2. Real Slurm (tools/slurm_local.sh): slurm/tiny_cpu.sh submitted with sbatch runs a stand-in SPMD program
   (tests/slurm_standin.py) under srun: a gloo all-reduce completes; a rank that exits 1 makes the job FAILED
   within 60 s; SIGUSR1 makes the ranks checkpoint and exit 75, the job requeues itself and resumes.
   Skipped when no Slurm is running, unless MEGATRON_RLVR_REQUIRE_SLURM=1 (CI), which turns the skip into a
   failure.
3. The same scenarios with the real trainer (`megatron-rlvr train configs/tiny.yaml`): skipped until issue 6.
"""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_rlvr.launch_env import dist_env_from_slurm, expand_hostlist, master_port_for_job

REPO = Path(__file__).resolve().parents[1]
REQUIRE_SLURM = os.environ.get("MEGATRON_RLVR_REQUIRE_SLURM") == "1"


# ------------------------------------------------------------------------------------------------------------
# 1. rendering and rank mapping (no Slurm needed)
# ------------------------------------------------------------------------------------------------------------


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
    out = dry_run("slurm/tiny_cpu.sh", {**alloc, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"})
    assert out["SRUN"].split()[-3:] == ["megatron-rlvr", "train", "configs/tiny.yaml"]
    d = sbatch_directives(REPO / "slurm" / "tiny_cpu.sh")
    assert d["ntasks"] == "2" and "gpus-per-node" not in d


# ------------------------------------------------------------------------------------------------------------
# 2. real Slurm
# ------------------------------------------------------------------------------------------------------------


def _slurm_conf() -> str | None:
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    env_file = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/megatron-rlvr-slurm")) / "env.sh"
    if env_file.exists():
        m = re.search(r"export SLURM_CONF=(\S+)", env_file.read_text())
        if m:
            return m.group(1).strip("'\"")
    return None


@pytest.fixture(scope="module")
def slurm():
    """Environment for sbatch/scontrol on a running cluster; skips (or fails under CI) when there is none."""
    conf = _slurm_conf()
    why = None
    if not shutil.which("sbatch"):
        why = "sbatch not installed"
    elif not conf:
        why = "no SLURM_CONF and no tools/slurm_local.sh env file"
    else:
        env = {**os.environ, "SLURM_CONF": conf}
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=15)
        states = r.stdout.split()
        if r.returncode or not any(s.rstrip("*") in ("idle", "mixed", "allocated", "completing") for s in states):
            why = f"Slurm not usable (sinfo rc={r.returncode}, states={states}, {r.stderr.strip()[:200]})"
    if why:
        if REQUIRE_SLURM:
            pytest.fail(f"MEGATRON_RLVR_REQUIRE_SLURM=1 but {why}; start it with: bash tools/slurm_local.sh start")
        pytest.skip(f"{why} (bash tools/slurm_local.sh start)")
    env = {**os.environ, "SLURM_CONF": conf}
    for k in [k for k in env if k.startswith(("SLURM_JOB", "SBATCH_", "SRUN_"))]:
        del env[k]  # do not leak an outer allocation into the submissions
    return env


def submit(env, tmp: Path, cmd: str, script="slurm/tiny_cpu.sh", extra_env=None) -> tuple[str, Path]:
    log = tmp / "job.out"
    e = {**env, "RLVR_CMD": cmd, "RLVR_RUN_DIR": str(tmp / "run"), **(extra_env or {})}
    r = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", script], cwd=REPO, env=e, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0], log


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


def wait_for_log(log: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and re.search(pattern, log.read_text()):
            return
        time.sleep(0.2)
    pytest.fail(f"{pattern!r} not in {log} after {timeout}s:\n{log.read_text() if log.exists() else '(no log)'}")


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def test_slurm_smoke_gloo_allreduce(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "python tests/slurm_standin.py allreduce")
    info = wait_state(slurm, job, DONE, timeout=60)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert text.count("ALLREDUCE_OK") == 2, text
    assert re.search(r"rank 0/2 local 0 at \S+:\d+: all_reduce sum 3 expected 3", text), text


def test_slurm_fail_fast_when_one_rank_dies(slurm, tmp_path):
    t0 = time.monotonic()
    job, log = submit(slurm, tmp_path, "python tests/slurm_standin.py fail")
    info = wait_state(slurm, job, DONE, timeout=60)
    elapsed = time.monotonic() - t0
    text = log.read_text()
    assert info["JobState"] == "FAILED", text
    assert info["ExitCode"] != "0:0"
    assert "rank 1: exiting with code 1" in text and "FAILED: srun exited with" in text, text
    assert elapsed < 60, f"job took {elapsed:.1f}s to fail"  # the other rank would have slept 300 s


def test_slurm_fail_fast_when_one_rank_is_killed(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "python tests/slurm_standin.py sleep")
    wait_for_log(log, r"rank 1: sleeping", timeout=30)
    # `scontrol listpids` maps the job's processes to task ids: SIGKILL the process of global task 1 only.
    r = subprocess.run(["scontrol", "listpids", job], env=slurm, capture_output=True, text=True, check=True)
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    pids = [int(row[0]) for row in rows if len(row) == 5 and row[2] != "batch" and row[4] == "1"]
    assert len(pids) == 1, r.stdout
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    info = wait_state(slurm, job, DONE, timeout=60)
    text = log.read_text()
    assert info["JobState"] == "FAILED", text
    assert "task 1: Killed" in text, text
    assert time.monotonic() - t0 < 60


def test_slurm_preempt_checkpoint_requeue_resume(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "python tests/slurm_standin.py preempt", extra_env={"STANDIN_STEPS": "25"})
    wait_for_log(log, r"rank 0: step 3\b", timeout=30)
    r = subprocess.run(["scancel", "--signal=USR1", job], env=slurm, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = wait_state(slurm, job, DONE, timeout=50)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert info["Restarts"] == "1", info
    assert f"requeueing job {job} (restart 1)" in text, text
    for rank in (0, 1):
        saved = re.search(rf"rank {rank}: got SIGUSR1, checkpoint saved at step (\d+)", text)
        resumed = re.search(rf"rank {rank}: resumed from step (\d+)", text)
        assert saved and resumed and saved.group(1) == resumed.group(1), text
        assert f"rank {rank}: done at step 25" in text
    assert "SLURM_RESTART_COUNT=1" in text


# ------------------------------------------------------------------------------------------------------------
# 3. with the trainer (issue 6): same mechanics, real program
# ------------------------------------------------------------------------------------------------------------

needs_trainer = pytest.mark.skip(reason="needs trainer (issue 6)")


@needs_trainer
def test_tiny_cpu_trains_under_slurm(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "megatron-rlvr train configs/tiny.yaml")
    info = wait_state(slurm, job, DONE, timeout=600)
    assert info["JobState"] == "COMPLETED", log.read_text()
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert metrics.exists() and metrics.read_text().strip(), "the trainer writes metrics.jsonl into RLVR_RUN_DIR"


@needs_trainer
def test_trainer_preempt_requeue_resume(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "megatron-rlvr train configs/tiny.yaml")
    wait_state(slurm, job, {"RUNNING"}, timeout=60)
    wait_for_log(log, r"step\s*2\b", timeout=300)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    info = wait_state(slurm, job, DONE, timeout=600)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log.read_text()


@needs_trainer
def test_trainer_fail_fast_when_a_rank_is_killed(slurm, tmp_path):
    job, log = submit(slurm, tmp_path, "megatron-rlvr train configs/tiny.yaml")
    wait_for_log(log, r"step\s*1\b", timeout=300)
    r = subprocess.run(["scontrol", "listpids", job], env=slurm, capture_output=True, text=True, check=True)
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    pids = [int(row[0]) for row in rows if len(row) == 5 and row[2] != "batch" and row[4] == "1"]
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    info = wait_state(slurm, job, DONE, timeout=90)
    assert info["JobState"] == "FAILED" and time.monotonic() - t0 < 60, log.read_text()
