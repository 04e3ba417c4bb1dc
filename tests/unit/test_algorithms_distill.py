"""On-policy distillation (megatron_rlvr.algorithms.distill, the ops' ``kl`` and the loss composition): the
full-vocabulary reverse KL(p_s || p_t) and its gradient w.r.t. the student's logits, through the ops and
compute_policy_loss, against hand-written float64 torch on the full vocabulary; the sampled-token estimate and its
loss surrogate are unbiased for the KL's value and gradient (Monte Carlo, 4-sigma intervals); the advantage mode's
per-token term; the config's refusals."""

import json

import pytest
import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    DistillConfig,
    LossNormalizers,
    PolicyLossInputs,
    compute_policy_loss,
)
from megatron_rlvr.algorithms.distill import distill_advantages, sampled_reverse_kl_surrogate
from megatron_rlvr.ops import vocab_parallel_token_stats

B, T, V, VOCAB = 3, 5, 40, 37  # ids 37..39 are padding columns (excluded from every distribution)
TEMP = 0.8


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(B * T, V, generator=torch.Generator().manual_seed(seed)) * scale


def _reverse_kl_fp64(student_TV: torch.Tensor, teacher_TV: torch.Tensor) -> torch.Tensor:
    """Hand-written reference: sum_v p_s(v) (log p_s(v) - log p_t(v)) over the true vocabulary, float64."""
    ls = torch.log_softmax(student_TV[:, :VOCAB].double() / TEMP, dim=-1)
    lt = torch.log_softmax(teacher_TV[:, :VOCAB].double() / TEMP, dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


def _forward_kl_fp64(student_TV, teacher_TV):
    """The control: KL(p_t || p_s), the other direction."""
    ls = torch.log_softmax(student_TV[:, :VOCAB].double() / TEMP, dim=-1)
    lt = torch.log_softmax(teacher_TV[:, :VOCAB].double() / TEMP, dim=-1)
    return (lt.exp() * (lt - ls)).sum(-1)


def _mask() -> torch.Tensor:
    lengths = torch.tensor([5, 2, 0])  # ragged, one empty response
    return torch.arange(T)[None, :] < lengths[:, None]


def _cfg(**distill) -> AlgorithmConfig:
    return AlgorithmConfig.from_dict({"distill": {"teacher": "tiny", **distill}})


def test_full_vocab_reverse_kl_and_its_gradient_match_fp64_through_the_loss():
    """The loss of ``estimator=full`` (reward_weight 0: distillation alone, token-mean over the masked tokens):
    ops ``kl`` of the student's fp32 logits against the teacher's -> compute_policy_loss -> backward. Its value and
    gradient w.r.t. every student logit (padding columns: 0) equal coef x the mean of the hand-written float64
    reverse KL and its autograd gradient; the forward KL, the control, differs by far more than the tolerance."""
    student, teacher = _logits(1), _logits(2)
    mask = _mask()
    coef = 0.7
    x = student.clone().requires_grad_()
    st = vocab_parallel_token_stats(x, temperature=TEMP, vocab_size=VOCAB, want=("kl",), other_logits_TV=teacher)
    kl_BT = st["kl"].view(B, T)
    t_lp = torch.log_softmax(teacher[:, :VOCAB] / TEMP, -1)[:, 0].view(B, T)  # any detached teacher log-prob
    inp = PolicyLossInputs(
        logp_BT=torch.zeros(B, T),
        old_logp_BT=torch.zeros(B, T),
        mask_BT=mask,
        adv_BT=torch.zeros(B, T),
        teacher_logp_BT=t_lp,
        distill_kl_BT=kl_BT,
    )
    loss, metrics = compute_policy_loss(
        _cfg(estimator="full", coef=coef, reward_weight=0.0), inp, LossNormalizers.from_batch(mask)
    )
    loss.backward()

    xr = student.double().requires_grad_()
    kl_ref = _reverse_kl_fp64(xr, teacher).view(B, T)
    ref = coef * kl_ref[mask].sum() / mask.sum()
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 2e-6
    assert torch.allclose(x.grad.double(), xr.grad, atol=2e-7, rtol=2e-5)
    assert float(x.grad[:, VOCAB:].abs().max()) == 0.0
    assert abs(float(metrics["distill/kl_per_token"]) - float(kl_ref[mask].mean())) < 2e-6
    assert abs(float(metrics["loss/distill"]) - float(ref) / coef) < 2e-6
    # control: the other direction is a different number (the comparison above would catch a swap)
    fwd = coef * _forward_kl_fp64(student, teacher).view(B, T)[mask].mean()
    assert abs(float(fwd) - float(ref)) > 100 * 2e-6


def test_full_vocab_gradient_is_the_closed_form():
    """d KL / d z_v = p_s(v) (log p_s(v) - log p_t(v) - KL) / T (z the logits, T the temperature), written out by
    hand in float64, equals the ops' gradient of sum_t KL_t."""
    student, teacher = _logits(3), _logits(4)
    x = student.clone().requires_grad_()
    kl = vocab_parallel_token_stats(x, temperature=TEMP, vocab_size=VOCAB, want=("kl",), other_logits_TV=teacher)
    kl["kl"].sum().backward()
    ls = torch.log_softmax(student[:, :VOCAB].double() / TEMP, -1)
    lt = torch.log_softmax(teacher[:, :VOCAB].double() / TEMP, -1)
    k = (ls.exp() * (ls - lt)).sum(-1, keepdim=True)
    g = ls.exp() * (ls - lt - k) / TEMP
    assert torch.allclose(x.grad[:, :VOCAB].double(), g, atol=2e-7, rtol=2e-5)
    assert torch.allclose(kl["kl"].double(), k[:, 0], atol=2e-6)


def test_sampled_estimate_and_its_loss_gradient_are_unbiased():
    """y ~ p_s (float64, 200k draws per position): the mean of the sampled estimate log p_s(y) - log p_t(y), as the
    loss surrogate's value on-policy, lies within 4 standard errors of the exact KL; the mean of the surrogate's
    gradient w.r.t. the logits lies within 4 standard errors of the exact KL gradient in every coordinate. The
    control: the naive loss log p_s(y) - log p_t(y) has mean gradient 0, far from it."""
    n = 200_000
    g = torch.Generator().manual_seed(5)
    student = torch.randn(2, 12, generator=g, dtype=torch.float64) * 1.5
    teacher = torch.randn(2, 12, generator=g, dtype=torch.float64) * 1.5
    ls, lt = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    kl_exact = (ls.exp() * (ls - lt)).sum(-1)
    grad_exact = ls.exp() * (ls - lt - kl_exact[:, None])
    for t in range(2):
        y = torch.multinomial(ls[t].exp(), n, replacement=True, generator=g)
        z = student[t].expand(n, -1).clone().requires_grad_()
        logp = torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]
        value = sampled_reverse_kl_surrogate(logp, logp.detach(), lt[t][y], log_ratio_clamp=20.0)
        se = value.detach().std() / n**0.5
        assert abs(float(value.detach().mean() - kl_exact[t])) < 4 * float(se)
        value.sum().backward()  # per-sample gradients are the rows of z.grad
        gm, gse = z.grad.mean(0), z.grad.std(0) / n**0.5
        assert bool(((gm - grad_exact[t]).abs() < 4 * gse + 1e-12).all()), (gm, grad_exact[t])
        # control: the naive per-sample loss x has gradient (onehot(y) - p), mean 0 != the KL gradient
        naive = (torch.nn.functional.one_hot(y, 12).double() - ls[t].exp()).mean(0)
        assert float((naive - grad_exact[t]).abs().max()) > 20 * float(gse.max())


def test_sampled_loss_weights_off_policy_tokens_by_the_ratio():
    """Off-policy (logp != old): the surrogate's gradient w.r.t. logp is r (logp - teacher_logp) with
    r = exp(logp - old), and its value r (logp - teacher_logp), by hand."""
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.2, -1.5, -0.5], dtype=torch.float64)
    teach = torch.tensor([-0.3, -2.5, -1.0], dtype=torch.float64)
    out = sampled_reverse_kl_surrogate(logp, old, teach, log_ratio_clamp=20.0)
    out.sum().backward()
    r = torch.exp(logp.detach() - old)
    x = logp.detach() - teach
    assert torch.allclose(out.detach(), r * x) and torch.allclose(logp.grad, r * x)


@pytest.mark.parametrize("mode", ["loss", "advantage"])
def test_advantages_with_distillation(mode):
    """reward_weight x the reward's advantage, plus -coef (old - teacher) per token in advantage mode; 0 off the
    mask (by hand)."""
    mask = _mask()
    g = torch.Generator().manual_seed(6)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T)
    old, teach = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    cfg = DistillConfig(teacher="tiny", mode=mode, coef=0.5, reward_weight=0.25)
    out = distill_advantages(cfg, adv, old, teach, mask)
    want = 0.25 * adv - (0.5 * (old - teach) if mode == "advantage" else 0.0)
    assert torch.allclose(out, torch.where(mask, want, torch.zeros(())))


def test_advantage_mode_enters_the_policy_gradient():
    """Advantage mode through compute_policy_loss (policy loss pg, reward_weight 0): the loss gradient w.r.t. logp
    is -A_t / N_tok with A_t = -coef (old - teacher) (by hand), and no distillation loss term is added."""
    mask = _mask()
    g = torch.Generator().manual_seed(8)
    old, teach = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    cfg = AlgorithmConfig.from_dict(
        {"policy_loss": {"name": "pg"}, "distill": {"teacher": "tiny", "mode": "advantage", "coef": 2.0}}
    )
    adv = distill_advantages(cfg.distill, torch.zeros(B, T), old, teach, mask)
    logp = old.clone().requires_grad_()
    inp = PolicyLossInputs(logp, old, mask, adv_BT=adv, teacher_logp_BT=teach)
    loss, metrics = compute_policy_loss(cfg, inp, LossNormalizers.from_batch(mask))
    loss.backward()
    want = torch.where(mask, 2.0 * (old - teach) / mask.sum(), torch.zeros(()))
    assert torch.allclose(logp.grad, want, atol=1e-7)
    assert "loss/distill" not in metrics
    assert abs(float(metrics["distill/teacher_logprob_mean"]) - float(teach[mask].mean())) < 1e-6


def test_config_refusals(tmp_path):
    """One line naming the option: full + advantage, a bad coef; a teacher folder whose vocabulary differs from the
    student's (both named); tokenizers that map differently."""
    from megatron_rlvr.config import ConfigError, load_run_config
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.trainer.policy_side import check_same_vocabulary

    with pytest.raises(ValueError, match="estimator=full needs mode=loss"):
        DistillConfig(teacher="tiny", estimator="full", mode="advantage")
    with pytest.raises(ValueError, match="DistillConfig.coef"):
        DistillConfig(teacher="tiny", coef=0.0)
    hf = tiny_hf_config()
    hf["vocab_size"] = hf["vocab_size"] + 5
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"vocab_size=\d+ but the student model 'tiny' has vocab_size=\d+"):
        load_run_config("configs/tiny.yaml", [f"algorithm.distill.teacher={tmp_path}"])
    with pytest.raises(ConfigError, match="estimator=full needs parallel.pp=1"):
        load_run_config(
            "configs/tiny.yaml", ["algorithm.distill.teacher=tiny", "algorithm.distill.estimator=full", "parallel.pp=2"]
        )

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    check_same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}), "s", "t")
    with pytest.raises(ValueError, match="teacher='t'.*student model 's'"):
        check_same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}), "s", "t")
