"""Verified weight syncs: per-tensor digests computed on both sides of a weight stream, so that an engine that does
not hold what the trainer exported (a tensor corrupted in transit, a bucket applied twice or not at all, an expert
written into the wrong slot) stops the run with the name of the first differing tensor, instead of training on
samples from weights nobody chose.

The digest is the CRC-32 of the tensor's bytes: the same for the same bytes on every device, changed by any changed,
swapped or missing byte. It is not a cryptographic hash: it guards against accidents.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import torch


def due(mode: str, syncs_done: int) -> bool:
    """Whether the next sync is verified under ``rollout.verify_sync=mode`` after ``syncs_done`` syncs."""
    return mode == "every" or (mode == "first" and syncs_done == 0)


class WeightSyncError(RuntimeError):
    """The engine does not hold what the trainer sent (names the first differing tensor)."""


def digest(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (zlib's, about a copy's speed on the CPU); a CUDA tensor is copied to the host
    first. Any changed, swapped or missing byte changes it (short of a 1 in 2^32 collision)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(memoryview(flat.numpy()))


def record(stream: Iterable, into: dict[str, int]) -> Iterator:
    """Pass a weight stream (buckets of (name, tensor), or pairs) through unchanged, recording each tensor's digest
    into ``into`` (name -> digest) as it goes by."""
    for item in stream:
        for name, tensor in item if isinstance(item, list) else [item]:
            into[name] = digest(tensor)
        yield item


def compare(expected: dict[str, int], actual: dict[str, int], where: str) -> None:
    """Raise WeightSyncError naming the first tensor (in ``expected``'s order) whose digest differs or is missing."""
    for name, want in expected.items():
        got = actual.get(name)
        if got != want:
            what = "is missing" if got is None else f"has digest {got:#010x}, the trainer sent {want:#010x}"
            raise WeightSyncError(
                f"weight sync verification failed: {where}: {name} {what}; the engine does not hold the trainer's "
                "weights (rollout.verify_sync)"
            )
