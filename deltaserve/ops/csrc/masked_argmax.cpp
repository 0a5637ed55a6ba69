#include "masked_argmax.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "linear_int.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// v[j] for j < n masked by the row's allowed bits (from token n0 on): refused or NaN values become -inf.
void mask_values(float* v, int64_t n, int64_t n0, const uint32_t* row_bits) {
  for (int64_t j0 = 0; j0 < n; j0 += 32) {  // a word of the mask at a time
    const uint32_t word = row_bits[(n0 + j0) >> 5];
    for (int64_t j = j0; j < std::min<int64_t>(j0 + 32, n); ++j) {
      const bool ok = ((word >> (j - j0)) & 1u) != 0 && !std::isnan(v[j]);
      v[j] = ok ? v[j] : -INFINITY;
    }
  }
}

}  // namespace

void masked_argmax(const Linear& lm, const at::Tensor& h, const int32_t* allowed, int64_t words, int64_t* argmax) {
  const int64_t R = h.size(0), K = lm.K, N = lm.N, P = (N + kPanel - 1) / kPanel;
  const float* hp = h.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(allowed);
  const auto int8_part = [&](const WeightPart& p) { return reads_int8_activations(lm, p); };
  if (std::any_of(lm.parts.begin(), lm.parts.end(), int8_part)) {
    // An int8-activation head quantizes each call's rows together (linear_int.h): a subset of them would
    // not give compute_logits' numbers, so these rows take the whole logits, masked.
    const at::Tensor y = apply(lm, h);
    float* yp = y.data_ptr<float>();
    for (int64_t t = 0; t < R; ++t) {
      mask_values(yp + t * N, N, 0, bits + t * words);
      argmax[t] = first_argmax(yp + t * N, N);
    }
    return;
  }
  const bool packed = packed_rows(R);  // the kernel apply() runs for R rows: the same sums, row by row
  std::vector<float> best_value(R * P, -INFINITY);  // [R, P]: each row's best masked value in each panel
  std::vector<int64_t> best_column(R * P, 0);
  // Panel by panel, as apply() goes: the rows that allow a token of the panel are gathered and projected
  // together (each weight row read once for all of them).
  at::parallel_for(0, P, grain_for(R * K * kPanel / 8), [&](int64_t p0, int64_t p1) {
    std::vector<float> tile, x, out;
    std::vector<int64_t> rows;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0), w0 = n0 >> 5, w1 = (n0 + ncols - 1) >> 5;
      rows.clear();
      for (int64_t t = 0; t < R; ++t) {
        bool any = false;  // kPanel = 64: the panel's tokens are two words of the row's mask
        for (int64_t w = w0; w <= w1; ++w) any = any || bits[t * words + w] != 0;
        if (any) rows.push_back(t);
      }
      for (size_t b0 = 0; b0 < rows.size(); b0 += kPackedRowBlock) {  // as many rows as apply() takes at once
        const int64_t n = std::min<int64_t>(kPackedRowBlock, rows.size() - b0);
        out.resize(n * kPanel);
        const float* rows_x = hp + rows[b0] * K;
        if (rows[b0 + n - 1] - rows[b0] != n - 1) {  // not consecutive rows of h: gather them
          x.resize(n * K);
          for (int64_t i = 0; i < n; ++i) std::memcpy(x.data() + i * K, hp + rows[b0 + i] * K, K * sizeof(float));
          rows_x = x.data();
        }
        project_panel(lm, rows_x, n, n0, ncols, packed, tile, out.data(), kPanel);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = rows[b0 + i];
          float* v = out.data() + i * kPanel;
          mask_values(v, ncols, n0, bits + t * words);
          const int64_t at = first_argmax(v, ncols);
          best_value[t * P + p] = v[at];
          best_column[t * P + p] = n0 + at;
        }
      }
    }
  });
  for (int64_t t = 0; t < R; ++t) {
    int64_t at = -1;  // the first panel with the largest value; none above -inf: torch.argmax gives 0
    for (int64_t p = 0; p < P; ++p) {
      if (best_value[t * P + p] > (at < 0 ? -INFINITY : best_value[t * P + at])) at = p;
    }
    argmax[t] = at < 0 ? 0 : best_column[t * P + at];
  }
}

}  // namespace deltaserve
