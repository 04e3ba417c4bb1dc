"""GLM-4.5 (``Glm4MoeForCausalLM``) in process: the HF config -> megatron translation (partial rotary as
``rotary_percent``, q/k/v biases, per-head qk-norm by ``use_qk_norm``, DeepSeek-V3's router fields) with one clear error
per setting megatron cannot compute as transformers does; the weight mapping round-trips every tensor of a tiny
checkpoint at any TP / expert TP / EP / pipeline offset; the planner's spec counts exactly transformers' tensors, and
the built-in GLM-4.5-Air / GLM-4.5 specs against the published sizes. The transformers-parity checks with controls
are in tests/integration/test_models_glm4_moe.py."""

from __future__ import annotations

import pytest
import torch
from test_models_glm4_moe import glm_config, make_glm_model


@pytest.fixture(scope="module")
def tiny():
    cfg = glm_config()
    model = make_glm_model(cfg, seed=3)
    return cfg.to_dict(), model


def test_glm4_moe_config_translation():
    """Every GLM-4.5 feature lands on the megatron field that computes it: rotary_percent 0.5 (from rope_parameters,
    from the top level of a hub config.json, and transformers' default when absent), q/k/v biases without other
    linear biases, qk-norm from use_qk_norm, sigmoid routing with the expert bias, groups, scaling, the ungated
    shared expert and the dense first layer."""
    from megatron_rlvr.models.hf_config import megatron_model_args

    cfg = glm_config().to_dict()
    a = megatron_model_args(cfg, tp_size=2, ep_size=2, etp_size=1)
    c = a.config
    assert type(c).__name__ == "TransformerConfig" and a.rope.percent == 0.5 and a.rope.kind == "default"
    assert c.add_qkv_bias and not c.add_bias_linear and c.qk_layernorm and not c.rotary_interleaved
    assert (c.kv_channels, c.num_query_groups, c.num_attention_heads) == (32, 2, 4)
    assert c.moe_layer_freq == [0, 1, 1] and a.dims.moe_layers == (False, True, True)
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_bias_update_rate == 0.0 and c.moe_router_pre_softmax is False
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert c.moe_shared_expert_intermediate_size == 32 and not c.moe_shared_expert_gate
    assert a.dims.qkv_bias and a.dims.qk_layernorm and a.dims.expert_bias and not a.dims.shared_expert_gate
    assert c.sequence_parallel  # MoE at TP > 1
    assert a.hf_config == cfg  # exported verbatim, partial_rotary_factor included
    # a hub config.json: rope_theta and partial_rotary_factor at the top level, no rope_parameters, n_group 1
    hub = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    hub |= {"rope_theta": 1e6, "rope_scaling": None, "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1}
    hub |= {"use_qk_norm": False, "routed_scaling_factor": 1.0}
    h = megatron_model_args(hub)
    assert (h.rope.percent, h.rope.theta, h.config.moe_router_num_groups) == (0.5, 1e6, None)
    assert h.config.moe_router_topk_scaling_factor is None and not h.config.qk_layernorm and not h.dims.qk_layernorm
    # no factor anywhere: transformers' Glm4MoeConfig fills in 0.5
    assert megatron_model_args({k: v for k, v in hub.items() if k != "partial_rotary_factor"}).rope.percent == 0.5
    full = hub | {"partial_rotary_factor": 1.0}
    assert megatron_model_args(full).rope.percent == 1.0


@pytest.mark.parametrize(
    "change,message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_experts_per_tok": 1}, "norm_topk_prob"),
        ({"num_experts_per_tok": 4}, "num_experts_per_tok == 2 \\* topk_group"),
        ({"n_group": 3}, "n_group=3 must split"),
        ({"partial_rotary_factor": 0.3}, "partial_rotary_factor=0.3 must rotate an even number"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'linear'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"scoring_func": "softmax"}, "scoring_func"),
    ],
)
def test_glm4_moe_refusals_name_the_field(change, message):
    """A GLM-4.5 setting that megatron would compute differently from transformers is one ValueError naming the
    field (sigmoid weights not renormalised, group scores from a top other than 2, groups that do not split the
    experts, a partial rotary factor giving an odd rotated width, rope scaling together with partial rotary)."""
    from megatron_rlvr.models.hf_config import megatron_model_args

    cfg = glm_config().to_dict()
    if "partial_rotary_factor" in change:
        cfg["rope_parameters"] = {k: v for k, v in cfg["rope_parameters"].items() if k != "partial_rotary_factor"}
    if "rope_parameters" in change:
        cfg.pop("partial_rotary_factor")
    with pytest.raises(ValueError, match=message):
        megatron_model_args(cfg | change)


def test_partial_rotary_refused_for_families_that_rotate_whole_heads():
    """Only a family that declares partial rotary takes it: Qwen3 with partial_rotary_factor 0.5 is refused."""
    from transformers import Qwen3Config

    from megatron_rlvr.families.table import FAMILIES, rotary_fraction
    from megatron_rlvr.models.hf_config import megatron_model_args

    q = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, architectures=["Qwen3ForCausalLM"]).to_dict()  # fmt: skip
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        megatron_model_args(q | {"partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for qwen3"):
        rotary_fraction(q | {"partial_rotary_factor": 0.5}, FAMILIES["Qwen3ForCausalLM"])


@pytest.mark.parametrize("tp", [1, 2])
def test_glm4_moe_mapping_round_trips_at_any_layout(tiny, tp):
    """Every HF tensor of the tiny checkpoint (q/k/v weights and biases, q_norm / k_norm, the router and its fp32
    bias, experts, the shared expert, the dense first layer) -> megatron shards (sliced reads) -> HF again, bit for
    bit, at TP (and expert TP) ``tp``; routed experts land on the EP rank that owns them at EP 1, 2, 4, 8; names
    resolve to global layers at a pipeline offset."""
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.mapping import TensorSlice, WeightMapping, gather_tp, read_local_shard, unfuse_experts

    cfg, model = tiny
    state = {k: v.detach() for k, v in model.state_dict().items()}
    dims = megatron_model_args(cfg).dims
    hf = unfuse_experts(state)
    mapping = WeightMapping(dims)
    assert sorted(mapping.hf_names()) == sorted(hf)
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.2.self_attn.k_norm.weight"} <= set(hf)
    reader = lambda name: TensorSlice(hf[name])  # noqa: E731
    seen = set()
    for p in mapping.all_params():
        full = p.from_hf(hf, tp)
        shards = [read_local_shard(p, reader, r, tp) for r in range(tp)]
        for r in range(tp):
            assert torch.equal(shards[r], p.shard(full, r, tp)), (p.megatron_name, r)
        for name, t in p.to_hf(gather_tp(shards, p.tp_dim), tp).items():
            assert torch.equal(t, hf[name]) and t.dtype == hf[name].dtype, (p.megatron_name, name)
            seen.add(name)
    assert seen == set(hf)
    for ep in (1, 2, 4, 8):
        owned = sorted(
            mapping.resolve(f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight", 0, r * 8 // ep).expert
            for r in range(ep)
            for j in range(8 // ep)
        )
        assert owned == list(range(8))
    p = mapping.resolve("decoder.layers.0.mlp.router.expert_bias", layer_offset=2)
    assert p.hf_names == ("model.layers.2.mlp.gate.e_score_correction_bias",)
    with pytest.raises(KeyError):  # the dense first layer has no router
        mapping.resolve("decoder.layers.0.mlp.router.expert_bias", layer_offset=0)


def test_glm4_moe_plan_specs_count_every_parameter_and_the_published_totals(tiny):
    """The planner's ModelSpec of a GLM-4.5 config counts exactly the tensors transformers holds (the tiny model:
    parameters + the router bias buffers, q/k/v biases and qk-norms included; active = total minus the idle routed
    experts). The built-in specs against the published sizes, which count without the embeddings for the active
    figure: GLM-4.5-Air 106.85 B (published 106 B), 12.18 B active without the two embedding matrices (12 B);
    GLM-4.5 352.80 B (published 355 B: 0.6 % off), 32.08 B active without embeddings (32 B). The checkpoints'
    multi-token-prediction layer is not counted (the policy is the causal LM; it is skipped on load)."""
    from megatron_rlvr.families.table import get_model_spec, model_spec_from_hf_config

    cfg, model = tiny
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    total = sum(p.numel() for p in model.parameters()) + bias
    spec = model_spec_from_hf_config(cfg)
    assert spec.qkv_bias and spec.qk_norm and spec.router_bias and spec.head_dim == 32
    assert spec.param_count() == total
    idle = 2 * (8 - 2) * 3 * 64 * 32  # 2 MoE layers x 6 idle experts x (gate, up, down) of 64 x 32
    assert spec.active_param_count() == total - idle
    air, big = get_model_spec("zai-org/GLM-4.5-Air"), get_model_spec("zai-org/GLM-4.5")
    assert not air.qk_norm and big.qk_norm
    assert 106.8e9 < air.param_count() < 106.9e9
    assert 12.1e9 < air.active_param_count() - 2 * 151552 * 4096 < 12.2e9
    assert 352.7e9 < big.param_count() < 352.9e9 and abs(big.param_count() / 355e9 - 1) < 0.01
    assert 32.0e9 < big.active_param_count() - 2 * 151552 * 5120 < 32.1e9
    assert air.kv_cache_elems_per_token(1) == 2 * 46 * 8 * 128 and big.kv_cache_elems_per_token(8) == 2 * 92 * 128
