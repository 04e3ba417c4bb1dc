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

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.data import Example, render, shard_range
from megatron_rlvr.data.harmony import reply_text
from megatron_rlvr.rewards import RewardManager
from megatron_rlvr.rewards.judge import question_text
from megatron_rlvr.rewards.manager import RewardFailure, check_failure_fraction
from megatron_rlvr.rewards.pool import ScoringStopped
from megatron_rlvr.rollout.engine import GenerationStopped, RolloutEngine, SamplingParams, sample_seed
from megatron_rlvr.rollout.multiturn import MultiTurn, Trajectory, demonstrate, roll_out


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
    """The policy version (last step whose update the engine held) that generated each sample, stamped when the
    group is made (``Round.version``). With partial rollouts a sample's tokens may come from several versions: this
    is its OLDEST token's version."""
    token_versions: list[list[int]] = field(default_factory=list)
    """Partial rollouts only (else empty): per sample, per response token, the version that generated it."""
    routes: list = field(default_factory=list)
    """Per sample, the engine's MoE routes [MoE layers, P + R - 1, k] int16 (``Completion.routes``) when the engine
    returns them (routing replay R3); empty otherwise."""
    route_weights: list = field(default_factory=list)
    """Per sample, the engine's gate weights of those routes [MoE layers, P + R - 1, k] float32
    (``Completion.route_weights``) when the engine returns them; empty otherwise (multi-turn trajectories too)."""
    loss_masks: list[list[int]] = field(default_factory=list)
    """Multi-turn rollouts only (else empty: every response token carries loss): per sample, per response token, 1
    where the policy sampled it and 0 at observation tokens (``rollout.multiturn``)."""
    turns: list[int] = field(default_factory=list)
    """Multi-turn only: per sample, its assistant turns."""
    tool_calls: list[list] = field(default_factory=list)
    """Multi-turn only: per sample, its tool calls (``agentic.environment.ToolCallRecord``)."""
    cuts: list[str] = field(default_factory=list)
    """Multi-turn only: per sample, the limit that ended it ('' when the episode ended by itself)."""
    reward_terms: list[dict[str, float]] = field(default_factory=list)
    """Multi-turn only: per sample, the environment's per-turn reward terms summed over its turns (already added to
    ``rewards``)."""
    demos: list[bool] = field(default_factory=list)
    """Off-policy guidance (``agent.guidance``) only, else empty: per sample, True where it is the environment's
    demonstration (not sampled by the policy: its ``logprobs`` are 0.0 placeholders)."""


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


def tokenize_prompts(
    examples: list[Example], tokenizer, data_cfg, max_prompt_len: int, image_processor=None, tools=None
):
    """(kept examples, their prompt ids, number skipped as too long); ``tools``: tool descriptions for the chat
    template (multi-turn rollouts with tools). An example with images must tokenize to one
    ``<|image_pad|>`` per image; with ``image_processor`` ``max_prompt_len`` counts the EXPANDED prompt (each pad as
    its image's tokens: what the engine must hold), else the ids as tokenized."""
    kept, ids, too_long = [], [], 0
    for ex in examples:
        text = render(ex, data_cfg, tokenizer, tools)
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


@dataclass(frozen=True)
class Generator:
    """Who generates and scores on this rank, and how the engines' results meet."""

    engine: RolloutEngine
    """This rank's engine (every rank of an engine's tensor-parallel group calls generate)."""
    reward_manager: RewardManager | None
    """Reward workers: engine leaders only (they keep and score their engine's outputs)."""
    tokenizer: Any
    """Decodes a completion that came back without text."""
    info: EngineInfo
    """Which engine this rank belongs to and whether it leads it."""
    gather: Callable[[object], list]
    """All-gather over the ranks that roll out (rank order)."""
    should_stop: Callable[[], bool] | None = None
    """A stop was requested (a stop signal): asked during scoring and, by ``interruptible`` engines, between decode
    steps; when it returns True on any rank every rank raises RolloutStopped after the all-gather. None: never."""
    multi_turn: MultiTurn | None = None
    """Multi-turn rollouts: the environment and limits (``agent`` section); None: one completion per sample."""
    guidance_threshold: float | None = None
    """Off-policy guidance (``agent.guidance: all_wrong``, multi-turn only): a group whose every sample's reward is
    below this (algorithm.advantage.correct_threshold) gets its last sample replaced by the environment's
    demonstration (:func:`guide`); None: off."""


@dataclass(frozen=True)
class Round:
    """One generation round: which prompts, how to sample them, and what the samples are stamped with."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    """Token ids of each example's rendered prompt (``tokenize_prompts``)."""
    params: SamplingParams
    """How to sample; its ``seed`` is replaced by the round's derived seed."""
    seed: int
    step: int
    round_idx: int
    version: int = 0
    """The weight version the engine holds as the round starts: ``Group.versions`` of samples whose tokens carry
    no version of their own."""
    reward_max_error_frac: float | None = None
    """Raise RewardFailure (on every rank) when more of the round's rewards failed, or when an engine's scoring
    stopped early because more of its share had failed."""
    reward_fn: str = ""
    """The reward's name, for that error."""


def generate_groups(gen: Generator, rnd: Round) -> tuple[list[Group], dict[str, float]]:
    """Generate and score this engine's share, all-gather: every rank returns all groups in prompt order, with the
    merged reward counts and the slowest engine's times. RolloutStopped on every rank when a stop was requested on
    any (``Generator.should_stop``), within seconds instead of after the batch."""
    share = shard_range(len(rnd.examples), gen.info.index, gen.info.count)
    stats = {"time/generate_s": 0.0, "time/reward_s": 0.0}
    mine: list[Group] = []
    reward_stats: dict[str, float] = {}
    stopped = False
    try:
        outputs, images = _generate_share(gen, rnd, share, stats)
        if gen.info.leader and len(share) > 0:
            if gen.multi_turn is not None:
                mine = [_trajectory_group(rnd, i, trajs) for i, trajs in zip(share, outputs)]
            else:
                mine = [_group(rnd, i, out, images is not None, gen.tokenizer) for i, out in zip(share, outputs)]
            t0 = time.perf_counter()
            reward_stats = _score(gen.reward_manager, mine, rnd.reward_max_error_frac, gen.should_stop)
            if gen.guidance_threshold is not None and gen.multi_turn is not None:
                guide(mine, gen.multi_turn, gen.tokenizer, gen.reward_manager, gen.guidance_threshold)
            stats["time/reward_s"] = time.perf_counter() - t0
    except (GenerationStopped, ScoringStopped):
        stopped, mine, reward_stats = True, [], {}
    scoring = gen.info.leader and gen.reward_manager is not None
    pending = gen.reward_manager.take_pending() if scoring else []
    everything = gen.gather(
        (mine, reward_stats, stats, pending, stopped) if gen.info.leader else ([], {}, {}, [], stopped)
    )
    if any(part[4] for part in everything):
        raise RolloutStopped(f"step {rnd.step}: a stop was requested during its rollout")
    if scoring and gen.reward_manager.report_now:  # rank 0: each failure kind once per job
        gen.reward_manager.report_gathered([item for _, _, _, p, _ in everything for item in p])
    groups = [g for part, *_ in everything for g in part]
    merged = _merge_stats(everything)
    if rnd.reward_max_error_frac is not None:  # every rank sees the same merged counts: all raise together
        try:
            check_failure_fraction(merged, rnd.reward_max_error_frac, rnd.reward_fn)
        except RewardFailure as e:
            e.speaker = gen.info.index == 0 and gen.info.leader  # the first engine's leader says it
            raise
    return groups, merged


def _generate_share(gen: Generator, rnd: Round, share: range, stats: dict) -> tuple[list, list | None]:
    """This engine's outputs for its share of the prompts, and their images (None: no prompt has one)."""
    images = [rnd.examples[i].images or [] for i in share]
    images = images if any(images) else None
    # an engine that runs collectives inside generate (partial rollouts: weight agreement between chunks) is called
    # on every rank, with no prompts where the share is empty
    if len(share) == 0 and not gen.engine.generate_on_every_rank:
        return [], images
    # Every rank of an engine's tensor-parallel group calls generate: a vLLM engine with rollout TP > 1 is SPMD (its
    # ranks run the same steps together); only the group's leader keeps and scores the outputs.
    t0 = time.perf_counter()
    p = dataclasses.replace(rnd.params, seed=round_seed(rnd.seed, rnd.step, rnd.round_idx))
    # vision-language prompts: the engine returns them expanded (one token per merged patch): what the trainer trains
    kw = {} if images is None else {"images": images}
    if gen.should_stop is not None and gen.engine.interruptible:
        kw["should_stop"] = gen.should_stop
    if gen.multi_turn is not None:
        if images is not None:
            raise ValueError("agent.environment: multi-turn rollouts do not take image prompts yet (docs/agentic.md)")
        outputs = roll_out(
            gen.engine,
            gen.multi_turn,
            [rnd.examples[i] for i in share],
            [rnd.prompt_ids[i] for i in share],
            p,
            list(share),
            decode=lambda ids: decode_action(gen.tokenizer, ids),
            generate_kw=kw,
        )
        stats["time/generate_s"] = time.perf_counter() - t0
        return outputs, None
    outputs = gen.engine.generate([rnd.prompt_ids[i] for i in share], p, prompt_keys=share, **kw)
    stats["time/generate_s"] = time.perf_counter() - t0
    return outputs, images


def _group(rnd: Round, i: int, out, expanded: bool, tokenizer) -> Group:
    """The group of prompt ``i`` from its engine output, each sample stamped with its version (its oldest token's
    under partial rollouts, else the round's)."""
    ex = rnd.examples[i]
    g = Group(example=ex, prompt_ids=list(out.prompt_token_ids) if expanded else rnd.prompt_ids[i])
    for c in out.completions:
        g.response_ids.append(list(c.token_ids))
        g.logprobs.append([float(x) for x in c.logprobs])
        g.finish_reasons.append(c.finish_reason)
        if c.routes is not None:
            g.routes.append(c.routes)
        if c.route_weights is not None:
            g.route_weights.append(c.route_weights)
        if c.versions is not None:
            g.token_versions.append(list(c.versions))
        g.versions.append(min(c.versions) if c.versions else rnd.version)
        g.texts.append(reply_text(tokenizer, c.token_ids, c.text))  # harmony: the final channel only
    return g


def decode_action(tokenizer, ids: list[int]) -> str:
    """An assistant turn's text for parsing and scoring: special tokens (EOS) dropped, added tokens such as
    ``<tool_call>`` kept (they are not special in the Qwen and tiny tokenizers)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def _trajectory_group(rnd: Round, i: int, trajs: list[Trajectory]) -> Group:
    """The group of prompt ``i`` from its multi-turn trajectories (all tokens from the round's weights)."""
    g = Group(example=rnd.examples[i], prompt_ids=rnd.prompt_ids[i])
    for t in trajs:
        g.response_ids.append(list(t.response_ids))
        g.logprobs.append(list(t.logprobs))
        g.finish_reasons.append(t.finish_reason)
        g.texts.append(t.final_text)
        g.versions.append(rnd.version)
        g.loss_masks.append(list(t.loss_mask))
        g.turns.append(t.turns)
        g.tool_calls.append(list(t.tool_calls))
        g.cuts.append(t.cut)
        g.reward_terms.append(dict(t.reward_terms))
        if t.routes is not None:
            g.routes.append(t.routes)
    return g


def guide(groups: list[Group], multi: MultiTurn, tokenizer, reward_manager, threshold: float) -> None:
    """Off-policy guidance where the policy fails (LUFFY, Yan et al. 2025, "Learning to Reason under Off-Policy
    Guidance"; demonstrations only for the prompts the policy gets all wrong, as in SRFT / ReLIFT): in every group
    whose samples all scored below ``threshold``, the last sample is replaced by the environment's demonstration
    (:func:`~megatron_rlvr.rollout.multiturn.demonstrate`), scored by the same verifier plus its reward terms. The
    group's advantages are then computed with it. A demonstration that does not itself score at least
    ``threshold`` is not used (it would teach a wrong answer). Every group gets ``demos`` (one flag per sample).
    A group that has routes (routing replay R3) is refused: a demonstration has none."""
    for g in groups:
        g.demos = [False] * len(g.rewards)
        if not g.rewards or max(g.rewards) >= threshold:
            continue
        if g.routes:
            raise ValueError("agent.guidance: demonstrations carry no engine routes (train.routing_replay=r3)")
        t = demonstrate(multi, g.example, tokenizer, lambda ids: decode_action(tokenizer, ids))
        if t is None:
            continue
        demo = Group(example=g.example, prompt_ids=g.prompt_ids)
        demo.texts, demo.finish_reasons, demo.reward_terms = [t.final_text], [t.finish_reason], [dict(t.reward_terms)]
        _score(reward_manager, [demo], None)
        if demo.rewards[0] < threshold:
            continue
        j = len(g.rewards) - 1
        g.response_ids[j], g.logprobs[j], g.finish_reasons[j] = list(t.response_ids), list(t.logprobs), t.finish_reason
        g.texts[j], g.rewards[j], g.turns[j] = t.final_text, demo.rewards[0], t.turns
        g.loss_masks[j] = list(t.loss_mask)
        g.tool_calls[j], g.cuts[j], g.reward_terms[j] = list(t.tool_calls), t.cut, dict(t.reward_terms)
        g.demos[j] = True


def _score(reward_manager, groups: list[Group], max_error_frac: float | None, should_stop=None) -> dict[str, float]:
    """Score every sample of ``groups`` (each exactly once) into ``Group.rewards``; the manager's counts.
    ScoringStopped when ``should_stop()`` returned True meanwhile."""
    texts, gts, metas, item_ids, questions = [], [], [], [], []
    for g in groups:
        ex = g.example
        for text, reason in zip(g.texts, g.finish_reasons):
            texts.append(text)
            gts.append(ex.answer)
            metas.append({**ex.metadata, "finish_reason": reason})
            item_ids.append(ex.id)
            questions.append(question_text(ex.prompt))  # a judge's prompt shows the question
    # stops early once more than the allowed fraction of this share failed (the step fails on every rank)
    rewards, reward_stats = reward_manager.score(
        texts, gts, metas, item_ids, max_error_frac, should_stop=should_stop, questions=questions
    )
    bad = {i for i, r in enumerate(rewards) if not (isinstance(r, (int, float)) and math.isfinite(r))}
    # the manager scores NaN/inf as 0 and counts it; anything else non-finite here is counted too
    reward_stats["reward/n_nonfinite"] = reward_stats.get("reward/n_nonfinite", 0.0) + float(len(bad))
    rewards = [0.0 if i in bad else float(r) for i, r in enumerate(rewards)]
    k = 0
    for g in groups:
        g.rewards = rewards[k : k + len(g.texts)]
        if g.reward_terms:  # multi-turn: the environment's per-turn terms add to the verifier's reward
            g.rewards = [r + sum(terms.values()) for r, terms in zip(g.rewards, g.reward_terms)]
        k += len(g.texts)
    return reward_stats


REWARD_COUNTS = (
    "reward/n_items",
    "reward/n_timeout",
    "reward/n_error",
    "reward/n_no_answer",
    "reward/n_nonfinite",
    "reward/n_unscored",
    "reward/n_judge_unparsed",
    "reward/workers_restarted",
)
"""Reward counters summed over the engines."""


def _merge_stats(everything: list) -> dict[str, float]:
    """Reward counts summed over the engines; times are the slowest engine's (engines run in parallel)."""
    merged: dict[str, float] = {}
    for _, rstats, tstats, _, _ in everything:
        for key in REWARD_COUNTS:
            merged[key] = merged.get(key, 0.0) + float(rstats.get(key, 0.0))
        for key, v in tstats.items():
            merged[key] = max(merged.get(key, 0.0), v)
    return merged
