"""Regularisers: reference KL k1/k2/k3 and the exact-KL hook, entropy bonus, MCPO hinge-KL (exactly zero value and
gradient inside delta) and CPGD policy drift (gradient clamp(r - 1, max=c) * grad logp), against hand-worked values."""

import math

import pytest
import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    HingeKLConfig,
    LossNormalizers,
    PolicyLossInputs,
    compute_policy_loss,
    hinge_kl_loss,
)
from megatron_rlvr.algorithms.mcpo import hinge_phi
from megatron_rlvr.algorithms.regularizers import RefKLConfig, kl_k1, kl_k2, kl_k3, ref_kl_per_token


def _k3(d):
    return math.exp(d) - d - 1


def test_kl_estimators_hand_computed():
    """x = logp - ref = 0.5 and -3: k1 = x, k2 = x^2/2, k3 = e^-x - 1 + x; x = -30 is clamped to -20 first, and the
    k3 value to <= 10 (k3_clamp)."""
    logp = torch.tensor([-1.0, -4.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([0.5, -3.0, -20.0], dtype=torch.float64))
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([0.125, 4.5, 200.0], dtype=torch.float64))
    k3 = [math.exp(-0.5) - 0.5, min(math.exp(3.0) - 1 - 3.0, 10.0), 10.0]
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor(k3, dtype=torch.float64))
    assert kl_k3(logp, ref, RefKLConfig(k3_clamp=5.0))[2] == 5.0


def _one_row_inputs(logp, old, **kw):
    logp = torch.tensor([logp], dtype=torch.float64).requires_grad_()
    old = torch.tensor([old], dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    return logp, PolicyLossInputs(logp, old, mask, adv_B=torch.zeros(1, dtype=torch.float64), **kw)


def test_ref_kl_term_in_loss_and_exact_hook():
    """Zero advantages isolate the KL term: loss = coef * token-mean(k), gradient = coef * dk/dlogp / N."""
    cfg = AlgorithmConfig.from_dict({"ref_kl": {"coef": 0.1, "estimator": "k2"}})
    logp, inp = _one_row_inputs(
        [-1.0, -2.0], [-1.0, -2.0], ref_logp_BT=torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    )
    loss, m = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=2, num_seqs=1))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.1 * (0.125 + 0.5) / 2, dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.5 / 2, 0.1 * -1.0 / 2]], dtype=torch.float64))
    # exact: the given per-token KL is used as is and receives the gradient coef / N
    exact = torch.tensor([[0.3, 0.7]], dtype=torch.float64, requires_grad=True)
    cfg = AlgorithmConfig.from_dict({"ref_kl": {"coef": 0.5, "estimator": "exact"}})
    _, inp = _one_row_inputs([-1.0, -2.0], [-1.0, -2.0], ref_kl_BT=exact)
    loss, _ = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=2, num_seqs=1))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.25, dtype=torch.float64))
    torch.testing.assert_close(exact.grad, torch.full((1, 2), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs ref_kl_BT"):
        ref_kl_per_token(RefKLConfig(coef=1.0, estimator="exact"), exact, None, None)
    with pytest.raises(ValueError, match="needs ref_logp_BT"):
        ref_kl_per_token(RefKLConfig(coef=1.0, estimator="k3"), exact, None, None)


def test_entropy_bonus():
    cfg = AlgorithmConfig.from_dict({"entropy": {"coef": 0.01}})
    ent = torch.tensor([[1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    _, inp = _one_row_inputs([-1.0, -2.0], [-1.0, -2.0], entropy_BT=ent)
    loss, m = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=2, num_seqs=1))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.01 * 2.0, dtype=torch.float64))
    torch.testing.assert_close(ent.grad, torch.full((1, 2), -0.005, dtype=torch.float64))
    assert m["loss/entropy"] == 2.0


def test_hinge_phi_values_and_continuity():
    delta = 0.01
    d = torch.tensor([0.0, 0.005, -0.01, 0.01, 0.02, -0.05], dtype=torch.float64)
    expected = [0, 0, 0, 0, _k3(0.02) - _k3(0.01), _k3(-0.05) - _k3(-0.01)]
    torch.testing.assert_close(hinge_phi(d, delta), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    eps = torch.tensor([delta + 1e-9, -delta - 1e-9], dtype=torch.float64)
    assert hinge_phi(eps, delta).abs().max() < 1e-10  # continuous at +-delta


def test_hinge_kl_hand_computed_and_only_on_mastered():
    """Row 0 (mastered): d = [0.02, 0.005] -> (phi(0.02) + 0) / 2. Row 1 (mastered): d = [-0.05] -> phi(-0.05).
    Row 2 (not mastered) is ignored. Global mastered count 4 (two more on other ranks), beta 2."""
    cfg = HingeKLConfig(enabled=True, beta=2.0, delta=0.01)
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    d = torch.tensor([[0.02, 0.005], [-0.05, 0.0], [0.5, 0.5]], dtype=torch.float64)
    logp = (old + d).requires_grad_()
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    mastered = torch.tensor([True, True, False])
    norms = LossNormalizers(num_tokens=20, num_seqs=10, num_mastered_seqs=4)
    loss, m = hinge_kl_loss(cfg, logp, old, mask, mastered, norms)
    loss.backward()
    p1, p2 = _k3(0.02) - _k3(0.01), _k3(-0.05) - _k3(-0.01)
    torch.testing.assert_close(loss, torch.tensor(2.0 * (p1 / 2 + p2) / 4, dtype=torch.float64))
    expected_grad = [[2.0 / 4 * math.expm1(0.02) / 2, 0.0], [2.0 / 4 * math.expm1(-0.05), 0.0], [0.0, 0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=torch.float64))
    torch.testing.assert_close(m["mcpo/hinge_active_frac"], torch.tensor(2 / 3))
    torch.testing.assert_close(m["mcpo/mastered_abs_d"], torch.tensor((0.02 + 0.005 + 0.05) / 3))


def test_hinge_kl_exactly_zero_inside_delta():
    """Every |d| <= delta: the value and the gradient are exactly 0 (not merely small)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g) * 4
    logp = (old + (torch.rand(6, 9, generator=g) * 2 - 1) * 0.0099).requires_grad_()
    mask = torch.rand(6, 9, generator=g) > 0.2
    mastered = torch.ones(6, dtype=torch.bool)
    cfg = AlgorithmConfig.from_dict({"hinge_kl": {"enabled": True}, "policy_loss": {"name": "pg"}})
    loss, m = compute_policy_loss(
        cfg,
        PolicyLossInputs(logp, old, mask, adv_B=torch.zeros(6), mastered_B=mastered),
        LossNormalizers.from_batch(mask, mastered),
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
    assert m["mcpo/hinge_active_frac"] == 0.0 and m["mcpo/hinge_kl"] == 0.0


def test_hinge_kl_requires_mastered_flags():
    cfg = AlgorithmConfig.from_dict({"hinge_kl": {"enabled": True}})
    _, inp = _one_row_inputs([-1.0], [-1.0])
    with pytest.raises(ValueError, match="mastered_B"):
        compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=1, num_seqs=1))


def test_cpgd_drift_gradient_is_capped_k3_gradient():
    """d = 0.5: weight e^0.5 - 1; d = 1.5: e^1.5 - 1 = 3.48 capped at c = 2; d = -0.5: e^-0.5 - 1.
    Loss (zero advantage) = coef * token-mean(k3(d)); gradient = coef * weight / N."""
    cfg = AlgorithmConfig.from_dict({"drift": {"coef": 0.01, "clip": 2.0}, "policy_loss": {"name": "cpgd"}})
    ds = [0.5, 1.5, -0.5]
    logp, inp = _one_row_inputs([-1.0 + d for d in ds], [-1.0] * 3)
    loss, m = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=3, num_seqs=1))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.01 * sum(_k3(d) for d in ds) / 3, dtype=torch.float64))
    w = [math.expm1(0.5), 2.0, math.expm1(-0.5)]
    torch.testing.assert_close(logp.grad, torch.tensor([[0.01 * x / 3 for x in w]], dtype=torch.float64))
    torch.testing.assert_close(m["drift/capped_frac"], torch.tensor(1 / 3))


@pytest.mark.parametrize("c", [0.5, 1.0, 5.0])
def test_cpgd_drift_cap_is_the_configured_c(c):
    """The drift weight is capped at drift.clip itself (every other hand-computed case used c = 2, which a hard-coded
    2.0 would pass): weight = min(e^d - 1, c) at d = 0.5, 1.5, -0.5, and capped_frac counts exactly those above c."""
    cfg = AlgorithmConfig.from_dict({"drift": {"coef": 1.0, "clip": c}, "policy_loss": {"name": "cpgd"}})
    ds = [0.5, 1.5, -0.5]
    logp, inp = _one_row_inputs([-1.0 + d for d in ds], [-1.0] * 3)
    loss, m = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=3, num_seqs=1))
    loss.backward()
    w = [min(math.expm1(d), c) for d in ds]
    torch.testing.assert_close(logp.grad, torch.tensor([[x / 3 for x in w]], dtype=torch.float64))
    capped = sum(math.expm1(d) > c for d in ds)
    torch.testing.assert_close(m["drift/capped_frac"], torch.tensor(capped / 3))


@pytest.mark.parametrize("d0", [25.0, -25.0])
def test_hinge_kl_keeps_restoring_gradient_beyond_cap(d0):
    """Issue 14 item 12: |d| = 25 (beyond the +-20 ratio clamp) must still be pulled back. Reference in fp64 by hand:
    d = -25: the exact phi, gradient e^d - 1 (about -1); d = +25: the tangent of phi at 20, value
    k3(20) - k3(delta) + (e^20 - 1)(d - 20), gradient e^20 - 1. Clamping d first gave gradient 0 at both."""
    delta = 0.01
    cfg = HingeKLConfig(enabled=True, beta=1.0, delta=delta)
    old = torch.full((1, 1), -30.0, dtype=torch.float64)
    logp = (old + d0).requires_grad_()
    norms = LossNormalizers(num_tokens=1, num_seqs=1, num_mastered_seqs=1)
    loss, _ = hinge_kl_loss(cfg, logp, old, torch.ones(1, 1, dtype=torch.bool), torch.tensor([True]), norms)
    loss.backward()
    if d0 < 0:
        ref_val, ref_grad = _k3(d0) - _k3(-delta), math.expm1(d0)
    else:
        ref_val, ref_grad = _k3(20.0) - _k3(delta) + math.expm1(20.0) * (d0 - 20.0), math.expm1(20.0)
    assert math.isclose(float(loss), ref_val, rel_tol=1e-12)
    assert math.isclose(float(logp.grad), ref_grad, rel_tol=1e-12)
    assert (float(logp.grad) < 0) == (d0 < 0)  # restoring: descent moves d back towards the band
    # fp32: still finite and the same direction
    lp32 = (old.float() + d0).requires_grad_()
    loss32, _ = hinge_kl_loss(cfg, lp32, old.float(), torch.ones(1, 1, dtype=torch.bool), torch.tensor([True]), norms)
    loss32.backward()
    assert torch.isfinite(loss32) and math.isclose(float(lp32.grad), ref_grad, rel_tol=1e-5)
