"""HF models in megatron: tiny random Llama (Llama-3 rope scaling, 4 layers), Qwen2 (QKV bias, tied embeddings,
sharded safetensors index) and Qwen3 (q/k norm, head_dim != hidden/heads) give transformers' logits (fp32, relative
error < 1e-4) at (TP, PP) = (1,1), (2,1), (1,2), (2,2) on 4 gloo ranks, through megatron's pipeline schedule; the
HF -> megatron -> HF export is bit-identical tensor by tensor and reloads in transformers; bad configs and layouts
raise ValueErrors naming the problem. The reference is transformers' own forward on the same weights.
"""

from __future__ import annotations

import os

import pytest
import torch

VOCAB = 300  # not a multiple of 128: TP padding (384 at TP=1, 512 at TP=2) is exercised
SEQ = 11
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "llama": LlamaConfig(
            **common,
            num_hidden_layers=4,
            tie_word_embeddings=False,
            # small original context so the llama3 wavelength bands fall inside head_dim=16's frequencies
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            architectures=["LlamaForCausalLM"],
        ),
        "qwen2": Qwen2Config(
            **common,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            architectures=["Qwen2ForCausalLM"],
        ),
        "qwen3": Qwen3Config(
            **common,
            num_hidden_layers=2,
            head_dim=24,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            architectures=["Qwen3ForCausalLM"],
        ),
    }


def _make_model(name, cfg, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random (HF inits norms to 1 and biases to 0: a mapping slip would hide)
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{family: (folder, input_ids [2, SEQ], reference logits [2, SEQ, VOCAB])}."""
    out = {}
    for i, (name, cfg) in enumerate(_configs().items()):
        model = _make_model(name, cfg, seed=10 + i)
        folder = tmp_path_factory.mktemp(f"hf_{name}")
        # qwen2 is saved as a sharded checkpoint with an index, the others as one model.safetensors
        model.save_pretrained(folder, max_shard_size="60KB" if name == "qwen2" else "5GB")
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            ref = model(ids).logits.float()
        out[name] = (str(folder), ids, ref)
    assert os.path.isfile(os.path.join(out["qwen2"][0], "model.safetensors.index.json"))
    return out


def _rank_parity(models: dict, export_root: str) -> dict:
    """On every rank of the current layout: build each family, load HF weights (sliced), forward through the
    schedule, export back to HF. Returns logits (last stage only) and a bf16 check at TP=2, PP=1."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.build import build_gpt_model, forward_logits
    from megatron_rlvr.models.export import export_hf
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    out = {}
    for name, (folder, ids, _) in models.items():
        args = megatron_model_args(folder, tp_size=tp, pp_size=pp)
        model = build_gpt_model(args)
        load_hf_weights(model, args, folder)
        model.eval()
        logits = forward_logits(model, [ids[:1], ids[1:]], vocab_size=args.dims.vocab_size)  # 2 micro-batches
        out[name] = None if logits is None else torch.cat(logits, 0)
        export_dir = os.path.join(export_root, f"{name}_tp{tp}_pp{pp}")
        # tiny shard limit: several shards + index; qwen2 is written as one file
        export_hf(model, args, export_dir, source_dir=folder, max_shard_bytes=10**9 if name == "qwen2" else 40_000)
        out[f"{name}_export"] = export_dir
        out[f"{name}_padded_vocab"] = args.dims.padded_vocab_size
        if name == "qwen3" and (tp, pp) == (2, 1):
            args16 = megatron_model_args(folder, tp_size=tp, pp_size=pp, dtype=torch.bfloat16)
            m16 = build_gpt_model(args16)
            load_hf_weights(m16, args16, folder)
            m16.eval()
            out["qwen3_bf16"] = forward_logits(m16, ids, vocab_size=args16.dims.vocab_size)[0]
            out["qwen3_bf16_dtype"] = next(m16.parameters()).dtype
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_match_transformers_and_export_roundtrips(dist_pool, hf_models, tmp_path, tp, pp):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    results = dist_pool.run(_rank_parity, tp=tp, pp=pp, args=(hf_models, str(tmp_path)), timeout=240)
    last = [r for r in results if r["llama"] is not None]
    assert len(last) == 4 // pp, "logits must come back from the last pipeline stage only"
    for name, (folder, ids, ref) in hf_models.items():
        assert results[0][f"{name}_padded_vocab"] == 128 * tp * (-(-VOCAB // (128 * tp)))
        for r in last:
            assert r[name].shape == ref.shape
            err = _rel(r[name], ref)
            assert err < 1e-4, f"{name} at TP={tp} PP={pp}: relative logits error {err:.2e}"
        # export: bit-identical tensors, same names, and transformers reloads it unchanged
        exported = results[0][f"{name}_export"]

        def tensors(d):
            files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
            out = {}
            for f in files:
                out.update(load_file(os.path.join(d, f)))
            return out, files

        src, _ = tensors(folder)
        dst, files = tensors(exported)
        assert sorted(src) == sorted(dst)
        for k in src:
            assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), f"{name}: {k} differs after export"
        if name == "qwen2":  # fits in one shard; each pipeline stage writes its own shard files
            assert files == ["model.safetensors"] if pp == 1 else len(files) == pp
        else:
            assert len(files) > 1 and os.path.isfile(os.path.join(exported, "model.safetensors.index.json"))
        if (tp, pp) == (2, 2):  # reload once per family: identical weights -> identical logits
            reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
            with torch.no_grad():
                assert torch.equal(reloaded(ids).logits, ref)
            assert os.path.isfile(os.path.join(exported, "generation_config.json"))
    if (tp, pp) == (2, 1):
        bf16 = [r["qwen3_bf16"] for r in results if r.get("qwen3_bf16") is not None]
        assert bf16 and results[0]["qwen3_bf16_dtype"] == torch.bfloat16
        err = _rel(bf16[0], hf_models["qwen3"][2])
        assert err < 3e-2, f"bf16 logits too far from fp32 transformers: {err:.2e}"


# --------------------------------------------------------------------------------------------------------------------
# Config translation and its errors (single process)
# --------------------------------------------------------------------------------------------------------------------


def _cfg(name, **changes):
    d = _configs()[name].to_dict()
    d.update(changes)
    return d


def test_config_translation_per_family():
    from megatron_rlvr.models.hf_config import megatron_model_args

    a = megatron_model_args(_cfg("llama"), tp_size=2)
    assert a.rope.kind == "llama3" and a.rope.original_max_position_embeddings == 64 and a.rope.factor == 8.0
    assert a.config.num_query_groups == 2 and a.config.kv_channels == 16 and a.config.gated_linear_unit
    assert not a.config.add_qkv_bias and not a.config.qk_layernorm and a.config.layernorm_epsilon == 1e-5
    assert a.dims.padded_vocab_size == 512 and not a.dims.tie_word_embeddings
    q2 = megatron_model_args(_cfg("qwen2"), vocab_multiple=64)
    assert q2.config.add_qkv_bias and q2.dims.tie_word_embeddings and q2.rope.theta == 1e6
    assert q2.dims.padded_vocab_size == 320
    q3 = megatron_model_args(_cfg("qwen3"))
    assert q3.config.qk_layernorm and q3.config.kv_channels == 24 and not q3.config.add_qkv_bias
    # legacy config.json spelling (rope_theta + rope_scaling at top level) is understood too
    legacy = _cfg("llama")
    legacy.pop("rope_parameters")
    legacy.update(
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    la = megatron_model_args(legacy)
    assert la.rope.theta == 5e5 and la.rope.kind == "llama3" and la.rope.factor == 32.0


def test_llama3_inv_freq_matches_transformers():
    """Our rope scaling (megatron's _apply_scaling with every HF parameter) equals transformers' llama3 inv_freq."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rlvr.models.build import _apply_rope_scaling
    from megatron_rlvr.models.hf_config import megatron_model_args

    cfg = _configs()["llama"]
    args = megatron_model_args(cfg.to_dict())

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=object()
            )

    h = Holder()
    _apply_rope_scaling(h, args)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**cfg.to_dict()), "cpu")
    assert torch.allclose(h.rotary_pos_emb.inv_freq, hf_inv.float(), rtol=1e-6, atol=0)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(hf_inv.float(), plain), "the test config must actually rescale some frequencies"


@pytest.mark.parametrize(
    "changes,kwargs,match",
    [
        (dict(architectures=["GPT2LMHeadModel"]), {}, "not supported"),
        (dict(architectures=None), {}, "not supported"),
        ({}, dict(tp_size=3), "does not divide num_attention_heads=4"),
        ({}, dict(tp_size=4), r"does not divide num_query_groups \(num_key_value_heads\)=2"),
        ({}, dict(pp_size=3), "does not divide num_hidden_layers=4"),
        ({}, dict(tp_size=2, padded_vocab_size=301), "does not divide padded_vocab_size=301"),
        ({}, dict(padded_vocab_size=200), "padded_vocab_size=200 < vocab_size=300"),
        (dict(hidden_act="gelu"), {}, "hidden_act"),
        (dict(attention_bias=True), {}, "attention_bias"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), {}, "original_max_position"),
        ({}, dict(vocab_multiple=0), "vocab padding multiple"),
    ],
)
def test_bad_configs_and_layouts_raise(changes, kwargs, match):
    from megatron_rlvr.models.hf_config import megatron_model_args

    with pytest.raises(ValueError, match=match):
        megatron_model_args(_cfg("llama", **changes), **kwargs)


def test_qwen_sliding_window_rejected():
    from megatron_rlvr.models.hf_config import megatron_model_args

    with pytest.raises(ValueError, match="use_sliding_window"):
        megatron_model_args(_cfg("qwen2", use_sliding_window=True, sliding_window=16))
