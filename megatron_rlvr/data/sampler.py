"""Deterministic shuffling and data-parallel sharding with a resumable position.

The global stream of example indices is the concatenation of one seeded permutation per epoch::

    stream = perm(seed, epoch=0) ++ perm(seed, epoch=1) ++ ...

Every rank walks the same stream in lockstep; each step takes the next ``global_batch_size`` indices and rank
``r`` of ``W`` keeps the contiguous slice ``[r * B / W, (r + 1) * B / W)``. Hence within an epoch every example is
used exactly once across all ranks (disjoint and covering, no padding or dropping; a batch may straddle two
epochs), and the state ``(epoch, position)`` is a position in the global stream: independent of the number of
ranks and of the batch size, so a run can resume with a different data-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_rlvr.data.records import Example

__all__ = ["PromptLoader", "PromptSampler", "shard_range"]


def shard_range(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous, balanced block of ``range(n)`` (sizes differ by at most one, larger blocks first):
    prompts over engines, groups over mini-batches, sequences over data-parallel ranks, evaluation examples."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class PromptSampler:
    """This rank's share of a deterministic, epoch-aware stream of example indices (see module docstring)."""

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got dp_rank={dp_rank}, dp_world={dp_world}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self._check_batch(global_batch_size, dp_world)
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Epoch of the next index to hand out."""
        self.position = 0
        """Offset of the next index within that epoch's permutation."""
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @staticmethod
    def _check_batch(global_batch_size: int, dp_world: int) -> None:
        if global_batch_size < 1 or global_batch_size % dp_world:
            raise ValueError(
                f"global batch size {global_batch_size} must be >= 1 and divisible by the data-parallel size {dp_world}"
            )

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch`` (identity if not shuffling); seeded by (seed, epoch) only."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def next_global_indices(self, global_batch_size: int | None = None) -> list[int]:
        """The next ``global_batch_size`` indices of the stream (all ranks' together), advancing the state."""
        b = self.global_batch_size if global_batch_size is None else global_batch_size
        self._check_batch(b, self.dp_world)
        out: list[int] = []
        while len(out) < b:
            perm = self.epoch_permutation(self.epoch)
            take = min(b - len(out), self.num_examples - self.position)
            out.extend(int(i) for i in perm[self.position : self.position + take])
            self.position += take
            if self.position == self.num_examples:
                self.epoch += 1
                self.position = 0
        return out

    def next_indices(self, global_batch_size: int | None = None) -> list[int]:
        """This rank's slice of the next global batch. Every rank must call this the same number of times with the
        same size (they walk the stream in lockstep)."""
        g = self.next_global_indices(global_batch_size)
        per_rank = len(g) // self.dp_world
        return g[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the stream exactly (plain ints/bools: JSON- and torch.save-friendly)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; the data set and shuffling must be the same."""
        for key in ("num_examples", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"data sampler state was saved with {key}={state.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resuming would replay a different order"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_examples:
            raise ValueError(f"invalid data sampler state epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position


class PromptLoader:
    """Batches of :class:`Example` for this data-parallel rank, from a :class:`PromptSampler` over ``examples``."""

    def __init__(
        self,
        examples: Sequence[Example],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if len(examples) == 0:
            raise ValueError("PromptLoader got an empty data set")
        self.examples = examples
        self.sampler = PromptSampler(len(examples), global_batch_size, dp_rank, dp_world, seed, shuffle)

    def next_batch(self, global_batch_size: int | None = None) -> list[Example]:
        """This rank's examples of the next global batch (``global_batch_size / dp_world`` of them)."""
        return [self.examples[i] for i in self.sampler.next_indices(global_batch_size)]

    def __iter__(self):
        return self

    def __next__(self) -> list[Example]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
