"""GPT-OSS in-process checks: HF config -> megatron fields and the refusals, the weight mapping's round trip of every
tensor at any expert TP / EP / PP offset (gate/up de-interleaved, experts sliced out of the fused tensors and stacked
back), the planner's counts (the tiny model's tensors; the published gpt-oss-20b / 120b totals), and an MXFP4
checkpoint read as its dequantised values."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_models_gpt_oss import _config, _make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf config dict, transformers' in-memory state (experts fused), saved folder)."""
    cfg = _config()
    model = _make_model(cfg, seed=43)
    folder = tmp_path_factory.mktemp("gpt_oss_units")
    model.save_pretrained(folder)
    return cfg.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}, str(folder)


def test_gpt_oss_config_translation_and_refusals(tiny):
    """HF config -> megatron fields: sinks (learnable softmax offset), window (w - 1, 0) on the sliding layers only,
    biases, quick_gelu gated with up + 1 and the clamp, the renormalised top-k router, YaRN attributes with
    truncate=false, expert TP 1; one clear error per setting megatron cannot compute as transformers does."""
    from megatron_rlvr.models.hf_config import megatron_model_args, quick_gelu_eager

    cfg, *_ = tiny
    a = megatron_model_args(cfg, tp_size=2, ep_size=2)
    c = a.config
    assert (c.softmax_type, c.window_size, c.window_attn_skip_freq) == ("learnable", (7, 0), [1, 0, 1, 0])
    assert c.add_bias_linear and c.add_qkv_bias and c.gated_linear_unit
    assert c.activation_func is quick_gelu_eager and (c.glu_linear_offset, c.activation_func_clamp_value) == (1.0, 7.0)
    x = torch.linspace(-5, 5, 11)
    assert torch.equal(c.activation_func(x), x * torch.sigmoid(1.702 * x))
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_layer_freq) == (8, 2, 32, 1)
    assert c.moe_router_score_function == "softmax" and c.moe_router_pre_softmax is False
    assert c.expert_tensor_parallel_size == 1 and c.sequence_parallel and not c.moe_grouped_gemm
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings) == (4.0, 32)
    assert (c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_correction_range_round_to_int) == (32.0, 1.0, False)
    assert c.yarn_mscale is None and c.yarn_mscale_all_dim is None  # attention factor 0.1 ln(4) + 1
    assert (a.rope.kind, a.rope.theta, c.layernorm_epsilon) == ("yarn", 150000.0, 1e-5)
    assert a.dims.gpt_oss and a.dims.qkv_bias and a.dims.moe_layers == (True,) * 4
    # any pattern of sliding layers is a per-layer list; none: no window at all
    odd = megatron_model_args(cfg | {"layer_types": ["full_attention", "sliding_attention"] * 2}).config
    assert odd.window_attn_skip_freq == [0, 1, 0, 1]
    assert megatron_model_args(cfg | {"layer_types": ["full_attention"] * 4}).config.window_size is None
    plain = cfg | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert not hasattr(megatron_model_args(plain).config, "yarn_rotary_scaling_factor")
    no_theta = {k: v for k, v in cfg.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default"}}
    assert megatron_model_args(no_theta).rope.theta == 150000.0  # transformers' GptOssConfig default, not 1e4
    bad = {
        "swiglu_alpha": (1.5, "swiglu_alpha=1.5 is not supported"),
        "attention_bias": (False, "attention_bias=False"),
        "layer_types": (["sliding_attention"] * 3, "layer_types must list 4 entries"),
        "sliding_window": (None, "sliding_window >= 1"),
        "rope_parameters": (cfg["rope_parameters"] | {"attention_factor": 1.1}, "attention_factor"),
        "quantization_config": ({"quant_method": "fp8"}, "quant_method='fp8'"),
        "num_experts_per_tok": (9, "num_experts_per_tok=9"),
    }
    for name, (value, msg) in bad.items():
        with pytest.raises(ValueError, match=msg):
            megatron_model_args(cfg | {name: value})
    with pytest.raises(ValueError, match="rope type 'linear' is not supported for gpt_oss"):
        megatron_model_args(cfg | {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="expert TP 1"):
        megatron_model_args(cfg, tp_size=2, etp_size=2)
    mx = megatron_model_args(cfg | {"quantization_config": {"quant_method": "mxfp4"}})
    assert mx.dims.gpt_oss


@pytest.mark.parametrize("etp", [1, 2])
def test_gpt_oss_mapping_round_trips_at_any_layout(tiny, etp):
    """Every tensor of transformers' state -> megatron shards (sliced reads of the fused experts) -> HF again, bit for
    bit, the expert slices stacked back into transformers' fused [E, ...] tensors, at TP 2 and expert TP ``etp`` (the
    transforms are written for any expert TP; megatron itself builds biased experts at 1 only); megatron's fc1 rows
    are [gate; up] per expert-TP rank (HF interleaves them); experts land on the EP rank that owns them at EP 1, 2,
    4, 8; pipeline offsets give global layers."""
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.mapping import (
        TensorSlice,
        WeightMapping,
        checkpoint_names,
        fused_expert_reader,
        gather_tp,
        read_local_shard,
        stack_fused_experts,
    )

    cfg, state, _ = tiny
    dims = megatron_model_args(cfg).dims
    mapping = WeightMapping(dims)
    assert sorted(checkpoint_names(mapping.hf_names())) == sorted(state)
    reader = fused_expert_reader(lambda name: TensorSlice(state[name]), state.keys())
    produced = []
    for p in mapping.all_params():
        size = etp if p.per_expert else 2
        hf = {n: reader(n)[...] for n in p.hf_names}
        full = p.from_hf(hf, size)
        shards = [read_local_shard(p, reader, r, size) for r in range(size)]
        for r in range(size):
            assert torch.equal(shards[r], p.shard(full, r, size)), (p.megatron_name, r)
        produced.extend(p.to_hf(gather_tp(shards, p.tp_dim), size).items())
        if p.megatron_name == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight":
            inner = dims.moe_ffn_hidden_size // etp
            gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][3]  # [H, 2F], gate = even columns
            rank0 = shards[0]
            assert torch.equal(rank0[:inner], gate_up[:, 0 : 2 * inner : 2].t())
            assert torch.equal(rank0[inner:], gate_up[:, 1 : 2 * inner : 2].t())
    back = dict(stack_fused_experts(iter(produced), dims.num_experts))
    assert sorted(back) == sorted(state)
    assert [k for k in state if not (torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype)] == []
    for ep in (1, 2, 4, 8):
        name = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.bias"
        owned = sorted(
            mapping.resolve(name.format(j), 0, r * 8 // ep).expert for r in range(ep) for j in range(8 // ep)
        )
        assert owned == list(range(8))
    p = mapping.resolve("decoder.layers.0.self_attention.core_attention.softmax_offset", layer_offset=3)
    assert p.hf_names == ("model.layers.3.self_attn.sinks",) and p.tp_dim == 0
    p = mapping.resolve("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.bias", layer_offset=2, expert_offset=4)
    assert p.hf_names == ("model.layers.3.mlp.experts.5.down_proj_bias",)
    with pytest.raises(RuntimeError, match="only 7 of 8 experts"):
        list(stack_fused_experts(((n, t) for n, t in produced if n != p.hf_names[0]), dims.num_experts))


def test_gpt_oss_plan_counts_every_tensor_and_the_published_totals(tiny):
    """The planner's spec of a GPT-OSS config counts exactly transformers' parameters (sinks and every bias
    included; active = total minus the idle experts with their biases), and the built-in specs give the model
    card's figures: gpt-oss-20b 20.91 B total / 3.61 B active, gpt-oss-120b 116.83 B / 5.13 B, active counted
    without the input embedding as the card does."""
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.families.table import get_model_spec, model_spec_from_hf_config

    cfg, _, folder = tiny
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    total = sum(p.numel() for p in hf.parameters())
    spec = model_spec_from_hf_config(cfg)
    assert spec.param_count() == total and spec.attention_sinks and spec.linear_bias
    idle = 4 * (8 - 2) * (3 * 64 * 32 + 2 * 32 + 64)  # 4 layers x 6 idle experts x (gate, up, down + 3 biases)
    assert spec.active_param_count() == total - idle
    for name, want_total, want_active in (("openai/gpt-oss-20b", 2091, 361), ("openai/gpt-oss-120b", 11683, 513)):
        s = get_model_spec(name)
        emb = s.vocab * s.hidden
        assert round(s.param_count() / 1e7) == want_total, (name, s.param_count())
        assert round((s.active_param_count() - emb) / 1e7) == want_active, (name, s.active_param_count())


def _mxfp4_encode(rng: torch.Generator, experts: int, rows: int, cols: int):
    """Random MXFP4 codes for [experts, rows, cols] weights (rows = output dim) and their values, decoded here by the
    format's definition in float64: nibble n (low nibble first) is (-1)^(n >> 3) * (0, .5, 1, 1.5, 2, 3, 4, 6)[n & 7],
    times 2^(scale - 127) shared by 32 values. Returns (blocks, scales, values [experts, cols, rows])."""
    groups = cols // 32
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=rng, dtype=torch.uint8)
    scales = torch.randint(120, 131, (experts, rows, groups), generator=rng, dtype=torch.uint8)
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)

    def value(n):
        n = n.long()
        return torch.where(n >= 8, -1.0, 1.0).double() * mag[n & 7]

    codes = torch.stack([value(blocks & 0x0F), value(blocks >> 4)], dim=-1)  # [E, rows, G, 16, 2]
    vals = codes.reshape(experts, rows, groups, 32) * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return blocks, scales, vals.reshape(experts, rows, cols).transpose(1, 2)


@pytest.mark.parametrize("decoder", ["transformers", "own"])
def test_gpt_oss_mxfp4_checkpoint_loads_dequantised(tiny, tmp_path, monkeypatch, decoder):
    """A hub-style checkpoint whose experts are MXFP4 (``*_blocks`` / ``*_scales``, biases in full precision, config
    with quantization_config mxfp4), written here from codes chosen at random: the strict presence check accepts
    it, every expert reads as the values the codes define (decoded independently above, in float64), megatron's
    fc1 shard is their de-interleaved transpose, transformers' own loader reads the folder as the same values, and
    undecodable scales fail with one line naming the tensor.
    ``decoder``: transformers' dequantiser, or this project's own (used where transformers has none)."""
    from safetensors.torch import save_file

    from megatron_rlvr.models import mxfp4
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import _missing, _reader_for
    from megatron_rlvr.models.mapping import WeightMapping, read_local_shard

    if decoder == "own":
        monkeypatch.setattr(mxfp4, "_transformers_decoder", lambda: None)
    else:
        assert mxfp4._transformers_decoder() is not None
    cfg, state, _ = tiny
    cfg = cfg | {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}}
    rng = torch.Generator().manual_seed(3)
    hf, expected = {}, {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = t.shape  # transformers' [E, in, out]
            blocks, scales, vals = _mxfp4_encode(rng, experts, rows, cols)
            hf[name + "_blocks"], hf[name + "_scales"], expected[name] = blocks, scales, vals
        else:
            hf[name] = t
    save_file(hf, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = megatron_model_args(cfg)
    mapping = WeightMapping(args.dims)
    reader, closer = _reader_for(str(tmp_path))
    try:
        assert _missing(mapping.hf_names(), closer.names()) == set()
        for layer in range(4):
            for proj in ("gate_up_proj", "down_proj"):
                want = expected[f"model.layers.{layer}.mlp.experts.{proj}"]
                for e in range(8):
                    got = reader(f"model.layers.{layer}.mlp.experts.{e}.{proj}")[...]
                    assert got.dtype == torch.float32 and torch.equal(got.double(), want[e]), (layer, proj, e)
        p = mapping.resolve("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight")
        shard = read_local_shard(p, reader, 0, 1)
        gate_up = expected["model.layers.2.mlp.experts.gate_up_proj"][5]
        assert torch.equal(shard.double(), torch.cat([gate_up[:, ::2].t(), gate_up[:, 1::2].t()]))
    finally:
        closer.close()
    if decoder == "transformers":  # transformers' own loader reads the folder as the same values (the layout)
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()
        assert all(torch.equal(loaded[n].double(), v) for n, v in expected.items())
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.down_proj: .*cannot dequantise"):
        blocks = hf["model.layers.0.mlp.experts.down_proj_blocks"][0]
        mxfp4.dequantize_expert(
            blocks, torch.zeros(blocks.shape[:-1], dtype=torch.int32), "model.layers.0.mlp.experts.down_proj"
        )


def test_gpt_oss_per_expert_names_are_views_of_transformers_fused_experts(tiny):
    """What the weight stream sends for GPT-OSS (the table's per-expert slices, ``WeightMapping.hf_names()``) is
    exactly the set of names ``unfuse_experts`` gives a transformers GPT-OSS model (the transformers engine's refit
    view), each a view of the fused parameter with the slice's shape: copying model A's slices into model B's views
    makes B compute A's logits."""
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.mapping import TensorSlice, WeightMapping, fused_expert_reader, unfuse_experts

    cfg, state, _ = tiny
    names = WeightMapping(megatron_model_args(cfg).dims).hf_names()
    target = _make_model(_config(), seed=44)
    views = unfuse_experts(dict(target.named_parameters()))
    assert sorted(views) == sorted(names)
    reader = fused_expert_reader(lambda name: TensorSlice(state[name]), state.keys())
    ids = torch.randint(3, 160, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = target(ids).logits
        for n in names:
            src = reader(n)[...]
            assert views[n].shape == src.shape, n
            views[n].copy_(src)
        after = target(ids).logits
        source = _make_model(_config(), seed=43)  # the fixture's model: same seed, same weights
        want = source(ids).logits
    assert not torch.equal(before, want) and torch.equal(after, want)
