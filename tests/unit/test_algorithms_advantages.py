"""Group advantage estimators, F-GRPO focal scaling, MCPO query weights and CPGD weights against hand-computed values
and the papers' invariants (gamma = 0 equals GRPO; MCPO query weight 0.5 on (0.5, 1); zero-variance groups give
exactly 0)."""

import math

import pytest
import torch

from megatron_rlvr.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AlgorithmConfig,
    compute_advantages,
    implied_query_weight,
    mastered_rollouts,
    mcpo_query_scale,
)

S3 = math.sqrt(3.0)


def _cfg(**adv) -> AlgorithmConfig:
    return AlgorithmConfig.from_dict({"advantage": adv})


def _adv(rewards, **adv):
    out, metrics = compute_advantages(_cfg(**adv), torch.tensor(rewards, dtype=torch.float64))
    return out, metrics


def test_grpo_population_std_hand_computed():
    """Group [1,0,0,1]: mean 0.5, population std 0.5 -> +-1. Group [.5,.5,.5,1]: mean 0.625, std sqrt(3)/8
    -> -1/sqrt(3) for the three 0.5s, sqrt(3) for the 1."""
    a, _ = _adv([[1, 0, 0, 1], [0.5, 0.5, 0.5, 1.0]], estimator="grpo", eps=0.0)
    expected = torch.tensor([[1, -1, -1, 1], [-1 / S3, -1 / S3, -1 / S3, S3]], dtype=torch.float64)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)


def test_grpo_unbiased_std_and_eps():
    """Unbiased std of [1,0,0,1] is sqrt(1/3): A = 0.5/(sqrt(1/3) + eps)."""
    a, _ = _adv([[1, 0, 0, 1]], estimator="grpo", std="unbiased", eps=0.01)
    v = 0.5 / (math.sqrt(1 / 3) + 0.01)
    torch.testing.assert_close(a, torch.tensor([[v, -v, -v, v]], dtype=torch.float64), rtol=0, atol=1e-12)


def test_dr_grpo_rloo_hand_computed():
    a, _ = _adv([[1, 0, 0, 1], [1, 0, 0, 0]], estimator="dr_grpo")
    torch.testing.assert_close(
        a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]], dtype=torch.float64)
    )
    # RLOO: r_i - mean of the other three
    a, _ = _adv([[1, 0, 0, 0], [1, 1, 0, 0.5]], estimator="rloo")
    expected = [[1 - 0, 0 - 1 / 3, 0 - 1 / 3, 0 - 1 / 3], [1 - 1.5 / 3, 1 - 1.5 / 3, 0 - 2.5 / 3, 0.5 - 2 / 3]]
    torch.testing.assert_close(a, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_reinforce_pp_group_mean_then_batch_whitening():
    """Centred [.5,-.5], [0,0] (zero variance), [.25,-.25]; batch mean 0, population var 0.625/6."""
    a, _ = _adv([[1, 0], [1, 1], [0.5, 0]], estimator="reinforce_pp", eps=0.0)
    s = math.sqrt(0.625 / 6)
    expected = torch.tensor([[0.5 / s, -0.5 / s], [0, 0], [0.25 / s, -0.25 / s]], dtype=torch.float64)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)


def test_cpgd_weights_hand_computed():
    r = [[1, 0, 0, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
    centered = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [0.75, -0.25, -0.25, -0.25]], dtype=torch.float64)
    a, _ = _adv(r, estimator="cpgd", cpgd_weight="equal")
    torch.testing.assert_close(a, centered)
    a, _ = _adv(r, estimator="cpgd", cpgd_weight="std")
    std = torch.tensor([0.5, 0.0, math.sqrt(0.1875)], dtype=torch.float64)
    torch.testing.assert_close(a, centered / (std[:, None] + 1e-9))
    # one zero-variance group of B = 3: w = min(3 / (3 - 1), 3) = 1.5
    a, _ = _adv(r, estimator="cpgd", cpgd_weight="clip_filter_like")
    torch.testing.assert_close(a, centered * 1.5)
    # three of four zero-variance: 4 / 1 = 4, capped at 3.0
    a, _ = _adv([[1, 0], [1, 1], [0, 0], [1, 1]], estimator="cpgd", cpgd_weight="clip_filter_like")
    torch.testing.assert_close(a, torch.tensor([[1.5, -1.5], [0, 0], [0, 0], [0, 0]], dtype=torch.float64))
    # no zero-variance group: w = 1
    a, _ = _adv([[1, 0], [0, 1]], estimator="cpgd", cpgd_weight="clip_filter_like")
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5], [-0.5, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_zero_variance_groups_exactly_zero_never_nan(estimator):
    """Identical rewards give exactly 0, also when the float mean of identical values is off in the last bit
    (mean of three 0.1s is 0.10000000000000002: with eps = 0 a naive (r - mean)/(std + eps) gives -1)."""
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    assert rewards[0].mean() != 0.1  # the trap is real on this platform
    naive = (rewards[0] - rewards[0].mean()) / rewards[0].std(unbiased=False)
    assert naive.abs().max() > 0.5
    adv, metrics = compute_advantages(_cfg(estimator=estimator, eps=0.0), rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.isfinite(adv).all() and (adv[3] != 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # a single-rollout group and a group of one valid rollout are zero-variance too
    adv1, _ = compute_advantages(_cfg(estimator=estimator, std="unbiased", eps=0.0), torch.tensor([[1.0], [0.0]]))
    assert torch.equal(adv1, torch.zeros(2, 1))


def test_valid_mask_ragged_groups():
    """Invalid rollouts (here NaN rewards) are excluded from mean/std and get 0; stats use the valid ones only."""
    r = torch.tensor([[1.0, 0.0, float("nan"), 1.0], [0.0, 1.0, 1.0, 1.0]])
    valid = torch.tensor([[True, True, False, True], [True, True, True, True]])
    adv, _ = compute_advantages(_cfg(estimator="grpo", eps=0.0), r, valid_G_n=valid)
    # group 0 over [1, 0, 1]: mean 2/3, population std sqrt(2)/3
    s = math.sqrt(2) / 3
    torch.testing.assert_close(adv[0], torch.tensor([(1 / 3) / s, -(2 / 3) / s, 0.0, (1 / 3) / s]))
    assert adv.dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    cfg = _cfg()
    with pytest.raises(ValueError, match="non-finite reward .* group 1, rollout 0"):
        compute_advantages(cfg, torch.tensor([[1.0, 0.0], [float("inf"), 0.0]]))
    with pytest.raises(ValueError, match=r"rewards_G_n must be \[G, n\]"):
        compute_advantages(cfg, torch.ones(4))
    with pytest.raises(ValueError, match="empty"):
        compute_advantages(cfg, torch.ones(0, 4))
    with pytest.raises(ValueError, match="valid_G_n must have the shape"):
        compute_advantages(cfg, torch.ones(2, 4), valid_G_n=torch.ones(2, 3, dtype=torch.bool))


def test_focal_weight_hand_computed():
    """mu_pos = 0.75 -> g = 0.25^0.5 = 0.5; mu_pos = 0.25 -> g = sqrt(0.75)."""
    r = [[1, 1, 1, 0], [1, 0, 0, 0]]
    base, _ = _adv(r, estimator="grpo")
    foc, m = _adv(r, estimator="grpo", focal_gamma=0.5)
    torch.testing.assert_close(foc[0], base[0] * 0.5, rtol=0, atol=1e-12)
    torch.testing.assert_close(foc[1], base[1] * math.sqrt(0.75), rtol=0, atol=1e-12)
    torch.testing.assert_close(m["focal/weight_min"], torch.tensor(0.5))
    # non-binary reward scale: R_correct = 2, R_wrong = -1, mean 1 -> mu = 2/3, g = (1/3)^1
    foc, _ = _adv([[2.0, -1.0, 2.0]], estimator="dr_grpo", focal_gamma=1.0, reward_correct=2.0, reward_wrong=-1.0)
    torch.testing.assert_close(foc, torch.tensor([[1 / 3, -2 / 3, 1 / 3]], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_focal_gamma_zero_reproduces_base_estimator_bitwise(estimator):
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(64, 8, generator=g) > 0.5).double()
    r[:4] = 1.0  # mastered groups: mu_pos = 1, g = 0^0 = 1
    r[4:8] = torch.rand(4, 8, generator=g)  # non-binary rewards
    base, _ = compute_advantages(_cfg(estimator=estimator), r)
    focal0, _ = compute_advantages(_cfg(estimator=estimator, focal_gamma=0.0), r)
    assert torch.equal(base, focal0)
    focal, _ = compute_advantages(_cfg(estimator=estimator, focal_gamma=0.5), r)
    assert not torch.equal(base, focal)


def test_mcpo_query_scale_values():
    p = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.9, 1.0], dtype=torch.float64)
    expected = [1.0, 1.0, 1.0, 2 * math.sqrt(0.1875), 2 * math.sqrt(0.09), 1.0]
    torch.testing.assert_close(mcpo_query_scale(p), torch.tensor(expected, dtype=torch.float64))


def test_mcpo_query_weight_is_half_on_majority_correct_prompts():
    """Binary rewards, population std: implied weight q(p) = 0.5 exactly for p in (0.5, 1) after MCPO scaling,
    sqrt(p(1-p)) for p <= 0.5; with unbiased std it is 0.5 sqrt((n-1)/n) instead."""
    for n in range(2, 17):
        rows, ps = [], []
        for k in range(0, n + 1):
            rows.append([1.0] * k + [0.0] * (n - k))
            ps.append(k / n)
        r = torch.tensor(rows, dtype=torch.float64)
        p = torch.tensor(ps, dtype=torch.float64)
        valid = torch.ones_like(r, dtype=torch.bool)
        majority = (p > 0.5) & (p < 1)
        minority = (p > 0) & (p <= 0.5)
        adv, _ = compute_advantages(_cfg(estimator="grpo", eps=0.0, mcpo_query_weight=True), r)
        q = implied_query_weight(adv, valid)
        torch.testing.assert_close(q[majority], torch.full_like(q[majority], 0.5), rtol=0, atol=1e-12)
        torch.testing.assert_close(q[minority], (p * (1 - p)).sqrt()[minority], rtol=0, atol=1e-12)
        assert torch.equal(q[(p == 0) | (p == 1)], torch.zeros_like(q[(p == 0) | (p == 1)]))
        adv_eps, _ = compute_advantages(_cfg(estimator="grpo", mcpo_query_weight=True), r)  # default eps 1e-6
        torch.testing.assert_close(implied_query_weight(adv_eps, valid)[majority], q[majority], rtol=0, atol=1e-5)
        adv_unb, _ = compute_advantages(_cfg(estimator="grpo", std="unbiased", eps=0.0, mcpo_query_weight=True), r)
        q_unb = implied_query_weight(adv_unb, valid)[majority]
        torch.testing.assert_close(q_unb, torch.full_like(q_unb, 0.5 * math.sqrt((n - 1) / n)), rtol=0, atol=1e-12)


def test_metrics_groups_and_difficulty_buckets():
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    cfg = AlgorithmConfig.from_dict({"advantage": {"mcpo_query_weight": True, "eps": 0.0}})
    _, m = compute_advantages(cfg, r)
    assert m["groups/mastered_frac"] == 0.25 and m["groups/all_wrong_frac"] == 0.25
    assert m["groups/zero_variance_frac"] == 0.5
    # easy: p = 1 (mean reward 1); hard: p = 0; medium: p = 0.75 and 0.25 -> mean reward 0.5
    assert m["reward/easy"] == 1.0 and m["reward/hard"] == 0.0 and m["reward/medium"] == 0.5
    assert m["reward/easy_frac"] == 0.25 and m["reward/medium_frac"] == 0.5
    # query weights: 0, 0.5 (MCPO plateau), 0, sqrt(3)/4 = 0.433
    assert m["mcpo/query_weight_hist/[0,0.1)"] == 0.5
    assert m["mcpo/query_weight_hist/[0.49,0.51)"] == 0.25
    assert m["mcpo/query_weight_hist/[0.4,0.49)"] == 0.25
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in m.values())


def test_mastered_rollouts_threshold_and_group_size():
    r = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, float("nan"), float("nan")]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    m = mastered_rollouts(AlgorithmConfig(), r, valid_G_n=valid)
    assert m.tolist() == [[True, True, True], [False, False, False], [False, False, False]]  # min_group_size 2
    cfg = AlgorithmConfig.from_dict({"hinge_kl": {"mastered_threshold": 0.6, "min_group_size": 1}})
    m = mastered_rollouts(cfg, r, valid_G_n=valid)
    assert m.tolist() == [[True, True, True], [True, True, True], [True, False, False]]
    # the verifier's verdict overrides the reward threshold (shaped rewards below 0.5 but correct)
    shaped = torch.tensor([[0.4, 0.3, 0.45]])
    assert mastered_rollouts(AlgorithmConfig(), shaped).tolist() == [[False] * 3]
    assert mastered_rollouts(AlgorithmConfig(), shaped, correct_G_n=torch.ones(1, 3, dtype=torch.bool)).tolist() == [
        [True] * 3
    ]


def test_correct_threshold_is_the_reward_midpoint():
    """Without the verifier's verdict a rollout is correct when its reward reaches (R_correct + R_wrong) / 2: with
    R_correct = 2, R_wrong = -1 the threshold is 0.5, so rewards 0.4 / 0.5 / 2 give accuracy 2/3 (by hand)."""
    from megatron_rlvr.algorithms import AdvantageConfig
    from megatron_rlvr.algorithms.advantages import rollout_accuracy

    cfg = AdvantageConfig(reward_correct=2.0, reward_wrong=-1.0)
    assert cfg.correct_threshold == 0.5
    rewards = torch.tensor([[0.4, 0.5, 2.0]], dtype=torch.float64)
    acc = rollout_accuracy(cfg, rewards, torch.ones(1, 3, dtype=torch.bool), None)
    assert acc.tolist() == [2 / 3]
