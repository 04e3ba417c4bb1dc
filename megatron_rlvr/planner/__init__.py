"""Layout planner: validates a TP/PP/rollout-TP layout and estimates per-GPU memory before a job is submitted.

No Megatron import and no GPU: it runs on a login node. Split by concern: ``inputs`` (a run config -> what is
planned), ``memory`` (layout validation and the memory model), ``report`` (the table, the search, the CLI); the
model shapes are ``megatron_rlvr.families.table``.

    megatron-rlvr plan CONFIG [--gpus-per-node 8] [--gpu-mem-gb 80] [--nodes N] [--search] [key=value ...]

CONFIG is one of
  * a run-config YAML: the same file ``megatron-rlvr train`` runs, loaded and validated by the same code
    (megatron_rlvr.config), so a file one accepts the other accepts. Files it names (weights, data) need not exist
    where ``plan`` runs: they are warnings here. The model's shapes come from its HF config.json when readable,
    else from the built-in spec named by ``model.name``. The planner reads ``model.dtype``, ``parallel``,
    ``rollout`` (engine, lengths, gpu_memory_utilization, kv_cache_gb, max_batch_rows, sleep_level), ``train``
    (micro_batch_tokens, recompute, logits_chunk, ref_model), ``algorithm.distill`` (the teacher: its weights at
    the policy's layout, its logits with the full-vocabulary estimator, its share of the compute) and
    ``cluster`` (the allocation and the memory assumptions: vllm_overhead_gb, vllm_sleep_residual_gb,
    train_overhead_gb, offload_during_rollout);
  * a built-in model name (``qwen2.5-14b``, ``Qwen/Qwen2.5-14B-Instruct``, ... see ``families.table.BUILTIN_SPECS``)
    or an HF ``config.json`` (or a folder holding one): the default run config for that model, in bf16 unless
    ``model.dtype=float32`` is given.

``key=value`` arguments override any key (``parallel.tp=8``). Exit status: 0 the layout fits, 1 it is
invalid or does not fit (the reasons are printed), 2 bad input (unreadable config, unknown model, bad value).

Memory model (per GPU, bytes; GiB = 2**30). Every term is a formula of the config, stated where it is computed:
  * weights bf16 2 B/param, main grads fp32 4 B/param, fp32 master weights + Adam m, v 12 B/param divided by DP
    when the distributed optimizer is on: "bf16 parameters, fp32 gradients: 6 + 12/d bytes per parameter"
    (Megatron-Core developer guide, "Distributed Optimizer"). With ``model.dtype=float32`` the weights take 4 B
    and the optimizer 8 B (m, v; the weights are the master copy), and every bf16 term below (activations,
    logits, reference model, the engine's weights and KV cache) doubles.
  * activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4,
    re-derived for SwiGLU + GQA + flash attention (no s^2 score term, no dropout masks): see
    ``activation_bytes_per_layer``. 1F1B pipelining keeps ``pp - stage`` micro-batches in flight (Sec. 4.2.3).
  * logits: the output layer materialises [T, V/tp] bf16 logits (and their grad); the vocab-parallel ops then
    work on fp32 chunks of ``logits_chunk`` tokens.
  * mixture of experts: each MoE layer's routed experts are split over EP (whole experts) and expert TP, the
    router is replicated; the distributed optimizer shards the experts' state over expert-DP = world / (etp x ep x
    pp) and the rest over DP; a token stores activations only for its top-k routed copies
    (``moe_activation_bytes_per_layer``); vLLM holds every expert, sliced by the rollout TP.
  * vision-language models: the vision tower (``ModelSpec.vision``) is a plain module on pipeline stage 0, whole on
    each GPU there: its weights, when trained fp32 grads + Adam (16 B/param, not sharded by the distributed
    optimizer) and the activations of its blocks for the micro-batch's patches (the prompt share of its tokens as
    image tokens, ``spatial_merge_size``^2 patches each; see ``VisionSpec.activation_bytes_per_block``); vLLM holds
    it sliced by the rollout TP.
  * colocated vLLM: the engine claims ``gpu_memory_utilization`` x GPU while rolling out (weights at rollout TP,
    a fixed overhead for activations / CUDA graphs, the rest is KV cache); during training it sleeps (level 1
    offloads weights to host RAM, level 2 discards them; both discard the KV cache), keeping only
    ``cluster.vllm_sleep_residual_gb``; ``rollout.kv_cache_gb`` replaces the utilisation share by weights +
    overhead + that cache. ``rollout.engine=hf`` (the transformers engine, rollout TP 1) instead keeps the whole
    model on every GPU in both phases, plus a KV cache of ``max_batch_rows`` full-length rows while generating;
    ``auto`` is planned as vLLM. Peak = max(training phase, rollout phase).
  * disaggregated (``parallel.rollout_ranks`` R > 0): the roles have their own GPUs. A training rank holds the
    training terms above with DP = (world - R) / (tp x pp) and no engine; a rollout rank holds only its engine
    (vLLM never sleeps there) plus the framework overhead. ``train_peak`` / ``rollout_peak`` are then the two
    roles' GPUs; the engine count is R / rollout TP.
  * context parallelism (``parallel.cp``, dense text models): a GPU holds 1 / cp of every micro-batch's tokens, so
    activations and logits are for T / cp tokens; the distributed optimizer shards over DP x CP. The report adds the
    keys and values each GPU sends per layer per micro-batch (``memory.cp_comm_bytes_per_layer``, by
    ``parallel.cp_comm_type``). ``--search`` tries cp in (1, 2, 4, 8) and chooses cp > 1 only when no cp=1 layout
    fits (``report.search_layouts``).
"""

from megatron_rlvr.config.sections import ClusterConfig, ParallelConfig, RolloutConfig, TrainConfig
from megatron_rlvr.families.table import (
    BUILTIN_SPECS,
    MEGATRON_VOCAB_DIVISIBLE_BY,
    ModelSpec,
    get_model_spec,
    model_spec_from_hf_config,
)
from megatron_rlvr.planner.inputs import load_plan_config, model_spec_for, plan_config_from_run
from megatron_rlvr.planner.memory import (
    GIB,
    LayoutError,
    MemoryPlan,
    PlanConfig,
    activation_bytes_per_layer,
    cp_comm_bytes_per_layer,
    estimate_memory,
    moe_activation_bytes_per_layer,
    stage_expert_params,
    stage_params,
    validate_layout,
)
from megatron_rlvr.planner.report import format_plan, format_search, plan_main, search_layouts, smallest_fitting_nodes

__all__ = [
    "BUILTIN_SPECS",
    "GIB",
    "MEGATRON_VOCAB_DIVISIBLE_BY",
    "ClusterConfig",
    "LayoutError",
    "MemoryPlan",
    "ModelSpec",
    "ParallelConfig",
    "PlanConfig",
    "RolloutConfig",
    "TrainConfig",
    "activation_bytes_per_layer",
    "cp_comm_bytes_per_layer",
    "estimate_memory",
    "format_plan",
    "format_search",
    "get_model_spec",
    "load_plan_config",
    "model_spec_for",
    "model_spec_from_hf_config",
    "plan_config_from_run",
    "plan_main",
    "moe_activation_bytes_per_layer",
    "search_layouts",
    "smallest_fitting_nodes",
    "stage_expert_params",
    "stage_params",
    "validate_layout",
]
