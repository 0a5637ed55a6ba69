// The rotary tables of one step, from text positions [T] or multimodal (mRoPE) positions [3, T] (t, h, w rows),
// as deltaserve/model/layers.py RotaryEmbedding.cos_sin computes them.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace deltaserve {

struct StepRope {
  // int64 [T]: each token's index in its sequence, the position the KV cache and the causal mask read
  // (Batch.positions). Text positions are that index already; under mRoPE it is context_lens[b] plus the
  // token's offset in its chunk, the 1-D positions the engine would give a text step.
  at::Tensor index;
  std::vector<float> cos, sin;  // [T, half]
};

// axis [half]: the position row (0 t, 1 h, 2 w) frequency f reads under mRoPE (RotaryEmbedding.axis: the
// interleaved mrope_section rule); all zeros for a text model. Text positions read the one row they have.
inline StepRope step_rope(const at::Tensor& positions, int64_t T, const at::Tensor& qsl, const at::Tensor& context_lens,
                          const float* inv_freq, const int64_t* axis, int64_t half) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "FusedStack: positions are int64");
  TORCH_CHECK(positions.dim() == 1 || (positions.dim() == 2 && positions.size(0) == 3),
              "FusedStack: positions are [T] (text) or [3, T] (mRoPE t, h, w rows), not ", positions.sizes());
  TORCH_CHECK(positions.size(-1) == T, "FusedStack: ", positions.size(-1), " positions for ", T, " tokens");
  StepRope r;
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (positions.dim() == 1) {
    r.index = positions;
  } else {
    TORCH_CHECK(qsl.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong && qsl.is_contiguous() &&
                    context_lens.is_contiguous() && qsl.numel() == context_lens.numel() + 1,
                "FusedStack: query_start_loc [B + 1] and context_lens [B] are int64");
    const int64_t B = context_lens.numel(), *q = qsl.data_ptr<int64_t>(), *c = context_lens.data_ptr<int64_t>();
    TORCH_CHECK(q[0] == 0 && q[B] == T, "FusedStack: query_start_loc must span the T tokens");
    r.index = at::empty({T}, positions.options());
    int64_t* ip = r.index.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(q[b] <= q[b + 1], "FusedStack: query_start_loc must not decrease");
      for (int64_t t = q[b]; t < q[b + 1]; ++t) ip[t] = c[b] + t - q[b];
    }
  }
  const int64_t rows = positions.dim() == 1 ? 0 : T;  // stride between the t, h and w rows (0: one row)
  r.cos.resize(T * half);
  r.sin.resize(T * half);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < half; ++f) {
      const float angle = static_cast<float>(pos[axis[f] * rows + t]) * inv_freq[f];
      r.cos[t * half + f] = std::cos(angle);
      r.sin[t * half + f] = std::sin(angle);
    }
  }
  return r;
}

}  // namespace deltaserve
