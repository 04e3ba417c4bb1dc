"""The run's metrics outputs: metrics.jsonl (one record per step), TensorBoard when installed, and the progress
line. Only global rank 0 writes.

TensorBoard gets one event per step holding all of that step's scalars (what ``SummaryWriter.add_scalar`` writes
per scalar, merged: the same tags, steps and float32 values): ``add_scalar`` costs about 0.2 ms a call, 20 ms a step
for the ~90 metrics of a step, the one event about 0.1 ms. The event file writer's own thread writes it and flushes
every ``TB_FLUSH_S`` seconds and at close, not every step (a flush waits for that thread)."""

from __future__ import annotations

import json
import math
import os
import sys
import time

TB_FLUSH_S = 10
"""Seconds between flushes of the TensorBoard event file (its writer thread does them; close flushes the rest)."""


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl, one per step in step order; records of the same step are merged, later keys
    winning (a resumed run repeats steps; evaluation adds its own record). Lines cut by a crash are skipped."""
    by_step: dict[int, dict] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                step = rec.get("step")
                if step is not None:
                    by_step[step] = {**by_step.get(step, {}), **rec}
    return [by_step[k] for k in sorted(by_step)]


def _fmt(v: float) -> str:
    if v != v:
        return "nan"
    if abs(v) >= 1000 or (0 < abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3f}"


class RunLogger:
    """metrics.jsonl (one JSON object per step), TensorBoard scalars, and a one-line progress report per step."""

    def __init__(
        self, run_dir: str, *, enabled: bool, tensorboard: str = "auto", progress: bool = True, total_steps: int = 0
    ):
        self.enabled = enabled
        self.progress = progress
        self.total_steps = total_steps
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.tb_dir = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard != "off":
            try:
                from tensorboard.compat.proto.summary_pb2 import Summary
                from torch.utils.tensorboard.writer import FileWriter

                self.tb_dir = os.path.join(run_dir, "tensorboard")
                self.tb = FileWriter(self.tb_dir, flush_secs=TB_FLUSH_S)
                self._summary = Summary
            except ImportError:
                if tensorboard == "on":
                    raise ValueError("logging.tensorboard=on but the tensorboard package is not installed") from None

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > ``step`` (a resumed run repeats them)."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if rec.get("step", 0) <= step:
                    kept.append(json.dumps(rec))
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, "wall_time": time.time()}
        rec.update({k: (float(v) if v == v and abs(v) != math.inf else None) for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            value = self._summary.Value
            scalars = [value(tag=k, simple_value=float(v)) for k, v in metrics.items() if v == v and abs(v) != math.inf]
            self.tb.add_summary(self._summary(value=scalars), step)
        if self.progress:
            print(self.progress_line(step, metrics), flush=True)

    def progress_line(self, step: int, m: dict[str, float]) -> str:
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        if m.get("train/skipped", 0):
            why = "empty or all-truncated batch" if m.get("train/skipped_empty") else "non-finite logits/loss/grads"
            if m.get("train/skipped_all_too_long"):
                why = "every prompt longer than rollout.max_prompt_len"
            parts.append(f"SKIPPED ({why})")
        failed = [
            f"{m[k]:.0f} {label}"
            for k, label in (
                ("reward/n_error", "errors"),
                ("reward/n_timeout", "timeouts"),
                ("reward/n_nonfinite", "non-finite"),
            )
            if m.get(k)
        ]
        if failed:
            parts.append("reward fn: " + ", ".join(failed))
        for key, label in (
            ("reward/mean", "reward"),
            ("reward/accuracy", "acc"),
            ("response/length_mean", "len"),
            ("loss/total", "loss"),
            ("loss/entropy", "entropy"),
            ("loss/clip_frac_high", "clip_hi"),
            ("groups/mastered_frac", "mastered"),
            ("optim/grad_norm", "gnorm"),
        ):
            if key in m:
                parts.append(f"{label} {_fmt(m[key])}")
        if "time/step_s" in m:
            parts.append(f"{m['time/step_s']:.2f} s/step")
        if "perf/tokens_per_s" in m:
            parts.append(f"{m['perf/tokens_per_s']:.0f} tok/s")
        return " | ".join(parts)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def say(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stdout, flush=True)
