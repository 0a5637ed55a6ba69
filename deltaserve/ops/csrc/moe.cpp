#include "moe.h"

#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// out [n] = silu(gate [n]) * up [n]
inline void swiglu_row(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = silu(gate[j]) * up[j];
}

at::Tensor timed_apply(const Linear& l, const at::Tensor& x, double* slot) {
  Timed timed(slot);
  return apply(l, x);
}

// Expert e's output rows [n, H] for its tokens' input rows xs [n, H] (not yet scaled by their routing weights).
at::Tensor expert_rows(const MoeWeights& w, int64_t e, int64_t I, const at::Tensor& xs) {
  const int64_t n = xs.size(0);
  const at::Tensor gu = apply(w.gate_up[e], xs);  // [n, 2I]: gate | up
  at::Tensor act = at::empty({n, I}, xs.options());
  const float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) swiglu_row(gp + i * 2 * I, gp + i * 2 * I + I, ap + i * I, I);
  return apply(w.down[e], act);  // [n, H]
}

}  // namespace

std::vector<Linear> expert_linears(const at::Tensor& experts, const at::Tensor& scales, Format format, int64_t group,
                                   int64_t K, bool int8_activations, const std::string& what) {
  TORCH_CHECK(experts.dim() == 3 && (!scales.defined() || (scales.dim() == 3 && scales.size(0) == experts.size(0))),
              what, ": experts [E, N, K'] and scales [E, N, groups] expected");
  std::vector<Linear> out;
  for (int64_t e = 0; e < experts.size(0); ++e) {
    const at::Tensor scale = scales.defined() ? scales.select(0, e) : at::Tensor();
    out.push_back(make_linear({make_part(experts.select(0, e), scale, format, group, K, what)}, int8_activations));
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> moe_route(const MoeDims& d, const at::Tensor& logits) {
  // at::softmax and at::topk themselves: the same probabilities, and for exact ties (a zero router, repeated
  // router rows) the same k experts in the same order as the torch model's torch.topk.
  const at::Tensor probs = at::softmax(logits.contiguous(), -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, d.top_k, -1);
  if (d.norm_topk) weights = weights / weights.sum(-1, true);
  return {ids.contiguous(), weights.contiguous()};
}

at::Tensor moe_mlp(const MoeDims& d, const MoeWeights& w, const at::Tensor& h, double* projections) {
  const int64_t T = h.size(0), H = h.size(1), E = d.experts, k = d.top_k, I = d.inter, Is = d.shared_inter;
  // [T, E + 2 Is + 1]: router logits | shared expert gate | up | shared_expert_gate
  const at::Tensor proj = timed_apply(w.router_shared, h, projections);
  const int64_t width = proj.size(1);
  const float* pp = proj.data_ptr<float>();

  at::Tensor out = at::zeros({T, H}, h.options());
  float* op = out.data_ptr<float>();
  if (T == 0) return out;
  const auto [ids, weights] = moe_route(d, proj.narrow(1, 0, E));
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();

  // The (token, choice) pairs grouped by expert, tokens ascending within each (a counting sort): moe.py's
  // stable argsort, so each token's expert outputs are added in the same order, ascending expert ids.
  std::vector<int64_t> start(E + 1, 0), pairs(T * k);
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "moe: expert id out of range");
    ++start[ip[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) pairs[next[ip[p]]++] = p;

  // The experts some token chose, each with its tokens' rows. A decode step's experts have a token or two
  // each: too little for their projections to split their panels over threads (parallel.h's grain), so
  // the experts themselves go to the threads then. Each expert's rows are computed by one thread in one
  // order and added below in expert order: the same sums for any thread count.
  const float* hp = h.data_ptr<float>();
  std::vector<int64_t> touched;
  std::vector<at::Tensor> ys;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;  // an expert no token chose: its weights are never read
    at::Tensor xs = at::empty({n, H}, h.options());
    float* xp = xs.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) std::memcpy(xp + i * H, hp + pairs[start[e] + i] / k * H, H * sizeof(float));
    touched.push_back(e);
    ys.push_back(std::move(xs));
  }
  {
    Timed timed(projections);
    const int64_t per_expert = T * k / static_cast<int64_t>(touched.size()) * 3 * I * H;  // multiply-adds
    const auto run = [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) ys[j] = expert_rows(w, touched[j], I, ys[j]);
    };
    // (not at::parallel_for with a grain of all experts for the others: even inline it marks a parallel
    // region, and the projections' own parallel_for would then not split)
    const int64_t count = static_cast<int64_t>(touched.size());
    if (T <= kExpertParallelRows) {
      at::parallel_for(0, count, grain_for(per_expert), run);
    } else {
      run(0, count);
    }
  }
  for (size_t j = 0; j < touched.size(); ++j) {
    const int64_t e = touched[j], n = start[e + 1] - start[e];
    const float* yp = ys[j].data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pairs[start[e] + i];
      const float weight = wp[p];
      float* o = op + p / k * H;
      const float* yi = yp + i * H;
#pragma omp simd
      for (int64_t c = 0; c < H; ++c) o[c] += yi[c] * weight;
    }
  }

  at::Tensor shared_act = at::empty({T, Is}, h.options());
  float* sp = shared_act.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) swiglu_row(pp + t * width + E, pp + t * width + E + Is, sp + t * Is, Is);
  const at::Tensor shared = timed_apply(w.shared_down, shared_act, projections);  // [T, H]
  const float* shp = shared.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float scale = sigmoid(pp[t * width + E + 2 * Is]);
    float* o = op + t * H;
    const float* s = shp + t * H;
#pragma omp simd
    for (int64_t c = 0; c < H; ++c) o[c] += scale * s[c];
  }
  return out;
}

}  // namespace deltaserve
