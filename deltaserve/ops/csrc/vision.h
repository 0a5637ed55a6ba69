// Element-wise steps of the fused executor's vision tower on its bf16 products (executor/fused_cpu/vision.py).
#pragma once

#include <torch/extension.h>

namespace deltaserve {

// x <- GELU(x) with tanh's approximation (gelu_pytorch_tanh), in place on contiguous bf16: each value widened
// to fp32, x * sigmoid(2z) = x * (1 + tanh z) / 2 with z = sqrt(2/pi) (x + 0.044715 x^3), rounded back to
// bf16 (to nearest even, as torch converts). torch's own bf16 kernel spends 4x as long, in its tanh.
void gelu_tanh_bf16_(const at::Tensor& x);

}  // namespace deltaserve
