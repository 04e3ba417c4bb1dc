"""The planner with model.lora: adapter parameter counts per GPU (checked against the count megatron's optimizer
holds for the tiny Qwen3 of tests/test_models_lora.py), no base gradients / optimizer states / reference copy, and
the smaller layout that makes possible. Pure Python."""

import dataclasses

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.planner import (
    GIB,
    ClusterConfig,
    ModelSpec,
    ParallelConfig,
    PlanConfig,
    estimate_memory,
    get_model_spec,
)
from megatron_rlvr.planner.memory import lora_stage_params
from megatron_rlvr.planner.report import search_layouts


def _tiny_qwen3() -> ModelSpec:
    # tests/test_models_lora.py's model: hidden 64, ffn 96, 4 heads of 24, 2 KV heads, 2 layers
    return ModelSpec(
        name="tiny-qwen3", hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, vocab=300, head_dim=24, qk_norm=True
    )


def test_adapter_params_per_gpu_match_the_model():
    spec, lora = _tiny_qwen3(), LoRAConfig(rank=4)
    # counted by megatron's optimizer / DDP buffer in tests/test_models_lora.py: 8192 at TP=1, 5888 per rank at TP=2
    assert lora_stage_params(spec, ParallelConfig(tp=1), lora) == [8192]
    assert lora_stage_params(spec, ParallelConfig(tp=2), lora) == [5888]
    # by hand, qkv only, TP=2, PP=2 (one layer per stage): A 3*4*64 + B 192*4/2
    assert lora_stage_params(spec, ParallelConfig(tp=2, pp=2), LoRAConfig(rank=4, targets=["qkv"])) == [1152, 1152]


def test_lora_drops_base_grads_optimizer_and_reference_and_fits_a_smaller_layout():
    base = PlanConfig(
        model=get_model_spec("qwen2.5-7b"),
        parallel=ParallelConfig(tp=1, distributed_optimizer=True),
        cluster=ClusterConfig(nodes=1),
        ref_model=True,
    )
    lora = LoRAConfig(rank=32)
    full, low = estimate_memory(base), estimate_memory(dataclasses.replace(base, lora=lora))
    a = lora_stage_params(base.model, base.parallel, lora)[0]
    p = full.stage_param_counts[0]
    assert low.components["grads"] == 4 * a and low.components["ref_model"] == 0
    assert low.components["optimizer"] == 12 * a / low.dp
    assert low.components["weights"] == 2 * (p + a)
    assert full.components["grads"] == 4 * p and full.components["ref_model"] == 2 * p
    assert low.peak < full.peak - 40 * GIB
    # on one 8-GPU node: full fine-tuning needs TP=4, LoRA fits at TP=1
    best_full = next(q for q in search_layouts(base) if q.fits).config.parallel
    best_lora = next(q for q in search_layouts(dataclasses.replace(base, lora=lora)) if q.fits).config.parallel
    assert best_lora.tp * best_lora.pp < best_full.tp * best_full.pp
