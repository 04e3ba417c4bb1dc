"""Data rows with images: paths (relative to the data file, absolute), bytes, HF ``Image`` structs in parquet, the
``images`` / ``image`` fields under the problem/answer (geometry3k-, MMK12-like) and DAPO schemas; decoded pixels
equal the originals; malformed rows (missing file, undecodable bytes, marker count) give one line naming file and
row, or a counted skip; rendering puts one image part per image where the ``<image>`` markers are, and
tokenize_prompts gives ONE ``<|image_pad|>`` per image, which the Qwen-VL processor expands."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image, ImageDraw

from megatron_rlvr.data import DataConfig, Example, MalformedRowError, load_examples, render
from megatron_rlvr.data.images import load_image
from megatron_rlvr.data.templates import IMAGE_PLACEHOLDER, prompt_messages
from megatron_rlvr.families.tiny_vl import tiny_vl_tokenizer
from megatron_rlvr.rollout.groups import image_tokens, tokenize_prompts


def _picture(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    ImageDraw.Draw(im).ellipse((2, 2, 20, 20), fill=(255, 0, 0))
    return im


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == "RGB" and a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b.convert("RGB")))


def test_jsonl_paths_relative_absolute_and_markers(tmp_path):
    pics = [_picture(i) for i in range(3)]
    (tmp_path / "imgs").mkdir()
    for i, p in enumerate(pics):
        p.save(tmp_path / "imgs" / f"{i}.png")
    pics[2].convert("L").save(tmp_path / "gray.jpg")  # grayscale JPEG -> converted to RGB
    rows = [
        {
            "images": ["imgs/0.png", str(tmp_path / "imgs" / "1.png")],
            "problem": "<image>Left, <image> right?",
            "answer": 3,
        },
        {"image": "imgs/2.png", "question": "How many?", "answer": "4", "subject": "math", "id": "q7"},  # MMK12-like
        {"problem": "no image", "answer": "1"},
        {"images": ["gray.jpg"], "problem": "Gray <image>", "answer": "2"},
    ]
    ds = load_examples(_jsonl(tmp_path / "train.jsonl", rows))
    a, b, c, d = ds.examples
    assert _same(a.images[0], pics[0]) and _same(a.images[1], pics[1]) and a.answer == "3"
    assert _same(b.images[0], pics[2]) and b.prompt == "How many?" and b.id == "q7"
    assert b.metadata == {"subject": "math", "id": "q7"}  # image fields are not metadata
    assert c.images == [] and d.images[0].mode == "RGB" and d.images[0].size == (40, 30)


def test_parquet_hf_image_structs_and_dapo_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pics = [_picture(10), _picture(11, (24, 56))]
    pics[1].save(tmp_path / "p1.png")
    table = pa.Table.from_pylist(
        [
            # datasets' Image feature in parquet: {bytes, path}; bytes win, else the path
            {"images": [{"bytes": _png(pics[0]), "path": "ignored.png"}], "problem": "Q0 <image>", "answer": "5"},
            {"images": [{"bytes": None, "path": "p1.png"}], "problem": "<image> Q1", "answer": "6"},
        ]
    )
    pq.write_table(table, tmp_path / "train.parquet")
    ds = load_examples(str(tmp_path / "train.parquet"))
    assert _same(ds[0].images[0], pics[0]) and _same(ds[1].images[0], pics[1])

    dapo = [
        {
            "prompt": [{"role": "user", "content": "<image>What is the area?"}],
            "images": [{"bytes": None, "path": "p1.png"}],
            "reward_model": {"ground_truth": "12"},
            "data_source": "geo3k",
        }
    ]
    ex = load_examples(_jsonl(tmp_path / "dapo.jsonl", dapo))[0]
    assert ex.source == "geo3k" and _same(ex.images[0], pics[1])
    assert prompt_messages(ex) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the area?"}]}
    ]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"images": ["imgs/ok.png", "imgs/missing.png"], "problem": "p", "answer": "1"},
         r"train.jsonl:2: field 'images'\[1\]: image file not found: .*imgs/missing.png"),
        ({"images": [{"bytes": None, "path": None}], "problem": "p", "answer": "1"},
         r"train.jsonl:2: field 'images'\[0\]: an image dict needs 'bytes' or a non-empty 'path'"),
        ({"image": "imgs/broken.png", "problem": "p", "answer": "1"},
         r"train.jsonl:2: field 'image'\[0\]: cannot decode image file .*broken.png: UnidentifiedImageError"),
        ({"images": ["imgs/truncated.png"], "problem": "p", "answer": "1"},
         r"train.jsonl:2: field 'images'\[0\]: cannot decode image file .*truncated.png: OSError"),
        ({"images": ["imgs/ok.png"], "problem": "<image> vs <image>", "answer": "1"},
         r"train.jsonl:2: the prompt has 2 '<image>' markers for 1 images"),
        ({"images": [3], "problem": "p", "answer": "1"},
         r"train.jsonl:2: field 'images'\[0\]: an image must be a path, bytes or a \{'bytes', 'path'\} dict, got int"),
    ],
)  # fmt: skip
def test_malformed_image_rows_name_file_and_row(tmp_path, row, message):
    (tmp_path / "imgs").mkdir()
    _picture(0).save(tmp_path / "imgs" / "ok.png")
    (tmp_path / "imgs" / "broken.png").write_bytes(b"not an image at all")
    (tmp_path / "imgs" / "truncated.png").write_bytes(_png(_picture(1, (64, 64)))[:200])
    good = {"images": ["imgs/ok.png"], "problem": "fine", "answer": "2"}
    path = _jsonl(tmp_path / "train.jsonl", [good, row, good])
    with pytest.raises(MalformedRowError, match=message):
        load_examples(path)
    ds = load_examples(path, skip_malformed=True)
    assert len(ds) == 2 and ds.n_malformed == 1 and ds.malformed[0].split(": ", 1)[0].endswith("train.jsonl:2")


def test_load_image_bytes_directly():
    im = _picture(3)
    assert _same(load_image(_png(im)), im) and _same(load_image({"bytes": _png(im)}), im)
    with pytest.raises(ValueError, match=r"cannot decode image bytes \(5 bytes\)"):
        load_image(b"hello")


def test_rendering_one_pad_per_image_where_the_markers_are():
    tok = tiny_vl_tokenizer()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    two = Example("A<image>B<image>C", "1", "s", "x", images=[_picture(0), _picture(1)])
    first = Example("How many?", "1", "s", "y", images=[_picture(2)])
    chat = DataConfig(template="chat", prompt_template="{problem}")
    assert render(two, chat, tok) == (
        "<|im_start|>user\nA" + IMAGE_PLACEHOLDER + "B" + IMAGE_PLACEHOLDER + "C<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(first, chat, tok).startswith("<|im_start|>user\n" + IMAGE_PLACEHOLDER + "How many?")
    with_system = DataConfig(template="chat", prompt_template="{problem}", system_prompt="Be brief.")
    assert prompt_messages(first, "{problem}", "Be brief.")[0] == {"role": "system", "content": "Be brief."}
    plain = DataConfig(template="plain", prompt_template="{problem}")
    assert render(first, plain) == IMAGE_PLACEHOLDER + "How many?"
    assert render(two, plain) == "A" + IMAGE_PLACEHOLDER + "B" + IMAGE_PLACEHOLDER + "C"

    kept, ids, too_long = tokenize_prompts([two, first], tok, with_system, max_prompt_len=200)
    assert too_long == 0 and [ids[0].count(pad), ids[1].count(pad)] == [2, 1]
    # a chat template that drops image parts leaves no pad: a clear error, not a silent text-only prompt
    tok.chat_template = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"example x: its rendered prompt holds 0 <\|image_pad\|> tokens for 2 images"):
        tokenize_prompts([two], tok, chat, max_prompt_len=200)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_processor_expands_the_rendered_pads(kind):
    """The rendered prompt is what the Qwen-VL processor expects: it expands each pad to the image's merged patches."""
    from megatron_rlvr.data import ProceduralConfig, generate_examples
    from megatron_rlvr.families.tiny_vl import tiny_image_processor
    from megatron_rlvr.families.vl_processor import vl_processor

    tok = tiny_vl_tokenizer()
    proc = vl_processor(kind, tiny_image_processor(kind), tok)
    ex = generate_examples(ProceduralConfig(task="visual_count", num_examples=1, image_size=112))[0]
    ex.images.append(_picture(5, (60, 90)))
    ex.prompt = "<image> and <image>: " + ex.prompt
    text = render(ex, DataConfig(template="chat", prompt_template="{problem}"), tok)
    out = proc(text=[text], images=ex.images, return_tensors="pt")
    merge = proc.image_processor.merge_size**2
    expected = [int(g.prod()) // merge for g in out["image_grid_thw"]]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert int((out["input_ids"][0] == pad).sum()) == sum(expected) and len(expected) == 2
    # tokenize_prompts with the image processor measures the expanded prompt against max_prompt_len
    assert [image_tokens(im, proc.image_processor) for im in ex.images] == expected
    full = out["input_ids"].shape[1]
    cfg = DataConfig(template="chat", prompt_template="{problem}")
    _, ids, too_long = tokenize_prompts([ex], tok, cfg, full, proc.image_processor)
    assert too_long == 0 and len(ids[0]) == full - sum(expected) + 2  # one pad per image in the ids
    assert tokenize_prompts([ex], tok, cfg, full - 1, proc.image_processor)[2] == 1
    assert tokenize_prompts([ex], tok, cfg, full - 1)[2] == 0  # without it only the unexpanded ids count


def test_an_image_over_pillows_pixel_limit_is_a_malformed_row(tmp_path, monkeypatch):
    """Pillow refuses to decode an image of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels with a
    DecompressionBombError, which is neither an OSError nor a ValueError: it escaped as an unexpected error (rc 1,
    no file or row named) and data.skip_malformed did not skip it. Here the limit is lowered to 100 pixels so that a
    40 x 30 picture passes it twice over."""
    (tmp_path / "imgs").mkdir()
    _picture(0).save(tmp_path / "imgs" / "big.png")
    good = {"problem": "fine", "answer": "2"}
    path = _jsonl(tmp_path / "train.jsonl", [good, {"images": ["imgs/big.png"], "problem": "p", "answer": "1"}, good])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    pattern = r"train.jsonl:2: field 'images'\[0\]: image file .*big.png is larger than Pillow's pixel limit .*1200"
    with pytest.raises(MalformedRowError, match=pattern + r".*data\.skip_malformed=true"):
        load_examples(path)
    ds = load_examples(path, skip_malformed=True)
    assert len(ds) == 2 and ds.n_malformed == 1
