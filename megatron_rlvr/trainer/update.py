"""The training half of a step: behaviour / reference log-probs (forward only) and the policy update (mini-batches
x epochs of megatron forward/backward, then megatron's optimizer step with gradient clipping). The update reads a
``TrainBatch`` and returns an ``UpdateResult``; it never changes its inputs.

Data parallelism: every rank holds the global batch of sequences; mini-batch ``m`` is the groups
``shard_range(G, m, M)`` and data-parallel rank ``d`` trains on ``shard_range`` ``d`` of that mini-batch's sequences.
The loss normalisers of a mini-batch are computed from ALL its sequences (every rank can, it has them all), so they
are global without a collective.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_rlvr.algorithms import AlgorithmConfig, LossNormalizers
from megatron_rlvr.algorithms.aggregation import normalizer_counts_from_lengths
from megatron_rlvr.data import shard_range
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.megatron.optimizer_step import apply_gradients, zero_grads
from megatron_rlvr.megatron.parallel import all_gather_objects, all_reduce_max
from megatron_rlvr.megatron.router_loss import expert_bias_metrics, reset_router_loss_tracker, router_loss_metrics
from megatron_rlvr.megatron.schedule import run_microbatches
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.trainer.batch import TrainBatch
from megatron_rlvr.trainer.context_split import split_for_context_parallel, split_thd_for_context_parallel
from megatron_rlvr.trainer.loss_metrics import LossMetrics
from megatron_rlvr.trainer.microbatch import MicroBatch, Sequence, build_microbatch, pack, pack_packed, response_values
from megatron_rlvr.trainer.token_loss import StatsSpec, logprob_fn, policy_loss_fn


@dataclass(frozen=True)
class UpdateSettings:
    """What the update and the log-prob passes need from the run config and the layout (built once by setup)."""

    algo: AlgorithmConfig
    spec: StatsSpec
    pg: object
    device: torch.device
    pad_id: int
    micro_batch_tokens: int | None
    seq_multiple: int
    """Pad sequence lengths to a multiple of this (TP size under sequence parallelism, times 2 x CP with context
    parallelism)."""
    n_per_group: int
    num_mini_batches: int
    ppo_epochs: int
    correction: MismatchCorrectionConfig
    """Train/inference mismatch correction (truncated IS) applied to the policy-gradient term."""
    skip_nonfinite: bool
    pack_rows: bool = False
    """Several sequences per micro-batch row (block-diagonal attention; ``train.pack_sequences`` where the model's
    attention takes such a mask). Needs ``micro_batch_tokens``."""
    routing: object | None = None
    """The policy's megatron.routing.RoutingReplay (``train.routing_replay`` r2 or r3), else None."""
    thd: bool = False
    """Context parallelism with Transformer Engine's attention and ``train.pack_sequences``: each micro-batch's
    sequences are packed end to end (THD, trainer.context_split.split_thd_for_context_parallel) instead of rows."""
    thd_multiple: int = 1
    """THD: the packed stream is a multiple of this x 2 x cp (TP under sequence parallelism)."""


@dataclass(frozen=True)
class UpdateResult:
    """What the policy update hands back."""

    metrics: dict[str, float]
    """Loss metrics merged over micro-batches and ranks, update counters, mean gradient norm."""
    first_forward_logprobs: dict[int, torch.Tensor]
    """Behaviour log-probs [R] the first update's forward gave (TrainBatch.old_from_first_forward), by sequence."""
    first_forward_nonfinite: float
    """1.0 when those log-probs were non-finite on this rank."""


def _microbatches(ctx: UpdateSettings, seqs, ids: list[int], old=None, ref=None, correct: bool = False, teacher=None):
    """Micro-batches of ``ids`` (indices into ``seqs``); a fully masked dummy micro-batch when ``ids`` is empty so
    every rank still enters the collective schedule."""
    cp = ctx.pg.cp.size()
    if not ids:
        dummy = Sequence(tokens=[ctx.pad_id, ctx.pad_id], prompt_len=2, train=False)
        s = max(2, ctx.seq_multiple)
        mbs = [build_microbatch([dummy], 1, s, ctx.pad_id)]
        if ctx.thd:
            return [split_thd_for_context_parallel(mbs[0], [2], cp, ctx.pg.cp.rank(), ctx.thd_multiple)], [[]]
        return ([split_for_context_parallel(mbs[0], cp, ctx.pg.cp.rank())] if cp > 1 else mbs), [[]]
    mbs: list[MicroBatch] = []
    members = []
    for chosen, b, s, rows in _plan(ctx, seqs, ids):
        mbs.append(
            build_microbatch(
                [seqs[i] for i in chosen],
                b,
                s,
                ctx.pad_id,
                old_logp=None if old is None else [old.get(i) for i in chosen],
                ref_logp=None if ref is None else [ref.get(i) for i in chosen],
                ids=chosen,
                correction=ctx.correction if correct else None,
                rows=rows,
                teacher_logp=None if teacher is None else [teacher.get(i) for i in chosen],
            )
        )
        members.append(chosen)
    if ctx.thd:  # packed sequences, each split into its own zig-zag chunks (trainer.context_split)
        rank = ctx.pg.cp.rank()
        return [
            split_thd_for_context_parallel(mb, [seqs[i].length for i in chosen], cp, rank, ctx.thd_multiple)
            for mb, chosen in zip(mbs, members)
        ], members
    if cp > 1:  # this context-parallel rank's part of each (trainer.context_split)
        mbs = [split_for_context_parallel(mb, cp, ctx.pg.cp.rank()) for mb in mbs]
    return mbs, members


def _plan(ctx: UpdateSettings, seqs, ids: list[int]):
    """Per micro-batch: (its sequence ids, b, s, rows), where rows (packed rows only, else None) are the positions in
    that id list of each model row's sequences."""
    uniform = ctx.pg.pp.size() > 1
    lengths = [seqs[i].length for i in ids]
    if ctx.thd:
        yield from _plan_thd(ctx, lengths, ids)
        return
    if not (ctx.pack_rows and ctx.micro_batch_tokens is not None):
        for local_idx, b, s in pack(lengths, ctx.micro_batch_tokens, uniform, ctx.seq_multiple):
            yield [ids[j] for j in local_idx], b, s, None
        return
    for rows, b, s in pack_packed(lengths, ctx.micro_batch_tokens, uniform, ctx.seq_multiple):
        chosen = [ids[j] for row in rows for j in row]
        position = iter(range(len(chosen)))
        yield chosen, b, s, [[next(position) for _ in row] for row in rows]


def _plan_thd(ctx: UpdateSettings, lengths: list[int], ids: list[int]):
    """Packed-sequence (THD) micro-batches: the longest sequences first, each micro-batch filled while its sequences'
    lengths padded to the 2 x cp multiple fit ``micro_batch_tokens`` (None: one sequence each); (ids, n, s, None)
    with s the longest padded length (the loss inputs' [n, s] layout)."""
    m = ctx.seq_multiple

    def padded(n: int) -> int:
        return -(-n // m) * m

    order = sorted(range(len(ids)), key=lambda j: -lengths[j])
    budget = ctx.micro_batch_tokens
    group: list[int] = []
    used = 0
    for j in order:
        if group and (budget is None or used + padded(lengths[j]) > budget):
            yield [ids[k] for k in group], len(group), padded(lengths[group[0]]), None
            group, used = [], 0
        group.append(j)
        used += padded(lengths[j])
    if group:
        yield [ids[k] for k in group], len(group), padded(lengths[group[0]]), None


def my_sequence_ids(ctx: UpdateSettings, num_seqs: int, mini_batch: int | None = None) -> list[int]:
    """This data-parallel rank's sequence indices of the whole step (mini_batch None) or of one mini-batch."""
    G = num_seqs // ctx.n_per_group
    dp, d = ctx.pg.dp.size(), ctx.pg.dp.rank()
    if mini_batch is None:
        out = []
        for m in range(ctx.num_mini_batches):
            out.extend(my_sequence_ids(ctx, num_seqs, m))
        return out
    groups = shard_range(G, mini_batch, ctx.num_mini_batches)
    seq_ids = list(range(groups.start * ctx.n_per_group, groups.stop * ctx.n_per_group))
    return [seq_ids[i] for i in shard_range(len(seq_ids), d, dp)]


@torch.no_grad()
def compute_logprobs(
    ctx: UpdateSettings, model, seqs, ids: list[int], with_entropy: bool = False, routes=None, route_weights=None
):
    """Per-sequence response log-probs (and entropies) of ``model`` for ``ids``: ({id: [R]}, {id: [R]}, nonfinite).

    Only the last pipeline stage gets values (the others return empty dicts); that is where the loss needs them.
    ``routes`` (a dict, with ``ctx.routing``): R2, the forward records each sequence's MoE routes into it; R3, the
    forward replays the engine's routes it holds (a behaviour forward); ``route_weights`` (R3, by sequence like
    ``routes``): the engine's gate weights of those routes are replayed too.
    """
    mbs, members = _microbatches(ctx, seqs, ids)
    record = ctx.routing is not None and ctx.routing.mode == "r2"
    with _routing(ctx, routes, seqs, record=record, phase="behaviour", weights=route_weights) as routing:
        infos = run_microbatches(
            model,
            mbs,
            logprob_fn(ctx.spec, with_entropy),
            pg=ctx.pg,
            forward_only=True,
            device=ctx.device,
            routing=routing,
        )
    logp: dict[int, torch.Tensor] = {}
    ent: dict[int, torch.Tensor] = {}
    nonfinite = 0.0
    for out, chosen in zip(infos, members):
        nonfinite = max(nonfinite, float(out.nonfinite))
        sel = [seqs[i] for i in chosen]
        logp.update(zip(chosen, response_values(out.logp_BT, sel)))
        if with_entropy:
            ent.update(zip(chosen, response_values(out.entropy_BT, sel)))
    return logp, ent, nonfinite


def _routing(ctx: UpdateSettings, routes, seqs, record: bool, phase: str = "update", weights=None):
    """A routing-replay session recording into / replaying from ``routes`` (a null context without replay);
    ``phase``: whether a replaying forward is a behaviour forward or a later update forward (counted apart);
    ``weights``: R3's engine gate weights, replayed with the routes (None: the router's own probabilities)."""
    if ctx.routing is None or routes is None:
        return contextlib.nullcontext()
    if record:
        return ctx.routing.recording(routes, seqs)
    return ctx.routing.replaying(routes, seqs, phase, weights=weights)


def normalizer_counts(seqs) -> torch.Tensor:
    """[3] float64 (trained response tokens, non-empty trained sequences, of which mastered) of the trained
    sequences, from their loss-token counts (algorithms.aggregation.normalizer_counts_from_lengths: no per-sequence
    masks; multi-turn observation tokens are not counted)."""
    trained = [q for q in seqs if q.train]
    with native_torch():  # tiny CPU tensors: skip the CPU shims' per-call handler
        lengths = torch.tensor([q.loss_tokens for q in trained], dtype=torch.long)
        mastered = torch.tensor([bool(q.mastered) for q in trained], dtype=torch.bool)
        return normalizer_counts_from_lengths(lengths, mastered)


def recompute_ids(ctx: UpdateSettings, num_seqs: int, old_from_forward: bool) -> list[int]:
    """This rank's sequences whose behaviour log-probs need a recompute pass before the update: all of them, or,
    with ``old_from_forward``, all but the first mini-batch's (the first update's forward gives those)."""
    ids = my_sequence_ids(ctx, num_seqs)
    if not old_from_forward:
        return ids
    first = set(my_sequence_ids(ctx, num_seqs, 0))
    return [i for i in ids if i not in first]


def policy_update(
    ctx: UpdateSettings, ddp_model, optimizer, batch: TrainBatch, ref_logits_fn=None, teacher_logits_fn=None
) -> UpdateResult:
    """All mini-batch updates of one step; returns merged (over ranks) loss metrics and update counters.

    ``ref_logits_fn`` / ``teacher_logits_fn`` (mb -> logits shard): the frozen reference / distillation teacher's
    logits of a micro-batch, for the exact reference KL / the full-vocabulary distillation KL.

    ``batch.old_from_first_forward``: ``batch.old_logprobs`` lacks the first mini-batch's sequences. Before the
    first optimizer step the policy IS the behaviour policy, so the first mini-batch of the first epoch takes its
    old log-probs from its own forward, detached (exact: the first update's ratio is 1; a separate no-grad
    recompute agrees only to float noise, ~5e-7 on CPU); later epochs and the mismatch metrics use them from the
    result's ``first_forward_logprobs``.
    """
    seqs = batch.sequences
    old = dict(batch.old_logprobs)  # this update's own copy: the batch stays as it was handed over
    routes = None if batch.routes is None else dict(batch.routes)  # R2: the fused first forward records its own
    r2 = ctx.routing is not None and ctx.routing.mode == "r2"
    ref = batch.ref_logprobs
    acc = LossMetrics()
    updates = skipped = 0
    grad_norms = []
    first: dict[int, torch.Tensor] = {}
    first_bad = 0.0
    G = len(seqs) // ctx.n_per_group
    forwards = 0  # training forwards on this rank: the router loss terms are averaged over them
    reset_router_loss_tracker()
    for epoch in range(ctx.ppo_epochs):
        for m in range(ctx.num_mini_batches):
            groups = shard_range(G, m, ctx.num_mini_batches)
            mb_seqs = range(groups.start * ctx.n_per_group, groups.stop * ctx.n_per_group)
            if not any(seqs[i].train for i in mb_seqs):
                continue  # nothing to learn from (identical on every rank: all hold the batch)
            norms = LossNormalizers.from_counts(normalizer_counts([seqs[i] for i in mb_seqs]))
            ids = my_sequence_ids(ctx, len(seqs), m)
            fused = batch.old_from_first_forward and epoch == 0 and m == 0
            mbs, members = _microbatches(
                ctx, seqs, ids, None if fused else old, ref, correct=not fused, teacher=batch.teacher_logprobs
            )
            loss_fn = policy_loss_fn(
                ctx.algo,
                norms,
                ctx.spec,
                ref_logits_fn,
                old_from_forward=fused,
                correction=ctx.correction,
                teacher_logits_fn=teacher_logits_fn,
            )
            zero_grads(ddp_model, optimizer)
            phase = "behaviour" if fused else "update"  # the fused forward IS the behaviour forward
            with _routing(ctx, routes, seqs, record=fused and r2, phase=phase, weights=batch.route_weights) as routing:
                infos = run_microbatches(
                    ddp_model, mbs, loss_fn, pg=ctx.pg, forward_only=False, device=ctx.device, routing=routing
                )
            forwards += len(mbs)
            for out, chosen in zip(infos, members):
                if fused:
                    first.update(zip(chosen, response_values(out.first_forward_logp_BT, [seqs[i] for i in chosen])))
                    first_bad = max(first_bad, out.metrics.get("train/nonfinite", 0.0))
                acc.add(out.metrics)
            if fused:
                old.update(first)
            local_bad = max([out.metrics.get("train/nonfinite", 0.0) for out in infos] + [0.0]) > 0
            outcome = apply_gradients(ddp_model, optimizer, local_nonfinite=local_bad, all_reduce_max=all_reduce_max)
            if outcome.nonfinite and not ctx.skip_nonfinite:
                raise FloatingPointError("non-finite logits, loss or gradients (train.skip_nonfinite=false)")
            if not outcome.applied:
                skipped += 1
                continue
            updates += 1
            if outcome.grad_norm is not None:
                grad_norms.append(outcome.grad_norm)
    contributor = ctx.pg.pp.rank() == ctx.pg.pp.size() - 1 and ctx.pg.tp.rank() == 0
    states = all_gather_objects(acc.state() if contributor else None)
    out = LossMetrics.merge([s for s in states if s is not None], max(updates + skipped, 1))
    out["train/updates"] = float(updates)
    out["train/skipped_nonfinite"] = float(skipped)
    if grad_norms:
        out["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if ctx.routing is not None:
        out.update(ctx.routing.metrics())
    out.update(router_loss_metrics(ddp_model, forwards, ctx.pg))  # load balancing / z-loss: in the gradient only
    out.update(expert_bias_metrics(ddp_model, ctx.pg))  # aux-loss-free routers: their bias and load imbalance
    return UpdateResult(metrics=out, first_forward_logprobs=first, first_forward_nonfinite=first_bad)
