"""Groups of samples -> the step's training sequences: reward shaping, dynamic-sampling filter, group advantages,
mastered prompts, truncation masking (all the algorithm's pure functions), plus the batch's metrics.

Runs identically on every rank on the global batch (every rank holds all groups after the rollout all-gather).
"""

from __future__ import annotations

import math

import torch

from megatron_rlvr.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    dynamic_sampling_keep,
    mastered_rollouts,
    shape_rewards,
)
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.rollout.groups import Group
from megatron_rlvr.trainer.microbatch import Sequence


def reward_tensors(groups: list[Group], algo: AlgorithmConfig):
    """(shaped rewards [G, n] float64, correct [G, n] bool, lengths [G, n] long) — groups must share n."""
    n = len(groups[0].rewards)
    if any(len(g.rewards) != n for g in groups):
        raise ValueError("every group must have the same number of samples")
    raw = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    lengths = torch.tensor([[len(r) for r in g.response_ids] for g in groups], dtype=torch.long)
    correct = raw >= 0.5 * (algo.advantage.reward_correct + algo.advantage.reward_wrong)
    shaped = shape_rewards(algo.dapo, raw, lengths)
    return shaped, correct, lengths


def informative(groups: list[Group], algo: AlgorithmConfig) -> list[bool]:
    """Dynamic sampling (DAPO Sec. 3.2): keep groups whose (shaped) rewards are not all equal."""
    if not groups:
        return []
    shaped, _, _ = reward_tensors(groups, algo)
    return [bool(k) for k in dynamic_sampling_keep(shaped)]


def build_sequences(groups: list[Group], algo: AlgorithmConfig) -> tuple[list[Sequence], dict[str, float]]:
    """Training sequences (group-major order) of the kept groups, and their advantage metrics (``adv/*``,
    ``focal/*``, ``mcpo/*``)."""
    if not groups:
        return [], {}
    with native_torch():  # ~150 tiny CPU tensor ops, no CUDA call: skip the CPU shims' per-call handler
        shaped, correct, _ = reward_tensors(groups, algo)
        adv, adv_metrics = compute_advantages(algo, shaped, correct_G_n=correct)
        mastered = mastered_rollouts(algo, shaped, correct_G_n=correct)
        adv_rows, mastered_rows = adv.tolist(), mastered.tolist()  # one conversion, not two torch calls per sequence
        adv_metrics = {k: float(v) for k, v in adv_metrics.items()}
    seqs: list[Sequence] = []
    for gi, g in enumerate(groups):
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
                )
            )
    m = {k: float(v) for k, v in adv_metrics.items() if k.split("/")[0] in ("adv", "focal", "mcpo")}
    m["batch/sequences"] = float(len(seqs))
    m["batch/trained_frac"] = sum(s.train for s in seqs) / len(seqs)
    return seqs, _finite(m)


def batch_metrics(groups: list[Group], algo: AlgorithmConfig) -> dict[str, float]:
    """What RL researchers watch, over ALL groups generated this step (before any dynamic-sampling filter): reward
    and accuracy (overall, by difficulty bucket easy/medium/hard and by the data's level), mastered / all-wrong /
    zero-variance group fractions, response lengths and truncation."""
    if not groups:
        return {"batch/groups_generated": 0.0}
    with native_torch():  # tiny CPU tensor ops only (see build_sequences)
        shaped, correct, lengths = reward_tensors(groups, algo)
        _, adv_metrics = compute_advantages(algo, shaped, correct_G_n=correct)
        m = {k: float(v) for k, v in adv_metrics.items() if k.split("/")[0] in ("reward", "groups")}
        lf = lengths.double()
        truncated = sum(r == "length" for g in groups for r in g.finish_reasons)
        m.update(
            {
                "reward/raw_mean": float(torch.tensor([g.rewards for g in groups], dtype=torch.float64).mean()),
                "reward/accuracy": float(correct.double().mean()),
                "response/length_mean": float(lf.mean()),
                "response/length_max": float(lf.max()),
                "response/length_min": float(lf.min()),
                "response/truncated_frac": truncated / lengths.numel(),
                "batch/groups_generated": float(len(groups)),
            }
        )
        correct_rows = correct.tolist()
    by_level: dict[str, list[float]] = {}
    for g, row in zip(groups, correct_rows):
        if g.example.level is not None:
            by_level.setdefault(str(g.example.level), []).extend(float(c) for c in row)
    for lvl, cs in sorted(by_level.items()):
        m[f"accuracy/level_{lvl}"] = sum(cs) / len(cs)
    return _finite(m)


def _finite(m: dict[str, float]) -> dict[str, float]:
    return {k: (v if math.isfinite(v) else 0.0) for k, v in m.items()}


def warn_all_too_long(t, step: int, m: dict) -> None:
    """Every prompt of the step was longer than rollout.max_prompt_len: say so once per run (rank 0), with the fix;
    the step is skipped (``train/skipped_all_too_long``)."""
    if getattr(t, "_warned_too_long", False) or not t.dist.is_logger:
        return
    t._warned_too_long = True
    print(
        f"megatron-rlvr: WARNING: step {step}: all {m['data/prompts_too_long']:.0f} prompts are longer than "
        f"rollout.max_prompt_len={t.cfg.rollout.max_prompt_len} tokens (after the prompt template), so the step "
        "trains on nothing; raise rollout.max_prompt_len (every such step is skipped)",
        flush=True,
    )
