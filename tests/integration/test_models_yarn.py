"""Dense YaRN rope scaling (Qwen3, Llama) in megatron against transformers, fp32: tiny random models with
``rope_scaling: yarn`` (factor 4 over an original context of 16) on 48-token sequences, i.e. three times past the
original context, give transformers' logits and parameter gradients at TP = 1 (DP = 4) and at context parallelism
CP = 2 (DP = 2: each rank holds chunks r and 3 - r of the sequence, the rotary angles sliced the same way, keys and
values all-gathered over CP). Qwen3 uses the default YaRN settings (beta 32 / 1, the attention factor
0.1 ln 4 + 1); Llama uses beta 8 / 0.5, ``truncate=false`` and the mscale / mscale_all_dim ratio, with a base of 100
so that the ramp between interpolated and extrapolated frequencies covers several of the 8 frequencies.

Controls, same weights, forward only: plain RoPE (YaRN dropped) and YaRN without its attention factor must each miss
transformers' logits by more than 100 x the tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

VOCAB = 96
SEQ = 48  # > original_max_position_embeddings (16); a multiple of 2 x CP
ORIGINAL = 16
LOGIT_TOL = 1e-4  # max-abs; logits reach ~3 here
GRAD_TOL = 1e-4  # relative (norm of the difference over the reference's norm), per parameter
CONTROL_MIN = 1e-2  # 100 x LOGIT_TOL


def _config(family: str) -> dict:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=4 * ORIGINAL,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
        return common | dict(
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            rope_theta=1000.0,
            rope_scaling=scaling,
            attention_bias=False,
            use_sliding_window=False,
        )
    scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 8.0,
        "beta_slow": 0.5,
        "truncate": False,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    }
    return common | dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=100.0,
        rope_scaling=scaling,
        attention_bias=False,
        mlp_bias=False,
    )


def _hf_model(cfg: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _ce_sum(logits, ids):
    """Sum over positions 0..S-2 of the next-token cross entropy: [b, S, V] logits, [b, S] ids."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
    )


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def yarn_model(request):
    """(family, hf config dict, in-memory state, ids [2, SEQ], reference logits, reference grads)."""
    cfg = _config(request.param)
    model = _hf_model(cfg, seed=23)
    rope = model.model.rotary_emb
    assert rope.rope_type == "yarn" and rope.attention_scaling != 1.0  # transformers really scales
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    logits = model(ids).logits
    _ce_sum(logits, ids).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return request.param, model.config.to_dict(), state, ids, logits.detach().float(), grads


def _global_logits(local, pg, seq: int):
    """[b, S, V] from this CP rank's [b, S / cp, V] (all-gathered over CP, put back in global order)."""
    from megatron_rlvr.megatron.context_parallel import zigzag_positions

    cp = pg.cp.size()
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=pg.cp)
    full = torch.empty(local.shape[0], seq, local.shape[2])
    for r, part in enumerate(parts):
        full[:, zigzag_positions(seq, cp, r)] = part
    return full


def _rank_yarn(cfg: dict, state: dict, ids: torch.Tensor) -> dict:
    """At the pool's layout: the megatron model of ``cfg`` with transformers' weights, the logits of ``ids`` (this
    rank's CP chunks, gathered), the gradients of this rank's share of the summed token cross entropy summed over
    CP (HF names), and the controls' logits errors are returned by rank 0."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.megatron.context_parallel import cp_core_attention, zigzag_positions
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.export import iter_hf_tensors
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    pg = ProcessGroupCollection.use_mpu_process_groups()
    cp = pg.cp.size()

    def build(hf: dict, **rope_changes):
        args = megatron_model_args(hf, cp_size=cp)
        args.rope = dataclasses.replace(args.rope, **rope_changes)  # build_gpt_model sets the yarn_* attributes
        model = build_gpt_model(args, pg_collection=pg, cp_core_attention=cp_core_attention() if cp > 1 else None)
        load_hf_weights(model, args, state, pg_collection=pg)
        return model, args

    local = zigzag_positions(SEQ, cp, pg.cp.rank()) if cp > 1 else torch.arange(SEQ)
    positions = local[None].expand(ids.shape[0], -1)
    labels = torch.roll(ids, -1, dims=1)  # shifted over the whole sequence, then split (the last one is dropped)
    keep = (torch.arange(SEQ) < SEQ - 1)[None].expand(ids.shape[0], -1)

    def logits_of(model):
        with torch.no_grad():
            out = model(ids[:, local], positions, None)
        return _global_logits(out.float(), pg, SEQ)

    model, args = build(cfg)
    assert args.rope.kind == "yarn" and args.config.apply_rope_fusion is False
    assert type(model.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    logits = logits_of(model)
    model.zero_grad()
    out = model(ids[:, local], positions, None)[..., :VOCAB]  # the vocabulary's padding left out of the softmax
    ce = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels[:, local].flatten(), reduction="none")
    (ce * keep[:, local].flatten()).sum().backward()
    for p in model.parameters():
        if cp > 1:
            torch.distributed.all_reduce(p.grad, group=pg.cp)
    saved = {n: p.data for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data = p.grad
    grads = {k: v.clone() for k, v in iter_hf_tensors(model, args, pg_collection=pg)}
    for n, p in model.named_parameters():
        p.data = saved[n]
    plain_cfg = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
    plain_cfg["rope_theta"] = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    controls = {
        "plain RoPE": logits_of(build(plain_cfg)[0]),
        # mscale == mscale_all_dim: megatron's attention factor get_mscale(f, m) / get_mscale(f, m) = 1
        "no attention factor": logits_of(build(cfg, mscale=1.0, mscale_all_dim=1.0)[0]),
    }
    if torch.distributed.get_rank() != 0:
        return {}
    return {"cp": cp, "logits": logits, "grads": grads, "controls": controls}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("cp", [1, 2])
def test_dense_yarn_logits_and_grads_match_transformers(dist_pool, yarn_model, cp):
    """Megatron's YaRN (position_embedding_type=yarn, the attention factor on cos / sin) equals transformers' Qwen3 /
    Llama with rope_scaling yarn, past the original context, at TP = 1 and CP = 2: logits to 1e-4 max-abs, every
    parameter gradient to 1e-4 relative; both controls miss the logits by more than 1e-2."""
    family, cfg, state, ids, ref_logits, ref_grads = yarn_model
    r0 = dist_pool.run(_rank_yarn, cp=cp, args=(cfg, state, ids), timeout=400)[0]
    assert r0["cp"] == cp
    err = (r0["logits"][..., :VOCAB] - ref_logits).abs().max().item()
    grads = r0["grads"]
    assert sorted(grads) == sorted(ref_grads)
    worst = max((_rel(grads[k], ref_grads[k]), k) for k in ref_grads)
    controls = {k: (v[..., :VOCAB] - ref_logits).abs().max().item() for k, v in r0["controls"].items()}
    print(
        f"{family} yarn cp={cp}: logits max-abs {err:.1e} (ref max {ref_logits.abs().max():.2f}), worst grad rel "
        f"{worst[0]:.1e} ({worst[1]}), controls " + ", ".join(f"{k} {v:.2e}" for k, v in controls.items())
    )
    assert err < LOGIT_TOL, err
    assert worst[0] < GRAD_TOL, worst
    assert all(v > CONTROL_MIN for v in controls.values()), controls
