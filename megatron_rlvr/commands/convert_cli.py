"""``megatron-rlvr convert``: megatron training checkpoint (any TP/PP) -> HF folder, and HF folder -> megatron
checkpoint at a chosen TP/PP.

Conversion runs on CPU with gloo: the command validates its arguments, then starts ``tp * pp`` local ranks the way
``train`` does (``megatron_rlvr.rundir.local_ranks``); each rank runs this same command, joins the process group and
does its share (``megatron_rlvr.models.convert``: each rank holds only its own shard of the model).

    megatron-rlvr convert to-hf --ckpt RUN/step_000000100 --out HF_OUT [--source-hf HF_IN] [--tp 1 --pp 1]
        [--adapter-out PEFT_OUT] [--base-hf HF_BASE]    (LoRA checkpoints: merged model, and the PEFT adapters)
    megatron-rlvr convert to-megatron --hf HF_IN --out RUN_DIR --tp 2 --pp 2 [--step 0] [--overwrite]
"""

from __future__ import annotations

import argparse
import re

from megatron_rlvr.megatron.parallel import env_rank_info, init_distributed
from megatron_rlvr.megatron.policy import random_hf_state_dict
from megatron_rlvr.models.checkpointing import read_meta
from megatron_rlvr.models.convert import (
    DTYPE_NAMES,
    conversion_world_size,
    resolve_checkpoint,
    to_hf_on_rank,
    to_megatron_on_rank,
    validate_layout,
)
from megatron_rlvr.rundir.local_ranks import launch_local


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use e.g. 5GB, 500MB, 1000000")
    mult = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[m.group(2)]
    return int(float(m.group(1)) * mult)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rlvr convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    h = sub.add_parser("to-hf", help="megatron training checkpoint -> HF folder")
    h.add_argument("--ckpt", required=True, help="a step_N checkpoint folder, or a run folder (its newest)")
    h.add_argument("--out", required=True, help="HF output folder")
    h.add_argument("--source-hf", default=None, help="original HF folder (tokenizer, generation_config)")
    h.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: the source config's dtype")
    h.add_argument("--max-shard-size", type=_size, default=5 * 10**9, help="per safetensors file (default 5GB)")
    h.add_argument("--overwrite", action="store_true", help="replace an HF checkpoint already in --out")
    h.add_argument("--base-hf", default=None, help="LoRA checkpoints: the base model's HF folder (default: recorded)")
    h.add_argument("--adapter-out", default=None, help="LoRA checkpoints: also write the adapters as a PEFT folder")
    m = sub.add_parser("to-megatron", help="HF folder -> megatron checkpoint at a chosen layout")
    m.add_argument("--hf", required=True, help="HF folder with safetensors weights")
    m.add_argument("--out", required=True, help="run folder; the checkpoint goes to OUT/step_<step>")
    m.add_argument("--step", type=int, default=0)
    m.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: the HF config's dtype")
    m.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at OUT/step_<step>")
    for q in (h, m):
        q.add_argument("--tp", type=int, default=1, help="tensor parallel size of the conversion job")
        q.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the conversion job")
        q.add_argument("--ep", type=int, default=1, help="expert parallel size (mixture-of-experts models)")
        q.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        q.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds")
    return p


def convert_main(argv: list[str] | None = None) -> int:
    """The command: validate, then start the ranks (or, inside a rank, do this rank's share). Returns the exit code;
    bad input raises ValueError."""

    argv = list(argv or [])
    args = build_parser().parse_args(argv)
    if env_rank_info() is not None:
        return _convert_as_rank(args)
    validate_layout(args, args.ckpt if args.direction == "to-hf" else args.hf)

    # Conversion is CPU work over gloo: the ranks see no GPU.
    return launch_local(
        ["convert", *argv],
        conversion_world_size(args.tp, args.pp, args.ep, args.etp),
        master_addr="127.0.0.1",
        master_port=0,
        threads=1,
        extra_env={"CUDA_VISIBLE_DEVICES": ""},
        timeout_s=args.timeout,
    )


def _convert_as_rank(args) -> int:
    import torch

    init_distributed(args.tp, args.pp, seed=1234, backend="gloo", timeout_s=args.timeout, ep=args.ep, etp=args.etp)
    try:
        if args.direction == "to-hf":
            out = to_hf_on_rank(
                args.ckpt,
                args.out,
                args.source_hf,
                args.dtype,
                args.max_shard_size,
                args.overwrite,
                base_weights=_lora_base(args),
                adapter_out=args.adapter_out,
            )
        else:
            out = to_megatron_on_rank(args.hf, args.out, args.step, args.dtype)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print(out, flush=True)
    finally:
        torch.distributed.destroy_process_group()
    return 0


def _lora_base(args):
    """The frozen base of a LoRA checkpoint: --base-hf, else the folder it records, else (a random init, e.g. the
    tiny model) the same init rebuilt from its HF config and seed."""

    meta = read_meta(resolve_checkpoint(args.ckpt))
    if not meta.get("lora") or args.base_hf or meta.get("lora_base"):
        return args.base_hf

    return random_hf_state_dict(meta["hf_config"], meta.get("lora_base_seed", 0))
