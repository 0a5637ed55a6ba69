"""Stored weights: the projections, experts and embeddings whose weights live in a weight format
(deltaserve/ops/formats.py), once, in the bytes they run in. The Python model computes with them by
dequantizing one module's weight when it runs and dropping it after (no widened copy is kept); the fused
step reads the same tensors and widens them in registers.

A module holds its weight as `<name>` (the stored data, row-major [..., N, K]) and, in a quantized format,
`<name>_scale`; `fmt` says how to read them. Built in float32 (nn.Linear's shapes and initialisation); the
loader calls `store` to give each module the format `WeightPolicy` picks, then fills it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.model.huge_pages import weight_memory
from deltaserve.ops.activation_quant import (
    fake_quantize,
    reads_bf16_activations,
    reads_int8_activations,
    resolve_activation_quantization,
    round_to_bf16,
)
from deltaserve.ops.formats import WeightFormat, dequantize, dequantize_rows

__all__ = ["Embedding", "Linear", "StoredWeights", "WeightPolicy", "quantizable", "scale_name", "shared_activations",
           "store", "tie"]

_DTYPE_FORMATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def scale_name(name: str) -> str:
    """The parameter holding the scales of stored weight `name`."""
    return name + "_scale"


def _unquantized(dtype: torch.dtype) -> WeightFormat:
    if dtype not in _DTYPE_FORMATS:
        raise ValueError(f"weights of dtype {dtype} have no weight format; store them with a WeightFormat")
    return WeightFormat(_DTYPE_FORMATS[dtype])


class StoredWeights(nn.Module):
    """A module with stored weights (WEIGHTS: their names) in one format. For an unquantized format the
    format follows the data's dtype, so `module.to(torch.bfloat16)` keeps the two in step."""

    WEIGHTS: tuple[str, ...] = ("weight",)
    _quantized: WeightFormat | None = None
    # "int8": an int8 / int4 module quantizes its input rows first; "bf16": every module rounds them to bf16
    # (deltaserve/ops/activation_quant.py); None: a module that reads no activations (the embedding, a lookup)
    activation_quantization: str | None = "none"

    @property
    def fmt(self) -> WeightFormat:
        if self._quantized is not None:
            return self._quantized
        return _unquantized(getattr(self, self.WEIGHTS[0]).dtype)

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """The weight's shape as numbers [..., N, K] (int4 data holds two columns per byte)."""
        raise NotImplementedError

    def scale(self, name: str) -> torch.Tensor | None:
        return getattr(self, scale_name(name), None)

    def weight_values(self, name: str = "weight", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as numbers in dtype: a fresh tensor for a quantized format, else the data cast."""
        return dequantize(getattr(self, name), self.scale(name), self.fmt, self.logical_shape(name)[-1], dtype)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The input rows as this module multiplies them: x, x quantized to int8 per group and back
        (activation_quantization "int8" on int8 / int4 weights) or x rounded to bf16 ("bf16")."""
        if reads_int8_activations(self.activation_quantization, self.fmt):
            return fake_quantize(x, self.fmt.group)
        if reads_bf16_activations(self.activation_quantization):
            return round_to_bf16(x)
        return x

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.fmt.name}" + (f"/{self.fmt.group}" if self.fmt.group else "")


def store(module: StoredWeights, fmt: WeightFormat, device: torch.device | str = "cpu") -> None:
    """Replace module's weights by empty ones of its shapes in fmt on device (the loader fills them)."""
    for name in module.WEIGHTS:
        *lead, n, k = module.logical_shape(name)
        data = weight_memory((*lead, *fmt.data_shape(n, k)), fmt.data_dtype, device)
        module.register_parameter(name, nn.Parameter(data, requires_grad=False))
        scale = fmt.scale_shape(n, k)
        module.register_parameter(scale_name(name), None if scale is None else nn.Parameter(
            weight_memory((*lead, *scale), fmt.scale_dtype, device), requires_grad=False))
    module._quantized = fmt if fmt.quantized else None


class Linear(StoredWeights):
    """y = x @ w^T (+ bias), w [out_features, in_features] stored in a weight format and dequantized to x's
    dtype for the call. The text model's projections have no bias; the vision tower's have one, which is not
    a stored weight: the loader keeps it in the activation dtype, as it does the norms."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's initialisation
        self.register_parameter("weight_scale", None)
        self.register_parameter("bias", None)
        if bias:
            bound = 1 / in_features**0.5
            self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound))

    def logical_shape(self, name: str = "weight") -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor, activations: torch.Tensor | None = None) -> torch.Tensor:
        """activations: self.activations(x) where the caller has it already (shared_activations)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        xa = self.activations(x) if activations is None else activations
        return F.linear(xa, self.weight_values("weight", x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt.name}")


def shared_activations(x: torch.Tensor, *modules: StoredWeights) -> list[torch.Tensor]:
    """Each module's activations(x) for projections that read the same x (q / k / v, gate / up, ...): x is
    quantized once per group size among them, not once per module (the very tensors each would compute)."""
    by_group: dict[int | str | None, torch.Tensor] = {}
    out = []
    for m in modules:
        group = m.fmt.group if reads_int8_activations(m.activation_quantization, m.fmt) else None
        group = "bf16" if reads_bf16_activations(m.activation_quantization) else group
        if group not in by_group:
            by_group[group] = m.activations(x)
        out.append(by_group[group])
    return out


class Embedding(StoredWeights):
    """Rows of a table [num_embeddings, dim] stored in a weight format; the picked rows come out in
    `out_dtype` (set to the model's activation dtype by the loader), the others are never widened."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim))  # nn.Embedding's initialisation
        self.register_parameter("weight_scale", None)
        self.out_dtype: torch.dtype | None = None  # None: the data's own dtype
        # a lookup reads no activations: a tied embedding takes the head's weight, never its input setting
        self.activation_quantization = None

    def logical_shape(self, name: str = "weight") -> tuple[int, int]:
        return self.num_embeddings, self.dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self.out_dtype or (self.weight.dtype if not self.fmt.quantized else torch.float32)
        if not self.fmt.quantized:
            return F.embedding(ids, self.weight).to(dtype)
        flat = ids.reshape(-1)
        rows = dequantize_rows(self.weight, self.weight_scale, self.fmt, self.dim, flat, dtype)
        return rows.reshape(*ids.shape, self.dim)


def tie(embedding: Embedding, head: Linear) -> None:
    """Make the embedding read the head's weight (tie_word_embeddings): one tensor, in the head's format,
    its rows dequantized one token at a time when the head is quantized."""
    embedding.weight, embedding.weight_scale = head.weight, head.weight_scale
    embedding._quantized = head._quantized


# Projections that stay in the checkpoint's format under --quantization, as Qwen's own FP8 releases keep
# them (modules_to_not_convert): the GDN gates' b / a (a few rows each, read by every token), the MoE
# router and the shared expert's gate.
KEEP_UNQUANTIZED = ("linear_attn.in_proj_b", "linear_attn.in_proj_a", "mlp.gate", "mlp.shared_expert_gate")


def quantizable(module_name: str, quantize_lm_head: bool = True) -> bool:
    """Whether --quantization covers the projection `module_name` (any prefix: the planner's checkpoint names
    too); embeddings are never quantized on their own."""
    if module_name.endswith("lm_head"):
        return quantize_lm_head
    return not any(module_name == k or module_name.endswith("." + k) for k in KEEP_UNQUANTIZED)


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """Which format each stored weight takes.

    - quantization (fp8 / int8 / int4): every projection and expert, lm_head too unless quantize_lm_head
      is off, except KEEP_UNQUANTIZED; embeddings stay as stored (a tied one shares the head's weight).
    - dtype: with `explicit_dtype`, every other weight in this dtype (`--dtype float32` asks for fp32
      weights); else each weight stays in the checkpoint's own format (bf16 stays bf16, fp8 stays fp8).
    - activation_quantization: "int8" has the int8 / int4 modules quantize their inputs
      (deltaserve/ops/activation_quant.py); None picks the default for the quantization.
    """

    dtype: torch.dtype = torch.float32
    quantization: str | None = None
    group_size: int | None = None
    explicit_dtype: bool = False
    quantize_lm_head: bool = True
    activation_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            WeightFormat.of(self.quantization, self.group_size)  # names a bad format or group size
        resolved = resolve_activation_quantization(self.activation_quantization, self.quantization)
        object.__setattr__(self, "activation_quantization", resolved)

    def quantizes(self, module_name: str, module: StoredWeights) -> bool:
        if self.quantization is None or isinstance(module, Embedding):
            return False
        return quantizable(module_name, self.quantize_lm_head)

    def format_for(self, module_name: str, module: StoredWeights, stored: WeightFormat) -> WeightFormat:
        """The format of module's weights, whose checkpoint tensors are in `stored`."""
        if self.quantizes(module_name, module):
            if stored.name == self.quantization and self.group_size in (None, stored.group):
                return stored  # an fp8 checkpoint asked for fp8: its own blocks
            return WeightFormat.of(self.quantization, self.group_size)
        if self.explicit_dtype or stored.name == "float16":
            return _unquantized(self.dtype)
        return stored
