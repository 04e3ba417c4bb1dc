"""On-policy distillation under context parallelism (parallel.cp): the trainer's loss of a micro-batch
(trainer/token_loss.py policy_loss_fn, estimator ``full``: the exact reverse KL(p_s || p_t) over the whole vocabulary
against the teacher's logits shard) on a micro-batch split over CP = 2 ranks (megatron's load-balanced zig-zag
chunks, trainer/context_split.py), at CP = 2 and CP = 2 x TP = 2, against a hand-written float64 reference on the
full, unsplit sequences and the full vocabulary: the loss (the CP ranks' shares summed), the merged
``distill/kl_per_token`` and the gradient w.r.t. every student logit of every (position, vocabulary) entry.

The batch has padding, a multi-turn trajectory whose tool tokens are out of the loss mask, and seq-mean-token-mean
aggregation (each sequence's token count must be completed over the CP group). Controls, each of which must miss the
reference: the logits of each rank taken from contiguous chunks instead of the zig-zag ones (the chunk order
ignored), per-sequence sums not completed over the CP group, and each CP rank's share of the loss is large enough
that dropping it would show."""

import pytest
import torch

B, S, V, VOCAB = 4, 12, 40, 33  # padded vocabulary: ids 33..39 are padding; S a multiple of 2 x CP = 4
TEMP = 0.9
COEF = 0.7
PROMPTS = [3, 2, 5, 4]
LENGTHS = [12, 7, 10, 5]
LOSS_MASKS = {2: [1, 1, 0, 0, 1]}  # sequence 2: assistant, assistant, tool, tool, assistant


def _sequences():
    from megatron_rlvr.trainer.microbatch import Sequence

    g = torch.Generator().manual_seed(3)
    out = []
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        tokens = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(Sequence(tokens=tokens, prompt_len=p, rollout_logprobs=[0.0] * (n - p), loss_mask=LOSS_MASKS.get(i)))
    return out


def _logits():
    """Student and teacher logits [B, S, V] of the whole, unsplit micro-batch."""
    g = torch.Generator().manual_seed(17)
    return torch.randn(B, S, V, generator=g) * 2, torch.randn(B, S, V, generator=g) * 2


def _hand_mask():
    """[B, S] bool: the positions whose label is a trained response token (position t predicts token t + 1)."""
    m = torch.zeros(B, S, dtype=torch.bool)
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        lm = LOSS_MASKS.get(i, [1] * (n - p))
        for j in range(n - p):
            m[i, p - 1 + j] = bool(lm[j])
    return m


def _algo():
    from megatron_rlvr.algorithms import AlgorithmConfig

    distill = {"teacher": "tiny", "estimator": "full", "coef": COEF, "reward_weight": 0.0}
    agg = {"mode": "seq-mean-token-mean"}
    return AlgorithmConfig.from_dict({"policy_loss": {"name": "pg"}, "distill": distill, "aggregation": agg})


def _cp_rank_loss(variant: str):
    """On every rank: this rank's loss share, its gradient shard [B, S / cp, V / tp], its positions / columns and
    the loss metrics. ``variant``: ``zigzag`` (the real layout), ``contiguous`` (logits of contiguous chunks: the
    chunk order ignored), ``no_seq_sum`` (per-sequence sums not completed over CP)."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.algorithms import LossNormalizers
    from megatron_rlvr.megatron.context_parallel import zigzag_positions
    from megatron_rlvr.trainer import token_loss
    from megatron_rlvr.trainer.context_split import split_for_context_parallel
    from megatron_rlvr.trainer.loss_metrics import LossMetrics
    from megatron_rlvr.trainer.microbatch import build_microbatch

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    seqs = _sequences()
    mb = build_microbatch(seqs, B, S, 0)
    split = split_for_context_parallel(mb, cp, cp_rank)
    if variant == "contiguous":
        pos = torch.arange(cp_rank * S // cp, (cp_rank + 1) * S // cp)
    else:
        pos = zigzag_positions(S, cp, cp_rank)
    cols = slice(tp_rank * V // tp, (tp_rank + 1) * V // tp)
    student, teacher = _logits()
    x = student[:, pos, cols].contiguous().requires_grad_()
    t_shard = teacher[:, pos, cols].contiguous()
    spec = token_loss.StatsSpec(
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        vocab_size=VOCAB,
        temperature=TEMP,
        chunk_size=64,
        cp_group=ps.get_context_parallel_group(),
    )
    norms = LossNormalizers.from_batch(mb.mask)  # the whole micro-batch is the global batch
    real_sequence_sum = token_loss.sequence_sum
    if variant == "no_seq_sum":
        token_loss.sequence_sum = lambda group: None
    try:
        fn = token_loss.policy_loss_fn(_algo(), norms, spec, old_from_forward=True, teacher_logits_fn=lambda m: t_shard)
    finally:
        token_loss.sequence_sum = real_sequence_sum
    loss, out = fn(split, x)
    loss.backward()
    metrics = LossMetrics()
    metrics.add(out.metrics)
    return {
        "mask_ok": bool(torch.equal(mb.mask, _hand_mask())),
        "tp": (tp, tp_rank),
        "cp": (cp, cp_rank),
        "dp": ps.get_data_parallel_rank(),
        "loss": float(loss.detach()),
        "grad": x.grad.clone(),
        "pos": pos,
        "cols": cols,
        "metrics": metrics.state(),
    }


def _reference():
    """float64, whole sequences, full vocabulary: (loss, gradient [B, S, V], mean KL over the trained tokens)."""
    student, teacher = _logits()
    z = student.double().requires_grad_()
    ls = torch.log_softmax(z[..., :VOCAB] / TEMP, -1)
    lt = torch.log_softmax(teacher[..., :VOCAB].double() / TEMP, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)  # [B, S]
    m = _hand_mask()
    per_seq = [kl[i][m[i]].sum() / m[i].sum() for i in range(B) if m[i].any()]
    loss = COEF * torch.stack(per_seq).sum() / len(per_seq)
    loss.backward()
    return float(loss.detach()), z.grad, float(kl.detach()[m].mean())


def _assemble(outs):
    """Per (DP rank, TP rank): the CP ranks' loss shares, the gradient [B, S, V / tp] put back in global order, and
    the merged metrics (token-weighted over the CP ranks, as the trainer merges them)."""
    from megatron_rlvr.trainer.loss_metrics import LossMetrics

    groups = {}
    for o in outs:
        groups.setdefault((o["dp"], o["tp"][1]), []).append(o)
    out = {}
    for key, members in groups.items():
        assert sorted(m["cp"][1] for m in members) == list(range(members[0]["cp"][0])), key
        grad = torch.zeros(B, S, members[0]["grad"].shape[-1])
        for m in members:
            grad[:, m["pos"]] += m["grad"]
        shares = [m["loss"] for m in members]
        merged = LossMetrics.merge([m["metrics"] for m in members], 1)
        out[key] = (shares, grad, members[0]["cols"], merged)
    return out


def _check(outs, expect_match: bool):
    """True when every (DP, TP) group matches the reference (loss 1e-6, kl_per_token 1e-6, gradient 1e-6 abs)."""
    r_loss, r_grad, r_kl = _reference()
    ok = True
    for (dp, tp_rank), (shares, grad, cols, merged) in _assemble(outs).items():
        loss = sum(shares)
        g_err = float((grad.double() - r_grad[..., cols]).abs().max())
        match = abs(loss - r_loss) < 1e-6 and abs(merged["distill/kl_per_token"] - r_kl) < 1e-6 and g_err < 1e-6
        if expect_match:
            assert match, (dp, tp_rank, loss, r_loss, merged["distill/kl_per_token"], r_kl, g_err)
            # every CP rank's share is far above the tolerance: a dropped rank would miss the reference
            assert min(abs(s) for s in shares) > 1e-2 * abs(r_loss), shares
        ok = ok and match
    return ok


@pytest.mark.parametrize("tp", [1, 2])
def test_full_distillation_kl_at_cp2_matches_fp64_whole_sequences(dist_pool, tp):
    """CP = 2 (x TP = 2): loss, merged kl_per_token and every logit's gradient equal the float64 reference on the
    whole sequences and vocabulary; the multi-turn mask of the micro-batch is the hand-written one. Controls: with
    contiguous chunks, or without the per-sequence sums over CP, the result misses the reference."""
    outs = dist_pool.run(_cp_rank_loss, tp=tp, cp=2, args=("zigzag",), timeout=240)
    assert all(o["mask_ok"] for o in outs)
    assert {o["cp"] for o in outs} == {(2, 0), (2, 1)} and {o["tp"][0] for o in outs} == {tp}
    assert _check(outs, expect_match=True)
    for control in ("contiguous", "no_seq_sum"):
        assert not _check(dist_pool.run(_cp_rank_loss, tp=tp, cp=2, args=(control,), timeout=240), False), control
