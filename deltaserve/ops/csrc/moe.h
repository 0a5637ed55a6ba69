// The sparse-MoE MLP of Qwen3.5-MoE and Qwen3-Next (deltaserve/model/moe.py is its reference): a softmax top-k
// router over E SwiGLU experts, renormalised over the k chosen when norm_topk_prob, plus a shared expert
// scaled by sigmoid(shared_expert_gate(x)). The (token, choice) pairs are grouped by expert and each expert
// some token chose runs one gate|up and one down projection over its tokens: a decode step reads only the
// weights of the experts its tokens chose.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "linear.h"

namespace deltaserve {

struct MoeDims {
  int64_t experts, top_k, inter, shared_inter;  // E, k, moe_intermediate_size, shared_expert_intermediate_size
  bool norm_topk;                              // renormalise the k chosen weights to sum to 1
};

struct MoeWeights {
  // [E + 2*shared_inter + 1, hidden]: rows of the router (gate) | shared_expert.gate_proj | .up_proj |
  // shared_expert_gate, which all read the layer's normed input
  Linear router_shared;
  Linear shared_down;             // [hidden, shared_inter]
  std::vector<Linear> gate_up;    // per expert [2*inter, hidden]: row block e of the model's experts.gate_up_proj
  std::vector<Linear> down;       // per expert [hidden, inter]: row block e of experts.down_proj
};

// One projection per expert e of K inputs: row block e of the model's 3-D data [E, N, K'] and, for a quantized
// format, of its scales [E, N, groups] (undefined otherwise), read where they are; int8_activations and
// bf16_activations as make_linear's. `what` names them in errors.
std::vector<Linear> expert_linears(const at::Tensor& experts, const at::Tensor& scales, Format format, int64_t group,
                                   int64_t K, bool int8_activations, const std::string& what,
                                   bool bf16_activations = false);

// The routing of x's rows: expert ids and weights [T, k] as moe.py's SparseMoeBlock.route (softmax in
// fp32 over the router logits [T, E], torch.topk's choice and order, ties included).
std::pair<at::Tensor, at::Tensor> moe_route(const MoeDims& d, const at::Tensor& logits);

// The routing moe_mlp does: the same choice as moe_route, weights to rounding (exp within an ulp of torch's),
// row by row in one loop over the logits; a row whose k-th and (k+1)-th choice may tie in torch's
// probabilities (or with a NaN) goes to moe_route.
std::pair<at::Tensor, at::Tensor> moe_route_fast(const MoeDims& d, const at::Tensor& logits);

// Steps of at most this many rows run their experts on separate threads, larger ones split each expert's
// projections over the threads (its panels of outputs; its tokens are many).
constexpr int64_t kExpertParallelRows = 32;

// The MLP's output [T, hidden] for normed input rows h [T, hidden]; adds the seconds its projections take to
// *projections (when not null: the stack's profile).
at::Tensor moe_mlp(const MoeDims& d, const MoeWeights& w, const at::Tensor& h, double* projections);

}  // namespace deltaserve
