"""Trainer glue for checkpoints (megatron_rlvr.models.checkpointing: dist_checkpointing, atomic, keep-last-K) and
the final HF export (megatron_rlvr.models.export).

A checkpoint holds model, optimizer, LR scheduler and RNG states plus the trainer state: the step and the prompt
sampler's position. Everything else a step depends on is a function of (seed, step): rollout sampling seeds derive
from them, so a resumed run repeats the uninterrupted run's steps exactly. The disaggregated schedule also saves the
rollout batches in flight (generated from weights older than the checkpoint's, not yet trained) in
``in_flight.pkl``: the resumed run trains those instead of regenerating them from the newer weights.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.config import CheckpointConfig
from megatron_rlvr.config.lora_config import adapter_refusal
from megatron_rlvr.data import PromptLoader
from megatron_rlvr.megatron.parallel import all_gather_objects, broadcast_object
from megatron_rlvr.models import checkpointing
from megatron_rlvr.models.build import unwrap
from megatron_rlvr.models.checkpointing import checkpoint_problem
from megatron_rlvr.models.export import export_hf
from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.models.lora import checkpoint_meta as lora_checkpoint_meta


class ResumeError(ValueError):
    """A resume that cannot proceed as asked (changed options, corrupt checkpoint without fallback)."""


IN_FLIGHT_FILE = "in_flight.pkl"
"""The disaggregated schedule's rollout batches in flight at a checkpoint (pickled list; rank 0 writes it)."""


class CheckpointSaveError(ValueError):
    """A checkpoint that could not be written (raised on every rank, with the same one-line message)."""


_NO_SPACE = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
_LOW_SPACE_BYTES = 64 << 20


def _causes(e: BaseException):
    """``e``, its causes and contexts, and the per-rank failures a torch CheckpointException carries."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        for wrapped in (getattr(x, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)


def save_failure_reason(e: BaseException, save_dir: str) -> str:
    """Why a checkpoint save failed, in one line. A full disk often reaches us without its errno (torch's zip
    writer reports a short write as ``unexpected pos 704 vs 598``), so a failure on a nearly full file system is
    named as that."""
    for x in _causes(e):
        if isinstance(x, OSError) and x.errno in _NO_SPACE:
            return f"{_NO_SPACE[x.errno]} [{errno.errorcode[x.errno]}]"
        for code, text in _NO_SPACE.items():
            if text in str(x):
                return f"{text} [{errno.errorcode[code]}]"
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    first = next((x for x in _causes(e) if getattr(x, "failures", None) is None), e)
    detail = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"[:300]
    if free is not None and free < _LOW_SPACE_BYTES:
        return f"No space left on device [ENOSPC] (only {free >> 20} MiB free; {detail})"
    return detail


def _traceback_file(e: BaseException) -> str | None:
    """The failure's traceback (with the writer's held-back log lines, its notes) in a temporary file, as the CLI
    keeps an unexpected error's: the line the user sees stays one line. None when that cannot be written either."""
    import tempfile
    import traceback

    path = None
    try:
        fd, path = tempfile.mkstemp(prefix="megatron-rlvr-checkpoint-", suffix=".traceback.txt")
        with os.fdopen(fd, "w") as f:
            traceback.print_exception(e, file=f)
        return path
    except OSError:  # that disk is full too
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
        return None


def load_failure_reason(e: BaseException) -> str:
    """Why a checkpoint load failed, in one line: the first rank's own error, not torch's per-rank tracebacks."""
    first = next((x for x in _causes(e) if getattr(x, "failures", None) is None), e)
    text = str(first).strip().splitlines()[0] if str(first).strip() else ""
    return f"{type(first).__name__}: {text}"[:500]


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


PENDING_CONFIG = ".config.pending.yaml"
"""A resume's resolved config until its checkpoint has loaded: the ranks start on it, and it replaces the run's
config.yaml only then. Written into config.yaml straight away, the options of a resume that then failed (a refused
adapter rank, a checkpoint that does not load) stayed in the run: a plain re-run trained with them, and a partial
repair compared against them instead of the checkpoint's."""


def pending_config(run_dir: str) -> str:
    return os.path.join(run_dir, PENDING_CONFIG)


def commit_pending_config(run_dir: str) -> None:
    """The resume has loaded its checkpoint: its config becomes the run's config.yaml (one rename)."""
    if os.path.isfile(pending_config(run_dir)):
        os.replace(pending_config(run_dir), os.path.join(run_dir, "config.yaml"))


def discard_pending_config(run_dir: str) -> None:
    """The resume failed: the run's config.yaml stays as it was."""
    try:
        os.remove(pending_config(run_dir))
    except FileNotFoundError:
        pass


@dataclass
class PolicyState:
    """What a checkpoint holds besides the trainer state: the policy and its optimizer (megatron objects)."""

    model: Any
    """Megatron DDP-wrapped policy."""
    optimizer: Any
    """Megatron optimizer."""
    scheduler: Any
    """Learning-rate scheduler."""
    args: MegatronModelArgs
    """Model arguments (recorded in the checkpoint's metadata: shapes, padded vocab)."""


@dataclass
class Checkpointer:
    """Saves and resumes one run's checkpoints (collective: every rank calls every method)."""

    run_dir: str
    """The run directory; checkpoints go to ``<run_dir>/checkpoints/step_N``."""
    cfg: CheckpointConfig
    """The run's ``checkpoint`` section (cadence, keep-last, resume, fallback, sharding type)."""
    pg: Any
    """Megatron ProcessGroupCollection of the layout."""
    rank: int
    """Global rank (rank 0 chooses the checkpoint and writes the manifest)."""
    algorithm: str
    """The algorithm's name, recorded with the trainer state."""
    last_step: int
    """schedule.steps: the last step is saved by the end of the run, not by the cadence."""
    resumed_from: int = 0
    """The step this run resumed from (0: a fresh run)."""
    in_flight: Callable[[int], list | None] | None = None
    """Called on every rank at a save of step N: the messages in flight to save with it (rank 0; None elsewhere or
    when there are none). Set by the disaggregated schedule."""
    resumed_in_flight: list = field(default_factory=list)
    """Rank 0: the messages in flight saved with the checkpoint resumed from (empty: none, or another rank)."""

    @property
    def save_dir(self) -> str:
        return checkpoint_dir(self.run_dir)

    def save(self, step: int, policy: PolicyState, loader: PromptLoader) -> str:
        """Save step ``step``; a no-op returning the path if that step is the checkpoint this run resumed from (e.g.
        the final save of a run resumed at its last step). Rank 0 then records every file's size
        (``checkpoint_problem``: a truncated shard is found on resume)."""
        path = os.path.join(self.save_dir, checkpointing.step_dir_name(step))
        # Only the resumed-from step is known to hold this state: a newer step_N folder that the resume skipped as
        # corrupt (checkpoint.fallback) must be replaced when the run reaches that step again, not kept.
        if step == self.resumed_from and checkpointing.latest_checkpoint(self.save_dir) == path:
            return path
        config = checkpointing.CheckpointConfig(
            save_dir=self.save_dir, keep_last=self.cfg.keep_last, distrib_optim_sharding_type=self.cfg.sharding_type
        )
        in_flight = self.in_flight(step) if self.in_flight is not None else None
        state = {"step": step, "data": loader.state_dict(), "algorithm": self.algorithm}
        if in_flight:  # rank 0 writes the trainer state: a resume then knows the file must be there
            state["in_flight"] = len(in_flight)
        try:
            out = checkpointing.save_checkpoint(
                config,
                step,
                model=policy.model,
                optimizer=policy.optimizer,
                scheduler=policy.scheduler,
                trainer_state=state,
                model_args=policy.args,
                pg_collection=self.pg,
            )
            if self.rank == 0:
                if in_flight:
                    write_in_flight(out, in_flight)
                checkpointing.write_manifest(out)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException: it passed `except Exception`
            raise self._save_failed(step, path, e) from e
        return out

    def _save_failed(self, step: int, path: str, e: BaseException) -> CheckpointSaveError:
        """One line for a failed save (every rank gets the same failure from the collective save): why, where,
        and what is safe. Rank 0 removes the partial folder, so it holds no space until the next save."""
        reason = save_failure_reason(e, self.save_dir)
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.save_dir, ".tmp-" + os.path.basename(path)), ignore_errors=True)
        newest = checkpointing.latest_checkpoint(self.save_dir)
        kept = f"the newest checkpoint, {newest}, is intact" if newest else "no earlier checkpoint exists"
        where = _traceback_file(e) if self.rank == 0 else None
        return CheckpointSaveError(
            f"the checkpoint of step {step} could not be written to {path}: {reason}; {kept}. Free space (or set "
            f"checkpoint.save_every / keep_last) and run the same command again to resume"
            + (f" (traceback in {where})" if where else "")
        )

    def maybe_save(self, step: int, policy: PolicyState, loader: PromptLoader) -> str | None:
        every = self.cfg.save_every
        if every and step % every == 0 and step != self.last_step:  # the last step is saved by the run's end
            return self.save(step, policy, loader)
        return None

    def _candidates(self) -> list[str]:
        how = self.cfg.resume
        if how == "auto":
            return candidates(self.save_dir)
        if os.path.isfile(os.path.join(how, checkpointing.META_FILE)):  # one step_N folder: no silent fallback
            return [how]
        found = candidates(how) or candidates(os.path.join(how, "checkpoints"))  # a checkpoints folder or a run dir
        if not found:
            raise ResumeError(
                f"checkpoint.resume={how}: no complete checkpoint (step_N folder with rlvr_meta.json) there"
            )
        return found

    def resume(self, policy: PolicyState, loader: PromptLoader) -> int:
        """Load the checkpoint named by checkpoint.resume ('auto': the run dir's newest, if any) into ``policy`` and
        ``loader``; returns (and records) its step.

        Rank 0 picks the newest checkpoint whose files are intact; a corrupt or incomplete one is reported by path
        and skipped for the previous complete one (checkpoint.fallback=false: a ResumeError instead). A load that
        fails on any rank is treated the same way. The resume's config (written aside by the run directory's
        preparation) becomes the run's config.yaml once the checkpoint has loaded, and is discarded if it fails."""
        try:
            self.resumed_from = self._resume(policy, loader)
        except BaseException:
            if self.rank == 0:
                discard_pending_config(self.run_dir)
            raise
        if self.rank == 0:
            commit_pending_config(self.run_dir)
        return self.resumed_from

    def _resume(self, policy: PolicyState, loader: PromptLoader) -> int:
        if self.cfg.resume == "never":
            return 0
        fallback = self.cfg.fallback
        warn = print if self.rank == 0 else (lambda *_: None)
        remaining = None
        if self.rank == 0:
            try:
                remaining = self._candidates()
            except ResumeError as e:
                remaining = e
        remaining = broadcast_object(remaining)
        if isinstance(remaining, ResumeError):
            raise remaining
        skipped: list[str] = []
        adapters = lora_checkpoint_meta(unwrap(policy.model)).get("lora")
        while remaining:
            choice, bad = None, []
            if self.rank == 0:
                try:
                    choice, bad = choose_checkpoint(remaining, fallback, warn=lambda m: print(m, flush=True))
                    # adapters of another shape: one line, not a shape mismatch from inside the load (no fallback:
                    # every checkpoint of the run has the same adapters)
                    refusal = choice and adapter_refusal(checkpointing.read_meta(choice).get("lora"), adapters, choice)
                    if refusal:
                        raise ResumeError(refusal)
                except ResumeError as e:
                    choice = e
            choice, bad = broadcast_object((choice, bad))
            skipped += bad
            if isinstance(choice, ResumeError):
                raise choice
            if choice is None:
                break
            try:
                state = checkpointing.load_checkpoint(
                    choice,
                    model=policy.model,
                    optimizer=policy.optimizer,
                    scheduler=policy.scheduler,
                    pg_collection=self.pg,
                )
                in_flight = read_in_flight(choice, state) if self.rank == 0 else []
                err = None
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # a damaged shard: EOFError, pickle or tensor-size errors (torch's
                err = load_failure_reason(e)  # CheckpointException is a BaseException, not an Exception)
            errors = [e for e in all_gather_objects(err) if e]
            if not errors:
                if "data" in state:
                    loader.load_state_dict(state["data"])
                self.resumed_in_flight = in_flight
                if skipped:
                    warn(f"megatron-rlvr: WARNING: resumed from {choice} instead of the newer {', '.join(skipped)}")
                return int(state.get("step", 0))
            if not fallback:
                raise ResumeError(
                    f"checkpoint {choice} cannot be loaded ({errors[0]}); checkpoint.fallback=false, so not resuming "
                    "from an older one. Delete that folder (or set checkpoint.fallback=true) to use the previous one"
                )
            warn(f"megatron-rlvr: WARNING: checkpoint {choice} cannot be loaded ({errors[0]}); trying the previous one")
            skipped.append(choice)
            remaining = remaining[remaining.index(choice) + 1 :]
        if skipped:
            raise ResumeError(
                f"no checkpoint of {self.run_dir} can be resumed (damaged: {', '.join(skipped)}); use "
                "checkpoint.resume=never to start the run over"
            )
        return 0


def write_in_flight(ckpt_dir: str, messages: list) -> None:
    """Pickle ``messages`` into ``ckpt_dir``/in_flight.pkl (written aside, synced, then renamed)."""
    tmp = os.path.join(ckpt_dir, "." + IN_FLIGHT_FILE + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(messages, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, IN_FLIGHT_FILE))


def read_in_flight(ckpt_dir: str, trainer_state: dict) -> list:
    """The messages in flight saved with ``ckpt_dir`` (the count its trainer state records; none: empty). The file
    is this run's own, written by :func:`write_in_flight`; a missing or short one raises (the load fails, and the
    resume falls back like for any damaged checkpoint file)."""
    n = int(trainer_state.get("in_flight", 0))
    if not n:
        return []
    with open(os.path.join(ckpt_dir, IN_FLIGHT_FILE), "rb") as f:
        messages = pickle.load(f)
    got = len(messages) if isinstance(messages, list) else type(messages).__name__
    if got != n:
        raise ValueError(f"{ckpt_dir}/{IN_FLIGHT_FILE} holds {got} batches, its trainer state says {n}")
    return messages


def export_hf_folder(run_dir: str, policy: PolicyState, source, tokenizer, pg, write_tokenizer: bool) -> str:
    """``<run_dir>/hf``: an HF folder of the final policy (tokenizer included) that transformers loads unchanged.
    ``source``: the model source (its weights / tokenizer folder is copied alongside); ``write_tokenizer``: this rank
    writes the built-in tokenizer's files when the source has none."""
    out = os.path.join(run_dir, "hf")
    source_dir = source.weights_dir or source.tokenizer_dir
    export_hf(unwrap(policy.model), policy.args, out, source_dir=source_dir, pg_collection=pg, overwrite=True)
    if write_tokenizer and source_dir is None:  # built-in tokenizer: write its files next to the weights
        tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint integrity
# ----------------------------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------------------------


def candidates(save_dir: str) -> list[str]:
    """Complete checkpoints, newest first."""
    return [p for _, p in reversed(checkpointing.list_checkpoints(save_dir))]


def choose_checkpoint(paths: list[str], fallback: bool, warn=print) -> tuple[str | None, list[str]]:
    """The first of ``paths`` (newest first) without a problem; ``warn`` gets one line per skipped checkpoint.
    Returns (path or None, skipped paths). Without fallback a problem with the newest raises ResumeError."""
    skipped = []
    for p in paths:
        problem = checkpoint_problem(p)
        if problem is None:
            return p, skipped
        if not fallback:
            raise ResumeError(
                f"checkpoint {p} is corrupt or incomplete ({problem}); checkpoint.fallback=false, so not resuming "
                "from an older one. Delete that folder (or set checkpoint.fallback=true) to resume from the previous "
                "complete checkpoint"
            )
        skipped.append(p)
        warn(f"megatron-rlvr: WARNING: checkpoint {p} is corrupt or incomplete ({problem}); trying the previous one")
    return None, skipped
