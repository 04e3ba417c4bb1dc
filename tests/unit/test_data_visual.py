"""The procedural visual-math tasks (visual_count, visual_sum): the answer is what the image shows, checked from the
pixels independently of the generator (connected components classified by how much of their bounding box they fill;
digits read back by template matching), on hand-made scenes and on generated ones; the built-in rewards score the
integer answers; determinism and the config's errors."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_rlvr.data import DataConfig, Example, ProceduralConfig, build_train_dataset, generate_examples
from megatron_rlvr.data.visual import (
    NumberScene,
    ShapeScene,
    number_layout,
    render_numbers,
    render_shapes,
)
from megatron_rlvr.rewards import ExactStopReward, NumericReward


def _components(img) -> list[tuple[int, int, int, int, int]]:
    """Connected components (4-neighbour) of non-white pixels: (pixel count, x0, y0, x1, y1) each."""
    a = np.asarray(img.convert("RGB")).astype(int)
    ink = (a.min(axis=2) < 200) & (a.max(axis=2) - a.min(axis=2) > 60)  # saturated: a shape, not anti-aliasing
    seen = np.zeros_like(ink)
    out = []
    h, w = ink.shape
    for y in range(h):
        for x in range(w):
            if not ink[y, x] or seen[y, x]:
                continue
            q, n, xs, ys = deque([(y, x)]), 0, [], []
            seen[y, x] = True
            while q:
                cy, cx = q.popleft()
                n += 1
                xs.append(cx)
                ys.append(cy)
                for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                    if 0 <= ny < h and 0 <= nx < w and ink[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        q.append((ny, nx))
            out.append((n, min(xs), min(ys), max(xs), max(ys)))
    return out


def _count_by_kind(img) -> dict[str, int]:
    """Shapes read from the pixels: fill ratio of the bounding box ~1 square, ~pi/4 circle, ~1/2 triangle."""
    counts = {"circle": 0, "square": 0, "triangle": 0}
    for n, x0, y0, x1, y1 in _components(img):
        ratio = n / ((x1 - x0 + 1) * (y1 - y0 + 1))
        kind = "square" if ratio > 0.92 else "circle" if ratio > 0.65 else "triangle"
        counts[kind] += 1
    return counts


def test_hand_made_shape_scene_shows_its_answer():
    scene = ShapeScene(
        cells=3,
        shapes=((0, "circle", "red"), (2, "square", "blue"), (4, "circle", "green"), (7, "triangle", "orange")),
        target="circle",
    )
    assert scene.answer == 2
    for side in (56, 112):
        img = render_shapes(scene, side)
        assert img.mode == "RGB" and img.size == (side, side)
        assert _count_by_kind(img) == {"circle": 2, "square": 1, "triangle": 1}
    assert ShapeScene(3, scene.shapes, "triangle").answer == 1
    assert ShapeScene(3, (), "square").answer == 0 and _components(render_shapes(ShapeScene(3, (), "square"), 56)) == []


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(shapes="circle", min_count=1, max_count=2, image_size=56),
        dict(min_count=0, max_count=8, image_size=224),
    ],
)
def test_generated_visual_count_answers_match_the_pixels(knobs):
    exs = generate_examples(ProceduralConfig(task="visual_count", num_examples=25, **knobs))
    for ex in exs:
        (img,) = ex.images
        counts = _count_by_kind(img)
        target = ex.metadata["target"]
        assert ex.prompt == f"How many {target}s are in the image?"
        assert counts[target] == int(ex.answer), (ex.id, counts, ex.answer)
        assert sum(counts.values()) == ex.metadata["num_shapes"]
    answers = {int(e.answer) for e in exs}
    lo, hi = knobs.get("min_count", 1), knobs.get("max_count", 5)
    assert answers <= set(range(lo, hi + 1)) and len(answers) > 1


def _read_numbers(img, n_numbers: int, digits: int) -> list[int]:
    """Each number read back from the ink (any colour) in its slot, compared with every candidate value of
    ``digits`` digits drawn alone at the same place: the candidate whose ink differs in the fewest pixels wins."""
    side = img.size[0]
    real = np.asarray(img.convert("L")) < 200
    candidates = range(10) if digits == 1 else range(10 ** (digits - 1), 10**digits)
    # drawn here with PIL directly (not the renderer) at the layout's size and places
    size, corners = number_layout(NumberScene(((candidates[-1], "red"),) * n_numbers), side)
    font = ImageFont.load_default(size=size)
    refs = {}
    for v in candidates:
        ref = Image.new("L", (side, side), 255)
        for xy in corners:
            ImageDraw.Draw(ref).text(xy, str(v), fill=0, font=font)
        refs[v] = np.asarray(ref) < 200
    out = []
    for i in range(n_numbers):
        slot = slice(round(i * side / n_numbers), round((i + 1) * side / n_numbers))
        assert real[:, slot].sum() > 4, "no ink in the slot"
        out.append(min(candidates, key=lambda v: int((refs[v][:, slot] != real[:, slot]).sum())))
    return out


def test_hand_made_number_scene_shows_its_answer():
    scene = NumberScene(((3, "blue"), (8, "green"), (5, "orange")))
    assert scene.answer == 16
    img = render_numbers(scene, 112)
    assert img.size == (112, 112) and img.mode == "RGB"
    assert _read_numbers(img, 3, 1) == [3, 8, 5]
    size, corners = number_layout(scene, 112)
    assert len(corners) == 3 and size >= 20  # legible: digits at least 20 px high in a 112 px image


@pytest.mark.parametrize("knobs", [dict(), dict(num_terms=3, image_size=64), dict(min_digits=2, max_digits=2)])
def test_generated_visual_sum_answers_match_the_pixels(knobs):
    exs = generate_examples(ProceduralConfig(task="visual_sum", num_examples=6, **knobs))
    digits = knobs.get("max_digits", 1)
    for ex in exs:
        n = ex.metadata["num_terms"]
        assert sum(_read_numbers(ex.images[0], n, digits)) == int(ex.answer), ex.id
        assert ex.prompt == "What is the sum of the numbers shown?"


def test_rewards_score_the_integer_answers():
    ex = generate_examples(ProceduralConfig(task="visual_count", num_examples=1))[0]
    right, wrong = ex.answer, str(int(ex.answer) + 1)
    exact = ExactStopReward("full")
    assert exact(right, ex.answer, finish_reason="stop") == 1.0
    assert exact(wrong, ex.answer, finish_reason="stop") == 0.0
    assert exact(right, ex.answer, finish_reason="length") == 0.0
    numeric = NumericReward("lenient")
    assert numeric(f"I count {right} of them.", ex.answer) == 1.0
    assert numeric(f"I count {wrong} of them.", ex.answer) == 0.0
    assert NumericReward("boxed")(f"\\boxed{{{right}}}", ex.answer) == 1.0


def test_visual_tasks_are_deterministic_and_prefix_stable():
    cfg = ProceduralConfig(task="visual_count", num_examples=12, seed=3)
    a, b = generate_examples(cfg), generate_examples(cfg)
    assert a == b  # PIL images compare by mode, size and pixels
    assert generate_examples(ProceduralConfig(task="visual_count", num_examples=20, seed=3))[:12] == a
    other = generate_examples(ProceduralConfig(task="visual_count", num_examples=12, seed=4))
    assert [e.images[0].tobytes() for e in other] != [e.images[0].tobytes() for e in a]
    terse = generate_examples(ProceduralConfig(task="visual_sum", num_examples=2, style="terse"))
    assert terse[0].prompt == "sum=" and terse[0].source == "procedural:visual_sum"
    ds = build_train_dataset(DataConfig(template="plain", procedural={"task": "visual_count", "num_examples": 3}))
    assert len(ds) == 3 and all(len(e.images) == 1 for e in ds.examples)
    # text tasks carry no images
    assert generate_examples(ProceduralConfig(task="copy", num_examples=2))[0].images == []
    assert Example("p", "1", "s", "i").images == []


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(shapes="circle,hexagon"), r"data.procedural.shapes must be distinct comma-separated kinds"),
        (dict(shapes="circle,circle"), r"data.procedural.shapes must be distinct"),
        (dict(min_count=3, max_count=2), r"0 <= min_count <= max_count <= 36, got 3, 2"),
        (dict(image_size=10), r"data.procedural.image_size must be an int in \[28, 4096\]"),
    ],
)
def test_visual_config_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        ProceduralConfig(task="visual_count", **knobs)


def test_easy_counts_differ_in_the_image():
    """The easy version (one kind, 1-2 shapes): images of different answers differ in their ink, so a policy that
    looks can tell them apart."""
    exs = generate_examples(
        ProceduralConfig(task="visual_count", shapes="circle", min_count=1, max_count=2, image_size=56, num_examples=40)
    )
    ink = {}
    for e in exs:
        ink.setdefault(e.answer, []).append(sum(n for n, *_ in _components(e.images[0])))
    assert set(ink) == {"1", "2"}
    assert max(ink["1"]) < min(ink["2"])
