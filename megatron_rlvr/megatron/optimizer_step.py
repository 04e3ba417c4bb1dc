"""Megatron glue for one optimizer step of the policy: clearing gradients, checking them, stepping.

The trainer never touches megatron-core's DDP gradient buffers or the optimizer's step result itself; it calls
:func:`zero_grads` before a mini-batch's backward passes and :func:`apply_gradients` after them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutcome:
    """What one :func:`apply_gradients` did."""

    applied: bool
    """The optimizer updated the weights (False: skipped, for non-finite gradients or by the optimizer itself)."""
    nonfinite: bool
    """Skipped because a logit, loss or gradient was non-finite on some rank."""
    grad_norm: float | None
    """The gradient norm before clipping, when the optimizer reports one."""


def zero_grads(ddp_model, optimizer) -> None:
    """Clear DDP's gradient buffers and the optimizer's gradients (megatron keeps both)."""
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


def grads_finite(model) -> bool:
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


def apply_gradients(ddp_model, optimizer, *, local_nonfinite: bool, all_reduce_max) -> StepOutcome:
    """After a mini-batch's backward passes: agree over all ranks whether any logit, loss or gradient was non-finite
    (``local_nonfinite`` or this rank's gradients; ``all_reduce_max(float) -> float`` over the world) and then either
    skip the step (gradients cleared) or take megatron's optimizer step (gradient clipping included)."""
    bad = local_nonfinite or not grads_finite(ddp_model)
    if all_reduce_max(1.0 if bad else 0.0) > 0:
        zero_grads(ddp_model, optimizer)
        return StepOutcome(applied=False, nonfinite=True, grad_norm=None)
    ok, grad_norm, _ = optimizer.step()
    return StepOutcome(applied=bool(ok), nonfinite=False, grad_norm=None if grad_norm is None else float(grad_norm))
