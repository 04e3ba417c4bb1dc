"""HF safetensors checkpoint (single file or sharded index) -> the parameters of one (TP, PP) rank's GPTModel.

Each rank opens the safetensors files lazily and reads only the rows / columns of the tensors it owns
(``safe_open(...).get_slice``), so no rank ever materialises the full model. The per-parameter layout work is all in
``mapping.py``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

import torch

from megatron_rlvr.models.hf_config import MegatronModelArgs
from megatron_rlvr.models.mapping import (
    ExpertLayout,
    TensorSlice,
    WeightMapping,
    fused_expert_name,
    fused_expert_reader,
    layer_offset,
    mapped_tensors,
    mtp_tensor_names,
    read_local_shard,
)

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"

log = logging.getLogger(__name__)


class HFCheckpointReader:
    """Lazy, sliceable access to an HF safetensors checkpoint folder: ``reader(name)`` returns a ``PySafeSlice``.

    Accepts a folder with ``model.safetensors`` or ``model.safetensors.index.json`` (sharded), or a path to a single
    ``.safetensors`` file. Use as a context manager (closes the file handles).
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, SAFE_INDEX)
            single = os.path.join(path, SAFE_SINGLE)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise ValueError(f"{index}: missing or empty 'weight_map'")
                self._file_of = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.isfile(single):
                self._file_of = None
                self._single = single
            else:
                raise ValueError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {path} (only safetensors checkpoints load)")
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            self._file_of = None
            self._single = path
        else:
            raise ValueError(f"HF checkpoint not found: {path}")
        self._handles: dict[str, object] = {}
        if self._file_of is None:
            self._file_of = {k: self._single for k in self._open(self._single).keys()}

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            if not os.path.isfile(file):
                raise ValueError(f"safetensors shard missing: {file}")
            self._handles[file] = safe_open(file, framework="pt", device="cpu")
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __call__(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not in the HF checkpoint")
        return self._open(self._file_of[name]).get_slice(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _reader_for(source):
    if isinstance(source, Mapping):  # in-memory HF state dict (tests, weight streams; transformers 5 fuses experts)
        return fused_expert_reader(lambda name: TensorSlice(source[name]), source.keys()), None
    reader = HFCheckpointReader(source)
    return fused_expert_reader(reader, reader.names()), reader


@torch.no_grad()
def load_hf_weights(model, args: MegatronModelArgs, source, *, pg_collection=None, strict: bool = True) -> list[str]:
    """Copy HF weights into this rank's (TP, PP) GPTModel; returns the HF names read.

    ``source``: HF folder / ``.safetensors`` file, or an in-memory ``{hf_name: tensor}`` dict.
    ``strict``: every HF tensor the model's dims imply must exist in the checkpoint (checked on every rank for the
    names it needs; a checkpoint with extra tensors, e.g. a tied ``lm_head.weight``, is fine).
    Routed experts: this rank's expert-parallel rank picks which experts it reads, its expert-TP rank which rows;
    per-expert names and transformers 5's fused ``experts.gate_up_proj`` / ``down_proj`` both load.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    tp_rank, tp_size = pg_collection.tp.rank(), pg_collection.tp.size()
    pp_rank = pg_collection.pp.rank()
    mapping = WeightMapping(args.dims)
    offset = layer_offset(args.config, pp_rank)
    experts = ExpertLayout.of(pg_collection)
    expert_offset = experts.expert_offset(args.dims)
    reader, closer = _reader_for(source)
    read: list[str] = []
    try:
        if strict and closer is not None:
            missing = sorted(_missing(mapping.hf_names(), closer.names()))
            if missing:
                raise ValueError(f"HF checkpoint {source} lacks {len(missing)} tensors, e.g. {missing[:5]}")
        if closer is not None:
            _note_mtp(closer.names(), args, source)
        for name, param in mapped_tensors(model):
            p = mapping.resolve(name, layer_offset=offset, expert_offset=expert_offset)
            rank, size = (experts.etp_rank, experts.etp_size) if p.per_expert else (tp_rank, tp_size)
            shard = read_local_shard(p, reader, rank, size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: shard from HF {p.hf_names} has shape {tuple(shard.shape)}, parameter has "
                    f"{tuple(param.shape)} ({'expert ' if p.per_expert else ''}TP rank {rank}/{size})"
                )
            param.copy_(shard.to(param.dtype))
            read.extend(p.hf_names)
    finally:
        if closer is not None:
            closer.close()
    return read


def _note_mtp(names, args: MegatronModelArgs, source) -> None:
    """One line (first rank) when the checkpoint carries multi-token-prediction layers: the causal LM does not use
    them, so they are not loaded (and an export does not write them)."""
    mtp = mtp_tensor_names(names, args.dims.num_layers)
    if mtp and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        n = len({name.split(".")[2] for name in mtp})
        log.warning(
            "%s: skipping %d tensors of %d multi-token-prediction layer(s) (model.layers.%d.*): the policy is the "
            "causal LM only",
            source,
            len(mtp),
            n,
            args.dims.num_layers,
        )


def _missing(needed, present) -> set[str]:
    """Needed HF names absent from a checkpoint; per-expert names count as present when the fused tensors are."""
    present = set(present)
    out = set()
    for name in needed:
        if name in present:
            continue
        oss = fused_expert_name(name)  # GPT-OSS: the fused tensor, or its MXFP4 blocks and scales
        if oss is not None and (oss[0] in present or {oss[0] + "_blocks", oss[0] + "_scales"} <= present):
            continue
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:
            proj = tail.split(".")[1] if "." in tail else ""
            fused = f"{head}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            if fused in present:
                continue
        out.add(name)
    return out
