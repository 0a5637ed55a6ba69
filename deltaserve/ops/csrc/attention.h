// Gated attention between its two projections over the paged KV cache (deltaserve/ops/attention.py has the
// cache layout and the reference): q/k RMSNorm and RoPE with the K/V write, the attention of each query
// token to its sequence's cached positions, and the output gate.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "batch.h"

namespace deltaserve {

struct AttentionDims {
  int64_t nh, nkv, hd, rotary_dim;
  float eps;
};

// One attention layer's paged cache: K and V in fp32, or as fp8 E4M3 codes with one fp32 scale per (token,
// kv head), set when the token is written (fp8.h; the rule and reference in deltaserve/ops/attention.py).
struct KVCache {
  at::Tensor k;        // [blocks, nkv, hd, block_size]: keys transposed within a block
  at::Tensor v;        // [blocks, block_size, nkv, hd]
  at::Tensor k_scale;  // fp8 only: [blocks, nkv, block_size]; undefined for fp32
  at::Tensor v_scale;  // fp8 only: [blocks, block_size, nkv]
  bool fp8() const { return k_scale.defined(); }
};

// Attention's loop over query tokens takes them kItemTokens of one sequence at a time (its unit of work
// between threads). A prompt chunk whose cached keys and values exceed kLoopKVBytes goes to torch's fused
// attention kernel instead, which reads them once per block of queries rather than once per query: below
// that the loop is faster (on the 60M benchmark model, one thread: 2k-token prompt 0.139 -> 0.107 s of
// attention; a 4000-token one, 4 MB of K/V a layer, 0.63 -> 0.41 s).
constexpr int64_t kItemTokens = 16;
constexpr int64_t kLoopKVBytes = 8 << 20;

// q/k RMSNorm and RoPE, K/V into the cache (every token's, before any token reads them), in place on the
// qkv projection's rows proj [T, 2 nh hd + 2 nkv hd] (per head q | gate, then k, then v). cos/sin: [T,
// rotary_dim / 2]. wanted (null: all): the tokens whose queries are needed; the others' are left as they are.
// An fp8 cache stores each K and V row quantized with its own scale (fp8.h, quantize_fp8_row).
void norm_rope_and_cache(const AttentionDims& d, const at::Tensor& proj, const at::Tensor& q_scale,
                         const at::Tensor& k_scale, const KVCache& cache, const Batch& bt, const float* cos,
                         const float* sin, const char* wanted);

// out [T, nh * hd] (contiguous) = softmax(q k^T / sqrt(hd)) v of each wanted token's queries q [T, nh, hd]
// (any row and head strides, dims contiguous) over positions 0 .. positions[t] of its sequence, read
// through the block table from the cache (an fp8 one's codes widened in registers, their scales applied to
// the scores and the probabilities). Rows of unwanted tokens are left unset. Prompt chunks of more than
// kItemTokens tokens whose K/V exceed loop_kv_bytes go through torch's fused kernel (only when every token
// is wanted).
void paged_attention(const at::Tensor& q, const KVCache& cache, const Batch& bt, const char* wanted,
                     int64_t loop_kv_bytes, const at::Tensor& out);

// out [T, nh * hd] *= sigmoid(gate), the gate being the second half of each head's q_proj rows in proj.
void output_gate(const at::Tensor& proj, int64_t nh, int64_t hd, const char* wanted, const at::Tensor& out);

}  // namespace deltaserve
