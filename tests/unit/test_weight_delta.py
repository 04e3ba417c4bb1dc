"""The delta codec of weight syncs (``megatron_rlvr.rollout.weight_delta``): what a delta carries and that the
receiver rebuilds exactly the new bytes, against hand-made cases."""

import pytest
import torch

from megatron_rlvr.rollout import weight_delta


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_a_sparse_delta_names_exactly_the_changed_elements_and_rebuilds_the_new_bytes(dtype):
    """Three elements of 1000 change: the delta is sparse, counts 3 changed words, costs 3 x (4-byte index +
    element) bytes, and applied to the base gives the new tensor bit for bit (the base itself unchanged)."""
    base = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    new = base.clone()
    new[[3, 500, 999]] = torch.tensor([1.5, -2.25, 7.0], dtype=dtype)
    before = base.clone()
    enc = weight_delta.encode(_u8(base), _u8(new), new.element_size())
    assert enc.kind == "sparse" and enc.changed == 3
    assert enc.payload.numel() == 3 * (4 + new.element_size())
    out = weight_delta.decode(_u8(base), enc.kind, enc.payload, _u8(new).numel(), new.element_size())
    assert torch.equal(out.view(dtype), new) and torch.equal(base, before)


def test_a_changed_bit_pattern_counts_even_where_the_values_compare_equal():
    """-0.0 == 0.0 and NaN != NaN as numbers; the delta compares bytes, so -0.0 over 0.0 is a change and an
    unchanged NaN is not."""
    base = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    enc = weight_delta.encode(_u8(base), _u8(new), 4)
    assert enc.changed == 1
    out = weight_delta.decode(_u8(base), enc.kind, enc.payload, 12, 4)
    assert torch.equal(out, _u8(new))


def test_a_tensor_whose_delta_is_not_smaller_goes_whole_and_without_a_base_too():
    """Every bf16 element changed: sparse would cost 6 bytes per 2-byte element, so the payload is the tensor's own
    bytes; with no base held (first sync, or a reshaped tensor) it is whole as well."""
    base = torch.zeros(64, dtype=torch.bfloat16)
    new = torch.arange(1, 65).bfloat16()
    enc = weight_delta.encode(_u8(base), _u8(new), 2)
    assert enc.kind == "full" and enc.changed == 64 and torch.equal(enc.payload, _u8(new))
    assert weight_delta.encode(None, _u8(new), 2).kind == "full"
    assert weight_delta.encode(_u8(base[:10]), _u8(new), 2).kind == "full"
    out = weight_delta.decode(None, "full", enc.payload, 128, 2)
    assert torch.equal(out.view(torch.bfloat16), new)


def test_payloads_at_odd_offsets_of_a_received_buffer_decode():
    """A received bucket is one flat buffer: a tensor's payload starts at any byte. A 1-change float64 delta at
    offset 3 of a buffer decodes to the new bytes."""
    base = torch.arange(16, dtype=torch.float64)
    new = base.clone()
    new[5] = -1.0
    enc = weight_delta.encode(_u8(base), _u8(new), 8)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), enc.payload])
    out = weight_delta.decode(_u8(base), "sparse", buf[3:], 128, 8)
    assert torch.equal(out.view(torch.float64), new)


def test_malformed_payloads_are_refused_in_one_line():
    """A sparse payload without a base, a torn one, and a full one of the wrong size raise ValueError naming the
    weight delta (the receiver turns that into a failed rebuild and a full resend)."""
    base = _u8(torch.zeros(8))
    with pytest.raises(ValueError, match="no base"):
        weight_delta.decode(None, "sparse", torch.zeros(8, dtype=torch.uint8), 32, 4)
    with pytest.raises(ValueError, match="not whole"):
        weight_delta.decode(base, "sparse", torch.zeros(7, dtype=torch.uint8), 32, 4)
    with pytest.raises(ValueError, match="full payload of 5 bytes"):
        weight_delta.decode(base, "full", torch.zeros(5, dtype=torch.uint8), 32, 4)
