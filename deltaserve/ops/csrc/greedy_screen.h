// The greedy screen of a bf16 lm_head (AVX512-BF16): greedy tokens exactly, at the bf16 dot product's rate.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "linear.h"

namespace deltaserve {

// Greedy tokens through a bf16 screen, exactly. The lm_head is the largest projection of a decode step, and
// greedy decoding wants only each row's argmax. AVX512-BF16's vdpbf16ps multiplies bf16 pairs at twice the
// fp32 FMA rate, but only if the hidden row is rounded to bf16 too; so it screens, and the fp32 kernel
// decides:
//   1. every logit is computed approximately from the rounded row h~ (the weights are bf16, read where they
//      are: a row-major bf16 row is already pairs along K), with a rigorous bound on how far it can be from
//      the fp32 logit the projection computes:
//        |a_v - a~_v| <= ||h - h~|| ||w_v|| + gamma (||h|| + ||h~||) ||w_v|| + tiny
//      (Cauchy-Schwarz for the rounding of h; gamma for the fp32 summation error of either sum, in any order;
//      the tiny absolute term for flushed subnormals), kept per row and panel of 64 outputs as the largest
//      lower and upper bound;
//   2. L = the row's largest lower bound is <= the maximum logit, so only panels whose largest upper bound
//      reaches L can hold it; those (usually one or two of thousands) are computed again by the projection's
//      own kernel for that many rows (project_panel), and their argmax, in panel order with torch.argmax's
//      rules, is the argmax of the logits that FusedStack::logits would return: bit for bit the same
//      numbers, not an approximation of them.
// Rows that are not finite or whose logits could come near overflow take the plain path. An lm_head in any
// other format (fp32, fp8, int8, int4) has no screen: greedy_tokens runs its exact projection with the argmax
// fused (apply with argmax), which is bound by streaming the weights anyway.
#if defined(__AVX512BF16__)

// A single row's lm_head is bound by streaming the weights, which the screen does not shorten: from two on.
constexpr int64_t kMinScreenedRows = 2;

struct GreedyScreen {
  at::Tensor norms;  // fp32 [N]: each output's weight norm, rounded up
  double max_norm = 0.0;
};
#else
constexpr int64_t kMinScreenedRows = 0;
struct GreedyScreen {};
#endif

// The screen of an lm_head stored as one bf16 part, or an empty one when it is in another format, a weight is
// not finite or a row's norm is so large that the bounds could overflow (always empty without AVX512-BF16).
GreedyScreen make_greedy_screen(const Linear& lm);
bool ready(const GreedyScreen& s);

// Fills argmax [T] with each row's torch.argmax of h @ lm^T (see above; needs ready(s)).
void screened_greedy(const at::Tensor& h, const GreedyScreen& s, const Linear& lm, int64_t* argmax);

}  // namespace deltaserve
