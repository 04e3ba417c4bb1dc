"""Loss aggregation with global normalisers: hand-computed modes, and the split invariance they give: for every
preset (and the remaining loss/regulariser options), 1 vs 4 micro-batches and 1 vs 2 simulated DP ranks give the
same loss and the same gradients (sum over shards == full batch), with empty responses and fully masked rows; and
the same for the POSITIONS of every sequence split over 2 simulated context-parallel ranks (two threads whose
``seq_sum`` adds their per-sequence sums)."""

import threading

import pytest
import torch

from megatron_rlvr.algorithms import (
    PRESETS,
    AggregationConfig,
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossInputs,
    aggregate,
    compute_policy_loss,
    local_normalizer_counts,
    preset,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    ("mode", "local", "global_"),
    [
        ("token-mean", 7 / 3, 7 / 6),  # (1 + 2 + 4) / N_tok
        ("seq-mean-token-mean", (1.5 + 4) / 2, (1.5 + 4) / 4),  # per-sequence means / N_seq
        ("seq-mean-token-sum", (3 + 4) / 2, (3 + 4) / 4),
        ("seq-mean-token-sum-norm", 7 / (2 * 10), 7 / (4 * 10)),  # / (N_seq * C), C = 10
    ],
)
def test_modes_hand_computed(mode, local, global_):
    cfg = AggregationConfig(mode=mode, token_sum_norm=10.0)
    # local counts: 3 tokens, 2 non-empty sequences (the fully masked row is not a sequence)
    norms = LossNormalizers.from_batch(MASK)
    assert (norms.num_tokens, norms.num_seqs) == (3.0, 2.0)
    torch.testing.assert_close(aggregate(VALUES, MASK, cfg, norms), torch.tensor(local, dtype=torch.float64))
    big = LossNormalizers(num_tokens=6, num_seqs=4)  # the rest of the global batch lives elsewhere
    torch.testing.assert_close(aggregate(VALUES, MASK, cfg, big), torch.tensor(global_, dtype=torch.float64))


def test_zero_global_count_gives_zero_not_nan():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    x = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out = aggregate(x, mask, AggregationConfig(mode=mode, token_sum_norm=4.0), LossNormalizers(0, 0))
        (g,) = torch.autograd.grad(out, x)
        assert out.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


def test_local_counts_and_normalizer_validation():
    mastered = torch.tensor([True, False, True])  # row 2 is mastered but empty: not counted
    assert local_normalizer_counts(MASK, mastered).tolist() == [3.0, 2.0, 1.0]
    n = LossNormalizers.from_counts(local_normalizer_counts(MASK, mastered) * 4)
    assert (n.num_tokens, n.num_seqs, n.num_mastered_seqs) == (12.0, 8.0, 4.0)
    with pytest.raises(ValueError, match="num_tokens must be a finite count"):
        LossNormalizers(num_tokens=-1, num_seqs=0)
    with pytest.raises(ValueError, match="num_seqs"):
        LossNormalizers(num_tokens=1, num_seqs=2)
    with pytest.raises(ValueError, match="token_sum_norm"):
        AggregationConfig(mode="seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------- split invariance
B, T = 8, 11

EXTRA_CONFIGS = {
    "dual_clip+entropy": {"policy_loss": {"name": "dual_clip"}, "entropy": {"coef": 0.01}},
    "pg+exact_kl+seq_sum": {
        "policy_loss": {"name": "pg"},
        "ref_kl": {"coef": 0.1, "estimator": "exact"},
        "aggregation": {"mode": "seq-mean-token-sum"},
    },
    "cpgd+clip_filter+margin+hinge": {
        "margin_credit": {"enabled": True},
        "hinge_kl": {"enabled": True, "delta": 0.001},
        "ref_kl": {"coef": 0.05, "estimator": "k1"},
    },
}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some tokens clip, some do not
    lengths = torch.tensor([11, 3, 0, 7, 1, 11, 5, 9])  # ragged, with an empty response
    mask = torch.arange(T)[None, :] < lengths[:, None]
    # garbage at padded positions must not matter
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan")))
    return dict(
        logp=logp,
        old=old,
        mask=mask,
        adv=torch.randn(B, generator=g, dtype=torch.float64),
        ref=old - 0.2 * torch.rand(B, T, generator=g, dtype=torch.float64),
        exact_kl=torch.rand(B, T, generator=g, dtype=torch.float64),
        entropy=torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
        margin=torch.rand(B, T, generator=g, dtype=torch.float64),
        mastered=torch.tensor([True, False, True, True, False, False, True, False]),
    )


def _loss_and_grads(cfg, data, rows, norms):
    """Loss on `rows` of the batch with the given normalisers; gradients w.r.t. the full-batch leaf tensors."""
    leaves = {k: data[k].clone().requires_grad_() for k in ("logp", "exact_kl", "entropy")}
    idx = torch.as_tensor(rows)
    inp = PolicyLossInputs(
        logp_BT=leaves["logp"][idx],
        old_logp_BT=data["old"][idx],
        mask_BT=data["mask"][idx],
        adv_B=data["adv"][idx],
        ref_logp_BT=data["ref"][idx],
        ref_kl_BT=leaves["exact_kl"][idx],
        entropy_BT=leaves["entropy"][idx],
        margin_BT=data["margin"][idx],
        mastered_B=data["mastered"][idx],
    )
    loss, metrics = compute_policy_loss(cfg, inp, norms)
    loss.backward()
    # unused inputs get no gradient; a NaN is mapped to a huge value so any NaN fails the comparison
    grads = {
        k: torch.zeros_like(v) if v.grad is None else torch.nan_to_num(v.grad, nan=1e30) for k, v in leaves.items()
    }
    return loss.detach(), grads, metrics


def _global_norms(data, shards):
    counts = sum(
        local_normalizer_counts(data["mask"][torch.as_tensor(s)], data["mastered"][torch.as_tensor(s)]) for s in shards
    )
    return LossNormalizers.from_counts(counts)  # the counts of the whole mini-batch, over every shard


def _split_total(cfg, data, shards):
    norms = _global_norms(data, shards)
    total_loss, total_grads = 0.0, None
    for rows in shards:
        loss, grads, _ = _loss_and_grads(cfg, data, rows, norms)
        total_loss = total_loss + loss
        total_grads = grads if total_grads is None else {k: total_grads[k] + grads[k] for k in grads}
    return total_loss, total_grads


ALL_CONFIGS = {name: (lambda n=name: preset(n)) for name in PRESETS} | {
    name: (lambda o=over, b=("cpgd" if "cpgd" in name else "grpo"): AlgorithmConfig.from_dict(o, base=preset(b)))
    for name, over in EXTRA_CONFIGS.items()
}


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_micro_batch_and_dp_split_invariance(name):
    cfg = ALL_CONFIGS[name]()
    if name == "cpgd+clip_filter+margin+hinge":
        assert cfg.policy_loss.name == "cpgd" and cfg.drift.coef > 0
    data = _batch()
    full = [list(range(B))]
    loss1, grads1, metrics = _loss_and_grads(cfg, data, full[0], _global_norms(data, full))
    assert torch.isfinite(loss1) and all(torch.isfinite(g).all() for g in grads1.values())
    assert grads1["logp"].abs().sum() > 0
    micro4 = [[0, 1], [2, 3], [4, 5], [6, 7]]
    dp2 = [[0, 2], [4, 6], [1, 3], [5, 7]]  # rank 0: rows 0,2,4,6 in 2 micro-batches; rank 1: the odd rows
    for shards in (micro4, dp2):
        loss_s, grads_s = _split_total(cfg, data, shards)
        torch.testing.assert_close(loss_s, loss1, rtol=1e-12, atol=1e-13)
        for k in grads1:
            torch.testing.assert_close(grads_s[k], grads1[k], rtol=1e-12, atol=1e-13)


def test_local_normalisers_would_break_invariance():
    """Negative control: dividing each micro-batch by its OWN counts (the verl/TRL bug) changes the gradient on this
    ragged batch, so the invariance test above can fail."""
    cfg = preset("dapo")
    data = _batch()
    _, grads1, _ = _loss_and_grads(cfg, data, list(range(B)), _global_norms(data, [list(range(B))]))
    buggy = None
    for rows in [[0, 1], [2, 3], [4, 5], [6, 7]]:
        own = LossNormalizers.from_batch(data["mask"][torch.as_tensor(rows)])
        _, g, _ = _loss_and_grads(cfg, data, rows, own)
        buggy = g["logp"] / 4 if buggy is None else buggy + g["logp"] / 4
    assert (buggy - grads1["logp"]).abs().max() > 1e-3


def _cp_split_total(cfg, data, complete: bool):
    """Loss and gradients summed over 2 simulated context-parallel ranks, each holding the positions megatron's
    zig-zag split gives it (of T padded to 12) and computing in its own thread; ``complete``: their ``seq_sum`` adds
    both ranks' per-sequence sums (a barrier-synchronised exchange), else None (rank-local sums)."""
    from megatron_rlvr.megatron.context_parallel import zigzag_positions

    cp = 2
    parts = []
    for r in range(cp):
        held = torch.zeros(12, dtype=torch.bool)
        held[zigzag_positions(12, cp, r)] = True
        parts.append(held[:T])
    barrier = threading.Barrier(cp, timeout=30)
    box: list = [None] * cp
    out: list = [None] * cp

    def rank(r):
        def seq_sum(x_B):
            box[r] = x_B.detach().clone()
            barrier.wait()
            total = box[0] + box[1]  # the same order on both ranks: the same floats
            barrier.wait()
            return total

        leaves = {k: data[k].clone().requires_grad_() for k in ("logp", "exact_kl", "entropy")}
        inp = PolicyLossInputs(
            logp_BT=leaves["logp"],
            old_logp_BT=data["old"],
            mask_BT=data["mask"] & parts[r][None, :],
            adv_B=data["adv"],
            ref_logp_BT=data["ref"],
            ref_kl_BT=leaves["exact_kl"],
            entropy_BT=leaves["entropy"],
            margin_BT=data["margin"],
            mastered_B=data["mastered"],
            seq_sum=seq_sum if complete else None,
        )
        try:
            loss, _ = compute_policy_loss(cfg, inp, _global_norms(data, [list(range(B))]))
            loss.backward()
            grads = {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in leaves.items()}
            out[r] = (loss.detach(), grads)
        except BaseException as e:  # re-raised below; release the peer
            barrier.abort()
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out[0][0] + out[1][0], {k: out[0][1][k] + out[1][1][k] for k in out[0][1]}


def _sums_over_sequences(cfg) -> bool:
    """A configuration with a sum over a whole sequence: |y_i| of seq-mean-token-mean, GSPO's mean log-ratio, margin
    credit's per-sequence mean, the hinge-KL's |y_i|. The others only sum tokens over global counts."""
    return (
        cfg.aggregation.mode == "seq-mean-token-mean"
        or cfg.policy_loss.name == "gspo"
        or cfg.margin_credit.enabled
        or cfg.hinge_kl.enabled
    )


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_context_parallel_position_split_invariance(name):
    """The positions of every sequence split over 2 ranks (context parallelism): the ranks' losses and gradients
    add up to the full batch's when ``seq_sum`` completes the per-sequence sums; rank-local sums (``seq_sum`` None,
    the bug a CP trainer that forgot the CP group would have) change exactly the configurations in
    ``_sums_over_sequences``."""
    cfg = ALL_CONFIGS[name]()
    data = _batch()
    loss1, grads1, _ = _loss_and_grads(cfg, data, list(range(B)), _global_norms(data, [list(range(B))]))
    loss_cp, grads_cp = _cp_split_total(cfg, data, complete=True)
    torch.testing.assert_close(loss_cp, loss1, rtol=1e-12, atol=1e-13)
    for k in grads1:
        torch.testing.assert_close(grads_cp[k], grads1[k], rtol=1e-12, atol=1e-13)
    loss_bad, grads_bad = _cp_split_total(cfg, data, complete=False)
    err = max(float((loss_bad - loss1).abs()), float((grads_bad["logp"] - grads1["logp"]).abs().max()))
    if _sums_over_sequences(cfg):
        assert err > 1e-3, (name, err)
    else:
        assert err < 1e-12, (name, err)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fully_masked_micro_batch_and_zero_variance_is_finite(name):
    """A micro-batch whose rows are all empty (and whose advantages are all 0) gives loss 0, zero gradient, finite
    metrics, for every preset."""
    cfg = preset(name)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    logp = torch.full((3, 4), float("nan"), requires_grad=True)
    inp = PolicyLossInputs(
        logp,
        torch.full((3, 4), float("inf")),
        mask,
        adv_B=torch.zeros(3),
        ref_logp_BT=torch.zeros(3, 4),
        margin_BT=torch.zeros(3, 4),
        mastered_B=torch.ones(3, dtype=torch.bool),
    )
    loss, metrics = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=10, num_seqs=2, num_mastered_seqs=1))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(torch.isfinite(v) for v in metrics.values()), metrics


def test_counts_from_lengths_match_the_mask_counts():
    """normalizer_counts_from_lengths (the trainer counts from sequence lengths) gives, by hand: 1 + 2 + 0 + 4 = 7
    tokens, 3 non-empty sequences, 1 non-empty mastered one (the mastered empty row is not counted); and the same
    as local_normalizer_counts on the masks of those lengths."""
    from megatron_rlvr.algorithms import normalizer_counts_from_lengths

    len_B = torch.tensor([1, 2, 0, 4])
    mastered_B = torch.tensor([False, True, True, False])
    got = normalizer_counts_from_lengths(len_B, mastered_B)
    assert got.dtype == torch.float64 and got.tolist() == [7.0, 3.0, 1.0]
    mask_BT = torch.arange(5)[None, :] < len_B[:, None]
    assert torch.equal(local_normalizer_counts(mask_BT, mastered_B), got)
    with pytest.raises(ValueError, match=r"len_B must be \[B\]"):
        normalizer_counts_from_lengths(mask_BT)
