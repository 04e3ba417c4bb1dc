"""A micro-batch split over context-parallel (CP) ranks (pure torch; the layout is megatron's, see
megatron_rlvr.megatron.context_parallel).

The MODEL inputs [b, s] (tokens, labels, positions) are sliced to this rank's two zig-zag chunks, [b, s / cp]; a
packed row's block-diagonal attention mask [b, 1, s, s] keeps its key columns in global order and loses the query
rows of the other ranks, [b, 1, s / cp, s] (the CP attention re-orders the columns to its gathered keys).

The LOSS inputs stay in the one-sequence-per-row layout [n, s] of the whole micro-batch (advantages, old / reference /
rollout log-probs, importance weights: per-position values with no vocabulary dimension, so cheap), and
``unpack`` maps each (sequence, position) to its place in this rank's model output [b * s / cp]. The positions this
rank does not hold are out of ``mask`` (and of ``held``): every per-token term is then computed where the logits are,
and each sum over a sequence is this rank's part of it, which the loss completes over the CP group
(PolicyLossInputs.seq_sum). Packed and unpacked micro-batches split the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_rlvr.megatron.context_parallel import thd_cu_seqlens, thd_partition_indices, zigzag_positions
from megatron_rlvr.trainer.microbatch import MicroBatch


@dataclass(frozen=True)
class ContextParallelMicroBatch(MicroBatch):
    """A :class:`MicroBatch` as one CP rank sees it: model inputs [b, s / cp], loss inputs [n, s] (module docstring)."""

    held: torch.Tensor | None = None
    """[n, s] bool: the (sequence, position) pairs whose model position this rank holds; the ranks' ``held`` are
    disjoint and together cover every real position."""
    cp_size: int = 1
    """Context-parallel ranks the micro-batch is split over."""
    cu_seqlens: torch.Tensor | None = None
    """[n + 1] int32: packed sequences (THD, :func:`split_thd_for_context_parallel`): cumulative real lengths of the
    sequences laid end to end (None: [b, s] rows)."""
    cu_seqlens_padded: torch.Tensor | None = None
    """[n + 1] int32: THD: cumulative lengths with each sequence padded to a multiple of 2 x cp."""
    max_seqlen: int = 0
    """THD: the longest padded sequence."""


def split_for_context_parallel(mb: MicroBatch, cp_size: int, cp_rank: int) -> ContextParallelMicroBatch:
    """This CP rank's part of ``mb`` (whose length s must be a multiple of 2 x cp_size)."""
    if mb.pixel_values is not None or mb.position_ids.dim() != 2:
        raise ValueError("context parallelism does not split micro-batches with images (M-RoPE positions)")
    b, s = mb.tokens.shape
    pos = zigzag_positions(s, cp_size, cp_rank)  # [s / cp]
    s_local = pos.numel()
    # local flat position of every global flat position of the model rows, -1 where another rank holds it
    lut = torch.full((b, s), -1, dtype=torch.long)
    lut[:, pos] = torch.arange(b * s_local, dtype=torch.long).view(b, s_local)
    lut = lut.view(-1)
    unpack = mb.unpack if mb.unpack is not None else torch.arange(b * s, dtype=torch.long).view(b, s)
    local = lut[unpack]  # [n, s]
    held = local >= 0
    mask = mb.attention_mask
    return ContextParallelMicroBatch(
        **{f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
        | dict(
            tokens=mb.tokens[:, pos].contiguous(),
            labels=mb.labels[:, pos].contiguous(),
            position_ids=mb.position_ids[:, pos].contiguous(),
            attention_mask=None if mask is None else mask[:, :, pos, :].contiguous(),
            mask=mb.mask & held,
            unpack=local.clamp_min(0),
        ),
        held=held,
        cp_size=cp_size,
    )


def split_thd_for_context_parallel(
    mb: MicroBatch, lengths: list[int], cp_size: int, cp_rank: int, total_multiple: int = 1
) -> ContextParallelMicroBatch:
    """This CP rank's part of ``mb`` (one sequence per row, [n, s], row i holding ``lengths[i]`` real tokens) as
    packed sequences (THD) for Transformer Engine's attention: the rows' real tokens laid end to end, each sequence
    padded to a multiple of 2 x cp_size (``thd_cu_seqlens``), and every sequence split into its own 2 x cp zig-zag
    chunks (``thd_partition_indices``, TE's ``thd_get_partitioned_indices``). Model inputs become [1, T / cp]
    (tokens, labels, positions within each sequence; no attention mask: ``cu_seqlens`` separate the sequences);
    the loss inputs stay [n, s] and ``unpack`` / ``held`` map each (sequence, position) to this rank's model output,
    exactly as :func:`split_for_context_parallel`, so advantages, old / reference / rollout log-probs and masks
    follow the tokens. Work per rank is balanced per sequence, and no attention is spent on padding beyond 2 x cp - 1
    tokens per sequence. ``total_multiple``: the stream is padded to a multiple of it x 2 x cp (TP under sequence
    parallelism)."""
    if mb.pixel_values is not None or mb.position_ids.dim() != 2:
        raise ValueError("context parallelism does not split micro-batches with images (M-RoPE positions)")
    if mb.unpack is not None or mb.attention_mask is not None:
        raise ValueError("split_thd_for_context_parallel takes one sequence per row (not packed rows)")
    n, s = mb.tokens.shape
    if len(lengths) != n or any(not 1 <= L <= s for L in lengths):
        raise ValueError(f"split_thd_for_context_parallel: lengths {lengths} for {n} rows of {s}")
    cu, cu_padded = thd_cu_seqlens(lengths, cp_size, total_multiple)
    total = int(cu_padded[-1])
    starts = cu_padded[:-1].to(torch.long)
    # packed index of every (sequence, position), -1 for positions past the sequence's real length
    pos = torch.arange(s, dtype=torch.long)
    real = pos[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]  # [n, s]
    packed_of = torch.where(real, starts[:, None] + pos[None, :], torch.full((n, s), -1, dtype=torch.long))
    # the packed stream: each sequence's tokens, then its padding (token 0, label 0, positions running on)
    seq_of = torch.repeat_interleave(torch.arange(n), (cu_padded[1:] - cu_padded[:-1]).to(torch.long))
    within = torch.arange(total, dtype=torch.long) - starts[seq_of]
    row_pos = within.clamp_max(s - 1)
    pad = within >= torch.tensor(lengths, dtype=torch.long)[seq_of]
    index = thd_partition_indices(cu_padded, total, cp_size, cp_rank)  # [T / cp]
    local_of = torch.full((total,), -1, dtype=torch.long)
    local_of[index] = torch.arange(index.numel(), dtype=torch.long)

    def stream(x_ns: torch.Tensor) -> torch.Tensor:  # [n, s] row values -> [1, T / cp] of this rank
        flat = torch.where(pad, torch.zeros((), dtype=x_ns.dtype), x_ns[seq_of, row_pos])
        return flat[index][None].contiguous()

    local = torch.where(packed_of >= 0, local_of[packed_of.clamp_min(0)], torch.full_like(packed_of, -1))
    held = local >= 0
    return ContextParallelMicroBatch(
        **{f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
        | dict(
            tokens=stream(mb.tokens),
            labels=stream(mb.labels),
            position_ids=within[index][None].contiguous(),
            attention_mask=None,
            mask=mb.mask & held,
            unpack=local.clamp_min(0),
        ),
        held=held,
        cp_size=cp_size,
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=int((cu_padded[1:] - cu_padded[:-1]).max()),
    )
