"""Layout planner: parameter counts and memory terms against hand-computed closed forms, layout validation,
config loading, and the CLI's exit codes. Pure Python, well under a second."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlvr.planner import (
    BUILTIN_SPECS,
    GIB,
    ClusterConfig,
    ModelSpec,
    ParallelConfig,
    PlanConfig,
    RolloutConfig,
    TrainConfig,
    activation_bytes_per_layer,
    estimate_memory,
    format_plan,
    get_model_spec,
    load_plan_config,
    model_spec_from_hf_config,
    plan_main,
    validate_layout,
)

REPO = Path(__file__).resolve().parents[2]

# Qwen/Qwen2.5-14B config.json: hidden 5120, intermediate 13824, 48 layers, 40 heads, 8 KV heads (head_dim 128),
# vocab 152064, untied LM head, Qwen2 attention has q/k/v biases, RMSNorm weights only.
H, F, L, A, KV, D, V = 5120, 13824, 48, 40, 8, 128, 152064


def qwen14b_layer_by_hand():
    q = H * (A * D) + A * D  # q_proj weight + bias
    k = H * (KV * D) + KV * D  # k_proj weight + bias
    v = H * (KV * D) + KV * D  # v_proj weight + bias
    o = (A * D) * H  # o_proj, no bias
    mlp = 3 * H * F  # gate_proj, up_proj, down_proj
    norms = 2 * H  # input_layernorm, post_attention_layernorm
    return q, k, v, o, mlp, norms


def test_qwen25_14b_param_count_closed_form():
    q, k, v, o, mlp, norms = qwen14b_layer_by_hand()
    total = V * H + L * (q + k + v + o + mlp + norms) + H + V * H  # embed + layers + final norm + lm_head
    assert total == 14_770_033_664
    assert abs(total / 1e9 - 14.77) < 0.005  # the published size
    assert get_model_spec("Qwen/Qwen2.5-14B-Instruct").param_count() == total


def _plan(model, tp, pp, rtp, nodes, gpn=8, **train):
    cfg = PlanConfig(
        model=model,
        parallel=ParallelConfig(tp=tp, pp=pp, rollout_tp=rtp),
        train=TrainConfig(**train),
        cluster=ClusterConfig(nodes=nodes, gpus_per_node=gpn, gpu_mem_gb=80),
    )
    return estimate_memory(cfg)


def test_qwen25_14b_per_gpu_weights_grads_optimizer_tp4_dp8():
    """TP=4, PP=1 on 32 GPUs: each GPU holds 1/4 of every matrix and bias, full copies of the norms, 1/4 of the
    (128*4-padded) vocab rows of embedding and LM head; bf16 weights 2 B, fp32 grads 4 B, optimizer 12 B / DP."""
    q, k, v, o, mlp, norms = qwen14b_layer_by_hand()
    tp, dp = 4, 8
    v_pad = -(-V // (128 * tp)) * (128 * tp)
    assert v_pad == V  # 152064 = 297 * 512: no padding needed at TP=4
    per_gpu = L * ((q + k + v + o + mlp) // tp + norms) + H + 2 * (v_pad * H // tp)
    plan = _plan(get_model_spec("qwen2.5-14b"), tp, 1, 2, nodes=4)
    assert plan.fits and plan.dp == dp
    c = plan.components
    assert c["weights"] == 2 * per_gpu
    assert c["grads"] == 4 * per_gpu
    assert c["optimizer"] == pytest.approx(12 * per_gpu / dp)
    # Megatron's "bf16 parameters, fp32 gradients: 6 + 12/d bytes per parameter" (distributed optimizer guide)
    assert c["weights"] + c["grads"] + c["optimizer"] == pytest.approx((6 + 12 / dp) * per_gpu)
    assert c["weights"] / GIB == pytest.approx(6.88, abs=0.01)


def test_qwen25_14b_vocab_padding_and_pipeline_stages_tp8_pp2():
    q, k, v, o, mlp, norms = qwen14b_layer_by_hand()
    tp, pp = 8, 2
    v_pad = 152576  # next multiple of 128 * 8 = 1024 above 152064
    assert get_model_spec("qwen2.5-14b").padded_vocab(tp) == v_pad
    layer = (q + k + v + o + mlp) // tp + norms
    first = (L // pp) * layer + v_pad * H // tp  # embedding on stage 0
    last = (L // pp) * layer + H + v_pad * H // tp  # final norm + LM head on the last stage
    plan = _plan(get_model_spec("qwen2.5-14b"), tp, pp, 2, nodes=4)
    assert plan.stage_param_counts == [first, last]
    assert plan.dp == 2


def test_activation_formula_reduces_to_korthikanti_for_gpt_shapes():
    """Korthikanti et al. 2022: a GPT layer stores 34 s*b*h (+ 5 a s^2 b) bytes; with flash attention (no s^2
    term) and without its two s*b*h dropout masks that is 32 s*b*h, divided by TP under sequence parallelism."""
    h = 1024
    gpt = ModelSpec(name="gpt", hidden=h, ffn=4 * h, layers=2, heads=16, kv_heads=16, vocab=1000, gated_mlp=False)
    tokens, tp = 4096, 4
    assert activation_bytes_per_layer(gpt, tokens, tp, sequence_parallel=True) == 32 * tokens * h // tp
    # without SP the paper's 10 s*b*h (here 8, no dropout mask) stay replicated and 24 are split
    assert activation_bytes_per_layer(gpt, tokens, tp, sequence_parallel=False) == tokens * (8 * h + 24 * h // tp)


def test_full_recompute_and_kv_cache_by_hand():
    m = get_model_spec("qwen2.5-14b")
    T = 16384
    plan = _plan(m, 4, 1, 2, nodes=4, micro_batch_tokens=T, recompute="full")
    # full recompute: each of the 48 layers keeps its input [T, h] bf16 sharded over TP (SP), plus one layer rebuilt
    per_layer_full = T * (8 * H + 4 * A * D + 4 * KV * D + 6 * F) // 4
    assert plan.components["act_full"] == L * (2 * T * H // 4) + per_layer_full
    assert plan.components["act_none"] == L * per_layer_full
    # vLLM at TP=2 keeps 8/2 = 4 KV heads per GPU: 2 (K, V) x 48 layers x 4 x 128 x 2 bytes per token
    kv_per_token = 2 * L * 4 * D * 2
    assert plan.kv_tokens == int(plan.components["kv_cache"] // kv_per_token)


def test_model_dtype_and_rollout_engine_are_planned():
    """model.dtype: fp32 holds weights, reference, activations, logits and the engine's weights and KV cache in 4 B
    (and needs no separate master copy); planned as bf16 a 7B fp32 run was said to fit. rollout.engine: the tiny
    preset's transformers engines were planned as 40 GiB vLLM engines."""
    bf16 = estimate_memory(load_plan_config(REPO / "configs" / "mcpo_7b.yaml"))
    fp32 = estimate_memory(load_plan_config(REPO / "configs" / "mcpo_7b.yaml", ["model.dtype=float32"]))
    assert bf16.fits and not fp32.fits
    b, f = bf16.components, fp32.components
    p = bf16.stage_param_counts[0]
    assert (b["weights"], f["weights"]) == (2 * p, 4 * p) and f["grads"] == b["grads"] == 4 * p
    assert f["optimizer"] == pytest.approx(b["optimizer"] * 8 / 12)  # Adam m, v only: the fp32 weights are the master
    for k in ("act_none", "act_full", "logits", "engine_weights"):
        assert f[k] == pytest.approx(2 * b[k], rel=1e-6), k
    m = bf16.config.model
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim  # elements, at rollout TP 1
    assert (bf16.kv_tokens, fp32.kv_tokens) == (
        b["kv_cache"] // (2 * kv_per_token),
        f["kv_cache"] // (4 * kv_per_token),
    )
    # a model given by name is planned as bf16 unless model.dtype says otherwise
    assert load_plan_config("qwen2.5-7b").dtype == "bfloat16"
    assert load_plan_config("qwen2.5-7b", ["model.dtype=float32"]).dtype == "float32"

    tiny = load_plan_config(REPO / "configs" / "tiny.yaml", ["cluster.nodes=1"])
    assert (tiny.engine, tiny.dtype) == ("hf", "float32")
    plan = estimate_memory(tiny)
    m, c = tiny.model, plan.components
    kv = tiny.rollout.max_batch_rows * tiny.max_model_len * 2 * m.layers * m.kv_heads * m.head_dim * 4
    assert c["engine_weights"] == 4 * m.param_count() and c["kv_cache"] == kv
    assert c["engine"] == c["engine_weights"] + kv and c["engine_in_training"] == c["engine_weights"]
    assert plan.fits and plan.peak < 2.1 * GIB  # the framework's 2 GiB; no vLLM share
    # rollout.kv_cache_gb sizes a vLLM engine instead of gpu_memory_utilization
    sized = estimate_memory(load_plan_config(REPO / "configs" / "mcpo_7b.yaml", ["rollout.kv_cache_gb=10"]))
    assert sized.components["kv_cache"] == 10 * GIB
    assert sized.components["engine"] == b["engine_weights"] + b["engine_overhead"] + 10 * GIB


def test_builtin_specs_match_their_hf_configs(tmp_path):
    qwen3 = {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(qwen3))
    spec = model_spec_from_hf_config(tmp_path)  # a folder holding config.json
    assert spec == ModelSpec(**{**BUILTIN_SPECS["qwen3-8b"].__dict__, "name": spec.name})
    assert spec.qk_norm and not spec.qkv_bias
    qwen2 = {"model_type": "qwen2", "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L}
    qwen2 |= {"num_attention_heads": A, "num_key_value_heads": KV, "vocab_size": V, "tie_word_embeddings": False}
    assert model_spec_from_hf_config(qwen2).param_count() == get_model_spec("qwen2.5-14b").param_count()


def test_bad_model_inputs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        get_model_spec("gpt-5")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'mixtral'"):
        model_spec_from_hf_config(bad)
    with pytest.raises(ValueError, match="heads .* multiple of kv_heads"):
        ModelSpec(name="x", hidden=96, ffn=128, layers=2, heads=6, kv_heads=4, vocab=100)


def test_invalid_layouts_give_clear_errors():
    m14 = get_model_spec("qwen2.5-14b")
    errs, _ = validate_layout(m14, ParallelConfig(tp=3, pp=1), world_size=24)
    assert any("tp=3 does not divide the 40 attention heads" in e for e in errs)
    errs, _ = validate_layout(m14, ParallelConfig(tp=4, pp=5), world_size=40)
    assert any("pp=5 does not divide the 48 layers" in e for e in errs)
    errs, _ = validate_layout(m14, ParallelConfig(tp=4, pp=4), world_size=8)
    assert any("not divisible by tp x pp = 4 x 4 = 16" in e for e in errs)
    errs, _ = validate_layout(m14, ParallelConfig(tp=2, rollout_tp=4), world_size=6, gpus_per_node=6)
    assert any("not divisible by rollout_tp=4" in e for e in errs)
    # KV heads: 12 query heads in 4 groups; TP=6 divides the heads but neither divides nor is divided by 4
    odd = ModelSpec(name="odd", hidden=768, ffn=3072, layers=4, heads=12, kv_heads=4, vocab=1000)
    errs, _ = validate_layout(odd, ParallelConfig(tp=2, rollout_tp=6), world_size=6)
    assert errs == ["parallel.rollout_tp=6 and the 4 KV heads: one must divide the other (KV heads are split when "
                    "kv_heads % tp == 0, replicated when tp % kv_heads == 0)"]  # fmt: skip
    errs, _ = validate_layout(odd, ParallelConfig(tp=6), world_size=6)
    assert any("parallel.tp=6 does not divide the model's num_key_value_heads=4" in e for e in errs), errs
    # megatron-core would replicate KV heads when tp is a multiple of them, the trainer's mapping does not:
    # Llama-3.1-70B (8 KV heads) at TP=16 is refused; DeepSeek-V3 (128 heads) at TP=16 is valid and spans nodes
    errs, warns = validate_layout(get_model_spec("llama-3.1-70b"), ParallelConfig(tp=16), world_size=16)
    assert any("parallel.tp=16 does not divide the model's num_key_value_heads=8" in e for e in errs), errs
    errs, warns = validate_layout(get_model_spec("deepseek-v3"), ParallelConfig(tp=16, rollout_tp=16), world_size=16)
    assert errs == [] and any("spans nodes" in w for w in warns)
    with pytest.raises(ValueError, match="parallel.tp must be a positive integer"):
        ParallelConfig(tp=0)


def test_cli_fits_refuses_and_rejects(capsys, tmp_path):
    assert plan_main([str(REPO / "configs" / "mcpo_14b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "TP=4 PP=1 DP=8" in out and "FITS" in out and "KV cache" in out
    # TP=1 cannot hold 14.8 B params with fp32 grads: refused with the reason, exit 1
    assert plan_main(["qwen2.5-14b", "--nodes", "4", "parallel.tp=1"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "training phase needs" in out
    assert plan_main(["qwen2.5-14b", "--nodes", "4", "parallel.tp=3"]) == 1
    assert "INVALID LAYOUT" in capsys.readouterr().out
    # a vLLM share too small for its own weights
    assert plan_main(["qwen2.5-14b", "--nodes", "4", "parallel.tp=4", "rollout.gpu_memory_utilization=0.2"]) == 1
    assert "no room for a KV cache" in capsys.readouterr().out
    # bad input: exit 2 with the field named
    assert plan_main(["qwen2.5-14b", "parallel.tp=abc"]) == 2
    assert "parallel.tp must be an integer" in capsys.readouterr().err  # the trainer's loader and wording
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {name: qwen2.5-7b}\nparallel: {tp: 2, tensor_parallel: 4}\n")
    assert plan_main([str(cfg)]) == 2
    assert "unknown config key 'parallel.tensor_parallel'" in capsys.readouterr().err
    # no --nodes: the smallest node count that fits
    assert plan_main(["qwen2.5-7b", "parallel.tp=2"]) == 0
    assert "smallest node count that fits is" in capsys.readouterr().out


def test_configs_in_repo_fit_and_match_slurm_scripts():
    for name, script_name, nodes, tp, rtp in (
        ("mcpo_14b", "mcpo_14b", 4, 4, 2),
        ("dapo_7b", "dapo_7b", 2, 2, 1),
        ("qwen3_30b_a3b", "qwen3_30b_a3b", 4, 2, 4),
        ("mcpo_14b_disagg", "mcpo_14b_disagg", 3, 2, 1),
        ("cpgd_qwen2_5_vl_7b", "cpgd_vl_7b", 2, 4, 1),
        ("long_qwen3_8b_32k", "long_qwen3_8b_32k", 2, 8, 1),
        ("long_qwen3_32b_64k", "long_qwen3_32b_64k", 8, 8, 4),
        ("moonlight_16b_a3b", "moonlight_16b_a3b", 1, 2, 2),
    ):
        cfg = load_plan_config(REPO / "configs" / f"{name}.yaml")
        assert (cfg.cluster.nodes, cfg.parallel.tp, cfg.parallel.rollout_tp) == (nodes, tp, rtp)
        assert estimate_memory(cfg).fits
        script = (REPO / "slurm" / f"{script_name}.sh").read_text()
        assert f"#SBATCH --nodes={nodes}\n" in script and f"configs/{name}.yaml" in script


def test_qwen3_30b_a3b_slurm_table_is_the_planners():
    """Every row of the layout table in slurm/qwen3_30b_a3b.sh is a row of `plan --search` (same numbers, same
    fits / does-not-fit verdict), the chosen row is the config's layout, and the config is the benchmark shape:
    32 x 80 GB GPUs, 4k-token responses."""
    cfg = load_plan_config(REPO / "configs" / "qwen3_30b_a3b.yaml")
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu_mem_gb) == (4, 8, 80)
    assert cfg.rollout.max_response_len == 4096
    r = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.planner", "configs/qwen3_30b_a3b.yaml", "--search"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = re.compile(
        r"^#?\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(fits|no:)"
    )
    searched = {m.groups()[:5]: m.groups()[5:] for m in map(row.match, r.stdout.splitlines()) if m}
    table = [(line, row.match(line)) for line in (REPO / "slurm" / "qwen3_30b_a3b.sh").read_text().splitlines()]
    table = [(line, m.groups()) for line, m in table if m]
    assert len(table) >= 8
    for line, groups in table:
        assert searched.get(groups[:5]) == groups[5:], line
    chosen = [g for line, g in table if line.endswith("<- chosen")]
    p = cfg.parallel
    assert [c[:5] for c in chosen] == [tuple(str(x) for x in (p.tp, p.pp, p.rollout_tp, 32 // (p.tp * p.pp), p.ep))]


def test_disaggregated_plan_gives_each_role_its_own_memory_and_chooses_a_layout(capsys):
    """parallel.rollout_ranks R > 0: a training rank holds the colocated training state of the same TP/PP/DP without
    any engine; a rollout rank holds only its engine (util x GPU, never asleep) + the framework overhead; the engine
    count is R / rollout TP. Checked on configs/mcpo_14b_disagg.yaml (3 nodes: 16 training + 8 rollout ranks)."""
    from megatron_rlvr.planner import format_search, search_layouts

    cfg = load_plan_config(REPO / "configs" / "mcpo_14b_disagg.yaml", warn=lambda _: None)
    par, cl = cfg.parallel, cfg.cluster
    assert (par.rollout_ranks, par.tp, par.pp, par.rollout_tp, cl.nodes) == (8, 2, 1, 1, 3)
    plan = estimate_memory(cfg)
    assert plan.fits and plan.disaggregated and plan.dp == 8 and plan.engines == 8 and plan.train_ranks == 16
    c = plan.components
    assert c["engine_in_training"] == 0 and c["train_state_in_rollout"] == 0 and c["host_ram_per_node"] == 0
    # the same training layout colocated on 16 GPUs (DP=8): its training phase minus the sleeping engine's residual
    colocated = estimate_memory(
        PlanConfig(
            model=cfg.model,
            parallel=ParallelConfig(tp=2, pp=1, rollout_tp=1),
            rollout=cfg.rollout,
            train=cfg.train,
            cluster=ClusterConfig(nodes=2, gpus_per_node=8, gpu_mem_gb=80),
            ref_model=cfg.ref_model,
        )
    )
    assert colocated.dp == 8
    residual = cl.vllm_sleep_residual_gb * GIB
    assert plan.train_peak == pytest.approx(colocated.train_peak - residual)
    assert plan.rollout_peak == pytest.approx(
        cfg.rollout.gpu_memory_utilization * 80 * GIB + cl.train_overhead_gb * GIB
    )
    # the KV cache: util x GPU - weights (whole model at rollout TP 1) - overhead, over 2 (K, V) x 48 x 8 x 128 x 2 B
    kv = cfg.rollout.gpu_memory_utilization * 80 * GIB - c["engine_weights"] - cl.vllm_overhead_gb * GIB
    assert c["engine_weights"] == 2 * cfg.model.param_count() and plan.kv_tokens == int(kv // (2 * L * KV * D * 2))
    # the search keeps R, chooses the configured layout, and says so
    plans = search_layouts(cfg)
    assert all(p.config.parallel.rollout_ranks == 8 for p in plans)
    chosen = next(p for p in plans if p.fits).config.parallel
    assert (chosen.tp, chosen.pp, chosen.rollout_tp) == (par.tp, par.pp, par.rollout_tp)
    table = format_search(plans)
    assert "engines" in table and "chosen: tp=2 pp=1 rollout_tp=1" in table
    # a TP=1 training rank cannot hold 14.8 B params with fp32 grads: the reason names the role
    tp1 = next(p for p in plans if p.config.parallel.tp == 1 and p.config.parallel.pp == 1)
    assert not tp1.fits and tp1.reasons[0].startswith("a training rank needs")
    assert plan_main([str(REPO / "configs" / "mcpo_14b_disagg.yaml"), "--search"]) == 0
    out = capsys.readouterr().out
    assert "16 training ranks (TP x PP x DP) + 8 rollout ranks (8 engines)" in out and "FITS" in out
    assert "per role: training ranks 69.0 GiB, rollout ranks 70.0 GiB per GPU" in out
    # layouts that do not divide the roles, and a rollout rank over its memory, are refused with the reason
    errors, _ = validate_layout(cfg.model, ParallelConfig(tp=1, rollout_tp=2, rollout_ranks=3), 24)
    assert errors == ["parallel.rollout_ranks=3 is not divisible by rollout_tp=2"]
    errors, _ = validate_layout(cfg.model, ParallelConfig(tp=4, rollout_tp=1, rollout_ranks=10), 24)
    assert errors == ["training ranks 14 (world - rollout_ranks) is not divisible by tp x pp = 4 x 1 = 4"]
    errors, _ = validate_layout(cfg.model, ParallelConfig(tp=2, rollout_ranks=24), 24)
    assert errors == ["parallel.rollout_ranks=24 leaves no training rank in a world of 24"]
    assert plan_main([str(REPO / "configs" / "mcpo_14b_disagg.yaml"), "rollout.gpu_memory_utilization=0.95"]) == 1
    assert "a rollout rank needs 78.0 GiB" in capsys.readouterr().out


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.planner", "llama-3.1-8b", "--nodes", "1", "parallel.tp=4"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "Llama-3.1-8B" in r.stdout and "FITS" in r.stdout


# Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 heads, 4 KV heads of 128, 128 experts of inner width
# 768, top-8, every layer an MoE layer, vocab 151936, untied LM head, q/k RMSNorm.
MH, ML, MA, MKV, MD, ME, MK, MF, MV = 2048, 48, 32, 4, 128, 128, 8, 768, 151936


def test_qwen3_30b_a3b_param_counts_closed_form():
    attn = MH * (MA * MD) + 2 * MH * (MKV * MD) + (MA * MD) * MH  # q, k, v, o (no bias)
    norms = 2 * MH + 2 * MD  # input / post-attention RMSNorm, q_norm, k_norm
    router = MH * ME
    experts = ME * 3 * MH * MF
    total = 2 * MV * MH + ML * (attn + norms + router + experts) + MH
    assert total == 30_532_122_624  # 30.5 B, the published size
    active = total - ML * (ME - MK) * 3 * MH * MF
    assert round(active / 1e9, 1) == 3.4  # "A3B": 3.35 B
    spec = get_model_spec("Qwen/Qwen3-30B-A3B")
    assert (spec.param_count(), spec.active_param_count()) == (total, active)
    big = get_model_spec("qwen3-235b-a22b")
    assert round(big.param_count() / 1e9) == 235 and round(big.active_param_count() / 1e9) == 22


def test_qwen3_30b_a3b_memory_by_hand_tp2_ep8_etp1_on_32_gpus():
    """Dense parts split over TP=2, each MoE layer's 128 experts over EP=8 (16 whole experts per GPU, expert TP 1),
    the router replicated; the distributed optimizer shards dense state over DP = 32 / 2 = 16 and the experts' over
    expert-DP = 32 / (1 x 8) = 4; a token's activations in an MoE layer are those of its k=8 routed copies."""
    tp, ep, T = 2, 8, 16384
    attn = (MH * (MA * MD) + 2 * MH * (MKV * MD) + (MA * MD) * MH) // tp
    norms = 2 * MH + 2 * MD
    router = MH * ME
    experts = (ME // ep) * 3 * MH * MF  # 16 experts of 3 x 2048 x 768
    v_pad = 152064  # next multiple of 128 x 2 above 151936
    emb = v_pad * MH // tp
    per_gpu = ML * (attn + norms + router + experts) + 2 * emb + MH
    expert_part = ML * experts
    assert per_gpu == 4_401_084_416 and expert_part == 3_623_878_656
    cfg = PlanConfig(
        model=get_model_spec("qwen3-30b-a3b"),
        parallel=ParallelConfig(tp=tp, ep=ep, etp=1, rollout_tp=4),
        train=TrainConfig(micro_batch_tokens=T, recompute="full", ref_model=False),
        cluster=ClusterConfig(nodes=4, gpus_per_node=8, gpu_mem_gb=80),
    )
    plan = estimate_memory(cfg)
    assert plan.errors == [] and (plan.dp, plan.edp) == (16, 4)
    c = plan.components
    assert plan.stage_param_counts == [per_gpu] and plan.stage_expert_param_counts == [expert_part]
    assert c["weights"] == 2 * per_gpu and c["grads"] == 4 * per_gpu
    assert c["optimizer"] == pytest.approx(12 * ((per_gpu - expert_part) / 16 + expert_part / 4))
    assert c["optimizer"] / GIB == pytest.approx(10.67, abs=0.01)
    # one MoE layer, sequence parallel (TP=2): 8h + 4 q_dim + 4 kv_dim per token, the router's fp32 logits and
    # scores 8E, and k=8 routed copies of 2h + 2h (dispatched input, expert output) + 6 f_e (SwiGLU of one expert)
    per_token = 8 * MH + 4 * MA * MD + 4 * MKV * MD + 8 * ME + MK * (4 * MH + 6 * MF)
    moe_layer = T * per_token // tp
    assert c["act_none"] == ML * moe_layer
    assert c["act_full"] == ML * (2 * T * MH // tp) + moe_layer
    # vLLM at TP=4 holds every expert, each sliced 4 ways; KV heads 4 / 4 = 1 per GPU
    layer = MH * MD * (MA // 4 + 2) + (MA * MD) * MH // 4 + norms + router + ME * 3 * MH * MF // 4
    assert c["engine_weights"] == 2 * (ML * layer + (MV // 4) * MH * 2 + MH)


def test_expert_layout_errors():
    moe = get_model_spec("qwen3-30b-a3b")
    errs, _ = validate_layout(moe, ParallelConfig(tp=1, ep=3), world_size=24)
    assert any("ep=3 does not divide the 128 routed experts" in e for e in errs)
    errs, _ = validate_layout(moe, ParallelConfig(tp=1, ep=16), world_size=8)
    assert any("etp x ep x pp = 1 x 16 x 1" in e for e in errs)
    errs, _ = validate_layout(moe, ParallelConfig(tp=1, ep=2, etp=5), world_size=10)
    assert any("expert TP 5 does not divide the experts' inner width 768" in e for e in errs)
    errs, _ = validate_layout(get_model_spec("qwen2.5-7b"), ParallelConfig(tp=1, ep=2), world_size=8)
    assert any("need a mixture-of-experts model" in e for e in errs)


def test_moe_config_in_repo_fits_and_hf_config_gives_the_builtin_spec():
    cfg = load_plan_config(REPO / "configs" / "qwen3_30b_a3b.yaml")
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.expert_tp) == (2, 8, 1)
    plan = estimate_memory(cfg)
    assert plan.fits and plan.edp == 4
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": MH, "intermediate_size": 6144}
    hf |= {"num_hidden_layers": ML, "num_attention_heads": MA, "num_key_value_heads": MKV, "head_dim": MD}
    hf |= {"vocab_size": MV, "num_experts": ME, "num_experts_per_tok": MK, "moe_intermediate_size": MF}
    hf |= {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    spec = model_spec_from_hf_config(hf)
    assert spec == ModelSpec(**{**BUILTIN_SPECS["qwen3-30b-a3b"].__dict__, "name": spec.name})


def test_context_parallel_divides_activations_and_logits_and_shards_the_optimizer_over_dp_x_cp():
    """parallel.cp=2 on the same 32 GPUs as TP=4 x DP=8: the GPU holds half of every micro-batch's tokens (per-token
    activations and logits halve, by hand from the CP=1 plan of half the tokens), the weights stay whole per TP
    shard, DP halves to 4 while the distributed optimizer still shards over dp x cp = 8; layouts that do not divide,
    and CP on an MoE model, are refused."""
    m = get_model_spec("qwen2.5-14b")
    T = 16384

    def plan(cp, tokens):
        cfg = PlanConfig(
            model=m,
            parallel=ParallelConfig(tp=4, cp=cp, rollout_tp=2),
            train=TrainConfig(micro_batch_tokens=tokens, recompute="full"),
            cluster=ClusterConfig(nodes=4, gpus_per_node=8, gpu_mem_gb=80),
        )
        return estimate_memory(cfg)

    cp2, cp1, half = plan(2, T), plan(1, T), plan(1, T // 2)
    assert not cp2.errors and (cp2.dp, cp1.dp) == (4, 8)
    for k in ("act_none", "act_full", "logits", "logits_chunk"):
        assert cp2.components[k] == half.components[k], k
    assert cp2.components["logits"] == cp1.components["logits"] / 2
    per_layer_full = (T // 2) * (8 * H + 4 * A * D + 4 * KV * D + 6 * F) // 4
    assert cp2.components["act_none"] == L * per_layer_full
    for k in ("weights", "grads", "optimizer"):
        assert cp2.components[k] == cp1.components[k], k
    errors, _ = validate_layout(m, ParallelConfig(tp=4, cp=3), 32)
    assert "world size 32 is not divisible by tp x cp x pp = 4 x 3 x 1 = 12" in errors
    moe = get_model_spec("qwen3-30b-a3b")
    errors, _ = validate_layout(moe, ParallelConfig(tp=2, cp=2), 32)
    assert any("parallel.cp=2: context parallelism is for dense text models" in e for e in errors)


def test_distillation_teacher_is_planned_on_the_training_gpus():
    """A Qwen2.5-7B student distilled from a Qwen2.5-14B teacher (built-in spec name): the teacher's frozen bf16
    weights at the student's TP / PP (14B counted by hand as above) and, with the full-vocabulary estimator, its
    logits shard [T, V/tp] bf16 are added to the training peak (and the teacher's weights to what a colocated GPU
    keeps while rolling out); the sampled estimator adds only the weights. The table names the teacher and its
    compute share."""
    base = load_plan_config(REPO / "configs" / "mcpo_7b.yaml", warn=lambda _: None)
    over = ["algorithm.distill.teacher=qwen2.5-14b"]
    sampled = load_plan_config(REPO / "configs" / "mcpo_7b.yaml", over, warn=lambda _: None)
    full = load_plan_config(
        REPO / "configs" / "mcpo_7b.yaml", [*over, "algorithm.distill.estimator=full"], warn=lambda _: None
    )
    p0, ps, pf = estimate_memory(base), estimate_memory(sampled), estimate_memory(full)
    tp, pp = base.parallel.tp, base.parallel.pp
    assert pp == 1
    q, k, v, o, mlp, norms = qwen14b_layer_by_hand()
    v_pad = -(-V // (128 * tp)) * (128 * tp)
    teacher_params = L * ((q + k + v + o + mlp) // tp + norms) + H + 2 * (v_pad * H // tp)
    assert ps.components["teacher"] == 2 * teacher_params
    assert ps.train_peak - p0.train_peak == pytest.approx(2 * teacher_params)
    if not base.cluster.offload_during_rollout:
        assert ps.components["train_state_in_rollout"] - p0.components["train_state_in_rollout"] == pytest.approx(
            2 * teacher_params
        )
    logits = base.micro_batch_tokens * (v_pad // tp) * 2
    assert pf.components["teacher_logits"] == logits and ps.components["teacher_logits"] == 0
    assert pf.train_peak - ps.train_peak == pytest.approx(logits)
    table = format_plan(pf)
    assert "distillation teacher Qwen2.5-14B bf16 (frozen)" in table and "teacher logits" in table
    share = 2 * get_model_spec("qwen2.5-14b").param_count() / (6 * get_model_spec("qwen2.5-7b").param_count())
    assert (
        f"distill teacher Qwen2.5-14B: 14.77 B params, frozen at the policy's layout; its forward costs ~{share:.2f}x"
        in table
    )


def test_context_parallel_exchange_volume_by_hand():
    """cp_comm_bytes_per_layer against hand-computed bytes, Qwen2.5-14B (8 KV heads of 128, 40 heads), a
    16384-token micro-batch in bf16. TP=4, CP=2: a GPU holds t = 8192 tokens and k = 8 / 4 x 128 = 256 key
    columns; the ring sends (cp - 1) t 2k b = 8192 x 512 x 2 = 8 MiB forward, twice that backward (K, V and dK,
    dV), the forward again under full recompute; all-gather sends 8 MiB each way; all-to-all (q = 10 x 128 = 1280)
    sends (cp - 1) / cp t (2q + 2k) b = 8192 x 3072 = 24 MiB each way. TP=8, CP=4: one KV head per GPU (k = 128),
    t = 4096: 3 x 4096 x 256 x 2 = 6 MiB. The plan report states the volume per layer and per micro-batch."""
    from megatron_rlvr.planner.memory import cp_comm_bytes_per_layer

    m = get_model_spec("qwen2.5-14b")
    mib = 1024**2

    def vol(tp, cp, kind, recompute="full"):
        cfg = PlanConfig(
            model=m,
            parallel=ParallelConfig(tp=tp, cp=cp, cp_comm_type=kind, rollout_tp=2),
            train=TrainConfig(micro_batch_tokens=16384, recompute=recompute),
            cluster=ClusterConfig(nodes=4, gpus_per_node=8, gpu_mem_gb=80),
        )
        v = cp_comm_bytes_per_layer(cfg)
        return v.forward, v.backward, v.recompute, cfg

    assert vol(4, 2, "p2p")[:3] == (8 * mib, 16 * mib, 8 * mib)
    assert vol(4, 2, "p2p", recompute="none")[:3] == (8 * mib, 16 * mib, 0)
    assert vol(4, 2, "all_gather")[:3] == (8 * mib, 8 * mib, 8 * mib)
    assert vol(4, 2, "a2a", recompute="none")[:3] == (24 * mib, 24 * mib, 0)
    assert vol(8, 4, "p2p", recompute="none")[:3] == (6 * mib, 12 * mib, 0)
    assert vol(4, 1, "p2p")[:3] == (0, 0, 0)
    text = format_plan(estimate_memory(vol(4, 2, "p2p")[3]))
    assert "context parallelism CP=2, cp_comm_type=p2p" in text
    # 8 + 16 + 8 = 32 MiB per layer; 48 layers: 1.5 GiB per micro-batch
    assert "forward 8.0 + backward 16.0 + recompute 8.0 = 32.0 MiB; x 48 layers = 1.50 GiB per micro-batch" in text
    assert "context parallelism" not in format_plan(estimate_memory(vol(4, 1, "p2p")[3]))
    # all-to-all splits heads: cp must divide the query and the key/value heads of a TP rank (40 / 8 = 5, 8 / 8 = 1)
    errors, _ = validate_layout(m, ParallelConfig(tp=8, cp=2, cp_comm_type="a2a"), 32)
    assert errors == [
        "parallel.cp_comm_type=a2a: parallel.cp=2 must divide the 5 attention and 1 key/value heads per TP rank (use "
        "p2p or all_gather)"
    ]


def test_search_uses_context_parallelism_only_when_no_layout_fits_without():
    """plan --search tries cp in (1, 2, 4, 8) for dense text models and takes cp > 1 only when no cp=1 layout fits.
    Qwen3-8B, 34816-token sequences, no recompute, 80 GiB GPUs: two packed sequences on 8 GPUs fit at TP=8 and also
    at TP=4 x CP=2 (a smaller tp x pp): the chosen layout is TP=8, cp=1. Four packed sequences on 16 GPUs fit no
    cp=1 layout (checked over every row), so the chosen one has cp > 1 and the smallest tp x cp x pp of the fitting
    rows. An MoE model is searched at cp=1 only and its table has no cp column."""
    from megatron_rlvr.planner import format_search, search_layouts

    def long_plans(nodes, sequences):
        return search_layouts(
            PlanConfig(
                model=get_model_spec("qwen3-8b"),
                parallel=ParallelConfig(tp=8, rollout_tp=1),
                rollout=RolloutConfig(max_prompt_len=2048, max_response_len=32768, gpu_memory_utilization=0.5),
                train=TrainConfig(micro_batch_tokens=sequences * 34816, recompute="none"),
                cluster=ClusterConfig(nodes=nodes, gpus_per_node=8, gpu_mem_gb=80),
            )
        )

    def layout(p):
        return p.config.parallel.tp, p.config.parallel.cp, p.config.parallel.pp

    plans = long_plans(1, 2)
    assert {p.config.parallel.cp for p in plans} == {1, 2, 4, 8}
    fitting = [layout(p) for p in plans if p.fits]
    assert fitting[0] == (8, 1, 1) and (4, 2, 1) in fitting
    assert format_search(plans).splitlines()[0].split()[:3] == ["tp", "cp", "pp"]

    plans = long_plans(2, 4)
    assert not any(p.fits for p in plans if p.config.parallel.cp == 1)
    fitting = [layout(p) for p in plans if p.fits]
    tp, cp, pp = fitting[0]
    assert cp > 1 and tp * cp * pp == min(a * b * c for a, b, c in fitting)
    assert f"chosen: tp={tp} cp={cp} pp={pp}" in format_search(plans)

    moe = load_plan_config(REPO / "configs" / "qwen3_30b_a3b.yaml", warn=lambda _: None)
    plans = search_layouts(moe)
    assert {p.config.parallel.cp for p in plans} == {1} and " cp " not in format_search(plans).splitlines()[0]


def test_training_tp_above_the_kv_heads_is_refused_in_the_trainers_words(tmp_path):
    """The trainer's weight mapping splits key/value heads over TP and never copies them, so `train` refuses a TP that
    does not divide num_key_value_heads (config.run.check_layout); the planner refuses the same layouts with the same
    line, and `plan --search` does not offer them. A Qwen3-style config of 8 heads / 2 KV heads: TP=4 and TP=8
    (multiples of 2, which megatron-core alone would accept by replicating heads) are refused by both; TP=2 passes
    both; the rollout TP may be 4 (vLLM replicates key/value heads)."""
    from megatron_rlvr.config import ConfigError, load_run_config
    from megatron_rlvr.config.run import check_layout
    from megatron_rlvr.planner import search_layouts

    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 1024, "tie_word_embeddings": True}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    spec = model_spec_from_hf_config(path)
    for tp in (4, 8):
        run = load_run_config(None, [f"model.hf_path={tmp_path}", f"parallel.tp={tp}"], check_files=False)
        with pytest.raises(ConfigError) as e:
            check_layout(run, 8)
        errs, _ = validate_layout(spec, ParallelConfig(tp=tp, rollout_tp=tp), world_size=8)
        assert str(e.value) in errs, (str(e.value), errs)
        assert str(e.value).startswith(f"parallel.tp={tp} does not divide the model's num_key_value_heads=2")
    check_layout(load_run_config(None, [f"model.hf_path={tmp_path}", "parallel.tp=2"], check_files=False), 8)
    assert validate_layout(spec, ParallelConfig(tp=2, rollout_tp=4), world_size=8)[0] == []
    cfg = PlanConfig(model=spec, parallel=ParallelConfig(), cluster=ClusterConfig(nodes=1, gpus_per_node=8))
    layouts = {(p.config.parallel.tp, p.config.parallel.rollout_tp) for p in search_layouts(cfg)}
    assert {tp for tp, _ in layouts} == {1, 2} and {rtp for _, rtp in layouts} == {1, 2, 4, 8}
    # GPT-OSS-20B (8 KV heads): every TP up to a node's 8 GPUs divides them
    assert validate_layout(get_model_spec("gpt-oss-20b"), ParallelConfig(tp=8, ep=8, etp=1), world_size=8)[0] == []


def test_gpt_oss_plans_experts_at_expert_tp_1_as_the_model_build_requires():
    """GPT-OSS's experts carry biases, which megatron builds only at expert TP 1; the model build refuses any other
    expert TP (models.hf_config), and the trainer passes parallel.etp, else tp. The planner refuses the same layouts
    (TP=2 with etp unset, or etp=2), and `--search` sets etp=1 in every layout it offers (and says so in its chosen
    line). At TP=2 x EP=8 x etp 1 on 8 GPUs a GPU holds 4 whole experts of each of the 24 layers, 24 x 4 x
    (3 x 2880 x 2880 + 2 x 2880 + 2880) = 2,389,616,640 parameters (by hand)."""
    from megatron_rlvr.planner import format_search, search_layouts

    spec = get_model_spec("gpt-oss-20b")
    cluster = ClusterConfig(nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    msg = "expert tensor parallel size 2: GPT-OSS's expert biases need expert TP 1 (parallel.etp=1)"
    for par in (ParallelConfig(tp=2, ep=4), ParallelConfig(tp=2, ep=4, etp=2)):
        assert msg in estimate_memory(PlanConfig(model=spec, parallel=par, cluster=cluster)).errors
    plan = estimate_memory(PlanConfig(model=spec, parallel=ParallelConfig(tp=2, ep=8, etp=1), cluster=cluster))
    assert plan.errors == [] and plan.edp == 1
    assert plan.stage_expert_param_counts == [24 * 4 * (3 * 2880 * 2880 + 2 * 2880 + 2880)] == [2_389_616_640]
    plans = search_layouts(PlanConfig(model=spec, parallel=ParallelConfig(), cluster=cluster))
    assert plans and {p.config.parallel.etp for p in plans} == {1}
    assert any(p.config.parallel.tp == 8 and p.config.parallel.ep == 8 for p in plans)  # 8 x 8 > 8 at expert TP 8
    two_nodes = dataclasses.replace(cluster, nodes=2)
    two = search_layouts(PlanConfig(model=spec, parallel=ParallelConfig(), cluster=two_nodes))
    assert " etp=1 (fits" in format_search(two).splitlines()[-1]
