"""Procedural verifiable tasks for runs without data files.

Our own generators (no dependency, deterministic): ``arithmetic`` ("What is 37 + 58?") and ``copy`` ("Repeat the
number 4817."), with knobs for operand digits, number of terms, operators and prompt style, and, for
vision-language policies, ``visual_count`` and ``visual_sum`` (:mod:`megatron_rlvr.data.visual`: a PIL-drawn image
per example, "How many circles are in the image?", "What is the sum of the numbers shown?"). At their easiest
(single-digit addition, terse style "3+5=", or copying one digit) a 2-layer model learns them in minutes on a CPU,
which the ``tiny`` preset relies on. ``reasoning_gym:<name>`` wraps a reasoning-gym task (optional dependency).

Example ``i`` depends only on (task knobs, seed, i): growing ``num_examples`` keeps the earlier examples.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rlvr.data.records import Example
from megatron_rlvr.data.visual import SHAPE_KINDS, visual_count, visual_sum

__all__ = ["PROCEDURAL_TASKS", "ProceduralConfig", "generate_examples"]

_OPERATORS = "+-*"


@dataclass
class ProceduralConfig:
    task: str = "arithmetic"
    """Task: "arithmetic", "copy", "visual_count", "visual_sum" (one image per example: vision-language policies),
    or "reasoning_gym:<dataset name>" (needs `pip install reasoning-gym`)."""
    num_examples: int = 10000
    """How many examples to generate (the sampler cycles through them in epochs)."""
    seed: int = 0
    """Generation seed; example i is a function of (knobs, seed, i) only."""
    min_digits: int = 1
    """Fewest digits per operand or visual_sum number (1 allows 0-9)."""
    max_digits: int = 1
    """Most digits per operand; each operand draws its digit count uniformly in [min_digits, max_digits]."""
    num_terms: int = 2
    """Operands per arithmetic expression; numbers drawn in a visual_sum image (copy, visual_count: ignored)."""
    operators: str = "+"
    """Operators to draw from, a subset of "+-*" (standard precedence; results may be negative with '-')."""
    style: str = "sentence"
    """Prompt wording: "sentence" ("What is 3 + 5?", "Repeat the number 7.") or "terse" ("3+5=", "7=",
    "circles=", "sum=")."""
    min_count: int = 1
    """visual_count: fewest shapes of the asked kind in an image."""
    max_count: int = 5
    """visual_count: most shapes of the asked kind (as many shapes of the other kinds may be added as distractors)."""
    shapes: str = "circle,square,triangle"
    """visual_count: comma-separated shape kinds drawn (from circle, square, triangle); the asked kind is one of them,
    the others are distractors. One kind: no distractors (the easiest version)."""
    image_size: int = 112
    """visual_count, visual_sum: image side in pixels (square RGB images)."""

    def __post_init__(self) -> None:
        if not (self.task in PROCEDURAL_TASKS or self.task.startswith("reasoning_gym:")):
            raise ValueError(
                f"data.procedural.task must be one of {sorted(PROCEDURAL_TASKS)} or 'reasoning_gym:<name>', "
                f"got {self.task!r}"
            )
        if self.task == "reasoning_gym:":
            raise ValueError(
                "data.procedural.task 'reasoning_gym:' needs a dataset name, e.g. 'reasoning_gym:basic_arithmetic'"
            )
        if not isinstance(self.num_examples, int) or self.num_examples < 1:
            raise ValueError(f"data.procedural.num_examples must be an int >= 1, got {self.num_examples!r}")
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(
                f"data.procedural needs 1 <= min_digits <= max_digits <= 18, got {self.min_digits}, {self.max_digits}"
            )
        if self.num_terms < 1 or (self.task == "arithmetic" and self.num_terms < 2):
            raise ValueError(f"data.procedural.num_terms must be >= 2 for arithmetic, got {self.num_terms}")
        if not self.operators or any(c not in _OPERATORS for c in self.operators):
            raise ValueError(
                f"data.procedural.operators must be a non-empty subset of {_OPERATORS!r}, got {self.operators!r}"
            )
        if self.style not in ("sentence", "terse"):
            raise ValueError(f"data.procedural.style must be 'sentence' or 'terse', got {self.style!r}")
        if not isinstance(self.min_count, int) or not isinstance(self.max_count, int):
            raise ValueError(
                f"data.procedural.min_count/max_count must be ints, got {self.min_count!r}, {self.max_count!r}"
            )
        if not 0 <= self.min_count <= self.max_count <= 36:
            raise ValueError(
                f"data.procedural needs 0 <= min_count <= max_count <= 36, got {self.min_count}, {self.max_count}"
            )
        kinds = self.shapes.split(",") if isinstance(self.shapes, str) else None
        if not kinds or any(k not in SHAPE_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"data.procedural.shapes must be distinct comma-separated kinds from {SHAPE_KINDS}, got {self.shapes!r}"
            )
        if not isinstance(self.image_size, int) or not 28 <= self.image_size <= 4096:
            raise ValueError(f"data.procedural.image_size must be an int in [28, 4096] pixels, got {self.image_size!r}")


def _operand(rng: random.Random, cfg: ProceduralConfig) -> int:
    d = rng.randint(cfg.min_digits, cfg.max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _evaluate(values: list[int], ops: list[str]) -> int:
    """Standard precedence: fold '*' first, then '+'/'-' left to right."""
    terms, signs = [values[0]], []
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = total + t if op == "+" else total - t
    return total


def _arithmetic(rng: random.Random, cfg: ProceduralConfig) -> tuple[str, str, dict, list]:
    values = [_operand(rng, cfg) for _ in range(cfg.num_terms)]
    ops = [rng.choice(cfg.operators) for _ in range(cfg.num_terms - 1)]
    sep = "" if cfg.style == "terse" else " "
    expr = str(values[0]) + "".join(f"{sep}{op}{sep}{v}" for op, v in zip(ops, values[1:]))
    prompt = f"{expr}=" if cfg.style == "terse" else f"What is {expr}?"
    level = max(len(str(v)) for v in values)
    return prompt, str(_evaluate(values, ops)), {"level": level, "num_terms": cfg.num_terms}, []


def _copy(rng: random.Random, cfg: ProceduralConfig) -> tuple[str, str, dict, list]:
    v = str(_operand(rng, cfg))
    prompt = f"{v}=" if cfg.style == "terse" else f"Repeat the number {v}."
    return prompt, v, {"level": len(v)}, []


PROCEDURAL_TASKS: dict[str, Callable[[random.Random, ProceduralConfig], tuple[str, str, dict, list]]] = {
    "arithmetic": _arithmetic,
    "copy": _copy,
    "visual_count": visual_count,
    "visual_sum": visual_sum,
}
"""Our own task generators: rng, config -> (prompt, answer, metadata, images)."""


def _reasoning_gym(cfg: ProceduralConfig) -> list[Example]:
    name = cfg.task.split(":", 1)[1]
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(f"data.procedural.task {cfg.task!r} needs `pip install reasoning-gym`") from e
    try:
        ds = reasoning_gym.create_dataset(name, size=cfg.num_examples, seed=cfg.seed)
    except Exception as e:
        raise ValueError(f"data.procedural.task {cfg.task!r}: reasoning-gym cannot create it: {e}") from e
    out = []
    for i, entry in enumerate(ds):
        meta = {"rg_dataset": name, "rg_entry": dict(entry)}
        difficulty = entry.get("metadata", {}).get("difficulty")
        if isinstance(difficulty, (int, float)):
            meta["level"] = difficulty
        out.append(
            Example(entry["question"], str(entry["answer"]), f"reasoning_gym:{name}", f"{name}-{cfg.seed}-{i}", meta)
        )
    return out


def generate_examples(cfg: ProceduralConfig) -> list[Example]:
    """``cfg.num_examples`` examples of ``cfg.task``, deterministic in ``cfg``."""
    if cfg.task.startswith("reasoning_gym:"):
        return _reasoning_gym(cfg)
    gen = PROCEDURAL_TASKS[cfg.task]
    source = f"procedural:{cfg.task}"
    out = []
    for i in range(cfg.num_examples):
        # A string seed goes through SHA-512 in random.seed: stable across processes and PYTHONHASHSEED.
        rng = random.Random(f"{cfg.task}:{cfg.seed}:{i}")
        prompt, answer, meta, images = gen(rng, cfg)
        out.append(Example(prompt, answer, source, f"{cfg.task}-{cfg.seed}-{i}", meta, images))
    return out
