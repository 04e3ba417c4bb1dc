"""Build the reward judge of ``reward.judge`` on the rollout side of an engine leader: a generative judge served by
the transformers rollout engine, or a scalar reward model, on the rank's device beside the policy's engine."""

from __future__ import annotations

import itertools

import torch

from megatron_rlvr.rewards.judge import GenerativeJudge, ScalarRewardModel
from megatron_rlvr.rewards.judge_config import JudgeConfig
from megatron_rlvr.rewards.reward_config import RewardConfig
from megatron_rlvr.rollout.engine import GenerationStopped, RolloutEngine, SamplingParams
from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

__all__ = ["build_judge", "engine_judge"]


def engine_judge(cfg: JudgeConfig, engine: RolloutEngine, tokenizer, seed: int = 0) -> GenerativeJudge:
    """A generative judge served by ``engine``: one ``generate`` call per step with all its items (one sample
    each, ``max_tokens`` and ``temperature`` from ``cfg``), interrupted between decode steps when the judge's
    ``should_stop`` (its wall-clock limit or a stop request) says so, where the engine is interruptible."""
    calls = itertools.count()

    def generate(prompt_ids: list[list[int]], should_stop) -> list[str] | None:
        # a new seed per call: a sampling judge must not draw the same noise for a prompt index every step
        params = SamplingParams(
            n=1, temperature=float(cfg.temperature), max_tokens=cfg.max_tokens, seed=seed + next(calls)
        )
        kw = {"should_stop": should_stop} if engine.interruptible else {}
        try:
            outputs = engine.generate(prompt_ids, params, **kw)
        except GenerationStopped:
            return None
        replies = []
        for out in outputs:
            c = out.completions[0]
            replies.append(c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True))
        return replies

    return GenerativeJudge(cfg, tokenizer, generate, closer=engine.close)


def build_judge(cfg: RewardConfig, device: torch.device, seed: int = 0):
    """The judge of ``cfg.judge`` on ``device`` (None when the reward does not use one)."""
    if not cfg.uses_judge:
        return None
    j = cfg.judge
    on_cpu = device.type == "cpu"
    if j.kind == "scalar":
        return ScalarRewardModel.from_pretrained(j, device=str(device))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if on_cpu or j.dtype == "float32" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(j.model)
    model = AutoModelForCausalLM.from_pretrained(j.model, dtype=dtype)
    engine_cfg = HFEngineConfig(max_batch_rows=j.max_batch_rows, device=str(device))
    engine = HFRolloutEngine(model, tokenizer, config=engine_cfg)
    return engine_judge(j, engine, tokenizer, seed)
