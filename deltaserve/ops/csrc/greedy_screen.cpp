#include "greedy_screen.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace deltaserve {

#if defined(__AVX512BF16__)
GreedyScreen make_greedy_screen(const Linear& lm) {
  GreedyScreen s;
  std::vector<at::Tensor> part_norms;
  for (const at::Tensor& w : lm.parts) {
    if (!at::isfinite(w).all().item<bool>()) return s;
    part_norms.push_back(w.to(at::kDouble).square().sum(1).sqrt() * (1.0 + 1e-6));  // up, past fp32 rounding
  }
  const at::Tensor norms = at::cat(part_norms);
  if (!(norms.max().item<double>() < 1e30)) return s;
  const int64_t N = lm.N, K = lm.K, P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  const at::TensorOptions fp32 = lm.parts[0].options();
  at::Tensor padded = at::zeros({P * kPanel, 2 * K2}, fp32.dtype(at::kBFloat16));
  int64_t row = 0;
  for (const at::Tensor& w : lm.parts) {
    padded.narrow(0, row, w.size(0)).narrow(1, 0, K).copy_(w);
    row += w.size(0);
  }
  s.pairs = padded.view({P, kPanel, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  s.max_norm = norms.max().item<double>();
  s.norms = at::zeros({P * kPanel}, fp32);
  s.norms.narrow(0, 0, N).copy_(norms);
  s.bias = at::full({P * kPanel}, -INFINITY, fp32);
  s.bias.narrow(0, 0, N).zero_();
  return s;
}
bool ready(const GreedyScreen& s) { return s.pairs.defined(); }

// R rows (bf16 pairs) times one panel of pairs, then each row's largest lower and upper bound in the panel.
template <int R>
void screen_rows(const uint32_t* x, int64_t K2, const uint16_t* panel, const float* norms, const float* bias,
                 const float* scale, const float* slack, float* lower, float* upper, int64_t ld) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kPanel + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * K2 + k]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 lo = _mm512_set1_ps(-INFINITY), hi = lo;
    for (int j = 0; j < 4; ++j) {
      const __m512 b = _mm512_loadu_ps(bias + 16 * j);
      const __m512 margin = _mm512_fmadd_ps(_mm512_set1_ps(scale[r]), _mm512_loadu_ps(norms + 16 * j),
                                            _mm512_set1_ps(slack[r]));
      lo = _mm512_max_ps(lo, _mm512_add_ps(_mm512_sub_ps(acc[r][j], margin), b));
      hi = _mm512_max_ps(hi, _mm512_add_ps(_mm512_add_ps(acc[r][j], margin), b));
    }
    lower[r * ld] = _mm512_reduce_max_ps(lo);
    upper[r * ld] = _mm512_reduce_max_ps(hi);
  }
}

// Fills argmax [T]. Rows that are not finite, or whose logits could come near overflow, are outside the
// screen's range: all their panels go through the fp32 kernel, the plain path.
void screened_greedy(const at::Tensor& h, const GreedyScreen& s, const Linear& lm, int64_t* argmax) {
  const int64_t T = h.size(0), K = h.size(1), N = lm.N, P = s.pairs.size(0), K2 = s.pairs.size(1);
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
      bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (meaningless unless v is finite)
      uint32_t top = bits & 0xFFFF0000u;
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
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(s.pairs.data_ptr<at::BFloat16>());
  const float* np = s.norms.data_ptr<float>();
  const float* bp = s.bias.data_ptr<float>();
  for (int64_t r0 = 0; r0 < T; r0 += kRowBlock) {
    const int64_t r1 = std::min(T, r0 + kRowBlock);
    at::parallel_for(0, P, grain_for((r1 - r0) * K * kPanel / 2), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* panel = wp + p * K2 * 2 * kPanel;
        for (int64_t t = r0; t < r1; t += 6) {
          const int64_t rows = std::min<int64_t>(6, r1 - t);
          with_row_tile(rows, [&](auto R) {
            screen_rows<decltype(R)::value>(pairs.data() + t * K2, K2, panel, np + p * kPanel, bp + p * kPanel,
                                            scale.data() + t, slack.data() + t, lower.data() + t * P + p,
                                            upper.data() + t * P + p, P);
          });
        }
      }
    });
  }
  const uint16_t* exact = reinterpret_cast<const uint16_t*>(lm.panels.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, grain_for(4 * K * kPanel), [&](int64_t t0, int64_t t1) {
    float logits[kPanel];
    for (int64_t t = t0; t < t1; ++t) {
      const float floor = *std::max_element(lower.begin() + t * P, lower.begin() + (t + 1) * P);
      int64_t best = -1;
      float best_value = 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        if (screened[t] && !(upper[t * P + p] >= floor)) continue;
        const int64_t ncols = std::min(kPanel, N - p * kPanel);
        panel_rows<1>(hp + t * K, K, exact + p * K * kPanel, logits, kPanel, ncols);
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
