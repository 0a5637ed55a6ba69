// The fused executor's vision tower (executor/fused_cpu/vision.py), two schemes:
// - its bf16 products' element-wise steps (torch's oneDNN kernels multiply): each reads the bf16 values widened
//   to fp32, computes in fp32 and rounds once to bf16 (to nearest even, as torch converts), in one pass where
//   torch's mixed-dtype ops make a converted copy per operand; and its attention, as bf16 pairs (vdpbf16ps);
// - a small tower's blocks and merger whole, in fp32 (vision_block_f32, vision_merger_f32): the projections
//   are linear.h's, reading each stored weight where it is, so the numbers are model/vision.py's fp32 ones up
//   to the order of the sums. One call per block instead of some twenty torch ops and four oneDNN products,
//   whose fixed costs (tens of us each) were most of a small tower's time.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

#include "linear.h"

namespace deltaserve {

// x <- GELU(x) with tanh's approximation (gelu_pytorch_tanh), in place on contiguous bf16:
// x * sigmoid(2z) = x * (1 + tanh z) / 2 with z = sqrt(2/pi) (x + 0.044715 x^3). torch's own bf16 kernel
// spends 2x as long, in its tanh.
void gelu_tanh_bf16_(const at::Tensor& x);

// The rotate-half rotary of q and k in place in the attention's qkv product [N, 3, heads, head_dim] (bf16,
// contiguous): x * cos + rotate_half(x) * sin with cos, sin [N, head_dim] fp32 (model/vision.py rotate).
void rotary_qk_bf16_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin);

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16 scheme's attention: out [N, heads * head_dim] (bf16) = softmax(q k^T / sqrt(head_dim)) v for each
// head within each segment of consecutive rows (one frame each), q, k, v read from the qkv product
// [N, 3, heads, head_dim] (bf16, contiguous). The scores are bf16 pairs multiplied and summed in fp32
// (vdpbf16ps), scaled in fp32; the softmax's exponentials are fp32, rounded to bf16 to multiply v the same way,
// and the fp32 sums are divided by the fp32 sum of the unrounded exponentials; the result is rounded once to
// bf16. Reference: model/vision.py attend_bf16.
at::Tensor vision_attention_bf16(const at::Tensor& qkv, const std::vector<int64_t>& segments);
#endif

// The residual stream x [T, n] (fp32, contiguous) += y (bf16 [T, n], when given), in place, then
// LayerNorm(x) * weight + bias (weight, bias fp32 [n]) returned in bf16 [T, n]: a projection's input.
at::Tensor add_layer_norm_bf16(const at::Tensor& x, const std::optional<at::Tensor>& y, const at::Tensor& weight,
                               const at::Tensor& bias, double eps);

// The MLP activations of model/vision.py (ACTIVATIONS), by their config names.
enum class VisionActivation { kGeluTanh, kGelu, kSilu, kQuickGelu };

// "gelu_pytorch_tanh", "gelu", "silu" or "quick_gelu"; anything else is an error naming the known ones.
VisionActivation vision_activation_named(const std::string& name);

// A LayerNorm's fp32 weight and bias [n] and its eps.
struct VisionNorm {
  at::Tensor weight, bias;
  double eps = 1e-6;
};

// A projection with its bias: the weight as linear.h reads it, the bias fp32 [N].
struct VisionProjection {
  Linear linear;
  at::Tensor bias;
};

// One VisionBlock's weights (model/vision.py), the model's own tensors.
struct VisionBlockWeights {
  VisionNorm norm1, norm2;
  VisionProjection qkv, proj, fc1, fc2;
  int64_t heads = 0;
  VisionActivation act = VisionActivation::kGeluTanh;
  // The attention as vision_attention_bf16 (AVX512-BF16 builds) on q, k, v rounded to bf16, its output widened
  // back: the tower of int8-activation projections (executor/fused_cpu/vision.py), whose rows are coarser still.
  bool bf16_attention = false;
};

// VisionBlock.forward in fp32, the residual stream x [N, hidden] (contiguous fp32) updated in place:
// x += proj(attention(rotary(qkv(norm1(x))))); x += fc2(act(fc1(norm2(x)))). cos, sin [N, head_dim] fp32;
// segments: consecutive row counts (one per frame) that each attend within themselves, unmasked.
void vision_block_f32(const at::Tensor& x, const VisionBlockWeights& w, const at::Tensor& cos,
                      const at::Tensor& sin, const std::vector<int64_t>& segments);

// PatchMerger.forward in fp32: fc2(GELU(fc1(norm(x) viewed [N / merge^2, merged]))) (exact GELU), fp32 out.
at::Tensor vision_merger_f32(const at::Tensor& x, const VisionNorm& norm, int64_t merged, const VisionProjection& fc1,
                             const VisionProjection& fc2);

}  // namespace deltaserve
