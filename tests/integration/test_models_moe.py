"""Mixture-of-experts models in megatron: tiny random Qwen3-MoE (some dense layers via ``mlp_only_layers``) and
Qwen2-MoE (shared expert with a sigmoid gate, q/k/v bias) give transformers' logits and gradients (fp32) at
EP=1, EP=2 and TP=2 + EP=2 + expert TP=2 on the 4 pooled gloo ranks; the export back to HF names is bit-identical;
every CPU MoE shim is needed (suspending it breaks a forward). The HF weights are loaded from transformers 5's fused
in-memory expert tensors at one layout and from a saved per-expert checkpoint at the others. Checkpoints reshard
when EP changes: conversion back to HF is bit-identical, and a training checkpoint (model and Adam state, plain and
distributed optimizer) resumes at another TP x EP with the next step landing where the uninterrupted run landed.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

VOCAB = 160
SEQ = 12
DP_BATCHES = 4  # one batch per data-parallel rank (at most 4)


def _configs() -> dict:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,  # the dense layers' MLP
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            num_hidden_layers=3,
            head_dim=24,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            architectures=["Qwen3MoeForCausalLM"],
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            num_hidden_layers=2,
            num_experts=4,
            norm_topk_prob=False,
            shared_expert_intermediate_size=48,
            architectures=["Qwen2MoeForCausalLM"],
        ),
    }


def _make_model(cfg, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random; routers large so that no top-k choice is a near tie
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(1.0 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def _hf_grads(model, batches) -> dict[str, torch.Tensor]:
    """Per-expert-named gradients of the mean over batches of the mean token cross-entropy."""
    from megatron_rlvr.models.mapping import unfuse_experts

    model.zero_grad()
    loss = sum(_ce(model(b).logits, b) for b in batches) / len(batches)
    loss.backward()
    return {k: v.detach().clone() for k, v in unfuse_experts({n: p.grad for n, p in model.named_parameters()}).items()}


def _ce(logits, ids):
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    )


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """{family: (hf config dict, fused in-memory state, saved folder, batches, reference logits, reference grads)}."""
    from megatron_rlvr.models.mapping import unfuse_experts

    out = {}
    for i, (name, cfg) in enumerate(_configs().items()):
        model = _make_model(cfg, seed=20 + i)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        g = torch.Generator().manual_seed(i)
        batches = [torch.randint(3, VOCAB, (2, SEQ), generator=g) for _ in range(DP_BATCHES)]
        with torch.no_grad():
            logits = model(batches[0]).logits.float()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers 5 fuses the experts in memory"
        assert sorted(unfuse_experts(state)) == sorted(_saved_tensors(str(folder)))
        out[name] = (cfg.to_dict(), state, str(folder), batches, logits, {})
    return out


def _saved_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def _rank_moe(models: dict, dispatcher: str, from_folder: bool, export_root: str | None) -> dict:
    """Build each family at the pool's layout, load HF weights, one forward/backward through megatron DDP with this
    data-parallel rank's batch, gradients reduced (finalize_model_grads) and gathered back to HF names."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlvr.megatron.policy import wrap_ddp
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.export import export_hf, iter_hf_tensors
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout

    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    rank = torch.distributed.get_rank()
    out = {"layout": (pg.tp.size(), experts.ep_size, experts.etp_size, pg.dp.size())}
    for name, (cfg, state, folder, batches, _, _) in models.items():
        args = megatron_model_args(
            cfg, tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size, moe_dispatcher=dispatcher
        )
        model = build_gpt_model(args, pg_collection=pg)
        load_hf_weights(model, args, folder if from_folder else state, pg_collection=pg)
        ddp = wrap_ddp(model, distributed_optimizer=False)
        ddp.zero_grad_buffer()
        ids = batches[pg.dp.rank()]
        with torch.no_grad():
            model.eval()
            logits = gather_from_tensor_model_parallel_region(ddp(batches[0], _positions(batches[0]), None))
        model.train()
        out_logits = gather_from_tensor_model_parallel_region(ddp(ids, _positions(ids), None))
        loss = _ce(out_logits[..., : args.dims.vocab_size], ids)
        loss.backward()
        finalize_model_grads([ddp])
        # the reduced gradients, gathered to HF names by the export path (grads swapped into the parameters)
        saved = {n: p.data for n, p in model.named_parameters()}
        for p in model.parameters():
            p.data = p.main_grad.to(p.dtype)
        grads = {k: v.clone() for k, v in iter_hf_tensors(model, args, pg_collection=pg)}
        for n, p in model.named_parameters():
            p.data = saved[n]
        if export_root is not None:
            export_hf(model, args, os.path.join(export_root, name), pg_collection=pg)
        if rank == 0:
            out[name] = {"logits": logits[..., : args.dims.vocab_size].detach(), "grads": grads}
    return out


def _positions(ids):
    return torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


LAYOUTS = [
    # (tp, ep, etp, dispatcher, load from the saved folder)
    (1, 1, 1, "alltoall", False),
    (1, 2, 1, "alltoall", True),
    (1, 2, 1, "allgather", False),
    (2, 2, 2, "alltoall", True),
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,etp,dispatcher,from_folder", LAYOUTS)
def test_moe_logits_and_grads_match_transformers(dist_pool, moe_models, tmp_path, tp, ep, etp, dispatcher, from_folder):
    export_root = str(tmp_path) if (tp, ep) == (2, 2) else None
    results = dist_pool.run(
        _rank_moe, tp=tp, ep=ep, etp=etp, args=(moe_models, dispatcher, from_folder, export_root), timeout=400
    )
    r0 = results[0]
    _, _, _, dp = r0["layout"]
    for name, (_, _, folder, batches, ref_logits, ref_grads) in moe_models.items():
        from transformers import AutoModelForCausalLM

        if not ref_grads:  # computed once per family, for the data split of the layouts (dp is 4 or 2)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            ref_grads.update({d: _hf_grads(model, batches[:d]) for d in (2, 4)})
        err = _rel(r0[name]["logits"], ref_logits)
        grads = r0[name]["grads"]
        want = ref_grads[dp]
        assert sorted(grads) == sorted(want), name
        worst = max(((_rel(grads[k], want[k]), k) for k in want), key=lambda x: x[0])
        print(
            f"{name} tp={tp} ep={ep} etp={etp} {dispatcher}: logits {err:.1e}, worst grad {worst[0]:.1e} ({worst[1]})"
        )
        assert err < 1e-5, (name, err)
        assert worst[0] < 1e-4, (name, worst)
        if export_root is not None:  # the export is bit-identical to transformers' own checkpoint
            src, dst = _saved_tensors(folder), _saved_tensors(os.path.join(export_root, name))
            assert sorted(src) == sorted(dst)
            bad = [k for k in src if not torch.equal(src[k], dst[k])]
            assert not bad, (name, bad[:5])


def _rank_shims(models: dict) -> dict:
    """Forward the tiny Qwen3-MoE at the pool's layout (alltoall) with each CPU MoE shim suspended in turn."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.megatron.cpu_shims import MOE_SHIM_NAMES, suspend_moe_shim
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.mapping import ExpertLayout

    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    cfg, state, _, batches, _, _ = models["qwen3_moe"]
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    ids = torch.cat(batches)  # more tokens: the experts' token counts differ between ranks
    out = {}
    for name in (None, *MOE_SHIM_NAMES):
        model = build_gpt_model(args, pg_collection=pg)
        load_hf_weights(model, args, state, pg_collection=pg)
        model.eval()
        try:
            with suspend_moe_shim(name) if name else contextlib.nullcontext(), torch.no_grad():
                model(ids, _positions(ids), None)
            out[name] = "ok"
        except Exception as e:  # every rank fails before communicating, so no rank is left waiting
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow
def test_each_cpu_moe_shim_is_needed(dist_pool, moe_models):
    results = dist_pool.run(_rank_shims, tp=2, ep=2, etp=2, args=(moe_models,), timeout=300)
    r = results[0]
    assert r[None] == "ok", r
    assert r["te_names"].startswith("NameError") and "te_general_gemm" in r["te_names"], r
    assert r["host_split_sizes"].startswith("TypeError") and "all_to_all" in r["host_split_sizes"], r
    assert r["uneven_gloo_gather"].startswith(("RuntimeError", "DistBackendError")), r
    assert "size" in r["uneven_gloo_gather"], r


def _rank_to_megatron(models: dict, root: str) -> None:
    from megatron_rlvr.models.convert import to_megatron_on_rank

    for name, (_, _, folder, _, _, _) in models.items():
        to_megatron_on_rank(folder, os.path.join(root, name, "ckpt"))


def _rank_to_hf(models: dict, root: str) -> None:
    from megatron_rlvr.models.convert import to_hf_on_rank

    for name in models:
        to_hf_on_rank(os.path.join(root, name, "ckpt"), os.path.join(root, name, "hf"), max_shard_bytes=50_000)


@pytest.mark.slow
def test_checkpoint_reshards_when_ep_changes_and_converts_back_bit_identical(dist_pool, moe_models, tmp_path):
    """HF -> megatron checkpoint at EP=2, loaded at TP=2 + EP=4 (expert TP 1; megatron's dist checkpoint reshards
    the experts) -> HF: every tensor bit-identical to transformers' checkpoint."""
    dist_pool.run(_rank_to_megatron, tp=1, ep=2, args=(moe_models, str(tmp_path)), timeout=300)
    dist_pool.run(_rank_to_hf, tp=2, ep=4, etp=1, args=(moe_models, str(tmp_path)), timeout=300)
    for name, (_, _, folder, _, _, _) in moe_models.items():
        src, dst = _saved_tensors(folder), _saved_tensors(str(tmp_path / name / "hf"))
        assert sorted(src) == sorted(dst), name
        assert [k for k in src if not torch.equal(src[k], dst[k])] == [], name


def test_moe_config_translation_and_layout_errors():
    from megatron_rlvr.families.table import FAMILIES, moe_fields
    from megatron_rlvr.models.hf_config import megatron_model_args

    q3 = _configs()["qwen3_moe"].to_dict()
    assert "num_local_experts" in q3  # transformers 5 writes this name; hub configs say num_experts
    hub = {k: v for k, v in q3.items() if k != "num_local_experts"} | {"num_experts": 8}
    for cfg in (q3, hub):
        a = megatron_model_args(cfg, tp_size=2, ep_size=2, etp_size=1)
        c = a.config
        assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 32)
        assert c.moe_layer_freq == [1, 0, 1] and a.dims.moe_layers == (True, False, True)
        assert c.moe_router_pre_softmax is False and c.moe_router_dtype == "fp32"  # norm_topk_prob=True
        assert c.sequence_parallel and c.expert_tensor_parallel_size == 1 and c.moe_token_dispatcher_type == "alltoall"
        assert c.moe_router_load_balancing_type == "none" and c.moe_z_loss_coeff is None
    step = moe_fields(q3 | {"mlp_only_layers": [], "decoder_sparse_step": 2}, FAMILIES["Qwen3MoeForCausalLM"])
    assert step.moe_layers == (False, True, False)
    q2 = megatron_model_args(_configs()["qwen2_moe"].to_dict(), moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    c = q2.config
    assert c.moe_router_pre_softmax is True and c.moe_shared_expert_intermediate_size == 48 and c.moe_shared_expert_gate
    assert (
        c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff == 0.01 and c.moe_z_loss_coeff == 1e-3
    )
    assert c.add_qkv_bias
    with pytest.raises(ValueError, match="expert parallel size 3 does not divide num_experts=8"):
        megatron_model_args(q3, ep_size=3)
    with pytest.raises(ValueError, match="expert tensor parallel size 3 does not divide moe_intermediate_size"):
        megatron_model_args(q3, etp_size=3)
    with pytest.raises(ValueError, match="dispatcher"):
        megatron_model_args(q3, moe_dispatcher="flex")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        megatron_model_args({**q3, "architectures": ["Qwen3ForCausalLM"]}, ep_size=2)


def _moe_step(ddp, opt, sched, batches, step, pg):
    """One Adam step on the 4 batches of ``step`` (a rolled copy of the fixture's), this data-parallel rank's share
    as micro-batches of one batch each: the gradient is the mean token cross-entropy over all 4 at every layout."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = [torch.roll(b, shifts=step, dims=1) for b in batches]
    per = len(data) // pg.dp.size()
    micro = data[pg.dp.rank() * per : (pg.dp.rank() + 1) * per]

    def forward_step(it, model):
        ids = next(it)
        # next-token labels, the last position wrapping around: SEQ stays divisible by TP (sequence parallel)
        out = model(ids, _positions(ids), None, labels=torch.roll(ids, -1, dims=1))
        return out, lambda loss_bs: (loss_bs.float().mean(), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp], num_microbatches=len(micro),
        seq_length=SEQ, micro_batch_size=micro[0].shape[0], forward_only=False,
    )  # fmt: skip
    ok, _, _ = opt.step()
    assert ok
    sched.step(1)


def _moe_weights(ddp, args, pg) -> dict[str, torch.Tensor]:
    """Every HF-named weight (experts gathered over expert TP and EP) on global rank 0, {} elsewhere."""
    from megatron_rlvr.models.export import iter_hf_tensors

    weights = {k: v.clone() for k, v in iter_hf_tensors(ddp, args, pg_collection=pg)}
    return weights if torch.distributed.get_rank() == 0 else {}


def _rank_moe_resume(folder: str, batches, root: str, save: bool) -> dict:
    """save: at this layout load the HF weights, step on set 0, save the training checkpoint (plain and distributed
    optimizer), step on set 1. Else: a fresh model and optimizer (another seed) load that checkpoint at this layout
    and step on set 1."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from test_models_checkpointing import _setup

    from megatron_rlvr.models.checkpointing import (
        CheckpointConfig,
        checkpoint_model_args,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.mapping import ExpertLayout

    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    layout = dict(ep_size=experts.ep_size, etp_size=experts.etp_size)
    out = {"layout": (pg.tp.size(), experts.ep_size, experts.etp_size, pg.dp.size())}
    for kind, dist_opt in (("plain", False), ("distopt", True)):
        ckpt_root = os.path.join(root, kind)
        if save:
            args = megatron_model_args(folder, tp_size=pg.tp.size(), **layout)
        else:
            args = checkpoint_model_args(latest_checkpoint(ckpt_root), tp_size=pg.tp.size(), pp_size=1, **layout)
        # fresh weights from the HF folder, or (resuming) another random init: everything must come from disk
        ddp, opt, sched = _setup(args, dist_opt, seed=7 if save else 99, hf_folder=folder if save else None)
        if save:
            _moe_step(ddp, opt, sched, batches, 0, pg)
            cfg = CheckpointConfig(ckpt_root, keep_last=2, distrib_optim_sharding_type="fully_reshardable",
                                   write_processes=1)  # fmt: skip
            save_checkpoint(cfg, 1, model=ddp, optimizer=opt, scheduler=sched, trainer_state={"step": 1},
                            model_args=args)  # fmt: skip
        else:
            ckpt = latest_checkpoint(ckpt_root)
            out[kind, "state"] = load_checkpoint(ckpt, model=ddp, optimizer=opt, scheduler=sched)
        out[kind, "at_save"] = _moe_weights(ddp, args, pg)
        _moe_step(ddp, opt, sched, batches, 1, pg)
        out[kind, "next"] = _moe_weights(ddp, args, pg)
    return out


@pytest.mark.slow
def test_training_checkpoint_resumes_model_and_optimizer_at_another_ep(dist_pool, moe_models, tmp_path):
    """A training checkpoint of the Qwen3-MoE (one dense layer, 8 experts) saved at TP=1 x EP=2 (DP=4, expert-DP=2)
    after one Adam step resumes at TP=2 x EP=4 x expert TP 1 (DP=2, expert-DP=1): the weights are restored exactly
    and the NEXT step lands where the run that never stopped landed (Adam's moments of every expert moved to their
    new EP rank, for megatron's plain optimizer and its DistributedOptimizer); a fresh Adam would move every weight
    by ~lr instead."""
    _, _, folder, batches, _, _ = moe_models["qwen3_moe"]
    ref = dist_pool.run(_rank_moe_resume, tp=1, ep=2, args=(folder, batches, str(tmp_path), True), timeout=300)[0]
    res = dist_pool.run(_rank_moe_resume, tp=2, ep=4, etp=1, args=(folder, batches, str(tmp_path), False),
                        timeout=300)[0]  # fmt: skip
    assert ref["layout"] == (1, 2, 1, 4) and res["layout"] == (2, 4, 1, 2)
    for kind in ("plain", "distopt"):
        assert res[kind, "state"] == {"step": 1}
        saved, loaded = ref[kind, "at_save"], res[kind, "at_save"]
        assert sorted(saved) == sorted(loaded) and any(".mlp.experts." in k for k in saved)
        assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == [], kind
        nxt_ref, nxt = ref[kind, "next"], res[kind, "next"]
        moved = max((nxt_ref[k] - saved[k]).abs().max().item() for k in saved)
        worst = {k: (nxt[k] - nxt_ref[k]).abs().max().item() for k in saved}
        assert moved > 1e-3, "the reference step must move the weights measurably"
        assert max(worst.values()) < 1e-5, (kind, sorted(worst.items(), key=lambda kv: -kv[1])[:3])
