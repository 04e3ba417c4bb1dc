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
    """Save step ``step`` (collective); a no-op returning the path if that step is the checkpoint this run resumed
    from (e.g. the final save of a run resumed at its last step). Rank 0 then records every file's size
    (megatron_rlvr/trainer/resume.py: a truncated shard is found on resume)."""
    from megatron_rlvr.models.checkpointing import latest_checkpoint, save_checkpoint, step_dir_name
    from megatron_rlvr.trainer.resume import write_manifest

    path = os.path.join(checkpoint_dir(t.run_dir), step_dir_name(step))
    # Only the resumed-from step is known to hold this state: a newer step_N folder that the resume skipped as
    # corrupt (checkpoint.fallback) must be replaced when the run reaches that step again, not kept.
    if step == t.start_step and latest_checkpoint(checkpoint_dir(t.run_dir)) == path:
        return path
    state = {"step": step, "data": t.loader.state_dict(), "algorithm": t.cfg.algorithm.name}
    out = save_checkpoint(
        _ckpt_config(t),
        step,
        model=t.model,
        optimizer=t.optimizer,
        scheduler=t.scheduler,
        trainer_state=state,
        model_args=t.args,
        pg_collection=t.dist.pg,
    )
    if t.dist.rank == 0:
        write_manifest(out)
    return out


def maybe_save(t, step: int) -> str | None:
    every = t.cfg.checkpoint.save_every
    if every and step % every == 0 and step != t.cfg.schedule.steps:  # the last step is saved by finish()
        return save(t, step)
    return None


def _resume_candidates(how: str, run_dir: str) -> list[str]:
    from megatron_rlvr.models.checkpointing import META_FILE
    from megatron_rlvr.trainer.resume import candidates

    if how == "auto":
        return candidates(checkpoint_dir(run_dir))
    if os.path.isfile(os.path.join(how, META_FILE)):  # one step_N folder: no silent fallback to another run's
        return [how]
    found = candidates(how) or candidates(os.path.join(how, "checkpoints"))  # a checkpoints folder or a run dir
    if not found:
        from megatron_rlvr.trainer.resume import ResumeError

        raise ResumeError(f"checkpoint.resume={how}: no complete checkpoint (step_N folder with rlvr_meta.json) there")
    return found


def maybe_resume(t) -> int:
    """Load the checkpoint named by checkpoint.resume ('auto': the run dir's newest, if any); returns its step.

    Collective. Rank 0 picks the newest checkpoint whose files are intact; a corrupt or incomplete one is reported
    by path and skipped for the previous complete one (checkpoint.fallback=false: a ResumeError instead). A load
    that fails on any rank is treated the same way."""
    from megatron_rlvr.megatron.parallel import all_gather_objects, broadcast_object
    from megatron_rlvr.models.checkpointing import load_checkpoint
    from megatron_rlvr.trainer.resume import ResumeError, choose_checkpoint

    how = t.cfg.checkpoint.resume
    if how == "never":
        return 0
    fallback = t.cfg.checkpoint.fallback
    warn = print if t.dist.rank == 0 else (lambda *_: None)
    remaining = None
    if t.dist.rank == 0:
        try:
            remaining = _resume_candidates(how, t.run_dir)
        except ResumeError as e:
            remaining = e
    remaining = broadcast_object(remaining)
    if isinstance(remaining, ResumeError):
        raise remaining
    skipped: list[str] = []
    while remaining:
        choice, bad = None, []
        if t.dist.rank == 0:
            try:
                choice, bad = choose_checkpoint(remaining, fallback, warn=lambda m: print(m, flush=True))
            except ResumeError as e:
                choice = e
        choice, bad = broadcast_object((choice, bad))
        skipped += bad
        if isinstance(choice, ResumeError):
            raise choice
        if choice is None:
            break
        try:
            state = load_checkpoint(
                choice, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, pg_collection=t.dist.pg
            )
            err = None
        except Exception as e:  # a damaged shard: EOFError, pickle or tensor-size errors from dist_checkpointing
            err = f"{type(e).__name__}: {e}"[:500]
        errors = [e for e in all_gather_objects(err) if e]
        if not errors:
            if "data" in state:
                t.loader.load_state_dict(state["data"])
            if skipped:
                warn(f"megatron-rlvr: WARNING: resumed from {choice} instead of the newer {', '.join(skipped)}")
            return int(state.get("step", 0))
        if not fallback:
            raise ResumeError(
                f"checkpoint {choice} cannot be loaded ({errors[0]}); checkpoint.fallback=false, so not resuming from "
                "an older one. Delete that folder (or set checkpoint.fallback=true) to use the previous one"
            )
        warn(f"megatron-rlvr: WARNING: checkpoint {choice} cannot be loaded ({errors[0]}); trying the previous one")
        skipped.append(choice)
        remaining = remaining[remaining.index(choice) + 1 :]
    if skipped:
        raise ResumeError(
            f"no checkpoint of {t.run_dir} can be resumed (damaged: {', '.join(skipped)}); use "
            "checkpoint.resume=never to start the run over"
        )
    return 0


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
