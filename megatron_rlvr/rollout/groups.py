"""The rollout half of a step: prompts -> samples from this rank's engine -> rewards -> every rank holds the global
batch.

Data flow (deterministic for a given seed and layout): every rank draws the same global prompt batch from the
sampler, tokenises and renders it identically, generates the ``n`` samples of its engine's contiguous share of the
prompts (``shard_range`` over the rollout data-parallel engines), scores its own samples with its reward workers
(each response is scored exactly once), and an all-gather gives every rank all groups in prompt order (the whole
batch on every rank: advantages such as REINFORCE++ whitening are batch statistics). The trainer then takes its
data-parallel slice of the sequences. Samples are seeded per prompt by its global index (``prompt_keys``), so they
are the same for any number of engines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rlvr.data import Example, shard_range
from megatron_rlvr.rewards.pool import ScoringStopped
from megatron_rlvr.rollout.engine import GenerationStopped, SamplingParams, sample_seed


class RolloutStopped(Exception):
    """A stop was requested during generation or scoring on some rank; raised on every rank together, after the
    all-gather (no rank may stop alone: the others would wait in a collective it never enters). The round's samples
    are dropped: the step has not trained, so the last completed step is the one to checkpoint."""


@dataclass
class Group:
    """One prompt and its samples."""

    example: Example
    prompt_ids: list[int]
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Verifier rewards (before any shaping)."""
    versions: list[int] = field(default_factory=list)
    """The policy version (last step whose update the engine held) that generated each sample; filled by the
    disaggregated schedule (empty: the colocated schedule's, all of RolloutBatch.policy_version). With partial
    rollouts a sample's tokens may come from several versions: this is its OLDEST token's version."""
    token_versions: list[list[int]] = field(default_factory=list)
    """Partial rollouts only (else empty): per sample, per response token, the version that generated it."""
    routes: list = field(default_factory=list)
    """Per sample, the engine's MoE routes [MoE layers, P + R - 1, k] int16 (``Completion.routes``) when the engine
    returns them (routing replay R3); empty otherwise."""


@dataclass
class EngineInfo:
    """Which engine this rank belongs to and whether it leads it (keeps and scores the outputs; every rank of the
    engine calls generate)."""

    index: int
    count: int
    leader: bool


def sampling_params(rollout) -> SamplingParams:
    """The training rollouts' sampling parameters from the run's ``rollout`` section."""
    return SamplingParams(
        n=rollout.n,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=rollout.max_response_len,
        stop=tuple(rollout.stop),
    )


def engine_info(rank: int, world_size: int, rollout_tp: int) -> EngineInfo:
    return EngineInfo(index=rank // rollout_tp, count=world_size // rollout_tp, leader=rank % rollout_tp == 0)


IMAGE_PAD_TOKEN = "<|image_pad|>"
"""Qwen-VL's image placeholder token: one per image in a prompt before expansion."""


def image_tokens(image, image_processor) -> int:
    """Language tokens one image becomes (its pad's expansion): the processor's patch count after its resize, over
    ``merge_size``^2 (the count vLLM and the processor use)."""
    patches = image_processor.get_number_of_image_patches(image.height, image.width)
    return patches // image_processor.merge_size**2


def tokenize_prompts(examples: list[Example], tokenizer, data_cfg, max_prompt_len: int, image_processor=None):
    """(kept examples, their prompt ids, number skipped as too long). An example with images must tokenize to one
    ``<|image_pad|>`` per image; with ``image_processor`` ``max_prompt_len`` counts the EXPANDED prompt (each pad as
    its image's tokens: what the engine must hold), else the ids as tokenized."""
    from megatron_rlvr.data import render

    kept, ids, too_long = [], [], 0
    for ex in examples:
        text = render(ex, data_cfg, tokenizer)
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not toks:
            toks = [tokenizer.eos_token_id]
        if ex.images:
            # one pad per image, unexpanded (the engine expands it); a template without image parts writes none
            pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
            n_pads = sum(1 for t in toks if t == pad)
            if n_pads != len(ex.images):
                raise ValueError(
                    f"example {ex.id}: its rendered prompt holds {n_pads} {IMAGE_PAD_TOKEN} tokens for "
                    f"{len(ex.images)} images (data.template={data_cfg.template!r}: the chat template must write one "
                    "per image part, as Qwen-VL's does; is model.name a vision-language model?)"
                )
        length = len(toks)
        if ex.images and image_processor is not None:
            length += sum(image_tokens(im, image_processor) - 1 for im in ex.images)
        if length > max_prompt_len:
            too_long += 1
            continue
        kept.append(ex)
        ids.append(list(toks))
    return kept, ids, too_long


def round_seed(seed: int, step: int, round_idx: int) -> int:
    """Sampling seed of one generation round; each prompt's samples then derive from it and the prompt's GLOBAL
    index (``prompt_keys``), so they do not depend on how prompts are split over engines."""
    return sample_seed(seed, step, round_idx)


def generate_groups(
    engine,
    reward_manager,
    tokenizer,
    examples: list[Example],
    prompt_ids: list[list[int]],
    params: SamplingParams,
    info: EngineInfo,
    *,
    seed: int,
    step: int,
    round_idx: int,
    gather,
    reward_max_error_frac: float | None = None,
    reward_fn: str = "",
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[Group], dict[str, float]]:
    """Generate and score this engine's share, all-gather: every rank returns all groups in prompt order.

    ``gather(obj) -> list`` is an all-gather over the world (rank order); ``params.seed`` is replaced by the
    round's derived seed. ``reward_max_error_frac``: raise RewardFailure (on every rank) when more of the round's
    rewards failed, or when an engine's scoring stopped early because more of its share had failed.

    ``should_stop()`` (a stop signal arrived) is asked during scoring and, by engines that are ``interruptible``,
    between decode steps; when it returns True on any rank, every rank raises :class:`RolloutStopped` after the
    all-gather, within seconds instead of after the batch (a hanging reward function held a SIGTERM for minutes)."""
    share = shard_range(len(examples), info.index, info.count)
    mine: list[Group] = []
    stats = {"time/generate_s": 0.0, "time/reward_s": 0.0}
    reward_stats: dict[str, float] = {}
    stopped = False
    # an engine that runs collectives inside generate (partial rollouts: weight agreement between chunks) is called
    # on every rank, with no prompts where the share is empty
    if len(share) > 0 or getattr(engine, "generate_on_every_rank", False):
        # Every rank of an engine's tensor-parallel group calls generate: a vLLM engine with rollout TP > 1 is SPMD
        # (its ranks run the same steps together); only the group's leader keeps and scores the outputs.
        t0 = time.perf_counter()
        p = SamplingParams(**{**params.__dict__, "seed": round_seed(seed, step, round_idx)})
        # vision-language prompts: the examples' images (the engine returns the prompts expanded, one token per
        # merged patch, which the trainer trains on)
        images = [getattr(examples[i], "images", None) or [] for i in share]
        images = images if any(images) else None
        kw = {} if images is None else {"images": images}
        if should_stop is not None and getattr(engine, "interruptible", False):
            kw["should_stop"] = should_stop
        try:
            outputs = engine.generate([prompt_ids[i] for i in share], p, prompt_keys=share, **kw)
        except GenerationStopped:
            stopped = True
        stats["time/generate_s"] = time.perf_counter() - t0
    if info.leader and len(share) > 0 and not stopped:
        texts, gts, metas, item_ids = [], [], [], []
        for i, out in zip(share, outputs):
            g = Group(example=examples[i], prompt_ids=list(out.prompt_token_ids) if images else prompt_ids[i])
            for c in out.completions:
                text = c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
                g.response_ids.append(list(c.token_ids))
                g.logprobs.append([float(x) for x in c.logprobs])
                g.finish_reasons.append(c.finish_reason)
                if c.routes is not None:
                    g.routes.append(c.routes)
                if c.versions is not None:
                    g.token_versions.append(list(c.versions))
                g.texts.append(text)
                texts.append(text)
                gts.append(examples[i].answer)
                metas.append({**examples[i].metadata, "finish_reason": c.finish_reason})
                item_ids.append(examples[i].id)
            mine.append(g)
        t0 = time.perf_counter()
        # stops early once more than the allowed fraction of this share failed (the step fails below on every rank)
        try:
            rewards, reward_stats = reward_manager.score(
                texts, gts, metas, item_ids, reward_max_error_frac, should_stop=should_stop
            )
        except ScoringStopped:
            stopped, rewards, mine = True, [], []
        stats["time/reward_s"] = time.perf_counter() - t0
        bad = {i for i, r in enumerate(rewards) if not (isinstance(r, (int, float)) and math.isfinite(r))}
        # the manager scores NaN/inf as 0 and counts it; anything else non-finite here is counted too
        reward_stats["reward/n_nonfinite"] = reward_stats.get("reward/n_nonfinite", 0.0) + float(len(bad))
        rewards = [0.0 if i in bad else float(r) for i, r in enumerate(rewards)]
        k = 0
        for g in mine:
            g.rewards = rewards[k : k + len(g.texts)]
            k += len(g.texts)
    scoring = info.leader and reward_manager is not None
    pending = reward_manager.take_pending() if scoring else []
    everything = gather((mine, reward_stats, stats, pending, stopped) if info.leader else ([], {}, {}, [], stopped))
    if any(part[4] for part in everything):
        raise RolloutStopped(f"step {step}: a stop was requested during its rollout")
    if scoring and reward_manager.report_now:  # rank 0: each failure kind once per job
        reward_manager.report_gathered([item for _, _, _, p, _ in everything for item in p])
    groups: list[Group] = []
    merged: dict[str, float] = {}
    for part, rstats, tstats, _, _ in everything:
        groups.extend(part)
        for key in (
            "reward/n_items",
            "reward/n_timeout",
            "reward/n_error",
            "reward/n_no_answer",
            "reward/n_nonfinite",
            "reward/n_unscored",
            "reward/workers_restarted",
        ):
            merged[key] = merged.get(key, 0.0) + float(rstats.get(key, 0.0))
        for key, v in tstats.items():  # engines run in parallel: the slowest one is the step's cost
            merged[key] = max(merged.get(key, 0.0), v)
    if reward_max_error_frac is not None:  # every rank sees the same merged counts: all raise together
        from megatron_rlvr.rewards.manager import check_failure_fraction

        check_failure_fraction(merged, reward_max_error_frac, reward_fn)
    return groups, merged
