#include "vision.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// Round to nearest even, a NaN to the quiet NaN: torch's float -> bfloat16 conversion. Branch-free, so that
// the loops calling it vectorize.
inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0u} : bf16_round_bits(bits);
}

uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_contiguous(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == dim, name, ": contiguous ", type, " of ",
              dim, " dims, got ", t.scalar_type(), " of ", t.dim(), t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace

void gelu_tanh_bf16_(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bfloat16, got ",
              x.scalar_type(), x.is_contiguous() ? "" : " (not contiguous)");
  uint16_t* p = bf16_data(x);
  at::parallel_for(0, x.numel(), grain_for(16), [p](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = bf16_to_float(p[i]);
      const float two_z = 1.5957691216057308f * (v + 0.044715f * v * v * v);  // 2 sqrt(2/pi) (v + 0.044715 v^3)
      // Below -88 sigmoid(2z) is under e^-88 (vexp clamps there): 0 * v, torch's -0 for a finite v, NaN for -inf.
      p[i] = round_bf16(two_z < -88.0f ? 0.0f * v : v / (1.0f + vexp(-two_z)));
    }
  });
}

void rotary_qk_bf16_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  check_contiguous(qkv, at::kBFloat16, 4, "qkv");
  check_contiguous(cos, at::kFloat, 2, "cos");
  check_contiguous(sin, at::kFloat, 2, "sin");
  const int64_t N = qkv.size(0), heads = qkv.size(2), hd = qkv.size(3), half = hd / 2;
  TORCH_CHECK(qkv.size(1) == 3 && hd % 2 == 0, "qkv: [N, 3, heads, head_dim] with head_dim even, got ",
              qkv.sizes());
  TORCH_CHECK(cos.size(0) == N && cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos, sin: [N, head_dim] = [",
              N, ", ", hd, "], got cos ", cos.sizes(), ", sin ", sin.sizes());
  uint16_t* base = bf16_data(qkv);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  // rows: (n, q or k, head), head_dim values each
  at::parallel_for(0, N * 2 * heads, grain_for(4 * hd), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / (2 * heads), rest = r % (2 * heads);  // rest: which (q 0 / k 1) * heads + head
      uint16_t* x = base + (n * 3 * heads + rest) * hd;
      const float* c = cp + n * hd;
      const float* s = sp + n * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + half]);
        x[i] = round_bf16(a * c[i] - b * s[i]);
        x[i + half] = round_bf16(b * c[i + half] + a * s[i + half]);
      }
    }
  });
}

at::Tensor add_layer_norm_bf16(const at::Tensor& x, const std::optional<at::Tensor>& y, const at::Tensor& weight,
                               const at::Tensor& bias, double eps) {
  check_contiguous(x, at::kFloat, 2, "x");
  const int64_t T = x.size(0), n = x.size(1);
  if (y) {
    check_contiguous(*y, at::kBFloat16, 2, "y");
    TORCH_CHECK(y->sizes() == x.sizes(), "y: the shape of x ", x.sizes(), ", got ", y->sizes());
  }
  check_contiguous(weight, at::kFloat, 1, "weight");
  check_contiguous(bias, at::kFloat, 1, "bias");
  TORCH_CHECK(weight.size(0) == n && bias.size(0) == n, "weight, bias: [n] for x [T, n] = ", x.sizes(),
              ", got weight ", weight.sizes(), ", bias ", bias.sizes());
  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kBFloat16));
  float* xp = x.data_ptr<float>();
  const uint16_t* yp = y ? bf16_data(*y) : nullptr;
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  uint16_t* op = bf16_data(out);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, T, grain_for(4 * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * n;
      if (yp) {
        const uint16_t* add = yp + t * n;
        for (int64_t i = 0; i < n; ++i) row[i] += bf16_to_float(add[i]);
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += row[i];
      const float mean = sum / static_cast<float>(n);
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += (row[i] - mean) * (row[i] - mean);
      const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + epsf);  // biased variance, as torch
      uint16_t* o = op + t * n;
      for (int64_t i = 0; i < n; ++i) o[i] = round_bf16((row[i] - mean) * rstd * w[i] + b[i]);
    }
  });
  return out;
}

}  // namespace deltaserve
