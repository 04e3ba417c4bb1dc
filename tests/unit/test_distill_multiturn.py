"""On-policy distillation of multi-turn trajectories: the trainer's loss of a micro-batch (trainer/token_loss.py
policy_loss_fn) built from trajectories that interleave the policy's turns with tool / environment observations
(rollout/multiturn.py Trajectory, whose loss mask is 1 at sampled tokens and 0 at observation tokens; the trainer
carries it as Sequence.loss_mask) counts the assistant tokens only: for the full-vocabulary estimator, the sampled one
as a loss and the sampled one as an advantage, the loss, ``distill/kl_per_token`` and the gradient w.r.t. every
student logit equal a hand-written float64 reference over the hand-listed assistant positions. Controls: the same
reference over every response token (observations included) is far from it, and new student / teacher logits at the
observation positions change nothing."""

import pytest
import torch

from megatron_rlvr.algorithms import AlgorithmConfig, LossNormalizers
from megatron_rlvr.rollout.engine import Completion
from megatron_rlvr.rollout.multiturn import Trajectory
from megatron_rlvr.trainer import token_loss
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch

V, VOCAB, S = 24, 21, 10  # ids 21..23 are padding columns
TEMP = 0.8
COEF = 0.6
PROMPT = [1, 3, 4]
ASSISTANT = {0: [2, 3, 7, 8], 1: [2]}
"""Hand-listed (row, model position) pairs whose label is a token the policy sampled: row 0's response is
action [5, 6], observation [7, 8, 9], action [10, 2] at token positions 3..9 (labels of positions 2..8); row 1's is
one action token at position 3 (label of position 2)."""
OBSERVATION = {0: [4, 5, 6]}


def _trajectories():
    a = Trajectory()
    a.add_action(Completion(token_ids=[5, 6], logprobs=[-1.0, -2.0], finish_reason="stop"))
    a.add_observation([7, 8, 9])
    a.add_action(Completion(token_ids=[10, 2], logprobs=[-0.5, -0.1], finish_reason="stop"))
    b = Trajectory()
    b.add_action(Completion(token_ids=[4], logprobs=[-0.3], finish_reason="stop"))
    return [a, b]


def _logits(seed: int, tool_seed: int | None = None):
    """Student and teacher logits [2, S, V]; ``tool_seed``: other values at the observation positions."""
    g = torch.Generator().manual_seed(seed)
    student, teacher = torch.randn(2, S, V, generator=g) * 2, torch.randn(2, S, V, generator=g) * 2
    if tool_seed is not None:
        g2 = torch.Generator().manual_seed(tool_seed)
        for row, positions in OBSERVATION.items():
            student[row, positions] = torch.randn(len(positions), V, generator=g2) * 3
            teacher[row, positions] = torch.randn(len(positions), V, generator=g2) * 3
    return student, teacher


def _positions(with_observations: bool):
    pos = {r: list(p) for r, p in ASSISTANT.items()}
    if with_observations:
        for r, p in OBSERVATION.items():
            pos[r] = sorted(pos[r] + p)
    return [(r, t) for r, ps in pos.items() for t in ps]


def _teacher_logp_fp64(teacher, labels):
    lt = torch.log_softmax(teacher[..., :VOCAB].double() / TEMP, -1)
    return lt.gather(-1, labels[..., None])[..., 0]  # [2, S]


def _reference(case: str, student, teacher, labels, with_observations: bool = False):
    """float64 over the listed positions, token-mean, ``pg`` policy loss with reward_weight 0: (loss, gradient
    [2, S, V], mean per-token KL estimate)."""
    z = student.double().requires_grad_()
    ls = torch.log_softmax(z[..., :VOCAB] / TEMP, -1)
    lt = torch.log_softmax(teacher[..., :VOCAB].double() / TEMP, -1)
    pos = _positions(with_observations)
    if case == "full":
        per_tok = (ls.exp() * (ls - lt)).sum(-1)
        terms = torch.stack([per_tok[r, t] for r, t in pos])
        kl = terms.detach()
    else:  # sampled token: value logp - teacher_logp, gradient (logp - teacher_logp) grad logp (on-policy)
        logp = ls.gather(-1, labels[..., None])[..., 0]
        t_lp = _teacher_logp_fp64(teacher, labels)
        x = torch.stack([logp[r, t] - t_lp[r, t] for r, t in pos])
        kl = x.detach()
        terms = torch.stack([logp[r, t] for r, t in pos]) * kl  # the gradient's form; value fixed below
    loss = COEF * terms.sum() / len(pos)
    loss.backward()
    # the value: the KL term itself in loss mode; in advantage mode the plain policy gradient's -A logp with
    # A = -coef (logp - teacher_logp), i.e. the gradient's form above
    value = loss.detach() if case == "advantage" else COEF * kl.mean()
    return float(value), z.grad, float(kl.mean())


def _run(case: str, student, teacher):
    """The trainer's loss of the micro-batch: (loss, gradient [2, S, V], metrics, micro-batch)."""
    seqs = [
        Sequence(
            tokens=PROMPT + t.response_ids, prompt_len=len(PROMPT), loss_mask=t.loss_mask, rollout_logprobs=t.logprobs
        )
        for t in _trajectories()
    ]
    labels = build_microbatch(seqs, 2, S, 0).labels
    t_lp = _teacher_logp_fp64(teacher, labels).float()
    # the teacher's log-probs of every response token (observations too, as the teacher's forward gives them)
    teacher_logp = [t_lp[i, len(PROMPT) - 1 : len(PROMPT) - 1 + q.response_len] for i, q in enumerate(seqs)]
    mb = build_microbatch(seqs, 2, S, 0, teacher_logp=teacher_logp if case != "full" else None)
    estimator, mode = {"full": ("full", "loss"), "sampled": ("sampled", "loss"), "advantage": ("sampled", "advantage")}[
        case
    ]
    distill = {"teacher": "tiny", "estimator": estimator, "mode": mode, "coef": COEF, "reward_weight": 0.0}
    algo = AlgorithmConfig.from_dict({"policy_loss": {"name": "pg"}, "distill": distill})
    spec = token_loss.StatsSpec(tp_group=None, vocab_size=VOCAB, temperature=TEMP, chunk_size=64)
    fn = token_loss.policy_loss_fn(
        algo, LossNormalizers.from_batch(mb.mask), spec, old_from_forward=True, teacher_logits_fn=lambda m: teacher
    )
    x = student.clone().requires_grad_()
    loss, out = fn(mb, x)
    loss.backward()
    return float(loss.detach()), x.grad, out.metrics, mb


@pytest.mark.parametrize("case", ["full", "sampled", "advantage"])
def test_distillation_counts_assistant_tokens_only(case):
    """The micro-batch's mask is the hand-listed assistant positions; loss (1e-6), kl_per_token (1e-6) and the
    gradient (1e-6; exactly 0 at observation positions) equal the float64 reference over those positions; the
    reference that also counts observation tokens misses by > 1e-2; other logits at observation positions change
    neither loss, metrics nor gradient."""
    student, teacher = _logits(5)
    loss, grad, metrics, mb = _run(case, student, teacher)
    hand = torch.zeros(2, S, dtype=torch.bool)
    for r, t in _positions(False):
        hand[r, t] = True
    assert torch.equal(mb.mask, hand)
    r_loss, r_grad, r_kl = _reference(case, student, teacher, mb.labels)
    assert abs(loss - r_loss) < 1e-6, (loss, r_loss)
    assert abs(metrics["distill/kl_per_token"] - r_kl) < 1e-6, (metrics["distill/kl_per_token"], r_kl)
    assert float((grad.double() - r_grad).abs().max()) < 1e-6
    assert float(grad[0, OBSERVATION[0]].abs().max()) == 0.0
    assert float(r_grad.abs().max()) > 1e-2  # a real gradient to compare
    # control: counting the observation tokens too gives another loss and mean KL
    c_loss, _, c_kl = _reference(case, student, teacher, mb.labels, with_observations=True)
    assert abs(c_loss - loss) > 1e-2 and abs(c_kl - metrics["distill/kl_per_token"]) > 1e-2, (c_loss, loss, c_kl)
    # other logits at the observation positions: nothing changes
    s2, t2 = _logits(5, tool_seed=99)
    assert not torch.equal(s2, student)
    loss2, grad2, metrics2, _ = _run(case, s2, t2)
    assert loss2 == loss and torch.equal(grad2, grad)
    assert metrics2["distill/kl_per_token"] == metrics["distill/kl_per_token"]
