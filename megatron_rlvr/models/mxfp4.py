"""MXFP4 checkpoint tensors (the hub's GPT-OSS experts) dequantised on load.

The OCP Microscaling format (MX v1.0): values come in blocks of 32 that share one E8M0 scale (an exponent byte,
bias 127, value ``2^(s - 127)``); each value is an FP4 E2M1 number (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives). GPT-OSS stores ``<proj>_blocks`` [E, rows, G, 16] uint8 (two values per byte,
the low nibble first) and ``<proj>_scales`` [E, rows, G] uint8, ``G * 32`` values per row, rows being the output
dim; the dequantised tensor is its transpose [E, G * 32, rows], the layout of the bf16 ``gate_up_proj`` /
``down_proj``. transformers' own decoder (``transformers.integrations.mxfp4.convert_moe_packed_tensors``) is used
when it imports, this module's otherwise; both are exact in fp32.
"""

from __future__ import annotations

import torch

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 E2M1 values by nibble (bit 3: sign)."""

E8M0_BIAS = 127
"""The shared scale's exponent bias."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, G, 16] uint8 nibble pairs and [..., rows, G] uint8 exponents -> [..., rows, G * 32] float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match ([..., G, 16] and "
            "[..., G])"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # low nibble first
    values = pairs.reshape(*blocks.shape[:-1], 32)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _transformers_decoder():
    """transformers' MXFP4 decoder, or None where the installed transformers has none."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except Exception:  # an older transformers, or one whose integration does not import here
        return None
    return convert_moe_packed_tensors


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, name: str = "MXFP4 tensor") -> torch.Tensor:
    """One expert's [rows, G, 16] blocks and [rows, G] scales -> its float32 [G * 32, rows] weight (the transpose
    of the decoded rows, as transformers' GPT-OSS holds it). ValueError naming ``name`` when they cannot be
    decoded."""
    if blocks.dim() != 3 or scales.dim() != 2:
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} are not [rows, G, 16] / "
            "[rows, G]: cannot dequantise"
        )
    try:
        dequantize_mxfp4(blocks[:0], scales[:0])  # the shape and dtype checks, with this tensor's name
    except ValueError as e:
        raise ValueError(f"{name}: {e}: cannot dequantise") from None
    decode = _transformers_decoder()
    if decode is not None:
        return decode(blocks[None], scales[None], dtype=torch.float32)[0]
    return dequantize_mxfp4(blocks, scales).t().contiguous()


class Mxfp4Expert:
    """One expert of an MXFP4 ``<proj>_blocks`` / ``<proj>_scales`` pair as a ``SliceReader`` of its dequantised
    [in, out] weight (``models/mapping.py`` reads GPT-OSS experts through it). The expert is decoded once, when first
    sliced."""

    def __init__(self, blocks, scales, expert: int, name: str):
        self.blocks, self.scales, self.expert, self.name = blocks, scales, expert, name
        self._value: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        shape = list(self.blocks.get_shape())
        if len(shape) != 4:
            raise ValueError(f"{self.name}_blocks has shape {shape}, not [experts, rows, G, 16]: cannot dequantise")
        return [shape[2] * 2 * shape[3], shape[1]]

    def __getitem__(self, idx) -> torch.Tensor:
        if self._value is None:
            e = self.expert
            self._value = dequantize_expert(self.blocks[e : e + 1][0], self.scales[e : e + 1][0], self.name)
        return self._value[idx]
