"""The run's metrics outputs: metrics.jsonl (one record per step), TensorBoard when installed, Weights & Biases when
``logging.wandb.enabled``, and the progress line. Only global rank 0 writes.

TensorBoard gets one event per step holding all of that step's scalars (what ``SummaryWriter.add_scalar`` writes
per scalar, merged: the same tags, steps and float32 values): ``add_scalar`` costs about 0.2 ms a call, 20 ms a step
for the ~90 metrics of a step, the one event about 0.1 ms. The event file writer's own thread writes it and flushes
every ``TB_FLUSH_S`` seconds and at close, not every step (a flush waits for that thread)."""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from typing import TYPE_CHECKING

from megatron_rlvr.config import resolved_dict
from megatron_rlvr.config.sections import WANDB_MISSING

if TYPE_CHECKING:
    from megatron_rlvr.config import RunConfig, WandbConfig

WANDB_ID_FILE = "wandb_run_id"
"""The run directory's W&B run id (a resumed run continues that W&B run)."""

TB_FLUSH_S = 10
"""Seconds between flushes of the TensorBoard event file (its writer thread does them; close flushes the rest)."""


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl, one per step in step order; records of the same step are merged, later keys
    winning (a resumed run repeats steps; evaluation adds its own record). Lines cut by a crash (or garbled, not
    UTF-8) are skipped."""
    by_step: dict[int, dict] = {}
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict):
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
    """metrics.jsonl (one JSON object per step), TensorBoard scalars, W&B, and a one-line progress report per step."""

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool,
        tensorboard: str = "auto",
        progress: bool = True,
        total_steps: int = 0,
        wandb: WandbConfig | None = None,
        run_name: str | None = None,
        run_config: dict | None = None,
    ):
        self.enabled = enabled
        self.progress = progress
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.tb_dir = None
        self.wandb_cfg = wandb if wandb is not None and wandb.enabled else None
        self.wandb_run = None
        self.run_name = run_name
        self.run_config = run_config or {}
        self.resumed_step = 0
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard != "off":
            try:
                from tensorboard.compat.proto.summary_pb2 import Summary
                from torch.utils.tensorboard.writer import FileWriter

                self.tb_dir = os.path.join(run_dir, "tensorboard")
                self._file_writer = FileWriter  # opened by the first record: a resume that fails writes nothing
                self._summary = Summary
            except ImportError:
                if tensorboard == "on":
                    raise ValueError("logging.tensorboard=on but the tensorboard package is not installed") from None

    @classmethod
    def for_run(cls, cfg: RunConfig, run_dir: str, enabled: bool) -> RunLogger:
        """The logger of a training run: its logging section, its resolved config recorded in W&B."""
        return cls(
            run_dir,
            enabled=enabled,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            total_steps=cfg.schedule.steps,
            wandb=cfg.logging.wandb,
            run_name=cfg.logging.name,
            run_config=resolved_dict(cfg) if enabled and cfg.logging.wandb.enabled else None,
        )

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > ``step`` (a resumed run repeats them); ``step`` > 0 is a resume: W&B continues
        the run directory's W&B run."""
        self.resumed_step = step
        if not self.enabled or not os.path.isfile(self.path):
            return
        kept = []
        with open(self.path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if isinstance(rec, dict) and rec.get("step", 0) <= step:
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
        if self.tb is None and self.tb_dir is not None:
            self.tb = self._file_writer(self.tb_dir, flush_secs=TB_FLUSH_S)
        if self.tb is not None:
            value = self._summary.Value
            scalars = [value(tag=k, simple_value=float(v)) for k, v in metrics.items() if v == v and abs(v) != math.inf]
            self.tb.add_summary(self._summary(value=scalars), step)
        if self.wandb_cfg is not None:
            if self.wandb_run is None:
                self.wandb_run = start_wandb(
                    self.wandb_cfg, self.run_dir, self.run_name, self.run_config, resume=self.resumed_step > 0
                )
            self.wandb_run.log({k: v for k, v in metrics.items() if v == v and abs(v) != math.inf}, step=step)
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
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def start_wandb(cfg: WandbConfig, run_dir: str, run_name: str | None, run_config: dict, resume: bool):
    """A W&B run writing under ``run_dir/wandb/``, recording the resolved config and the run directory. With
    ``resume`` (the trainer resumed from a checkpoint) the run directory's W&B run continues: W&B keeps the values
    it already has for repeated steps, while metrics.jsonl drops them; otherwise a new W&B run starts, its id saved
    in ``run_dir/wandb_run_id``."""
    try:
        import wandb
    except ImportError:
        raise ValueError(WANDB_MISSING) from None
    id_path = os.path.join(run_dir, WANDB_ID_FILE)
    run_id = None
    if resume and os.path.isfile(id_path):
        with open(id_path) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        tmp = id_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(run_id + "\n")
        os.replace(tmp, id_path)
    return wandb.init(
        project=cfg.project or os.environ.get("WANDB_PROJECT") or "megatron-rlvr",
        name=cfg.name or run_name,
        mode=cfg.mode,
        dir=run_dir,
        id=run_id,
        resume="allow",
        config={**run_config, "run_dir": os.path.abspath(run_dir)},
    )


def say(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stdout, flush=True)
