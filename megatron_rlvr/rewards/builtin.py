"""Built-in correctness rewards: math-verify equivalence, GSM8K exact numeric match, reasoning-gym scorers, programs
against test cases (:mod:`megatron_rlvr.rewards.code_reward`).

Each is a small class built from the extraction mode and called as ``fn(response, ground_truth, **metadata) ->
float`` (the same signature as user reward functions), so a user function can wrap one. They run inside the
reward worker processes (:mod:`megatron_rlvr.rewards.pool`), which enforce the per-item timeout; math-verify's own
``signal.alarm`` timeouts are therefore switched off here (they would cancel the worker's timer).
"""

from __future__ import annotations

import functools
import logging
import re

from megatron_rlvr.rewards.code_reward import CodeReward
from megatron_rlvr.rewards.extract import EXTRACTION_MODES, extract_answer, last_number, parse_number

__all__ = ["REWARD_FNS", "ExactStopReward", "MathVerifyReward", "NumericReward", "ReasoningGymReward"]


class MathVerifyReward:
    """1.0 if the extracted answer is mathematically equivalent to the ground truth under math-verify
    (numeric within its rounding, symbolic via sympy simplification, tuples/intervals/sets/matrices), else 0.0.

    The candidate is parsed as LaTeX; if that does not match, once more with plain-text names mapped to LaTeX
    (``pi`` -> ``\\pi``, ``sqrt`` -> ``\\sqrt``), so "(3, pi/2)" matches ``\\left( 3, \\frac{\\pi}{2} \\right)``.
    In ``lenient`` mode a response without an extractable answer is handed to math-verify whole (it finds the last
    LaTeX/expression itself).
    """

    _PLAIN_NAMES = (
        (re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])"), r"\\pi "),
        (re.compile(r"(?<![\\A-Za-z])sqrt"), r"\\sqrt"),
    )

    def __init__(self, extraction: str = "boxed"):
        if extraction not in EXTRACTION_MODES:
            raise ValueError(f"extraction must be one of {EXTRACTION_MODES}, got {extraction!r}")
        self.extraction = extraction
        # Imported here so that only worker processes pay sympy's import; timeouts off (the worker enforces its own)
        # and its one-time "timeout is disabled" warning silenced.
        import math_verify
        from math_verify import LatexExtractionConfig

        logging.getLogger("math_verify").setLevel(logging.ERROR)
        self._mv = math_verify
        self._latex_cfg = [LatexExtractionConfig()]
        # A group of rollouts shares one ground truth: parse it once per worker.
        self._gold = functools.lru_cache(maxsize=4096)(self.parse_gold)

    def _parse_boxed(self, s: str) -> list:
        return self._mv.parse("\\boxed{" + s + "}", extraction_config=self._latex_cfg, parsing_timeout=None)

    def parse_gold(self, ground_truth: str) -> list:
        gt = ground_truth.strip().strip("$").strip()
        gold = self._parse_boxed(gt)
        if not gold:
            gold = self._mv.parse(gt, parsing_timeout=None)
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
        return gold

    def _equal(self, gold: list, pred: list) -> bool:
        return bool(pred) and self._mv.verify(gold, pred, timeout_seconds=None)

    def __call__(self, response: str, ground_truth: str, **metadata) -> float:
        gold = self._gold(ground_truth)
        candidate = extract_answer(response, self.extraction)
        if candidate is None:
            if self.extraction != "lenient":
                return 0.0
            return 1.0 if self._equal(gold, self._mv.parse(response, parsing_timeout=None)) else 0.0
        candidate = candidate.strip().strip("$").strip()  # "Answer: $\frac{1}{2}$" (DAPO format)
        if self._equal(gold, self._parse_boxed(candidate)):
            return 1.0
        plain = candidate
        for pattern, repl in self._PLAIN_NAMES:
            plain = pattern.sub(repl, plain)
        if plain != candidate and self._equal(gold, self._parse_boxed(plain)):
            return 1.0
        return 0.0

    @staticmethod
    def has_answer(response: str, extraction: str) -> bool:
        """An answer was found to score (``reward/n_no_answer`` counts the others). In ``lenient`` mode a response
        without an explicit answer is parsed whole by math-verify, which finds the last number or LaTeX expression:
        counted as answered when it has either."""
        if extract_answer(response, extraction) is not None:
            return True
        return extraction == "lenient" and (last_number(response) is not None or "$" in response or "\\" in response)

    def warmup(self) -> None:
        """Load math-verify's ANTLR parser once so the first real item is not charged for it."""
        self(r"\boxed{\frac{1}{2}}", "0.5")


class NumericReward:
    """GSM8K-style exact numeric match: 1.0 if the extracted answer and the ground truth parse to the same number
    after stripping commas, ``$``, units and ``%`` (:func:`~megatron_rlvr.rewards.extract.parse_number`), else 0.0.
    In ``lenient`` mode a response without an extractable answer is scored on its last number."""

    @staticmethod
    def candidate(response: str, extraction: str) -> str | None:
        """The answer scored: the extracted one, in ``lenient`` mode else the last number."""
        found = extract_answer(response, extraction)
        if found is None and extraction == "lenient":
            found = last_number(response)
        return found

    @classmethod
    def has_answer(cls, response: str, extraction: str) -> bool:
        """An answer was found to score (``reward/n_no_answer`` counts the others)."""
        return cls.candidate(response, extraction) is not None

    def __init__(self, extraction: str = "boxed"):
        if extraction not in EXTRACTION_MODES:
            raise ValueError(f"extraction must be one of {EXTRACTION_MODES}, got {extraction!r}")
        self.extraction = extraction

    def __call__(self, response: str, ground_truth: str, **metadata) -> float:
        gold = parse_number(ground_truth)
        if gold is None:
            raise ValueError(f"ground truth {ground_truth!r} is not a number (use reward fn 'math' for LaTeX answers)")
        candidate = self.candidate(response, self.extraction)
        if candidate is None:
            return 0.0
        pred = parse_number(candidate)
        return 1.0 if pred is not None and pred == gold else 0.0


class ReasoningGymReward:
    """Scores with the reasoning-gym task's own scorer; needs the metadata written by the reasoning-gym data source
    (``rg_dataset``, ``rg_entry``). The answer is extracted from the response first (boxed/lenient/full)."""

    def __init__(self, extraction: str = "boxed"):
        if extraction not in EXTRACTION_MODES:
            raise ValueError(f"extraction must be one of {EXTRACTION_MODES}, got {extraction!r}")
        self.extraction = extraction
        try:
            import reasoning_gym
        except ImportError as e:  # pragma: no cover - depends on the optional install
            raise ValueError("reward fn 'reasoning_gym' needs `pip install reasoning-gym`") from e
        self._rg = reasoning_gym

    @staticmethod
    def has_answer(response: str, extraction: str) -> bool:
        """An answer was found to score (``reward/n_no_answer`` counts the others)."""
        return extract_answer(response, extraction) is not None

    def __call__(self, response: str, ground_truth: str, **metadata) -> float:
        if "rg_dataset" not in metadata or "rg_entry" not in metadata:
            raise ValueError("reasoning_gym reward needs metadata 'rg_dataset' and 'rg_entry' (from the data source)")
        candidate = extract_answer(response, self.extraction)
        if candidate is None:
            return 0.0
        score = self._rg.get_score_answer_fn(metadata["rg_dataset"])
        return float(score(candidate, metadata["rg_entry"]))


class ExactStopReward:
    """1.0 if the response ended by itself and its answer is exactly the ground truth, else 0.0: the sample's
    ``finish_reason`` (passed with the metadata of every trained or evaluated sample) must be ``"stop"`` (EOS or a
    stop string within the generation limit; ``"length"``, cut at ``rollout.max_response_len``, scores 0), and the
    extracted answer, stripped, must equal the stripped ground truth as a string. In ``lenient`` mode a response
    without an extractable answer is compared whole. Meant for procedural tasks whose answers are just a number
    (``extraction: full``): the ``tiny`` preset's copy task, "7=" -> "7" then EOS."""

    def __init__(self, extraction: str = "full"):
        if extraction not in EXTRACTION_MODES:
            raise ValueError(f"extraction must be one of {EXTRACTION_MODES}, got {extraction!r}")
        self.extraction = extraction

    @staticmethod
    def has_answer(response: str, extraction: str) -> bool:
        """An answer was found to score (``reward/n_no_answer`` counts the others); ``lenient`` compares the whole
        response, so every response has one there."""
        return extraction == "lenient" or extract_answer(response, extraction) is not None

    def __call__(self, response: str, ground_truth: str, finish_reason: str | None = None, **metadata) -> float:
        if finish_reason not in ("stop", "length"):
            raise ValueError(
                f"reward fn 'exact_stop' needs the sample's finish_reason ('stop' or 'length'), got {finish_reason!r}"
            )
        if finish_reason != "stop":
            return 0.0
        candidate = extract_answer(response, self.extraction)
        if candidate is None and self.extraction == "lenient":
            candidate = response
        return 1.0 if candidate is not None and candidate.strip() == ground_truth.strip() else 0.0


REWARD_FNS = {
    "math": MathVerifyReward,
    "gsm8k": NumericReward,
    "reasoning_gym": ReasoningGymReward,
    "exact_stop": ExactStopReward,
    "code": CodeReward,
}
"""Built-in reward names (``RewardConfig.fn``) -> class built as ``cls(extraction=..., **options)`` (options:
:meth:`~megatron_rlvr.rewards.reward_config.RewardConfig.scorer_options`)."""
