"""Per-token policy losses: value and gradient of each token against hand-worked cases (ratios chosen so each clip
branch is hit), plus GSPO's token form against the direct sequence-level objective."""

import math

import pytest
import torch

from megatron_rlvr.algorithms import (
    POLICY_LOSSES,
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossConfig,
    PolicyLossInputs,
    compute_policy_loss,
)

LN = math.log


def _run(name, log_ratios, adv, old=None, **pl):
    """Per-token loss values and d loss_t / d logp_t for one row of tokens (float64)."""
    cfg = PolicyLossConfig(name=name, **pl)
    lr = torch.tensor([log_ratios], dtype=torch.float64)
    old = torch.full_like(lr, -1.0) if old is None else torch.tensor([old], dtype=torch.float64)
    logp = (old + lr).requires_grad_()
    a = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(a, dtype=torch.bool)
    loss, metrics = POLICY_LOSSES[name](cfg, logp, old, a, mask)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach()[0], grad[0], metrics


def test_ppo_clip_each_branch():
    """eps = 0.2. t0: r=1.5, A=+1 -> clipped at -1.2, no grad. t1: r=0.5, A=+1 -> -0.5, grad -0.5.
    t2: r=1.1, A=-1 -> 1.1, grad 1.1. t3: r=0.7, A=-1 -> clipped at 0.8, no grad."""
    loss, grad, m = _run("ppo", [LN(1.5), LN(0.5), LN(1.1), LN(0.7)], [1.0, 1.0, -1.0, -1.0])
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.1, 0.8], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, 1.1, 0.0], dtype=torch.float64))
    assert m["loss/clip_frac_high"] == 0.25 and m["loss/clip_frac_low"] == 0.25


def test_dapo_clip_higher():
    """eps_low 0.2, eps_high 0.28: r = 1.25 with A > 0 is inside [0.8, 1.28] (grad -1.25), r = 1.5 clips at 1.28,
    r = 0.75 with A < 0 clips at 0.8 (the lower range is unchanged)."""
    loss, grad, m = _run("ppo", [LN(1.25), LN(1.5), LN(0.75)], [1.0, 1.0, -1.0], eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.25, -1.28, 0.8], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-1.25, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(m["loss/clip_frac_high"], torch.tensor(1 / 3))


def test_dual_clip():
    """c = 3: A = -1, r = 5 -> PPO loss 5 capped at 3 (no grad); A = -1, r = 2 -> 2 (grad 2); A = +2, r = 5 ->
    ordinary clip -2.4."""
    loss, grad, m = _run("dual_clip", [LN(5.0), LN(2.0), LN(5.0)], [-1.0, -1.0, 2.0], dual_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -2.4], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(m["loss/dual_clip_frac"], torch.tensor(1 / 3))


def test_cispo_stop_gradient_clipped_weight():
    """l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp: gradient -w A on every token, never dropped."""
    old = [-1.0, -2.0, -1.0]
    loss, grad, m = _run("cispo", [LN(1.5), LN(0.5), LN(1.1)], [1.0, 2.0, -1.0], old=old, eps_low=None, eps_high=0.2)
    w = torch.tensor([1.2, 0.5, 1.1], dtype=torch.float64)  # no lower bound: r = 0.5 is kept
    a = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    logp = torch.tensor(old, dtype=torch.float64) + torch.tensor([LN(1.5), LN(0.5), LN(1.1)], dtype=torch.float64)
    torch.testing.assert_close(loss, -w * a * logp)
    torch.testing.assert_close(grad, -w * a)
    torch.testing.assert_close(m["loss/clip_frac_high"], torch.tensor(1 / 3))
    assert m["loss/clip_frac_low"] == 0.0
    _, grad, m = _run("cispo", [LN(0.5)], [1.0], eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(grad, torch.tensor([-0.8], dtype=torch.float64))
    assert m["loss/clip_frac_low"] == 1.0


def test_gspo_sequence_ratio_hand_computed():
    """Log-ratios 0.1 and 0.3: s = e^0.2. eps 0.2: A = +1 clips at 1.2 (no grad); A = -1 keeps s (grad s per
    token, the token-form derivative of s_it = sg(s) pi_t / sg(pi_t))."""
    s = math.exp(0.2)
    loss, grad, _ = _run("gspo", [0.1, 0.3], [1.0, 1.0], eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.2], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.zeros(2, dtype=torch.float64))
    loss, grad, m = _run("gspo", [0.1, 0.3], [-1.0, -1.0], eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([s, s], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([s, s], dtype=torch.float64))
    torch.testing.assert_close(m["loss/seq_ratio_mean"], torch.tensor(s, dtype=torch.float32))


def test_gspo_token_form_equals_sequence_objective():
    """With seq-mean-token-mean the GSPO-token gradient equals that of the sequence-level objective
    -1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (logp - old))."""
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.01 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    cfg = AlgorithmConfig.from_dict(
        {
            "policy_loss": {"name": "gspo", "eps_low": 3e-3, "eps_high": 4e-3},
            "aggregation": {"mode": "seq-mean-token-mean"},
        }
    )
    loss, _ = compute_policy_loss(cfg, PolicyLossInputs(logp, old, mask, adv_B=adv), LossNormalizers.from_batch(mask))
    (g_tok,) = torch.autograd.grad(loss, logp)
    lr = torch.where(mask, logp - old, torch.zeros_like(logp))
    s = (lr.sum(1) / mask.sum(1)).exp()
    ref = -torch.minimum(s * adv, s.clamp(1 - 3e-3, 1 + 4e-3) * adv).mean()
    (g_seq,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-10, atol=1e-12)
    assert g_tok.abs().sum() > 0 and (g_tok == 0).any()  # some sequences clipped, some not


def test_plain_pg():
    loss, grad, m = _run("pg", [0.3, -0.2], [2.0, -1.0], old=[-1.0, -2.0])
    torch.testing.assert_close(loss, torch.tensor([-2.0 * -0.7, 1.0 * -2.2], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-2.0, 1.0], dtype=torch.float64))
    assert m["loss/clip_frac_low"] == 0 and m["loss/clip_frac_high"] == 0


def test_cpgd_clipped_policy_gradient():
    """eps 0.2, old = -1: bounds ln(1.2) = 0.1823, ln(0.8) = -0.2231 on the log-ratio.
    A=+2, d=0.3 -> -2(old + ln 1.2), no grad; A=+2, d=0.1 -> -2 logp, grad -2;
    A=-1, d=-0.3 -> +(old + ln 0.8), no grad; A=-1, d=0.1 -> logp, grad +1; A=0 -> 0."""
    loss, grad, m = _run("cpgd", [0.3, 0.1, -0.3, 0.1, 0.5], [2.0, 2.0, -1.0, -1.0, 0.0])
    expected = [-2 * (-1 + LN(1.2)), -2 * (-0.9), (-1 + LN(0.8)), -0.9, 0.0]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([0.0, -2.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    assert m["loss/clip_frac_high"] == 0.2 and m["loss/clip_frac_low"] == 0.2


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_garbage_gives_no_nan(name):
    """Padding positions holding inf/NaN log-probs must not leak NaN into the loss or the gradient."""
    eps_low = None if name == "cispo" else 0.2
    cfg = AlgorithmConfig.from_dict({"policy_loss": {"name": name, "eps_low": eps_low}})
    logp = torch.tensor([[-1.0, float("nan"), -float("inf")], [-0.5, -0.7, 300.0]]).requires_grad_()
    old = torch.tensor([[-1.1, float("inf"), 0.0], [-0.4, -0.9, -300.0]])
    mask = torch.tensor([[True, False, False], [True, True, False]])
    loss, metrics = compute_policy_loss(
        cfg, PolicyLossInputs(logp, old, mask, adv_B=torch.tensor([1.0, -1.0])), LossNormalizers.from_batch(mask)
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all() and (logp.grad[mask] != 0).any()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_extreme_log_ratio_is_clamped_not_nan():
    """A token with log-ratio 500 (exp overflows) gives a finite loss and zero gradient once clipped."""
    loss, grad, _ = _run("ppo", [500.0, 0.0], [1.0, 1.0])
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and grad[0] == 0
