"""Training checkpoints with megatron-core dist_checkpointing: model, optimizer, RNG states, trainer state.

Layout of ``save_dir``::

    step_000000100/          a complete checkpoint: dist_checkpointing files + rlvr_meta.json + trainer_state.json
    step_000000200/
    latest                   text file naming the newest complete checkpoint (informational; loaders scan)
    .tmp-step_000000300/     a save in progress (or one that crashed): ignored by loaders, removed by the next save

Atomic save: every rank writes into ``.tmp-step_N``; after all ranks finished (barrier), rank 0 writes the metadata
and renames the folder to ``step_N`` (a single ``rename`` on one filesystem), so a crash at any point before the
rename leaves the previous checkpoints untouched, and a folder named ``step_N`` is always complete. Then the oldest
complete checkpoints beyond ``keep_last`` are deleted.

Resharding: model and optimizer states are saved as megatron ShardedTensors, so a checkpoint saved at one
(TP, PP, DP, EP) layout loads at another. The optimizer state is stored per parameter, independently of how megatron
splits the optimizer: with expert parallelism it chains one optimizer for the dense parameters and one for the
experts, without it there is one, and megatron's own chained format prefixes every key with the position in that
chain (``chained_1.optimizer.state.exp_avg...``), so an EP=2 checkpoint did not load at EP=1. Here every inner
optimizer's sharded tensors are saved under their own (parameter-named) keys, with the shared Adam step beside them;
on load the current optimizer's structure is filled from them. The DistributedOptimizer's ``dp_reshardable`` format
stores its internal bucket layout (megatron's format, kept as is), which only survives a change of DP: loading it at
another TP/PP/EP is refused with a clear error; use ``fully_reshardable`` (the default here) to change them. RNG
states are per rank: restored when the layout is the same, skipped otherwise (the new ranks keep the seeds they were
initialised with).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import torch

from megatron_rlvr.config.sections import SHARDING_TYPES
from megatron_rlvr.models.hf_config import MegatronModelArgs, megatron_model_args
from megatron_rlvr.models.lora import checkpoint_meta, checkpoint_state, load_checkpoint_state

META_FILE = "rlvr_meta.json"
TRAINER_STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{9})$")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how training checkpoints are written."""

    save_dir: str
    """Folder holding the step_N checkpoints of one run."""
    keep_last: int = 2
    """Number of newest complete checkpoints kept; older ones are deleted after each successful save (0 = keep all)."""
    distrib_optim_sharding_type: str = "fully_reshardable"
    """DistributedOptimizer state format, one of SHARDING_TYPES (the run's checkpoint.sharding_type). Ignored for
    non-distributed optimizers."""
    write_processes: int = 2
    """Writer processes per rank used by megatron's torch_dist save (its ``thread_count``; each is a fork)."""

    def __post_init__(self):
        if not self.save_dir:
            raise ValueError("CheckpointConfig.save_dir must be a non-empty path")
        if self.keep_last < 0:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 0, got {self.keep_last}")
        if self.write_processes < 1:
            raise ValueError(f"CheckpointConfig.write_processes must be >= 1, got {self.write_processes}")
        if self.distrib_optim_sharding_type not in SHARDING_TYPES:
            raise ValueError(
                f"CheckpointConfig.distrib_optim_sharding_type={self.distrib_optim_sharding_type!r}; "
                f"choose one of {SHARDING_TYPES}"
            )


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:09d}"


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in ``save_dir`` as sorted (step, path); temporary folders are ignored."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _STEP_DIR.match(name)
        path = os.path.join(save_dir, name)
        if m and os.path.isfile(os.path.join(path, META_FILE)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(save_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    ckpts = list_checkpoints(save_dir)
    return ckpts[-1][1] if ckpts else None


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{ckpt_dir} is not a complete megatron-rlvr checkpoint (no {META_FILE})")
    with open(path) as f:
        return json.load(f)


def checkpoint_model_args(ckpt_dir: str, *, tp_size: int, pp_size: int, **kwargs) -> MegatronModelArgs:
    """Model args to rebuild the checkpoint's model at a (possibly different) layout: the saved HF config and the
    saved padded vocabulary (which must divide by the new TP size)."""
    meta = read_meta(ckpt_dir)
    if "hf_config" not in meta:
        raise ValueError(f"{ckpt_dir}/{META_FILE} has no hf_config: it was saved without model args")
    dtype = kwargs.pop("dtype", getattr(torch, meta.get("params_dtype", "float32")))
    return megatron_model_args(
        meta["hf_config"],
        tp_size=tp_size,
        pp_size=pp_size,
        dtype=dtype,
        padded_vocab_size=meta["padded_vocab_size"],
        **kwargs,
    )


# --------------------------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(pg) -> dict:
    ep, cp = getattr(pg, "ep", None), getattr(pg, "cp", None)
    return {
        "tp": pg.tp.size(),
        "pp": pg.pp.size(),
        "dp": pg.dp.size(),
        "ep": ep.size() if ep is not None else 1,
        "cp": cp.size() if cp is not None else 1,
    }


def _same_layout(saved: dict, now: dict) -> bool:
    """Checkpoints written before the layout recorded EP compare on what they recorded; before it recorded CP, they
    were written at CP = 1."""
    saved = {"cp": 1, **saved}
    return all(saved[k] == now[k] for k in saved.keys() & now.keys())


def _rng_sharded_object(pg, state):
    """Every rank's RNG states, one object per (pp, tp, dp) rank, and per CP rank with context parallelism (the CP
    ranks of one data-parallel rank hold different states; at CP = 1 the key shape stays what it always was)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lay = _layout(pg)
    shape, where = (lay["pp"], lay["tp"], lay["dp"]), (pg.pp.rank(), pg.tp.rank(), pg.dp.rank())
    if lay["cp"] > 1:
        shape, where = (*shape, lay["cp"]), (*where, pg.cp.rank())
    return ShardedObject("rng_state", state, shape, where, replica_id=0)


# --------------------------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------------------------


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _materialise_optimizer_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer real Adam state tensors before its state is loaded.

    Its ``state_dict()`` reads the per-parameter ``step`` of torch's Adam (when neither Apex nor TE provides the
    fused Adam), which only exists after a first ``step()``; the loaded values replace these dummies in place. The
    dummy step runs with lr = 0, so neither the update nor AdamW's decoupled weight decay touches the parameters.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or len(opt.optimizer.state) > 0:
            continue
        lrs = [g["lr"] for g in opt.optimizer.param_groups]
        for g in opt.optimizer.param_groups:
            g["lr"] = 0.0
        try:
            opt._init_optimizer_states_with_dummy_values()
        finally:
            for g, lr in zip(opt.optimizer.param_groups, lrs):
                g["lr"] = lr


OPTIMIZER_FORMAT = "per_parameter"
"""``rlvr_meta.json``'s ``optimizer_format`` of checkpoints whose optimizer state does not depend on the chaining
(absent: megatron's chained format, loadable at the layout it was saved at)."""


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _per_parameter_format(sharding_type: str | None) -> bool:
    """Every format but ``dp_reshardable`` names its tensors after the parameters (its bucket objects are named
    after the DP group index, which the dense and expert optimizers share)."""
    return sharding_type in (None, "fully_reshardable", "fully_sharded_model_space")


def _leaves(tree, path=()):
    """(path, leaf) of every non-container leaf of nested dicts / lists."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _slot(part: int, path: tuple) -> str:
    return "/".join(map(str, (part, *path)))


def _set_path(tree, path, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _torch_part(inner_sd: dict) -> dict | None:
    """The torch optimizer's part of an inner optimizer's state dict: megatron's fp32 optimizer returns it as is,
    the mixed-precision and distributed ones under ``optimizer``."""
    if "param_groups" in inner_sd:
        return inner_sd
    opt = inner_sd.get("optimizer")
    return opt if isinstance(opt, dict) else None


def _optimizer_step(inner_sd: dict) -> float | None:
    """The Adam step count shared by every parameter: megatron's plain optimizers keep it in
    ``state.common_step``, the DistributedOptimizer in every param group."""
    opt = _torch_part(inner_sd) or {}
    step = (opt.get("state") or {}).get("common_step")
    if step is None:
        step = next((g["step"] for g in opt.get("param_groups", []) if g.get("step") is not None), None)
    return None if step is None else float(step)


def _put_optimizer_step(inner_sd: dict, step: float | None) -> None:
    opt = _torch_part(inner_sd)
    if step is None or opt is None:
        return
    if "param_groups" in opt and any("step" in g for g in opt["param_groups"]):  # DistributedOptimizer
        for g in opt["param_groups"]:
            g["step"] = step
    elif isinstance(opt.get("state"), dict):  # plain optimizer: restored into every parameter's state
        opt["state"]["common_step"] = torch.tensor(step, dtype=torch.float32)


def _optimizer_parts(optimizer, model_sd, sharding_type, is_loading: bool) -> tuple[dict, list[dict]]:
    """(the optimizer's layout-independent sharded state, every inner optimizer's own sharded state dict).

    The former is ``{"tensors": {slot: sharded tensor}, "step": Adam's step, "grad_scaler": ...}``: each tensor
    keeps the parameter-named key megatron gives it (``optimizer.state.exp_avg.<parameter>``), the same whether the
    parameter's optimizer is the dense one or the expert one of a chain."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if not is_loading and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    metadata = {} if sharding_type is None else {"distrib_optim_sharding_type": sharding_type}
    inner = _inner_optimizers(optimizer)
    parts = [o.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata) for o in inner]
    # the sharded tensors' own keys and offsets place them in the checkpoint; the dictionary keys here only name
    # them within this process (one parameter key covers every layer's slice: several tensors share it)
    tensors = {_slot(i, p): x for i, sd in enumerate(parts) for p, x in _leaves(sd) if isinstance(x, ShardedBase)}
    steps = {_optimizer_step(sd) for sd in parts} - {None}
    if len(steps) > 1:
        raise ValueError(f"the chained optimizers disagree on Adam's step: {sorted(steps)}")
    scaler = next((sd["grad_scaler"] for sd in parts if sd.get("grad_scaler") is not None), None)
    return {"tensors": tensors, "step": steps.pop() if steps else None, "grad_scaler": scaler}, parts


def _load_optimizer_parts(optimizer, parts: list[dict], loaded: dict) -> None:
    """Fill every inner optimizer's own (current-layout) state dict from the loaded per-parameter state, then load
    it; param groups (hyper-parameters, the parameter order) are the current optimizer's."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    tensors = loaded.get("tensors", {})
    for i, (inner, sd) in enumerate(zip(_inner_optimizers(optimizer), parts)):
        for path, leaf in list(_leaves(sd)):
            if isinstance(leaf, ShardedBase):
                _set_path(sd, path, tensors[_slot(i, path)])
            elif isinstance(leaf, LocalNonpersistentObject):
                _set_path(sd, path, leaf.unwrap())
        _put_optimizer_step(sd, loaded.get("step"))
        if loaded.get("grad_scaler") is not None and "grad_scaler" in sd:
            sd["grad_scaler"] = loaded["grad_scaler"]
        inner.load_state_dict(sd)
    if hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


def _sharded_state(
    model, optimizer, scheduler, pg, sharding_type, *, is_loading: bool, rng: bool, per_parameter: bool = True
) -> tuple[dict, list[dict] | None]:
    """(the sharded state dict to save / load, the inner optimizers' own state dicts of the per-parameter format)."""
    model_sd = checkpoint_state(model, _unwrap(model).sharded_state_dict())  # LoRA: the adapters only
    state = {"model": model_sd}
    parts = None
    if optimizer is not None and per_parameter:
        state["optimizer"], parts = _optimizer_parts(optimizer, model_sd, sharding_type, is_loading)
    elif optimizer is not None:
        metadata = {"distrib_optim_sharding_type": sharding_type}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_sharded_object(pg, _rng_state())
    return state, parts


def _barrier():
    torch.distributed.barrier()


WRITER_LOGGERS = "megatron.core.dist_checkpointing"
"""megatron-core's checkpoint writers log under this name."""


@contextlib.contextmanager
def writer_errors_held():
    """Hold back the error lines megatron's checkpoint writer logs before it raises (``Local process 0 encountered
    an error: [Errno 28] No space left on device``, once per rank, printed above the checkpointer's own one-line
    message): they go into the notes of the exception that follows, so a traceback file keeps them. Other records
    pass as before."""
    held: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        held.append(f"{record.name}: {record.getMessage()}")
        return False

    names = [WRITER_LOGGERS + ".strategies.filesystem_async"]  # the writer's logger, even before its import
    names += [n for n in logging.root.manager.loggerDict if n.startswith(WRITER_LOGGERS)]
    loggers = [logging.getLogger(n) for n in dict.fromkeys(names)]
    for log in loggers:
        log.addFilter(hold)
    try:
        yield held
    except BaseException as e:
        for line in held:
            e.add_note(line)
        raise
    finally:
        for log in loggers:
            log.removeFilter(hold)


def _broadcast_error(err: str | None) -> None:
    box = [err]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0]:
        raise RuntimeError(box[0])


def _prepare_tmp_dir(save_dir: str, tmp: str) -> str | None:
    """Rank 0: remove the leftovers of crashed saves and make the empty ``tmp`` folder; the error message or None."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        for name in os.listdir(save_dir):  # leftovers of crashed saves
            if name.startswith(".tmp-") or name.startswith(".trash-"):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        return f"cannot prepare checkpoint folder {tmp}: {e}"
    return None


def _publish(cfg: CheckpointConfig, tmp: str, final: str, meta: dict, trainer_state: dict) -> None:
    """Rank 0, once every shard is in ``tmp``: write the trainer state and the meta file (last: its presence marks
    completeness), rename ``tmp`` to ``final`` (replacing an older save of the step), point LATEST at it and drop
    the checkpoints beyond ``keep_last``."""
    _write_json(os.path.join(tmp, TRAINER_STATE_FILE), trainer_state)
    _write_json(os.path.join(tmp, META_FILE), meta)  # written last: its presence marks completeness
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step: move the old one aside first (rename needs a free name)
        trash = os.path.join(cfg.save_dir, ".trash-" + os.path.basename(final))
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(cfg.save_dir)
    _write_text_atomic(os.path.join(cfg.save_dir, LATEST_FILE), os.path.basename(final) + "\n")
    if cfg.keep_last > 0:
        for _, path in list_checkpoints(cfg.save_dir)[: -cfg.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    cfg: CheckpointConfig,
    step: int,
    *,
    model,
    optimizer=None,
    scheduler=None,
    trainer_state: dict | None = None,
    model_args: MegatronModelArgs | None = None,
    pg_collection=None,
) -> str:
    """Atomically save step ``step``; collective over all ranks. Returns the final checkpoint path.

    ``trainer_state``: small JSON-serialisable dict (step counters, data cursor, metrics) written by rank 0.
    ``model_args``: stored (HF config, padded vocab, dtype) so the checkpoint can be rebuilt / converted to HF alone.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if trainer_state is not None:
        json.dumps(trainer_state)  # fail early (on every rank) if it is not JSON-serialisable
    rank = torch.distributed.get_rank()
    final = os.path.join(cfg.save_dir, step_dir_name(step))
    tmp = os.path.join(cfg.save_dir, "." + "tmp-" + step_dir_name(step))

    _broadcast_error(_prepare_tmp_dir(cfg.save_dir, tmp) if rank == 0 else None)

    distributed_opt = optimizer is not None and _is_distributed_optimizer(optimizer)
    sharding_type = cfg.distrib_optim_sharding_type if distributed_opt else None
    per_parameter = _per_parameter_format(sharding_type)
    state, _ = _sharded_state(
        model,
        optimizer,
        scheduler,
        pg_collection,
        sharding_type,
        is_loading=False,
        rng=True,
        per_parameter=per_parameter,
    )
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=cfg.write_processes)
    with writer_errors_held():
        dist_checkpointing.save(
            state, tmp, sharded_strategy=strategy, content_metadata={"distrib_optim_sharding_type": sharding_type}
        )
    _barrier()  # every rank's shards are on disk

    err = None
    if rank == 0:
        try:
            meta = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "layout": _layout(pg_collection),
                "distributed_optimizer": distributed_opt,
                "distrib_optim_sharding_type": sharding_type,
                "has_optimizer": optimizer is not None,
                "has_scheduler": scheduler is not None,
                **({"optimizer_format": OPTIMIZER_FORMAT} if optimizer is not None and per_parameter else {}),
                "checkpoint_config": asdict(cfg),
                **checkpoint_meta(model),
            }
            if model_args is not None:
                meta.update(
                    hf_config=model_args.hf_config,
                    padded_vocab_size=model_args.dims.padded_vocab_size,
                    params_dtype=str(model_args.config.params_dtype).removeprefix("torch."),
                )
            _publish(cfg, tmp, final, meta, trainer_state or {})
        except Exception as e:  # tell every rank: nobody may believe this step was saved
            err = f"checkpoint save of step {step} to {final} failed: {type(e).__name__}: {e}"
    _broadcast_error(err)
    return final


def load_checkpoint(
    ckpt_dir: str,
    *,
    model,
    optimizer=None,
    scheduler=None,
    pg_collection=None,
    load_rng: bool = True,
) -> dict:
    """Load a complete checkpoint (a step_N folder, or a save_dir: its newest) into model / optimizer / scheduler at
    the CURRENT layout. Returns the trainer state dict. Collective over all ranks."""
    from megatron.core import dist_checkpointing
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if not os.path.isfile(os.path.join(ckpt_dir, META_FILE)):
        latest = latest_checkpoint(ckpt_dir)
        if latest is None:
            raise ValueError(f"no complete checkpoint in {ckpt_dir}")
        ckpt_dir = latest
    meta = read_meta(ckpt_dir)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{ckpt_dir}: checkpoint format {meta.get('format_version')} != {FORMAT_VERSION}")
    if optimizer is not None and not meta.get("has_optimizer"):
        raise ValueError(f"{ckpt_dir} holds no optimizer state; load with optimizer=None")
    saved, now = meta["layout"], _layout(pg_collection)
    distributed_opt = optimizer is not None and _is_distributed_optimizer(optimizer)
    if optimizer is not None and distributed_opt != meta["distributed_optimizer"]:
        raise ValueError(
            f"{ckpt_dir} was saved with distributed_optimizer={meta['distributed_optimizer']}, the current optimizer "
            f"has {distributed_opt}: optimizer states are not convertible between the two"
        )
    sharding_type = meta.get("distrib_optim_sharding_type")
    per_parameter = meta.get("optimizer_format") == OPTIMIZER_FORMAT
    # dp_reshardable (megatron's format) names its tensors after the optimizer's buckets and its chain (EP)
    fixed = ("tp", "pp", "ep")
    if distributed_opt and sharding_type == "dp_reshardable" and any(saved.get(k, now[k]) != now[k] for k in fixed):
        was = ", ".join(f"{k.upper()}={saved[k]}" for k in fixed if k in saved)
        is_ = ", ".join(f"{k.upper()}={now[k]}" for k in fixed if k in saved)
        raise ValueError(
            f"{ckpt_dir}: DistributedOptimizer state in '{sharding_type}' format was saved at {was} and can only be "
            f"loaded at that layout (now {is_}); resume at {was}, or save with "
            "distrib_optim_sharding_type='fully_reshardable' (checkpoint.sharding_type) to change it"
        )
    same_layout = _same_layout(saved, now)
    if optimizer is not None:
        _materialise_optimizer_state(optimizer)
    rng = load_rng and same_layout
    with torch.no_grad():
        state, parts = _sharded_state(
            model,
            optimizer,
            scheduler if meta.get("has_scheduler") else None,
            pg_collection,
            sharding_type,
            is_loading=True,
            rng=rng,
            per_parameter=per_parameter,
        )
        if parts is not None:  # only the tensors are read: step and scaler come from the checkpoint's common state
            state["optimizer"] = {"tensors": state["optimizer"]["tensors"]}
        loaded = dist_checkpointing.load(state, ckpt_dir)
        load_checkpoint_state(_unwrap(model), loaded["model"])
        if optimizer is not None and parts is not None:
            _load_optimizer_parts(optimizer, parts, loaded["optimizer"])
        elif optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    if rng:
        _set_rng_state(loaded["rng_state"])
    with open(os.path.join(ckpt_dir, TRAINER_STATE_FILE)) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Integrity of saved checkpoints (rank 0 writes the manifest after a save; resume and convert check it)

MANIFEST_FILE = "rlvr_files.json"
"""Written by rank 0 into each checkpoint after it is complete: {relative path: size in bytes} of its files."""


def write_manifest(ckpt_dir: str) -> None:
    files = {}
    for root, _, names in os.walk(ckpt_dir):
        for n in names:
            if n == MANIFEST_FILE:
                continue
            p = os.path.join(root, n)
            files[os.path.relpath(p, ckpt_dir)] = os.path.getsize(p)
    tmp = os.path.join(ckpt_dir, "." + MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(files, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST_FILE))


def checkpoint_problem(ckpt_dir: str) -> str | None:
    """Why ``ckpt_dir`` cannot be resumed (a missing or truncated file, unreadable metadata), or None if it looks
    complete. Checkpoints written before the manifest existed are only checked for their metadata files."""
    for name in (META_FILE, TRAINER_STATE_FILE):
        p = os.path.join(ckpt_dir, name)
        try:
            with open(p) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{p}: unreadable ({type(e).__name__}: {e})"
    mpath = os.path.join(ckpt_dir, MANIFEST_FILE)
    if not os.path.isfile(mpath):
        return None
    try:
        with open(mpath) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        return f"{mpath}: unreadable ({type(e).__name__}: {e})"
    for rel, size in sorted(files.items()):
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            return f"{p}: missing"
        actual = os.path.getsize(p)
        if actual != size:
            return f"{p}: {actual} bytes, {size} when saved (truncated or overwritten)"
    return None
