"""Prompts -> rollout data-parallel groups -> samples -> training data-parallel ranks (colocated SPMD).

Every rank holds the same global list of prompts for the step. With rollout tensor parallelism ``t`` the world of
``W`` ranks forms ``W / t`` rollout groups of consecutive ranks (vLLM's external-launcher grouping); group ``g`` gets
a contiguous, balanced slice of the prompts and all its ranks submit exactly that slice (SPMD). Each prompt is seeded
by its GLOBAL index (``prompt_keys``), so the samples do not depend on the rollout layout: the same seed gives the
same samples at any rollout TP. The groups' outputs are gathered (only each group's first rank contributes) and
every rank keeps the contiguous slice of PROMPTS that belongs to its training data-parallel rank, all ``n`` samples
of a prompt together (group statistics such as GRPO advantages need the whole group on one rank).

The pure functions (``shard_range``, ``RolloutLayout``, ``merge_shards``, ``training_shard``) hold the logic;
``run_rollout`` is the thin collective glue and takes the process group as an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rlvr.rollout.engine import RolloutEngine, RolloutOutput, SamplingParams


def shard_range(n_items: int, n_shards: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard ``index`` when ``n_items`` are split into ``n_shards`` contiguous, balanced shards:
    the first ``n_items % n_shards`` shards get one extra item."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    if not 0 <= index < n_shards:
        raise ValueError(f"shard index {index} is outside [0, {n_shards})")
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    base, extra = divmod(n_items, n_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class RolloutLayout:
    """Where this rank sits among the rollout groups."""

    world_size: int
    """Ranks running engines (the torch.distributed world in colocated mode)."""
    rank: int
    """This rank."""
    rollout_tp: int
    """Rollout tensor-parallel size (ranks per engine group)."""

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RolloutLayout: rank {self.rank} is outside a world of {self.world_size}")
        if self.rollout_tp < 1 or self.world_size % self.rollout_tp:
            raise ValueError(
                f"RolloutLayout.rollout_tp={self.rollout_tp} must be >= 1 and divide world_size={self.world_size}"
            )

    @property
    def dp_size(self) -> int:
        """Number of rollout groups (rollout data parallelism)."""
        return self.world_size // self.rollout_tp

    @property
    def dp_rank(self) -> int:
        """This rank's rollout group: consecutive ranks share one (as vLLM groups them)."""
        return self.rank // self.rollout_tp

    @property
    def is_leader(self) -> bool:
        """First rank of its group: the one that contributes the group's samples to the gather."""
        return self.rank % self.rollout_tp == 0

    def prompt_range(self, n_prompts: int) -> tuple[int, int]:
        """Global [start, stop) of the prompts this rank's group generates."""
        return shard_range(n_prompts, self.dp_size, self.dp_rank)


def merge_shards(shards: Sequence[Sequence[tuple[int, RolloutOutput]] | None], n_prompts: int) -> list[RolloutOutput]:
    """Gathered (global index, output) lists -> outputs in global prompt order; every prompt exactly once."""
    out: list[RolloutOutput | None] = [None] * n_prompts
    for shard in shards:
        for idx, o in shard or ():
            if not 0 <= idx < n_prompts:
                raise ValueError(f"merge_shards: prompt index {idx} outside [0, {n_prompts})")
            if out[idx] is not None:
                raise ValueError(f"merge_shards: prompt {idx} was generated twice")
            out[idx] = o
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
        raise ValueError(f"merge_shards: no samples for prompts {missing[:5]} ({len(missing)} missing)")
    return out


def training_shard(outputs: Sequence[RolloutOutput], dp_size: int, dp_rank: int) -> tuple[range, list[RolloutOutput]]:
    """The contiguous prompts (with all their samples) of training data-parallel rank ``dp_rank``."""
    start, stop = shard_range(len(outputs), dp_size, dp_rank)
    return range(start, stop), list(outputs[start:stop])


@dataclass
class RolloutShard:
    """What one rank trains on after a rollout."""

    prompt_indices: range
    """Global indices of this training DP rank's prompts."""
    outputs: list[RolloutOutput]
    """Their outputs (``n`` completions each), in global order."""


def run_rollout(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    layout: RolloutLayout,
    train_dp_size: int,
    train_dp_rank: int,
    group=None,
) -> RolloutShard:
    """Generate this rank's rollout-group slice, gather all groups' samples over ``group`` (default: the world;
    it must contain exactly the ``layout.world_size`` ranks) and return this training DP rank's shard.

    Collective: every rank of ``group`` must call it with the same prompts and params."""
    import torch.distributed as dist

    start, stop = layout.prompt_range(len(prompts))
    local = []
    if stop > start:
        outs = engine.generate(list(prompts[start:stop]), params, prompt_keys=range(start, stop))
        local = list(zip(range(start, stop), outs))
    if dist.is_available() and dist.is_initialized() and layout.world_size > 1:
        if dist.get_world_size(group) != layout.world_size:
            raise ValueError(f"run_rollout: group has {dist.get_world_size(group)} ranks, layout {layout.world_size}")
        shards: list = [None] * layout.world_size
        dist.all_gather_object(shards, local if layout.is_leader else None, group=group)
    else:
        shards = [local]
    merged = merge_shards(shards, len(prompts))
    indices, mine = training_shard(merged, train_dp_size, train_dp_rank)
    return RolloutShard(indices, mine)
