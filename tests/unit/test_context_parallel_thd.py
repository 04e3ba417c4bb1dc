"""Packed sequences (THD) under context parallelism, the layout logic (pure torch): the cumulative lengths with each
sequence padded to a multiple of 2 x cp, the per-sequence zig-zag partition Transformer Engine's
``thd_get_partitioned_indices`` computes (checked against a hand-worked case, a line-by-line Python transcription
of TE's kernel, and the per-sequence ``zigzag_positions``), and the trainer's THD split of a micro-batch, checked
against the unsplit micro-batch and the [b, s] CP split the CPU path trains with: every loss input follows its
token. The model forward with Transformer Engine is tests/integration/test_context_parallel_thd_gpu.py (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rlvr.megatron.context_parallel import thd_cu_seqlens, thd_partition_indices, zigzag_positions
from megatron_rlvr.trainer.context_split import split_for_context_parallel, split_thd_for_context_parallel
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, unpack_values


def _te_kernel_reference(cu_padded: list[int], total: int, world: int, rank: int) -> list[int]:
    """TE's thd_partition_indices_kernel, token by token in plain Python (binary search over the per-rank
    cumulative lengths, offset rank for the first half of a sequence's local tokens, 2 world - 2 - rank after)."""
    cu = [c // world for c in cu_padded]
    out = []
    for token in range(total // world):
        left, right = 1, len(cu) - 1
        while left < right:
            mid = (left + right) // 2
            if cu[mid] <= token:
                left = mid + 1
            else:
                right = mid
        seq = left - 1
        seq_len = cu[seq + 1] - cu[seq]
        index = token - cu[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu[seq] * world + seq_len // 2 * offset)
    return out


def _zigzag(n: int, cp: int, r: int) -> torch.Tensor:
    return zigzag_positions(n, cp, r) if cp > 1 else torch.arange(n)


def test_thd_partition_hand_worked_case():
    """Lengths 5, 8, 2 at CP = 2 pad to 8, 8, 4 (chunks of 2, 2, 1): rank 0 holds chunks 0 and 3 of each sequence
    ([0, 1, 6, 7], [8, 9, 14, 15], [16, 19]), rank 1 chunks 1 and 2."""
    cu, cu_padded = thd_cu_seqlens([5, 8, 2], 2)
    assert cu.tolist() == [0, 5, 13, 15] and cu_padded.tolist() == [0, 8, 16, 20]
    assert cu.dtype == cu_padded.dtype == torch.int32
    assert thd_partition_indices(cu_padded, 20, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    assert thd_partition_indices(cu_padded, 20, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13, 17, 18]
    assert thd_cu_seqlens([5, 8, 2], 1)[1].tolist() == [0, 5, 13, 15]  # no CP: no padding
    assert thd_cu_seqlens([5, 8, 2], 2, total_multiple=3)[1].tolist() == [0, 8, 16, 24]  # the last one takes it
    with pytest.raises(ValueError, match="not multiples of 2 x cp = 4"):
        thd_partition_indices(torch.tensor([0, 6]), 6, 2, 0)
    with pytest.raises(ValueError, match="context parallel rank 2 of 2"):
        thd_partition_indices(cu_padded, 20, 2, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_partition_is_te_kernel_and_per_sequence_zigzag(cp):
    """For random lengths: each rank's indices equal the TE kernel's (also with tokens past the last sequence), the
    ranks' indices together are a permutation of the packed stream, and within each sequence a rank holds exactly
    the sequence's own zig-zag positions (zigzag_positions of its padded length) offset to its start, in order."""
    rng = random.Random(cp)
    for _ in range(20):
        lengths = [rng.randint(1, 23) for _ in range(rng.randint(1, 6))]
        _, cu_padded = thd_cu_seqlens(lengths, cp)
        total = int(cu_padded[-1])
        parts = [thd_partition_indices(cu_padded, total, cp, r) for r in range(cp)]
        for r, part in enumerate(parts):
            assert part.tolist() == _te_kernel_reference(cu_padded.tolist(), total, cp, r)
            tail = total + 2 * cp * 3  # a buffer longer than the sequences
            assert thd_partition_indices(cu_padded, tail, cp, r).tolist() == _te_kernel_reference(
                cu_padded.tolist(), tail, cp, r
            )
            want = torch.cat(
                [int(cu_padded[i]) + _zigzag(int(cu_padded[i + 1] - cu_padded[i]), cp, r) for i in range(len(lengths))]
            )
            assert torch.equal(part, want)
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(total))


def _seqs():
    g = torch.Generator().manual_seed(3)
    lengths, prompts = [7, 3, 12, 5, 9], [2, 1, 4, 3, 2]
    out = []
    for n, p in zip(lengths, prompts):
        tokens = torch.randint(3, 50, (n,), generator=g).tolist()
        out.append(Sequence(tokens=tokens, prompt_len=p, adv=float(torch.randn((), generator=g))))
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_split_keeps_every_loss_input_with_its_token(cp):
    """The THD split of a micro-batch (one sequence per row): each real (sequence, position) is held by exactly one
    rank; at a held position the rank's model input is the sequence's token, label and in-sequence position; a model
    output that is a function of (token, label, position) read back through ``unpack`` equals the unsplit
    micro-batch's at every held position, and equals what the [b, s] CP split (the CPU path) reads there; the loss
    mask is the global one restricted to the held positions, and the per-sequence loss inputs (advantages, old /
    reference / rollout log-probs) are the micro-batch's unchanged."""
    seqs = _seqs()
    s = 16  # a multiple of 2 x cp for the [b, s] split
    mb = build_microbatch(seqs, len(seqs), s, pad_id=0)
    lengths = [q.length for q in seqs]

    def model(tokens, labels, positions):  # [b, s'] -> a value per model position that identifies its inputs
        return tokens.double() * 1e6 + labels.double() * 1e3 + positions.double()

    whole = unpack_values(model(mb.tokens, mb.labels, mb.position_ids), mb)  # [n, s]
    real = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    held_total = torch.zeros(mb.mask.shape, dtype=torch.long)
    for r in range(cp):
        part = split_thd_for_context_parallel(mb, lengths, cp, r, total_multiple=3)
        total = int(part.cu_seqlens_padded[-1])
        assert part.tokens.shape == part.labels.shape == part.position_ids.shape == (1, total // cp)
        assert total % (3 * 2 * cp if cp > 1 else 3) == 0
        assert part.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert part.attention_mask is None
        assert part.max_seqlen == int((part.cu_seqlens_padded[1:] - part.cu_seqlens_padded[:-1]).max())
        got = unpack_values(model(part.tokens, part.labels, part.position_ids), part)
        assert torch.equal(got[part.held], whole[part.held])
        assert torch.equal(part.mask, mb.mask & part.held)
        for key in ("adv", "old_logp", "rollout_logp", "ref_logp", "seq_ids", "mastered"):
            assert torch.equal(getattr(part, key), getattr(mb, key)), key
        if cp > 1:  # the same values where the [b, s] split holds the same positions
            bs = split_for_context_parallel(mb, cp, r)
            pos = zigzag_positions(s, cp, r)
            via_bs = unpack_values(model(mb.tokens[:, pos], mb.labels[:, pos], mb.position_ids[:, pos]), bs)
            both = part.held & bs.held
            assert torch.equal(got[both], via_bs[both])
        held_total += part.held.long()
    assert torch.equal(held_total[real], torch.ones_like(held_total[real])) and int(held_total[~real].max()) == 0
    with pytest.raises(ValueError, match="lengths"):
        split_thd_for_context_parallel(mb, lengths[:-1], cp, 0)


class _Group:
    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("budget", [None, 24, 40])
def test_trainer_thd_microbatches_and_packed_seq_params(budget):
    """The update's THD plan at CP = 2 (UpdateSettings.thd): every sequence in exactly one micro-batch, each
    micro-batch's padded lengths within ``micro_batch_tokens`` (one sequence each without a budget), split into this
    rank's THD part; the schedule's PackedSeqParams carry its real and padded boundaries and longest padded length;
    a [b, s] micro-batch gets none."""
    from types import SimpleNamespace

    from megatron_rlvr.algorithms import preset
    from megatron_rlvr.megatron.schedule import thd_params
    from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
    from megatron_rlvr.trainer import update
    from megatron_rlvr.trainer.context_split import ContextParallelMicroBatch

    seqs = _seqs()
    for rank in range(2):
        pg = SimpleNamespace(cp=_Group(2, rank), pp=_Group(1), dp=_Group(1), tp=_Group(1))
        ctx = update.UpdateSettings(
            algo=preset("grpo"), spec=None, pg=pg, device=torch.device("cpu"), pad_id=0, micro_batch_tokens=budget,
            seq_multiple=4, n_per_group=5, num_mini_batches=1, ppo_epochs=1,
            correction=MismatchCorrectionConfig(tis_cap=None), skip_nonfinite=False, thd=True,
        )  # fmt: skip
        mbs, members = update._microbatches(ctx, seqs, list(range(len(seqs))))
        assert sorted(i for m in members for i in m) == list(range(len(seqs)))
        for mb, chosen in zip(mbs, members):
            assert isinstance(mb, ContextParallelMicroBatch) and mb.cu_seqlens is not None
            padded = (mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).tolist()
            assert padded == [-(-seqs[i].length // 4) * 4 for i in chosen]
            assert len(chosen) == 1 if budget is None else (sum(padded) <= budget or len(chosen) == 1)
            p = thd_params(mb, torch.device("cpu"))
            assert p.qkv_format == "thd" and torch.equal(p.cu_seqlens_q, mb.cu_seqlens)
            assert torch.equal(p.cu_seqlens_kv_padded, mb.cu_seqlens_padded) and p.max_seqlen_q == max(padded)
            assert p.cu_seqlens_q.dtype == torch.int32
    assert thd_params(build_microbatch(seqs, len(seqs), 16, pad_id=0), torch.device("cpu")) is None
