#include "masked_argmax.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace deltaserve {

void masked_argmax(const Linear& lm, const at::Tensor& h, const int32_t* allowed, int64_t words, int64_t* argmax) {
  const int64_t R = h.size(0), K = lm.K, N = lm.N, P = (N + kPanel - 1) / kPanel;
  const float* hp = h.data_ptr<float>();
  const bool packed = packed_rows(R);  // the kernel apply() runs for R rows: the same sums
  // a row is a few panels' work, unless its mask allows much of the vocabulary
  at::parallel_for(0, R, grain_for(8 * K * kPanel), [&](int64_t t0, int64_t t1) {
    std::vector<float> tile;
    float values[kPanel];
    for (int64_t t = t0; t < t1; ++t) {
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(allowed + t * words);
      int64_t best = 0;
      float best_value = -INFINITY;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
        bool any = false;  // kPanel = 64: the panel's tokens are two words of the mask (n0 is a multiple of 32)
        for (int64_t w = n0 >> 5; w <= (n0 + ncols - 1) >> 5; ++w) any = any || bits[w] != 0;
        if (!any) continue;
        project_panel(lm, hp + t * K, 1, n0, ncols, packed, tile, values, kPanel);
        for (int64_t j = 0; j < ncols; ++j) {
          const int64_t v = n0 + j;
          const bool ok = ((bits[v >> 5] >> (v & 31)) & 1u) != 0 && !std::isnan(values[j]);
          values[j] = ok ? values[j] : -INFINITY;
        }
        const int64_t at = first_argmax(values, ncols);
        if (values[at] > best_value) best = n0 + at, best_value = values[at];  // of equals the first stays
      }
      argmax[t] = best;  // 0 when every value is -inf, as torch.argmax gives
    }
  });
}

}  // namespace deltaserve
