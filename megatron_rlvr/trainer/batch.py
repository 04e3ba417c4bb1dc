"""The step's batches and the pure functions between them (no Megatron; identical on every rank, which holds the
global batch after the rollout all-gather):

``RolloutBatch`` (prompt groups with rewards and engine log-probs, the policy version that generated them)
-> :func:`group_rewards` (shaped rewards, correctness, lengths: once per step) -> :func:`advantages_and_sequences`
(the algorithm's group advantages, mastered prompts, truncation masking: once per step) -> ``TrainBatch`` (sequences
with advantages, and, once the log-prob stage has run, behaviour and reference log-probs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    dynamic_sampling_keep,
    mastered_rollouts,
    shape_rewards,
)
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.models.mrope import image_token_counts
from megatron_rlvr.rollout.groups import Group
from megatron_rlvr.rollout.multiturn import CUTS
from megatron_rlvr.trainer.microbatch import Sequence, VisionInputs


@dataclass(frozen=True)
class GroupRewards:
    """Rewards of a list of groups as tensors (groups share n)."""

    shaped_G_n: torch.Tensor
    """[G, n] float64: verifier rewards after the algorithm's shaping (DAPO overlong penalty)."""
    correct_G_n: torch.Tensor
    """[G, n] bool: the raw reward is closer to reward_correct than to reward_wrong."""
    lengths_G_n: torch.Tensor
    """[G, n] long: response lengths."""

    def rows(self, index: list[int]) -> GroupRewards:
        """The rewards of the groups ``index`` (in that order)."""
        i = torch.tensor(index, dtype=torch.long)
        return GroupRewards(self.shaped_G_n[i], self.correct_G_n[i], self.lengths_G_n[i])


def group_rewards(groups: list[Group], algo: AlgorithmConfig) -> GroupRewards:
    n = len(groups[0].rewards)
    if any(len(g.rewards) != n for g in groups):
        raise ValueError("every group must have the same number of samples")
    with native_torch():  # tiny CPU tensor ops, no CUDA call: skip the CPU shims' per-call handler
        raw = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        lengths = torch.tensor([[len(r) for r in g.response_ids] for g in groups], dtype=torch.long)
        correct = raw >= algo.advantage.correct_threshold
        return GroupRewards(shape_rewards(algo.dapo, raw, lengths), correct, lengths)


@dataclass(frozen=True)
class RolloutBatch:
    """What the rollout stage hands on: every group generated this step (all dynamic-sampling rounds), which of them
    are kept for training, their rewards, and the rollout's metrics."""

    groups: list[Group]
    """Every group generated this step, in generation order (the batch metrics and the forgetting probe read all)."""
    kept: list[int]
    """Indices into ``groups`` of the groups trained on (all of them without dynamic sampling)."""
    rewards: GroupRewards | None
    """Rewards of ``groups`` (None when no group was generated)."""
    policy_version: int
    """The last step whose update the generating weights include (0: the initial weights; step - 1 when
    synchronous)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout metrics: prompts skipped as too long, rounds, generation and reward times, reward failures."""


def informative(rewards: GroupRewards) -> list[bool]:
    """Dynamic sampling (DAPO Sec. 3.2): keep groups whose (shaped) rewards are not all equal."""
    with native_torch():
        return [bool(k) for k in dynamic_sampling_keep(rewards.shaped_G_n)]


@dataclass(frozen=True)
class TrainBatch:
    """The training batch of one step (every rank holds all of it; each trains on its data-parallel share)."""

    sequences: tuple[Sequence, ...]
    """Group-major training sequences with their advantages and mastered flags."""
    old_logprobs: Mapping[int, torch.Tensor] = field(default_factory=dict)
    """Behaviour log-probs [R] of this rank's sequences, by index; the first mini-batch's are absent when
    ``old_from_first_forward`` (the first update's forward gives them)."""
    ref_logprobs: Mapping[int, torch.Tensor] | None = None
    """Reference-policy log-probs [R] of this rank's sequences (None: no reference KL from log-probs)."""
    teacher_logprobs: Mapping[int, torch.Tensor] | None = None
    """The distillation teacher's log-probs [R] of this rank's sequences (None: no teacher, or the teacher's
    logits come with each micro-batch of the update: ``algorithm.distill.estimator=full``)."""
    old_from_first_forward: bool = False
    """The first mini-batch's behaviour log-probs come from the first update's own forward (exact: the policy IS
    the behaviour policy before the first optimizer step)."""
    policy_version: int = 0
    """The policy version that generated the sequences (see RolloutBatch)."""
    routes: Mapping[int, torch.Tensor] | None = None
    """Routing replay: the MoE routes [MoE layers on this stage, length, k] of this rank's sequences, by index. R2:
    the behaviour forward's (the first mini-batch's are absent when ``old_from_first_forward``); R3: the engine's,
    every sequence's (-1 where unknown); None: no replay."""
    route_weights: Mapping[int, torch.Tensor] | None = None
    """R3 with ``train.routing_replay_weights``: the engine's gate weights of those routes [MoE layers on this stage,
    length, k] float32 (NaN where unknown), by index; None: the router's own probabilities weight the experts."""

    @property
    def trains(self) -> bool:
        """Some sequence carries loss (an empty or all-truncated batch has nothing to learn from)."""
        return any(s.train for s in self.sequences)


def group_vision(group: Group, image_processor, image_token_id: int, spatial_merge_size: int) -> VisionInputs | None:
    """The trainer's image inputs of a group's prompt (None without images): ``image_processor`` on the example's
    images (deterministic: the same pixels and grids the engine's processor gave), the image mask from the prompt
    ids the engine returned (expanded: one token per merged patch). ValueError when they disagree."""
    if not group.example.images:
        return None
    out = image_processor(images=list(group.example.images), return_tensors="pt")
    grid = out["image_grid_thw"].long()
    mask = torch.tensor(group.prompt_ids, dtype=torch.long) == image_token_id
    want = sum(image_token_counts(grid, spatial_merge_size))
    if int(mask.sum()) != want:
        raise ValueError(
            f"example {group.example.id!r}: its prompt holds {int(mask.sum())} image tokens, its "
            f"{len(group.example.images)} images need {want}: the engine must return the expanded prompt"
        )
    return VisionInputs(out["pixel_values"], grid, mask, spatial_merge_size)


def advantages_and_sequences(
    rollout: RolloutBatch, algo: AlgorithmConfig, vision: Callable[[Group], VisionInputs | None] | None = None
) -> tuple[tuple[Sequence, ...], dict[str, float]]:
    """Training sequences (group-major) of the kept groups and the batch's metrics: the algorithm's advantages,
    mastered prompts and truncation masking, computed once; reward / accuracy / group / length curves of everything
    generated (``batch_metrics``). ``vision``: a group's image inputs (:func:`group_vision`), for vision-language
    policies."""
    if not rollout.groups:
        return (), {"batch/groups_generated": 0.0}
    kept_groups = [rollout.groups[i] for i in rollout.kept]
    everything = rollout.rewards
    all_kept = len(rollout.kept) == len(rollout.groups)
    with native_torch():  # ~150 tiny CPU tensor ops, no CUDA call: skip the CPU shims' per-call handler
        m: dict[str, float] = {}
        seqs: list[Sequence] = []
        if kept_groups:
            kept = everything if all_kept else everything.rows(rollout.kept)
            adv, adv_metrics = compute_advantages(algo, kept.shaped_G_n, correct_G_n=kept.correct_G_n)
            mastered = mastered_rollouts(algo, kept.shaped_G_n, correct_G_n=kept.correct_G_n)
            adv_rows, mastered_rows = adv.tolist(), mastered.tolist()  # one conversion, not two per sequence
            m.update({k: float(v) for k, v in adv_metrics.items() if k.split("/")[0] in ("adv", "focal", "mcpo")})
            seqs = _sequences(kept_groups, adv_rows, mastered_rows, algo, vision)
            m["batch/sequences"] = float(len(seqs))
            m["batch/trained_frac"] = sum(s.train for s in seqs) / len(seqs)
        if all_kept and kept_groups:
            group_metrics = adv_metrics
        else:  # dynamic sampling: the reward curves describe everything generated, not the kept groups
            _, group_metrics = compute_advantages(algo, everything.shaped_G_n, correct_G_n=everything.correct_G_n)
        m.update(batch_metrics(rollout.groups, everything, group_metrics))
    return tuple(seqs), _finite(m)


def _sequences(groups: list[Group], adv_rows, mastered_rows, algo: AlgorithmConfig, vision=None) -> list[Sequence]:
    seqs: list[Sequence] = []
    for gi, g in enumerate(groups):
        images = None if vision is None else vision(g)
        for j, resp in enumerate(g.response_ids):
            truncated = g.finish_reasons[j] == "length"
            seqs.append(
                Sequence(
                    tokens=list(g.prompt_ids) + list(resp),
                    prompt_len=len(g.prompt_ids),
                    adv=float(adv_rows[gi][j]),
                    mastered=bool(mastered_rows[gi][j]),
                    train=len(resp) > 0 and not (algo.dapo.mask_truncated and truncated),
                    rollout_logprobs=list(g.logprobs[j]),
                    engine_routes=g.routes[j] if g.routes else None,
                    engine_route_weights=g.route_weights[j] if g.route_weights else None,
                    vision=images,
                    loss_mask=list(g.loss_masks[j]) if g.loss_masks else None,
                    demo=bool(g.demos and g.demos[j]),
                )
            )
    return seqs


def batch_metrics(groups: list[Group], rewards: GroupRewards, group_metrics: dict) -> dict[str, float]:
    """What RL researchers watch, over ALL groups generated this step (before any dynamic-sampling filter): reward
    and accuracy (overall, by difficulty bucket easy/medium/hard and by the data's level), mastered / all-wrong /
    zero-variance group fractions (``group_metrics``: the advantage estimator's metrics over all groups), response
    lengths and truncation."""
    m = {k: float(v) for k, v in group_metrics.items() if k.split("/")[0] in ("reward", "groups")}
    lf = rewards.lengths_G_n.double()
    truncated = sum(r == "length" for g in groups for r in g.finish_reasons)
    m.update(
        {
            "reward/raw_mean": float(torch.tensor([g.rewards for g in groups], dtype=torch.float64).mean()),
            "reward/accuracy": float(rewards.correct_G_n.double().mean()),
            "response/length_mean": float(lf.mean()),
            "response/length_max": float(lf.max()),
            "response/length_min": float(lf.min()),
            "response/truncated_frac": truncated / rewards.lengths_G_n.numel(),
            "batch/groups_generated": float(len(groups)),
        }
    )
    by_level: dict[str, list[float]] = {}
    for g, row in zip(groups, rewards.correct_G_n.tolist()):
        if g.example.level is not None:
            by_level.setdefault(str(g.example.level), []).extend(float(c) for c in row)
    for lvl, cs in sorted(by_level.items()):
        m[f"accuracy/level_{lvl}"] = sum(cs) / len(cs)
    if any(g.turns for g in groups):
        m.update(agent_metrics(groups))
    if any(g.demos for g in groups):
        m.update(on_policy_metrics(groups, rewards))
    return m


def on_policy_metrics(groups: list[Group], rewards: GroupRewards) -> dict[str, float]:
    """Off-policy guidance (``agent.guidance``): the curves that report the policy's performance (``reward/mean``,
    ``reward/raw_mean``, ``reward/accuracy``, ``agent/*``) over the samples the policy drew only (a demonstration
    replaced one sample of a group the policy got all wrong), and ``guidance/demos`` (demonstrations trained on this
    step) with ``guidance/demo_frac`` (their share of the samples). The ``groups/*`` and the bucketed ``reward/*``
    curves stay those of the trained groups (demonstrations included)."""
    demo_G_n = torch.tensor([g.demos or [False] * len(g.rewards) for g in groups], dtype=torch.bool)
    onp = ~demo_G_n
    n_on = max(int(onp.sum()), 1)
    raw = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    m = {
        "reward/mean": float(rewards.shaped_G_n[onp].sum()) / n_on,
        "reward/raw_mean": float(raw[onp].sum()) / n_on,
        "reward/accuracy": float(rewards.correct_G_n[onp].double().sum()) / n_on,
        "guidance/demos": float(demo_G_n.sum()),
        "guidance/demo_frac": float(demo_G_n.double().mean()),
    }
    policy_only = [_drop_demos(g) for g in groups]
    if any(g.turns for g in policy_only):
        m.update(agent_metrics([g for g in policy_only if g.turns]))
    return m


def _drop_demos(g: Group) -> Group:
    """The group's multi-turn records of its sampled trajectories only (for ``agent_metrics``)."""
    keep = [j for j in range(len(g.rewards)) if not (g.demos and g.demos[j])]
    pick = lambda xs: [xs[j] for j in keep] if xs else []  # noqa: E731
    return Group(
        example=g.example,
        prompt_ids=g.prompt_ids,
        response_ids=pick(g.response_ids),
        turns=pick(g.turns),
        tool_calls=pick(g.tool_calls),
        loss_masks=pick(g.loss_masks),
        cuts=pick(g.cuts),
    )


SANDBOX_LIMITS = ("timeout", "memory", "output_limit", "process_limit")
"""Tool-call statuses that mean a sandbox limit ended the call."""


def agent_metrics(groups: list[Group]) -> dict[str, float]:
    """Multi-turn rollouts, over every trajectory generated: turns, tool calls (all, by tool, errors, timeouts,
    sandbox limits), observation tokens and their share of the response tokens, trajectories cut by each limit."""
    n = sum(len(g.turns) for g in groups)
    calls = [c for g in groups for per in g.tool_calls for c in per]
    obs = sum(len(mask) - sum(mask) for g in groups for mask in g.loss_masks)
    resp = sum(len(r) for g in groups for r in g.response_ids)
    m = {
        "agent/turns_mean": sum(t for g in groups for t in g.turns) / n,
        "agent/turns_max": float(max(t for g in groups for t in g.turns)),
        "agent/tool_calls_per_trajectory": len(calls) / n,
        "agent/tool_errors": float(sum(c.status != "ok" for c in calls)),
        "agent/tool_timeouts": float(sum(c.status == "timeout" for c in calls)),
        "agent/sandbox_limits": float(sum(c.status in SANDBOX_LIMITS for c in calls)),
        "agent/malformed_calls": float(sum(c.status == "malformed" for c in calls)),
        "agent/observation_tokens_mean": obs / n,
        "agent/observation_token_frac": obs / max(resp, 1),
    }
    for tool in sorted({c.tool for c in calls}):
        m[f"agent/calls_{tool}"] = float(sum(c.tool == tool for c in calls))
    cuts = [c for g in groups for c in g.cuts]
    for limit in CUTS:
        m[f"agent/cut_{limit}"] = float(sum(c == limit for c in cuts))
    return m


def _finite(m: dict[str, float]) -> dict[str, float]:
    return {k: (v if math.isfinite(v) else 0.0) for k, v in m.items()}
