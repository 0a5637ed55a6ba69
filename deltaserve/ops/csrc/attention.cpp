#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "fp8.h"
#include "norms.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// The cache's elements as the loops read them, templated on the element type KV: fp32, or fp8 codes
// (uint8_t) widened to their value / kFp8Unit (fp8.h), whose row scales the loops apply.
inline float load1(float x) { return x; }
inline float load1(uint8_t code) { return widen_fp8(code); }
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint8_t* p) { return widen_fp8x16(p); }
#endif
#if defined(DELTASERVE_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint8_t* p) { return widen_fp8x8(p); }
#endif

// The attention loop reads the KV cache block by block, each block its own pages where the hardware
// prefetcher starts cold; while it computes one block of a sequence's first token it asks for the keys and
// values of the block kBlocksAhead on (possibly the next sequence's), into L2. On the 60M benchmark model's
// decode steps: 10-17% less time in attention than without (it still reads the cache at well under DRAM
// bandwidth). A sequence's later tokens find the blocks cached; asking for them again cost prompts 3%.
constexpr int64_t kBlocksAhead = 2;

#if defined(__AVX512F__)
// The register-tiled forms of block_scores and probs_times_v below, for a group of G <= 8 query heads per
// KV head known at compile time (a runtime G left the accumulators on the stack, each FMA waiting on a
// store). Larger groups take the plain loops; AVX2 builds the 8-lane forms below.
// An fp8 block's scores are also multiplied by its keys' row scales, row_scale [16] (null for fp32).
template <int G, typename KV>
inline void block_scores_tile(const float* q0, int64_t q_stride, const KV* kt, const KV* ahead_k,
                              const KV* ahead_v, int64_t hd, float scale, const float* row_scale, float* out,
                              int64_t ld, int64_t n) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t e = 0; e < hd; ++e) {
    // one line of each, spread over the loop: a burst would stall it (fp8: 16 codes a dim, 4 dims a line)
    if (ahead_k != nullptr && (sizeof(KV) == 4 || e % 4 == 0)) {
      __builtin_prefetch(ahead_k + e * 16, 0, 1);
      __builtin_prefetch(ahead_v + e * 16, 0, 1);
    }
    const __m512 k = load16(kt + e * 16);
    for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q0[g * q_stride + e]), k, acc[g]);
  }
  const __mmask16 first_n = static_cast<__mmask16>((1u << n) - 1);
  __m512 s = _mm512_set1_ps(scale);
  if (row_scale != nullptr) s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(first_n, row_scale));
  for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(out + g * ld, first_n, _mm512_mul_ps(acc[g], s));
}

// C x 16 output dims of all G heads per pass (G * C accumulators): each V row is read hd / (16 C) times.
template <int G, int C, typename KV>
inline void probs_times_v_tile(const float* probs, int64_t L, const KV* v_base, const int64_t* rows,
                               int64_t hd, float* out) {
  for (int64_t e0 = 0; e0 < hd; e0 += 16 * C) {
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < L; ++j) {
      const KV* row = v_base + rows[j] + e0;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load16(row + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * L + j]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * hd + e0 + 16 * c, acc[g][c]);
    }
  }
}

// The widest pass whose G * C accumulators and C value registers fit the 32 vector registers.
template <int G, typename KV>
inline void probs_times_v_group(const float* probs, int64_t L, const KV* v_base, const int64_t* rows,
                                int64_t hd, float* out) {
  constexpr int kWide = G <= 6 ? 4 : 2;
  if (hd % (16 * kWide) == 0) return probs_times_v_tile<G, kWide>(probs, L, v_base, rows, hd, out);
  probs_times_v_tile<G, 1>(probs, L, v_base, rows, hd, out);
}
#endif

#if defined(DELTASERVE_AVX2)
// The AVX2 forms of the two tiles above (8 lanes, 16 registers): a block's 16 scores of each head in two
// registers, so G <= 6 (2G accumulators, the two key vectors and the broadcast query); C x 8 output dims of
// all G heads per pass, G x C accumulators and C value registers.
template <int G, typename KV>
inline void block_scores_tile8(const float* q0, int64_t q_stride, const KV* kt, const KV* ahead_k,
                               const KV* ahead_v, int64_t hd, float scale, const float* row_scale, float* out,
                               int64_t ld, int64_t n) {
  __m256 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
  for (int64_t e = 0; e < hd; ++e) {
    if (ahead_k != nullptr && (sizeof(KV) == 4 || e % 4 == 0)) {  // as block_scores_tile asks ahead
      __builtin_prefetch(ahead_k + e * 16, 0, 1);
      __builtin_prefetch(ahead_v + e * 16, 0, 1);
    }
    const __m256 k0 = load8(kt + e * 16), k1 = load8(kt + e * 16 + 8);
    for (int g = 0; g < G; ++g) {
      const __m256 q = _mm256_set1_ps(q0[g * q_stride + e]);
      lo[g] = _mm256_fmadd_ps(q, k0, lo[g]);
      hi[g] = _mm256_fmadd_ps(q, k1, hi[g]);
    }
  }
  __m256 s0 = _mm256_set1_ps(scale), s1 = s0;
  if (row_scale != nullptr) {  // (a block's 16 scales are always there)
    s0 = _mm256_mul_ps(s0, _mm256_loadu_ps(row_scale));
    s1 = _mm256_mul_ps(s1, _mm256_loadu_ps(row_scale + 8));
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float scores[16];
    _mm256_store_ps(scores, _mm256_mul_ps(lo[g], s0));
    _mm256_store_ps(scores + 8, _mm256_mul_ps(hi[g], s1));
    std::memcpy(out + g * ld, scores, n * sizeof(float));
  }
}

template <int G, int C, typename KV>
inline void probs_times_v_tile8(const float* probs, int64_t L, const KV* v_base, const int64_t* rows, int64_t hd,
                                float* out) {
  for (int64_t e0 = 0; e0 < hd; e0 += 8 * C) {
    __m256 acc[G][C];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < L; ++j) {
      const KV* row = v_base + rows[j] + e0;
      __m256 v[C];
      for (int c = 0; c < C; ++c) v[c] = load8(row + 8 * c);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(probs[g * L + j]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + g * hd + e0 + 8 * c, acc[g][c]);
    }
  }
}

template <int G, typename KV>
inline void probs_times_v_group8(const float* probs, int64_t L, const KV* v_base, const int64_t* rows, int64_t hd,
                                 float* out) {
  constexpr int kWide = G <= 3 ? 3 : G <= 6 ? 2 : 1;
  if (hd % (8 * kWide) == 0) return probs_times_v_tile8<G, kWide>(probs, L, v_base, rows, hd, out);
  probs_times_v_tile8<G, 1>(probs, L, v_base, rows, hd, out);
}
#endif

// Scores of the G query heads of one KV head (head g's query at q0 + g * q_stride) against one cache block
// of keys, kt [hd, block_size] (transposed: a dim's keys are contiguous): out[g * ld + l] = scale * q_g . k_l
// for the first n offsets l. A block of 16 keeps every head's 16 scores in a register while the dims stream.
// An fp8 block's scores are also multiplied by its keys' row scales, row_scale [block_size] (else null).
template <typename KV>
inline void block_scores(const float* q0, int64_t q_stride, int64_t G, const KV* kt, const KV* ahead_k,
                         const KV* ahead_v, int64_t hd, int64_t block_size, float scale, const float* row_scale,
                         float* out, int64_t ld, int64_t n) {
#if defined(__AVX512F__)
  if (block_size == 16) {
#define DELTASERVE_TILE(g) \
  case g: return block_scores_tile<g>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, row_scale, out, ld, n)
    switch (G) {
      DELTASERVE_TILE(1); DELTASERVE_TILE(2); DELTASERVE_TILE(3); DELTASERVE_TILE(4);
      DELTASERVE_TILE(5); DELTASERVE_TILE(6); DELTASERVE_TILE(7); DELTASERVE_TILE(8);
      default: break;
    }
#undef DELTASERVE_TILE
  }
#elif defined(DELTASERVE_AVX2)
  if (block_size == 16) {
#define DELTASERVE_TILE(g) \
  case g: return block_scores_tile8<g>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, row_scale, out, ld, n)
    switch (G) {
      DELTASERVE_TILE(1); DELTASERVE_TILE(2); DELTASERVE_TILE(3); DELTASERVE_TILE(4);
      DELTASERVE_TILE(5); DELTASERVE_TILE(6);
      default: break;
    }
#undef DELTASERVE_TILE
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t l = 0; l < n; ++l) {
      float acc = 0.0f;
      for (int64_t e = 0; e < hd; ++e) acc += q0[g * q_stride + e] * load1(kt[e * block_size + l]);
      out[g * ld + l] = acc * scale * (row_scale != nullptr ? row_scale[l] : 1.0f);
    }
  }
}

// out[g] = sum_j probs[g, j] v_j for the G query heads of one KV head, v_j = v_base + rows[j]: up to 64
// output dims of every head at a time stay in registers while the positions stream by. (An fp8 cache's
// caller has multiplied the probabilities by the V rows' scales.)
template <typename KV>
inline void probs_times_v(const float* probs, int64_t L, int64_t G, const KV* v_base, const int64_t* rows,
                          int64_t hd, float* out) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
#define DELTASERVE_GROUP(g) case g: return probs_times_v_group<g>(probs, L, v_base, rows, hd, out)
    switch (G) {
      DELTASERVE_GROUP(1); DELTASERVE_GROUP(2); DELTASERVE_GROUP(3); DELTASERVE_GROUP(4);
      DELTASERVE_GROUP(5); DELTASERVE_GROUP(6); DELTASERVE_GROUP(7); DELTASERVE_GROUP(8);
      default: break;
    }
#undef DELTASERVE_GROUP
  }
#elif defined(DELTASERVE_AVX2)
  if (hd % 8 == 0) {
#define DELTASERVE_GROUP(g) case g: return probs_times_v_group8<g>(probs, L, v_base, rows, hd, out)
    switch (G) {
      DELTASERVE_GROUP(1); DELTASERVE_GROUP(2); DELTASERVE_GROUP(3); DELTASERVE_GROUP(4);
      DELTASERVE_GROUP(5); DELTASERVE_GROUP(6); DELTASERVE_GROUP(7); DELTASERVE_GROUP(8);
      default: break;
    }
#undef DELTASERVE_GROUP
  }
#endif
  std::fill(out, out + G * hd, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const KV* v = v_base + rows[j];
    for (int64_t g = 0; g < G; ++g) {
#pragma omp simd
      for (int64_t e = 0; e < hd; ++e) out[g * hd + e] += probs[g * L + j] * load1(v[e]);
    }
  }
}

struct AttentionItem {
  int64_t seq, begin, end;  // tokens [begin, end) of sequence seq
};

inline bool is_wanted(const char* wanted, int64_t t) { return wanted == nullptr || wanted[t] != 0; }

// Attention of sequence b's query tokens (the last n of its L positions) through torch's fused kernel,
// with its keys and values gathered from the cache blocks into [1, nkv, L, hd] (an fp8 cache's dequantized).
void fused_attention(const at::Tensor& q_all, const KVCache& cache, const at::Tensor& attn, const Batch& bt,
                     int64_t b, int64_t L, float scale) {
  const int64_t nh = q_all.size(1), hd = q_all.size(2), nkv = cache.k.size(1), block_size = cache.v.size(1);
  const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0, nb = (L + block_size - 1) / block_size;
  at::Tensor blocks = at::from_blob(const_cast<int64_t*>(bt.block_tables + b * bt.table_width), {nb}, at::kLong);
  auto heads_first = [&](const at::Tensor& rows) {  // [nb * block_size, nkv, hd] -> [1, nkv, L, hd]
    return rows.narrow(0, 0, L).transpose(0, 1).unsqueeze(0);
  };
  at::Tensor k_blocks = cache.k.index_select(0, blocks);  // [nb, nkv, hd, block_size]
  at::Tensor v_blocks = cache.v.index_select(0, blocks);  // [nb, block_size, nkv, hd]
  if (cache.fp8()) {
    k_blocks = k_blocks.to(at::kFloat) * cache.k_scale.index_select(0, blocks).unsqueeze(2);
    v_blocks = v_blocks.to(at::kFloat) * cache.v_scale.index_select(0, blocks).unsqueeze(3);
  }
  at::Tensor keys = heads_first(k_blocks.permute({0, 3, 1, 2}).reshape({nb * block_size, nkv, hd}));
  at::Tensor values = heads_first(v_blocks.reshape({nb * block_size, nkv, hd}));
  at::Tensor q = q_all.narrow(0, t0, n);
  std::optional<at::Tensor> mask;  // the n queries are the last n of the L positions
  if (L != n) mask = at::arange(L).unsqueeze(0) <= at::arange(L - n, L).unsqueeze(1);
  at::Tensor out =
      at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, mask, 0.0, L == n, scale, true);
  attn.narrow(0, t0, n).view({n, nh, hd}).copy_(out[0].transpose(0, 1));
}

// Token t's K rows k [nkv * hd] and V rows v into the cache at flat row kv_row: V rows as they are, K
// transposed within its block (k[block][head][dim][offset]); an fp8 cache's as codes with their row scales.
void cache_token(const KVCache& cache, const float* k, const float* v, int64_t kv_row, int64_t nkv, int64_t hd) {
  const int64_t block_size = cache.v.size(1), row_size = nkv * hd;
  const int64_t block = kv_row / block_size, offset = kv_row % block_size;
  const int64_t k_at = block * row_size * block_size + offset;  // element (head 0, dim 0) of this token's key
  if (!cache.fp8()) {
    std::memcpy(cache.v.data_ptr<float>() + kv_row * row_size, v, row_size * sizeof(float));
    float* kt = cache.k.data_ptr<float>() + k_at;
    for (int64_t e = 0; e < row_size; ++e) kt[e * block_size] = k[e];
    return;
  }
  uint8_t* v_codes = static_cast<uint8_t*>(cache.v.data_ptr()) + kv_row * row_size;
  uint8_t* k_codes = static_cast<uint8_t*>(cache.k.data_ptr()) + k_at;
  float* v_scales = cache.v_scale.data_ptr<float>() + kv_row * nkv;
  float* k_scales = cache.k_scale.data_ptr<float>() + block * nkv * block_size + offset;
  for (int64_t hh = 0; hh < nkv; ++hh) {
    v_scales[hh] = quantize_fp8_row(v + hh * hd, hd, v_codes + hh * hd, 1);
    k_scales[hh * block_size] = quantize_fp8_row(k + hh * hd, hd, k_codes + hh * hd * block_size, block_size);
  }
}

}  // namespace

void norm_rope_and_cache(const AttentionDims& d, const at::Tensor& proj, const at::Tensor& q_scale,
                         const at::Tensor& k_scale, const KVCache& cache, const Batch& bt, const float* cos,
                         const float* sin, const char* wanted) {
  const int64_t nh = d.nh, nkv = d.nkv, hd = d.hd, half = d.rotary_dim / 2;
  const int64_t q_width = 2 * nh * hd, width = q_width + 2 * nkv * hd, row_size = nkv * hd;
  float* pp = proj.data_ptr<float>();
  const float* qs = q_scale.data_ptr<float>();
  const float* ks = k_scale.data_ptr<float>();
  for (int64_t t = 0; t < bt.T; ++t) {
    float* row = pp + t * width;
    for (int64_t hh = 0; hh < nh && is_wanted(wanted, t); ++hh) {
      float* q = row + hh * 2 * hd;
      rms_norm_row(q, qs, d.eps, hd, q);
      rope_head(q, cos + t * half, sin + t * half, half);
    }
    float* k = row + q_width;
    for (int64_t hh = 0; hh < nkv; ++hh) {
      rms_norm_row(k + hh * hd, ks, d.eps, hd, k + hh * hd);
      rope_head(k + hh * hd, cos + t * half, sin + t * half, half);
    }
    cache_token(cache, k, k + row_size, bt.slot_mapping[t], nkv, hd);
  }
}

namespace {

template <typename KV>
void paged_attention_loop(const at::Tensor& q, const KVCache& cache, const Batch& bt, const char* wanted,
                          int64_t loop_kv_bytes, const at::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = cache.k.size(1), group = nh / nkv;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t block_size = cache.v.size(1), row_size = nkv * hd;
  const float* qp = q.data_ptr<float>();
  const KV* k_cache = static_cast<const KV*>(cache.k.data_ptr());
  const KV* v_cache = static_cast<const KV*>(cache.v.data_ptr());
  // fp8: scores take the keys' row scales, probabilities the values' (both times kFp8Unit: fp8.h)
  const float* k_scales = cache.fp8() ? cache.k_scale.data_ptr<float>() : nullptr;
  const float* v_scales = cache.fp8() ? cache.v_scale.data_ptr<float>() : nullptr;
  const float unit = cache.fp8() ? kFp8Unit : 1.0f;
  // Each query token attends to positions 0 .. its own, read through its sequence's block table: in a
  // loop per (token, kv head) that reads each cached K/V row once for all the query heads of its group,
  // or, for a prompt chunk whose keys and values outgrow the caches (re-read for each of its tokens),
  // through torch's fused attention kernel.
  float* ap = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t kv_bytes_per_position = 2 * row_size * static_cast<int64_t>(sizeof(KV));
  std::vector<AttentionItem> items;  // the loop's work: up to kItemTokens tokens of one sequence
  int64_t loop_work = 0;             // query x key pairs, times the head work
  for (int64_t b = 0; b < bt.B; ++b) {
    const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
    if (n == 0) continue;
    const int64_t L = bt.positions[t0 + n - 1] + 1;
    // (with output rows, the loop: a chunk has one sampled token, not a block of queries)
    if (wanted == nullptr && n > kItemTokens && L * kv_bytes_per_position > loop_kv_bytes) {
      fused_attention(q, cache, out, bt, b, L, scale);
      continue;
    }
    // runs of up to kItemTokens wanted tokens
    for (int64_t t = t0; t < t0 + n;) {
      if (!is_wanted(wanted, t)) {
        ++t;
        continue;
      }
      int64_t end = t + 1;
      while (end < std::min(t0 + n, t + kItemTokens) && is_wanted(wanted, end)) ++end;
      items.push_back({b, t, end});
      loop_work += (end - t) * L * nh * hd * 2;
      t = end;
    }
  }
  // Block i of those token t (of items[k]) attends to, counting on past its last one into the blocks of
  // the next sequence below items[k_end] (later tokens of t's sequence read the same, cached, blocks):
  // what to ask for while an earlier block is computed. -1 when there is none.
  const int64_t block_elems = block_size * row_size;
  auto block_ahead = [&](int64_t k, int64_t k_end, int64_t t, int64_t i) -> int64_t {
    int64_t b = items[k].seq, blocks = bt.positions[t] / block_size + 1;
    if (i < blocks) return bt.block_tables[b * bt.table_width + i];
    i -= blocks;
    while (k < k_end && items[k].seq == b) ++k;
    if (k == k_end) return -1;
    b = items[k].seq, t = items[k].begin;
    return i <= bt.positions[t] / block_size ? bt.block_tables[b * bt.table_width + i] : -1;
  };
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, num_items, grain_for(loop_work / std::max<int64_t>(num_items, 1)), [&](int64_t k0, int64_t k1) {
    std::vector<float> probs;        // [nkv, group, L]
    std::vector<int64_t> rows;       // offset (in elements) of each position's V row
    std::vector<float> value_scale;  // fp8: [nkv, len], each position's V row scale times kFp8Unit
    for (int64_t k = k0; k < k1; ++k) {
      const AttentionItem item = items[k];
      const int64_t* table = bt.block_tables + item.seq * bt.table_width;
      const int64_t len = bt.positions[item.end - 1] + 1;
      rows.resize(len);
      for (int64_t j0 = 0; j0 < len; j0 += block_size) {  // block by block: no division per position
        const int64_t first = table[j0 / block_size] * block_size * row_size;
        for (int64_t j = j0; j < std::min(len, j0 + block_size); ++j) rows[j] = first + (j - j0) * row_size;
      }
      if (v_scales != nullptr) {
        value_scale.resize(nkv * len);
        for (int64_t j = 0; j < len; ++j) {
          for (int64_t kvh = 0; kvh < nkv; ++kvh) value_scale[kvh * len + j] = v_scales[rows[j] / hd + kvh] * unit;
        }
      }
      for (int64_t t = item.begin; t < item.end; ++t) {
        // only the first token of a sequence here finds its blocks cold, and asks ahead
        const bool cold = t == item.begin && (k == k0 || items[k - 1].seq != item.seq);
        const int64_t L = bt.positions[t] + 1;
        probs.resize(nkv * group * L);
        // Block by block, the keys of every KV head (one contiguous run of the cache), then per head
        // its softmax and values.
        const int64_t nb = (L + block_size - 1) / block_size;
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t j0 = i * block_size;
          const int64_t ahead = cold ? block_ahead(k, k1, t, i + kBlocksAhead) : -1;
          const KV* block_keys = k_cache + table[i] * block_elems;
          for (int64_t kvh = 0; kvh < nkv; ++kvh) {
            const float* q0 = qp + t * q_row + kvh * group * q_head;  // head g of the group: q0 + g * q_head
            // each head's pass asks for its share (1/nkv) of the K and V blocks `ahead`
            const int64_t share = ahead * block_elems + kvh * hd * block_size;
            const float* row_scale = k_scales != nullptr ? k_scales + (table[i] * nkv + kvh) * block_size : nullptr;
            block_scores(q0, q_head, group, block_keys + kvh * hd * block_size,
                         ahead >= 0 ? k_cache + share : nullptr, ahead >= 0 ? v_cache + share : nullptr, hd,
                         block_size, scale * unit, row_scale, probs.data() + kvh * group * L + j0, L,
                         std::min(block_size, L - j0));
          }
        }
        for (int64_t kvh = 0; kvh < nkv; ++kvh) {
          float* head_probs = probs.data() + kvh * group * L;
          for (int64_t g = 0; g < group; ++g) {
            softmax_row(head_probs + g * L, L);
            if (v_scales == nullptr) continue;
            const float* vs = value_scale.data() + kvh * len;
            float* p = head_probs + g * L;
#pragma omp simd
            for (int64_t j = 0; j < L; ++j) p[j] *= vs[j];
          }
          float* o0 = ap + t * nh * hd + kvh * group * hd;
          probs_times_v(head_probs, L, group, v_cache + kvh * hd, rows.data(), hd, o0);
        }
      }
    }
  });
}

}  // namespace

void paged_attention(const at::Tensor& q, const KVCache& cache, const Batch& bt, const char* wanted,
                     int64_t loop_kv_bytes, const at::Tensor& out) {
  if (cache.fp8()) return paged_attention_loop<uint8_t>(q, cache, bt, wanted, loop_kv_bytes, out);
  paged_attention_loop<float>(q, cache, bt, wanted, loop_kv_bytes, out);
}

void output_gate(const at::Tensor& proj, int64_t nh, int64_t hd, const char* wanted, const at::Tensor& out) {
  const int64_t T = out.size(0), width = proj.size(1);
  const float* pp = proj.data_ptr<float>();
  float* ap = out.data_ptr<float>();
  // output gate: attn * sigmoid(gate), the gate being the second half of each head's q_proj rows
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hh = 0; hh < nh && is_wanted(wanted, t); ++hh) {
      float* o = ap + (t * nh + hh) * hd;
      const float* gate = pp + t * width + hh * 2 * hd + hd;
#pragma omp simd
      for (int64_t e = 0; e < hd; ++e) o[e] *= sigmoid(gate[e]);
    }
  }
}

}  // namespace deltaserve
