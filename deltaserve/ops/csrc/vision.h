// Element-wise steps of the fused executor's vision tower on its bf16 products (executor/fused_cpu/vision.py):
// each reads the bf16 values widened to fp32, computes in fp32 and rounds once to bf16 (to nearest even, as
// torch converts), in one pass where torch's mixed-dtype ops make a converted copy per operand.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace deltaserve {

// x <- GELU(x) with tanh's approximation (gelu_pytorch_tanh), in place on contiguous bf16:
// x * sigmoid(2z) = x * (1 + tanh z) / 2 with z = sqrt(2/pi) (x + 0.044715 x^3). torch's own bf16 kernel
// spends 2x as long, in its tanh.
void gelu_tanh_bf16_(const at::Tensor& x);

// The rotate-half rotary of q and k in place in the attention's qkv product [N, 3, heads, head_dim] (bf16,
// contiguous): x * cos + rotate_half(x) * sin with cos, sin [N, head_dim] fp32 (model/vision.py rotate).
void rotary_qk_bf16_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin);

// The residual stream x [T, n] (fp32, contiguous) += y (bf16 [T, n], when given), in place, then
// LayerNorm(x) * weight + bias (weight, bias fp32 [n]) returned in bf16 [T, n]: a projection's input.
at::Tensor add_layer_norm_bf16(const at::Tensor& x, const std::optional<at::Tensor>& y, const at::Tensor& weight,
                               const at::Tensor& bias, double eps);

}  // namespace deltaserve
