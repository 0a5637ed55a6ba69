"""The weight formats' plain-torch reference (deltaserve/ops/formats.py): round trips, layouts and sizes."""

import pytest
import torch

from deltaserve.ops.formats import FORMATS, WeightFormat, dequantize, dequantize_rows, fp8_from_blocks, quantize

SHAPES = [(5, 37), (64, 256), (3, 1), (2, 33)]  # partial groups, odd K, a single column


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_within_the_format_step(name, shape):
    torch.manual_seed(0)
    fmt = WeightFormat.of(name)
    w = torch.randn(*shape) * 0.05
    data, scale = quantize(w, fmt)
    assert tuple(data.shape) == fmt.data_shape(*shape) and data.dtype == fmt.data_dtype
    back = dequantize(data, scale, fmt, shape[1])
    assert back.shape == w.shape
    # Half a quantization step of the group's largest value (plus the bf16 rounding of the scale).
    step = {"float32": 0.0, "bfloat16": 2**-7, "float16": 2**-10, "fp8": 2**-3, "int8": 1 / 127, "int4": 1 / 7}[name]
    assert (back - w).abs().max() <= step * w.abs().max() * 0.51 + 1e-7
    assert fmt.nbytes(*shape) == data.numel() * data.element_size() + (
        0 if scale is None else scale.numel() * scale.element_size())


def test_quantized_values_times_scales_are_exact_in_fp32():
    """int8 / int4 values have at most 8 bits and bf16 scales 8: their products are exact, so a kernel that
    widens in registers computes the very numbers dequantize gives."""
    torch.manual_seed(1)
    w = torch.randn(16, 96)
    for name in ("int8", "int4"):
        fmt = WeightFormat.of(name)
        data, scale = quantize(w, fmt)
        assert torch.equal(dequantize(data, scale, fmt, 96).double(),
                           dequantize(data, scale, fmt, 96, torch.float64))


def test_int4_packs_two_columns_per_byte_low_first():
    fmt = WeightFormat.of("int4", 2)
    w = torch.tensor([[7.0, -7.0, 3.5]])  # groups [7, -7] (scale 1) and [3.5] (scale 0.5)
    data, scale = quantize(w, fmt)
    assert data.tolist() == [[(7 + 8) | ((-7 + 8) << 4), (7 + 8) | (8 << 4)]]
    assert dequantize(data, scale, fmt, 3).tolist() == [[7.0, -7.0, 3.5]]


def test_zero_groups_quantize_to_zero():
    w = torch.zeros(2, 64)
    for name in ("int8", "int4", "fp8"):
        fmt = WeightFormat.of(name)
        assert torch.equal(dequantize(*quantize(w, fmt), fmt, 64), w)


def test_fp8_blocks_expand_to_per_row_scales_exactly():
    torch.manual_seed(2)
    data = (torch.randn(200, 300) * 3).to(torch.float8_e4m3fn)
    blocks = torch.rand(2, 3) + 0.5
    d, s = fp8_from_blocks(data, blocks, (128, 128))
    expected = data.float() * blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert torch.equal(dequantize(d, s, WeightFormat.of("fp8"), 300), expected)


def test_experts_keep_their_leading_dim_and_rows_dequantize_alone():
    torch.manual_seed(3)
    w = torch.randn(3, 8, 40)
    for name in FORMATS:
        fmt = WeightFormat.of(name)
        data, scale = quantize(w, fmt)
        full = dequantize(data, scale, fmt, 40)
        assert full.shape == w.shape
        flat_data, flat_scale = data[1], None if scale is None else scale[1]
        rows = torch.tensor([5, 0])
        assert torch.equal(dequantize_rows(flat_data, flat_scale, fmt, 40, rows), full[1][rows])


def test_bad_formats_are_named():
    with pytest.raises(ValueError, match="int3"):
        WeightFormat.of("int3")
    with pytest.raises(ValueError, match="even"):
        WeightFormat("int4", 5)
