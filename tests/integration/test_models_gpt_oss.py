"""GPT-OSS (``GptOssForCausalLM``) in megatron: a tiny random model that exercises every feature of the family -
learned attention sinks, sliding-window attention on even layers (window 8, sequence 40), biases on q/k/v/o, the
router and the experts, the router's top-k of biased logits softmaxed over k, the clamped SwiGLU with ``up + 1`` whose
clamp binds (expert weights large enough), gate/up interleaved in transformers' fused ``gate_up_proj``, and YaRN with
``truncate=false`` past the original context - gives transformers' logits and gradients (fp32) at TP=1 and at
TP=2 x EP=2 (expert TP 1) on 4 gloo ranks. Each run also has controls: the same megatron model with one feature
switched off or mis-mapped (sinks, window one key wider, clamp, gate/up left interleaved, router bias, YaRN's
correction range rounded) must miss transformers' logits by 100 x the tolerance or more. The export back to HF is
bit-identical; the mapping round-trips every tensor at any expert layout (pure torch); an MXFP4 checkpoint loads
as its dequantised values.
"""

from __future__ import annotations

import pytest
import torch
from test_models_deepseek import _ce, _positions, _rel, _saved_tensors

VOCAB = 160
SEQ = 40  # > sliding_window (8) and > original_max_position_embeddings (32); divisible by TP (sequence parallel)
BATCHES = 4
LOGIT_TOL = 1e-4  # max-abs; logits reach ~10 here (relative error ~3e-6)
GRAD_TOL = 1e-4
CONTROL_MIN = 1e-2  # 100 x LOGIT_TOL


def _config():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        attention_bias=True,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["GptOssForCausalLM"],
    )


def _make_model(cfg, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random, sinks and biases included; routers large (no near ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.weight"):
                p.copy_(1.0 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "router.bias")):
                p.copy_(1.0 * torch.randn(p.shape, generator=g))
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(0.6 * torch.randn(p.shape, generator=g))  # pre-activations of std ~5: the clamp at 7 binds
            elif name.endswith("experts.down_proj"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def _hf_grads(model, batches) -> dict[str, torch.Tensor]:
    """Gradients (transformers' own names, experts fused) of the mean over batches of the mean token CE."""
    model.zero_grad()
    loss = sum(_ce(model(b).logits, b) for b in batches) / len(batches)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(hf config dict, in-memory state, saved folder, batches, reference logits, reference grads per DP size)."""
    cfg = _config()
    model = _make_model(cfg, seed=41)
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(3, VOCAB, (2, SEQ), generator=g) for _ in range(BATCHES)]
    with torch.no_grad():
        logits = model(batches[0]).logits.float()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {d: _hf_grads(model, batches[:d]) for d in (2, 4)}
    return cfg.to_dict(), state, str(folder), batches, logits, grads


def _controls(gpt, args, ids, ref) -> dict[str, float]:
    """Max-abs logits error against transformers with one feature switched off or mis-mapped (same weights)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    cfg = args.config
    layers = list(gpt.decoder.layers)
    cores = [ly.self_attention.core_attention for ly in layers]
    routers = [ly.mlp.router for ly in layers]
    fc1s = [e.linear_fc1 for ly in layers for e in ly.mlp.experts.local_experts]
    out = {}

    def err():
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(gpt(ids, _positions(ids), None))
        return (logits[..., : args.dims.vocab_size] - ref).abs().max().item()

    def toggle(name, off, on):
        with torch.no_grad():
            off()
        try:
            out[name] = err()
        finally:
            with torch.no_grad():
                on()

    sinks = [c.softmax_offset.detach().clone() for c in cores]
    toggle(
        "sinks off",
        lambda: [c.softmax_offset.fill_(-1e9) for c in cores],
        lambda: [c.softmax_offset.copy_(s) for c, s in zip(cores, sinks, strict=True)],
    )
    softmaxes = [c.scale_mask_softmax for c in cores if c.scale_mask_softmax.window_size is not None]
    window = cfg.window_size
    toggle(
        "window one key wider",
        lambda: [setattr(s, "window_size", (window[0] + 1, 0)) for s in softmaxes],
        lambda: [setattr(s, "window_size", window) for s in softmaxes],
    )
    limit = cfg.activation_func_clamp_value
    toggle(
        "no clamp",
        lambda: setattr(cfg, "activation_func_clamp_value", None),
        lambda: setattr(cfg, "activation_func_clamp_value", limit),
    )
    saved = [(f.weight.detach().clone(), f.bias.detach().clone()) for f in fc1s]

    def interleave(t):  # HF's column order copied as is: rows gate_0, up_0, gate_1, up_1, ...
        gate, up = t.chunk(2, dim=0)
        return torch.stack([gate, up], dim=1).reshape(t.shape)

    toggle(
        "gate/up not de-interleaved",
        lambda: [(f.weight.copy_(interleave(w)), f.bias.copy_(interleave(b))) for f, (w, b) in zip(fc1s, saved)],
        lambda: [(f.weight.copy_(w), f.bias.copy_(b)) for f, (w, b) in zip(fc1s, saved)],
    )
    biases = [r.bias.detach().clone() for r in routers]
    toggle(
        "router bias ignored",
        lambda: [r.bias.zero_() for r in routers],
        lambda: [r.bias.copy_(b) for r, b in zip(routers, biases, strict=True)],
    )
    rotary = gpt.rotary_pos_emb

    def rounding(on: bool):
        rotary.correction_range_round_to_int = on
        rotary.forward.cache_clear()  # megatron caches the embedding per length

    toggle("YaRN range rounded (truncate=true)", lambda: rounding(True), lambda: rounding(False))
    return out


def _rank_gpt_oss(data, from_folder: bool, export_root: str | None) -> dict:
    """Build the tiny GPT-OSS model at the pool's layout, load the HF weights, logits (eval), the controls, one
    forward/backward through megatron DDP with this data-parallel rank's batch, gradients gathered back to HF's
    fused names, and (export_root) the export."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlvr.megatron.policy import wrap_ddp
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.export import export_hf, iter_hf_tensors
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout, stack_fused_experts

    cfg, state, folder, batches, ref_logits, _ = data
    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg)
    load_hf_weights(model, args, folder if from_folder else state, pg_collection=pg)
    ddp = wrap_ddp(model, distributed_optimizer=False)
    ddp.zero_grad_buffer()
    model.eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(ddp(batches[0], _positions(batches[0]), None))
    controls = _controls(model, args, batches[0], ref_logits)
    model.train()
    ids = batches[pg.dp.rank()]
    out_logits = gather_from_tensor_model_parallel_region(ddp(ids, _positions(ids), None))
    _ce(out_logits[..., : args.dims.vocab_size], ids).backward()
    finalize_model_grads([ddp])
    saved = {n: p.data for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data = p.main_grad.to(p.dtype)
    tensors = iter_hf_tensors(model, args, pg_collection=pg)
    grads = {k: v.clone() for k, v in stack_fused_experts(tensors, args.dims.num_experts)}
    for n, p in model.named_parameters():
        p.data = saved[n]
    if export_root is not None:
        export_hf(model, args, export_root, pg_collection=pg)
    out = {"layout": (pg.tp.size(), experts.ep_size, experts.etp_size, pg.dp.size())}
    if torch.distributed.get_rank() == 0:
        out |= {"logits": logits[..., : args.dims.vocab_size].detach(), "grads": grads, "controls": controls}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,from_folder", [(1, 1, False), (2, 2, True)])
def test_gpt_oss_logits_grads_and_controls_match_transformers(dist_pool, gpt_oss, tmp_path, tp, ep, from_folder):
    """Megatron's logits and gradients equal transformers' (fp32) at TP=1 and TP=2 x EP=2; six controls each miss by
    more than 100 x the tolerance; at TP=2 x EP=2 the model loads from the saved folder and its export equals it bit
    for bit."""
    cfg, _, folder, _, ref_logits, ref_grads = gpt_oss
    export_root = str(tmp_path / "export") if from_folder else None
    results = dist_pool.run(_rank_gpt_oss, tp=tp, ep=ep, etp=1, args=(gpt_oss, from_folder, export_root), timeout=400)
    r0 = results[0]
    dp = r0["layout"][3]
    abs_err = (r0["logits"] - ref_logits).abs().max().item()
    rel_err = _rel(r0["logits"], ref_logits)
    want, grads = ref_grads[dp], r0["grads"]
    assert sorted(grads) == sorted(want)
    worst = max(((_rel(grads[k], want[k]), k) for k in want), key=lambda x: x[0])
    controls = r0["controls"]
    print(
        f"gpt_oss tp={tp} ep={ep}: logits max-abs {abs_err:.1e} rel {rel_err:.1e}, worst grad {worst[0]:.1e} "
        f"({worst[1]}), controls " + ", ".join(f"{k}: {v:.2e}" for k, v in controls.items())
    )
    assert abs_err < LOGIT_TOL and rel_err < 1e-5, (abs_err, rel_err)
    bad = sorted((round(_rel(grads[k], want[k]), 4), k) for k in want if _rel(grads[k], want[k]) >= GRAD_TOL)
    assert worst[0] < GRAD_TOL, bad
    assert len(controls) == 6 and all(v > CONTROL_MIN for v in controls.values()), controls
    if from_folder:
        src, dst = _saved_tensors(folder), _saved_tensors(export_root)
        assert sorted(src) == sorted(dst)
        assert [k for k in src if not torch.equal(src[k], dst[k])] == []
