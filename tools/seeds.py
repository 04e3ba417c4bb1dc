"""Seed sweep: train one config at several ``train.seed`` values, each in its own run directory, and print what
each seed learned, so that a claim about a preset is a spread over seeds rather than one run.

    PYTHONPATH=. python tools/seeds.py [CONFIG] [key=value ...] [--seeds 1-5] [--jobs 1|N|auto] [--out DIR]

CONFIG and the overrides are those of ``megatron-rlvr train`` (default CONFIG: that command's default,
configs/tiny.yaml); the tool adds ``train.seed=<s>`` and ``logging.run_dir=<out>/seed<s>`` to each run (so neither
may be given as an override). Each run's output goes to ``<out>/seed<s>.log``. Runs go one after another by default;
``--jobs N`` runs N at a time, ``--jobs auto`` as many as the CPU cores allow (cores // ranks per run); with more
than one job, each rank gets cores // (jobs x ranks) threads (at least 1) unless ``launch.threads_per_rank`` is set.

Per seed it prints, from the run's metrics.jsonl (``reward/mean``, the mean training reward of a step):
  final      the mean of the last 5 steps' rewards;
  pass_0.9   the first step whose reward was >= 0.9 (``never`` if none);
  collapse   the worst fall after the peak: the peak of the 5-step moving average minus the lowest 5-step moving
             average at or after it (0 when the average never falls below its peak);
then, last, ``seeds_min= seeds_median= seeds_max=`` of the final rewards of the seeds that finished. The exit status
is 1 if a run failed (its line names its log).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_rlvr.rundir.metrics_log import read_metrics  # noqa: E402

WINDOW = 5
"""Steps in the final mean and in the moving average of the collapse."""
THRESHOLD = 0.9
"""The reward whose first crossing is reported."""
RESERVED = ("train.seed", "logging.run_dir")
"""Overrides the tool sets per run."""


def summarize(records: list[dict], key: str = "reward/mean", window: int = WINDOW, threshold: float = THRESHOLD):
    """Final reward, first step at or above ``threshold``, and collapse after the peak, from metrics records (one
    per step, as ``read_metrics`` returns them; records without ``key`` are skipped).

    final: mean of the last ``window`` rewards (all of them if fewer). first_pass: the ``step`` of the first record
    with reward >= threshold, None if none. collapse: over the trailing ``window``-step moving averages (the first one
    ends at the ``window``-th reward; with fewer rewards, one average over all), the maximum minus the minimum at or
    after the (first) maximum. Returns a dict with those three keys and ``steps`` (records with a reward); None when
    no record has a reward."""
    pts = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    if not pts:
        return None
    rewards = [v for _, v in pts]
    w = min(window, len(rewards))
    final = sum(rewards[-w:]) / w
    first_pass = next((s for s, v in pts if v >= threshold), None)
    moving = [sum(rewards[i - w + 1 : i + 1]) / w for i in range(w - 1, len(rewards))]
    peak = max(range(len(moving)), key=lambda i: (moving[i], -i))  # the first maximum
    collapse = moving[peak] - min(moving[peak:])
    return {"final": final, "first_pass": first_pass, "collapse": collapse, "steps": len(pts)}


def parse_seeds(spec: str) -> list[int]:
    """``1-5`` -> [1, 2, 3, 4, 5]; ``1,4,9`` -> [1, 4, 9]; ranges and lists mix (``1-3,7``)."""
    seeds: list[int] = []
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            seeds += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    except ValueError:
        raise SystemExit(f"seeds.py: --seeds {spec!r}: expected integers and ranges such as 1-5 or 1,4,9") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"seeds.py: --seeds {spec!r}: expected distinct seeds, at least one")
    return seeds


def format_line(seed: int, summary: dict | None, run_dir: str) -> str:
    if summary is None:
        return f"seed={seed} no reward/mean in {os.path.join(run_dir, 'metrics.jsonl')}"
    first = "never" if summary["first_pass"] is None else str(summary["first_pass"])
    return (
        f"seed={seed} final={summary['final']:.3f} pass_{THRESHOLD}={first} collapse={summary['collapse']:.3f} "
        f"steps={summary['steps']} run_dir={run_dir}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...], as for megatron-rlvr train")
    ap.add_argument("--seeds", default="1-5", help="seeds: a range and/or list, e.g. 1-5 or 1,4,9 (default 1-5)")
    ap.add_argument("--jobs", default="1", help="runs at a time: a number, or auto (cores // ranks per run)")
    ap.add_argument("--out", default=None, help="root of the run directories (default runs/seeds/<name>-<time>)")
    a = ap.parse_args(argv)
    seeds = parse_seeds(a.seeds)

    from megatron_rlvr.commands.train_cli import load_checked, split_config_and_overrides

    config, overrides = split_config_and_overrides(a.args)
    for o in overrides:
        if o.split("=", 1)[0].strip() in RESERVED:
            raise SystemExit(f"seeds.py: override {o!r}: the tool sets {' and '.join(RESERVED)} for each run")
    try:
        cfg, world = load_checked(config, overrides)  # a bad config fails here once, not at every seed
    except ValueError as e:
        raise SystemExit(f"seeds.py: {e}") from None
    cores = os.cpu_count() or 1
    if a.jobs == "auto":
        jobs = max(1, cores // world)
    else:
        try:
            jobs = int(a.jobs)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise SystemExit(f"seeds.py: --jobs {a.jobs!r}: expected a positive integer or auto")
    jobs = min(jobs, len(seeds))
    extra = []
    if jobs > 1 and cfg.launch.threads_per_rank is None:
        extra.append(f"launch.threads_per_rank={max(1, cores // (jobs * world))}")
    name = cfg.logging.name or os.path.splitext(os.path.basename(config or "tiny"))[0]
    out = a.out or os.path.join("runs", "seeds", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    for s in seeds:
        if os.path.exists(os.path.join(out, f"seed{s}")):
            raise SystemExit(f"seeds.py: {os.path.join(out, f'seed{s}')} exists; choose another --out")
    os.makedirs(out, exist_ok=True)
    load = os.getloadavg()[0]
    print(
        f"{len(seeds)} seeds, {jobs} at a time, {world} rank(s) each, {cores} cores (load {load:.2f}), out {out}",
        flush=True,
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def one(seed: int) -> tuple[int, dict | None, str]:
        run_dir = os.path.join(out, f"seed{seed}")
        log = os.path.join(out, f"seed{seed}.log")
        cmd = [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", *([config] if config else [])]
        cmd += [*overrides, *extra, f"train.seed={seed}", f"logging.run_dir={run_dir}"]
        t0 = time.time()
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc:
            print(f"seed={seed} failed (exit {rc}) after {time.time() - t0:.0f} s, log {log}", flush=True)
            return seed, None, "failed"
        summary = summarize(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
        print(f"{format_line(seed, summary, run_dir)} time={time.time() - t0:.0f}s", flush=True)
        return seed, summary, "ok" if summary is not None else "failed"

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, seeds))
    finals = [s["final"] for _, s, status in results if status == "ok"]
    failed = [seed for seed, _, status in results if status != "ok"]
    if failed:
        print(f"failed seeds: {' '.join(map(str, failed))}", flush=True)
    if finals:
        print(f"seeds_min={min(finals):.3f} seeds_median={statistics.median(finals):.3f} seeds_max={max(finals):.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
