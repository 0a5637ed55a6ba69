"""Weight formats: how a projection's weight w [N, K] is stored, and the plain-torch reference that turns the
stored bytes back into the numbers they stand for (`dequantize`). The fused step's kernels
(deltaserve/ops/csrc/formats.h) read the same bytes and multiply by exactly these numbers: every stored
value times its scale is exact in fp32 or rounded once, the same way in both, so a kernel differs from
`dequantize(...) @ x` only in the order of its sums.

Every format is row-major along K, as checkpoints are, so a fused projection (q|k|v|z|b|a, gate|up) is
just its parts' rows one after another, and a tensor-parallel rank's rows are a slice of them.

- float32, bfloat16, float16: the values themselves, no scale.
- fp8: E4M3 values and one fp32 scale per row and per `group` columns (128: Qwen's FP8 releases store one
  `weight_scale_inv` per 128 x 128 block; its rows are repeated here, exactly, so that a row's scales sit
  with the row, and parts or shards of a block keep theirs).
- int8: symmetric, one bf16 scale per row and per `group` columns (32 by default, settable): q in
  [-127, 127], w = q * scale. The scale is rounded to bf16 before q is chosen, so q * scale is exact.
- int4: the same with q in [-7, 7], stored as q + 8 in nibbles, two per byte along K (column 2j in the low
  nibble of byte j, column 2j + 1 in the high one; an odd K gets a zero column). `group` must be even.

A last group narrower than `group` (K not a multiple of it) is allowed everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.ops.format_names import DEFAULT_GROUP, FORMATS, QUANTIZATIONS

__all__ = ["DEFAULT_GROUP", "FORMATS", "QUANTIZATIONS", "WeightFormat", "dequantize", "dequantize_rows",
           "fp8_from_blocks", "quantize", "quantize_fp8_blocks"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_QMAX = {"int8": 127, "int4": 7}
_DATA_DTYPE = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
    "int8": torch.int8, "int4": torch.uint8,
}
_SCALE_DTYPE = {"fp8": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """A storage format and, for the quantized ones, the columns per scale."""

    name: str
    group: int = 0

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"weight format {self.name!r} is not known; accepted: {', '.join(FORMATS)}")
        if self.quantized:
            if self.group <= 0:
                raise ValueError(f"the {self.name} weight format needs a group size > 0, got {self.group}")
            if self.name == "int4" and self.group % 2:
                raise ValueError(f"the int4 group size must be even (two values per byte), got {self.group}")
        elif self.group:
            raise ValueError(f"the {self.name} weight format has no groups; got group size {self.group}")

    @classmethod
    def of(cls, name: str, group: int | None = None) -> WeightFormat:
        """The format by name, with the default group size of a quantized one unless `group` is given."""
        return cls(name, (group or DEFAULT_GROUP[name]) if name in DEFAULT_GROUP else 0)

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZATIONS

    @property
    def data_dtype(self) -> torch.dtype:
        return _DATA_DTYPE[self.name]

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return _SCALE_DTYPE.get(self.name)

    def data_shape(self, n: int, k: int) -> tuple[int, int]:
        return (n, (k + 1) // 2) if self.name == "int4" else (n, k)

    def scale_shape(self, n: int, k: int) -> tuple[int, int] | None:
        return (n, -(-k // self.group)) if self.quantized else None

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of a weight [n, k] in this format, scales included (the planner's arithmetic)."""
        rows, cols = self.data_shape(n, k)
        total = rows * cols * self.data_dtype.itemsize
        if (scales := self.scale_shape(n, k)) is not None:
            total += scales[0] * scales[1] * self.scale_dtype.itemsize
        return total


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [..., K] as [..., ceil(K/group), group], the last group padded with zeros."""
    k = w.shape[-1]
    pad = -k % group
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], -1, group)


def _expand(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Per-group scales [..., G] as per-column ones [..., k]."""
    return scale.float().repeat_interleave(group, dim=-1)[..., :k]


def quantize(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scale) of w [..., N, K] (any float dtype) in fmt; leading dims (experts) are kept."""
    if not fmt.quantized:
        return w.to(fmt.data_dtype).contiguous(), None
    if fmt.name == "fp8":  # square blocks of `group`, as the releases; experts one by one
        if w.dim() > 2:
            pairs = [quantize(e, fmt) for e in w]
            return torch.stack([d for d, _ in pairs]), torch.stack([s for _, s in pairs])
        block = (fmt.group, fmt.group)
        return fp8_from_blocks(*quantize_fp8_blocks(w, block), block)
    k, qmax = w.shape[-1], _QMAX[fmt.name]
    groups = _groups(w.float(), fmt.group)  # [..., N, G, group]
    scale = (groups.abs().amax(dim=-1) / qmax).to(torch.bfloat16)
    divisor = scale.float().unsqueeze(-1)
    q = (groups / divisor.masked_fill(divisor == 0, 1.0)).round_().clamp_(-qmax, qmax)
    q = q.to(torch.int8).flatten(-2)[..., :k]  # a zero group's values are 0 / 1 = 0
    if fmt.name == "int8":
        return q.contiguous(), scale.contiguous()
    return _pack_int4(q), scale.contiguous()


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data, block scales [ceil(N/bn), ceil(K/bk)]) of w [N, K], as Qwen's FP8 releases store them and
    vLLM's online fp8 makes them: w ~= data * scale over each bn x bn block, scale = amax / 448."""
    bn, bk = block
    n, k = w.shape
    w = w.float()
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    safe = scale.masked_fill(scale == 0, 1.0)
    per_value = safe.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    data = (w / per_value).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale


def fp8_from_blocks(data: torch.Tensor, block_scale: torch.Tensor, block: tuple[int, int]) -> tuple[
        torch.Tensor, torch.Tensor]:
    """A checkpoint's fp8 weight [..., N, K] with its block scales [..., ceil(N/bn), ceil(K/bk)] as this
    format stores it: the same data, and each block row's scales repeated for its rows ([..., N, ceil(K/bk)])."""
    bn, _ = block
    n = data.shape[-2]
    scale = block_scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]
    return data.contiguous(), scale.contiguous()


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 q [..., K] in [-8, 7] -> uint8 [..., ceil(K/2)]: (q[2j] + 8) | (q[2j+1] + 8) << 4."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))  # a zero column: stored as 8, read back as 0
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def _unpack_int4(data: torch.Tensor, k: int) -> torch.Tensor:
    low = (data & 0x0F).to(torch.int8) - 8
    high = (data >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(*data.shape[:-1], -1)[..., :k]


def dequantize(data: torch.Tensor, scale: torch.Tensor | None, fmt: WeightFormat, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [..., N, k] that (data, scale) stands for, in fp32 (then cast to dtype): the reference
    every kernel of the format is held to."""
    if not fmt.quantized:
        return data.to(dtype)
    values = _unpack_int4(data, k) if fmt.name == "int4" else data
    w = values.float() * _expand(scale, fmt.group, k)
    return w.to(dtype)


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor | None, fmt: WeightFormat, k: int,
                    rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize(...)[rows] without widening the other rows (a tied embedding read from a quantized head)."""
    return dequantize(data[rows], None if scale is None else scale[rows], fmt, k, dtype)
