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

from megatron_rlvr.megatron.context_parallel import zigzag_positions
from megatron_rlvr.trainer.microbatch import MicroBatch


@dataclass(frozen=True)
class ContextParallelMicroBatch(MicroBatch):
    """A :class:`MicroBatch` as one CP rank sees it: model inputs [b, s / cp], loss inputs [n, s] (module docstring)."""

    held: torch.Tensor | None = None
    """[n, s] bool: the (sequence, position) pairs whose model position this rank holds; the ranks' ``held`` are
    disjoint and together cover every real position."""
    cp_size: int = 1
    """Context-parallel ranks the micro-batch is split over."""


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
