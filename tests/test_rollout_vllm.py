"""The vLLM engine. CPU part (always runs): bucketing of update streams, config validation, conversion of vLLM
outputs, the refusal of filtered log-probs. GPU part (@pytest.mark.gpu, run by tools/gpu_check.sh): a tiny random
Qwen2 built from a config in vllm==0.33.0 — generation, sampled-token log-probs against an fp32 transformers
recomputation on the same (bf16-valued) weights, seeds, sleep/wake with a weight update and prefix-cache reset, and
weight sync from a TP=2 megatron trainer into rollout-TP engines (rollout TP != training TP)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.rollout.engine import SamplingParams
from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine, _write_model_dir, as_buckets

# ----------------------------------------------------------------------------------------------------------------- CPU


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
    comp.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        VLLMRolloutEngine._convert([1], SimpleNamespace(outputs=[comp]), has_text=False)


def test_model_dir_needs_architectures(tmp_path):
    with pytest.raises(ValueError, match="architectures"):
        _write_model_dir({"model_type": "qwen2"})
    path, tmp = _write_model_dir({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 2})
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert os.path.isfile(os.path.join(path, "generation_config.json"))
    tmp.cleanup()
    assert _write_model_dir(str(tmp_path))[0] == str(tmp_path)


# ----------------------------------------------------------------------------------------------------------------- GPU


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64: supported by every vLLM attention backend
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
        architectures=["Qwen2ForCausalLM"],
    )


def _random_model(cfg, seed, device="cuda"):
    """fp32 HF model whose values are exactly representable in bf16 (the engine runs in bf16)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = 1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.06 * torch.randn_like(p)
            p.copy_(v.bfloat16().float())
    return model


def _reference_logprob_errors(model, outputs, temperature):
    errs = []
    for o in outputs:
        for c in o.completions:
            ids = torch.tensor([o.prompt_token_ids + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0].double()
            lp = torch.log_softmax(logits / temperature, -1)[len(o.prompt_token_ids) - 1 : -1]
            ref = lp.gather(-1, ids[0, len(o.prompt_token_ids) :, None])[:, 0]
            errs.append((ref.cpu() - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
    return torch.cat(errs)


PROMPTS = [[5, 6, 7, 8], [11, 12], [40, 41, 42, 43, 44, 45, 46]]


@pytest.mark.gpu
def test_vllm_engine_generate_logprobs_sleep_and_update():
    cfg = _qwen2_config()
    w1, w2 = _random_model(cfg, 1), _random_model(cfg, 2)
    engine = VLLMRolloutEngine(
        cfg,
        config=VLLMEngineConfig(
            gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=256, bucket_bytes=1 << 20
        ),
    )
    try:
        n = engine.update_weights((k, v.bfloat16()) for k, v in w1.named_parameters())
        assert n == len(list(w1.named_parameters()))
        sp = SamplingParams(n=3, temperature=0.9, max_tokens=16, seed=1)
        out = engine.generate(PROMPTS, sp)
        assert [len(o.completions) for o in out] == [3, 3, 3]
        for o in out:
            for c in o.completions:
                assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 16
                assert c.finish_reason == "length" or c.token_ids[-1] == 2
        err = _reference_logprob_errors(w1, out, 0.9)
        assert err.mean() < 0.03 and err.max() < 0.3, (err.mean(), err.max())  # bf16 engine vs fp32 reference
        again = engine.generate(PROMPTS, sp)
        assert [[c.token_ids for c in o.completions] for o in again] == [
            [c.token_ids for c in o.completions] for o in out
        ]
        with pytest.raises(ValueError, match="top_k/top_p"):
            engine.generate(PROMPTS, SamplingParams(top_p=0.9))

        free_before = torch.cuda.mem_get_info()[0]
        engine.sleep(2)
        assert torch.cuda.mem_get_info()[0] > free_before + (64 << 20), "sleep(2) must free the KV cache"
        with pytest.raises(RuntimeError, match="sleep"):
            engine.generate(PROMPTS, sp)
        engine.wake_up(["weights"])
        engine.update_weights((k, v.bfloat16()) for k, v in w2.named_parameters())
        engine.wake_up(["kv_cache"])
        out2 = engine.generate(PROMPTS, sp)  # same prompts: stale prefix-cache blocks would show up here
        err2 = _reference_logprob_errors(w2, out2, 0.9)
        assert err2.mean() < 0.03 and err2.max() < 0.3, (err2.mean(), err2.max())
        assert _reference_logprob_errors(w1, out2, 0.9).mean() > 5 * err2.mean(), "the new weights must be in use"
    finally:
        engine.close()


@pytest.mark.gpu
def test_hf_engine_on_cuda_matches_recomputation():
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _random_model(_qwen2_config(), 3)
    engine = HFRolloutEngine(model, config=HFEngineConfig(device="cuda"))
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=4))
    assert _reference_logprob_errors(model, out, 0.7).max() < 1e-4


def _rank_megatron_to_vllm(cfg_dict):
    """One rank: megatron trainer at TP=2 (weights on CPU, gloo), vLLM engine at a different rollout TP."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from transformers import Qwen2Config

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.loading import load_hf_weights
    from megatron_rlvr.models.mapping import WeightMapping
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, stream_hf_weights

    cfg = Qwen2Config(**cfg_dict)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    multi_gpu = torch.cuda.device_count() >= dist.get_world_size()
    rollout_tp = dist.get_world_size() if pg.tp.size() == 1 else 1
    if not multi_gpu:
        os.environ["LOCAL_RANK"] = "0"  # one GPU: both rollout engines (TP=1) share it
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ref = _random_model(cfg, 7, device="cpu")
    ref_sd = {n: p.detach().clone() for n, p in ref.named_parameters()}
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), pp_size=1, dtype=torch.float32)
    model = build_gpt_model(args).cpu()  # the stream runs over gloo on CPU, as in CI
    load_hf_weights(model, args, ref_sd)
    engine = VLLMRolloutEngine(
        cfg,
        config=VLLMEngineConfig(
            tensor_parallel_size=rollout_tp, gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=256
        ),
    )
    try:
        stats = StreamStats()
        stream = stream_hf_weights(
            model,
            WeightMapping(args.dims),
            tp_group=pg.tp,
            pp_group=pg.pp,
            config=WeightStreamConfig(1 << 20),
            stats=stats,
        )
        engine.update_weights([(n, t.bfloat16()) for n, t in b] for b in stream)
        out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=9))
        err = _reference_logprob_errors(ref.cuda(), out, 0.8)
        return dict(
            mean=err.mean().item(),
            max=err.max().item(),
            tokens=[[c.token_ids for c in o.completions] for o in out],
            rollout_tp=rollout_tp,
            train_tp=pg.tp.size(),
            buckets=stats.buckets,
        )
    finally:
        engine.close()


@pytest.mark.gpu
def test_weight_sync_from_megatron_at_a_different_rollout_tp():
    """Training TP=2 -> rollout TP=1 on one GPU (or training TP=1 -> rollout TP=2 on two GPUs)."""
    from megatron_rlvr.testing.distributed import run_distributed

    train_tp = 1 if torch.cuda.device_count() >= 2 else 2
    results = run_distributed(_rank_megatron_to_vllm, 2, tp=train_tp, args=(_qwen2_config().to_dict(),), timeout=500)
    for r in results:
        assert r["rollout_tp"] != r["train_tp"]
        assert r["buckets"] > 1
        assert r["mean"] < 0.03 and r["max"] < 0.3, r
    assert results[0]["tokens"] == results[1]["tokens"], "both ranks got the same weights and the same seed"
