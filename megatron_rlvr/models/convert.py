"""Checkpoint conversion, the per-rank work: megatron training checkpoint (any TP/PP) -> HF folder
(``to_hf_on_rank``), HF folder -> megatron checkpoint at the job's TP/PP (``to_megatron_on_rank``). Any initialised
megatron job can call them; ``megatron-rlvr convert`` (megatron_rlvr.commands.convert_cli) starts such a job. Each rank
holds only its own shard of the model."""

from __future__ import annotations

import os

import torch

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.families.table import routed_experts
from megatron_rlvr.families.tiny import TINY_MODELS, tiny_hf_config, tiny_tokenizer_for
from megatron_rlvr.models.build import build_gpt_model
from megatron_rlvr.models.checkpointing import (
    CheckpointConfig,
    checkpoint_model_args,
    checkpoint_problem,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    step_dir_name,
)
from megatron_rlvr.models.export import export_hf
from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
from megatron_rlvr.models.hf_loading import SAFE_INDEX, SAFE_SINGLE, load_hf_weights
from megatron_rlvr.models.lora import attach_lora, export_peft

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = sorted(_DTYPES)
"""The ``--dtype`` choices."""


def to_hf_on_rank(
    ckpt_dir: str,
    out_dir: str,
    source_hf: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    base_weights=None,
    adapter_out: str | None = None,
) -> str:
    """On every rank of an initialised (TP, PP) megatron job: load the checkpoint's model and export it to HF.

    A LoRA checkpoint holds the adapters only: the frozen base comes from ``base_weights`` (an HF folder or state
    dict; default: the folder the checkpoint names), the export is the merged model, and ``adapter_out`` also gets
    the adapters as a PEFT folder."""
    from megatron.core import parallel_state as ps

    ckpt_dir = resolve_checkpoint(ckpt_dir)
    meta = read_meta(ckpt_dir)
    args = checkpoint_model_args(
        ckpt_dir,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        perform_initialization=False,
        **expert_layout_kwargs(meta["hf_config"]),
    )
    model = build_gpt_model(args)
    if meta.get("lora"):
        _attach_checkpoint_lora(model, args, meta, base_weights)
    elif adapter_out:
        raise ValueError(f"--adapter-out: {ckpt_dir} is not a LoRA checkpoint (no adapters to export)")
    load_checkpoint(ckpt_dir, model=model, load_rng=False)
    if source_hf is None:
        source_hf = meta.get("hf_config", {}).get("_name_or_path") or None
        if source_hf and not os.path.isdir(source_hf):
            source_hf = None
    out = export_hf(
        model, args, out_dir, source_dir=source_hf, dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite
    )
    if adapter_out:
        export_peft(model, adapter_out, base_model=meta.get("lora_base"))
    if source_hf is None and torch.distributed.get_rank() == 0 and is_tiny_config(meta.get("hf_config", {})):
        # the built-in tiny tokenizer has no source folder to copy from
        tiny_tokenizer_for(meta["hf_config"]).save_pretrained(out)
    return out


def expert_layout_kwargs(hf_config: dict) -> dict:
    """The job's expert-parallel and expert-TP sizes as model-args keywords (nothing for a dense model)."""
    from megatron.core import parallel_state as ps

    if not routed_experts(hf_config):
        return {}
    return {
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
    }


def _attach_checkpoint_lora(model, args, meta: dict, base_weights) -> None:
    base = base_weights if base_weights is not None else meta.get("lora_base")
    if base is None:
        raise ValueError(
            "this LoRA checkpoint's base model was a random init: pass its weights (convert does this for you)"
        )
    if isinstance(base, str) and not os.path.isdir(base):
        raise ValueError(f"the LoRA checkpoint's base model {base} is not a folder here: pass --base-hf")
    load_hf_weights(model, args, base)
    cfg = LoRAConfig(**meta["lora"])
    attach_lora(model, cfg, args, seed=meta.get("lora_base_seed", 0), base=meta.get("lora_base"))


def is_tiny_config(hf_config: dict) -> bool:
    """The checkpoint is of a built-in model over the character tokenizer (``tiny``, ``tiny_moe``:
    megatron_rlvr/families/tiny.py)."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    refs = [tiny_hf_config(name=name) for name in TINY_MODELS]
    return any(all(hf_config.get(k) == ref[k] for k in keys) for ref in refs)


def resolve_checkpoint(path: str) -> str:
    """``--ckpt``: a step_N folder, a checkpoints folder (its newest), or a run directory (its checkpoints/)."""
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
        **expert_layout_kwargs(hf_cfg),
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


def validate_layout(args, cfg_source) -> None:
    """Fail before starting ranks: the layout must divide the model (same ValueErrors as the model build)."""
    if args.tp < 1 or args.pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got {args.tp}, {args.pp}")
    if args.direction == "to-hf":
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
        meta_cfg = checkpoint_model_args(ckpt, tp_size=args.tp, pp_size=args.pp, **_cli_experts(args)).hf_config
    else:
        if not os.path.isfile(os.path.join(cfg_source, "config.json")):
            raise ValueError(f"--hf {cfg_source}: not an HF model folder (no config.json)")
        target = os.path.join(args.out, step_dir_name(args.step))
        if os.path.exists(target) and not args.overwrite:
            raise ValueError(
                f"--out {args.out} already holds step {args.step} ({target}); pass --overwrite to replace it, or "
                "choose another --out or --step"
            )
        meta_cfg = megatron_model_args(cfg_source, tp_size=args.tp, pp_size=args.pp, **_cli_experts(args)).hf_config
    if (args.ep > 1 or (args.etp or 1) > 1) and not routed_experts(meta_cfg):
        raise ValueError("--ep / --etp > 1 need a mixture-of-experts model")


def _cli_experts(args) -> dict:
    return {"ep_size": args.ep, "etp_size": args.etp}


def conversion_world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """Ranks of a conversion job: the smallest world that both the dense grid (tp x dp x pp) and megatron's expert
    grid (etp x ep x expert-dp x pp) divide."""
    import math

    etp = tp if etp is None else etp
    return math.lcm(tp, etp * ep) * pp
