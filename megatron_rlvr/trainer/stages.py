"""The stages of one RL step, with typed hand-offs (every rank runs every stage, SPMD):

    rollout(t, step)              -> RolloutBatch   prompts -> samples -> rewards (+ dynamic-sampling refill)
    train_batch(t, rollout)       -> TrainBatch     group advantages; behaviour and reference log-probs
    update(t, batch)              -> UpdateResult   mini-batches x epochs of forward/backward + optimizer steps
    publish_weights(t, updated)   -> metrics        the new policy into the rollout engines

A schedule orders them: ``megatron_rlvr.trainer.colocated`` is the synchronous colocated one (rollout, then
training, then the weight sync, the engines asleep while the trainer runs). The stages hold no schedule state: a
schedule that overlaps rollout with training composes the same functions.
"""

from __future__ import annotations

import time

import torch

from megatron_rlvr.algorithms.reductions import reduction_of
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.megatron.parallel import all_gather_objects
from megatron_rlvr.rollout.groups import generate_groups, sampling_params, tokenize_prompts
from megatron_rlvr.rollout.mismatch import mismatch_metrics as token_mismatch
from megatron_rlvr.trainer.batch import (
    RolloutBatch,
    TrainBatch,
    advantages_and_sequences,
    group_rewards,
    group_vision,
    informative,
)
from megatron_rlvr.trainer.components import Trainer
from megatron_rlvr.trainer.engine_setup import engine_sleeps, wake_all, wake_weights
from megatron_rlvr.trainer.update import UpdateResult, compute_logprobs, my_sequence_ids, policy_update, recompute_ids
from megatron_rlvr.trainer.weights import sync_weights

# ------------------------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------------------------


def rollout(t: Trainer, step: int) -> RolloutBatch:
    """Sample prompts, roll out, score; with dynamic sampling keep informative groups and refill from more prompts
    (at most train.dynamic_sampling_max_rounds rounds)."""
    cfg, need = t.cfg, t.cfg.train.prompts_per_step
    dynamic = t.algo.dapo.dynamic_sampling
    params = sampling_params(cfg.rollout)
    groups, kept, m = [], [], {"data/prompts_too_long": 0.0, "rollout/rounds": 0.0}
    rewards = None
    signals = getattr(t, "signals", None)  # the disaggregated rollout worker has none: the trainer stops it
    should_stop = (lambda: signals.code != 0) if signals is not None else None
    for round_idx in range(cfg.train.dynamic_sampling_max_rounds if dynamic else 1):
        examples = t.loader.next_batch(need)
        examples, ids, too_long = tokenize_prompts(
            examples, t.tokenizer, cfg.data, cfg.rollout.max_prompt_len, t.image_processor
        )
        m["data/prompts_too_long"] += too_long
        new, stats = generate_groups(
            t.engine,
            t.reward_manager,
            t.tokenizer,
            examples,
            ids,
            params,
            t.engine_info,
            seed=cfg.train.seed,
            step=step,
            round_idx=round_idx,
            gather=all_gather_objects,
            reward_max_error_frac=cfg.reward.max_error_frac,
            reward_fn=cfg.reward.fn,
            should_stop=should_stop,
        )
        for k, v in stats.items():
            m[k] = m.get(k, 0.0) + v
        m["rollout/rounds"] += 1
        first = len(groups)
        groups.extend(new)
        if not dynamic:
            kept = list(range(len(groups)))
            break
        if new:
            kept.extend(first + i for i, keep in enumerate(informative(group_rewards(new, t.algo))) if keep)
        if len(kept) >= need:
            break
    kept = kept[:need]
    if groups:
        rewards = group_rewards(groups, t.algo)
    m["rollout/kept_groups"] = float(len(kept))
    m["rollout/kept_frac"] = len(kept) / max(len(groups), 1)
    return RolloutBatch(groups=groups, kept=kept, rewards=rewards, policy_version=t.policy_version, metrics=m)


def train_batch(t: Trainer, rolled: RolloutBatch) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages (once), then this rank's behaviour log-probs (recomputed with the current weights, or the
    engine's) and reference log-probs (when a KL term needs them); returns the batch and the metrics so far."""
    seqs, m = advantages_and_sequences(rolled, t.algo, vision_of(t))
    m = {**rolled.metrics, **m}
    if not any(s.train for s in seqs):
        return TrainBatch(sequences=seqs, policy_version=rolled.policy_version), m
    t0 = time.perf_counter()
    ctx = t.update_settings
    ids = my_sequence_ids(ctx, len(seqs))
    fused = first_forward_gives_old(t)
    routes = None  # routing replay: R2 records the behaviour forward's MoE routes, R3 replays the engine's
    if ctx.routing is not None:
        routes = {} if ctx.routing.mode == "r2" else {i: ctx.routing.engine_routes(seqs[i]) for i in ids}
    if t.cfg.rollout.old_logprobs == "recompute":
        todo = recompute_ids(ctx, len(seqs), fused)
        old, bad = {}, 0.0
        if todo:
            old, _, bad = compute_logprobs(ctx, t.model, seqs, todo, routes=routes)
    else:
        old = {i: torch.tensor(seqs[i].rollout_logprobs, dtype=torch.float32) for i in ids}
        bad = 0.0
    ref = None
    if t.ref_model is not None and t.algo.ref_kl.estimator != "exact":
        ref, _, bad_ref = compute_logprobs(ctx, t.ref_model, seqs, ids)
        bad = max(bad, bad_ref)
    if routes and ctx.routing.mode == "r3" and t.cfg.diagnostics.replay_mismatch:
        # the same behaviour log-probs with the trainer's own routes: what R3 changes in the train/inference mismatch
        plain, _, _ = compute_logprobs(ctx, t.model, seqs, ids)
        m.update({k.replace("mismatch/", "mismatch_noreplay/"): v for k, v in mismatch_metrics(t, seqs, plain).items()})
    m["logprobs/nonfinite"] = bad
    m["time/logprobs_s"] = time.perf_counter() - t0
    batch = TrainBatch(
        sequences=seqs,
        old_logprobs=old,
        ref_logprobs=ref,
        old_from_first_forward=fused,
        policy_version=rolled.policy_version,
        routes=routes,
    )
    return batch, m


def update(t: Trainer, batch: TrainBatch) -> UpdateResult:
    """The policy update of the step (megatron_rlvr.trainer.update)."""
    return policy_update(t.update_settings, t.model, t.optimizer, batch, ref_logits_fn(t))


def publish_weights(t: Trainer, updated: bool) -> dict[str, float]:
    """Wake the engine's weights, stream the policy into it when it changed (or when sleep dropped the engine's
    copy), then wake the KV cache: weights and KV cache are never both allocated during the sync."""
    dropped = engine_sleeps(t.engine) and t.cfg.rollout.sleep_level == 2
    wake_weights(t.engine)
    m = sync_weights(t.engine, t.model, t.args, t.dist.pg) if (updated or dropped) else {}
    wake_all(t.engine)
    return m


# ------------------------------------------------------------------------------------------------------------------
# Helpers of the stages
# ------------------------------------------------------------------------------------------------------------------


def first_forward_gives_old(t: Trainer) -> bool:
    """Recomputed behaviour log-probs of the first mini-batch come from the first update's own forward."""
    return t.cfg.rollout.old_logprobs == "recompute" and t.cfg.train.old_logprobs_from_update


def update_mismatch_metrics(t: Trainer, batch: TrainBatch, result: UpdateResult) -> dict[str, float]:
    """The train/inference mismatch of the recomputed behaviour log-probs, once all of them are known (the first
    mini-batch's come from the update's first forward)."""
    if t.cfg.rollout.old_logprobs != "recompute":
        return {}
    return mismatch_metrics(t, batch.sequences, {**batch.old_logprobs, **result.first_forward_logprobs})


def mismatch_metrics(t: Trainer, seqs, old) -> dict[str, float]:
    """Train/inference mismatch of the behaviour policy (megatron_rlvr.rollout.mismatch definitions) over this
    data-parallel rank's response tokens, combined over ranks (means weighted by tokens)."""
    pairs = [(lp, seqs[i].rollout_logprobs) for i, lp in old.items()]
    pairs = [(a, b) for a, b in pairs if len(a) == len(b) and len(a) > 0]
    local = None
    if t.dist.is_last_stage and t.dist.tp_rank == 0 and pairs:
        with native_torch():  # CPU tensors of this rank's response tokens: no CUDA call, skip the shims' handler
            lt = torch.cat([a for a, _ in pairs])[None]
            lr = torch.tensor([x for _, b in pairs for x in b], dtype=torch.float32)[None]
            if bool(torch.isfinite(lt).all()):
                ones = torch.ones_like(lt, dtype=torch.bool)
                local = {k: float(v) for k, v in token_mismatch(lt, lr, ones).items()}
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


def vision_of(t: Trainer):
    """A group -> its image inputs (vision-language policies: trainer/batch.py group_vision); None for text-only
    policies."""
    spec = t.args.vision
    if spec is None or t.image_processor is None:
        return None
    return lambda g: group_vision(g, t.image_processor, spec.image_token_id, spec.spatial_merge_size)


def ref_logits_fn(t: Trainer):
    """For the exact reference KL: the reference model's logits shard of a micro-batch (PP = 1)."""
    if t.ref_model is None or t.algo.ref_kl.estimator != "exact":
        return None

    def fn(mb):
        with torch.no_grad():
            dev = t.dist.device
            mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)  # packed rows
            return t.ref_model(mb.tokens.to(dev), mb.position_ids.to(dev), mask, **mb.vision_kwargs(dev))

    return fn
