// The row operations between projections: zero-centred RMSNorm (its scale 1 + w is precomputed), Gated
// DeltaNet's gated RMSNorm, and rotate-half rotary embedding (deltaserve/model/layers.py is the reference).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace deltaserve {

// out = x * rsqrt(mean(x^2) + eps) * scale, for one row of n.
inline void rms_norm_row(const float* x, const float* scale, float eps, int64_t n, float* out) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * scale[i];
}

// rms_norm_row over the rows of x [T, n] (contiguous float32), into a new tensor.
inline at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& scale, float eps) {
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) rms_norm_row(xp + t * n, sp, eps, n, op + t * n);
  return out;
}

// Gated RMSNorm of one head's row o [n], in place: o * rsqrt(mean(o^2) + eps) * w * silu(z).
inline void gated_rms_norm_row(float* o, const float* z, const float* w, float eps, int64_t n) {
  const float r = 1.0f / std::sqrt(dot(o, o, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = o[j] * r * w[j] * silu(z[j]);
}

// cos/sin [T, half] of positions * inv_freq, as RotaryEmbedding.cos_sin computes them (text positions).
inline void rope_tables(const int64_t* positions, int64_t T, const float* inv_freq, int64_t half,
                        std::vector<float>& cos, std::vector<float>& sin) {
  cos.resize(T * half);
  sin.resize(T * half);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < half; ++f) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[f];
      cos[t * half + f] = std::cos(angle);
      sin[t * half + f] = std::sin(angle);
    }
  }
}

// Rotate-half rotary embedding on the first 2*half dims of one head, in place.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace deltaserve
