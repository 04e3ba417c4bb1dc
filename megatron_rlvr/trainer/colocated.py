"""The synchronous colocated schedule: every rank holds the policy and a rollout engine, and each step runs
rollout, then training, then the weight sync (``megatron_rlvr.trainer.step.rl_step``). ``train(cfg)`` runs on every
rank (SPMD) and wraps the steps with the run's life: stop signals (checkpoint, documented exit code), periodic
evaluation and checkpoints, the final checkpoint, HF export and plot."""

from __future__ import annotations

import os

from megatron_rlvr.config import RunConfig
from megatron_rlvr.megatron.parallel import all_reduce_max
from megatron_rlvr.rundir.checkpointer import export_hf_folder
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.metrics_log import read_metrics
from megatron_rlvr.rundir.plot import plot_runs
from megatron_rlvr.rundir.signals import StopSignals, exit_code_for
from megatron_rlvr.trainer.components import Trainer, setup, teardown
from megatron_rlvr.trainer.step import rl_step


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None) -> int:
    """Run (or resume) training on this rank; returns the process exit code (0 done, else a signal's code).
    ``lock``: the run directory's lock when this process already holds it (a single-process run prepared it)."""

    t = setup(cfg, run_dir, lock)
    try:
        for step in range(t.start_step + 1, cfg.schedule.steps + 1):
            t.step = step
            metrics = rl_step(t, step)
            if t.evaluator.due(step):
                metrics.update(run_eval(t))
            t.logger.log(step, metrics)
            stop = int(all_reduce_max(t.signals.code))  # every rank must agree on stopping at this step
            if stop:
                t.checkpointer.save(step, t.policy, t.loader)
                code = exit_code_for(stop, cfg.checkpoint.sigterm_exit_code, cfg.checkpoint.sigusr1_exit_code)
                if t.dist.is_logger:
                    print(
                        f"{StopSignals.name(stop)}: checkpoint of step {step} saved in {t.run_dir}/checkpoints; "
                        f"exiting with {code}",
                        flush=True,
                    )
                return code
            t.checkpointer.maybe_save(step, t.policy, t.loader)
        t.step = max(t.start_step, cfg.schedule.steps)
        if cfg.eval.at_end and t.evaluator.sets and not t.evaluator.due(t.step):
            t.logger.log(t.step, run_eval(t))
        finish(t)
        return 0
    finally:
        teardown(t)


def run_eval(t: Trainer) -> dict[str, float]:
    """avg@k / pass@k on every eval file with the current engine weights; metrics namespaced eval/<name>/..."""
    return t.evaluator.run(t.engine, t.reward_manager, t.tokenizer, t.engine_info)


def finish(t: Trainer) -> None:
    """After the last step: final checkpoint, optional HF export, optional plot, and where everything is."""

    cfg = t.cfg
    ckpt_path = t.checkpointer.save(t.step, t.policy, t.loader) if cfg.checkpoint.save_at_end else None
    hf_dir = None
    if cfg.checkpoint.export_hf:
        hf_dir = export_hf_folder(t.run_dir, t.policy, t.source, t.tokenizer, t.dist.pg, t.dist.is_logger)
    if not t.dist.is_logger:
        return
    plot_path = None
    if cfg.logging.plot_at_end:
        try:
            plot_path = plot_runs([t.run_dir])
        except ImportError:  # matplotlib is optional
            pass
        except ValueError as e:  # e.g. no step trained: the summary below still says where everything is
            print(f"megatron-rlvr: no curves: {e}", flush=True)
    print(summary(t, ckpt_path, hf_dir, plot_path), flush=True)


def summary(t: Trainer, ckpt_path, hf_dir, plot_path) -> str:
    hist = [h for h in read_metrics(t.logger.path) if h.get("reward/mean") is not None]
    lines = [f"megatron-rlvr: finished {t.cfg.logging.name} ({t.cfg.algorithm.name}) at step {t.step}"]
    recs = read_metrics(t.logger.path)
    skipped = sum(1 for h in recs if h.get("train/skipped"))
    if recs and skipped:
        lines.append(f"  WARNING: {skipped} of {len(recs)} steps were skipped (no update); see the progress lines")
    if hist:
        w = max(1, min(5, len(hist) // 4 or 1))
        first = sum(h["reward/mean"] for h in hist[:w]) / w
        last = sum(h["reward/mean"] for h in hist[-w:]) / w
        secs = sum(h.get("time/step_s", 0.0) for h in hist)
        lines.append(
            f"  mean training reward: {first:.3f} (first {w} steps) -> {last:.3f} (last {w} steps); "
            f"{len(hist)} steps in {secs:.0f} s"
        )
    lines.append(f"  run dir:     {t.run_dir}")
    lines.append(f"  config:      {os.path.join(t.run_dir, 'config.yaml')}")
    lines.append(f"  metrics:     {t.logger.path}")
    if t.logger.tb_dir:
        lines.append(f"  tensorboard: {t.logger.tb_dir}")
    if ckpt_path:
        lines.append(f"  checkpoint:  {ckpt_path}")
    if hf_dir:
        lines.append(f"  HF model:    {hf_dir}  (transformers.AutoModelForCausalLM.from_pretrained)")
    if plot_path:
        lines.append(f"  curves:      {plot_path}")
    return "\n".join(lines)
