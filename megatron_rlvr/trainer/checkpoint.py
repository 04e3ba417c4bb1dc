"""Trainer glue for checkpoints (megatron_rlvr.models.checkpointing: dist_checkpointing, atomic, keep-last-K) and
the final HF export (megatron_rlvr.models.export).

A checkpoint holds model, optimizer, LR scheduler and RNG states plus the trainer state: the step and the prompt
sampler's position. Everything else a step depends on is a function of (seed, step): rollout sampling seeds derive
from them, so a resumed run repeats the uninterrupted run's steps exactly.
"""

from __future__ import annotations

import os


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _ckpt_config(t):
    from megatron_rlvr.models.checkpointing import CheckpointConfig

    return CheckpointConfig(
        save_dir=checkpoint_dir(t.run_dir),
        keep_last=t.cfg.checkpoint.keep_last,
        distrib_optim_sharding_type=t.cfg.checkpoint.sharding_type,
    )


def save(t, step: int) -> str:
    """Save step ``step`` (collective); a no-op returning the path if that step is already the newest checkpoint."""
    from megatron_rlvr.models.checkpointing import latest_checkpoint, save_checkpoint, step_dir_name

    path = os.path.join(checkpoint_dir(t.run_dir), step_dir_name(step))
    if latest_checkpoint(checkpoint_dir(t.run_dir)) == path:
        return path
    state = {"step": step, "data": t.loader.state_dict(), "algorithm": t.cfg.algorithm.name}
    return save_checkpoint(
        _ckpt_config(t),
        step,
        model=t.model,
        optimizer=t.optimizer,
        scheduler=t.scheduler,
        trainer_state=state,
        model_args=t.args,
        pg_collection=t.dist.pg,
    )


def maybe_save(t, step: int) -> str | None:
    every = t.cfg.checkpoint.save_every
    if every and step % every == 0 and step != t.cfg.schedule.steps:  # the last step is saved by finish()
        return save(t, step)
    return None


def maybe_resume(t) -> int:
    """Load the checkpoint named by checkpoint.resume ('auto': the run dir's newest, if any); returns its step."""
    from megatron_rlvr.models.checkpointing import latest_checkpoint, load_checkpoint

    how = t.cfg.checkpoint.resume
    if how == "never":
        return 0
    path = latest_checkpoint(checkpoint_dir(t.run_dir)) if how == "auto" else how
    if path is None:
        return 0
    state = load_checkpoint(path, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, pg_collection=t.dist.pg)
    if "data" in state:
        t.loader.load_state_dict(state["data"])
    return int(state.get("step", 0))


def export_hf_folder(t) -> str:
    """``<run_dir>/hf``: an HF folder of the final policy (tokenizer included) that transformers loads unchanged."""
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.export import export_hf

    out = os.path.join(t.run_dir, "hf")
    source_dir = t.source.weights_dir or t.source.tokenizer_dir
    export_hf(unwrap(t.model), t.args, out, source_dir=source_dir, pg_collection=t.dist.pg, overwrite=True)
    if t.dist.is_logger and source_dir is None:  # built-in tokenizer: write its files next to the weights
        t.tokenizer.save_pretrained(out)
    return out
