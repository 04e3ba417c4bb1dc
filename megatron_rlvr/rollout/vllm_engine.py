"""vLLM rollout engine, colocated with the Megatron trainer in the same processes (SPMD, no Ray). GPU only.

Written against vllm==0.33.0 (the ``gpu`` extra pins it); the APIs used, all read from that release's source:

- ``LLM(..., distributed_executor_backend="external_launcher", tensor_parallel_size=rollout_tp)``: every rank of the
  already initialised torch.distributed world runs one engine; vLLM builds its own TP groups of consecutive ranks
  on that world (``vllm/v1/executor/uniproc_executor.py: ExecutorWithExternalLauncher``), so the rollout TP is
  independent of the trainer's TP and only has to divide the world size. Ranks of one rollout TP group must submit
  identical requests (``megatron_rlvr.rollout.dataflow`` splits prompts by rollout data-parallel rank). Without an
  initialised world the in-process ``uni`` executor is used (single GPU).
  External launcher forces ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, so
  ``LLM.apply_model(fn)`` calls ``fn(model)`` directly, with no pickling.
- ``load_format="dummy"``: the engine starts from random weights; real weights always arrive through
  ``update_weights``, bucket by bucket, through the model's own ``load_weights`` (it maps HF names to vLLM's fused
  ``qkv_proj`` / ``gate_up_proj`` and slices each full tensor to this rank's rollout-TP shard), so no full state
  dict is ever materialised. ``reset_prefix_cache()`` follows every update: cached KV blocks were computed with the
  old weights.
- ``enable_sleep_mode=True``: ``sleep(level)`` frees GPU memory while the trainer runs (level 1 offloads weights to
  host memory, level 2 discards them); ``wake_up(tags=["weights"])`` then ``update_weights`` then
  ``wake_up(tags=["kv_cache"])`` keeps the weight-sync peak low.
- ``logprobs_mode="processed_logprobs"`` with ``SamplingParams(logprobs=0)``: the sampled token's log-prob after
  temperature scaling (``vllm/v1/sample/sampler.py``), which is the project's convention (see ``engine.py``) as long
  as top-k / top-p are off; with them on, vLLM renormalises over the kept tokens, so such requests are refused
  unless ``VLLMEngineConfig.allow_filtered_logprobs``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_rlvr.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    prompt_keys_or_default,
    sample_seed,
    validate_prompts,
)

VLLM_VERSION = "0.33.0"
"""The vLLM release this engine was written and checked against (pyproject's ``gpu`` extra)."""


@dataclass
class VLLMEngineConfig:
    """Settings of the colocated vLLM engine."""

    tensor_parallel_size: int = 1
    """Rollout TP size (independent of the trainer's TP); must divide the world size."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use for weights + KV cache (the trainer shares the GPU)."""
    dtype: str = "bfloat16"
    """Weight / activation dtype of the engine."""
    max_model_len: int | None = None
    """Longest prompt + completion; None: the model config's max_position_embeddings."""
    max_num_seqs: int = 256
    """Most sequences decoded concurrently."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    enable_prefix_caching: bool = True
    """Share KV blocks of common prompt prefixes (GRPO's n samples per prompt); reset after every weight update."""
    seed: int = 0
    """Engine seed; also the base of per-call seeds when a request has none (identical on all ranks)."""
    bucket_bytes: int = 512 << 20
    """Loose (name, tensor) pairs are grouped into buckets of at most this many bytes per ``load_weights`` call."""
    allow_filtered_logprobs: bool = False
    """Allow top-k / top-p requests although vLLM then reports log-probs renormalised over the kept tokens."""
    extra_llm_kwargs: dict = field(default_factory=dict)
    """Passed verbatim to ``vllm.LLM`` (e.g. ``attention_config``)."""

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VLLMEngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"VLLMEngineConfig.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"VLLMEngineConfig.bucket_bytes must be positive, got {self.bucket_bytes!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"VLLMEngineConfig.max_num_seqs must be positive, got {self.max_num_seqs!r}")


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


def _write_model_dir(hf_config) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """vLLM needs a model folder with config.json; weights are not read (load_format='dummy')."""
    if isinstance(hf_config, (str, os.PathLike)) and os.path.isdir(hf_config):
        return os.fspath(hf_config), None
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    if not cfg.get("architectures"):
        raise ValueError("hf_config needs 'architectures' (e.g. ['Qwen2ForCausalLM']) so vLLM can pick the model")
    tmp = tempfile.TemporaryDirectory(prefix="rlvr-vllm-model-")
    with open(os.path.join(tmp.name, "config.json"), "w") as f:
        json.dump(cfg, f)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    with open(os.path.join(tmp.name, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return tmp.name, tmp


class VLLMRolloutEngine(RolloutEngine):
    """The RolloutEngine interface on vLLM (see the module docstring for the vLLM APIs used).

    ``hf_config``: HF config (PretrainedConfig, dict, or a model folder). ``tokenizer``: a tokenizer folder/name for
    stop strings and text (None: token ids only, stop strings refused).
    """

    def __init__(self, hf_config, tokenizer: str | None = None, *, config: VLLMEngineConfig | None = None):
        import torch.distributed as dist

        self.config = cfg = config or VLLMEngineConfig()
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if world % cfg.tensor_parallel_size:
            raise ValueError(
                f"VLLMEngineConfig.tensor_parallel_size={cfg.tensor_parallel_size} does not divide world size {world}"
            )
        if not distributed and cfg.tensor_parallel_size > 1:
            raise ValueError("rollout tensor_parallel_size > 1 needs an initialised torch.distributed world")
        # in-process engine core: apply_model runs our closures directly (external_launcher forces it as well)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self._model_dir, self._tmp = _write_model_dir(hf_config)
        self.tokenizer = tokenizer
        self.llm = LLM(
            model=self._model_dir,
            tokenizer=tokenizer,
            skip_tokenizer_init=tokenizer is None,
            tensor_parallel_size=cfg.tensor_parallel_size,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            enable_sleep_mode=True,
            load_format="dummy",
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            **cfg.extra_llm_kwargs,
        )
        hf = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(hf.vocab_size)
        self._param_names = set(self.llm.apply_model(lambda m: [n for n, _ in m.named_parameters()])[0])
        self._calls = 0
        self._asleep: set[str] = set()
        self._closed = False

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
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=self.tokenizer is not None,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, prompt_keys: Sequence[int] | None = None
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
        keys = prompt_keys_or_default(prompt_keys, len(prompts))
        # A seed for every request keeps the ranks of one rollout TP group sampling identically; without one, the
        # per-call counter (the same on every rank) stands in.
        base = params.seed if params.seed is not None else sample_seed(self.config.seed, 1 << 20, self._calls)
        self._calls += 1
        from vllm.inputs import TokensPrompt

        # one seed per prompt (vLLM gives child sample j the seed + j); random 61-bit seeds do not collide in practice
        vparams = [self._vllm_params(params, sample_seed(base, k, 0) >> 2) for k in keys]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], vparams, use_tqdm=False)
        return [self._convert(p, o, self.tokenizer is not None) for p, o in zip(prompts, outs)]

    @staticmethod
    def _convert(prompt: list[int], out, has_text: bool) -> RolloutOutput:
        comps = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample with reason {c.finish_reason!r} (aborted?)")
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no sampled-token log-probs (SamplingParams.logprobs=0 was ignored?)")
            lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
            comps.append(Completion(ids, lps, c.finish_reason, c.stop_reason, c.text if has_text else None))
        return RolloutOutput(prompt_token_ids=list(prompt), completions=comps)

    # -- weights ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: Iterable, strict: bool = True) -> int:
        """Load HF-named full tensors (pairs or buckets) through the model's ``load_weights``, one bucket per call.
        With ``strict`` every vLLM parameter must have been written. Resets the prefix cache."""
        self._check_open()
        if "weights" in self._asleep:
            raise RuntimeError("update_weights while the weights sleep: call wake_up(tags=['weights']) first")
        loaded: set[str] = set()
        count = 0
        for bucket in as_buckets(weights, self.config.bucket_bytes):
            count += len(bucket)
            (names,) = self.llm.apply_model(lambda model, b=bucket: model.load_weights(b))
            loaded |= set(names or ())
            del bucket  # before the stream assembles the next one
        self.llm.reset_prefix_cache()
        if strict:
            missing = sorted(self._param_names - loaded)
            if missing:
                raise ValueError(f"update_weights: {len(missing)} vLLM parameters were not written, e.g. {missing[:5]}")
        return count

    # -- memory ----------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """Level 1: weights to host memory, KV cache dropped; level 2: both dropped (the next update_weights must
        bring every weight, which is what RL does after each step)."""
        self._check_open()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._asleep:
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
        if self._closed:
            return
        self._closed = True
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            if self._tmp is not None:
                self._tmp.cleanup()
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the engine is closed")
