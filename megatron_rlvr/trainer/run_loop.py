"""The run loop's helpers that both schedules share: the start-up line, the end of a step (stop signals, checkpoint
cadence), evaluation, the end of the run (final checkpoint, HF export, plot, summary) and the run's warnings. The
schedules (``colocated``, ``disaggregated``) are siblings over this module; neither imports the other."""

from __future__ import annotations

import os

from megatron_rlvr.data import PromptLoader
from megatron_rlvr.megatron.parallel import all_reduce_max
from megatron_rlvr.models.fusions import detect
from megatron_rlvr.rundir.checkpointer import export_hf_folder
from megatron_rlvr.rundir.metrics_log import read_metrics
from megatron_rlvr.rundir.plot import plot_runs
from megatron_rlvr.rundir.signals import StopSignals, exit_code_for
from megatron_rlvr.trainer.policy_side import PolicySide, describe
from megatron_rlvr.trainer.rollout_side import RolloutSide
from megatron_rlvr.trainer.run_life import RunLife


def announce(life: RunLife, policy: PolicySide, n_prompts: int, n_malformed: int) -> None:
    """Rank 0's start-up lines: the data, where the run starts, the layout and the run directory."""
    if not life.is_logger:
        return
    cfg = life.cfg
    skipped = f", {n_malformed} malformed rows skipped" if n_malformed else ""
    print(f"megatron-rlvr: data: {n_prompts} training prompts{skipped}", flush=True)
    where = f"resumed from step {life.start_step}" if life.start_step else "starting"
    print(
        f"megatron-rlvr: {where} | {cfg.logging.name} | algorithm {cfg.algorithm.name} | {describe(policy)} "
        f"| {detect().describe()} | run dir {life.run_dir}",
        flush=True,
    )


def end_step(life: RunLife, policy: PolicySide, loader: PromptLoader, step: int, saved_note: str = "") -> int | None:
    """After a step is logged: every rank agrees on a stop signal (one MAX all-reduce); on one, checkpoint this step
    and return the exit code, else save by the cadence and return None. Every schedule ends its steps this way."""
    cfg = life.cfg
    stop = int(all_reduce_max(life.signals.code))
    if not stop:
        life.checkpointer.maybe_save(step, policy.state, loader)
        return None
    life.checkpointer.save(step, policy.state, loader)
    code = exit_code_for(stop, cfg.checkpoint.sigterm_exit_code, cfg.checkpoint.sigusr1_exit_code)
    if life.is_logger:
        print(
            f"{StopSignals.name(stop)}: checkpoint of step {step} saved in {life.run_dir}/checkpoints{saved_note}; "
            f"exiting with {code}",
            flush=True,
        )
    return code


def run_eval(life: RunLife, rollout: RolloutSide) -> dict[str, float]:
    """avg@k / pass@k on every eval file with the engine's current weights; metrics namespaced eval/<name>/..."""
    return life.evaluator.run(rollout.engine, rollout.reward_manager, rollout.tokenizer, rollout.engine_info)


def finish(life: RunLife, policy: PolicySide, loader: PromptLoader) -> None:
    """After the last step: final checkpoint, optional HF export, optional plot, and where everything is."""
    cfg = life.cfg
    ckpt_path = life.checkpointer.save(life.step, policy.state, loader) if cfg.checkpoint.save_at_end else None
    hf_dir = None
    if cfg.checkpoint.export_hf:
        d = policy.dist
        hf_dir = export_hf_folder(life.run_dir, policy.state, policy.source, policy.tokenizer, d.pg, d.is_logger)
    if not life.is_logger:
        return
    plot_path = None
    if cfg.logging.plot_at_end:
        try:
            plot_path = plot_runs([life.run_dir])
        except ImportError:  # matplotlib is optional
            pass
        except ValueError as e:  # e.g. no step trained: the summary below still says where everything is
            print(f"megatron-rlvr: no curves: {e}", flush=True)
    vl = policy.image_processor is not None
    print(summary(life, ckpt_path, hf_dir, plot_path, vl), flush=True)


def summary(life: RunLife, ckpt_path, hf_dir, plot_path, vl: bool) -> str:
    """The closing lines: the reward's first and last steps, and where the run's outputs are."""
    recs = read_metrics(life.logger.path)
    hist = [h for h in recs if h.get("reward/mean") is not None]
    lines = [f"megatron-rlvr: finished {life.cfg.logging.name} ({life.cfg.algorithm.name}) at step {life.step}"]
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
    lines.append(f"  run dir:     {life.run_dir}")
    lines.append(f"  config:      {os.path.join(life.run_dir, 'config.yaml')}")
    lines.append(f"  metrics:     {life.logger.path}")
    if life.logger.tb_dir:
        lines.append(f"  tensorboard: {life.logger.tb_dir}")
    if ckpt_path:
        lines.append(f"  checkpoint:  {ckpt_path}")
    if hf_dir:
        auto = "AutoModelForImageTextToText" if vl else "AutoModelForCausalLM"
        lines.append(f"  HF model:    {hf_dir}  (transformers.{auto}.from_pretrained)")
    if plot_path:
        lines.append(f"  curves:      {plot_path}")
    return "\n".join(lines)


def warn_all_too_long(life: RunLife, step: int, m: dict[str, float]) -> None:
    """A step whose every prompt was longer than rollout.max_prompt_len (``train/skipped_all_too_long``): say so once
    per run (rank 0), with the fix; every such step is skipped."""
    if not m.get("train/skipped_all_too_long") or life.warned_all_too_long or not life.is_logger:
        return
    life.warned_all_too_long = True
    print(
        f"megatron-rlvr: WARNING: step {step}: all {m['data/prompts_too_long']:.0f} prompts are longer than "
        f"rollout.max_prompt_len={life.cfg.rollout.max_prompt_len} tokens (after the prompt template), so the step "
        "trains on nothing; raise rollout.max_prompt_len (every such step is skipped)",
        flush=True,
    )
