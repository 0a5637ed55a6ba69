#include "vision.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

inline float widen_bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, a NaN to the quiet NaN: torch's float -> bfloat16 conversion. Branch-free, so that
// the loop calling it vectorizes.
inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

}  // namespace

void gelu_tanh_bf16_(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bfloat16, got ",
              x.scalar_type(), x.is_contiguous() ? "" : " (not contiguous)");
  uint16_t* p = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, x.numel(), grain_for(16), [p](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = widen_bf16(p[i]);
      const float two_z = 1.5957691216057308f * (v + 0.044715f * v * v * v);  // 2 sqrt(2/pi) (v + 0.044715 v^3)
      // Below -88 sigmoid(2z) is under e^-88 (vexp clamps there): 0 * v, torch's -0 for a finite v, NaN for -inf.
      p[i] = round_bf16(two_z < -88.0f ? 0.0f * v : v / (1.0f + vexp(-two_z)));
    }
  });
}

}  // namespace deltaserve
