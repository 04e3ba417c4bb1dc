"""Bounded gradients on extreme ratios: every policy loss, every regulariser and every preset through
``compute_policy_loss`` is held, in fp64 autograd, to the per-token gradient bound documented in docs/algorithms.md
("Gradient bounds"), on log-ratios from -50 to 50 and advantages from 1e-8 to 1e6 in magnitude. The bounds below are
written from the formulas (not read from the code), and each one is also shown to be reached (within 10%) on the grid,
so a bound looser than the code's behaviour is caught too. Plus the hand-computed GSPO case of a sequence whose
ratio exploded (A = -1, log r = [11])."""

import math

import pytest
import torch

from megatron_rlvr.algorithms import (
    POLICY_LOSSES,
    PRESETS,
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossConfig,
    PolicyLossInputs,
    compute_policy_loss,
    preset,
)
from megatron_rlvr.algorithms.cpgd import policy_drift_per_token
from megatron_rlvr.algorithms.mcpo import hinge_phi_bounded
from megatron_rlvr.algorithms.regularizers import ref_kl_per_token

F64 = torch.float64
ADVS = (-1e6, -1.0, -1e-8, 1e-8, 1.0, 1e6)
EXTREME = (-50.0, -20.5, -11.0, -3.0, -0.5, 0.0, 0.5, math.log(2.9), 9.99, 10.0, 10.5, 11.0, 19.99, 20.5, 50.0)
RTOL = 1e-9  # fp64 rounding of the bound's own arithmetic


def policy_bound(pl: PolicyLossConfig) -> float:
    """max |d l_t / d logp_t| / |A_t| of one policy loss (docs/algorithms.md, "Gradient bounds"):
    ppo: for A < 0 the unclipped branch -A r is kept for every r > 1 - eps_low, r <= e^C (C = log_ratio_clamp).
    dual clip (ppo, gspo): A < 0 loses its gradient once the loss reaches -c A, i.e. r (or s) >= c; A > 0 keeps it
    only below 1 + eps_high. cispo: the weight is clipped to <= 1 + eps_high. gspo: s <= e^min(L, C)
    (L = seq_log_ratio_clamp; the token log-ratios are already clamped at C). pg, cpgd: no ratio factor, |A|."""
    c, hi, C = pl.dual_clip_c, 1.0 + pl.eps_high, pl.log_ratio_clamp
    if pl.name == "dual_clip" or (pl.name in ("ppo", "gspo") and pl.dual_clip):
        return max(c, hi)
    if pl.name == "ppo":
        return math.exp(C)
    if pl.name == "gspo":
        return math.exp(min(pl.seq_log_ratio_clamp, C))
    if pl.name == "cispo":
        return hi
    if pl.name in ("pg", "cpgd"):
        return 1.0
    raise AssertionError(f"policy loss {pl.name!r} has no documented gradient bound: add it here and to the docs")


def k3_bound(k3_clamp: float) -> float:
    """max |d k3 / d logp| where k3 = e^u - 1 - u <= K (u = logp_ref - logp; the value clamp zeroes the gradient
    beyond): |e^u - 1| is largest at the positive root u* of e^u - 1 - u = K, where it is K + u* (at the negative
    root u_ of the same level it is 1 - e^u_, smaller: the function is steeper for u > 0). u* by bisection in
    fp64."""
    lo, hi = 0.0, 60.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.expm1(mid) - mid < k3_clamp else (lo, mid)
    return k3_clamp + lo


KL_BOUND = {"k1": lambda cfg: 1.0, "k2": lambda cfg: 20.0, "k3": lambda cfg: k3_bound(cfg.k3_clamp), "exact": None}
"""k1 = x: gradient 1. k2 = x^2 / 2 with x clamped to [-20, 20]: gradient |x| <= 20. exact: the KL comes in as an
input computed from the logits, so it has no gradient with respect to logp."""


def _grid_rows(seed: int = 0):
    """(logp, old, adv) [B, 1]: every log-ratio of a dense grid (step 0.005 over [-50, 50]) at every advantage."""
    lr = torch.linspace(-50.0, 50.0, 20001, dtype=F64)
    a = torch.tensor(ADVS, dtype=F64)
    lr, a = torch.cartesian_prod(lr, a).unbind(1)
    g = torch.Generator().manual_seed(seed)
    logp = -5.0 * torch.rand(lr.shape, generator=g, dtype=F64)  # log-probs <= 0; old = logp - log r
    return logp[:, None], (logp - lr)[:, None], a[:, None]


def _random_rows(B: int = 512, T: int = 6, seed: int = 1):
    """(logp, old, adv, mask) [B, T]: token log-ratios and per-token advantages drawn from the extreme values, rows
    of 1..T valid tokens (so GSPO's sequence means mix exploded and ordinary tokens)."""
    g = torch.Generator().manual_seed(seed)
    ex = torch.tensor(EXTREME, dtype=F64)
    lr = ex[torch.randint(len(EXTREME), (B, T), generator=g)]
    a = torch.tensor(ADVS, dtype=F64)[torch.randint(len(ADVS), (B, T), generator=g)]
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B, 1), generator=g)
    logp = -5.0 * torch.rand(B, T, generator=g, dtype=F64)
    return logp, logp - lr, a, mask


POLICY_CONFIGS = {
    "ppo": dict(name="ppo"),
    "ppo_dapo_clip": dict(name="ppo", eps_low=0.2, eps_high=0.28),
    "ppo+dual_clip": dict(name="ppo", dual_clip=True),
    "dual_clip": dict(name="dual_clip"),
    "dual_clip_c10": dict(name="dual_clip", dual_clip_c=10.0),
    "cispo": dict(name="cispo", eps_low=None, eps_high=0.28),
    "cispo_low": dict(name="cispo", eps_low=0.2, eps_high=0.2),
    "gspo": dict(name="gspo", eps_low=3e-4, eps_high=4e-4),
    "gspo+dual_clip": dict(name="gspo", eps_low=3e-4, eps_high=4e-4, dual_clip=True),
    "gspo_clamp3": dict(name="gspo", eps_low=0.2, eps_high=0.2, seq_log_ratio_clamp=3.0),
    "pg": dict(name="pg"),
    "cpgd": dict(name="cpgd"),
}


def test_every_policy_loss_has_a_bound_case():
    """The cases below cover every registered policy loss (a new loss must state its bound)."""
    assert {kw["name"] for kw in POLICY_CONFIGS.values()} == set(POLICY_LOSSES)


def _policy_grad(pl: PolicyLossConfig, logp, old, adv, mask):
    logp = logp.clone().requires_grad_()
    loss, _ = POLICY_LOSSES[pl.name](pl, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(torch.where(mask, loss, torch.zeros_like(loss)).sum(), logp)
    assert torch.isfinite(loss[mask]).all() and torch.isfinite(grad).all()
    return grad


@pytest.mark.parametrize("case", sorted(POLICY_CONFIGS))
def test_policy_loss_gradient_within_documented_bound(case):
    """|d l_t / d logp_t| <= bound * |A_t| on a dense log-ratio grid at advantages +-1e-8, +-1, +-1e6 (one token a
    row) and on rows mixing extreme token log-ratios and advantages; the bound is reached within 10% on the grid."""
    pl = PolicyLossConfig(**POLICY_CONFIGS[case])
    bound = policy_bound(pl)
    logp, old, adv = _grid_rows()
    mask = torch.ones_like(adv, dtype=torch.bool)
    grad = _policy_grad(pl, logp, old, adv, mask)
    top = float((grad.abs() / adv.abs()).max())
    assert top <= bound * (1 + RTOL), f"{case}: gradient / |A| reached {top:.6g} > {bound}"
    assert top >= 0.9 * bound, f"{case}: bound {bound} is loose (max {top:.6g})"
    logp, old, adv, mask = _random_rows()
    grad = _policy_grad(pl, logp, old, adv, mask)
    ratio = (grad.abs() / adv.abs())[mask]
    assert float(ratio.max()) <= bound * (1 + RTOL), f"{case}: mixed rows reached {float(ratio.max()):.6g} > {bound}"


@pytest.mark.parametrize("k3_clamp", [10.0, 1.0, 0.1])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_gradient_within_documented_bound(estimator, k3_clamp):
    """|d kl_t / d logp_t| <= the estimator's bound (k1 1, k2 20, k3 K + u*) for logp - logp_ref over [-50, 50],
    reached within 10%."""
    from megatron_rlvr.algorithms.algorithm_config import RefKLConfig

    cfg = RefKLConfig(coef=1.0, estimator=estimator, k3_clamp=k3_clamp)
    x = torch.linspace(-50.0, 50.0, 20001, dtype=F64)[None, :]
    logp = (-5.0 * torch.rand(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64)).requires_grad_()
    kl = ref_kl_per_token(cfg, logp, (logp - x).detach(), None)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    bound = KL_BOUND[estimator](cfg)
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    assert float(grad.abs().max()) <= bound * (1 + RTOL)
    assert float(grad.abs().max()) >= 0.9 * bound


@pytest.mark.parametrize("clip", [2.0, 0.5])
def test_drift_and_hinge_gradients_within_documented_bounds(clip):
    """CPGD drift: gradient clamp(r - 1, max=c) in [-1, c], so |.| <= max(1, c). MCPO hinge phi: gradient e^d - 1
    for d > delta, its tangent's e^C - 1 above C = 20, and in (-1, 0] below: |.| <= e^C - 1. Both reached."""
    d = torch.linspace(-50.0, 50.0, 20001, dtype=F64)[None, :]
    old = -5.0 * torch.rand(d.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    logp = (old + d).requires_grad_()
    drift, _ = policy_drift_per_token(logp, old, clip, 20.0)
    (g_drift,) = torch.autograd.grad(drift.sum(), logp)
    assert torch.isfinite(drift).all() and torch.isfinite(g_drift).all()
    assert 0.9 * max(1.0, clip) <= float(g_drift.abs().max()) <= max(1.0, clip) * (1 + RTOL)
    dd = d.clone().requires_grad_()
    phi = hinge_phi_bounded(dd, 0.01, 20.0)
    (g_phi,) = torch.autograd.grad(phi.sum(), dd)
    assert torch.isfinite(phi).all() and torch.isfinite(g_phi).all()
    assert 0.9 * math.expm1(20.0) <= float(g_phi.abs().max()) <= math.expm1(20.0) * (1 + RTOL)


def _aggregation_weight(cfg: AlgorithmConfig, mask):
    """d aggregate / d l_t per token [B, T], from the aggregation formulas (docs/algorithms.md, Aggregation)."""
    len_B = mask.sum(1, keepdim=True).to(F64)
    n_tok, n_seq = float(mask.sum()), float((len_B > 0).sum())
    mode = cfg.aggregation.mode
    if mode == "token-mean":
        w = torch.full_like(len_B, 1.0 / n_tok)
    elif mode == "seq-mean-token-mean":
        w = 1.0 / (n_seq * len_B.clamp_min(1))
    elif mode == "seq-mean-token-sum":
        w = torch.full_like(len_B, 1.0 / n_seq)
    else:
        w = torch.full_like(len_B, 1.0 / (n_seq * cfg.aggregation.token_sum_norm))
    return w.expand(mask.shape)


def _total_bound(cfg: AlgorithmConfig, adv_B, mask, mastered_B):
    """Per-token bound of d loss / d logp_t: aggregation weight x (policy bound |A| + drift + reference KL terms)
    plus the hinge-KL's beta (e^C - 1) / (N_mastered |y_i|) on mastered rows. Margin credit scales A by
    w_t = s_t |y| / sum s with scores s in [floor, 1], at most |y| / (1 + (|y| - 1) floor) (this token at 1, the
    others at the floor); the entropy bonus and the exact KL are inputs of their own, not functions of logp."""
    adv_BT = adv_B.abs()[:, None].expand(mask.shape)
    if cfg.margin_credit.enabled:
        len_B = mask.sum(1, keepdim=True).to(F64)
        adv_BT = adv_BT * len_B / (1.0 + (len_B - 1.0) * cfg.margin_credit.floor)
    per = policy_bound(cfg.policy_loss) * adv_BT
    if cfg.drift.coef > 0:
        per = per + cfg.drift.coef * max(1.0, cfg.drift.clip)
    if cfg.ref_kl.coef > 0 and cfg.ref_kl.estimator != "exact":
        per = per + cfg.ref_kl.coef * KL_BOUND[cfg.ref_kl.estimator](cfg.ref_kl)
    bound = _aggregation_weight(cfg, mask) * per
    if cfg.hinge_kl.enabled:
        len_B = mask.sum(1, keepdim=True).clamp_min(1).to(F64)
        n_m = max(float((mastered_B & mask.any(1)).sum()), 1.0)
        h = cfg.hinge_kl.beta * math.expm1(cfg.policy_loss.log_ratio_clamp) / (n_m * len_B)
        bound = bound + torch.where(mastered_B[:, None], h, torch.zeros_like(h))
    return bound


ALGO_CASES = {
    **{name: (name, {}) for name in PRESETS},
    "gspo+dual_clip": ("gspo", {"policy_loss": {"dual_clip": True}}),
    "mcpo+dual_clip": ("mcpo", {"policy_loss": {"dual_clip": True}}),
    "grpo+k1": ("grpo", {"ref_kl": {"coef": 0.5, "estimator": "k1"}}),
    "grpo+k2": ("grpo", {"ref_kl": {"coef": 0.5, "estimator": "k2"}}),
    "grpo+exact": ("grpo", {"ref_kl": {"coef": 0.5, "estimator": "exact"}}),
    "mcpo_margin+everything": (
        "mcpo_margin",
        {"ref_kl": {"coef": 0.1, "estimator": "k3"}, "entropy": {"coef": 0.01}, "drift": {"coef": 0.05}},
    ),
}
"""case -> (preset, overrides)."""


@pytest.mark.parametrize("case", sorted(ALGO_CASES))
def test_every_preset_total_gradient_within_documented_bound(case):
    """compute_policy_loss of every preset (and variants with the dual clip, each reference KL, and every
    regulariser at once): on rows of extreme token log-ratios, reference log-ratios and advantages, with mastered
    rows for the hinge-KL, each token's total gradient is finite and within the sum of its terms' bounds."""
    base, overrides = ALGO_CASES[case]
    cfg = preset(base, **overrides)
    logp, old, _, mask = _random_rows(B=256, T=6, seed=4)
    g = torch.Generator().manual_seed(5)
    ex = torch.tensor(EXTREME, dtype=F64)
    adv_B = torch.tensor(ADVS, dtype=F64)[torch.randint(len(ADVS), (256,), generator=g)]
    mastered_B = torch.rand(256, generator=g) < 0.3
    logp = logp.clone().requires_grad_()
    inputs = PolicyLossInputs(
        logp_BT=logp,
        old_logp_BT=old,
        mask_BT=mask,
        adv_B=adv_B,
        ref_logp_BT=(logp - ex[torch.randint(len(EXTREME), mask.shape, generator=g)]).detach(),
        ref_kl_BT=torch.rand(mask.shape, generator=g, dtype=F64),
        entropy_BT=torch.rand(mask.shape, generator=g, dtype=F64),
        margin_BT=torch.rand(mask.shape, generator=g, dtype=F64),
        mastered_B=mastered_B,
    )
    loss, _ = compute_policy_loss(cfg, inputs, LossNormalizers.from_batch(mask, mastered_B))
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    bound = _total_bound(cfg, adv_B, mask, mastered_B)
    excess = (grad.abs() - bound * (1 + RTOL))[mask]
    assert float(excess.max()) <= 0.0, f"{case}: a token's gradient exceeds its bound by {float(excess.max()):.6g}"
    assert bool((grad[~mask] == 0).all())


def _gspo(log_ratios, adv, **kw):
    """GSPO preset's policy loss on one row: per-token loss, d loss_t / d logp_t, metrics (fp64)."""
    cfg = preset("gspo", policy_loss=kw).policy_loss
    lr = torch.tensor([log_ratios], dtype=F64)
    old = torch.full_like(lr, -30.0)
    logp = (old + lr).requires_grad_()
    a = torch.full_like(lr, adv)
    loss, m = POLICY_LOSSES["gspo"](cfg, logp, old, a, torch.ones_like(lr, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach()[0], grad[0], m


def test_gspo_exploded_sequence_hand_computed():
    """A = -1, log r = [11]: the sequence log-ratio 11 is clamped at L = 10, so the loss is e^10 = 22026.47 (not
    e^11 = 59874) and the gradient 0 (verl's GSPO gives the same). With the dual clip (c = 3) the loss is 3, gradient
    0. A = +1 at the same ratio: the eps clip holds it at -(1 + 4e-4), gradient 0. Inside the clamp, log r =
    [1.5, 0.5] (s = e): loss e per token, gradient e each; the dual clip leaves it (e < 3) but caps log r = [1.2, 1.2]
    (s = e^1.2 = 3.32) at 3 with gradient 0."""
    loss, grad, m = _gspo([11.0], -1.0)
    assert loss.item() == pytest.approx(22026.465794806718, rel=1e-12) and grad.item() == 0.0
    assert m["loss/seq_ratio_clamped_frac"].item() == 1.0
    loss, grad, m = _gspo([11.0], -1.0, dual_clip=True)
    assert loss.item() == 3.0 and grad.item() == 0.0 and m["loss/dual_clip_frac"].item() == 1.0
    loss, grad, _ = _gspo([11.0], 1.0)
    assert loss.item() == pytest.approx(-1.0004, rel=1e-12) and grad.item() == 0.0
    loss, grad, m = _gspo([1.5, 0.5], -1.0, dual_clip=True)
    torch.testing.assert_close(loss, torch.full((2,), math.e, dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.full((2,), math.e, dtype=F64), rtol=1e-12, atol=0)
    assert m["loss/dual_clip_frac"].item() == 0.0 and m["loss/seq_ratio_clamped_frac"].item() == 0.0
    loss, grad, _ = _gspo([1.2, 1.2], -1.0, dual_clip=True)
    torch.testing.assert_close(loss, torch.full((2,), 3.0, dtype=F64))
    assert torch.equal(grad, torch.zeros(2, dtype=F64))


def test_gspo_matches_the_clamped_sequence_objective_at_large_drift():
    """On random rows with token log-ratios up to +-15 (sequence means on both sides of L = 10) the GSPO token
    form through compute_policy_loss (seq-mean-token-mean) has the value and gradient of the sequence-level
    objective -1/G sum_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(min(mean_t log r_it, 10)), by direct autograd."""
    g = torch.Generator().manual_seed(6)
    B, T = 64, 5
    old = -3.0 * torch.rand(B, T, generator=g, dtype=F64)
    shift = 15.0 * (2 * torch.rand(B, 1, generator=g, dtype=F64) - 1)  # per-row drift, so many means pass 10
    logp = (old + shift + torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B, 1), generator=g)
    adv = torch.randn(B, generator=g, dtype=F64)
    cfg = preset("gspo", policy_loss={"eps_low": 0.2, "eps_high": 0.2})
    loss, m = compute_policy_loss(cfg, PolicyLossInputs(logp, old, mask, adv_B=adv), LossNormalizers.from_batch(mask))
    (g_tok,) = torch.autograd.grad(loss, logp)
    lr = torch.where(mask, logp - old, torch.zeros_like(logp))
    log_s = (lr.sum(1) / mask.sum(1)).clamp(max=10.0)
    s = log_s.exp()
    ref = -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv).mean()
    (g_seq,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-10, atol=1e-12)
    above = (lr.sum(1) / mask.sum(1)).detach() > 10.0
    assert 0 < int(above.sum()) < B and bool((g_tok[above] == 0).all())
    assert 0 < m["loss/seq_ratio_clamped_frac"].item() < 1
