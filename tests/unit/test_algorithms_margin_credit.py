"""MCPO margin credit: the score map, the per-sequence renormalisation (mean weight exactly 1, so each sequence's
mean advantage is unchanged), uniform fallbacks, and its effect on the policy-gradient per token."""

import pytest
import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    LossNormalizers,
    MarginCreditConfig,
    PolicyLossInputs,
    compute_policy_loss,
    margin_credit_weights,
)
from megatron_rlvr.algorithms.margin_credit import margin_score


def test_score_map_hand_computed():
    cfg = MarginCreditConfig(enabled=True, tau_lo=0.3, tau_hi=0.9, floor=0.5)
    m = torch.tensor([0.0, 0.1, 0.3, 0.6, 0.9, 1.0], dtype=torch.float64)
    torch.testing.assert_close(margin_score(cfg, m), torch.tensor([1, 1, 1, 0.75, 0.5, 0.5], dtype=torch.float64))


def test_weights_hand_computed():
    """Scores [1, 0.75, 0.5, 0.5] (mean 0.6875) -> weights s / 0.6875; the padded position gets 0."""
    cfg = MarginCreditConfig(enabled=True)
    margin = torch.tensor([[0.2, 0.6, 0.95, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    w = margin_credit_weights(cfg, margin, mask)
    expected = torch.tensor([[1, 0.75, 0.5, 0.5, 0]], dtype=torch.float64) / 0.6875
    expected[0, 4] = 0.0
    torch.testing.assert_close(w, expected)


def test_mean_advantage_preserved_per_sequence():
    g = torch.Generator().manual_seed(0)
    cfg = MarginCreditConfig(enabled=True)
    margin = torch.rand(16, 40, generator=g, dtype=torch.float64)
    mask = torch.rand(16, 40, generator=g) > 0.4
    mask[3] = False  # empty response
    adv = torch.randn(16, generator=g, dtype=torch.float64)
    w = margin_credit_weights(cfg, margin, mask)
    a_tok = adv[:, None] * w
    n = mask.sum(1)
    mean_a = torch.where(mask, a_tok, 0).sum(1) / n.clamp_min(1)
    torch.testing.assert_close(mean_a[n > 0], adv[n > 0], rtol=1e-12, atol=1e-12)
    assert torch.equal(w[3], torch.zeros(40, dtype=torch.float64)) and torch.isfinite(w).all()
    assert w.std() > 0.1  # the credit is actually redistributed


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_uniform_when_scores_equal(floor):
    cfg = MarginCreditConfig(enabled=True, floor=floor)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    for value in (0.95, 0.1, 0.3):  # all confident (floor, incl. an all-zero row), all full credit
        w = margin_credit_weights(cfg, torch.full((2, 4), value), mask)
        assert torch.equal(w, mask.float()), (value, w)


def test_margin_credit_scales_the_policy_gradient_per_token():
    """Plain PG with token-mean: d loss / d logp_t = -A w_t / N."""
    cfg = AlgorithmConfig.from_dict({"policy_loss": {"name": "pg"}, "margin_credit": {"enabled": True}})
    margin = torch.tensor([[0.2, 0.6, 0.95, 1.0]], dtype=torch.float64)
    logp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = compute_policy_loss(
        cfg,
        PolicyLossInputs(logp, logp.detach(), mask, adv_B=torch.tensor([2.0], dtype=torch.float64), margin_BT=margin),
        LossNormalizers.from_batch(mask),
    )
    loss.backward()
    w = torch.tensor([1, 0.75, 0.5, 0.5], dtype=torch.float64) / 0.6875
    torch.testing.assert_close(logp.grad, (-2.0 * w / 4)[None])
    torch.testing.assert_close(m["credit/weight_max"], torch.tensor(1 / 0.6875, dtype=torch.float32))
    torch.testing.assert_close(m["credit/upweighted_frac"], torch.tensor(0.5))  # 1.45 and 1.09 > 1
    with pytest.raises(ValueError, match="margin_BT"):
        compute_policy_loss(
            cfg, PolicyLossInputs(logp, logp.detach(), mask, adv_B=torch.ones(1)), LossNormalizers(4, 1)
        )
