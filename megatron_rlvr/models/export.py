"""Megatron (any TP x PP) -> Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads unchanged.

Writes config.json, generation_config.json, safetensors shards (each <= ``max_shard_bytes``, 5 GB by default, with
``model.safetensors.index.json``; a single ``model.safetensors`` when everything fits in one) and copies the tokenizer
files of the source HF model. Memory: each pipeline stage gathers its own parameters over TP one at a time and
streams them into its shard files, so no rank holds more than one shard file's worth of tensors.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from collections.abc import Iterator

import torch

from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.models.hf_loading import SAFE_INDEX, SAFE_SINGLE
from megatron_rlvr.models.lora import lora_container
from megatron_rlvr.models.mapping import (
    FP32_HF_TENSORS,
    ExpertLayout,
    WeightMapping,
    checkpoint_names,
    layer_offset,
    mapped_tensors,
    stack_fused_experts,
)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)
"""Files copied verbatim from the source HF model folder when present (a vision-language model's processor too)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gather_tp(t: torch.Tensor, tp_dim: int | None, tp_group) -> torch.Tensor:
    if tp_dim is None or tp_group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp_group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)  # gloo: contiguous inputs only
    return torch.cat(parts, dim=tp_dim)


@torch.no_grad()
def iter_hf_tensors(model, args: MegatronModelArgs, *, pg_collection=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor held by this pipeline stage, TP-gathered.

    Collective over the TP group (every TP rank of the stage must iterate to the end); every TP rank gets the same
    tensors. The last stage's copy of a tied embedding is skipped (HF stores it once, on the first stage).
    Yielded tensors may ALIAS the parameters (replicated params, TP=1): clone them if they must outlive an update.
    Routed experts are gathered over the expert-TP group, then all-gathered over the expert-parallel group, so
    every rank also gets every expert (collective over those groups too).
    A LoRA policy is exported merged: each adapted weight as W + (alpha/r) B A (the adapters' ownership table says
    which), the adapters' own tensors not at all (``lora.export_peft`` writes them as a PEFT folder).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    tp_group = pg_collection.tp
    mapping = WeightMapping(args.dims)
    offset = layer_offset(args.config, pg_collection.pp.rank())
    experts = ExpertLayout.of(pg_collection)
    lora = lora_container(model)
    for name, param in mapped_tensors(model):
        if lora is not None and lora.is_adapter_param(param):  # exported merged into the weight it adapts
            continue
        p = mapping.resolve(name, layer_offset=offset, expert_offset=experts.expert_offset(args.dims))
        if p.skip_on_export:
            continue
        if not p.per_expert:
            full = _gather_tp(lora.merged_weight(param) if lora is not None else param.detach(), p.tp_dim, tp_group)
            yield from p.to_hf(full, tp_group.size()).items()
            continue
        full = _gather_tp(param.detach(), p.tp_dim, pg_collection.expt_tp)
        peers = [full]
        if experts.ep_size > 1:
            peers = [torch.empty_like(full) for _ in range(experts.ep_size)]
            torch.distributed.all_gather(peers, full.contiguous(), group=pg_collection.ep)
        for r, t in enumerate(peers):
            peer = mapping.resolve(name, layer_offset=offset, expert_offset=experts.expert_offset(args.dims, r))
            yield from peer.to_hf(t, experts.etp_size).items()


def export_dtype(args: MegatronModelArgs, dtype: torch.dtype | str | None) -> torch.dtype:
    """Explicit dtype, else the source HF config's dtype, else the model's parameter dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or args.hf_config.get("dtype") or args.hf_config.get("torch_dtype")
    if name is None:
        return args.config.params_dtype
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"export dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def hf_config_dict(args: MegatronModelArgs, dtype: torch.dtype) -> dict:
    """The source HF config with the exported dtype."""
    cfg = dict(args.hf_config)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    cfg.pop("quantization_config", None)  # weights are written dequantised
    return cfg


def _generation_config(cfg: dict) -> dict:
    out = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    out["_from_model_config"] = True
    return out


def export_hf(
    model,
    args: MegatronModelArgs,
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    pg_collection=None,
    overwrite: bool = False,
) -> str:
    """Write this (TP, PP) model as an HF folder. Collective over all ranks; returns ``out_dir``.

    ``source_dir``: the HF model the run started from; its generation_config.json and tokenizer files are copied.
    ``dtype``: tensor dtype in the files (default: the source config's dtype, else the parameter dtype).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = os.fspath(out_dir)
    dtype = export_dtype(args, dtype)
    rank = torch.distributed.get_rank()
    pp_rank = pg_collection.pp.rank()
    cp = getattr(pg_collection, "cp", None)  # context-parallel ranks hold the same weights: one of them writes
    writer = pg_collection.tp.rank() == 0 and pg_collection.dp.rank() == 0 and (cp is None or cp.rank() == 0)

    created = rank == 0 and not os.path.isdir(out_dir)
    err = _prepare_out_dir(out_dir, overwrite) if rank == 0 else None
    err = _broadcast_object(err)
    if err:
        raise ValueError(err)

    # 1. every stage streams its tensors into temporary shard files
    tensors = iter_hf_tensors(model, args, pg_collection=pg_collection)
    if args.dims.gpt_oss and writer:  # GPT-OSS checkpoints hold each expert tensor fused over experts
        tensors = stack_fused_experts(tensors, args.dims.num_experts, device="cpu")
    files, err = _write_temp_shards(tensors, out_dir, pp_rank, dtype, max_shard_bytes, writer)

    # 2. rank 0 names the shards globally and writes the index, config and tokenizer
    plans = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(plans, (pp_rank, files, err) if writer else None)
    if rank == 0:
        plans = sorted((p for p in plans if p), key=lambda p: p[0])
        err = next((f"stage {p[0]}: {p[2]}" if len(plans) > 1 else p[2] for p in plans if p[2]), None)
        if err is None:
            try:
                _finalise([f for plan in plans for f in plan[1]], out_dir, args, dtype, source_dir)
            except Exception as e:  # tell every rank, so none waits forever for rank 0
                err = _one_line(e)
        if err is not None:
            _discard_partial_export(out_dir, created)
    err = _broadcast_object(err)
    if err:
        left = "the folder was removed" if created else "its temporary shards were removed"
        raise RuntimeError(f"HF export to {out_dir} failed: {err} ({left})")
    return out_dir


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:500]


def _discard_partial_export(out_dir: str, created: bool) -> None:
    """Rank 0, after a failed export (a full disk): the folder it created goes, or else the temporary shards of
    every stage, so no half-written model is left to be mistaken for one."""
    if created:
        shutil.rmtree(out_dir, ignore_errors=True)
        return
    for path in glob.glob(os.path.join(out_dir, ".tmp-pp*.safetensors")):
        with contextlib.suppress(OSError):
            os.remove(path)


def _prepare_out_dir(out_dir: str, overwrite: bool) -> str | None:
    """Rank 0: refuse a folder that holds an HF checkpoint unless ``overwrite``; the error text, or None. A previous
    checkpoint there stays whole until the new one's shards are all written (``_finalise`` replaces it then), so an
    export that fails part way (a full disk at the end of a run) leaves the previous export as it was."""
    existing = _weight_files(out_dir)
    if existing and not overwrite:
        return (
            f"{out_dir} already holds an HF checkpoint ({os.path.basename(existing[0])}); pass overwrite=True "
            "(--overwrite for megatron-rlvr convert)"
        )
    os.makedirs(out_dir, exist_ok=True)
    return None


def _weight_files(out_dir: str) -> list[str]:
    """The HF weight files of ``out_dir`` (shards, single file, index), sorted."""
    return sorted(glob.glob(os.path.join(out_dir, "model*.safetensors*")))


def _write_temp_shards(
    tensors, out_dir: str, pp_rank: int, dtype, max_shard_bytes: int, writer: bool
) -> tuple[list, str | None]:
    """Iterate the (collective) tensor stream to its end; a writer rank (TP rank 0, DP rank 0, CP rank 0 of its stage)
    saves the tensors into temporary shard files of at most ``max_shard_bytes``: ([(temp path, names, bytes)], the
    one-line error of a write that failed, e.g. on a full disk). After a failed write the stream is still iterated
    (its TP peers gather with this rank) but nothing more is written."""
    files: list[tuple[str, list[str], int]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    err = None

    def flush():
        nonlocal pending, pending_bytes, err
        if not pending or err is not None:
            return
        path = os.path.join(out_dir, f".tmp-pp{pp_rank:03d}-{len(files):05d}.safetensors")
        try:
            save_shard(pending, path)
        except Exception as e:  # safetensors' error is no OSError
            err = _one_line(e)
            with contextlib.suppress(OSError):
                os.remove(path)
            return
        files.append((path, list(pending), pending_bytes))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        if not writer or err is not None:
            continue
        keep = torch.float32 if name.endswith(FP32_HF_TENSORS) else dtype  # transformers' fp32 router bias
        t = tensor.to(device="cpu", dtype=keep).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending[name] = t
        pending_bytes += nbytes
    if writer:
        flush()
    return files, err


def save_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' ``save_file``, leaving the file with the mode any new file gets (0644 under umask 022): it writes
    0600, so teammates on a shared file system could not read an exported model."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _finalise(files, out_dir, args: MegatronModelArgs, dtype, source_dir) -> None:
    expected = set(checkpoint_names(WeightMapping(args.dims).hf_names()))
    written = [n for _, names, _ in files for n in names]
    if sorted(written) != sorted(expected):
        missing, extra = sorted(expected - set(written)), sorted(set(written) - expected)
        raise RuntimeError(f"export wrote the wrong tensor set: missing {missing[:5]}, unexpected {extra[:5]}")
    # every new shard is on disk now: the previous export's weight files that the new ones will not replace go first
    # (each rename below replaces a file of the same name in one step)
    finals = (
        {SAFE_SINGLE}
        if len(files) == 1
        else {SAFE_INDEX} | {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))}
    )
    for old in _weight_files(out_dir):
        if os.path.basename(old) not in finals:
            os.remove(old)
    if len(files) == 1:
        os.replace(files[0][0], os.path.join(out_dir, SAFE_SINGLE))
    else:
        weight_map, total = {}, 0
        for i, (path, names, nbytes) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(path, os.path.join(out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
            total += nbytes
        with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg = hf_config_dict(args, dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    src_gen = os.path.join(source_dir, "generation_config.json") if source_dir else None
    if src_gen and os.path.isfile(src_gen):
        shutil.copyfile(src_gen, os.path.join(out_dir, "generation_config.json"))
    else:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(_generation_config(cfg), f, indent=2)
    if source_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(source_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))


def _broadcast_object(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
