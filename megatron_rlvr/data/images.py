"""Images of data rows for vision-language policies: where a row keeps them and how they are decoded.

A row's images are in ``images`` (a list, the EasyR1 / verl / LLaMA-Factory convention) or ``image`` (one image or a
list: MMK12-style rows, HF ``datasets`` with one ``Image`` column). Each image is one of:

- a path string: absolute, or relative to the data file's folder (``~`` expanded);
- a dict ``{"bytes": ..., "path": ...}``: how an HF ``datasets`` ``Image`` feature is stored in parquet; the bytes
  are used when present, else the path;
- raw encoded bytes (PNG, JPEG, ... anything Pillow reads).

Images are decoded once at load time (a broken file fails there, naming the data file and row) and kept as RGB PIL
images: decoded pixels are held in memory for the whole run (a 448 x 448 RGB image is 0.6 MB).

In the problem text, ``<image>`` marks where an image goes (one per image, in order); without any, the images come
before the text. :mod:`megatron_rlvr.data.templates` renders them as the chat template's image parts.
"""

from __future__ import annotations

import io
import os
from typing import Any

__all__ = ["IMAGE_KEYS", "IMAGE_MARKER", "load_image", "row_images"]

IMAGE_KEYS = ("images", "image")
"""Row fields that hold images, checked in this order."""

IMAGE_MARKER = "<image>"
"""Where an image goes in a row's problem text."""


def load_image(ref: Any, base_dir: str = "."):
    """One image reference (see the module docstring) decoded to an RGB PIL image; ValueError saying what is wrong."""
    from PIL import Image, UnidentifiedImageError

    what = "image"
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            ref = ref["bytes"]
        elif isinstance(ref.get("path"), str) and ref["path"]:
            ref = ref["path"]
        else:
            raise ValueError("an image dict needs 'bytes' or a non-empty 'path'")
    if isinstance(ref, str):
        if not ref.strip():
            raise ValueError("empty image path")
        path = os.path.expanduser(ref)
        if not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise ValueError(f"image file not found: {path}")
        what = f"image file {path}"
        source: Any = path
    elif isinstance(ref, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(ref))
        what = f"image bytes ({len(ref)} bytes)"
    else:
        raise ValueError(f"an image must be a path, bytes or a {{'bytes', 'path'}} dict, got {type(ref).__name__}")
    try:
        with Image.open(source) as im:
            im.load()  # decode now: a truncated or corrupt file fails here, not in the middle of training
            return im.convert("RGB")
    except Image.DecompressionBombError as e:  # not an OSError: it escaped as an unexpected error, row unnamed
        raise ValueError(
            f"{what} is larger than Pillow's pixel limit ({e}); shrink it, or skip such rows with "
            "data.skip_malformed=true"
        ) from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"cannot decode {what}: {type(e).__name__}: {e}") from e


def row_images(row: dict, base_dir: str = ".") -> list:
    """The decoded images of a row (empty when it has none); ValueError naming the field and index of a bad one."""
    for key in IMAGE_KEYS:
        if key not in row or row[key] is None:
            continue
        refs = row[key] if isinstance(row[key], list) else [row[key]]
        out = []
        for j, ref in enumerate(refs):
            try:
                out.append(load_image(ref, base_dir))
            except ValueError as e:
                raise ValueError(f"field {key!r}[{j}]: {e}") from None
        return out
    return []


def count_markers(prompt: str | list[dict]) -> int:
    """``<image>`` markers in a problem text or in chat messages' string contents."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_MARKER)
    return sum(m["content"].count(IMAGE_MARKER) for m in prompt if isinstance(m.get("content"), str))
