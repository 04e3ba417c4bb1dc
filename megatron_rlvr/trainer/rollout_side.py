"""The rollout side of a rank: what generating and scoring a step's samples needs (the prompts, the tokenizer and
image processor, the engine and which engine this rank belongs to, the reward workers, the weight version the
engine holds). A colocated rank builds it beside the policy side; a rank of the disaggregated layout that only rolls
out builds only this, through the same :func:`build_rollout_side`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rlvr.agentic.registry import build_environment
from megatron_rlvr.config import RunConfig
from megatron_rlvr.data import PromptLoader, build_train_dataset, build_train_loader
from megatron_rlvr.megatron.parallel import all_gather_objects
from megatron_rlvr.models.source import ModelSource, load_image_processor, load_tokenizer
from megatron_rlvr.rewards import RewardManager
from megatron_rlvr.rollout.engine import RolloutEngine
from megatron_rlvr.rollout.groups import EngineInfo, Generator, engine_info
from megatron_rlvr.rollout.judge_ranks import RemoteJudge
from megatron_rlvr.rollout.lora_sync import AdapterSync
from megatron_rlvr.rollout.multiturn import MultiTurn
from megatron_rlvr.trainer.engine_setup import build_engine
from megatron_rlvr.trainer.judge_setup import build_judge


@dataclass
class RolloutSide:
    """Everything the rollout stage touches on one rank."""

    cfg: RunConfig
    """The validated run config."""
    tokenizer: Any
    """The policy's tokenizer (prompts in, responses out)."""
    image_processor: Any
    """A vision-language policy's image processor (prompt lengths count the expanded image tokens); else None."""
    engine: RolloutEngine
    """This rank's rollout engine (transformers or vLLM)."""
    engine_info: EngineInfo
    """Which engine this rank belongs to and whether it leads it."""
    reward_manager: RewardManager | None
    """Reward workers (engine leaders only)."""
    loader: PromptLoader
    """Resumable prompt loader (its position is what a checkpoint records of the data)."""
    n_malformed: int
    """Malformed training rows skipped while loading the data (``data.skip_malformed``)."""
    adapter_sync: AdapterSync | None = None
    """LoRA with ``model.lora.sync: adapter``: the adapter folder this engine serves; None otherwise."""
    policy_version: int = 0
    """The weight version the engine holds: the last step whose update its weights include."""
    should_stop: Callable[[], bool] | None = None
    """A stop signal arrived: generation and scoring are abandoned within seconds (None: the rank is stopped by
    others, as the disaggregated rollout ranks are by the training ranks)."""
    multi_turn: MultiTurn | None = None
    """Multi-turn rollouts (``agent.environment``): the environment and the trajectory limits; None: one completion
    per sample."""

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tool descriptions the chat template writes into every prompt (multi-turn rollouts with tools)."""
        if self.multi_turn is None or not self.multi_turn.environment.tool_schemas:
            return None
        return list(self.multi_turn.environment.tool_schemas)

    def generator(self) -> Generator:
        """Who generates and scores here, for ``rollout.groups.generate_groups``."""
        return Generator(
            self.engine,
            self.reward_manager,
            self.tokenizer,
            self.engine_info,
            all_gather_objects,
            self.should_stop,
            self.multi_turn,
            self.cfg.algorithm.advantage.correct_threshold if self.cfg.agent.guidance != "none" else None,
        )

    def close(self) -> None:
        if self.multi_turn is not None:
            self.multi_turn.environment.close()
        if self.reward_manager is not None:
            self.reward_manager.close()
        if self.adapter_sync is not None:
            self.adapter_sync.close()
        self.engine.close()


def build_loader(cfg: RunConfig) -> tuple[PromptLoader, int]:
    """The run's prompt loader (every rank draws the same global batches) and the malformed rows skipped."""
    dataset = build_train_dataset(cfg.data)
    loader = build_train_loader(cfg.data, cfg.train.prompts_per_step, dp_rank=0, dp_world=1, dataset=dataset)
    return loader, dataset.n_malformed


def build_rollout_side(
    cfg: RunConfig,
    source: ModelSource,
    rank: int,
    ranks: int,
    should_stop: Callable[[], bool] | None = None,
    judge_links: list | None = None,
    judge_ranks: list[int] | None = None,
) -> RolloutSide:
    """The rollout side of ``rank`` among the ``ranks`` that roll out (the world when colocated, the rollout ranks
    when disaggregated). The engine starts with random weights: the policy's arrive by the first publish.
    ``should_stop``: RolloutSide.should_stop. ``judge_links``: with ``parallel.judge_ranks``, this engine leader's
    pair groups to the judge ranks (global ranks ``judge_ranks``): the reward judge is reached there instead of
    built here."""
    tokenizer = load_tokenizer(source)
    info = engine_info(rank, ranks, cfg.parallel.rollout_tp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    engine = build_engine(cfg, source, tokenizer, device)
    judge = reward_manager = None
    try:
        lora = cfg.model.lora
        adapter_sync = AdapterSync(engine) if lora is not None and lora.sync == "adapter" else None
        if info.leader and judge_links:
            judge = RemoteJudge(cfg.reward.judge, judge_links, judge_ranks)
        elif info.leader:
            judge = build_judge(cfg.reward, device, cfg.train.seed)
        reward_manager = RewardManager(cfg.reward, judge=judge) if info.leader else None
        loader, n_malformed = build_loader(cfg)
        multi_turn = build_multi_turn(cfg, tokenizer)
    except BaseException:
        # a judge process, or the reward workers, must not outlive a failed start
        if reward_manager is not None:
            reward_manager.close()
        elif judge is not None:
            judge.close()
        engine.close()
        raise
    image_processor = load_image_processor(source)
    return RolloutSide(
        cfg,
        tokenizer,
        image_processor,
        engine,
        info,
        reward_manager,
        loader,
        n_malformed,
        adapter_sync,
        0,
        should_stop,
        multi_turn,
    )


def build_multi_turn(cfg: RunConfig, tokenizer) -> MultiTurn | None:
    """The environment and limits of multi-turn rollouts (None without ``agent.environment``)."""
    agent = cfg.agent
    if not agent.multi_turn:
        return None
    budget = cfg.rollout.max_response_len
    return MultiTurn.build(
        build_environment(agent, tokenizer),
        tokenizer,
        max_turns=agent.max_turns,
        budget=budget,
        max_turn_tokens=min(agent.max_turn_tokens or budget, budget),
    )
