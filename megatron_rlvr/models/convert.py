"""Checkpoint conversion: megatron training checkpoint (any TP/PP) -> HF folder, and HF folder -> megatron checkpoint
at a chosen TP/PP. ``convert_main(argv)`` is the CLI (``megatron-rlvr convert`` / ``tools/convert_checkpoint.py``).

Conversion runs on CPU with gloo: ``tp * pp`` local ranks are started (the per-rank work is the public
``to_hf_on_rank`` / ``to_megatron_on_rank``, which any already-initialised megatron job can also call). Each rank
holds only its own shard of the model.

    megatron-rlvr convert to-hf --ckpt RUN/step_000000100 --out HF_OUT [--source-hf HF_IN] [--tp 1 --pp 1]
    megatron-rlvr convert to-megatron --hf HF_IN --out RUN_DIR --tp 2 --pp 2 [--step 0]
"""

from __future__ import annotations

import argparse
import os
import re

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_hf_on_rank(
    ckpt_dir: str,
    out_dir: str,
    source_hf: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> str:
    """On every rank of an initialised (TP, PP) megatron job: load the checkpoint's model and export it to HF."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.checkpointing import checkpoint_model_args, load_checkpoint, read_meta
    from megatron_rlvr.models.export import export_hf

    ckpt_dir = resolve_checkpoint(ckpt_dir)
    meta = read_meta(ckpt_dir)
    args = checkpoint_model_args(
        ckpt_dir,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        perform_initialization=False,
    )
    model = build_gpt_model(args)
    load_checkpoint(ckpt_dir, model=model, load_rng=False)
    if source_hf is None:
        source_hf = meta.get("hf_config", {}).get("_name_or_path") or None
        if source_hf and not os.path.isdir(source_hf):
            source_hf = None
    out = export_hf(
        model, args, out_dir, source_dir=source_hf, dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite
    )
    if source_hf is None and torch.distributed.get_rank() == 0 and is_tiny_config(meta.get("hf_config", {})):
        from megatron_rlvr.models.tiny import save_tiny_tokenizer

        save_tiny_tokenizer(out)  # the built-in tiny tokenizer has no source folder to copy from
    return out


def is_tiny_config(hf_config: dict) -> bool:
    """The checkpoint is of the built-in ``tiny`` model (megatron_rlvr/models/tiny.py)."""
    from megatron_rlvr.models.tiny import tiny_hf_config

    ref = tiny_hf_config()
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    return all(hf_config.get(k) == ref[k] for k in keys)


def resolve_checkpoint(path: str) -> str:
    """``--ckpt``: a step_N folder, a checkpoints folder (its newest), or a run directory (its checkpoints/)."""
    from megatron_rlvr.models.checkpointing import latest_checkpoint

    if os.path.isfile(os.path.join(path, "rlvr_meta.json")):
        return path
    found = latest_checkpoint(path) or latest_checkpoint(os.path.join(path, "checkpoints"))
    if found is None:
        raise ValueError(
            f"--ckpt {path}: no complete megatron-rlvr checkpoint there (a step_N folder with rlvr_meta.json, a "
            "checkpoints folder, or a run directory with checkpoints/)"
        )
    return found


def to_megatron_on_rank(hf_dir: str, save_dir: str, step: int = 0, dtype: str | None = None) -> str:
    """On every rank of an initialised (TP, PP) megatron job: load the HF folder (sliced) and save a model-only
    training checkpoint ``save_dir/step_<step>`` at this layout."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.checkpointing import CheckpointConfig, save_checkpoint
    from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    hf_cfg = load_hf_config(hf_dir)
    if not hf_cfg.get("_name_or_path"):
        hf_cfg["_name_or_path"] = os.path.abspath(hf_dir)  # lets to-hf find the tokenizer again
    name = dtype or hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32"
    if str(name) not in _DTYPES:
        raise ValueError(f"--dtype {name!r}: choose one of {sorted(_DTYPES)}")
    args = megatron_model_args(
        hf_cfg,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dtype=_DTYPES[str(name)],
        perform_initialization=False,
    )
    model = build_gpt_model(args)
    load_hf_weights(model, args, hf_dir)
    return save_checkpoint(
        CheckpointConfig(save_dir, keep_last=0),
        step,
        model=model,
        trainer_state={"step": step, "converted_from": os.path.abspath(hf_dir)},
        model_args=args,
    )


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
    h.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the source config's dtype")
    h.add_argument("--max-shard-size", type=_size, default=5 * 10**9, help="per safetensors file (default 5GB)")
    h.add_argument("--overwrite", action="store_true", help="replace an HF checkpoint already in --out")
    m = sub.add_parser("to-megatron", help="HF folder -> megatron checkpoint at a chosen layout")
    m.add_argument("--hf", required=True, help="HF folder with safetensors weights")
    m.add_argument("--out", required=True, help="run folder; the checkpoint goes to OUT/step_<step>")
    m.add_argument("--step", type=int, default=0)
    m.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the HF config's dtype")
    for q in (h, m):
        q.add_argument("--tp", type=int, default=1, help="tensor parallel size of the conversion job")
        q.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the conversion job")
        q.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds")
    return p


def _validate_layout(args, cfg_source) -> None:
    """Fail before starting ranks: the layout must divide the model (same ValueErrors as the model build)."""
    from megatron_rlvr.models.checkpointing import checkpoint_model_args
    from megatron_rlvr.models.hf_config import megatron_model_args

    if args.tp < 1 or args.pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got {args.tp}, {args.pp}")
    if args.direction == "to-hf":
        from megatron_rlvr.models.checkpointing import checkpoint_problem
        from megatron_rlvr.models.export import SAFE_INDEX, SAFE_SINGLE

        ckpt = resolve_checkpoint(cfg_source)
        problem = checkpoint_problem(ckpt)
        if problem is not None:
            raise ValueError(f"--ckpt {ckpt} is corrupt or incomplete ({problem}); pass an older step_N folder")
        existing = [n for n in (SAFE_SINGLE, SAFE_INDEX) if os.path.isfile(os.path.join(args.out, n))]
        if existing and not args.overwrite:
            raise ValueError(
                f"--out {args.out} already holds an HF checkpoint ({existing[0]}); pass --overwrite to replace it, or "
                "choose another --out"
            )
        checkpoint_model_args(ckpt, tp_size=args.tp, pp_size=args.pp)
    else:
        if not os.path.isfile(os.path.join(cfg_source, "config.json")):
            raise ValueError(f"--hf {cfg_source}: not an HF model folder (no config.json)")
        megatron_model_args(cfg_source, tp_size=args.tp, pp_size=args.pp)


def convert_main(argv: list[str] | None = None) -> int:
    """CLI entry point. Returns 0 on success; errors are raised (ValueError for bad input)."""
    args = build_parser().parse_args(argv)
    _validate_layout(args, args.ckpt if args.direction == "to-hf" else args.hf)
    from megatron_rlvr.testing.distributed import run_distributed

    world = args.tp * args.pp
    if args.direction == "to-hf":
        fn, fn_args = (
            to_hf_on_rank,
            (args.ckpt, args.out, args.source_hf, args.dtype, args.max_shard_size, args.overwrite),
        )
    else:
        fn, fn_args = to_megatron_on_rank, (args.hf, args.out, args.step, args.dtype)
    # Conversion is CPU work over gloo: hide GPUs from the ranks (they inherit the environment when the harness'
    # forkserver starts, which is the first time this process starts ranks).
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        out = run_distributed(fn, world, tp=args.tp, pp=args.pp, args=fn_args, timeout=args.timeout)
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    print(out[0])
    return 0
