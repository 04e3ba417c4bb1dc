"""Train/inference mismatch metrics and corrections: a hand-computed case, the unbiasedness of the KL estimators
against the exact KL of two known distributions, and the edge cases (empty mask, NaN in masked-out tokens, bad
configs)."""

import math

import pytest
import torch

from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig, mismatch_correction, mismatch_metrics

P_TRAIN = torch.tensor([[0.5, 0.2, 0.1, 0.9]])
P_ROLL = torch.tensor([[0.4, 0.4, 0.1, 0.3]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_metrics_hand_computed():
    """|dp| = .1,.2,0 (the masked .6 ignored); rho = 1.25,.5,1; k1 = ln .8, ln 2, 0; k3 = rho - 1 - ln rho."""
    m = mismatch_metrics(P_TRAIN.log(), P_ROLL.log(), MASK)
    assert m["mismatch/tokens"].item() == 3
    assert m["mismatch/abs_prob_diff_mean"].item() == pytest.approx(0.1, abs=1e-6)
    assert m["mismatch/abs_prob_diff_max"].item() == pytest.approx(0.2, abs=1e-6)
    assert m["mismatch/kl_k1"].item() == pytest.approx((math.log(0.8) + math.log(2.0)) / 3, abs=1e-6)
    k3 = (0.25 - math.log(1.25)) + (-0.5 - math.log(0.5))
    assert m["mismatch/kl_k3"].item() == pytest.approx(k3 / 3, abs=1e-6)
    assert m["mismatch/ratio_mean"].item() == pytest.approx(2.75 / 3, abs=1e-6)
    assert m["mismatch/ratio_max"].item() == pytest.approx(1.25, abs=1e-6)
    assert m["mismatch/ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    lr_abs = (math.log(1.25) + math.log(2.0)) / 3
    assert m["mismatch/log_ratio_abs_mean"].item() == pytest.approx(lr_abs, abs=1e-6)


def test_kl_estimators_are_unbiased_for_the_exact_kl():
    """Tokens drawn from the rollout distribution q: mean k1 and mean k3 converge to KL(q || p) (exact sum)."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(50, generator=g), 0)
    p = torch.softmax(torch.randn(50, generator=g) * 0.5 + q.log() * 0.5, 0)
    exact = (q * (q.log() - p.log())).sum().item()
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=g)
    m = mismatch_metrics(p.log()[tokens], q.log()[tokens], torch.ones_like(tokens))
    assert m["mismatch/kl_k1"].item() == pytest.approx(exact, rel=0.05)
    assert m["mismatch/kl_k3"].item() == pytest.approx(exact, rel=0.05)
    assert m["mismatch/ratio_mean"].item() == pytest.approx(1.0, abs=0.01)  # E_q[p/q] = 1


def test_corrections_off_by_default():
    cfg = MismatchCorrectionConfig()
    assert not cfg.enabled
    w, mask, met = mismatch_correction(P_TRAIN.log(), P_ROLL.log(), MASK, cfg)
    assert torch.equal(w, MASK.float()) and torch.equal(mask, MASK)
    assert met["mismatch/tis_clip_frac"].item() == 0 and met["mismatch/masked_frac"].item() == 0


def test_truncated_is_and_ratio_masking_hand_computed():
    """rho = 1.25, .5, 1 (masked 3.0): cap 1.1 gives weights 1.1, .5, 1, 0; bounds [.6, 2] also drop the .5."""
    w, mask, met = mismatch_correction(P_TRAIN.log(), P_ROLL.log(), MASK, MismatchCorrectionConfig(tis_cap=1.1))
    assert torch.allclose(w, torch.tensor([[1.1, 0.5, 1.0, 0.0]]), atol=1e-6)
    assert torch.equal(mask, MASK)
    assert met["mismatch/tis_clip_frac"].item() == pytest.approx(1 / 3)
    cfg = MismatchCorrectionConfig(tis_cap=1.1, mask_low=0.6, mask_high=2.0)
    w, mask, met = mismatch_correction(P_TRAIN.log(), P_ROLL.log(), MASK, cfg)
    assert torch.allclose(w, torch.tensor([[1.1, 0.0, 1.0, 0.0]]), atol=1e-6)
    assert torch.equal(mask, torch.tensor([[1, 0, 1, 0]]))
    assert met["mismatch/masked_frac"].item() == pytest.approx(1 / 3)
    # an upper bound alone masks the large ratio (1.25 > 1.2) and keeps weight 1 elsewhere (no TIS)
    w, mask, _ = mismatch_correction(P_TRAIN.log(), P_ROLL.log(), MASK, MismatchCorrectionConfig(mask_high=1.2))
    assert torch.equal(mask, torch.tensor([[0, 1, 1, 0]])) and torch.equal(w, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))


def test_empty_mask_and_nan_in_masked_tokens():
    nan_lp = torch.tensor([[float("nan"), -1.0]])
    m = mismatch_metrics(nan_lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[0, 0]]))
    assert all(torch.isfinite(v) and v.item() == 0 for v in m.values())
    w, mask, met = mismatch_correction(nan_lp, nan_lp, torch.tensor([[0, 1]]), MismatchCorrectionConfig(tis_cap=2))
    assert torch.equal(w, torch.tensor([[0.0, 1.0]])) and all(torch.isfinite(v) for v in met.values())
    with pytest.raises(ValueError, match="NaN/inf"):
        mismatch_metrics(nan_lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="shapes"):
        mismatch_metrics(torch.zeros(3), torch.zeros(3), torch.ones(4))
    with pytest.raises(ValueError, match="positive"):
        mismatch_metrics(torch.tensor([0.5]), torch.tensor([-1.0]), torch.ones(1))
    # fp32 rounding of a near-certain token's log-prob (+1.2e-6 stopped a real SmolLM2 run) is not an error
    m = mismatch_metrics(torch.tensor([1.2e-6]), torch.tensor([-1e-7]), torch.ones(1))
    assert abs(float(m["mismatch/log_ratio_abs_mean"]) - 1.3e-6) < 1e-8


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(tis_cap=float("inf")), "tis_cap"),
        (dict(mask_low=-0.1), "mask_low"),
        (dict(mask_high=0.0), "mask_high"),
        (dict(mask_low=2.0, mask_high=1.0), "mask_low"),
    ],
)
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        MismatchCorrectionConfig(**kw)
