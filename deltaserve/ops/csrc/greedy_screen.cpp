#include "greedy_screen.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "formats.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

#if defined(__AVX512BF16__)
GreedyScreen make_greedy_screen(const Linear& lm) {
  GreedyScreen s;
  if (lm.parts.size() != 1 || lm.parts[0].format != Format::kBFloat16) return s;
  const int64_t N = lm.N, K = lm.K;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(lm.parts[0].bytes);
  at::Tensor norms = at::empty({N}, at::kFloat);
  float* np = norms.data_ptr<float>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, N, grain_for(K), [&](int64_t n0, int64_t n1) {  // row by row: no widened copy
    for (int64_t n = n0; n < n1; ++n) {
      double sum = 0.0;
      bool ok = true;
      for (int64_t k = 0; k < K; ++k) {
        const double v = bf16_to_float(w[n * K + k]);
        ok = ok && std::isfinite(v);
        sum += v * v;
      }
      if (!ok) finite = false;
      np[n] = static_cast<float>(std::sqrt(sum) * (1.0 + 1e-6));  // up, past fp32 rounding
    }
  });
  const double max_norm = norms.max().item<double>();
  if (!finite || !(max_norm < 1e30)) return s;
  s.norms = norms;
  s.max_norm = max_norm;
  return s;
}
bool ready(const GreedyScreen& s) { return s.norms.defined(); }

// out[r * ldo + j] = the bf16 dot products of R rows (bf16 pairs, K2 per row) with NO weight rows (bf16, K
// per row, ldw apart), accumulated in fp32 by vdpbf16ps.
template <int NO, int R>
void screen_block(const uint32_t* x, int64_t K2, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[R][NO];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  auto step = [&](int64_t j0, __mmask16 pairs, __mmask32 values) {
    __m512bh wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(values, w + j * K + 2 * j0);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi32(pairs, x + r * K2 + j0);
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  };
  int64_t j0 = 0;
  for (; 2 * j0 + 32 <= K; j0 += 16) step(j0, 0xFFFF, 0xFFFFFFFFu);
  if (j0 < K2) {  // the last pairs; an odd K's last one has one weight (and x's high half is 0)
    step(j0, static_cast<__mmask16>((1u << (K2 - j0)) - 1), static_cast<__mmask32>((1ull << (K - 2 * j0)) - 1));
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NO; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

// Fills argmax [T]. Rows that are not finite, or whose logits could come near overflow, are outside the
// screen's range: all their panels go through the fp32 kernel, the plain path.
void screened_greedy(const at::Tensor& h, const GreedyScreen& s, const Linear& lm, int64_t* argmax) {
  const int64_t T = h.size(0), K = h.size(1), N = lm.N, P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  const float* hp = h.data_ptr<float>();
  std::vector<uint32_t> pairs(T * K2, 0);  // each row rounded to bf16 (subnormals flushed, as vdpbf16ps does)
  std::vector<float> scale(T, 0.0f), slack(T, 0.0f);
  std::vector<char> screened(T, 1);
  const double unit = std::ldexp(1.0, -24), gamma = (K + 2) * unit / (1.0 - (K + 2) * unit);
  for (int64_t t = 0; t < T; ++t) {
    double h2 = 0.0, rounded2 = 0.0, error2 = 0.0, h1 = 0.0;
    for (int64_t k = 0; k < K && screened[t]; ++k) {
      const float v = hp[t * K + k];
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      // round to nearest even (meaningless unless v is finite)
      uint32_t top = static_cast<uint32_t>(bf16_round_bits(bits)) << 16;
      float r;
      std::memcpy(&r, &top, sizeof(r));
      if (std::fabs(r) < FLT_MIN) r = 0.0f, top = 0;
      screened[t] = std::isfinite(v) && std::isfinite(r);
      pairs[t * K2 + k / 2] |= (top >> 16) << (16 * (k % 2));
      h2 += double(v) * v, rounded2 += double(r) * r, error2 += (double(v) - r) * (double(v) - r);
      h1 += std::fabs(double(v));
    }
    screened[t] = screened[t] && std::sqrt(h2) * s.max_norm < 1e36;
    if (!screened[t]) {
      std::fill(pairs.begin() + t * K2, pairs.begin() + (t + 1) * K2, 0u);
      continue;
    }
    // 1.25 and 4 x gamma: room for the float roundings of the norms and of the bounds themselves
    scale[t] = static_cast<float>(1.25 * std::sqrt(error2) + 4.0 * gamma * (std::sqrt(h2) + std::sqrt(rounded2)));
    slack[t] = static_cast<float>(std::ldexp(h1 + 2.0 * K, -100));
  }
  std::vector<float> lower(T * P), upper(T * P);  // [T, P]
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(lm.parts[0].bytes);
  const float* np = s.norms.data_ptr<float>();
  at::parallel_for(0, P, grain_for(T * K * kPanel / 2), [&](int64_t p0, int64_t p1) {
    float approx[4 * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
      for (int64_t t = 0; t < T; t += 4) {  // 4 outputs' weights stay in L1 while the row tiles pass
        const int64_t rows = std::min<int64_t>(4, T - t);
        with_rows<4>(rows, [&](auto R) {
          constexpr int kR = decltype(R)::value;
          int64_t j = 0;
          for (; j + 4 <= ncols; j += 4) {
            screen_block<4, kR>(pairs.data() + t * K2, K2, wp + (n0 + j) * K, K, approx + j, kPanel);
          }
          for (; j < ncols; ++j) screen_block<1, kR>(pairs.data() + t * K2, K2, wp + (n0 + j) * K, K, approx + j, kPanel);
        });
        for (int64_t r = 0; r < rows; ++r) {
          float lo = -INFINITY, hi = -INFINITY;
          for (int64_t j = 0; j < ncols; ++j) {
            const float a = approx[r * kPanel + j], margin = scale[t + r] * np[n0 + j] + slack[t + r];
            lo = std::max(lo, a - margin);
            hi = std::max(hi, a + margin);
          }
          lower[(t + r) * P + p] = lo;
          upper[(t + r) * P + p] = hi;
        }
      }
    }
  });
  const bool packed = packed_rows(T);  // the kernel logits() runs for T rows: the same sums
  at::parallel_for(0, T, grain_for(4 * K * kPanel), [&](int64_t t0, int64_t t1) {
    float logits[kPanel];
    std::vector<float> tile;
    for (int64_t t = t0; t < t1; ++t) {
      const float floor = *std::max_element(lower.begin() + t * P, lower.begin() + (t + 1) * P);
      int64_t best = -1;
      float best_value = 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        if (screened[t] && !(upper[t * P + p] >= floor)) continue;
        const int64_t ncols = std::min(kPanel, N - p * kPanel);
        project_panel(lm, hp + t * K, 1, p * kPanel, ncols, packed, tile, logits, kPanel);
        const int64_t at = first_argmax(logits, ncols);
        if (best < 0 || beats(logits[at], best_value)) best = p * kPanel + at, best_value = logits[at];
      }
      argmax[t] = best;
    }
  });
}
#else
GreedyScreen make_greedy_screen(const Linear&) { return {}; }
bool ready(const GreedyScreen&) { return false; }
void screened_greedy(const at::Tensor&, const GreedyScreen&, const Linear&, int64_t*) {}
#endif

}  // namespace deltaserve
