"""The stages of one RL step, each over the part of the rank it needs, with typed hand-offs:

    rollout(rollout_side, step)          -> RolloutBatch   prompts -> samples -> rewards (+ dynamic-sampling refill)
    learn(policy_side, rolled)           -> StepResult     advantages, behaviour / reference log-probs, the update,
                                                           the train/inference mismatch, the scheduler step
    publish(policy_side, sink, version)  -> metrics        the policy's weights into the engines (a local engine or
                                                           the bridge to the rollout ranks)

Both schedules drive these same functions: ``megatron_rlvr.trainer.colocated`` runs them in order on every rank;
``megatron_rlvr.trainer.disaggregated`` runs ``rollout`` on the rollout ranks and ``learn`` / ``publish`` on the
training ranks. The stages hold no schedule state and never change what they were handed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_rlvr.algorithms.reductions import reduction_of
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.megatron.parallel import all_gather_objects
from megatron_rlvr.rollout.groups import Round, generate_groups, sampling_params, tokenize_prompts
from megatron_rlvr.rollout.mismatch import mismatch_metrics as token_mismatch
from megatron_rlvr.trainer.batch import (
    RolloutBatch,
    TrainBatch,
    advantages_and_sequences,
    group_rewards,
    group_vision,
    informative,
)
from megatron_rlvr.trainer.policy_side import PolicySide
from megatron_rlvr.trainer.rollout_side import RolloutSide
from megatron_rlvr.trainer.update import UpdateResult, compute_logprobs, my_sequence_ids, policy_update, recompute_ids
from megatron_rlvr.trainer.weights import WeightSink

# ------------------------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------------------------


def rollout(side: RolloutSide, step: int) -> RolloutBatch:
    """Sample prompts, roll out, score; with dynamic sampling keep informative groups and refill from more prompts
    (at most train.dynamic_sampling_max_rounds rounds). Samples are stamped with the engine's weight version."""
    cfg, need = side.cfg, side.cfg.train.prompts_per_step
    algo = cfg.algorithm
    dynamic = algo.dapo.dynamic_sampling
    params = sampling_params(cfg.rollout)
    gen = side.generator()
    groups, kept, m = [], [], {"data/prompts_too_long": 0.0, "rollout/rounds": 0.0}
    rewards = None
    for round_idx in range(cfg.train.dynamic_sampling_max_rounds if dynamic else 1):
        examples = side.loader.next_batch(need)
        examples, ids, too_long = tokenize_prompts(
            examples, side.tokenizer, cfg.data, cfg.rollout.max_prompt_len, side.image_processor, side.prompt_tools
        )
        m["data/prompts_too_long"] += too_long
        rnd = Round(
            examples,
            ids,
            params,
            seed=cfg.train.seed,
            step=step,
            round_idx=round_idx,
            version=side.policy_version,
            reward_max_error_frac=cfg.reward.max_error_frac,
            reward_fn=cfg.reward.fn,
        )
        new, stats = generate_groups(gen, rnd)
        for k, v in stats.items():
            m[k] = m.get(k, 0.0) + v
        m["rollout/rounds"] += 1
        first = len(groups)
        groups.extend(new)
        if not dynamic:
            kept = list(range(len(groups)))
            break
        if new:
            kept.extend(first + i for i, keep in enumerate(informative(group_rewards(new, algo))) if keep)
        if len(kept) >= need:
            break
    kept = kept[:need]
    if groups:
        rewards = group_rewards(groups, algo)
    m["rollout/kept_groups"] = float(len(kept))
    m["rollout/kept_frac"] = len(kept) / max(len(groups), 1)
    return RolloutBatch(groups=groups, kept=kept, rewards=rewards, policy_version=side.policy_version, metrics=m)


@dataclass(frozen=True)
class StepResult:
    """What the training half of a step hands back."""

    metrics: dict[str, float]
    """The step's metrics so far: the rollout's, the batch's, the update's, the mismatch, the learning rate."""
    updated: bool
    """The weights changed (at least one optimizer step was applied): they need publishing."""
    tokens: int
    """Tokens of every sequence trained on (prompts and responses), for the throughput."""


def learn(policy: PolicySide, rolled: RolloutBatch) -> StepResult:
    """The training half of a step on a rollout batch: advantages and log-probs (:func:`train_batch`), the policy
    update, the train/inference mismatch of the behaviour log-probs, the scheduler step."""
    batch, m = train_batch(policy, rolled)
    if not batch.trains:  # empty or all-truncated batch: nothing to learn from
        m.update({"train/skipped": 1.0, "train/skipped_empty": 1.0})
        if not rolled.groups and m.get("data/prompts_too_long", 0) > 0:
            m["train/skipped_all_too_long"] = 1.0
        return StepResult(metrics=m, updated=False, tokens=0)
    t1 = time.perf_counter()
    result = update(policy, batch)
    m.update(result.metrics)
    m["logprobs/nonfinite"] = max(m.get("logprobs/nonfinite", 0.0), result.first_forward_nonfinite)
    m.update(update_mismatch_metrics(policy, batch, result))
    m["time/update_s"] = time.perf_counter() - t1
    policy.scheduler.step(increment=1)
    updated = m.get("train/updates", 0) > 0
    m["train/skipped"] = float(not updated)
    m["optim/lr"] = policy.current_lr()
    m["perf/generated_tokens"] = float(sum(s.response_len for s in batch.sequences))
    return StepResult(metrics=m, updated=updated, tokens=sum(s.length for s in batch.sequences))


def publish(policy: PolicySide, sink: WeightSink, version: int, changed: bool = True) -> dict[str, float]:
    """The policy's weights into ``sink`` as ``version`` (``changed``: they differ from the last published)."""
    return sink.publish(policy, version, changed)


def train_batch(policy: PolicySide, rolled: RolloutBatch) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages (once), then this rank's behaviour log-probs (recomputed with the current weights, or the
    engine's) and reference log-probs (when a KL term needs them); returns the batch and the metrics so far."""
    cfg, ctx = policy.cfg, policy.settings
    seqs, m = advantages_and_sequences(rolled, cfg.algorithm, vision_of(policy))
    m = {**rolled.metrics, **m}
    if not any(s.train for s in seqs):
        return TrainBatch(sequences=seqs, policy_version=rolled.policy_version), m
    t0 = time.perf_counter()
    ids = my_sequence_ids(ctx, len(seqs))
    fused = first_forward_gives_old(policy)
    routes = None  # routing replay: R2 records the behaviour forward's MoE routes, R3 replays the engine's
    if ctx.routing is not None:
        routes = {} if ctx.routing.mode == "r2" else {i: ctx.routing.engine_routes(seqs[i]) for i in ids}
    weights = None  # R3 with the engine's gate weights too
    if ctx.routing is not None and cfg.train.routing_replay_weights:
        weights = {i: ctx.routing.engine_weights(seqs[i]) for i in ids}
    old, bad = {}, 0.0
    if cfg.rollout.old_logprobs == "recompute":
        todo = recompute_ids(ctx, len(seqs), fused)
        if todo:
            old, _, bad = compute_logprobs(ctx, policy.model, seqs, todo, routes=routes, route_weights=weights)
    else:
        old = {i: torch.tensor(seqs[i].rollout_logprobs, dtype=torch.float32) for i in ids}
    ref = None
    if policy.ref_model is not None and cfg.algorithm.ref_kl.estimator != "exact":
        ref, _, bad_ref = compute_logprobs(ctx, policy.ref_model, seqs, ids)
        bad = max(bad, bad_ref)
    teacher = None
    if policy.teacher is not None and cfg.algorithm.distill.estimator == "sampled":
        # the teacher scores the student's own tokens once per step (the full estimator scores every vocabulary
        # entry instead, from the teacher's logits inside each micro-batch of the update)
        teacher, _, bad_teacher = compute_logprobs(ctx, policy.teacher, seqs, ids)
        bad = max(bad, bad_teacher)
    if routes and ctx.routing.mode == "r3" and cfg.diagnostics.replay_mismatch:
        # the same behaviour log-probs with the trainer's own routes: what R3 changes in the train/inference mismatch
        plain, _, _ = compute_logprobs(ctx, policy.model, seqs, ids)
        noreplay = mismatch_metrics(policy, seqs, plain)
        m.update({k.replace("mismatch/", "mismatch_noreplay/"): v for k, v in noreplay.items()})
    m["logprobs/nonfinite"] = bad
    m["time/logprobs_s"] = time.perf_counter() - t0
    batch = TrainBatch(
        sequences=seqs,
        old_logprobs=old,
        ref_logprobs=ref,
        teacher_logprobs=teacher,
        old_from_first_forward=fused,
        policy_version=rolled.policy_version,
        routes=routes,
        route_weights=weights,
    )
    return batch, m


def update(policy: PolicySide, batch: TrainBatch) -> UpdateResult:
    """The policy update of the step (megatron_rlvr.trainer.update)."""
    return policy_update(
        policy.settings, policy.model, policy.optimizer, batch, ref_logits_fn(policy), teacher_logits_fn(policy)
    )


# ------------------------------------------------------------------------------------------------------------------
# Helpers of the stages
# ------------------------------------------------------------------------------------------------------------------


def first_forward_gives_old(policy: PolicySide) -> bool:
    """Recomputed behaviour log-probs of the first mini-batch come from the first update's own forward."""
    return policy.cfg.rollout.old_logprobs == "recompute" and policy.cfg.train.old_logprobs_from_update


def update_mismatch_metrics(policy: PolicySide, batch: TrainBatch, result: UpdateResult) -> dict[str, float]:
    """The train/inference mismatch of the recomputed behaviour log-probs, once all of them are known (the first
    mini-batch's come from the update's first forward)."""
    if policy.cfg.rollout.old_logprobs != "recompute":
        return {}
    return mismatch_metrics(policy, batch.sequences, {**batch.old_logprobs, **result.first_forward_logprobs})


def mismatch_metrics(policy: PolicySide, seqs, old) -> dict[str, float]:
    """Train/inference mismatch of the behaviour policy (megatron_rlvr.rollout.mismatch definitions) over this
    data-parallel rank's response tokens, combined over ranks (means weighted by tokens)."""
    # a demonstration (off-policy guidance) has no engine log-probs to compare with
    pairs = [(lp, seqs[i].rollout_logprobs, seqs[i].loss_mask) for i, lp in old.items() if not seqs[i].demo]
    pairs = [(a, b, m) for a, b, m in pairs if len(a) == len(b) and len(a) > 0]
    local = None
    # one rank per data-parallel rank: the TP ranks and the context-parallel ranks all hold the same log-probs
    if policy.dist.is_last_stage and policy.dist.tp_rank == 0 and policy.dist.cp_rank == 0 and pairs:
        with native_torch():  # CPU tensors of this rank's response tokens: no CUDA call, skip the shims' handler
            lt = torch.cat([a for a, _, _ in pairs])[None]
            lr = torch.tensor([x for _, b, _ in pairs for x in b], dtype=torch.float32)[None]
            # multi-turn: observation tokens have no engine log-prob (and carry no loss)
            sampled = torch.tensor([bool(x) for a, _, m in pairs for x in (m or [1] * len(a))])[None]
            if bool(torch.isfinite(lt[sampled]).all()):
                local = {k: float(v) for k, v in token_mismatch(lt, lr, sampled).items()}
    parts = [p for p in all_gather_objects(local) if p is not None]
    if not parts:
        return {}
    n = sum(p["mismatch/tokens"] for p in parts)
    out = {"mismatch/tokens": n}
    for key in parts[0]:
        kind = reduction_of(key)
        if kind == "max":
            out[key] = max(p[key] for p in parts)
        elif kind == "min":
            out[key] = min(p[key] for p in parts)
        elif key != "mismatch/tokens":
            out[key] = sum(p[key] * p["mismatch/tokens"] for p in parts) / max(n, 1)
    return out


def vision_of(policy: PolicySide):
    """A group -> its image inputs (vision-language policies: trainer/batch.py group_vision); None for text-only
    policies."""
    spec = policy.args.vision
    if spec is None or policy.image_processor is None:
        return None
    return lambda g: group_vision(g, policy.image_processor, spec.image_token_id, spec.spatial_merge_size)


def frozen_logits_fn(policy: PolicySide, model):
    """A frozen scorer model's (reference, distillation teacher) logits shard of a micro-batch, forward only, on
    the policy's device (PP = 1: the whole frozen model runs where the policy's logits are)."""

    def fn(mb):
        with torch.no_grad():
            dev = policy.dist.device
            mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)  # packed rows
            return model(mb.tokens.to(dev), mb.position_ids.to(dev), mask, **mb.vision_kwargs(dev))

    return fn


def ref_logits_fn(policy: PolicySide):
    """For the exact reference KL: the reference model's logits shard of a micro-batch (PP = 1)."""
    if policy.ref_model is None or policy.cfg.algorithm.ref_kl.estimator != "exact":
        return None
    return frozen_logits_fn(policy, policy.ref_model)


def teacher_logits_fn(policy: PolicySide):
    """For the full-vocabulary distillation KL: the teacher's logits shard of a micro-batch (PP = 1)."""
    if policy.teacher is None or policy.cfg.algorithm.distill.estimator != "full":
        return None
    return frozen_logits_fn(policy, policy.teacher)
