"""The weight-mapping contract that loading, export and the rollout weight stream rely on, checked on random
tensors for every layout kind at TP = 1, 2, 4 (pure torch, no ranks):
- read_local_shard (sliced reads) == split_tp(from_hf(...)) for every rank, i.e. loading and streaming agree;
- to_hf(gather_tp(shards)) returns the HF tensors bit for bit;
- names: TE-spec aliases, wrapper prefixes and pipeline layer offsets resolve to the right HF names;
- the QKV layout is megatron's [q heads of group g | k_g | v_g] per group, checked against a hand-built example.
"""

import pytest
import torch

from megatron_rlvr.models.mapping import (
    ModelDims,
    TensorSlice,
    WeightMapping,
    gather_tp,
    read_local_shard,
    split_tp,
)


def _dims(**kw):
    base = dict(
        num_layers=4,
        hidden_size=8,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=3,
        ffn_hidden_size=12,
        vocab_size=50,
        padded_vocab_size=64,
        tie_word_embeddings=False,
        qkv_bias=True,
        qk_layernorm=True,
    )
    base.update(kw)
    return ModelDims(**base)


def _random_hf(mapping):
    d, g = mapping.dims, torch.Generator().manual_seed(0)
    shapes = {
        "embed_tokens.weight": (d.vocab_size, d.hidden_size),
        "lm_head.weight": (d.vocab_size, d.hidden_size),
        "q_proj.weight": (d.num_attention_heads * d.head_dim, d.hidden_size),
        "k_proj.weight": (d.num_query_groups * d.head_dim, d.hidden_size),
        "v_proj.weight": (d.num_query_groups * d.head_dim, d.hidden_size),
        "q_proj.bias": (d.num_attention_heads * d.head_dim,),
        "k_proj.bias": (d.num_query_groups * d.head_dim,),
        "v_proj.bias": (d.num_query_groups * d.head_dim,),
        "q_norm.weight": (d.head_dim,),
        "k_norm.weight": (d.head_dim,),
        "o_proj.weight": (d.hidden_size, d.num_attention_heads * d.head_dim),
        "gate_proj.weight": (d.ffn_hidden_size, d.hidden_size),
        "up_proj.weight": (d.ffn_hidden_size, d.hidden_size),
        "down_proj.weight": (d.hidden_size, d.ffn_hidden_size),
        "layernorm.weight": (d.hidden_size,),
        "norm.weight": (d.hidden_size,),
    }
    out = {}
    for name in mapping.hf_names():
        shape = next(s for suffix, s in shapes.items() if name.endswith(suffix))
        out[name] = torch.randn(shape, generator=g)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_shards_roundtrip_for_every_param(tp, tied):
    mapping = WeightMapping(_dims(tie_word_embeddings=tied))
    hf = _random_hf(mapping)
    reader = lambda name: TensorSlice(hf[name])
    seen = set()
    for p in mapping.all_params():
        full = p.from_hf(hf, tp)
        shards = [read_local_shard(p, reader, r, tp) for r in range(tp)]
        for r in range(tp):
            assert torch.equal(shards[r], p.shard(full, r, tp)), (p.megatron_name, r)
        back = p.to_hf(gather_tp(shards, p.tp_dim), tp)
        for name, t in back.items():
            assert torch.equal(t, hf[name]), (p.megatron_name, name)
            seen.add(name)
    assert seen == set(hf), "every HF tensor is produced exactly by some parameter"
    assert ("lm_head.weight" in seen) == (not tied)


def test_qkv_layout_by_hand():
    # 4 query heads, 2 groups, head_dim 1: megatron rows = [q0 q1 k0 v0 | q2 q3 k1 v1]
    d = _dims(num_attention_heads=4, num_query_groups=2, head_dim=1, hidden_size=1, qk_layernorm=False)
    p = WeightMapping(d).resolve("decoder.layers.0.self_attention.linear_qkv.bias")
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    full = p.from_hf([q, k, v], tp_size=2)
    assert full.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [s.tolist() for s in split_tp(full, 0, 2)] == [[0, 1, 10, 20], [2, 3, 11, 21]]


def test_gated_fc1_layout_by_hand():
    # each TP rank holds [gate rows of the rank; up rows of the rank]
    d = _dims(ffn_hidden_size=4, hidden_size=1)
    p = WeightMapping(d).resolve("decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = torch.arange(4.0).unsqueeze(1), 10 + torch.arange(4.0).unsqueeze(1)
    full = p.from_hf([gate, up], tp_size=2)
    assert full.squeeze(1).tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    assert p.from_hf([gate, up], tp_size=1).squeeze(1).tolist() == [0, 1, 2, 3, 10, 11, 12, 13]


def test_names_aliases_offsets_and_errors():
    m = WeightMapping(_dims())
    p = m.resolve("module.module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", layer_offset=2)
    assert p.hf_names == ("model.layers.3.input_layernorm.weight",) and p.global_layer == 3 and p.tp_dim is None
    p = m.resolve("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", layer_offset=1)
    assert p.hf_names == ("model.layers.1.post_attention_layernorm.weight",)
    assert m.resolve("decoder.layers.0.self_attention.linear_proj.weight").tp_dim == 1
    assert m.resolve("embedding.word_embeddings.weight").global_layer is None
    with pytest.raises(ValueError, match="outside"):
        m.resolve("decoder.layers.2.mlp.linear_fc2.weight", layer_offset=2)
    with pytest.raises(KeyError, match="no HF mapping"):
        m.resolve("decoder.layers.0.mlp.router.weight")
    tied = WeightMapping(_dims(tie_word_embeddings=True)).resolve("output_layer.weight")
    assert tied.skip_on_export and tied.hf_names == ("model.embed_tokens.weight",)
    with pytest.raises(KeyError):  # no q/k norm on a model without them
        WeightMapping(_dims(qk_layernorm=False)).resolve("decoder.layers.0.self_attention.q_layernorm.weight")
    with pytest.raises(ValueError, match="num_query_groups"):
        _dims().check_tp(8)
    with pytest.raises(ValueError, match="not a multiple"):
        _dims(num_query_groups=3)
