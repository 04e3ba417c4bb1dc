"""The synchronous colocated schedule: every rank holds the policy and a rollout engine, and ``rl_step`` runs the
stages of ``megatron_rlvr.trainer.stages`` in order: rollout, then training (the engine asleep), then the weight sync.
``train(cfg)`` runs on every rank (SPMD) and wraps the steps with the run's life: stop signals (checkpoint, documented
exit code), periodic evaluation and checkpoints, the final checkpoint, HF export and plot."""

from __future__ import annotations

import os
import time

from megatron_rlvr.config import RunConfig
from megatron_rlvr.megatron.parallel import all_reduce_max
from megatron_rlvr.rollout.groups import RolloutStopped
from megatron_rlvr.rundir.checkpointer import export_hf_folder
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.metrics_log import read_metrics
from megatron_rlvr.rundir.plot import plot_runs
from megatron_rlvr.rundir.signals import StopSignals, exit_code_for
from megatron_rlvr.trainer.components import Trainer, setup, teardown
from megatron_rlvr.trainer.diagnostics import forgetting_control, forgetting_probe
from megatron_rlvr.trainer.engine_setup import sleep_engine
from megatron_rlvr.trainer.stages import publish_weights, rollout, train_batch, update, update_mismatch_metrics


def rl_step(t: Trainer, step: int) -> dict[str, float]:
    """One synchronous colocated RL step; returns the step's metrics (identical on every rank)."""
    t0 = time.perf_counter()
    rolled = rollout(t, step)
    control = forgetting_control(t, rolled, step)  # diagnostics: the probe's prompts and seeds, pre-update policy
    sleep_engine(t.engine, t.cfg.rollout.sleep_level)  # GPU: the engine frees its memory while the trainer runs
    batch, m = train_batch(t, rolled)
    if not batch.trains:  # empty or all-truncated batch: nothing to learn from
        m.update(publish_weights(t, updated=False))
        m.update({"train/skipped": 1.0, "train/skipped_empty": 1.0, "time/step_s": time.perf_counter() - t0})
        if not rolled.groups and m.get("data/prompts_too_long", 0) > 0:
            m["train/skipped_all_too_long"] = 1.0
            warn_all_too_long(t, step, m)
        return m
    t1 = time.perf_counter()
    result = update(t, batch)
    m.update(result.metrics)
    m["logprobs/nonfinite"] = max(m.get("logprobs/nonfinite", 0.0), result.first_forward_nonfinite)
    m.update(update_mismatch_metrics(t, batch, result))
    m["time/update_s"] = time.perf_counter() - t1
    t.scheduler.step(increment=1)
    m.update(publish_weights(t, updated=m.get("train/updates", 0) > 0))
    t.policy_version = step  # the engines now hold the weights after this step's update
    m.update(forgetting_probe(t, rolled, step, control))  # diagnostics: the same prompts, updated policy
    m["train/skipped"] = float(m.get("train/updates", 0) == 0)
    m["optim/lr"] = t.current_lr()
    m["time/step_s"] = time.perf_counter() - t0
    m["perf/tokens_per_s"] = sum(s.length for s in batch.sequences) / max(m["time/step_s"], 1e-9)
    m["perf/generated_tokens"] = float(sum(s.response_len for s in batch.sequences))
    return m


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None) -> int:
    """Run (or resume) training on this rank; returns the process exit code (0 done, else a signal's code).
    ``lock``: the run directory's lock when this process already holds it (a single-process run prepared it)."""

    t = setup(cfg, run_dir, lock)
    try:
        for step in range(t.start_step + 1, cfg.schedule.steps + 1):
            t.step = step
            data_state = t.loader.state_dict()
            try:
                metrics = rl_step(t, step)
            except RolloutStopped:  # a stop signal during generation or scoring: the step has not trained
                t.loader.load_state_dict(data_state)  # its prompts are drawn again on resume
                return end_step(t, step - 1, f" (step {step} was stopped during its rollout and runs again on resume)")
            if t.evaluator.due(step):
                metrics.update(run_eval(t))
            t.logger.log(step, metrics)
            code = end_step(t, step)
            if code is not None:
                return code
        t.step = max(t.start_step, cfg.schedule.steps)
        if cfg.eval.at_end and t.evaluator.sets and not t.evaluator.due(t.step):
            t.logger.log(t.step, run_eval(t))
        finish(t)
        return 0
    finally:
        teardown(t)


def end_step(t: Trainer, step: int, saved_note: str = "") -> int | None:
    """After a step is logged: every rank agrees on a stop signal (one MAX all-reduce); on one, checkpoint this step
    and return the exit code, else save by the cadence and return None. Every schedule ends its steps this way."""
    cfg = t.cfg
    stop = int(all_reduce_max(t.signals.code))
    if not stop:
        t.checkpointer.maybe_save(step, t.policy, t.loader)
        return None
    t.checkpointer.save(step, t.policy, t.loader)
    code = exit_code_for(stop, cfg.checkpoint.sigterm_exit_code, cfg.checkpoint.sigusr1_exit_code)
    if t.dist.is_logger:
        print(
            f"{StopSignals.name(stop)}: checkpoint of step {step} saved in {t.run_dir}/checkpoints{saved_note}; "
            f"exiting with {code}",
            flush=True,
        )
    return code


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
        auto = "AutoModelForImageTextToText" if t.image_processor is not None else "AutoModelForCausalLM"
        lines.append(f"  HF model:    {hf_dir}  (transformers.{auto}.from_pretrained)")
    if plot_path:
        lines.append(f"  curves:      {plot_path}")
    return "\n".join(lines)


def warn_all_too_long(t: Trainer, step: int, m: dict) -> None:
    """Every prompt of the step was longer than rollout.max_prompt_len: say so once per run (rank 0), with the fix;
    the step is skipped (``train/skipped_all_too_long``)."""
    if t.warned_all_too_long or not t.dist.is_logger:
        return
    t.warned_all_too_long = True
    print(
        f"megatron-rlvr: WARNING: step {step}: all {m['data/prompts_too_long']:.0f} prompts are longer than "
        f"rollout.max_prompt_len={t.cfg.rollout.max_prompt_len} tokens (after the prompt template), so the step "
        "trains on nothing; raise rollout.max_prompt_len (every such step is skipped)",
        flush=True,
    )
