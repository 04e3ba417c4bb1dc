"""The planner on vision-language models: the tower's parameter count equals transformers' (Qwen2.5-VL-7B's real
config and both tiny families, meta device), the built-in Qwen2.5-VL-7B spec is the one read from that config, and
the tower's memory terms (weights, fp32 grads + Adam state when trained, activations, the reference copy, the vLLM
engine's share) are hand-computed and sit on pipeline stage 0 only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlvr.config.sections import ClusterConfig, ParallelConfig, RolloutConfig, TrainConfig
from megatron_rlvr.families.table import VisionSpec, get_model_spec, model_spec_from_hf_config
from megatron_rlvr.planner import GIB, PlanConfig, estimate_memory


def _qwen2_5_vl_7b_config():
    """Qwen/Qwen2.5-VL-7B-Instruct's config.json values (language model and vision tower)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


def _counts(model) -> tuple[int, int]:
    params = dict(model.named_parameters())
    return sum(p.numel() for p in params.values()), sum(p.numel() for n, p in params.items() if "visual" in n)


def test_qwen2_5_vl_7b_param_counts_match_transformers():
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = _qwen2_5_vl_7b_config()
    with torch.device("meta"):
        total, tower = _counts(Qwen2_5_VLForConditionalGeneration(cfg))
    spec = model_spec_from_hf_config(cfg.to_dict())
    assert spec.vision.param_count() == tower and spec.param_count() == total
    assert round(total / 1e9, 2) == 8.29  # the published "8.3B"
    builtin = get_model_spec("Qwen/Qwen2.5-VL-7B-Instruct")
    assert dataclasses.replace(builtin, name=spec.name) == spec


@pytest.mark.parametrize("kind, deepstack", [("qwen2_5_vl", None), ("qwen3_vl", [0]), ("qwen3_vl", [0, 1])])
def test_tiny_vl_param_counts_match_transformers(kind, deepstack):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from megatron_rlvr.families.tiny_vl import tiny_vl_hf_config

    cfg = tiny_vl_hf_config(kind)
    if deepstack is not None:
        cfg.vision_config.deepstack_visual_indexes = deepstack
    cls = Qwen2_5_VLForConditionalGeneration if kind == "qwen2_5_vl" else Qwen3VLForConditionalGeneration
    with torch.device("meta"):
        total, tower = _counts(cls(cfg))
    raw = cfg.to_dict()
    raw["architectures"] = [cls.__name__]
    spec = model_spec_from_hf_config(raw)
    assert spec.vision.kind == kind and spec.vision.param_count() == tower and spec.param_count() == total


def _plan(spec, **kw) -> PlanConfig:
    base = dict(
        model=spec,
        parallel=ParallelConfig(tp=2, pp=1, rollout_tp=2),
        rollout=RolloutConfig(engine="vllm", max_prompt_len=1024, max_response_len=3072),
        train=TrainConfig(micro_batch_tokens=8192, recompute="full"),
        cluster=ClusterConfig(nodes=1, gpus_per_node=8, gpu_mem_gb=80),
        ref_model=True,
    )
    base.update(kw)
    return PlanConfig(**base)


def test_tower_memory_terms_hand_computed():
    vl = get_model_spec("qwen2.5-vl-7b")
    text = dataclasses.replace(vl, vision=None)
    v = vl.vision
    pv = v.param_count()
    a, b = estimate_memory(_plan(vl)), estimate_memory(_plan(text))
    assert not a.errors and not b.errors  # a valid layout (whether it fits does not matter here)
    d = {k: a.components[k] - b.components[k] for k in ("weights", "grads", "optimizer", "ref_model", "act_full")}
    assert d["weights"] == 2 * pv and d["grads"] == 4 * pv and d["optimizer"] == 12 * pv and d["ref_model"] == 2 * pv
    # patches: the prompt share of 8192 tokens (1024 / 4096) as image tokens, 4 patches each
    patches = 8192 * 1024 // 4096 * 4
    assert _plan(vl).image_patches_per_micro_batch == patches == 8192
    # per patch and block, 2-byte units: 16 h + 6 f (SwiGLU)
    assert d["act_full"] == 32 * patches * (16 * 1280 + 6 * 3420)
    assert a.components["vision_activations"] == d["act_full"]
    # vLLM holds the tower sliced by the rollout TP
    assert a.components["engine_weights"] - b.components["engine_weights"] == 2 * (pv // 2)

    frozen = estimate_memory(_plan(vl, vision_trainable=False))
    f = {k: frozen.components[k] - b.components[k] for k in ("weights", "grads", "optimizer", "act_full")}
    assert f == {"weights": 2 * pv, "grads": 0, "optimizer": 0, "act_full": patches * (16 * 1280 + 6 * 3420)}
    # fp32 grads + Adam (16 B/param) and 31 of the 32 blocks' activations less
    assert a.train_peak - frozen.train_peak == 16 * pv + 31 * patches * (16 * 1280 + 6 * 3420)
    assert a.train_peak - frozen.train_peak > 19 * GIB

    fraction = estimate_memory(_plan(vl, image_token_fraction=0.5)).components["vision_activations"]
    assert fraction == 32 * (8192 // 2 * 4) * (16 * 1280 + 6 * 3420)


def test_tower_lives_on_stage_zero_only():
    vl = get_model_spec("qwen2.5-vl-7b")
    text = dataclasses.replace(vl, vision=None)
    par = ParallelConfig(tp=2, pp=2, rollout_tp=2)
    a, b = estimate_memory(_plan(vl, parallel=par)), estimate_memory(_plan(text, parallel=par))
    assert a.stage_param_counts == b.stage_param_counts  # the language model's shards are unchanged
    # the worst stage is 0 with the tower (1F1B also keeps 2 micro-batches there)
    assert a.worst_stage == 0 and a.components["vision_weights"] == 2 * vl.vision.param_count()


def test_vision_spec_validation_and_fraction():
    with pytest.raises(ValueError, match="kind must be qwen2_5_vl or qwen3_vl"):
        VisionSpec(kind="clip", depth=1, hidden=8, ffn=8, heads=1, out_hidden=8)
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        VisionSpec(kind="qwen3_vl", depth=0, hidden=8, ffn=8, heads=1, out_hidden=8)
    with pytest.raises(ValueError, match=r"image_token_fraction must be a number in \[0, 1\]"):
        _plan(get_model_spec("qwen2.5-vl-7b"), image_token_fraction=1.5)
    text = get_model_spec("qwen2.5-7b")
    assert _plan(text).image_patches_per_micro_batch == 0 and not _plan(text).trains_vision
