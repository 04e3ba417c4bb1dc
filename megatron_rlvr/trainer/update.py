"""The training half of a step: behaviour / reference log-probs (forward only) and the policy update (mini-batches
x epochs of megatron forward/backward, then megatron's optimizer step with gradient clipping).

Data parallelism: every rank holds the global batch of sequences; mini-batch ``m`` is the groups
``shard_range(G, m, M)`` and data-parallel rank ``d`` trains on ``shard_range`` ``d`` of that mini-batch's sequences.
The loss normalisers of a mini-batch are computed from ALL its sequences (every rank can, it has them all), so they
are global without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlvr.algorithms import AlgorithmConfig, LossNormalizers
from megatron_rlvr.data import shard_range
from megatron_rlvr.megatron.parallel import all_reduce_max
from megatron_rlvr.megatron.schedule import run_microbatches
from megatron_rlvr.trainer.loss_metrics import LossMetrics
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, pack, pack_packed, response_values
from megatron_rlvr.trainer.token_loss import StatsSpec, logprob_fn, policy_loss_fn


@dataclass
class UpdateContext:
    """What the update needs from the trainer (no globals)."""

    algo: AlgorithmConfig
    spec: StatsSpec
    pg: object
    device: torch.device
    pad_id: int
    micro_batch_tokens: int | None
    seq_multiple: int
    """Pad sequence lengths to a multiple of this (TP size under sequence parallelism)."""
    n_per_group: int
    num_mini_batches: int
    ppo_epochs: int
    tis_cap: float | None
    skip_nonfinite: bool
    pack_rows: bool = False
    """Several sequences per micro-batch row (block-diagonal attention; ``train.pack_sequences`` where the model's
    attention takes such a mask). Needs ``micro_batch_tokens``."""


def _microbatches(ctx: UpdateContext, seqs: list[Sequence], ids: list[int], old=None, ref=None, with_tis=False):
    """Micro-batches of ``ids`` (indices into ``seqs``); a fully masked dummy micro-batch when ``ids`` is empty so
    every rank still enters the collective schedule."""
    if not ids:
        dummy = Sequence(tokens=[ctx.pad_id, ctx.pad_id], prompt_len=2, train=False)
        s = max(2, ctx.seq_multiple)
        return [build_microbatch([dummy], 1, s, ctx.pad_id)], [[]]
    mbs, members = [], []
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
                tis_cap=ctx.tis_cap if with_tis else None,
                rows=rows,
            )
        )
        members.append(chosen)
    return mbs, members


def _plan(ctx: UpdateContext, seqs: list[Sequence], ids: list[int]):
    """Per micro-batch: (its sequence ids, b, s, rows), where rows (packed rows only, else None) are the positions in
    that id list of each model row's sequences."""
    uniform = ctx.pg.pp.size() > 1
    lengths = [seqs[i].length for i in ids]
    if not (ctx.pack_rows and ctx.micro_batch_tokens is not None):
        for local_idx, b, s in pack(lengths, ctx.micro_batch_tokens, uniform, ctx.seq_multiple):
            yield [ids[j] for j in local_idx], b, s, None
        return
    for rows, b, s in pack_packed(lengths, ctx.micro_batch_tokens, uniform, ctx.seq_multiple):
        chosen = [ids[j] for row in rows for j in row]
        position = iter(range(len(chosen)))
        yield chosen, b, s, [[next(position) for _ in row] for row in rows]


def my_sequence_ids(ctx: UpdateContext, num_seqs: int, mini_batch: int | None = None) -> list[int]:
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
def compute_logprobs(ctx: UpdateContext, model, seqs: list[Sequence], ids: list[int], with_entropy: bool = False):
    """Per-sequence response log-probs (and entropies) of ``model`` for ``ids``: ({id: [R]}, {id: [R]}, nonfinite).

    Only the last pipeline stage gets values (the others return empty dicts); that is where the loss needs them.
    """
    mbs, members = _microbatches(ctx, seqs, ids)
    infos = run_microbatches(
        model, mbs, logprob_fn(ctx.spec, with_entropy), pg=ctx.pg, forward_only=True, device=ctx.device
    )
    logp: dict[int, torch.Tensor] = {}
    ent: dict[int, torch.Tensor] = {}
    nonfinite = 0.0
    for info, chosen in zip(infos, members):
        nonfinite = max(nonfinite, info["nonfinite"])
        sel = [seqs[i] for i in chosen]
        for i, v in zip(chosen, response_values(info["logp"], sel)):
            logp[i] = v
        if with_entropy:
            for i, v in zip(chosen, response_values(info["entropy"], sel)):
                ent[i] = v
    return logp, ent, nonfinite


def normalizer_counts(seqs: list[Sequence]) -> torch.Tensor:
    """[3] float64 (trained response tokens, non-empty trained sequences, of which mastered): what
    ``local_normalizer_counts`` gives for the sequences' loss masks, counted from their lengths (no per-sequence
    tensors; tests/test_trainer_units.py checks the two agree)."""
    tokens = nonempty = mastered = 0
    for q in seqs:
        if q.train and q.response_len > 0:
            tokens += q.response_len
            nonempty += 1
            mastered += bool(q.mastered)
    return torch.tensor([tokens, nonempty, mastered], dtype=torch.float64)


def _grads_finite(model) -> bool:
    """Whether every gradient is finite, in one cheap pass: a sum is finite iff its terms are, unless finite terms
    overflow it, and only a non-finite sum has each element tested (exact either way; a per-element test of every
    gradient cost ~20x the sums on CPU). The sums run over megatron DDP's flat gradient buffers (every
    ``main_grad`` is a view into them) or, without them, over each gradient."""
    ddp_buffers = [getattr(model, k, None) for k in ("buffers", "expert_parallel_buffers")]  # DDP's, not nn.Module's
    flats = [b.grad_data for bufs in ddp_buffers if isinstance(bufs, list) for b in bufs]
    if not flats:
        for p in model.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                flats.append(g)
    if not flats:
        return True
    sums = torch.stack([f.sum() for f in flats])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(f).all()) for f in flats)  # an inf / NaN, or finite values overflowing a sum


def recompute_ids(ctx: UpdateContext, num_seqs: int, old_from_forward: bool) -> list[int]:
    """This rank's sequences whose behaviour log-probs need a recompute pass before the update: all of them, or,
    with ``old_from_forward``, all but the first mini-batch's (the first update's forward gives those)."""
    ids = my_sequence_ids(ctx, num_seqs)
    if not old_from_forward:
        return ids
    first = set(my_sequence_ids(ctx, num_seqs, 0))
    return [i for i in ids if i not in first]


def policy_update(
    ctx: UpdateContext, ddp_model, optimizer, seqs, old, ref, ref_logits_fn=None, *, old_from_forward: bool = False
) -> dict[str, float]:
    """All mini-batch updates of one step; returns merged (over ranks) loss metrics and update counters.

    ``old_from_forward``: ``old`` (a dict, recomputed log-probs) lacks the first mini-batch's sequences. Before the
    first optimizer step the policy IS the behaviour policy, so the first mini-batch of the first epoch takes its
    old log-probs from its own forward, detached (exact: the first update's ratio is 1; a separate no-grad
    recompute agrees only to float noise, ~5e-7 on CPU), and stores them into ``old`` (in place) for later epochs
    and the mismatch metrics;
    ``logprobs/nonfinite_update`` then says whether those log-probs were finite on this rank.
    """
    acc = LossMetrics()
    updates = skipped = 0
    grad_norms = []
    fused_bad = 0.0
    G = len(seqs) // ctx.n_per_group
    for _epoch in range(ctx.ppo_epochs):
        for m in range(ctx.num_mini_batches):
            groups = shard_range(G, m, ctx.num_mini_batches)
            mb_seqs = range(groups.start * ctx.n_per_group, groups.stop * ctx.n_per_group)
            if not any(seqs[i].train for i in mb_seqs):
                continue  # nothing to learn from (identical on every rank: all hold the batch)
            norms = LossNormalizers.from_counts(normalizer_counts([seqs[i] for i in mb_seqs]))
            ids = my_sequence_ids(ctx, len(seqs), m)
            fused = old_from_forward and _epoch == 0 and m == 0
            with_tis = ctx.tis_cap is not None and not fused
            mbs, members = _microbatches(ctx, seqs, ids, None if fused else old, ref, with_tis=with_tis)
            loss_fn = policy_loss_fn(
                ctx.algo,
                norms,
                ctx.spec,
                ref_logits_fn,
                old_from_forward=fused,
                tis_cap=ctx.tis_cap if fused else None,
            )
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            infos = run_microbatches(ddp_model, mbs, loss_fn, pg=ctx.pg, forward_only=False, device=ctx.device)
            for info, chosen in zip(infos, members):
                if fused:
                    for i, v in zip(chosen, response_values(info.pop("logp"), [seqs[i] for i in chosen])):
                        old[i] = v
                    fused_bad = max(fused_bad, info.get("train/nonfinite", 0.0))
                acc.add(info)
            local_bad = max([info.get("train/nonfinite", 0.0) for info in infos] + [0.0])
            local_bad = max(local_bad, 0.0 if _grads_finite(ddp_model) else 1.0)
            if all_reduce_max(local_bad) > 0:
                if not ctx.skip_nonfinite:
                    raise FloatingPointError("non-finite logits, loss or gradients (train.skip_nonfinite=false)")
                skipped += 1
                ddp_model.zero_grad_buffer()
                optimizer.zero_grad()
                continue
            ok, grad_norm, _ = optimizer.step()
            if not ok:
                skipped += 1
                continue
            updates += 1
            if grad_norm is not None:
                grad_norms.append(float(grad_norm))
    contributor = ctx.pg.pp.rank() == ctx.pg.pp.size() - 1 and ctx.pg.tp.rank() == 0
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, acc.state() if contributor else None)
    out = LossMetrics.merge([s for s in states if s is not None], max(updates + skipped, 1))
    out["train/updates"] = float(updates)
    out["train/skipped_nonfinite"] = float(skipped)
    if grad_norms:
        out["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if old_from_forward:
        out["logprobs/nonfinite_update"] = fused_bad
    return out
