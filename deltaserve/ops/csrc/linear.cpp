#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "parallel.h"

namespace deltaserve {

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t* argmax) {
  const int64_t T = x.size(0), K = x.size(1), P = panels.size(0);
  at::Tensor y = argmax == nullptr ? at::empty({T, N}, x.options()) : at::Tensor();
  std::vector<float> best_value(argmax == nullptr ? 0 : T * P);  // [T, P]: each row's best in each panel
  std::vector<int64_t> best_column(best_value.size());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  const float* xp = x.data_ptr<float>();
  float* yp = argmax == nullptr ? y.data_ptr<float>() : nullptr;
  // An output past kStreamBytes (a long prompt chunk's) is written around the caches: a normal store first
  // reads each line of y from memory, and y would push the row block and the panel out of L2. On the 60M
  // benchmark model's 2048-row projections: 3-5% with outputs of 12 MB and more, 2-4% with the 4 MB of the
  // 512-wide ones. A decode step's outputs (64 rows x 3072 at most: 0.8 MB) stay in the caches.
  const bool stream = yp != nullptr && T * N * static_cast<int64_t>(sizeof(float)) > kStreamBytes && N % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(yp) % 64 == 0;
  for (int64_t r0 = 0; r0 < T; r0 += kRowBlock) {
    const int64_t r1 = std::min(T, r0 + kRowBlock);
    at::parallel_for(0, P, grain_for((r1 - r0) * K * kPanel), [&](int64_t p0, int64_t p1) {
      float tile[6 * kPanel];
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* panel = wp + p * K * kPanel;
        const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
        for (int64_t t = r0; t < r1; t += 6) {
          const int64_t rows = std::min<int64_t>(6, r1 - t);
          const float* xt = xp + t * K;
          float* out = yp != nullptr ? yp + t * N + n0 : tile;
          const int64_t ld = yp != nullptr ? N : kPanel;
          with_row_tile(rows, [&](auto R) { panel_rows<decltype(R)::value>(xt, K, panel, out, ld, ncols, stream); });
          for (int64_t r = 0; yp == nullptr && r < rows; ++r) {
            const int64_t at = first_argmax(tile + r * kPanel, ncols);
            best_value[(t + r) * P + p] = tile[r * kPanel + at];
            best_column[(t + r) * P + p] = n0 + at;
          }
        }
      }
#if defined(__AVX512F__)
      if (stream) _mm_sfence();  // the non-temporal stores are ordered before whatever reads y next
#endif
    });
  }
  for (int64_t t = 0; argmax != nullptr && t < T; ++t) {
    int64_t at = 0;
    for (int64_t p = 1; p < P; ++p) at = beats(best_value[t * P + p], best_value[t * P + at]) ? p : at;
    argmax[t] = best_column[t * P + at];
  }
  return y;
}

Linear make_linear(std::vector<at::Tensor> parts, at::Tensor panels) {
  Linear l;
  for (const at::Tensor& p : parts) l.N += p.size(0);
  l.K = parts.at(0).size(1);
  l.parts = std::move(parts);
  l.panels = std::move(panels);
  return l;
}

// The panel kernel where the weight has panels: on the 60M benchmark model's shapes it runs at 53-57
// GMAC/s from 64 rows up, against MKL's 26-49 (one AVX-512 core, benchmarks-style measurement through
// the exported linear_panels); otherwise MKL, one GEMM per part into its columns of y (a GEMM writes a
// column block of y in place, its row stride being N).
at::Tensor apply(const Linear& l, const at::Tensor& x) {
  if (l.panels.defined()) return linear_panels(x, l.panels, l.N);
  if (l.parts.size() == 1) return at::linear(x, l.parts[0]);
  at::Tensor y = at::empty({x.size(0), l.N}, x.options());
  int64_t column = 0;
  for (const at::Tensor& p : l.parts) {
    at::Tensor block = y.narrow(1, column, p.size(0));
    at::mm_out(block, x, p.t());
    column += p.size(0);
  }
  return y;
}

}  // namespace deltaserve
