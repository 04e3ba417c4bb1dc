"""Multimodal rotary positions (M-RoPE, Qwen2-VL: Wang et al. 2024, arXiv:2409.12191), pure torch.

A text token has one position p, used for all three axes (temporal, height, width). An image of ``t x h x w`` merged
patches (``h = grid_h / merge``, ``w = grid_w / merge``) placed at running position p gets positions
``(p + i, p + y, p + x)`` for its token at frame i, row y, column x; the text after it continues from
``p + max(h, w)``. This is transformers' ``get_rope_index`` for image inputs, as a function of the token ids' image
mask and the image grids alone (no model, no processor), so the trainer computes the positions of any sequence,
prompt and sampled response together.

The rotary frequencies of a head are split between the three axes: Qwen2-VL / Qwen2.5-VL give contiguous bands
(``mrope_section`` = (t, h, w) counts; megatron-core's ``MultimodalRotaryEmbedding``), Qwen3-VL interleaves them
(frequency j uses axis h when ``j % 3 == 1`` and ``j < 3 * section[1]``, axis w when ``j % 3 == 2`` and
``j < 3 * section[2]``, else axis t): :func:`interleaved_mrope_freqs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Number of language-model tokens of each image: ``t * h * w / merge^2`` of its [t, h, w] patch grid."""
    grids = image_grid_thw.reshape(-1, 3).tolist()
    return [int(t) * (int(h) // spatial_merge_size) * (int(w) // spatial_merge_size) for t, h, w in grids]


def rope_index(image_mask: torch.Tensor, image_grid_thw: torch.Tensor | None, spatial_merge_size: int) -> torch.Tensor:
    """[3, s] long M-RoPE position ids of one sequence.

    ``image_mask`` [s] bool: the image tokens (each image a run of ``t * h * w / merge^2`` consecutive tokens, in
    the order of ``image_grid_thw`` [n_images, 3]); ``None`` grids: a text-only sequence (positions 0..s-1 on every
    axis). ValueError when the mask and the grids disagree."""
    mask = [bool(x) for x in image_mask.reshape(-1).tolist()]
    merge = spatial_merge_size
    s = len(mask)
    counts = [] if image_grid_thw is None else image_token_counts(image_grid_thw, spatial_merge_size)
    grids = [] if image_grid_thw is None else image_grid_thw.reshape(-1, 3).tolist()
    out = torch.empty(3, s, dtype=torch.long)
    pos = i = img = 0
    while i < s:
        if not mask[i]:
            j = i
            while j < s and not mask[j]:
                j += 1
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        if img >= len(counts):
            raise ValueError(f"rope_index: more image tokens than the {len(counts)} image grids account for")
        n = counts[img]
        if i + n > s or not all(mask[i : i + n]):
            raise ValueError(f"rope_index: image {img} needs {n} consecutive image tokens from position {i}")
        t, gh, gw = int(grids[img][0]), int(grids[img][1]) // merge, int(grids[img][2]) // merge
        out[0, i : i + n] = torch.arange(t).repeat_interleave(gh * gw) + pos
        out[1, i : i + n] = torch.arange(gh).repeat_interleave(gw).repeat(t) + pos
        out[2, i : i + n] = torch.arange(gw).repeat(t * gh) + pos
        pos += max(int(grids[img][1]), int(grids[img][2])) // merge
        i += n
        img += 1
    if img != len(counts):
        raise ValueError(f"rope_index: {len(counts)} image grids but only {img} images in the sequence's tokens")
    return out


def interleaved_mrope_freqs(freqs: torch.Tensor, mrope_section: Sequence[int]) -> torch.Tensor:
    """[3, ..., d/2] per-axis rotary angles -> [..., d/2] interleaved (Qwen3-VL): angle j from axis h when
    ``j % 3 == 1`` and ``j < 3 * section[1]``, from axis w when ``j % 3 == 2`` and ``j < 3 * section[2]``, else t."""
    if freqs.shape[0] != 3 or len(mrope_section) != 3:
        raise ValueError(f"interleaved M-RoPE needs 3 axes, got freqs {tuple(freqs.shape)} and {list(mrope_section)}")
    out = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, 3 * int(mrope_section[axis]), 3)
        out[..., idx] = freqs[axis][..., idx]
    return out
