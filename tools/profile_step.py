"""Profile RL steps of the bench_step.py workload (ours, TP=1, one process) in-process: torch.profiler's top ops by
self CPU time and cProfile's top Python functions by cumulative / total time.

    PYTHONPATH=$PWD .venv/bin/python tools/profile_step.py --steps 3 --warmup 2 [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import bench_step
    import torch

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import rl_step, setup, teardown

    work = a.out or tempfile.mkdtemp(prefix="profile_step-")
    os.makedirs(work, exist_ok=True)
    bench_step.prepare(work)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    over = bench_step.ours_overrides(work, os.path.join(work, "run"), 1, a.warmup + a.steps)
    cfg = load_run_config(os.path.join(bench_step.REPO, "configs", "tiny.yaml"), over)
    t = setup(cfg, os.path.join(work, "run"))
    try:
        for s in range(1, a.warmup + 1):
            rl_step(t, s)
        prof = cProfile.Profile()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            prof.enable()
            times = []
            for s in range(a.warmup + 1, a.warmup + a.steps + 1):
                m = rl_step(t, s)
                times.append({k: round(v, 4) for k, v in m.items() if k.startswith("time/")})
            prof.disable()
        for x in times:
            print(x)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.rows)
        print(buf.getvalue())
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        print(buf.getvalue())
    finally:
        teardown(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
