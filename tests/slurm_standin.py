"""Stand-in SPMD program for testing the slurm/ scripts' mechanics without the trainer.

Run by every srun task (RLVR_CMD="python tests/slurm_standin.py MODE"); ranks come from Slurm's environment
through megatron_rlvr.slurm_env, exactly as the trainer will get them.

  allreduce  torch.distributed gloo init at MASTER_ADDR:MASTER_PORT (after the trainer's rendezvous preparation:
             slurm_env.prepare_rendezvous picks the socket interface when the job spans nodes), then
             all_reduce(rank + 1) == W (W + 1) / 2
  fail       rank 1 exits 1 after a second; every other rank sleeps 300 s (the job must still end quickly)
  sleep      every rank sleeps 300 s (a test then kills one rank with SIGKILL)
  preempt    the trainer's preemption contract (slurm/common.sh): steps of 0.1 s; on SIGUSR1 or SIGTERM each
             rank writes a checkpoint {"step": n} into $RLVR_RUN_DIR and exits 75; on start it resumes from it
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlvr.slurm_env import dist_env_from_slurm, prepare_rendezvous  # noqa: E402

REQUEUE_EXIT_CODE = 75


def allreduce(d: dict) -> int:
    import torch
    import torch.distributed as dist

    note = prepare_rendezvous(d)
    if note:
        print(note, flush=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{d['master_addr']}:{d['master_port']}",
        rank=d["rank"],
        world_size=d["world_size"],
    )
    t = torch.tensor([float(d["rank"] + 1)])
    dist.all_reduce(t)
    expected = d["world_size"] * (d["world_size"] + 1) / 2
    ok = t.item() == expected
    print(
        f"rank {d['rank']}/{d['world_size']} local {d['local_rank']} at {d['master_addr']}:{d['master_port']}: "
        f"all_reduce sum {t.item():g} expected {expected:g} {'ALLREDUCE_OK' if ok else 'ALLREDUCE_WRONG'}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if ok else 1


def fail(d: dict) -> int:
    if d["rank"] == 1:
        time.sleep(1.0)
        print("rank 1: exiting with code 1", flush=True)
        return 1
    print(f"rank {d['rank']}: sleeping", flush=True)
    time.sleep(300)
    return 0


def sleep(d: dict) -> int:
    print(f"rank {d['rank']}: sleeping", flush=True)
    time.sleep(300)
    return 0


def preempt(d: dict) -> int:
    run_dir = Path(os.environ["RLVR_RUN_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / f"standin_ckpt_rank{d['rank']}.json"
    total = int(os.environ.get("STANDIN_STEPS", "40"))
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    if start:
        print(f"rank {d['rank']}: resumed from step {start}", flush=True)
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signal.Signals(signum).name

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for step in range(start, total):
        if stop["sig"]:
            ckpt.write_text(json.dumps({"step": step}))
            print(f"rank {d['rank']}: got {stop['sig']}, checkpoint saved at step {step}", flush=True)
            return REQUEUE_EXIT_CODE
        print(f"rank {d['rank']}: step {step}", flush=True)
        time.sleep(0.1)
    print(f"rank {d['rank']}: done at step {total}", flush=True)
    return 0


MODES = {"allreduce": allreduce, "fail": fail, "sleep": sleep, "preempt": preempt}


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in MODES:
        print(f"usage: slurm_standin.py {{{'|'.join(MODES)}}} [ignored args]", file=sys.stderr)
        return 2
    return MODES[argv[0]](dist_env_from_slurm())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
