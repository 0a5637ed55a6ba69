// Projections: a Linear is an fp32 weight for ATen's GEMM (MKL) and, for bf16-valued weights, bf16 panels
// that the panel kernel streams instead. The kernel templates stay here, inlinable, for the greedy screen.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace deltaserve {

// A projection y = x @ w^T whose weight w [N, K] is given as its row blocks, the model's own fp32 weights
// (read where they are: the fused step keeps no fp32 copy of them; gate_proj | up_proj, for instance), and,
// when every value is exactly a bfloat16 (a bf16 checkpoint computed in fp32), the same values as bf16
// panels [ceil(N/64), K, 64] of all the rows (padded with zeros): half the bytes to stream, laid out so that
// a panel of 64 outputs is read front to back. Within a panel row the outputs are interleaved
// (deltaserve/executor/fused_cpu/stack.py, _linear): output 32h + i at word 32h + 2i and output 32h + 16 + i
// at word 32h + 2i + 1, so that, read as 32-bit lanes, the low words are 16 consecutive outputs and the high
// words the next 16. bf16 is the top half of an fp32: the low words shifted up by 16 bits and the lanes
// with their low 16 bits cleared are the weights in fp32, exactly, two cheap ops for 32 weights.
constexpr int64_t kPanel = 64;
struct Linear {
  std::vector<at::Tensor> parts;  // fp32 [N_i, K], in output order: N = sum N_i
  at::Tensor panels;              // bf16 [ceil(N/64), K, 64], or undefined
  int64_t N = 0, K = 0;

  bool defined() const { return N > 0; }
};

// The Linear of these parts (contiguous fp32 [N_i, K] each) and panels (undefined, or bf16 panels of all
// their rows); the caller has checked the shapes.
Linear make_linear(std::vector<at::Tensor> parts, at::Tensor panels);

// The 64 weights of panel row k in fp32, in output order (the portable path; AVX-512 does it in registers).
inline void panel_row_to_float(const uint16_t* row, float* w) {
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 16; ++i) {
      const uint32_t low = static_cast<uint32_t>(row[32 * h + 2 * i]) << 16;
      const uint32_t high = static_cast<uint32_t>(row[32 * h + 2 * i + 1]) << 16;
      std::memcpy(w + 32 * h + i, &low, sizeof(float));
      std::memcpy(w + 32 * h + 16 + i, &high, sizeof(float));
    }
  }
}

// Rows of x go through the panel kernels 6 at a time (24 accumulators + 4 weight registers of 32): calls
// f(std::integral_constant<int, R>) with R = rows (1..6) known at compile time.
template <typename F>
inline void with_row_tile(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// R input rows times one panel: R x 64 fp32 accumulators in registers, each weight converted once and used
// for all R rows. The products and the fp32 accumulation are the GEMM's; only the summation order differs.
// `stream`: write full panels of y with non-temporal stores (y and ldy 64-byte aligned; see linear_panels).
template <int R>
void panel_rows(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t ldy, int64_t ncols,
                bool stream = false) {
#if defined(__AVX512F__)
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    const __m512i lo = _mm512_loadu_si512(panel + k * kPanel), hi = _mm512_loadu_si512(panel + k * kPanel + 32);
    const __m512 w[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(lo, high_words)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(hi, high_words))};
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == kPanel && stream) {
      for (int j = 0; j < 4; ++j) _mm512_stream_ps(y + r * ldy + 16 * j, acc[r][j]);
    } else if (ncols == kPanel) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
    } else {  // the last panel of an N that is not a multiple of 64
      float row[kPanel];
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(row + 16 * j, acc[r][j]);
      std::memcpy(y + r * ldy, row, ncols * sizeof(float));
    }
  }
#else
  (void)stream;  // plain stores here
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kPanel];
    panel_row_to_float(panel + k * kPanel, w);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], ncols * sizeof(float));
#endif
}

// Rows of x processed against every panel before the next rows: 96 rows of K <= 1024 floats stay in L2
// while the panels stream past them (a 2048-row prompt chunk otherwise re-reads x from L3 for each panel).
constexpr int64_t kRowBlock = 96;
constexpr int64_t kStreamBytes = 2 << 20;

// y [T, N] = x [T, K] @ w^T from the bf16 panels; threads split the panels. With `argmax` (int64 [T]),
// y is not kept: each tile is reduced to its rows' best column while it is in L1, and argmax gets each
// row's torch.argmax -- greedy sampling without writing (and reading back) T x vocab logits.
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t* argmax = nullptr);

// y [T, N] = x [T, K] @ w^T through the panels where the weight has them, else MKL (see linear.cpp).
at::Tensor apply(const Linear& l, const at::Tensor& x);

}  // namespace deltaserve
