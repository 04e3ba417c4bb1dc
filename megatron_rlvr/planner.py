"""Layout planner: validates a TP/PP/rollout-TP layout and estimates per-GPU memory before a job is submitted.

Pure Python (no torch, no Megatron import), so it runs on a login node in well under a second.

    megatron-rlvr plan CONFIG [--gpus-per-node 8] [--gpu-mem-gb 80] [--nodes N] [--search] [key=value ...]

CONFIG is one of
  * a built-in model name (``qwen2.5-14b``, ``Qwen/Qwen2.5-14B-Instruct``, ... see ``BUILTIN_SPECS``),
  * an HF ``config.json`` (or a folder holding one),
  * a run-config YAML. Keys read by the planner (all optional except ``model``; other keys and sections are
    ignored here and validated by the trainer's config):

        model:
          name: qwen2.5-14b          # a built-in spec, or
          hf_config: /path/to/config.json_or_folder
          spec: {hidden: 64, ffn: 256, layers: 2, heads: 4, kv_heads: 2, vocab: 1024}   # or an inline ModelSpec
        parallel:   tp, pp, rollout_tp, sequence_parallel, distributed_optimizer   (ParallelConfig)
        rollout:    max_prompt_len, max_response_len, gpu_memory_utilization, sleep_level,
                    overhead_gb, sleep_residual_gb                                  (RolloutConfig)
        train:      micro_batch_tokens, recompute, logits_chunk, ref_model, offload_during_rollout,
                    overhead_gb                                                     (TrainConfig)
        cluster:    nodes, gpus_per_node, gpu_mem_gb, usable_fraction               (ClusterConfig; the CLI wins)

``key=value`` arguments override any of these (``parallel.tp=8``). Exit status: 0 the layout fits, 1 it is
invalid or does not fit (the reasons are printed), 2 bad input (unreadable config, unknown model, bad value).

Memory model (per GPU, bytes; GiB = 2**30). Every term is a formula of the config, stated where it is computed:
  * weights bf16 2 B/param, main grads fp32 4 B/param, fp32 master weights + Adam m, v 12 B/param divided by DP
    when the distributed optimizer is on: "bf16 parameters, fp32 gradients: 6 + 12/d bytes per parameter"
    (Megatron-Core developer guide, "Distributed Optimizer").
  * activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4,
    re-derived for SwiGLU + GQA + flash attention (no s^2 score term, no dropout masks): see
    ``activation_bytes_per_layer``. 1F1B pipelining keeps ``pp - stage`` micro-batches in flight (Sec. 4.2.3).
  * logits: the output layer materialises [T, V/tp] bf16 logits (and their grad); the vocab-parallel ops then
    work on fp32 chunks of ``logits_chunk`` tokens.
  * colocated vLLM: the engine claims ``gpu_memory_utilization`` x GPU while rolling out (weights at rollout TP,
    a fixed overhead for activations / CUDA graphs, the rest is KV cache); during training it sleeps (level 1
    offloads weights to host RAM, level 2 discards them; both discard the KV cache), keeping only
    ``sleep_residual_gb``. Peak = max(training phase, rollout phase).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3
MEGATRON_VOCAB_DIVISIBLE_BY = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``; the padded vocab is a multiple of this times TP."""


class LayoutError(ValueError):
    """The requested parallel layout cannot run (a size does not divide, an axis is too large)."""


# ----------------------------------------------------------------------------------------------------------------
# Model specs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 family: RMSNorm, RoPE, GQA, SwiGLU)."""

    name: str
    """Display name."""
    hidden: int
    """Model width h (HF ``hidden_size``)."""
    ffn: int
    """MLP inner width f (HF ``intermediate_size``)."""
    layers: int
    """Number of transformer layers L (HF ``num_hidden_layers``)."""
    heads: int
    """Number of attention (query) heads a (HF ``num_attention_heads``)."""
    kv_heads: int
    """Number of key/value heads, i.e. GQA query groups (HF ``num_key_value_heads``)."""
    vocab: int
    """Vocabulary size V of the checkpoint, before Megatron's padding (HF ``vocab_size``)."""
    head_dim: int = 0
    """Per-head width d (HF ``head_dim``); 0 means hidden // heads."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one matrix (HF ``tie_word_embeddings``)."""
    qkv_bias: bool = False
    """Q, K and V projections carry a bias (always on for Qwen2/2.5; HF ``attention_bias`` for Llama/Qwen3)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys, one weight of size d each (Qwen3)."""
    gated_mlp: bool = True
    """SwiGLU MLP (gate, up, down: 3 matrices). False: a 2-matrix MLP (GeLU)."""

    def __post_init__(self):
        for f in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model spec {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"model spec {self.name!r}: hidden ({self.hidden}) is not divisible by heads ({self.heads}); "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.head_dim < 0:
            raise ValueError(f"model spec {self.name!r}: head_dim must be positive, got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model spec {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )

    @property
    def q_dim(self) -> int:
        """Width of all query heads, a * d (equals hidden for every built-in model)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads, kv_heads * d."""
        return self.kv_heads * self.head_dim

    def layer_params(self) -> dict[str, int]:
        """Parameters of ONE transformer layer, split into TP-sharded matrices/biases and replicated norms."""
        h, f = self.hidden, self.ffn
        qkv_w = h * (self.q_dim + 2 * self.kv_dim)
        qkv_b = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        out_w = self.q_dim * h
        mlp_w = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return {"qkv_w": qkv_w, "qkv_b": qkv_b, "out_w": out_w, "mlp_w": mlp_w, "norms": norms}

    def param_count(self) -> int:
        """Total parameters of the HF checkpoint (unpadded vocab), embeddings + L layers + final norm + LM head."""
        emb = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else emb
        return emb + self.layers * sum(self.layer_params().values()) + self.hidden + head

    def padded_vocab(self, tp: int, divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY) -> int:
        """Megatron pads V up to a multiple of divisible_by * TP so every TP rank holds an equal, aligned shard."""
        m = divisible_by * tp
        return -(-self.vocab // m) * m


def _spec(**kw) -> ModelSpec:
    return ModelSpec(**kw)


# Values from the official HF config.json of each model (Qwen/..., meta-llama/... on huggingface.co).
# Qwen2 attention always has q/k/v biases (modeling_qwen2 builds them with bias=True); Llama and Qwen3 follow
# "attention_bias": false. Qwen3 adds q_norm/k_norm (RMSNorm of size head_dim) in every layer.
BUILTIN_SPECS: dict[str, ModelSpec] = {
    # Qwen/Qwen2.5-7B: hidden_size 3584, intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
    # num_key_value_heads 4, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-7b": _spec(
        name="Qwen2.5-7B", hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4, vocab=152064, qkv_bias=True
    ),
    # Qwen/Qwen2.5-14B: hidden_size 5120, intermediate_size 13824, num_hidden_layers 48, num_attention_heads 40,
    # num_key_value_heads 8, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-14b": _spec(
        name="Qwen2.5-14B", hidden=5120, ffn=13824, layers=48, heads=40, kv_heads=8, vocab=152064, qkv_bias=True
    ),
    # Qwen/Qwen2.5-32B: hidden_size 5120, intermediate_size 27648, num_hidden_layers 64, num_attention_heads 40,
    # num_key_value_heads 8, vocab_size 152064, tie_word_embeddings false.
    "qwen2.5-32b": _spec(
        name="Qwen2.5-32B", hidden=5120, ffn=27648, layers=64, heads=40, kv_heads=8, vocab=152064, qkv_bias=True
    ),
    # meta-llama/Llama-3.1-8B: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, vocab_size 128256, attention_bias false, tie false.
    "llama-3.1-8b": _spec(name="Llama-3.1-8B", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    # meta-llama/Llama-3.1-70B: hidden_size 8192, intermediate_size 28672, num_hidden_layers 80,
    # num_attention_heads 64, num_key_value_heads 8, vocab_size 128256, attention_bias false, tie false.
    "llama-3.1-70b": _spec(name="Llama-3.1-70B", hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    # Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, attention_bias false, tie_word_embeddings false.
    "qwen3-8b": _spec(
        name="Qwen3-8B",
        hidden=4096,
        ffn=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    ),
}


def _spec_key(name: str) -> str:
    key = name.strip().lower().split("/")[-1]
    for suffix in ("-instruct", "-base"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    return key.replace("meta-llama-", "llama-")


def get_model_spec(name: str) -> ModelSpec:
    """Built-in spec by name; accepts HF ids and -Instruct variants (same architecture)."""
    key = _spec_key(name)
    if key not in BUILTIN_SPECS:
        raise ValueError(f"unknown model {name!r}; built-in specs: {', '.join(sorted(BUILTIN_SPECS))}")
    return BUILTIN_SPECS[key]


_HF_SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


def model_spec_from_hf_config(source: str | Path | dict, name: str | None = None) -> ModelSpec:
    """ModelSpec from an HF config.json (path, folder holding one, or the parsed dict)."""
    where = "config dict"
    if not isinstance(source, dict):
        p = Path(source)
        if p.is_dir():
            p = p / "config.json"
        where = str(p)
        try:
            source = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"HF config not found: {p}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from None
    cfg = source
    mtype = cfg.get("model_type")
    if mtype not in _HF_SUPPORTED:
        raise ValueError(
            f"{where}: model_type {mtype!r} is not supported by the planner (dense decoder-only: "
            f"{', '.join(sorted(_HF_SUPPORTED))})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r}; only SwiGLU (silu) MLPs are supported")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or Path(where).parent.name or mtype,
        hidden=cfg["hidden_size"],
        ffn=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or 0,
        # transformers' Llama/Qwen2/Qwen3/Mistral config classes default tie_word_embeddings to False.
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if mtype == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=mtype == "qwen3",
    )


# ----------------------------------------------------------------------------------------------------------------
# Run-config sections the planner reads
# ----------------------------------------------------------------------------------------------------------------


def _check_pos_int(section: str, obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{section}.{n} must be a positive integer, got {v!r}")


def _check_nonneg(section: str, obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{section}.{n} must be a non-negative number, got {v!r}")


@dataclass
class ParallelConfig:
    """How the model is split over GPUs."""

    tp: int = 1
    """Training tensor-parallel size (Megatron tensor_model_parallel_size)."""
    pp: int = 1
    """Training pipeline-parallel size; must divide the layer count (the planner only plans even splits)."""
    rollout_tp: int = 1
    """Tensor-parallel size of each colocated vLLM engine; world / rollout_tp engines run side by side."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism (shards norm/residual activations over TP). None: on when tp > 1."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam state over the data-parallel group (Megatron distributed optimizer)."""

    def __post_init__(self):
        _check_pos_int("parallel", self, "tp", "pp", "rollout_tp")
        if self.sequence_parallel is None:
            self.sequence_parallel = self.tp > 1
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")


@dataclass
class RolloutConfig:
    """Colocated vLLM engine sizes."""

    max_prompt_len: int = 2048
    """Longest prompt in tokens."""
    max_response_len: int = 8192
    """Longest generated response in tokens; prompt + response is vLLM's max_model_len."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory each vLLM engine may claim while awake (weights + activations + KV cache)."""
    sleep_level: int = 1
    """vLLM sleep level during training: 1 offloads weights to host RAM, 2 discards them (re-synced anyway)."""
    overhead_gb: float = 2.0
    """vLLM memory besides weights and KV cache (profiled activation peak, CUDA graphs, sampler), GiB. Assumed."""
    sleep_residual_gb: float = 1.0
    """GPU memory an asleep engine keeps (allocations outside vLLM's sleep-mode pool), GiB. Assumed."""

    def __post_init__(self):
        _check_pos_int("rollout", self, "max_prompt_len", "max_response_len")
        _check_nonneg("rollout", self, "overhead_gb", "sleep_residual_gb")
        g = self.gpu_memory_utilization
        if not isinstance(g, (int, float)) or isinstance(g, bool) or not (0.0 < g < 1.0):
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1), got {g!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level!r}")

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_len + self.max_response_len


RECOMPUTE_MODES = ("none", "full")


@dataclass
class TrainConfig:
    """Training-side sizes that drive memory."""

    micro_batch_tokens: int | None = None
    """Tokens per micro-batch (sequences are packed up to this budget). None: one max-length sequence."""
    recompute: str = "full"
    """Activation recomputation: "full" (Megatron recompute_granularity=full, uniform, 1 layer) or "none"."""
    logits_chunk: int = 1024
    """Tokens per chunk in the vocab-parallel log-prob / entropy ops (fp32 work buffers are chunk x V/tp)."""
    ref_model: bool = False
    """Keep a bf16 reference model on the GPU (KL penalty to the initial policy)."""
    offload_during_rollout: bool = False
    """Move training weights, grads and optimizer state to host RAM while vLLM generates."""
    overhead_gb: float = 2.0
    """Per-process memory outside the model (CUDA context, NCCL buffers, allocator fragmentation), GiB. Assumed."""

    def __post_init__(self):
        if self.micro_batch_tokens is not None:
            _check_pos_int("train", self, "micro_batch_tokens")
        _check_pos_int("train", self, "logits_chunk")
        _check_nonneg("train", self, "overhead_gb")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")


@dataclass
class ClusterConfig:
    """The allocation the job will run on."""

    nodes: int | None = None
    """Number of nodes. None: the planner picks the smallest count that fits."""
    gpus_per_node: int = 8
    """GPUs per node (= Slurm tasks per node)."""
    gpu_mem_gb: float = 80.0
    """Memory of one GPU in GiB."""
    usable_fraction: float = 0.92
    """Share of GPU memory a plan may fill; the rest is left for allocator fragmentation and estimate error."""

    def __post_init__(self):
        if self.nodes is not None:
            _check_pos_int("cluster", self, "nodes")
        _check_pos_int("cluster", self, "gpus_per_node")
        _check_nonneg("cluster", self, "gpu_mem_gb")
        if not (0.0 < self.usable_fraction <= 1.0):
            raise ValueError(f"cluster.usable_fraction must be in (0, 1], got {self.usable_fraction!r}")

    @property
    def world_size(self) -> int:
        if self.nodes is None:
            raise ValueError("cluster.nodes is not set")
        return self.nodes * self.gpus_per_node


@dataclass
class PlanConfig:
    """Everything the planner needs: model, layout, rollout and training sizes, and the cluster."""

    model: ModelSpec
    """The model to plan for."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM engine sizes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training sizes."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Allocation."""

    @property
    def micro_batch_tokens(self) -> int:
        return self.train.micro_batch_tokens or self.rollout.max_model_len


_SECTIONS = {"parallel": ParallelConfig, "rollout": RolloutConfig, "train": TrainConfig, "cluster": ClusterConfig}
_MODEL_KEYS = {"name", "hf_config", "spec"}


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply ``section.key=value`` strings (YAML-typed values) to a nested dict, in place; returns it."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ValueError(f"override {item!r}: empty key")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(value)
    return raw


def _model_from_section(sec: Any, where: str, base_dir: Path) -> ModelSpec:
    if isinstance(sec, str):
        return get_model_spec(sec)
    if not isinstance(sec, dict):
        raise ValueError(f"{where}: 'model' must be a mapping with name, hf_config or spec")
    unknown = set(sec) - _MODEL_KEYS
    given = [k for k in ("name", "hf_config", "spec") if sec.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"{where}: model needs exactly one of name, hf_config, spec (got {given or 'none'})")
    if unknown:
        print(f"warning: {where}: model keys ignored by the planner: {', '.join(sorted(unknown))}", file=sys.stderr)
    if given[0] == "name":
        return get_model_spec(str(sec["name"]))
    if given[0] == "hf_config":
        p = Path(sec["hf_config"]).expanduser()
        if not p.is_absolute() and not p.exists() and (base_dir / p).exists():
            p = base_dir / p
        return model_spec_from_hf_config(p)
    spec = dict(sec["spec"])
    spec.setdefault("name", "custom")
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    bad = set(spec) - names
    if bad:
        raise ValueError(f"{where}: model.spec has unknown key(s) {', '.join(sorted(bad))}; known: {sorted(names)}")
    return ModelSpec(**spec)


def plan_config_from_dict(raw: dict, where: str = "config", base_dir: Path | None = None) -> PlanConfig:
    """PlanConfig from a parsed run config (only the keys documented in the module docstring are read)."""
    if not isinstance(raw, dict) or "model" not in raw:
        raise ValueError(f"{where}: needs a 'model' section (model: {{name: ...}} or {{hf_config: ...}})")
    model = _model_from_section(raw["model"], where, base_dir or Path.cwd())
    kwargs: dict[str, Any] = {"model": model}
    for sec, cls in _SECTIONS.items():
        body = raw.get(sec) or {}
        if not isinstance(body, dict):
            raise ValueError(f"{where}: section {sec!r} must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in body.items() if k in known}
        unknown = set(body) - known
        if unknown and sec in ("parallel", "cluster"):
            # These sections are the planner's own; a typo here would silently change the plan.
            raise ValueError(
                f"{where}: unknown key(s) in {sec}: {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})"
            )
        try:
            kwargs[sec] = cls(**picked)
        except TypeError as e:
            raise ValueError(f"{where}: section {sec}: {e}") from None
    return PlanConfig(**kwargs)


def load_plan_config(source: str | Path, overrides: Sequence[str] = ()) -> PlanConfig:
    """PlanConfig from a built-in model name, an HF config.json (file or folder) or a run-config YAML."""
    p = Path(source).expanduser()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"config not found: {p}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: invalid YAML ({e})") from None
        raw = raw or {}
        where, base = str(p), p.parent
    elif p.suffix == ".json" or p.is_dir():
        raw, where, base = {"model": {"hf_config": str(p)}}, str(p), p.parent
    else:
        raw, where, base = {"model": {"name": str(source)}}, f"model {source!r}", Path.cwd()
    apply_overrides(raw, overrides)
    return plan_config_from_dict(raw, where, base)


# ----------------------------------------------------------------------------------------------------------------
# Layout validation
# ----------------------------------------------------------------------------------------------------------------


def validate_layout(model: ModelSpec, par: ParallelConfig, world_size: int, gpus_per_node: int = 8):
    """(errors, warnings) for this layout; an empty error list means Megatron and vLLM can both build it.

    Megatron-Core (TransformerConfig.__post_init__, core 0.16): num_attention_heads % tp == 0, and
    num_query_groups must be a multiple OR a divisor of tp; when kv_heads < tp each KV head is replicated on
    tp / kv_heads ranks (the fused QKV output is all-gathered and sliced, attention.py). vLLM's
    QKVParallelLinear applies the same rule to the rollout TP (replicas = rollout_tp / kv_heads).
    """
    errors: list[str] = []
    warnings: list[str] = []
    for axis, t in (("tp", par.tp), ("rollout_tp", par.rollout_tp)):
        if model.heads % t:
            errors.append(f"parallel.{axis}={t} does not divide the {model.heads} attention heads")
        if model.kv_heads % t and t % model.kv_heads:
            errors.append(
                f"parallel.{axis}={t} and the {model.kv_heads} KV heads: one must divide the other "
                f"(KV heads are split when kv_heads % tp == 0, replicated when tp % kv_heads == 0)"
            )
        if model.ffn % t:
            errors.append(f"parallel.{axis}={t} does not divide ffn={model.ffn} (column-parallel MLP)")
        if t > gpus_per_node:
            warnings.append(f"parallel.{axis}={t} spans nodes ({gpus_per_node} GPUs/node): TP traffic leaves NVLink")
    if model.layers % par.pp:
        errors.append(f"parallel.pp={par.pp} does not divide the {model.layers} layers")
    mp = par.tp * par.pp
    if world_size % mp:
        errors.append(f"world size {world_size} is not divisible by tp x pp = {par.tp} x {par.pp} = {mp}")
    if world_size % par.rollout_tp:
        errors.append(f"world size {world_size} is not divisible by rollout_tp={par.rollout_tp}")
    if world_size < mp:
        errors.append(f"world size {world_size} is smaller than tp x pp = {mp}")
    return errors, warnings


# ----------------------------------------------------------------------------------------------------------------
# Memory estimate
# ----------------------------------------------------------------------------------------------------------------


def stage_params(model: ModelSpec, par: ParallelConfig) -> list[int]:
    """Parameters held by ONE GPU of each pipeline stage (TP-sharded matrices, replicated norms, padded vocab).

    Stage 0 holds the input embedding, the last stage the final norm and the LM head (with tied embeddings and
    pp > 1 Megatron keeps a copy of the embedding on the last stage for the output layer).
    """
    lp = model.layer_params()
    per_layer = (lp["qkv_w"] + lp["qkv_b"] + lp["out_w"] + lp["mlp_w"]) // par.tp + lp["norms"]
    emb = model.padded_vocab(par.tp) * model.hidden // par.tp
    n_local = model.layers // par.pp
    out = []
    for s in range(par.pp):
        n = n_local * per_layer
        if s == 0:
            n += emb
        if s == par.pp - 1:
            n += model.hidden  # final norm
            if not model.tied_embeddings or par.pp > 1:
                n += emb
        out.append(n)
    return out


def activation_bytes_per_layer(model: ModelSpec, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Bytes of bf16 activations one transformer layer saves for backward, for `tokens` tokens of one micro-batch.

    Korthikanti et al. 2022 (Sec. 4.1) count 34 s*b*h + 5 a s^2 b per layer for GPT (GeLU, MHA, dropout,
    materialised softmax). Re-derived here for Llama/Qwen layers trained with flash attention and no dropout
    (per token, 2 bytes per element):
        RMSNorm inputs            2h + 2h
        QKV input, MLP input      2h + 2h
        Q; K and V (GQA)          2 q_dim; 4 kv_dim       (flash attention keeps q, k, v; no s^2 term)
        attention output          2 q_dim                 (input of the output projection)
        SwiGLU                    4f (fc1 output, gate|up) + 2f (input of fc2)
    = 8h + 4 q_dim + 4 kv_dim + 6f. With sequence parallelism every term is sharded over TP (Sec. 4.2.2);
    without it the 8h norm/linear-input terms are replicated and only the rest is divided by TP.
    Check against the paper: a GPT layer (MHA so q_dim = kv_dim = h, f = 4h, GeLU MLP storing 2f + 2f bytes)
    gives 8h + 4h + 4h + 16h = 32h, the paper's 34 s*b*h minus its two s*b*h dropout masks.
    """
    h, f = model.hidden, model.ffn
    replicated = 8 * h
    sharded = 4 * model.q_dim + 4 * model.kv_dim + (6 * f if model.gated_mlp else 4 * f)
    if sequence_parallel:
        return tokens * (replicated + sharded) // tp
    return tokens * (replicated + sharded // tp)


_TRAIN_PHASE_TERMS = ("weights", "grads", "optimizer", "ref_model", "activations", "logits", "logits_chunk")
_TRAIN_PHASE_TERMS += ("train_overhead", "vllm_sleeping")

LOGITS_CHUNK_FACTOR = 4
"""fp32 [chunk, V/tp] buffers alive at once in the vocab-parallel ops: upcast logits, exp/softmax, grad, a temp."""


@dataclass
class MemoryPlan:
    """The planner's verdict for one config on one allocation."""

    config: PlanConfig
    """The config that was planned."""
    world_size: int
    """nodes x GPUs per node."""
    dp: int
    """Data-parallel size world / (tp x pp): the distributed optimizer's sharding factor."""
    errors: list[str]
    """Layout errors (the layout cannot be built); memory is not estimated when non-empty."""
    warnings: list[str]
    """Legal but slow choices (TP across nodes)."""
    reasons: list[str] = field(default_factory=list)
    """Why the layout does not fit in memory (empty when it fits)."""
    components: dict[str, float] = field(default_factory=dict)
    """Bytes per GPU of each term, for the worst pipeline stage (keys: see ``estimate_memory``)."""
    worst_stage: int = 0
    """The pipeline stage with the largest peak (reported in the table)."""
    stage_param_counts: list[int] = field(default_factory=list)
    """Parameters held by one GPU of each pipeline stage."""
    train_peak: float = 0.0
    """Bytes per GPU while training (vLLM asleep), worst stage."""
    rollout_peak: float = 0.0
    """Bytes per GPU while vLLM generates (training state resident unless offloaded), worst stage."""
    kv_tokens: int = 0
    """KV-cache capacity of one vLLM engine in tokens (all layers)."""

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)

    @property
    def limit(self) -> float:
        c = self.config.cluster
        return c.gpu_mem_gb * c.usable_fraction * GIB

    @property
    def fits(self) -> bool:
        return not self.errors and not self.reasons


def _vllm_weight_params(model: ModelSpec, rtp: int) -> int:
    """Parameters per GPU of a vLLM engine at TP=rtp; KV heads are replicated when rtp > kv_heads."""
    h, d = model.hidden, model.head_dim
    kv_local = max(1, model.kv_heads // rtp)
    q_local = model.heads // rtp
    qkv_w = h * d * (q_local + 2 * kv_local)
    qkv_b = d * (q_local + 2 * kv_local) if model.qkv_bias else 0
    lp = model.layer_params()
    per_layer = qkv_w + qkv_b + (lp["out_w"] + lp["mlp_w"]) // rtp + lp["norms"]
    vocab_shard = -(-model.vocab // rtp)  # vLLM pads the vocab shard; the difference is negligible here
    emb = vocab_shard * h * (1 if model.tied_embeddings else 2)
    return model.layers * per_layer + emb + h


def estimate_memory(cfg: PlanConfig) -> MemoryPlan:
    """Validate the layout and estimate per-GPU memory of every pipeline stage; keeps the worst stage.

    ``components`` keys (bytes, worst stage): weights, grads, optimizer, ref_model, act_none, act_full, activations
    (the configured recompute mode), logits, logits_chunk, train_overhead, vllm_sleeping, train_state_in_rollout,
    vllm_engine, vllm_weights, vllm_overhead, kv_cache, host_ram_per_node (sleep level 1 weight backup).
    """
    m, par, ro, tr, cl = cfg.model, cfg.parallel, cfg.rollout, cfg.train, cfg.cluster
    world = cl.world_size
    errors, warnings = validate_layout(m, par, world, cl.gpus_per_node)
    dp = max(1, world // (par.tp * par.pp))
    plan = MemoryPlan(config=cfg, world_size=world, dp=dp, errors=errors, warnings=warnings)
    T = cfg.micro_batch_tokens
    if T < ro.max_model_len:
        errors.append(
            f"train.micro_batch_tokens={T} is smaller than one max-length sequence "
            f"(rollout.max_prompt_len + max_response_len = {ro.max_model_len}); a sequence cannot be split"
        )
    if errors:
        return plan

    G = cl.gpu_mem_gb * GIB
    params = stage_params(m, par)
    plan.stage_param_counts = params
    a_layer = activation_bytes_per_layer(m, T, par.tp, par.sequence_parallel)
    n_local = m.layers // par.pp
    vocab_shard = m.padded_vocab(par.tp) // par.tp
    vllm_w = 2 * _vllm_weight_params(m, par.rollout_tp)
    vllm_engine = ro.gpu_memory_utilization * G
    kv_cache = vllm_engine - vllm_w - ro.overhead_gb * GIB
    # K and V for every layer; vLLM keeps max(1, kv_heads / rollout_tp) heads per GPU, bf16.
    kv_per_token = 2 * m.layers * max(1, m.kv_heads // par.rollout_tp) * m.head_dim * 2
    plan.kv_tokens = max(0, int(kv_cache // kv_per_token))

    best = None
    for s, p in enumerate(params):
        in_flight = par.pp - s  # 1F1B: stage s holds pp - s micro-batches of activations (Korthikanti Sec. 4.2.3)
        c: dict[str, float] = {}
        c["weights"] = 2 * p
        c["grads"] = 4 * p
        c["optimizer"] = 12 * p / (dp if par.distributed_optimizer else 1)
        c["ref_model"] = 2 * p if tr.ref_model else 0
        c["act_none"] = in_flight * n_local * a_layer
        # Full recompute stores only each layer's input ([T, h] bf16, sharded by SP) and rebuilds one layer.
        layer_input = 2 * T * m.hidden // (par.tp if par.sequence_parallel else 1)
        c["act_full"] = in_flight * n_local * layer_input + a_layer
        c["activations"] = c["act_full"] if tr.recompute == "full" else c["act_none"]
        last = s == par.pp - 1
        c["logits"] = T * vocab_shard * (2 + 2) if last else 0  # bf16 logits + their grad
        c["logits_chunk"] = min(tr.logits_chunk, T) * vocab_shard * 4 * LOGITS_CHUNK_FACTOR if last else 0
        c["train_overhead"] = tr.overhead_gb * GIB
        c["vllm_sleeping"] = ro.sleep_residual_gb * GIB
        train_peak = sum(c[k] for k in _TRAIN_PHASE_TERMS)
        state = c["weights"] + c["grads"] + c["optimizer"] + c["ref_model"]
        c["train_state_in_rollout"] = 0 if tr.offload_during_rollout else state
        c["vllm_engine"] = vllm_engine
        c["vllm_weights"] = vllm_w
        c["vllm_overhead"] = ro.overhead_gb * GIB
        c["kv_cache"] = kv_cache
        rollout_peak = c["train_state_in_rollout"] + vllm_engine + c["train_overhead"]
        if best is None or max(train_peak, rollout_peak) > max(best[1], best[2]):
            best = (s, train_peak, rollout_peak, c)
    s, plan.train_peak, plan.rollout_peak, plan.components = best
    plan.worst_stage = s
    plan.components["host_ram_per_node"] = vllm_w * cl.gpus_per_node if ro.sleep_level == 1 else 0

    limit = plan.limit
    lim_txt = f"{limit / GIB:.1f} GiB usable ({cl.gpu_mem_gb:g} x {cl.usable_fraction:g})"
    if kv_cache <= 0:
        plan.reasons.append(
            f"vLLM: rollout.gpu_memory_utilization={ro.gpu_memory_utilization:g} gives "
            f"{vllm_engine / GIB:.1f} GiB, less than its weights ({vllm_w / GIB:.1f} GiB at rollout_tp="
            f"{par.rollout_tp}) + overhead ({ro.overhead_gb:g} GiB): no room for a KV cache; raise "
            "gpu_memory_utilization or rollout_tp"
        )
    elif plan.kv_tokens < ro.max_model_len:
        plan.reasons.append(
            f"vLLM: KV cache holds {plan.kv_tokens} tokens, less than one sequence of max_model_len="
            f"{ro.max_model_len} (vLLM refuses to start); raise gpu_memory_utilization or rollout_tp"
        )
    if plan.train_peak > limit:
        hint = "set train.recompute=full, " if tr.recompute != "full" else ""
        plan.reasons.append(
            f"training phase needs {plan.train_peak / GIB:.1f} GiB on pipeline stage {s}, over {lim_txt}; "
            f"{hint}lower train.micro_batch_tokens, raise tp/pp, or add nodes (shards the optimizer further)"
        )
    if plan.rollout_peak > limit:
        plan.reasons.append(
            f"rollout phase needs {plan.rollout_peak / GIB:.1f} GiB (training state "
            f"{plan.components['train_state_in_rollout'] / GIB:.1f} + vLLM {vllm_engine / GIB:.1f} + overhead), "
            f"over {lim_txt}; lower rollout.gpu_memory_utilization, set train.offload_during_rollout=true, "
            "or raise tp"
        )
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def _g(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """Human-readable table (GiB per GPU) with the verdict and reasons."""
    cfg = plan.config
    m, par, ro, tr, cl = cfg.model, cfg.parallel, cfg.rollout, cfg.train, cfg.cluster
    lines = [
        f"model   {m.name}: {m.param_count() / 1e9:.2f} B params, L={m.layers} h={m.hidden} f={m.ffn} "
        f"heads={m.heads} kv_heads={m.kv_heads} d={m.head_dim} V={m.vocab}",
        f"cluster {cl.nodes} node(s) x {cl.gpus_per_node} GPUs x {cl.gpu_mem_gb:g} GiB = world {plan.world_size}",
        f"layout  TP={par.tp} PP={par.pp} DP={plan.dp} SP={'on' if par.sequence_parallel else 'off'} | rollout "
        f"TP={par.rollout_tp} ({plan.world_size // par.rollout_tp} vLLM engines)",
    ]
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    if plan.errors:
        lines.append("INVALID LAYOUT:")
        lines += [f"  - {e}" for e in plan.errors]
        return "\n".join(lines)
    c = plan.components
    T = cfg.micro_batch_tokens
    vp = m.padded_vocab(par.tp)
    p = plan.stage_param_counts[plan.worst_stage]
    dp_div = plan.dp if par.distributed_optimizer else 1
    lines.append(
        f"sizes   micro-batch {T} tokens (max seq {ro.max_model_len}), vocab {m.vocab} -> padded {vp} "
        f"(multiple of {MEGATRON_VOCAB_DIVISIBLE_BY} x TP), recompute={tr.recompute}"
    )
    lines.append("")
    lines.append(f"{'GiB per GPU':<58}{'':>8}")
    lines.append(f"-- training phase (pipeline stage {plan.worst_stage} of {par.pp}, the largest) " + "-" * 12)
    rows = [
        (f"weights bf16 ({p / 1e9:.3f} B params on this GPU)", c["weights"]),
        ("main grads fp32 (4 B/param)", c["grads"]),
        (f"fp32 master + Adam m,v (12 B/param / DP={dp_div})", c["optimizer"]),
    ]
    if tr.ref_model:
        rows.append(("reference model bf16", c["ref_model"]))
    mark_n = " <-" if tr.recompute == "none" else ""
    mark_f = " <-" if tr.recompute == "full" else ""
    rows += [
        (f"activations, no recompute{mark_n}", c["act_none"]),
        (f"activations, full recompute{mark_f}", c["act_full"]),
        (f"logits [{T} x {vp // par.tp}] bf16 + grad", c["logits"]),
        (
            f"logits chunk work [{min(tr.logits_chunk, T)} x {vp // par.tp}] fp32 x{LOGITS_CHUNK_FACTOR}",
            c["logits_chunk"],
        ),
        ("framework (CUDA context, NCCL, fragmentation)", c["train_overhead"]),
        (f"vLLM asleep (level {ro.sleep_level}, residual)", c["vllm_sleeping"]),
    ]
    lines += [f"  {label:<56}{_g(v)}" for label, v in rows]
    lines.append(f"  {'= training peak':<56}{_g(plan.train_peak)}")
    lines.append(
        f"-- rollout phase (vLLM TP={par.rollout_tp}, gpu_memory_utilization={ro.gpu_memory_utilization:g}) " + "-" * 8
    )
    kv_seqs = plan.kv_tokens / ro.max_model_len
    off = " (offloaded)" if tr.offload_during_rollout else ""
    rows = [
        (f"training state kept on GPU{off}", c["train_state_in_rollout"]),
        ("vLLM engine = util x GPU, of which:", c["vllm_engine"]),
        ("    weights bf16 (KV heads replicated if rtp > kv_heads)", c["vllm_weights"]),
        ("    activations, CUDA graphs, sampler (assumed)", c["vllm_overhead"]),
        (f"    KV cache: {plan.kv_tokens} tokens = {kv_seqs:.1f} seqs of {ro.max_model_len}", c["kv_cache"]),
        ("framework (CUDA context, NCCL, fragmentation)", c["train_overhead"]),
    ]
    lines += [f"  {label:<56}{_g(v)}" for label, v in rows]
    lines.append(f"  {'= rollout peak':<56}{_g(plan.rollout_peak)}")
    lines.append("")
    if ro.sleep_level == 1:
        lines.append(f"host RAM per node for vLLM sleep level 1 weight backup: {c['host_ram_per_node'] / GIB:.1f} GiB")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"peak {plan.peak / GIB:.1f} GiB per GPU of {plan.limit / GIB:.1f} usable "
        f"({cl.gpu_mem_gb:g} GiB x {cl.usable_fraction:g}): {verdict}"
    )
    lines += [f"  - {r}" for r in plan.reasons]
    return "\n".join(lines)


def _with_nodes(cfg: PlanConfig, nodes: int) -> PlanConfig:
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=nodes))


def smallest_fitting_nodes(cfg: PlanConfig, max_nodes: int = 128) -> MemoryPlan | None:
    """Plan at the smallest node count (1..max_nodes) where the layout is valid and fits; None if none does."""
    for n in range(1, max_nodes + 1):
        plan = estimate_memory(_with_nodes(cfg, n))
        if plan.fits:
            return plan
    return None


def search_layouts(cfg: PlanConfig) -> list[MemoryPlan]:
    """Every valid (tp, pp, rollout_tp) with tp, rollout_tp <= GPUs per node, sorted: fitting first, then the
    smaller model-parallel size tp x pp (less communication, more DP), then less PP (smaller pipeline bubble),
    then smaller rollout TP (more independent engines)."""
    gpn = cfg.cluster.gpus_per_node
    sizes = [t for t in (1, 2, 4, 8, 16) if t <= gpn]
    plans = []
    for tp in sizes:
        for pp in (1, 2, 4, 8):
            for rtp in sizes:
                try:
                    par = dataclasses.replace(cfg.parallel, tp=tp, pp=pp, rollout_tp=rtp, sequence_parallel=tp > 1)
                except ValueError:
                    continue
                plan = estimate_memory(dataclasses.replace(cfg, parallel=par))
                if not plan.errors:
                    plans.append(plan)

    def rank(p: MemoryPlan):
        par = p.config.parallel
        return (not p.fits, par.tp * par.pp, par.pp, par.rollout_tp, p.peak)

    plans.sort(key=rank)
    return plans


def format_search(plans: list[MemoryPlan]) -> str:
    head = f"{'tp':>3} {'pp':>3} {'rtp':>4} {'dp':>4} {'train':>7} {'rollout':>8} {'peak':>7} {'kv seqs':>8}  verdict"
    lines = [head + "   (GiB per GPU)"]
    for p in plans:
        par = p.config.parallel
        seqs = p.kv_tokens / p.config.rollout.max_model_len
        why = "fits" if p.fits else "no: " + p.reasons[0].split(";")[0]
        lines.append(
            f"{par.tp:>3} {par.pp:>3} {par.rollout_tp:>4} {p.dp:>4} {p.train_peak / GIB:7.1f} "
            f"{p.rollout_peak / GIB:8.1f} {p.peak / GIB:7.1f} {seqs:8.1f}  {why}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-rlvr plan",
        description="Validate a parallel layout and estimate per-GPU memory (training + colocated vLLM).",
    )
    ap.add_argument("config", help="run-config YAML, HF config.json / folder, or a built-in model name")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=8")
    ap.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: cluster.gpus_per_node or 8)"
    )
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GiB per GPU (default: cluster.gpu_mem_gb or 80)")
    ap.add_argument(
        "--nodes", type=int, default=None, help="node count (default: cluster.nodes, else the smallest that fits)"
    )
    ap.add_argument("--usable-fraction", type=float, default=None, help="share of GPU memory a plan may fill (0.92)")
    ap.add_argument("--search", action="store_true", help="list every valid (tp, pp, rollout_tp) for this allocation")
    return ap


def plan_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megatron-rlvr plan``; returns the exit status (0 fits, 1 refused, 2 bad input)."""
    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    cli = {
        k: v
        for k, v in (
            ("cluster.nodes", args.nodes),
            ("cluster.gpus_per_node", args.gpus_per_node),
            ("cluster.gpu_mem_gb", args.gpu_mem_gb),
            ("cluster.usable_fraction", args.usable_fraction),
        )
        if v is not None
    }
    try:
        cfg = load_plan_config(args.config, list(args.overrides) + [f"{k}={v}" for k, v in cli.items()])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.cluster.nodes is None:
        plan = smallest_fitting_nodes(cfg)
        if plan is None:
            print(format_plan(estimate_memory(_with_nodes(cfg, 1))))
            print("no node count up to 128 fits this layout", file=sys.stderr)
            return 1
        print(f"(--nodes not given: the smallest node count that fits is {plan.config.cluster.nodes})")
    else:
        plan = estimate_memory(cfg)
    if args.search:
        print(format_search(search_layouts(plan.config)))
        print()
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(plan_main())
