"""Slurm scripts and rank mapping.

1. Rendering and rank mapping, no Slurm needed: tests/unit/test_slurm_scripts.py.
2. Real Slurm (tools/slurm_local.sh): slurm/tiny_cpu.sh submitted with sbatch runs a stand-in SPMD program
   (tests/slurm_standin.py) under srun: a gloo all-reduce completes; a rank that exits 1 makes the job FAILED
   within 60 s; SIGUSR1 makes the ranks checkpoint and exit 75, the job requeues itself and resumes.
   Skipped when no Slurm is running, unless MEGATRON_RLVR_REQUIRE_SLURM=1 (CI), which turns the skip into a
   failure.
3. The same scenarios with the real trainer (`megatron-rlvr train configs/tiny.yaml`, 150 steps): a job preempted
   with SIGUSR1 checkpoints, is requeued (Restarts=1), resumes from that checkpoint and COMPLETES with the reward
   far above chance; SIGKILL of rank 1's trainer process ends its job FAILED within 60 s.
"""

import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import (
    DONE,
    cancel_on_error,
    cancel_submitted,
    hostnames,
    job_info,
    log_time,
    metrics,
    multi_node_env,
    show_job,
    single_node_env,
    submit,
    task_program_pid,
    wait_for_log,
    wait_state,
)

# ------------------------------------------------------------------------------------------------------------
# 2. real Slurm
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    """Environment for sbatch/scontrol on the single-node cluster; skips (or fails under CI) when there is none."""
    return single_node_env()


@pytest.fixture(scope="module")
def slurm_cluster():
    """The same on tools/slurm_cluster.sh's multi-node cluster (tests/e2e/test_slurm_multinode.py)."""
    return multi_node_env()


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs():
    """A failed test must not leave its job occupying the single 2-CPU node (the next jobs would only queue)."""
    yield
    cancel_submitted()


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


@pytest.mark.parametrize("cluster", ["single-node", "multi-node"])
def test_slurm_fail_fast_when_one_rank_is_killed(cluster, request, tmp_path):
    """SIGKILL of rank 1 ends the job FAILED within 60 s; on the multi-node cluster rank 1 runs on the second node
    (-N2, one task per node), whose processes `scontrol listpids JOB NODE` lists from this machine."""
    multi = cluster == "multi-node"
    env = request.getfixturevalue("slurm_cluster" if multi else "slurm")
    sbatch_args = ("--nodes=2", "--ntasks-per-node=1") if multi else ()
    job, log = submit(env, tmp_path, "python tests/slurm_standin.py sleep", sbatch_args=sbatch_args)
    wait_for_log(log, r"rank 1: sleeping", timeout=30)
    # `scontrol listpids` maps the job's processes to task ids: SIGKILL the program of global task 1 only.
    pid, node, _ = task_program_pid(env, job, 1)
    assert "slurm_standin.py" in Path(f"/proc/{pid}/cmdline").read_text()
    nodes = hostnames(env, job_info(env, job)["NodeList"])
    assert node == nodes[-1] and len(nodes) == (2 if multi else 1), (node, nodes)  # block distribution
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    info = wait_state(env, job, DONE, timeout=60)
    text = log.read_text()
    assert info["JobState"] == "FAILED", text
    assert re.search(rf"{node}: task 1: Killed", text), text
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
# 3. the real trainer (`megatron-rlvr train configs/tiny.yaml`) under slurm/tiny_cpu.sh
# ------------------------------------------------------------------------------------------------------------
# Two jobs (each trainer start costs ~20-40 s on 2 cores, so the checks share them):
#   * one preempted job: SIGUSR1 after step 3 -> checkpoint -> exit 75 -> requeue -> resume -> COMPLETED. It proves
#     both "the job trains" (the reward rises far above chance) and "preemption resumes from the checkpoint";
#   * one job whose rank 1 is SIGKILLed mid-training: FAILED within 60 s.
# checkpoint.save_every=0: the only checkpoints are the signal's and the final one, so "resumed from step k" can
# only come from the checkpoint the signal wrote.

# Enough steps that the signal, sent once "step 3/" reaches the job's log, always lands before the run ends: on an
# idle machine a step takes ~0.1 s, and 30 steps once finished before the log line, scancel and the signal's delivery
# had gone through (the job then completed without a checkpoint to resume from).
TRAIN_STEPS = 150
TRAIN_CMD = (
    f"megatron-rlvr train configs/tiny.yaml schedule.steps={TRAIN_STEPS} checkpoint.save_every=0 "
    "checkpoint.export_hf=false logging.plot_at_end=false logging.tensorboard=off"
)
CHANCE = 1 / 19**2  # the copy task: the digit, then EOS, among the 19 tokens a random policy draws from


@pytest.fixture(scope="module")
def preempted_trainer_job(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_preempt")
    t0 = time.monotonic()
    job, log = submit(slurm, tmp, TRAIN_CMD)
    with cancel_on_error(slurm, job):
        wait_state(slurm, job, {"RUNNING", *DONE}, timeout=120)
        # after step 3 the trainer's signal handler is surely installed (before it, SIGUSR1 would just kill the ranks)
        wait_for_log(log, r"(?m)^step 3/", timeout=240)
        # what `#SBATCH --signal=USR1@180` does 180 s before the time limit: SIGUSR1 to every task of the job step
        r = subprocess.run(["scancel", "--signal=USR1", job], env=slurm, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        wait_state(slurm, job, DONE, timeout=360)
    lines = (
        r"restart=",
        r"SIGUSR1",
        r"exit code",
        r"requeueing",
        r"resumed from",
        rf"^step ([1-8]|{TRAIN_STEPS})/",
        r"finished",
    )
    info = show_job("preempt", slurm, job, log, lines)
    print(f"[preempt] wall time {time.monotonic() - t0:.1f} s")
    return job, info, log.read_text(), tmp / "run"


def test_trainer_job_completes_and_trains_under_slurm(preempted_trainer_job):
    """sbatch slurm/tiny_cpu.sh runs the real trainer to the end: COMPLETED, exit 0:0, one metrics record per step
    with a finite loss, and the mean reward of the last 5 steps far above a random policy's (~1/19^2), which a broken
    pipeline (no weight sync, wrong advantage sign, wrong log-probs or masks) stays at."""
    job, info, text, run_dir = preempted_trainer_job
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert f"finished tiny (mcpo) at step {TRAIN_STEPS}" in text and "finished (exit 0)" in text, text
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, TRAIN_STEPS + 1)), [r["step"] for r in recs]
    for r in recs:
        assert r["loss/total"] is not None and math.isfinite(r["loss/total"]), r  # the logger writes NaN/inf as null
        assert r["batch/sequences"] == 256.0, r  # 32 prompts x 8 samples trained every step
    rewards = [r["reward/mean"] for r in recs]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"[train] reward first 5 steps {first:.3f} -> last 5 steps {last:.3f} (chance {CHANCE:.3f})")
    assert first <= 0.2, f"a random policy starts near 1/19^2: {rewards[:5]}"
    # 5 steps x 256 samples at chance: std ~0.0015, so 0.25 is > 100 standard deviations above chance
    assert last >= 0.25 and last >= first + 0.15, f"the reward did not rise: {rewards}"
    assert (run_dir / "checkpoints" / f"step_{TRAIN_STEPS:09d}").is_dir(), list((run_dir / "checkpoints").iterdir())


def test_trainer_preempt_checkpoint_requeue_resume(preempted_trainer_job):
    """SIGUSR1 -> every rank checkpoints step k and exits 75 -> the script requeues the job (Restarts=1) -> the
    restarted trainer resumes from step k's checkpoint: metrics of steps <= k were written before the restart, those
    of steps > k after it (a restart from 0 would have rewritten every step after it), and the job COMPLETES."""
    job, info, text, run_dir = preempted_trainer_job
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text)
    m = re.search(r"SIGUSR1: checkpoint of step (\d+) saved in (\S+)/checkpoints; exiting with 75", text)
    assert m, text
    k = int(m.group(1))
    assert 3 <= k < TRAIN_STEPS and m.group(2) == str(run_dir), text
    # both ranks exited 75 (slurm/common.sh's task wrapper counts them) and the script requeued the job
    assert f"checkpointed (exit 75 on 2 of 2 tasks): requeueing job {job} (restart 1)" in text, text
    assert "Terminated" not in text and "Killed" not in text, text
    assert "SLURM_RESTART_COUNT=1" in text, text
    assert f"megatron-rlvr: resumed from step {k} |" in text, text
    after_resume = text.split(f"resumed from step {k} |", 1)[1]
    assert re.search(rf"^step {k + 1}/{TRAIN_STEPS} \|", after_resume, re.M), after_resume
    assert not re.search(rf"^step [1-{min(k, 9)}]/", after_resume, re.M), "the resumed run repeated early steps"
    # the signal's checkpoint is on disk (save_every=0: nothing else could have written step_k)
    assert (run_dir / "checkpoints" / f"step_{k:09d}" / "rlvr_meta.json").is_file()

    restart_line = next(line for line in text.splitlines() if "restart=1" in line)
    t_restart = log_time(restart_line)
    recs = {r["step"]: r for r in metrics(run_dir)}
    before = [recs[s]["wall_time"] for s in range(1, k + 1)]
    after = [recs[s]["wall_time"] for s in range(k + 1, TRAIN_STEPS + 1)]
    assert max(before) < t_restart <= min(after), (k, before, t_restart, after)


def test_trainer_fail_fast_when_a_rank_is_killed(slurm, tmp_path):
    """SIGKILL of rank 1's trainer process mid-training (rank 0 then waits in a gloo collective) ends the job
    FAILED within 60 s: srun --kill-on-bad-exit kills the surviving rank."""
    job, log = submit(slurm, tmp_path, TRAIN_CMD)
    with cancel_on_error(slurm, job):
        wait_for_log(log, r"(?m)^step 1/", timeout=240)
        # rank 1's trainer process (its reward worker and slurm/common.sh's task wrapper are left alone)
        pid, _, listing = task_program_pid(slurm, job, 1)
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert "python" in argv[0] and argv[1].endswith("megatron-rlvr") and argv[2] == "train", argv
        print(f"\n[fail-fast] scontrol listpids {job}:\n{listing.rstrip()}")
        print(f"[fail-fast] SIGKILL rank 1 trainer pid {pid}")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_state(slurm, job, DONE, timeout=90)
    elapsed = time.monotonic() - t0
    info = show_job("fail-fast", slurm, job, log, (r"restart=", r"srun:", r"FAILED", r"^step \d+/"))
    print(f"[fail-fast] job ended {elapsed:.1f} s after the SIGKILL")
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", (info, text)
    assert "task 1: Killed" in text and "FAILED: srun exited with" in text, text
    assert f"finished tiny (mcpo) at step {TRAIN_STEPS}" not in text, text
    assert elapsed < 60, f"job took {elapsed:.1f} s to fail"
