"""Procedural visual-math tasks for vision-language policies: PIL draws the image, nothing is downloaded.

- ``visual_count``: filled shapes (circle, square, triangle) on a grid of cells, one shape per cell; "How many
  circles are in the image?" (terse: "circles="). The answer is the number of shapes of the asked kind.
- ``visual_sum``: ``num_terms`` numbers drawn side by side in colour; "What is the sum of the numbers shown?" (terse:
  "sum="). The answer is their sum.

Each task is split into a scene (what is drawn: :class:`ShapeScene`, :class:`NumberScene`, sampled from an rng and
the config), a renderer (scene -> PIL RGB image) and the answer (a function of the scene alone), so tests can draw
hand-made scenes and check the answer from the pixels independently. Answers are integers: the built-in rewards
``exact_stop`` (``extraction: full``: the answer then EOS, for tiny models) and ``gsm8k`` (exact numeric match, e.g.
``extraction: lenient`` or ``boxed`` for instruction-tuned models) score them.

Difficulty knobs (:class:`~megatron_rlvr.data.procedural.ProceduralConfig`): ``min_count``/``max_count`` (how many of
the asked shape), ``shapes`` (the kinds drawn; one kind means no distractors), ``image_size`` (pixels per side),
``num_terms`` and ``min_digits``/``max_digits`` (visual_sum). The easiest version, 1-2 circles of one kind on a 2 x 2
grid, is learnable by a randomly initialised 2-layer VL model on a CPU.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COLOURS",
    "SHAPE_KINDS",
    "NumberScene",
    "ShapeScene",
    "render_numbers",
    "render_shapes",
    "sample_number_scene",
    "sample_shape_scene",
]

SHAPE_KINDS = ("circle", "square", "triangle")
"""The shapes ``visual_count`` draws."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "blue": (30, 60, 220),
    "green": (30, 160, 60),
    "orange": (240, 140, 20),
}
"""Fill colours (saturated, far from the white background)."""

BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class ShapeScene:
    """Shapes on a ``cells`` x ``cells`` grid: ``shapes[i] = (cell index, kind, colour name)``, at most one shape per
    cell (cell ``c`` is row ``c // cells``, column ``c % cells``); the question asks for the number of ``target``."""

    cells: int
    shapes: tuple[tuple[int, str, str], ...]
    target: str

    @property
    def answer(self) -> int:
        return sum(kind == self.target for _, kind, _ in self.shapes)


@dataclass(frozen=True)
class NumberScene:
    """Numbers drawn left to right, each in a colour: ``numbers[i] = (value, colour name)``; the answer is the sum."""

    numbers: tuple[tuple[int, str], ...]

    @property
    def answer(self) -> int:
        return sum(v for v, _ in self.numbers)


def grid_cells(max_shapes: int) -> int:
    """The grid side that holds ``max_shapes`` shapes (at least 2 x 2)."""
    return max(2, math.ceil(math.sqrt(max_shapes)))


def sample_shape_scene(
    rng: random.Random, min_count: int, max_count: int, kinds: tuple[str, ...], max_distractors: int | None = None
) -> ShapeScene:
    """A scene with ``randint(min_count, max_count)`` shapes of a target kind drawn from ``kinds`` and, when
    ``kinds`` has more than one, up to ``max_distractors`` (default ``max_count``) shapes of the other kinds, in
    random cells of the smallest grid that holds them all."""
    target = rng.choice(kinds)
    others = [k for k in kinds if k != target]
    n_max_distractors = (max_count if max_distractors is None else max_distractors) if others else 0
    cells = grid_cells(max_count + n_max_distractors)
    count = rng.randint(min_count, max_count)
    n_distractors = rng.randint(0, n_max_distractors) if others else 0
    slots = rng.sample(range(cells * cells), count + n_distractors)
    colours = list(COLOURS)
    shapes = tuple(
        (slot, target if i < count else rng.choice(others), rng.choice(colours)) for i, slot in enumerate(slots)
    )
    return ShapeScene(cells, tuple(sorted(shapes)), target)


def render_shapes(scene: ShapeScene, side: int):
    """The scene as a ``side`` x ``side`` PIL RGB image: each shape fills its cell less a margin of 1/6 of the cell
    (circles: the inscribed ellipse; triangles: apex up), so shapes never touch."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(im)
    c = side / scene.cells
    m = max(1.0, c / 6)
    for slot, kind, colour in scene.shapes:
        x0, y0 = (slot % scene.cells) * c, (slot // scene.cells) * c
        box = (round(x0 + m), round(y0 + m), round(x0 + c - m) - 1, round(y0 + c - m) - 1)
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        elif kind == "triangle":
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
        else:
            raise ValueError(f"unknown shape kind {kind!r}; known: {SHAPE_KINDS}")
    return im


def sample_number_scene(rng: random.Random, num_terms: int, min_digits: int, max_digits: int) -> NumberScene:
    """``num_terms`` numbers of ``randint(min_digits, max_digits)`` digits each (one digit allows 0-9)."""
    out = []
    for _ in range(num_terms):
        d = rng.randint(min_digits, max_digits)
        out.append((rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1), rng.choice(list(COLOURS))))
    return NumberScene(tuple(out))


@functools.lru_cache(maxsize=16)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)  # Pillow's bundled scalable font (needs FreeType; Pillow >= 10.1)


def number_layout(scene: NumberScene, side: int) -> tuple[int, list[tuple[int, int]]]:
    """The font size and each number's drawing origin: the numbers share the width in equal slots, the font as large
    as the longest number allows (a digit of Pillow's default font is ~0.6 x size wide; its ink spans ~0.25 x size
    to 1.0 x size below the origin), the ink centred vertically."""
    longest = max(len(str(v)) for v, _ in scene.numbers)
    slot = side / len(scene.numbers)
    size = max(6, min(int(0.9 * side), int(slot / (0.6 * longest + 0.2))))
    y = round((side - 0.75 * size) / 2 - 0.25 * size)
    return size, [(round(i * slot + 0.1 * size), y) for i in range(len(scene.numbers))]


def render_numbers(scene: NumberScene, side: int):
    """The scene as a ``side`` x ``side`` PIL RGB image (see :func:`number_layout`)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(im)
    size, corners = number_layout(scene, side)
    for (value, colour), xy in zip(scene.numbers, corners):
        draw.text(xy, str(value), fill=COLOURS[colour], font=_font(size))
    return im


def visual_count(rng: random.Random, cfg: Any) -> tuple[str, str, dict, list]:
    """Task generator (see :mod:`megatron_rlvr.data.procedural`): a shape-count question and its image."""
    kinds = tuple(cfg.shapes.split(","))
    scene = sample_shape_scene(rng, cfg.min_count, cfg.max_count, kinds)
    prompt = f"{scene.target}s=" if cfg.style == "terse" else f"How many {scene.target}s are in the image?"
    meta = {"level": len(scene.shapes), "target": scene.target, "num_shapes": len(scene.shapes)}
    return prompt, str(scene.answer), meta, [render_shapes(scene, cfg.image_size)]


def visual_sum(rng: random.Random, cfg: Any) -> tuple[str, str, dict, list]:
    """Task generator: a sum-of-the-numbers question and its image."""
    scene = sample_number_scene(rng, cfg.num_terms, cfg.min_digits, cfg.max_digits)
    prompt = "sum=" if cfg.style == "terse" else "What is the sum of the numbers shown?"
    meta = {"level": max(len(str(v)) for v, _ in scene.numbers), "num_terms": len(scene.numbers)}
    return prompt, str(scene.answer), meta, [render_numbers(scene, cfg.image_size)]
