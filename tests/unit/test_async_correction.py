"""The off-policy correction of the disaggregated schedule (docs/algorithms.md, "Off-policy data"): decoupled PPO
with the behaviour -> proximal weight w = min(pi_prox / mu, C), computed by the trainer's own functions
(``importance_weights`` into the advantage, then ``compute_policy_loss`` of the mcpo preset), recovers the ON-POLICY
policy gradient from samples of a stale behaviour policy. Checked exactly on a one-token bandit: the expectation over
the behaviour policy is a sum over the vocabulary weighted by mu (no sampling), against the hand-written on-policy
gradient sum_a pi(a) A(a) grad log pi(a) in fp64. The control (no correction: w = 1, what ``rollout.old_logprobs=
rollout`` or a zero cap would give) is the gradient of mu's data under pi and differs."""

import torch

from megatron_rlvr.algorithms.aggregation import LossNormalizers
from megatron_rlvr.algorithms.loss import PolicyLossInputs, compute_policy_loss
from megatron_rlvr.algorithms.presets import preset
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.trainer.microbatch import importance_weights
from megatron_rlvr.trainer.policy_side import ASYNC_TIS_CAP

V = 6


def _expected_gradient(theta, logmu_V, adv_V, corrected: bool, cap: float = ASYNC_TIS_CAP):
    """E_{a ~ mu}[grad of the loss of one sampled token a] at theta = the proximal policy (the first mini-batch of a
    step: ratio 1), through the trainer's weight and loss functions."""
    algo = preset("mcpo")
    theta = theta.clone().requires_grad_(True)
    logp_V = torch.log_softmax(theta, -1)
    total = torch.zeros((), dtype=torch.float64)
    for a in range(V):
        logp = logp_V[a].view(1, 1)
        old = logp.detach()
        mask = torch.ones(1, 1, dtype=torch.bool)
        if corrected:
            w = importance_weights(old.float(), logmu_V[a].view(1, 1).float(), mask, MismatchCorrectionConfig(cap))
            adv_BT = adv_V[a].view(1, 1) * w.double()
        else:
            adv_BT = adv_V[a].view(1, 1)
        inputs = PolicyLossInputs(
            logp_BT=logp, old_logp_BT=old, mask_BT=mask, adv_BT=adv_BT, mastered_B=torch.zeros(1, dtype=torch.bool)
        )
        loss, _ = compute_policy_loss(algo, inputs, LossNormalizers(num_tokens=1.0, num_seqs=1.0))
        total = total + logmu_V[a].exp() * loss
    (g,) = torch.autograd.grad(total, theta)
    return g


def _on_policy_gradient(theta, adv_V):
    """-sum_a pi(a) A(a) grad log pi(a) (the loss is the negative objective), by hand in fp64."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    (g,) = torch.autograd.grad(-(logp.detach().exp() * adv_V * logp).sum(), theta)
    return g


def test_decoupled_weight_recovers_the_on_policy_gradient_from_stale_samples():
    """Behaviour two updates behind (mu != pi_prox, every pi/mu below the cap): corrected == on-policy to fp64
    rounding; uncorrected is off by a large margin (it is E_mu, not E_pi)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=g, dtype=torch.float64)
    stale = theta + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    logmu = torch.log_softmax(stale, -1)
    assert float((torch.log_softmax(theta, -1) - logmu).exp().max()) < ASYNC_TIS_CAP  # no weight truncated
    adv = torch.randn(V, generator=g, dtype=torch.float64)
    ref = _on_policy_gradient(theta, adv)
    corrected = _expected_gradient(theta, logmu, adv, corrected=True)
    uncorrected = _expected_gradient(theta, logmu, adv, corrected=False)
    scale = float(ref.abs().max())
    assert float((corrected - ref).abs().max()) < 1e-6 * scale, (corrected, ref)
    assert float((uncorrected - ref).abs().max()) > 0.1 * scale, (uncorrected, ref)


def test_a_weight_above_the_cap_is_truncated_to_the_cap():
    """An action the behaviour policy almost never took (pi/mu = 50) contributes mu * C * A grad log pi, not
    pi * A grad log pi: the truncation bounds the variance at a bias (hand-computed for that one action)."""
    theta = torch.zeros(V, dtype=torch.float64)
    logmu = torch.log_softmax(torch.tensor([0.0] * (V - 1) + [-8.0], dtype=torch.float64), -1)
    adv = torch.zeros(V, dtype=torch.float64)
    adv[-1] = 1.0
    pi = torch.softmax(theta, -1)
    ratio = float(pi[-1] / logmu[-1].exp())
    assert ratio > ASYNC_TIS_CAP
    got = _expected_gradient(theta, logmu, adv, corrected=True)
    # grad of -(mu_a C A log pi_a) w.r.t. theta: -mu_a C A (onehot(a) - pi)
    onehot = torch.zeros(V, dtype=torch.float64)
    onehot[-1] = 1.0
    want = -logmu[-1].exp() * ASYNC_TIS_CAP * (onehot - pi)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-12), (got, want)
