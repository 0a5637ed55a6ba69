"""Activation quantization for int8 / int4 weights (activation_quantization = "int8"): a projection's input
rows are quantized to int8 the way its weights are, and each group's products are summed as integers, as
llama.cpp's Q8_0 / Q8_K activations are. This module is the scheme's definition and its plain-torch reference;
the fused step's integer kernel (deltaserve/ops/csrc/linear_int.h: AVX512-VNNI or AVX2) computes the same
numbers, and the Python model's Linear and Experts apply it when the setting is on, so both executors agree.

The scheme, for x [T, K] and weights w [N, K] in int8 or int4 (formats.py: q_w with one bf16 scale s_w per
row and per `group` columns):

- x is quantized per row and per group of the same `group` columns (the last one may be narrower):
  s_x = amax(|x|) / 127 in fp32 (one division), q_x = round_half_even(x / s_x) (one fp32 division, then
  torch.round), clamped to [-127, 127]. An all-zero group has s_x = 0 and q_x = 0; a group holding a NaN or
  an infinity has q_x = 0 and s_x = NaN, so its outputs are NaN as they would be without quantization.
- y[t, n] = sum over groups g of D[t, n, g] * (s_x[t, g] * s_w[n, g]), where D is the group's dot product of
  q_x and q_w in int32: exact (|D| <= 127 * 127 * group).
- fp32 order: each group's term is float(D) times the fp32 product s_x * s_w, rounded once; the terms are
  added in fp32. The reference (`linear_reference`) adds them over groups with torch's sum; the kernel adds
  int32 partial dots of 4 columns (int8 weights; 8 for int4) of one 32-bit lane per 64 (int4: 128) columns
  into 16 fp32 lanes, then sums the lanes.
  Orders differ, so results differ by fp32 summation rounding only, never by a different quantization: the
  kernel's q_x and s_x are these bit for bit.

The Python model (`fake_quantize` then its usual matmul) computes x~ = q_x * s_x and x~ @ dequantize(w)^T:
the same sum, with each product rounded where the reference rounds each group term.

The setting applies to int8 and int4 weights only: bf16, fp8 and float32 weights (and the projections
--quantization leaves unquantized, such as the GDN gates' in_proj_b / in_proj_a) keep their exact float path.

activation_quantization = "bf16" (opt-in, for checkpoints whose weights are not quantized by --quantization
int8 / int4; typically bf16 ones): every projection of the language model (trunk, MTP head, lm_head) reads
its input rows rounded to bf16, to nearest even (`round_to_bf16`, torch's x.bfloat16()), as llama.cpp's BF16
path and a bf16 torch model do, and multiplies them in fp32 with its weights' values. The products of a
bf16 weight and a bf16 input are exact in fp32, so the fused step's bf16 panels multiply bf16 pairs
(AVX512-BF16's vdpbf16ps, twice the products per instruction of an fp32 FMA) and still equal
`round_to_bf16(x) @ w^T` up to the order of fp32 sums (and denormals, which vdpbf16ps flushes to zero). The
vision tower keeps its own path.
"""

from __future__ import annotations

import torch

from deltaserve.ops.format_names import ACTIVATION_QUANTIZATIONS, INT8_ACTIVATION_WEIGHTS
from deltaserve.ops.formats import WeightFormat, dequantize

__all__ = ["ACTIVATION_QUANTIZATIONS", "INT8_ACTIVATION_WEIGHTS", "fake_quantize", "linear_reference",
           "quantize_activations", "reads_bf16_activations", "reads_int8_activations",
           "resolve_activation_quantization", "round_to_bf16"]

QMAX = 127


def reads_int8_activations(activation_quantization: str, fmt: WeightFormat) -> bool:
    """Whether a projection of weights in fmt quantizes its input under the setting."""
    if activation_quantization not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"activation_quantization {activation_quantization!r} is not known; accepted: "
                         f"{', '.join(ACTIVATION_QUANTIZATIONS)}")
    return activation_quantization == "int8" and fmt.name in INT8_ACTIVATION_WEIGHTS


def reads_bf16_activations(activation_quantization: str | None) -> bool:
    """Whether a projection rounds its input rows to bf16 under the setting (every format does, under "bf16")."""
    return activation_quantization == "bf16"


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even) and back to its dtype: what a projection reads under "bf16"."""
    return x.to(torch.bfloat16).to(x.dtype)


def resolve_activation_quantization(requested: str | None, quantization: str | None) -> str:
    """The setting for weights quantized to `quantization` (None: the checkpoint's formats): `requested`, checked,
    or for None the default, "int8" for int8 / int4 weights and "none" otherwise. "int8" with weights it does
    not apply to is an error (as vLLM refuses a quantization option its weights have no use for) rather than
    a setting that silently does nothing."""
    if requested is None:
        return "int8" if quantization in INT8_ACTIVATION_WEIGHTS else "none"
    if requested not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"activation_quantization {requested!r} is not known; accepted: "
                         f"{', '.join(ACTIVATION_QUANTIZATIONS)}")
    if requested == "bf16" and quantization in INT8_ACTIVATION_WEIGHTS:
        raise ValueError(f"activation_quantization 'bf16' applies to weights kept in their float formats, not to "
                         f"{quantization} weights (they read int8 activations or, with 'none', float ones)")
    if requested == "int8" and quantization not in INT8_ACTIVATION_WEIGHTS:
        raise ValueError("activation_quantization 'int8' applies to int8 or int4 weights (quantization int8 or "
                         f"int4), not to {quantization or 'the checkpoint formats'!r} weights; drop it or pass 'none'")
    return requested


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., K], s fp32 [..., ceil(K / group)]) of x [..., K], as the module docstring defines them."""
    k = x.shape[-1]
    pad = -k % group
    groups = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, group)
    scale = groups.abs().amax(dim=-1) / QMAX  # NaN where the group holds a NaN, inf where it holds an inf
    usable = torch.isfinite(scale) & (scale > 0)
    divisor = torch.where(usable, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.where(usable.unsqueeze(-1), torch.round(groups / divisor), torch.zeros_like(groups))
    q = q.clamp_(-QMAX, QMAX).to(torch.int8).flatten(-2)[..., :k]
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    return q.contiguous(), scale.contiguous()


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x~ = q_x * s_x in x's dtype (computed in fp32): what the Python model multiplies by the weights."""
    q, scale = quantize_activations(x, group)
    values = q.float() * scale.repeat_interleave(group, dim=-1)[..., : x.shape[-1]]
    return values.to(x.dtype)


def linear_reference(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat,
                     k: int) -> torch.Tensor:
    """y [T, N] of x [T, k] and int8 / int4 weights (data, scale) in fmt: the scheme's sum, with the group dot
    products D computed exactly (in float64, where integers below 2^53 are exact) and the terms in fp32."""
    if fmt.name not in INT8_ACTIVATION_WEIGHTS:
        raise ValueError(f"activation quantization applies to int8 / int4 weights, not {fmt.name}")
    group = fmt.group
    qx, sx = quantize_activations(x, group)
    qw = _int_values(data, fmt, k)
    pad = -k % group
    gx = torch.nn.functional.pad(qx.double(), (0, pad)).reshape(qx.shape[0], -1, group)  # [T, G, group]
    gw = torch.nn.functional.pad(qw.double(), (0, pad)).reshape(qw.shape[0], -1, group)  # [N, G, group]
    dots = torch.einsum("tgc,ngc->tng", gx, gw).float()  # exact integers; exact in fp32 below 2^24 (group < 1040)
    terms = dots * (sx[:, None, :] * scale.float()[None, :, :])
    return terms.sum(dim=-1)


def _int_values(data: torch.Tensor, fmt: WeightFormat, k: int) -> torch.Tensor:
    """The stored integers q_w [N, k] of int8 / int4 data (dequantize with unit scales)."""
    ones = torch.ones(data.shape[0], -(-k // fmt.group))
    return dequantize(data, ones, fmt, k).round().to(torch.int32)
