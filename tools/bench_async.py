"""Steps per second of the disaggregated schedule at max_staleness k = 0 (rollout and training alternate) and k = 1
(one-step-off: they overlap), on the same ranks (1 training rank + 1 rollout rank, one thread each), and of the
colocated synchronous schedule on the same total cores (2 ranks x 1 thread, data parallel: both generate, then
both train) for reference.

The workload is the tiny preset with 40-token responses and 16 prompts x 8 samples a step, chosen so that
generation (the transformers engine, token by token: its cost follows the response length) and training (its cost
follows the token count) take comparable time per step: about 0.06 s and 0.05 s on one thread each, so the ceiling
(G + T) / max(G, T) is about 1.8 (64 prompts with 24-token responses made training twice as long as generation, a
ceiling of 1.5). Each run's own metrics say how comparable (``async/rollout_s`` against the training rank's busy
time). The three runs of a round go in a rotating order (k0, k1, colocated, then
k1, colocated, k0, ...) so that neither a slow phase of a shared machine nor the position in a round favours one.
The rate of a run is measured from its metrics' wall times between the first and the last steady step (the first
``--skip`` steps pay start-up and, at k = 1, are served by the rollout rank's head start, which would inflate the
rate). Prints one line per run, the medians, the load average, and last ``async_speedup=`` (k = 1 over k = 0,
medians). On a machine whose cores are busy with other work the overlap has no free core to run on: the speedup
then says nothing about the schedule (compare the load average with the core count).

Every run trains with one optimizer update per step (``train.mini_batch_prompts=null``: the whole step's prompts,
whatever ``train.prompts_per_step`` is, so an extra ``train.prompts_per_step=24`` needs nothing else; an extra
``train.mini_batch_prompts=...`` comes later and wins).

Workload mixes (``--mixes``, all three by default; each is the workload above plus its overrides, and the
caller's overrides come after them):

    generation  8 prompts x 8 samples, 56-token responses (the tiny model has 64 positions): generation dominates
    balanced    16 prompts x 8 samples, 40-token responses: the workload above
    training    24 prompts x 8 samples, 24-token responses: training dominates

For each mix the k = 0 runs give the measured G (the rollout rank's generate time a step) and T (the training
rank's update and log-prob time a step), so the ceiling of overlapping them is (G + T) / max(G, T); the mix's line
gives that ceiling, ``async_speedup`` (k = 1 over k = 0), the share of the ceiling it reached (``of_ceiling``) and
``k1_over_colocated``. With one mix the last line is ``async_speedup=``; with several it is each mix's speedup and
``min_of_ceiling=``.

    PYTHONPATH=. python tools/bench_async.py [--rounds 3] [--steps 20] [--mixes generation,balanced,training]
        [--modes k0,k1,colocated] [overrides ...]
    PYTHONPATH=. python tools/bench_async.py --rounds 1 --steps 5 --skip 2 --modes k0,k1 --mixes balanced
        # the smallest run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_rlvr.rundir.metrics_log import read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = [
    "configs/tiny.yaml",
    "parallel.tp=1",
    "launch.threads_per_rank=1",
    "reward.num_workers=0",
    "rollout.max_response_len=40",
    "rollout.max_prompt_len=8",
    "train.prompts_per_step=16",
    "train.mini_batch_prompts=null",  # one update per step at any prompts_per_step (the preset's is 16 of 32)
    "rollout.n=8",
    "data.procedural.num_examples=100000",
    "checkpoint.save_every=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_hf=false",
    "logging.plot_at_end=false",
    "logging.progress=false",
    "logging.tensorboard=off",
]


MODES = {
    "k0": ["parallel.rollout_ranks=1", "rollout.max_staleness=0"],
    "k1": ["parallel.rollout_ranks=1", "rollout.max_staleness=1"],
    "colocated": ["parallel.rollout_ranks=0", "launch.nproc=2"],  # same 2 ranks x 1 thread, DP = 2
}


MIXES = {
    "generation": ["train.prompts_per_step=8", "rollout.max_response_len=56"],
    "balanced": [],
    "training": ["train.prompts_per_step=24", "rollout.max_response_len=24"],
}
"""Overrides of each workload mix on top of WORKLOAD (see the module docstring)."""


def train_args(mode: str, steps: int, run_dir: str, extra: list[str], mix: str = "balanced") -> list[str]:
    """``megatron-rlvr train`` arguments of one run: the preset, the workload, the mix, the mode, then ``extra``."""
    return [*WORKLOAD, *MIXES[mix], *MODES[mode], f"schedule.steps={steps}", f"logging.run_dir={run_dir}", *extra]


def run(mode: str, steps: int, skip: int, extra: list[str], root: str, i: int, mix: str = "balanced") -> dict:
    run_dir = os.path.join(root, f"{mix}_{mode}_{i}")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", *train_args(mode, steps, run_dir, extra, mix)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # one record per step (a step may log twice)
    if [r["step"] for r in recs] != list(range(1, steps + 1)):
        raise SystemExit(f"{mode} run logged steps {[r['step'] for r in recs]}, expected 1..{steps}")
    steady = recs[skip:]
    # steps completed between the first and the last steady record, over the time between them
    rate = (len(steady) - 1) / (steady[-1]["wall_time"] - steady[0]["wall_time"])

    def mean(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return sum(vals) / max(len(vals), 1)

    return {
        "mode": mode,
        "steps_per_s": rate,
        "rollout_s": mean("async/rollout_s") or mean("time/generate_s"),
        "train_s": mean("time/update_s") + mean("time/logprobs_s"),
        "trainer_wait_s": mean("async/trainer_wait_s"),
        "rollout_wait_s": mean("async/rollout_wait_s"),
        "staleness_mean": mean("async/staleness_mean"),
        "reward_last": steady[-1].get("reward/mean"),
    }


def summarize(mix: str, runs: dict[str, list[dict]]) -> dict:
    """Medians of one mix's runs by mode: rates, and from the k = 0 runs (no overlap) the measured G and T."""
    out: dict = {"mix": mix}
    for mode, rs in runs.items():
        out[f"{mode}_steps_per_s"] = statistics.median(r["steps_per_s"] for r in rs)
    if runs.get("k0"):
        g = statistics.median(r["rollout_s"] for r in runs["k0"])
        t = statistics.median(r["train_s"] for r in runs["k0"])
        out.update(G=g, T=t, ceiling=(g + t) / max(g, t, 1e-9))
        if runs.get("k1"):
            out["async_speedup"] = out["k1_steps_per_s"] / out["k0_steps_per_s"]
            out["of_ceiling"] = out["async_speedup"] / out["ceiling"]
    if runs.get("k1") and runs.get("colocated"):
        out["k1_over_colocated"] = out["k1_steps_per_s"] / out["colocated_steps_per_s"]
    if runs.get("k0") and runs.get("colocated"):
        out["colocated_over_k0"] = out["colocated_steps_per_s"] / out["k0_steps_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=4, help="steps left out of the rate (start-up, k = 1 head start)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, among {', '.join(MIXES)}")
    ap.add_argument("extra", nargs="*", help="more config overrides")
    a = ap.parse_args()
    if a.steps - a.skip < 3:
        ap.error(f"--steps {a.steps} leaves fewer than 3 steady steps after --skip {a.skip}")
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes {m!r}: choose from {', '.join(MODES)}")
    mixes = [m for m in a.mixes.split(",") if m]
    for m in mixes:
        if m not in MIXES:
            ap.error(f"--mixes {m!r}: choose from {', '.join(MIXES)}")
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for mix in mixes:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for i in range(a.rounds):
                for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                    r = run(mode, a.steps, a.skip, a.extra, root, i, mix)
                    runs[mode].append(r)
                    print(
                        f"{mix} round {i} {mode:>9}: {r['steps_per_s']:.3f} steps/s | rollout {r['rollout_s']:.3f} s, "
                        f"train {r['train_s']:.3f} s per step | idle: trainer {r['trainer_wait_s']:.3f} s, rollout "
                        f"{r['rollout_wait_s']:.3f} s | staleness {r['staleness_mean']:.2f} | load "
                        f"{os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
            res = summarize(mix, runs)
            results.append(res)
            print(f"mix {mix}: " + " ".join(f"{k}={v:.3f}" for k, v in res.items() if k != "mix"), flush=True)
    load1 = os.getloadavg()
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} on {os.cpu_count()} cores")
    cols = ["G", "T", "ceiling", "async_speedup", "of_ceiling", "k1_over_colocated"]
    print("| mix | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for res in results:
        print(f"| {res['mix']} | " + " | ".join(f"{res[c]:.3f}" if c in res else "-" for c in cols) + " |")
    speedups = [r for r in results if "async_speedup" in r]
    if len(results) == 1 and speedups:
        print(f"async_speedup={speedups[0]['async_speedup']:.2f}")
    elif speedups:
        print(
            " ".join(f"async_speedup_{r['mix']}={r['async_speedup']:.2f}" for r in speedups)
            + f" min_of_ceiling={min(r['of_ceiling'] for r in speedups):.2f}"
        )


if __name__ == "__main__":
    main()
