"""Context parallelism (CP): where a rank's tokens sit in a sequence, the per-sequence sum completed over the CP
group, and an exact core attention for CP without Transformer Engine (CPU).

Layout (megatron's load-balanced split, ``megatron.core.utils.get_batch_on_this_cp_rank``, and the slice its rotary
embedding takes, ``rope_utils.get_pos_emb_on_this_cp_rank``): a padded length S is cut into 2 x cp chunks of
S / (2 cp) tokens and CP rank r holds chunks r and 2cp - 1 - r, in that order. Under a causal mask the early chunk is
cheap and the late one expensive, so every rank does the same attention work.

The attention (:func:`cp_core_attention`) all-gathers keys and values over the CP group: megatron's sequence
gather (``gather_from_sequence_parallel_region``), whose backward reduce-scatters, i.e. sums every rank's queries'
gradients of a key back to the rank that holds the key. Scores are then [b, heads, S/cp, S] per rank, 1/cp of the
full matrix: exact, and fine for CPU runs; on GPUs Transformer Engine's ring / all-to-all attention
(``parallel.cp_comm_type``) is used instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[seq_len / cp_size] long: the global positions of the tokens CP rank ``cp_rank`` holds of a sequence of
    ``seq_len`` (a multiple of 2 x cp_size): chunk cp_rank, then chunk 2 cp_size - 1 - cp_rank."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel rank {cp_rank} of {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x cp = {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def gathered_positions(seq_len: int, cp_size: int) -> torch.Tensor:
    """[seq_len] long: the global positions of a sequence all-gathered over the CP group along the sequence (rank 0's
    tokens, then rank 1's, ...)."""
    return torch.cat([zigzag_positions(seq_len, cp_size, r) for r in range(cp_size)])


def thd_cu_seqlens(lengths: list[int], cp_size: int, total_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens, cu_seqlens_padded), each [n + 1] int32: the cumulative real lengths of ``n`` sequences packed
    end to end (THD), and the cumulative lengths with every sequence padded to a multiple of 2 x cp_size (each
    sequence is split into 2 x cp chunks by itself; Transformer Engine's THD attention reads both). The last
    sequence is padded further so the whole stream is a multiple of ``total_multiple`` x (2 x cp_size) (sequence
    parallelism splits each rank's tokens over TP: ``total_multiple`` = TP)."""
    if cp_size < 1 or total_multiple < 1 or not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"thd_cu_seqlens: lengths {lengths} must be >= 1 and cp {cp_size} >= 1")
    m = 2 * cp_size if cp_size > 1 else 1
    real = torch.tensor([0, *lengths], dtype=torch.long)
    padded = torch.tensor([0, *(-(-n // m) * m for n in lengths)], dtype=torch.long)
    whole = m * total_multiple
    padded[-1] += -int(padded.sum()) % whole
    return real.cumsum(0).to(torch.int32), padded.cumsum(0).to(torch.int32)


def thd_partition_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int):
    """[total_tokens / cp_size] long: the packed (THD) token indices CP rank ``cp_rank`` holds, in its local order:
    for every sequence in turn, chunk ``cp_rank`` then chunk 2 cp_size - 1 - cp_rank of that sequence's 2 x cp_size
    chunks (its zig-zag, ``zigzag_positions``, offset to where the sequence starts). This is Transformer Engine's
    ``thd_get_partitioned_indices`` (a CUDA kernel; megatron-core's ``get_thd_batch_on_this_cp_rank``), written in
    torch so the layout is computed and tested anywhere. Every padded length must be a multiple of 2 x cp_size;
    tokens past the last sequence (``total_tokens`` > cu_seqlens_padded[-1]) continue the last one, as TE's do."""
    cu = cu_seqlens_padded.to(torch.long).cpu()
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel rank {cp_rank} of {cp_size}")
    if cp_size == 1:  # no split: the stream as it is
        return torch.arange(total_tokens, dtype=torch.long)
    if bool((cu % (2 * cp_size)).any()) or total_tokens % cp_size:
        raise ValueError(
            f"THD lengths {cu.tolist()} / total {total_tokens} are not multiples of 2 x cp = {2 * cp_size}"
        )
    local_cu = cu // cp_size  # where each sequence's tokens start in a rank's local order
    token = torch.arange(total_tokens // cp_size, dtype=torch.long)
    seq = (torch.searchsorted(local_cu[1:-1], token, right=True)).clamp_max(len(cu) - 2)
    half = (local_cu[seq + 1] - local_cu[seq]) // 2  # chunk length of the token's sequence
    index = token - local_cu[seq]
    early = index < half
    chunk = torch.where(early, torch.full_like(index, cp_rank), torch.full_like(index, 2 * cp_size - 1 - cp_rank))
    return cu[seq] + chunk * half + torch.where(early, index, index - half)


def sequence_sum(cp_group) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The completion of per-sequence sums over the CP group (None without CP): ``f(x_B)`` is the SUM over the CP
    ranks of their ``x_B`` (each rank's sum over the tokens it holds), so every rank gets the whole sequence's.
    The algorithms (megatron_rlvr.algorithms: PolicyLossInputs.seq_sum) call it on detached tensors only (token
    counts, GSPO's mean log-ratio, margin-credit totals), so it carries no gradient."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return None

    def complete(x_B: torch.Tensor) -> torch.Tensor:
        out = x_B.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=cp_group)
        return out

    return complete


_CP_CORE = None


def cp_core_attention():
    """megatron's local ``DotProductAttention``, exact under context parallelism (see the module docstring); at
    CP = 1 it is the parent unchanged. Used as the layer spec's ``core_attention`` when CP > 1 without Transformer
    Engine (models/build.py)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    global _CP_CORE
    if _CP_CORE is not None:
        return _CP_CORE

    class ContextParallelDotProductAttention(DotProductAttention):
        """Keys and values all-gathered over CP; the mask from global positions.

        - no ``attention_mask`` and a causal layer: key position > query position is masked;
        - an ``attention_mask`` [b | 1, 1, S / cp, S] (True = masked; query rows of this rank, key columns in global
          order, e.g. the block-diagonal causal mask of packed rows split on its query rows): its columns are put in
          the gathered keys' order. As in the parent, a given mask replaces the causal one, so it holds causality.
        Not supported at CP > 1: packed_seq_params (THD), sliding windows, attention bias (the parent refuses it)."""

        applies_given_mask = True
        """A given attention_mask is applied as it is (models.build.takes_block_attention_mask: packed rows)."""

        def __init__(self, config, *args, pg_collection=None, **kwargs):
            cp = config.context_parallel_size
            config.context_parallel_size = 1  # the parent asserts CP == 1; the config is every module's: restore it
            try:
                super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
            finally:
                config.context_parallel_size = cp
            group = getattr(pg_collection, "cp", None)
            self.cp_group = group if group is not None else parallel_state.get_context_parallel_group()
            if self.cp_group.size() > 1 and self.scale_mask_softmax.window_size is not None:
                raise ValueError("sliding-window attention is not supported with context parallelism")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kw):
            cp = self.cp_group.size()
            if cp == 1:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, **kw)
            if kw.get("packed_seq_params") is not None:
                raise ValueError("context parallelism without Transformer Engine takes no packed_seq_params (THD)")
            s_local = query.size(0)  # [s_local, b, heads, d]; key / value [s_local, b, groups, d]
            seq = s_local * cp
            key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
            k_pos = gathered_positions(seq, cp).to(query.device)
            if attention_mask is not None:
                if attention_mask.size(-1) != seq or attention_mask.size(-2) != s_local:
                    raise ValueError(
                        f"attention_mask {tuple(attention_mask.shape)}: a context-parallel rank takes its {s_local} "
                        f"query rows and all {seq} key columns in global order"
                    )
                mask = attention_mask.index_select(-1, k_pos)
            elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                q_pos = zigzag_positions(seq, cp, self.cp_group.rank()).to(query.device)
                mask = (k_pos[None, :] > q_pos[:, None])[None, None]
            else:
                mask = None
            return super().forward(query, key, value, mask, attn_mask_type, attention_bias)

    _CP_CORE = ContextParallelDotProductAttention
    return _CP_CORE
