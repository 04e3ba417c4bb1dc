"""Profile RL steps of the bench_step.py workload (ours, TP=1, one process) in-process: the loop's per-step pieces
timed (the step's stages, the run logger, the stop check), torch.profiler's top ops by self CPU time and cProfile's
top Python functions by total / cumulative time.

    PYTHONPATH=$PWD .venv/bin/python tools/profile_step.py --steps 3 --warmup 2 [--model small] [--mode defaults]

``--mode``: bench_step.py's mode of our side (lean, the default; defaults: reward worker processes, TensorBoard when
installed, the progress line, configs/tiny.yaml's micro-batch size; bare: every option at its built-in default).
``--no-torch-profiler``: cProfile only (the torch profiler's own per-op cost is large at these sizes); ``--threads``:
torch threads (1 steadies the figures on a loaded machine).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--model", default="base", help="bench_step.py's model size: base or small")
    ap.add_argument("--mode", default="lean", help="bench_step.py's mode of our side: lean, defaults or bare")
    ap.add_argument("--no-torch-profiler", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: bench_step.py's 2)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import bench_step
    import torch
    from megatron_rlvr.trainer.step import rl_step

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.megatron.parallel import all_reduce_max
    from megatron_rlvr.trainer.components import setup, teardown

    work = a.out or tempfile.mkdtemp(prefix="profile_step-")
    os.makedirs(work, exist_ok=True)
    bench_step.prepare(work)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    mode = a.mode
    run = os.path.join(work, "run")
    conf, over = bench_step.ours_config(work, run, 1, a.warmup + a.steps, mode, a.model)
    if a.threads:
        over.append(f"launch.threads_per_rank={a.threads}")
    cfg = load_run_config(conf, over)
    t = setup(cfg, run)
    pieces: dict[str, list[float]] = {"step": [], "log": [], "stop": [], "wall": [], "cpu": []}

    def loop_body(s: int) -> dict[str, float]:
        """What colocated.train does per step (no evaluation, no checkpoints: off in both modes)."""
        w0, c0 = time.perf_counter(), time.process_time()
        m = rl_step(t, s)
        w1 = time.perf_counter()
        t.logger.log(s, m)
        w2 = time.perf_counter()
        all_reduce_max(t.signals.code)
        w3 = time.perf_counter()
        for k, v in (("step", w1 - w0), ("log", w2 - w1), ("stop", w3 - w2), ("wall", w3 - w0)):
            pieces[k].append(v)
        pieces["cpu"].append(time.process_time() - c0)
        return m

    try:
        for s in range(1, a.warmup + 1):
            loop_body(s)
        for v in pieces.values():
            v.clear()
        prof = cProfile.Profile()
        tp = None
        if not a.no_torch_profiler:
            tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            tp.__enter__()
        prof.enable()
        times = []
        for s in range(a.warmup + 1, a.warmup + a.steps + 1):
            m = loop_body(s)
            times.append({k: round(v, 4) for k, v in m.items() if k.startswith("time/")})
        prof.disable()
        prof.dump_stats(os.path.join(work, "steps.pstats"))  # for pstats / snakeviz
        if tp is not None:
            tp.__exit__(None, None, None)
        for x in times:
            print(x)
        print("per-step medians (s): " + " ".join(f"{k}={statistics.median(v):.4f}" for k, v in pieces.items()))
        if tp is not None:
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.rows)
        print(buf.getvalue())
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        print(buf.getvalue())
    finally:
        teardown(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
