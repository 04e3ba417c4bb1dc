"""LoRA policy -> vLLM, both sync modes (rollout/lora_sync.py), on 2 gloo ranks: megatron TP=2 with adapters on
every target, one vLLM engine per rank (vLLM TP=1, ``enable_lora``). Adapter sync (base once, then a PEFT folder
through ``LoRARequest``, reloaded in place) and merged sync (W + (alpha/r) B A through the weight stream) give the
same samples and log-probs, both match an fp64 transformers forward of the merged weights, and an in-place reload
serves the NEW adapter (prefix cache reset). Prints the timings that chose ``merged`` as the default."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from megatron_rlvr.config.lora_config import LORA_TARGETS, LoRAConfig

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1"
VOCAB, RANK = 300, 8


@pytest.fixture(scope="module")
def vllm_pool():
    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable")
        pytest.skip("vllm is not installed")
    from megatron_rlvr.testing.distributed import DistributedPool

    pool = DistributedPool(world_size=2)
    yield pool
    pool.close()


def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention needs 32, 64, ...
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["Qwen2ForCausalLM"],
    )


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                (1.0 if "norm" in name else 0.0) + (0.2 if "norm" in name else 0.12) * torch.randn(p.shape, generator=g)
            )
    folder = tmp_path_factory.mktemp("vllm_lora_base")
    model.save_pretrained(folder)
    return str(folder)


def _merged_state(folder: str, peft: dict, scale: float) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name, w in load_file(f"{folder}/model.safetensors").items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a = peft.get(f"{stem}.lora_A.weight")
        out[name] = w + scale * peft[f"{stem}.lora_B.weight"] @ a if a is not None else w
    return out


def _hf_err(state: dict, outs) -> float:
    """max |engine log-prob - fp64 transformers log-prob| on the given weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float64).eval()
    model.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    worst = 0.0
    with torch.no_grad():
        for o in outs:
            for c in o.completions:
                ids = torch.tensor([o.prompt_token_ids + c.token_ids])
                lp = torch.log_softmax(model(ids).logits[0], -1)[len(o.prompt_token_ids) - 1 : -1]
                ref = lp.gather(-1, ids[0, len(o.prompt_token_ids) :, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def _rank_adapter_vs_merged(folder: str, pefts: list) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.megatron.policy import build_model
    from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
    from megatron_rlvr.models.lora import load_peft_tensors, lora_container
    from megatron_rlvr.models.source import ModelSource
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.lora_sync import AdapterSync, adapter_engine_kwargs
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine
    from megatron_rlvr.trainer.weights import sync_weights

    pg = ProcessGroupCollection.use_mpu_process_groups()
    args = megatron_model_args(folder, tp_size=pg.tp.size())
    lora = LoRAConfig(rank=RANK, alpha=16.0, sync="adapter")
    model = build_model(args, ModelSource(load_hf_config(folder), folder, None, False), 0, pg, lora=lora)
    load_peft_tensors(model, pefts[0])
    cfg = VLLMEngineConfig(
        dtype="float32", max_model_len=256, max_num_seqs=8, extra_llm_kwargs=adapter_engine_kwargs(lora)
    )
    engine = VLLMRolloutEngine(_hf_config(), config=cfg)
    g = torch.Generator().manual_seed(3)
    # 140-token prompts: longer than one KV block, so a stale prefix cache would serve the old adapter's states
    prompts = [torch.randint(3, VOCAB, (140,), generator=g).tolist() for _ in range(3)]
    sp = SamplingParams(n=2, max_tokens=8, seed=17, ignore_eos=True)
    res = {}
    adapters = AdapterSync(engine)
    try:
        container = lora_container(model)
        t = time.perf_counter()
        res["adapter_first_sync"] = sync_weights(engine, model, args, pg, adapters)
        res["adapter_first_sync_s"] = time.perf_counter() - t
        t = time.perf_counter()
        res["adapter"] = engine.generate(prompts, sp)
        res["adapter_generate_s"] = time.perf_counter() - t
        load_peft_tensors(model, pefts[1])  # an update: the same adapter id reloaded in place
        res["adapter_sync"] = sync_weights(engine, model, args, pg, adapters)
        res["adapter_new"] = engine.generate(prompts, sp)
        container.cfg = LoRAConfig(rank=RANK, alpha=16.0, sync="merged")
        engine.lora_request = None
        t = time.perf_counter()
        sync_weights(engine, model, args, pg)
        res["merged_sync_s"] = time.perf_counter() - t
        t = time.perf_counter()
        res["merged"] = engine.generate(prompts, sp)
        res["merged_generate_s"] = time.perf_counter() - t
    finally:
        lora_dir = adapters.folder
        adapters.close()
        engine.close()
    res["adapter_dir_removed"] = lora_dir is not None and not os.path.exists(lora_dir)
    return res


def test_adapter_sync_and_merged_sync_agree(vllm_pool, base_folder):
    from test_models_lora import random_peft

    from megatron_rlvr.models.hf_config import load_hf_config

    hf = load_hf_config(base_folder)
    pefts = [random_peft(hf, LORA_TARGETS, RANK, seed=s) for s in (1, 2)]
    scale = 16.0 / RANK
    results = vllm_pool.run(_rank_adapter_vs_merged, tp=2, args=(base_folder, pefts), timeout=600)
    old, new = _merged_state(base_folder, pefts[0], scale), _merged_state(base_folder, pefts[1], scale)
    for r in results:
        err_adapter_old = _hf_err(old, r["adapter"])
        err_adapter_new = _hf_err(new, r["adapter_new"])
        err_merged = _hf_err(new, r["merged"])
        stale = _hf_err(old, r["adapter_new"])
        same = [[c.token_ids for c in o.completions] for o in r["merged"]] == [
            [c.token_ids for c in o.completions] for o in r["adapter_new"]
        ]
        diff = max(
            abs(a - b)
            for oa, ob in zip(r["adapter_new"], r["merged"])
            for ca, cb in zip(oa.completions, ob.completions)
            for a, b in zip(ca.logprobs, cb.logprobs)
        )
        print(
            f"\nadapter vs HF merged {err_adapter_old:.2e} (after in-place reload {err_adapter_new:.2e}); merged sync "
            f"vs HF {err_merged:.2e}; adapter vs merged log-probs {diff:.2e}, same tokens {same}; sync s: adapter "
            f"first {r['adapter_first_sync_s']:.3f}, adapter {r['adapter_sync']['sync/time_s']:.3f}, merged "
            f"{r['merged_sync_s']:.3f}; generate s: adapter {r['adapter_generate_s']:.3f}, merged "
            f"{r['merged_generate_s']:.3f}"
        )
        assert err_adapter_old < 1e-4 and err_adapter_new < 1e-4 and err_merged < 1e-4
        assert stale > 1e-2, "the reloaded adapter must replace the old one"
        assert same and diff < 1e-4
        assert r["adapter_dir_removed"], "close() must remove the adapter folder (it lives in /dev/shm)"


@pytest.mark.vllm
def test_bench_lora_sync_tool_runs_both_modes_on_the_same_policy():
    """tools/bench_lora_sync.py on the tiny preset, 2 rounds: both modes serve the same policy (its exit code) and
    the last line carries the timings with the ratio last."""
    import subprocess
    import sys
    from pathlib import Path

    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable")
        pytest.skip("vllm is not installed")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "tools" / "bench_lora_sync.py"), "--model", "tiny", "--rounds", "2"]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    kv = dict(item.split("=", 1) for item in last.split())
    assert kv["same_tokens"] == "True" and float(kv["max_logprob_diff"]) < 1e-4 and kv["rounds"] == "2"
    assert float(kv["merged_sync_ms"]) > 0 and float(kv["adapter_sync_ms"]) > 0
    assert last.split()[-1].startswith("adapter_over_merged=")
