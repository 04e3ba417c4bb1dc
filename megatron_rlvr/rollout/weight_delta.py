"""Delta weight syncs: what changed in a tensor's bytes since the version the receiver holds, as sparse words.

An optimizer step at an RL learning rate (1e-6) moves most bf16 weights by less than half a unit in the last place,
so their published bytes do not change at all; the rest change in one word each. A delta names the changed words
(their indices) and carries their new values; the receiver copies its base and writes them in. Words are the
tensor's element size (2 bytes for bf16), so a changed element costs its index (4 bytes, 8 past 2^31 words) plus
the element, and a tensor whose delta would not be smaller than the tensor itself is sent whole.

The payload of one tensor is a flat uint8 tensor: ``full`` (the bytes) or ``sparse`` (indices then values).
Pure tensor functions, no process groups: ``megatron_rlvr.rollout.bridge`` frames and checks them (digests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_dtype(element_size: int) -> torch.dtype:
    """The integer dtype of one element's bytes (a bf16's 2 bytes -> int16)."""
    if element_size not in _WORDS:
        raise ValueError(f"weight delta: no word type of {element_size} bytes")
    return _WORDS[element_size]


@dataclass(frozen=True)
class Encoded:
    """One tensor's part of a delta version."""

    kind: str
    """``full`` (payload = the tensor's bytes) or ``sparse`` (payload = changed word indices, then their values)."""
    payload: torch.Tensor
    """uint8 [n] on the CPU."""
    changed: int
    """Words that differ from the base (all of them for a tensor sent whole without a base)."""


def _view(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``u8`` (uint8, contiguous) read as ``dtype``; copied first where its offset in its storage is not a multiple
    of the dtype's size (a view into a received bucket's buffer starts anywhere)."""
    size = torch.empty((), dtype=dtype).element_size()
    if u8.storage_offset() % size:
        u8 = u8.clone()
    return u8.view(dtype)


def _index_dtype(words: int) -> torch.dtype:
    return torch.int32 if words < 2**31 else torch.int64


def encode(base_u8: torch.Tensor | None, new_u8: torch.Tensor, element_size: int) -> Encoded:
    """The delta of ``new_u8`` (a tensor's bytes, uint8 [n]) against ``base_u8`` (the same tensor's bytes in the
    version the receiver holds; None: it holds none), in words of ``element_size`` bytes."""
    words = new_u8.numel() // element_size
    if base_u8 is None or base_u8.numel() != new_u8.numel():
        return Encoded("full", new_u8, words)
    wt = word_dtype(element_size)
    new_w, base_w = _view(new_u8, wt), _view(base_u8, wt)
    idx = torch.nonzero(new_w != base_w).reshape(-1).to(_index_dtype(words))
    sparse_bytes = idx.numel() * (idx.element_size() + element_size)
    if sparse_bytes >= new_u8.numel():
        return Encoded("full", new_u8, idx.numel())
    payload = torch.cat([idx.view(torch.uint8), new_w[idx.long()].view(torch.uint8)])
    return Encoded("sparse", payload, idx.numel())


def decode(base_u8: torch.Tensor | None, kind: str, payload: torch.Tensor, nbytes: int, element_size: int):
    """The tensor's new bytes (uint8 [nbytes], a new tensor: the base is not modified) from its base and payload."""
    if kind == "full":
        if payload.numel() != nbytes:
            raise ValueError(f"weight delta: a full payload of {payload.numel()} bytes for a tensor of {nbytes}")
        return payload.clone()
    if kind != "sparse":
        raise ValueError(f"weight delta: unknown payload kind {kind!r}")
    if base_u8 is None or base_u8.numel() != nbytes:
        raise ValueError("weight delta: a sparse payload for a tensor the receiver holds no base of")
    words = nbytes // element_size
    idt = _index_dtype(words)
    per = torch.empty((), dtype=idt).element_size() + element_size
    if payload.numel() % per:
        raise ValueError(f"weight delta: a sparse payload of {payload.numel()} bytes is not whole (index, word) pairs")
    n = payload.numel() // per
    split = n * torch.empty((), dtype=idt).element_size()
    idx = _view(payload[:split], idt).long()
    wt = word_dtype(element_size)
    out = base_u8.clone()
    out.view(wt)[idx] = _view(payload[split:], wt)
    return out
