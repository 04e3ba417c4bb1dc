"""Profile RL steps of the bench_step.py workload (ours, TP=1, one process) in-process: the loop's per-step pieces
timed (the step on its own timer, the run logger's call, and the rest of the loop between two steps: evaluation
check, stop check, checkpoint check), torch.profiler's top ops by self CPU time and cProfile's top Python functions
by total / cumulative time.

    PYTHONPATH=$PWD .venv/bin/python tools/profile_step.py --steps 3 --warmup 2 [--model small] [--mode defaults]

The run is the ordinary ``megatron-rlvr train`` of bench_step.py's config, started in this process through the
CLI's own entry point; the profilers are switched on when the run logger has logged step ``--warmup`` and off when
it has logged step ``--warmup + --steps``, so the profiled window is exactly ``--steps`` whole iterations of the
training loop (set-up, the warm-up steps and the end of the run are outside it).

``--mode``: bench_step.py's mode of our side (lean, the default; defaults: reward worker processes, TensorBoard when
installed, the progress line, configs/tiny.yaml's micro-batch size; bare: every option at its built-in default).
``--no-torch-profiler``: cProfile only (the torch profiler's own per-op cost is large at these sizes); ``--threads``:
torch threads (1 steadies the figures on a loaded machine). ``--out``: the work folder (the run directory and
``steps.pstats`` for pstats / snakeviz go there; default: a temporary folder).
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
import bench_step  # noqa: E402

if bench_step.REPO not in sys.path:  # last: a checkout already on the path (PYTHONPATH) keeps its own code
    sys.path.append(bench_step.REPO)


class StepWindow:
    """Wraps the run logger's ``log``: times each call, stamps the end of each step's loop iteration, and switches
    the profilers on after step ``first - 1`` is logged and off after step ``last`` is logged."""

    def __init__(self, first: int, last: int, torch_profiler: bool):
        self.first, self.last = first, last
        self.cprofile = cProfile.Profile()
        self.torch_profiler = None
        self.want_torch = torch_profiler
        self.log_s: dict[int, float] = {}
        self.cpu_at: dict[int, float] = {}
        self.end_at: dict[int, float] = {}
        self.done = False

    def wrap(self, log):
        window = self

        def timed_log(logger, step: int, metrics: dict[str, float]) -> None:
            t0 = time.perf_counter()
            log(logger, step, metrics)
            window.end_at[step] = time.perf_counter()
            window.log_s[step] = window.end_at[step] - t0
            window.cpu_at[step] = time.process_time()
            if step == window.first - 1:
                window.start()
            elif step == window.last:
                window.stop()

        return timed_log

    def start(self) -> None:
        if self.want_torch:
            import torch

            self.torch_profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.torch_profiler.__enter__()
        self.cprofile.enable()

    def stop(self) -> None:
        self.cprofile.disable()
        if self.torch_profiler is not None:
            self.torch_profiler.__exit__(None, None, None)
        self.done = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled ones (at least 1)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--model", default="base", help=f"bench_step.py's model size: {', '.join(bench_step.MODELS)}")
    ap.add_argument("--mode", default="lean", help=f"bench_step.py's mode of our side: {', '.join(bench_step.MODES)}")
    ap.add_argument("--no-torch-profiler", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: bench_step.py's 2)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.model not in bench_step.MODELS:
        ap.error(f"--model {a.model!r}: choose from {', '.join(bench_step.MODELS)}")
    if a.mode not in bench_step.MODES:
        ap.error(f"--mode {a.mode!r}: choose from {', '.join(bench_step.MODES)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the window opens when a warm-up step is logged)")

    from megatron_rlvr.commands.train_cli import train_main
    from megatron_rlvr.rundir.metrics_log import RunLogger, read_metrics

    work = a.out or tempfile.mkdtemp(prefix="profile_step-")
    os.makedirs(work, exist_ok=True)
    bench_step.prepare(work)
    run = os.path.join(work, "run")
    conf, over = bench_step.ours_config(work, run, 1, a.warmup + a.steps, a.mode, a.model)
    if a.threads:
        over.append(f"launch.threads_per_rank={a.threads}")
    window = StepWindow(a.warmup + 1, a.warmup + a.steps, not a.no_torch_profiler)
    plain_log = RunLogger.log
    RunLogger.log = window.wrap(plain_log)
    try:
        rc = train_main([conf, *over])
    finally:
        RunLogger.log = plain_log
        if not window.done:
            window.cprofile.disable()
    if rc != 0 or not window.done:
        print(f"profile_step: the run ended with exit code {rc} before step {window.last} (run dir {run})")
        return rc or 1
    window.cprofile.dump_stats(os.path.join(work, "steps.pstats"))

    recs = {r["step"]: r for r in read_metrics(os.path.join(run, "metrics.jsonl"))}
    steps = range(window.first, window.last + 1)
    pieces: dict[str, list[float]] = {"step": [], "log": [], "rest": [], "wall": [], "cpu": []}
    for s in steps:
        wall = window.end_at[s] - window.end_at[s - 1]  # from the end of one log call to the next: one iteration
        step_s, log_s = recs[s]["time/step_s"], window.log_s[s]
        for k, v in (("step", step_s), ("log", log_s), ("rest", wall - step_s - log_s), ("wall", wall)):
            pieces[k].append(v)
        pieces["cpu"].append(window.cpu_at[s] - window.cpu_at[s - 1])
        print({k: round(v, 4) for k, v in recs[s].items() if k.startswith("time/")})
    print("per-step medians (s): " + " ".join(f"{k}={statistics.median(v):.4f}" for k, v in pieces.items()))
    if window.torch_profiler is not None:
        print(window.torch_profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    for order, rows in (("tottime", a.rows), ("cumulative", 60)):
        buf = io.StringIO()
        pstats.Stats(window.cprofile, stream=buf).sort_stats(order).print_stats(rows)
        print(buf.getvalue())
    print(f"profile_step: work folder {work} (steps.pstats, run/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
