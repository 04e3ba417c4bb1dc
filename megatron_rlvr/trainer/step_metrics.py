"""Step metrics: reduction of per-micro-batch loss metrics over micro-batches and ranks, and the run's outputs
(progress line, metrics.jsonl, TensorBoard when installed). Only global rank 0 writes."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from megatron_rlvr.algorithms.reductions import reduction_of


class LossMetrics:
    """Accumulates the info dicts of training micro-batches on one rank; ``merge`` combines ranks.

    Each key is reduced as the module producing it declared (megatron_rlvr.algorithms.reductions): shares of the
    global loss are summed within a mini-batch (over micro-batches and data-parallel ranks) and averaged over
    updates, max / min take the extreme, everything else is a mean weighted by the micro-batch's valid tokens.
    """

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.shares: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}

    def add(self, info: dict[str, float]) -> None:
        w = float(info.get("loss/num_tokens", 0.0))
        for k, v in info.items():
            v = float(v)
            kind = reduction_of(k)
            if kind == "share":
                self.shares[k] = self.shares.get(k, 0.0) + v
            elif kind == "max":
                self.maxima[k] = max(self.maxima.get(k, -math.inf), v)
            elif kind == "min":
                self.minima[k] = min(self.minima.get(k, math.inf), v)
            elif w > 0:
                self.sums[k] = self.sums.get(k, 0.0) + v * w
                self.weights[k] = self.weights.get(k, 0.0) + w

    def state(self) -> dict:
        return {
            "sums": self.sums,
            "weights": self.weights,
            "shares": self.shares,
            "maxima": self.maxima,
            "minima": self.minima,
        }

    @staticmethod
    def merge(states: list[dict], num_updates: int) -> dict[str, float]:
        total = LossMetrics()
        for st in states:
            for name in ("sums", "weights", "shares"):
                acc = getattr(total, name)
                for k, v in st[name].items():
                    acc[k] = acc.get(k, 0.0) + v
            for k, v in st["maxima"].items():
                total.maxima[k] = max(total.maxima.get(k, -math.inf), v)
            for k, v in st["minima"].items():
                total.minima[k] = min(total.minima.get(k, math.inf), v)
        out = {k: total.sums[k] / total.weights[k] for k in total.sums if total.weights.get(k, 0) > 0}
        out.update({k: v / max(num_updates, 1) for k, v in total.shares.items()})
        out.update(total.maxima)
        out.update(total.minima)
        return out


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
                from torch.utils.tensorboard import SummaryWriter

                self.tb_dir = os.path.join(run_dir, "tensorboard")
                self.tb = SummaryWriter(self.tb_dir)
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
            for k, v in metrics.items():
                if v == v and abs(v) != math.inf:
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
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
