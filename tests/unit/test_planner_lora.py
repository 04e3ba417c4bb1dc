"""The planner with model.lora: adapter parameter counts per GPU (checked against the count megatron's optimizer
holds for the tiny Qwen3 of tests/integration/test_models_lora.py), no base gradients / optimizer states / reference
copy, and the smaller layout that makes possible. Pure Python."""

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_rlvr.config import ConfigError, load_run_config
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
from megatron_rlvr.planner.inputs import load_plan_config
from megatron_rlvr.planner.memory import lora_stage_params
from megatron_rlvr.planner.report import search_layouts


def _tiny_qwen3() -> ModelSpec:
    # tests/integration/test_models_lora.py's model: hidden 64, ffn 96, 4 heads of 24, 2 KV heads, 2 layers
    return ModelSpec(
        name="tiny-qwen3", hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, vocab=300, head_dim=24, qk_norm=True
    )


def test_adapter_params_per_gpu_match_the_model():
    spec, lora = _tiny_qwen3(), LoRAConfig(rank=4)
    # counted by megatron's optimizer / DDP buffer in tests/integration/test_models_lora.py: 8192 at TP=1, 5888 per
    # rank at TP=2
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


# Qwen/Qwen3-4B-Base config.json (the fields that shape the model and the run's lengths)
QWEN3_4B_BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
LORA_4B_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "mcpo_margin_qwen3_4b_lora.yaml")


def test_qwen3_4b_lora_config_plans_the_real_model(tmp_path, monkeypatch):
    """configs/mcpo_margin_qwen3_4b_lora.yaml: with Qwen3-4B-Base's config.json in place the planner reads the same
    shapes as the built-in spec it falls back to without it; parameter and adapter counts by hand; it fits one
    8 x 80 GB node at TP=1; and `train`'s length check passes against the checkpoint's 32768 positions."""
    (tmp_path / "Qwen3-4B-Base").mkdir()
    (tmp_path / "Qwen3-4B-Base" / "config.json").write_text(json.dumps(QWEN3_4B_BASE))
    monkeypatch.setenv("RLVR_MODELS", str(tmp_path))
    from_hf = load_plan_config(LORA_4B_CONFIG, warn=lambda msg: None)  # the data files are not here
    monkeypatch.setenv("RLVR_MODELS", str(tmp_path / "absent"))
    warnings = []
    builtin = load_plan_config(LORA_4B_CONFIG, warn=warnings.append)
    assert len(warnings) == 1 and "model.hf_path" in warnings[0]
    spec = builtin.model
    assert spec == get_model_spec("Qwen/Qwen3-4B-Base")
    assert from_hf.model == dataclasses.replace(spec, name=from_hf.model.name)

    h, f, L, a, kv, d, V = 2560, 9728, 36, 32, 8, 128, 151936
    layer = h * (a * d + 2 * kv * d) + a * d * h + 3 * h * f + 2 * h + 2 * d  # q/k/v, o, SwiGLU, 2 norms, q/k norms
    assert spec.param_count() == V * h + L * layer + h == 4_022_468_096  # tied head; HF: "4.0B, 3.6B non-embedding"
    r = builtin.lora.rank
    # per layer, A [r, in] and B [out, r] for q, k, v, o, gate, up, down
    adapters = L * r * (3 * h + (a * d + 2 * kv * d) + a * d + h + 2 * h + 2 * f + f + h)
    assert r == 32 and lora_stage_params(spec, builtin.parallel, builtin.lora) == [adapters] == [66_060_288]

    plan_hf, plan = estimate_memory(from_hf), estimate_memory(builtin)
    assert plan_hf.peak == plan.peak and plan.fits and plan.dp == 8
    assert plan.components["grads"] == 4 * adapters and plan.components["ref_model"] == 0
    assert plan.components["optimizer"] == 12 * adapters / 8
    # vLLM's KV cache: 2 (K, V) x kv heads x d x 2 bytes (bf16) x L per token
    assert plan.kv_tokens == int(plan.components["kv_cache"] // (2 * kv * d * 2 * L))

    monkeypatch.setenv("RLVR_MODELS", str(tmp_path))
    run = load_run_config(LORA_4B_CONFIG, check_files=False)
    assert run.rollout.max_prompt_len + run.rollout.max_response_len <= QWEN3_4B_BASE["max_position_embeddings"]
    with pytest.raises(ConfigError, match="max_position_embeddings=32768"):
        too_long = ["rollout.max_response_len=32768", "train.micro_batch_tokens=40960"]
        load_run_config(LORA_4B_CONFIG, too_long, check_files=False)
