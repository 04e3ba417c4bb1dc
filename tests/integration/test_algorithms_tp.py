"""Exactness under tensor + data parallelism: MCPO (query weights + margin credit + hinge-KL) and CPGD (clipped PG +
policy drift) computed from vocab-sharded logits at TP = 2 (with DP = 2 and global normalisers all-reduced over DP)
match the same losses computed on the full, unsharded logits: the loss and the gradient w.r.t. every logit, to fp32
precision. References: fp64 torch on the full vocabulary (independent of the ops), and the TP = 1 fp32 ops run.

One spawn (the session's 4-rank pool, TP = 2 x DP = 2) runs every case."""

import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossInputs,
    compute_advantages,
    compute_policy_loss,
    local_normalizer_counts,
    mastered_rollouts,
    preset,
)

G, N, T, V, VOCAB = 2, 4, 5, 50, 47  # 8 sequences; V padded to 50, ids 47..49 are padding (all on TP rank 1)
B = G * N
CASES = {
    "mcpo_margin": {},  # MCPO query weights + margin credit + hinge-KL
    "cpgd": {},  # clipped PG + drift 0.01
    "cpgd_strong_drift": {"drift": {"coef": 1.0, "clip": 0.1}},  # drift dominant and often capped
}


def _case_cfg(name: str) -> AlgorithmConfig:
    base = "cpgd" if name.startswith("cpgd") else name
    return preset(base, **CASES[name])


def _data():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(B * T, V, generator=g) * 2
    old_logits = logits + 0.3 * torch.randn(B * T, V, generator=g)  # |d| mostly > delta, some clipped ratios
    ids = torch.randint(0, VOCAB, (B * T,), generator=g)
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]])  # group 0 mastered, group 1 p = 0.75
    lengths = torch.tensor([5, 3, 0, 4, 5, 1, 2, 5])  # ragged, one empty response
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logits, old_logits, ids, rewards, mask


def _stats_fp64(logits_TV: torch.Tensor, ids: torch.Tensor):
    """Independent reference: fp64 log-softmax over the TRUE vocabulary (padding columns dropped)."""
    lp = torch.log_softmax(logits_TV[:, :VOCAB].double(), dim=-1)
    top2 = lp.exp().topk(2, dim=-1).values
    return lp.gather(1, ids[:, None])[:, 0], (top2[:, 0] - top2[:, 1]).detach()


def _loss(cfg, logp_BT, old_BT, margin_BT, mask_BT, adv_B, mastered_B, norms):
    inp = PolicyLossInputs(logp_BT, old_BT, mask_BT, adv_B=adv_B, margin_BT=margin_BT, mastered_B=mastered_B)
    return compute_policy_loss(cfg, inp, norms)


def _tp_dp_check():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rlvr.ops.vocab_parallel import vocab_parallel_token_stats

    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    assert (tp, dp) == (2, 2)
    logits, old_logits, ids, rewards, mask = _data()
    vs = V // tp
    cols = slice(tp_rank * vs, (tp_rank + 1) * vs)
    rows_B = torch.arange(dp_rank, B, dp)  # this DP rank's sequences (interleaved: both groups on both ranks)
    tok = (rows_B[:, None] * T + torch.arange(T)[None, :]).reshape(-1)
    out = {}
    for name in CASES:
        cfg = _case_cfg(name)
        adv_Gn, _ = compute_advantages(cfg, rewards)  # global rollout batch: identical on every rank
        adv_B, mastered_B = adv_Gn.reshape(-1), mastered_rollouts(cfg, rewards).reshape(-1)

        # (1) fp64 full-vocabulary reference on the whole batch
        ref_logits = logits.double().requires_grad_()
        lp, margin = _stats_fp64(ref_logits, ids)
        old_lp, _ = _stats_fp64(old_logits, ids)
        norms = LossNormalizers.from_batch(mask, mastered_B)
        ref_loss, ref_metrics = _loss(
            cfg, lp.view(B, T), old_lp.view(B, T), margin.view(B, T), mask, adv_B.double(), mastered_B, norms
        )
        (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)

        # (2) TP = 1 fp32 ops on the whole batch
        full = logits.clone().requires_grad_()
        s1 = vocab_parallel_token_stats(full, token_ids_T=ids, vocab_size=VOCAB, want=("logprob", "margin"))
        o1 = vocab_parallel_token_stats(old_logits, token_ids_T=ids, vocab_size=VOCAB)["logprob"]
        tp1_loss, _ = _loss(
            cfg, s1["logprob"].view(B, T), o1.view(B, T), s1["margin"].view(B, T), mask, adv_B, mastered_B, norms
        )
        (tp1_grad,) = torch.autograd.grad(tp1_loss, full)

        # (3) TP = 2 x DP = 2: this rank's sequences and vocabulary shard; normalisers all-reduced over DP
        shard = logits[tok, cols].clone().requires_grad_()
        s2 = vocab_parallel_token_stats(
            shard, tp_group=tp_group, token_ids_T=ids[tok], vocab_size=VOCAB, want=("logprob", "margin")
        )
        o2 = vocab_parallel_token_stats(
            old_logits[tok, cols].contiguous(), tp_group=tp_group, token_ids_T=ids[tok], vocab_size=VOCAB
        )["logprob"]
        counts = local_normalizer_counts(mask[rows_B], mastered_B[rows_B]).contiguous()
        dist.all_reduce(counts, group=dp_group)
        bl = len(rows_B)
        loss, metrics = _loss(
            cfg,
            s2["logprob"].view(bl, T),
            o2.view(bl, T),
            s2["margin"].view(bl, T),
            mask[rows_B],
            adv_B[rows_B],
            mastered_B[rows_B],
            LossNormalizers.from_counts(counts),
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)  # the DP ranks' shares sum to the full-batch loss
        out[name] = dict(
            loss=total.item(),
            ref_loss=ref_loss.item(),
            tp1_loss=tp1_loss.item(),
            grad=shard.grad,
            ref_grad=ref_grad[tok, cols].float(),
            tp1_grad=tp1_grad[tok, cols],
            ref_grad_absmax=ref_grad.abs().max().item(),
            tp_rank=tp_rank,
            metrics={k: float(v) for k, v in ref_metrics.items()},
        )
    return out


def test_mcpo_and_cpgd_tp2_dp2_match_unsharded(dist_pool):
    outs = dist_pool.run(_tp_dp_check, tp=2, pp=1, timeout=240)
    for name in CASES:
        per_rank = [o[name] for o in outs]
        scale = per_rank[0]["ref_grad_absmax"]
        assert scale > 0
        for r in per_rank:
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * max(1.0, abs(r["ref_loss"])), (
                name,
                r["loss"],
                r["ref_loss"],
            )
            assert abs(r["loss"] - r["tp1_loss"]) <= 1e-6 * max(1.0, abs(r["tp1_loss"])), name
            torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-5, atol=1e-6 * scale, msg=name)
            torch.testing.assert_close(r["grad"], r["tp1_grad"], rtol=1e-5, atol=1e-7 * scale, msg=name)
            if r["tp_rank"] == 1:  # padding ids 47..49 are this shard's local columns 22..24: zero gradient
                assert torch.equal(r["grad"][:, VOCAB - V // 2 :], torch.zeros_like(r["grad"][:, VOCAB - V // 2 :]))
        m = per_rank[0]["metrics"]
        # the pieces under test are active in this batch
        if name == "mcpo_margin":
            assert m["mcpo/hinge_active_frac"] > 0.5 and m["mcpo/hinge_kl"] > 0 and m["credit/weight_spread"] > 0.05
        else:
            assert m["drift/kl"] > 0 and m["loss/clip_frac_high"] + m["loss/clip_frac_low"] > 0
            if name == "cpgd_strong_drift":
                assert m["drift/capped_frac"] > 0
