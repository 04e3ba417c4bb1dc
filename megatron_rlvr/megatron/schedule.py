"""Megatron glue: run a list of micro-batches through megatron-core's ``get_forward_backward_func`` (no pipelining,
or 1F1B when PP > 1) with a per-micro-batch loss/statistics function evaluated on the last pipeline stage.

Loss scaling. The RLVR losses (megatron_rlvr.algorithms) are "sum-reduced": each micro-batch's loss is its share
of the global mini-batch loss (divided by GLOBAL token / sequence counts), so the full-batch gradient is the SUM of
all micro-batch gradients on all data-parallel ranks. megatron's schedule divides each returned loss by the number
of micro-batches and its DDP averages gradients over the data-parallel group; ``run_microbatches`` multiplies the
loss by ``num_microbatches * dp_size`` before handing it over, which undoes both exactly.

Context parallelism: each CP rank's loss is its share (its positions' terms over global normalisers), megatron's
schedule multiplies a returned loss by the CP size and its DDP averages gradients over data x context parallel
(``dp_cp``): the two cancel, and the gradients of the CP ranks' shares add up. Micro-batches come split (model inputs
[b, s / cp]); the schedule is told the global length s, which it divides by CP itself (PP p2p shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_rlvr.megatron.cpu_shims import native_torch


def thd_params(mb, device: torch.device):
    """megatron's ``PackedSeqParams`` of a micro-batch of packed sequences (THD: ``cu_seqlens`` /
    ``cu_seqlens_padded`` set by trainer.context_split.split_thd_for_context_parallel), None for [b, s] rows. The
    rotary embedding and TE's attention read the padded boundaries (each sequence a multiple of 2 x cp, split into
    its own zig-zag chunks) and the real ones (padding attends to nothing and is attended by nothing)."""
    cu = getattr(mb, "cu_seqlens", None)
    if cu is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, padded = cu.to(device, torch.int32), mb.cu_seqlens_padded.to(device, torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(mb.max_seqlen),
        max_seqlen_kv=int(mb.max_seqlen),
    )


def run_microbatches(
    model,
    microbatches: list,
    loss_fn: Callable[[object, torch.Tensor], tuple[torch.Tensor, object]],
    *,
    pg,
    forward_only: bool,
    device: torch.device,
    routing=None,
) -> list:
    """Forward (and backward unless ``forward_only``) over ``microbatches``; returns, on the last pipeline stage,
    the result object of each micro-batch (in order), and [] on other stages. A micro-batch has ``tokens`` and
    ``position_ids`` [b, s] ([3, b, s] with images, whose inputs ``vision_kwargs(device)`` gives) and
    ``attention_mask`` ([b, 1, s, s] bool, True = not attended; packed rows) or None (causal), as the trainer's
    MicroBatch does.

    ``loss_fn(mb, logits_bsv)`` gets the micro-batch and this TP rank's logits shard [b, s, V/tp] and returns (this
    micro-batch's sum-reduced loss, a result object handed back as it is). Every micro-batch must have the same
    [b, s] when PP > 1.

    ``routing``: a routing-replay session (megatron_rlvr.megatron.routing) told before and after every micro-batch's
    forward, so it can set the routes to replay or collect the recorded ones.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        return []
    n_micro = len(microbatches)
    b, s = microbatches[0].tokens.shape
    pp_size = pg.pp.size()
    if pp_size > 1 and any(tuple(mb.tokens.shape) != (b, s) for mb in microbatches):
        raise ValueError("with pipeline parallelism every micro-batch must have the same [b, s]")
    scale = float(n_micro * pg.dp.size())

    def adapter(mb, output_tensor):
        loss, info = loss_fn(mb, output_tensor)
        if not forward_only:
            loss = loss * scale
        return loss, info

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        tokens = mb.tokens.to(device)
        position_ids = mb.position_ids.to(device)
        mask = mb.attention_mask  # packed rows: block-diagonal causal (None: megatron's causal mask)
        mask = None if mask is None else mask.to(device)
        if routing is not None:
            routing.before_forward(mb)
        # vision-language policies: the micro-batch's images, image mask and 3-D positions
        vision = mb.vision_kwargs(device) if hasattr(mb, "vision_kwargs") else {}
        thd = thd_params(mb, device)  # packed sequences (THD): Transformer Engine's attention takes them as they are
        packed = {} if thd is None else {"packed_seq_params": thd}
        with native_torch():  # the model forward makes no CUDA call (cpu_shims: causal masks): skip the redirect
            output = model_chunk(tokens, position_ids, mask, **vision, **packed)
        if routing is not None:
            routing.after_forward(mb)
        return output, functools.partial(adapter, mb)

    fwd_bwd = get_forward_backward_func(pp_size=pp_size)
    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    with ctx:
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=n_micro,
            seq_length=s * pg.cp.size(),  # the global length: megatron divides it by CP
            micro_batch_size=b,
            forward_only=forward_only,
        )
    if pg.pp.rank() != pp_size - 1:
        return []
    return list(out)
