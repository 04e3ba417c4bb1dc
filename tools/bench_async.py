"""Steps per second of the disaggregated schedule at max_staleness k = 0 (rollout and training alternate) and k = 1
(one-step-off: they overlap), on the same ranks (default: 1 training rank + 1 rollout rank, one thread each).

The workload is the tiny preset with longer responses, so that generation (the transformers engine, token by
token) and training take comparable time per step; each run's own metrics say how comparable
(``async/rollout_s`` against the training time). Runs alternate k = 0, k = 1, k = 0, ... so that a slow phase of a
shared machine hits both; the rate of a run is measured from its metrics' wall times between the first and the
last step (start-up excluded). Prints one line per run, then ``async_speedup=`` (k = 1 over k = 0, medians).

    PYTHONPATH=. python tools/bench_async.py [--rounds 2] [--steps 12] [extra overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = [
    "configs/tiny.yaml",
    "parallel.tp=1",
    "parallel.rollout_ranks=1",
    "launch.threads_per_rank=1",
    "reward.num_workers=0",
    "rollout.max_response_len=24",
    "rollout.max_prompt_len=8",
    "train.prompts_per_step=16",
    "rollout.n=8",
    "data.procedural.num_examples=100000",
    "checkpoint.save_every=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_hf=false",
    "logging.plot_at_end=false",
    "logging.progress=false",
    "logging.tensorboard=off",
]


def run(k: int, steps: int, extra: list[str], root: str, i: int) -> dict:
    run_dir = os.path.join(root, f"k{k}_{i}")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", *WORKLOAD]
    cmd += [f"rollout.max_staleness={k}", f"schedule.steps={steps}", f"logging.run_dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"k={k} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    skip = 2  # the first steps pay one-off costs (first forward, allocator warm-up)
    steady = recs[skip:]
    rate = (len(steady) - 1) / (steady[-1]["wall_time"] - steady[0]["wall_time"])

    def mean(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return sum(vals) / max(len(vals), 1)

    return {
        "k": k,
        "steps_per_s": rate,
        "rollout_s": mean("async/rollout_s"),
        "train_s": mean("time/update_s") + mean("time/logprobs_s"),
        "trainer_wait_s": mean("async/trainer_wait_s"),
        "rollout_wait_s": mean("async/rollout_wait_s"),
        "staleness_mean": mean("async/staleness_mean"),
        "reward_last": steady[-1].get("reward/mean"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("extra", nargs="*", help="more config overrides")
    a = ap.parse_args()
    rates: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(a.rounds):
            for k in (0, 1):
                r = run(k, a.steps, a.extra, root, i)
                rates[k].append(r["steps_per_s"])
                print(
                    f"round {i} k={k}: {r['steps_per_s']:.3f} steps/s | rollout {r['rollout_s']:.3f} s, train "
                    f"{r['train_s']:.3f} s per step | idle: trainer {r['trainer_wait_s']:.3f} s, rollout "
                    f"{r['rollout_wait_s']:.3f} s | staleness {r['staleness_mean']:.2f}",
                    flush=True,
                )
    k0, k1 = statistics.median(rates[0]), statistics.median(rates[1])
    print(f"k0_steps_per_s={k0:.3f} k1_steps_per_s={k1:.3f}")
    print(f"async_speedup={k1 / k0:.2f}")


if __name__ == "__main__":
    main()
