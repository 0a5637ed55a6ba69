// Scalar maths written to vectorize (exp, silu, sigmoid, dot), the row softmax, and torch.argmax's rules
// over a row: the element-wise helpers every kernel of the fused step shares.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace deltaserve {

#if defined(__AVX512F__)
// r[i] = column i of the 16 x 16 matrix whose rows were r[0..16) (linear.cpp's packed kernel; linear_amx.cpp's
// B tiles, through _mm512_castsi512_ps / _mm512_castps_si512)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// The sums of the 16-lane accumulators acc[0 .. n) (n <= 4) into y[0 .. n), by one shuffle tree for the 4 (a
// third of 4 reductions' instructions): the dot kernels' blocks of outputs (linear.cpp, linear_int.cpp). Each
// sum adds its own output's lanes in one fixed order, whatever the other accumulators hold (absent ones are
// zero), so an output's sum does not depend on the block it is in.
inline void store_sums4(const __m512* acc, int n, float* y) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 a0 = acc[0], a1 = n > 1 ? acc[1] : zero, a2 = n > 2 ? acc[2] : zero, a3 = n > 3 ? acc[3] : zero;
  const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // per 128-bit lane: the partial sums of the 4 outputs
  const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(a01, a23, 0x44), _mm512_shuffle_ps(a01, a23, 0xEE));
  const __m512 c = _mm512_add_ps(b, _mm512_shuffle_f32x4(b, b, 0x4E));
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));
  _mm_mask_storeu_ps(y, static_cast<__mmask8>((1u << n) - 1), _mm512_castps512_ps128(d));
}

// The sums of a block's N accumulators into y[0], y[step], y[2 step], ... (store_sums4, 4 at a time).
template <int N>
inline void store_sums(const __m512* acc, float* y, int64_t step) {
  float sums[N];
  float* out = step == 1 ? y : sums;
  for (int j = 0; j < N; j += 4) store_sums4(acc + j, std::min(4, N - j), out + j);
  if (step == 1) return;
  for (int j = 0; j < N; ++j) y[j * step] = sums[j];
}
#endif

#if defined(DELTASERVE_AVX2)
// 8 x 8 32-bit words transposed: v[i] then holds word i of each of the 8 inputs (linear_avx2_tiles.cpp's
// integer tiles; linear.cpp's packed fp32 tiles, through _mm256_castps_si256)
__attribute__((always_inline)) inline void transpose8_words(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// The sum of acc's 8 lanes, in one fixed order (the AVX2 kernels' accumulators).
inline float sum8(__m256 acc) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

// exp(x) for fp32 as Cephes computes it (x = n ln2 + r, a degree-6 polynomial for e^r, times 2^n): within
// 1 ulp of exp over [-87, 88.3] (measured), and written without calls or branches so that loops using it
// vectorize. Inputs are clamped to that range (e^-87.3 is the smallest normal float; silu and sigmoid of
// larger |x| are 0 or their asymptote anyway).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline float silu(float x) { return x / (1.0f + vexp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// In-place softmax of one row of n scores.
inline void softmax_row(float* x, int64_t n) {
  float mx = -INFINITY;
  int64_t tail = 0;
#if defined(__AVX512F__)  // the compiler leaves a max reduction scalar (std::max's NaN order)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; tail + 16 <= n; tail += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + tail));
  mx = _mm512_reduce_max_ps(m);
#endif
  for (int64_t i = tail; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = vexp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// torch.argmax's order: the larger wins, a NaN beats every number, and of equals the first stays.
inline bool beats(float v, float current) { return v > current || (v != v && current == current); }

// torch.argmax of v[0, n): a vector pass for the maximum (and whether there is a NaN), then vector tests
// over 16 at a time for the first position that holds it.
inline int64_t first_argmax(const float* v, int64_t n) {
#if defined(__AVX512F__)
  if (n == 64) {  // a full panel's row (kPanel, linear.h), the greedy projection's case: all in four registers
    __m512 x[4];
    __mmask16 nan[4];
    for (int c = 0; c < 4; ++c) {
      x[c] = _mm512_loadu_ps(v + 16 * c);
      nan[c] = _mm512_cmp_ps_mask(x[c], x[c], _CMP_UNORD_Q);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]))));
    const bool any_nan = (nan[0] | nan[1] | nan[2] | nan[3]) != 0;
    for (int c = 0; c < 4; ++c) {
      const __mmask16 hit = any_nan ? nan[c] : _mm512_cmp_ps_mask(x[c], top, _CMP_EQ_OQ);
      if (hit != 0) return 16 * c + __builtin_ctz(hit);
    }
    return 0;  // unreachable: some lane holds the maximum
  }
#endif
  float best = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    best = std::max(best, v[i]);  // a NaN v[i] leaves best as it is: `nan` tracks those
    nan |= v[i] != v[i];
  }
  auto match = [&](int64_t i) { return nan ? v[i] != v[i] : v[i] == best; };
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t c1 = std::min(n, c0 + 16);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c0; i < c1; ++i) hit |= match(i);
    if (hit) {
      int64_t at = c0;
      while (!match(at)) ++at;
      return at;
    }
  }
  return 0;
}

}  // namespace deltaserve
