#include "moe.h"

#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

#include "linear_int.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// out [n] = silu(gate [n]) * up [n]
inline void swiglu_row(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = silu(gate[j]) * up[j];
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

// A gap between two of the k + 1 largest logits of at most this much (relative to 1 + their distance from
// the largest) may vanish in torch's fp32 probabilities (exp within an ulp, the subtraction and the scaling
// rounded: about 6e-7 at worst), and which of the two torch.topk then puts first (or takes at all, at the
// k-th place) depends on its selection algorithm: such rows are routed by moe_route itself. So are rows whose k-th probability is so small that
// it might round to a tie (exp below e^-60), and rows with a NaN.
constexpr float kTieGap = 2e-6f;
constexpr float kSmallestLogGap = 60.0f;

// Row l [E]'s k experts and weights as moe_route gives them: the k largest logits (the largest probabilities:
// the same order), probabilities exp(l - max) * (1 / sum) and, when norm_topk, divided by their sum in that
// order, as torch computes them (exp to within an ulp: the weights agree to rounding). Returns false, having
// written nothing, for a row it leaves to moe_route (kTieGap). k <= kMaxTopK.
constexpr int64_t kMaxTopK = 63;
bool route_row(const float* l, int64_t E, int64_t k, bool norm_topk, int64_t* ids, float* weights) {
  if (k > kMaxTopK) return false;
  float value[kMaxTopK + 1];
  int64_t id[kMaxTopK + 1];
  const int64_t keep = std::min(k + 1, E);  // the k + 1 largest, descending (the first id of equal ones first)
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = l[e];
    if (std::isnan(v)) return false;
    if (n == keep && !(v > value[n - 1])) continue;
    int64_t j = n < keep ? n++ : n - 1;
    for (; j > 0 && v > value[j - 1]; --j) value[j] = value[j - 1], id[j] = id[j - 1];
    value[j] = v, id[j] = e;
  }
  const float top = value[0], last = value[k - 1];
  if (!(top - last < kSmallestLogGap)) return false;  // (also an infinite logit: NaN probabilities in torch)
  for (int64_t j = 1; j < keep; ++j) {  // (the order of the k chosen too: torch.topk's, the weights summed in it)
    if (!(value[j - 1] - value[j] > kTieGap * (1.0f + (top - value[j - 1])))) return false;
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - top);
  const float inv = 1.0f / sum;
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = id[j];
    weights[j] = std::exp(value[j] - top) * inv;
    chosen += weights[j];
  }
  for (int64_t j = 0; norm_topk && j < k; ++j) weights[j] /= chosen;
  return true;
}

// A step's buffers on the thread that runs its MoE block, grown to the largest step seen and never shrunk:
// a decode step allocates nothing here once warm (but its output).
struct BlockScratch {
  std::vector<float> proj, weights, ys, shared_act, shared_out;
  std::vector<int64_t> ids, start, next, pairs, touched;
  ActivationRows h_rows, shared_rows;  // h's rows and the shared expert's activations, quantized
};

// An expert's buffers on the thread that runs it (the same way).
struct ExpertScratch {
  std::vector<int64_t> tokens;
  std::vector<float> xs, gu, act;
  ActivationRows x_rows, act_rows;
};

// Expert e's output rows y [n, H] for the tokens of its n (token, choice) pairs (pair p is token p / k), not
// yet scaled by their routing weights, from the block's input h and its rows quantized (h_rows): a single
// token's row is read where it is; several are gathered, their quantized rows too (quantized once per token
// for all the experts that chose it).
void expert_rows_into(const MoeWeights& w, int64_t e, int64_t H, int64_t I, const int64_t* pairs, int64_t n,
                      int64_t k, const float* h, const ActivationRows& h_rows, float* y) {
  thread_local ExpertScratch s;
  const float* x = h;
  const ActivationRows* rows = &h_rows;
  int64_t r0 = pairs[0] / k;
  if (n > 1) {
    s.tokens.resize(n), s.xs.resize(n * H);
    for (int64_t i = 0; i < n; ++i) {
      s.tokens[i] = pairs[i] / k;
      std::memcpy(s.xs.data() + i * H, h + s.tokens[i] * H, H * sizeof(float));
    }
    gather_rows(h_rows, s.tokens.data(), n, s.x_rows);
    x = s.xs.data(), rows = &s.x_rows, r0 = 0;
  }
  s.gu.resize(n * 2 * I), s.act.resize(n * I);
  apply_rows(w.gate_up[e], x, r0, r0 + n, *rows, s.gu.data());  // [n, 2I]: gate | up
  for (int64_t i = 0; i < n; ++i) {
    swiglu_row(s.gu.data() + i * 2 * I, s.gu.data() + i * 2 * I + I, s.act.data() + i * I, I);
  }
  quantize_activations_into({&w.down[e]}, s.act.data(), n, s.act_rows);
  apply_rows(w.down[e], s.act.data(), 0, n, s.act_rows, y);  // [n, H]
}

// ids, weights [T, k] of rows of logits (row t at logits + t * ld): route_row, or moe_route for the rows it
// leaves (ties).
void route_rows(const MoeDims& d, const float* logits, int64_t T, int64_t ld, int64_t* ids, float* weights) {
  const int64_t E = d.experts, k = d.top_k;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits + t * ld;
    if (route_row(row, E, k, d.norm_topk, ids + t * k, weights + t * k)) continue;
    const at::Tensor view = at::from_blob(const_cast<float*>(row), {1, E}, at::TensorOptions().dtype(at::kFloat));
    const auto [row_ids, row_weights] = moe_route(d, view);
    std::memcpy(ids + t * k, row_ids.data_ptr<int64_t>(), k * sizeof(int64_t));
    std::memcpy(weights + t * k, row_weights.data_ptr<float>(), k * sizeof(float));
  }
}

}  // namespace

std::vector<Linear> expert_linears(const at::Tensor& experts, const at::Tensor& scales, Format format, int64_t group,
                                   int64_t K, bool int8_activations, const std::string& what,
                                   bool bf16_activations) {
  TORCH_CHECK(experts.dim() == 3 && (!scales.defined() || (scales.dim() == 3 && scales.size(0) == experts.size(0))),
              what, ": experts [E, N, K'] and scales [E, N, groups] expected");
  std::vector<Linear> out;
  for (int64_t e = 0; e < experts.size(0); ++e) {
    const at::Tensor scale = scales.defined() ? scales.select(0, e) : at::Tensor();
    out.push_back(make_linear({make_part(experts.select(0, e), scale, format, group, K, what)}, int8_activations,
                              bf16_activations));
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

std::pair<at::Tensor, at::Tensor> moe_route_fast(const MoeDims& d, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) == d.experts,
              "moe_route: float32 logits [T, ", d.experts, "] expected");
  const at::Tensor l = logits.contiguous();
  const int64_t T = l.size(0);
  at::Tensor ids = at::empty({T, d.top_k}, l.options().dtype(at::kLong)), weights = at::empty({T, d.top_k}, l.options());
  route_rows(d, l.data_ptr<float>(), T, d.experts, ids.data_ptr<int64_t>(), weights.data_ptr<float>());
  return {ids, weights};
}

at::Tensor moe_mlp(const MoeDims& d, const MoeWeights& w, const at::Tensor& h, double* projections) {
  thread_local BlockScratch scratch;
  BlockScratch& s = scratch;  // (the threads running the experts below reach this thread's through the reference)
  const int64_t T = h.size(0), H = h.size(1), E = d.experts, k = d.top_k, I = d.inter, Is = d.shared_inter;
  const int64_t width = w.router_shared.N;  // router logits | shared expert gate | up | shared_expert_gate
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && H == w.router_shared.K,
              "moe: h must be contiguous float32 [T, ", w.router_shared.K, "]");
  at::Tensor out = at::zeros({T, H}, h.options());
  if (T == 0) return out;
  float* op = out.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  // A step of a few rows (decode) takes each row's quantization (int8 activations) once for every projection
  // that reads it: the shared expert's gate / up and the gate|up of every expert that chose it (as the torch
  // Experts does). Larger steps quantize each expert's gathered rows (expert_rows: apply).
  const bool few = T <= kExpertParallelRows;
  if (few) {
    // (not in AMX tiles: each expert gathers a few of these rows, which the VNNI kernel takes faster)
    quantize_activations_into({&w.router_shared, &w.gate_up[0]}, hp, T, s.h_rows, false);
  } else {
    quantize_activations_into({&w.router_shared}, hp, T, s.h_rows);
  }
  s.proj.resize(T * width);
  {
    Timed timed(projections);
    apply_rows(w.router_shared, hp, 0, T, s.h_rows, s.proj.data());
  }
  const float* pp = s.proj.data();
  s.ids.resize(T * k), s.weights.resize(T * k);
  route_rows(d, pp, T, width, s.ids.data(), s.weights.data());
  const int64_t* ip = s.ids.data();
  const float* wp = s.weights.data();

  // The (token, choice) pairs grouped by expert, tokens ascending within each (a counting sort): moe.py's
  // stable argsort, so each token's expert outputs are added in the same order, ascending expert ids.
  s.start.assign(E + 1, 0), s.pairs.resize(T * k);
  int64_t* start = s.start.data();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "moe: expert id out of range");
    ++start[ip[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  s.next.assign(s.start.begin(), s.start.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) s.pairs[s.next[ip[p]]++] = p;
  const int64_t* pairs = s.pairs.data();
  s.touched.clear();  // the experts some token chose: an expert no token chose is never read
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > start[e]) s.touched.push_back(e);
  }
  const int64_t count = static_cast<int64_t>(s.touched.size());

  // Each chosen expert's rows [n, H], at its pairs' places (ys [T k, H]). A decode step's experts have a
  // token or two each: too little for their projections to split their panels over threads (parallel.h's
  // grain), so the experts themselves go to the threads then. Each expert's rows are computed by one thread
  // in one order and added below in expert order: the same sums for any thread count.
  const float* ys;
  std::vector<at::Tensor> expert_out;  // larger steps: each expert's rows (expert_rows)
  {
    Timed timed(projections);
    if (few) {
      s.ys.resize(T * k * H);
      const int64_t per_expert = T * k / count * 3 * I * H;  // multiply-adds
      at::parallel_for(0, count, grain_for(per_expert), [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t e = s.touched[j];
          expert_rows_into(w, e, H, I, pairs + start[e], start[e + 1] - start[e], k, hp, s.h_rows,
                           s.ys.data() + start[e] * H);
        }
      });
      ys = s.ys.data();
    } else {
      // (not at::parallel_for with a grain of all experts: even inline it marks a parallel region, and the
      // projections' own parallel_for would then not split)
      for (int64_t j = 0; j < count; ++j) {
        const int64_t e = s.touched[j], n = start[e + 1] - start[e];
        at::Tensor xs = at::empty({n, H}, h.options());
        float* xp = xs.data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) std::memcpy(xp + i * H, hp + pairs[start[e] + i] / k * H, H * sizeof(float));
        expert_out.push_back(expert_rows(w, e, I, xs));
      }
      ys = nullptr;
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const int64_t e = s.touched[j], n = start[e + 1] - start[e];
    const float* yp = few ? ys + start[e] * H : expert_out[j].data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pairs[start[e] + i];
      const float weight = wp[p];
      float* o = op + p / k * H;
      const float* yi = yp + i * H;
#pragma omp simd
      for (int64_t c = 0; c < H; ++c) o[c] += yi[c] * weight;
    }
  }

  s.shared_act.resize(T * Is), s.shared_out.resize(T * H);
  float* sp = s.shared_act.data();
  for (int64_t t = 0; t < T; ++t) swiglu_row(pp + t * width + E, pp + t * width + E + Is, sp + t * Is, Is);
  quantize_activations_into({&w.shared_down}, sp, T, s.shared_rows);
  {
    Timed timed(projections);
    apply_rows(w.shared_down, sp, 0, T, s.shared_rows, s.shared_out.data());  // [T, H]
  }
  const float* shp = s.shared_out.data();
  for (int64_t t = 0; t < T; ++t) {
    const float scale = sigmoid(pp[t * width + E + 2 * Is]);
    float* o = op + t * H;
    const float* sh = shp + t * H;
#pragma omp simd
    for (int64_t c = 0; c < H; ++c) o[c] += scale * sh[c];
  }
  return out;
}

}  // namespace deltaserve
