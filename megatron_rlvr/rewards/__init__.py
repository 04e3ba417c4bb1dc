"""Correctness rewards for RLVR: math-verify equivalence, GSM8K exact numbers, exact answers that must end by
themselves (procedural tasks), programs against test cases in the sandbox (``code``), user functions by dotted
path, scored in reusable worker processes with a per-item timeout (crash or timeout -> reward 0, counted).

    with RewardManager(RewardConfig(fn="math")) as rm:
        rewards, stats = rm.score(responses, ground_truths, metas)

Importing this package is light (no sympy/math-verify); workers import the reward function themselves.
"""

from megatron_rlvr.rewards.builtin import (
    REWARD_FNS,
    CodeReward,
    ExactStopReward,
    MathVerifyReward,
    NumericReward,
    ReasoningGymReward,
)
from megatron_rlvr.rewards.extract import EXTRACTION_MODES, extract_answer, last_boxed, last_number, parse_number
from megatron_rlvr.rewards.manager import RewardManager
from megatron_rlvr.rewards.pool import ItemResult
from megatron_rlvr.rewards.reward_config import RewardConfig
from megatron_rlvr.rewards.scorers import build_scorer, load_reward_fn

__all__ = [
    "EXTRACTION_MODES",
    "REWARD_FNS",
    "CodeReward",
    "ExactStopReward",
    "ItemResult",
    "MathVerifyReward",
    "NumericReward",
    "ReasoningGymReward",
    "RewardConfig",
    "RewardManager",
    "build_scorer",
    "extract_answer",
    "last_boxed",
    "last_number",
    "load_reward_fn",
    "parse_number",
]
