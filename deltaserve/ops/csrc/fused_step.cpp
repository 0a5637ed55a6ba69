// The whole forward of the trunk (or of the MTP head) for one engine step in one C++ call: projections go
// to ATen's GEMM (MKL) or, for bf16-valued weights, to a panel kernel that streams the weights as bf16;
// everything between them is one loop nest per token and head instead of a few hundred small torch ops.
// Same maths as deltaserve/model/*.py, which stays the reference (tests/test_fused_step.py holds the two
// together). fp32 weights, activations and caches.
//
// Layout of the flat batch: B sequences, sequence b owns tokens qsl[b] .. qsl[b+1]-1, each token t at
// rotary/KV position positions[t]. A sequence with context_lens[b] == 0 starts its GDN state from zeros.
// spec_index[b] >= 0 marks a verify segment: its GDN states after every token go to the returned
// per-position tensors (row spec_index[b]) and its cache slot is left untouched; other sequences update
// their slot in place.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

// exp(x) for fp32 as Cephes computes it (x = n ln2 + r, a degree-6 polynomial for e^r, times 2^n): within
// 1 ulp of exp over [-87, 88.3] (measured), and written without calls or branches so that loops using it
// vectorize. Inputs are clamped to that range (e^-87.3 is the smallest normal float; silu and sigmoid of
// larger |x| are 0 or their asymptote anyway).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline float silu(float x) { return x / (1.0f + vexp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sk = S^T k and sq = S^T q for one head's recurrent state S [dk, dv], in one read of S.
#if defined(__AVX512F__)
// N x 16 value dims at a time: 2N accumulators stay in registers while the dk rows stream by.
template <int N>
inline void state_times_kq_block(const float* S, int64_t dk, int64_t dv, const float* k, const float* q,
                                 float* sk, float* sq) {
  __m512 ak[N], aq[N];
  for (int c = 0; c < N; ++c) ak[c] = aq[c] = _mm512_setzero_ps();
  for (int64_t a = 0; a < dk; ++a) {
    const __m512 ka = _mm512_set1_ps(k[a]), qa = _mm512_set1_ps(q[a]);
    for (int c = 0; c < N; ++c) {
      const __m512 row = _mm512_loadu_ps(S + a * dv + 16 * c);
      ak[c] = _mm512_fmadd_ps(row, ka, ak[c]);
      aq[c] = _mm512_fmadd_ps(row, qa, aq[c]);
    }
  }
  for (int c = 0; c < N; ++c) {
    _mm512_storeu_ps(sk + 16 * c, ak[c]);
    _mm512_storeu_ps(sq + 16 * c, aq[c]);
  }
}
#endif

inline void state_times_kq(const float* S, const float* k, const float* q, int64_t dk, int64_t dv, float* sk,
                           float* sq) {
#if defined(__AVX512F__)
  if (dv % 16 == 0) {
    for (int64_t j0 = 0; j0 < dv; j0 += 64) {
      switch (std::min<int64_t>(4, (dv - j0) / 16)) {
        case 1: state_times_kq_block<1>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        case 2: state_times_kq_block<2>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        case 3: state_times_kq_block<3>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        default: state_times_kq_block<4>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
      }
    }
    return;
  }
#endif
  std::fill(sk, sk + dv, 0.0f);
  std::fill(sq, sq + dv, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    const float* Sa = S + a * dv;
    const float ka = k[a], qa = q[a];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      sk[j] += Sa[j] * ka;
      sq[j] += Sa[j] * qa;
    }
  }
}

// In-place softmax of one row of n scores.
inline void softmax_row(float* x, int64_t n) {
  float mx = -INFINITY;
  int64_t tail = 0;
#if defined(__AVX512F__)  // the compiler leaves a max reduction scalar (std::max's NaN order)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; tail + 16 <= n; tail += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + tail));
  mx = _mm512_reduce_max_ps(m);
#endif
  for (int64_t i = tail; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = vexp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Splitting a loop over threads costs a fork/join and wakes threads that may be serving HTTP: only worth it
// for this much work per thread (multiply-adds, about 20-50 us on one core).
constexpr int64_t kMinWorkPerThread = 1 << 20;

// The grain for at::parallel_for over n items of `work_per_item` each: the whole range inline when it is
// small, else chunks of at least kMinWorkPerThread.
inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(work_per_item, 1));
}

// The attention loop reads the KV cache block by block, each block its own pages where the hardware
// prefetcher starts cold; while it computes one block of a sequence's first token it asks for the keys and
// values of the block kBlocksAhead on (possibly the next sequence's), into L2. On the 60M benchmark model's
// decode steps: 10-17% less time in attention than without (it still reads the cache at well under DRAM
// bandwidth). A sequence's later tokens find the blocks cached; asking for them again cost prompts 3%.
constexpr int64_t kBlocksAhead = 2;

#if defined(__AVX512F__)
// The register-tiled forms of block_scores and probs_times_v below, for a group of G <= 8 query heads per
// KV head known at compile time (a runtime G left the accumulators on the stack, each FMA waiting on a
// store). Larger groups, and machines without AVX-512, take the plain loops.
template <int G>
inline void block_scores_tile(const float* q0, int64_t q_stride, const float* kt, const float* ahead_k,
                              const float* ahead_v, int64_t hd, float scale, float* out, int64_t ld, int64_t n) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t e = 0; e < hd; ++e) {
    if (ahead_k != nullptr) {  // one line of each, spread over the loop: a burst would stall it
      __builtin_prefetch(ahead_k + e * 16, 0, 1);
      __builtin_prefetch(ahead_v + e * 16, 0, 1);
    }
    const __m512 k = _mm512_loadu_ps(kt + e * 16);
    for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q0[g * q_stride + e]), k, acc[g]);
  }
  const __mmask16 first_n = static_cast<__mmask16>((1u << n) - 1);
  const __m512 s = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(out + g * ld, first_n, _mm512_mul_ps(acc[g], s));
}

// C x 16 output dims of all G heads per pass (G * C accumulators): each V row is read hd / (16 C) times.
template <int G, int C>
inline void probs_times_v_tile(const float* probs, int64_t L, const float* v_base, const int64_t* rows,
                               int64_t hd, float* out) {
  for (int64_t e0 = 0; e0 < hd; e0 += 16 * C) {
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < L; ++j) {
      const float* row = v_base + rows[j] + e0;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(row + 16 * c);
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
template <int G>
inline void probs_times_v_group(const float* probs, int64_t L, const float* v_base, const int64_t* rows,
                                int64_t hd, float* out) {
  constexpr int kWide = G <= 6 ? 4 : 2;
  if (hd % (16 * kWide) == 0) return probs_times_v_tile<G, kWide>(probs, L, v_base, rows, hd, out);
  probs_times_v_tile<G, 1>(probs, L, v_base, rows, hd, out);
}
#endif

// Scores of the G query heads of one KV head (head g's query at q0 + g * q_stride) against one cache block
// of keys, kt [hd, block_size] (transposed: a dim's keys are contiguous): out[g * ld + l] = scale * q_g . k_l
// for the first n offsets l. A block of 16 keeps every head's 16 scores in a register while the dims stream.
inline void block_scores(const float* q0, int64_t q_stride, int64_t G, const float* kt, const float* ahead_k,
                         const float* ahead_v, int64_t hd, int64_t block_size, float scale, float* out, int64_t ld,
                         int64_t n) {
#if defined(__AVX512F__)
  if (block_size == 16) {
    switch (G) {
      case 1: return block_scores_tile<1>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 2: return block_scores_tile<2>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 3: return block_scores_tile<3>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 4: return block_scores_tile<4>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 5: return block_scores_tile<5>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 6: return block_scores_tile<6>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 7: return block_scores_tile<7>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      case 8: return block_scores_tile<8>(q0, q_stride, kt, ahead_k, ahead_v, hd, scale, out, ld, n);
      default: break;
    }
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t l = 0; l < n; ++l) {
      float acc = 0.0f;
      for (int64_t e = 0; e < hd; ++e) acc += q0[g * q_stride + e] * kt[e * block_size + l];
      out[g * ld + l] = acc * scale;
    }
  }
}

// out[g] = sum_j probs[g, j] v_j for the G query heads of one KV head, v_j = v_base + rows[j]: up to 64
// output dims of every head at a time stay in registers while the positions stream by.
inline void probs_times_v(const float* probs, int64_t L, int64_t G, const float* v_base, const int64_t* rows,
                          int64_t hd, float* out) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    switch (G) {
      case 1: return probs_times_v_group<1>(probs, L, v_base, rows, hd, out);
      case 2: return probs_times_v_group<2>(probs, L, v_base, rows, hd, out);
      case 3: return probs_times_v_group<3>(probs, L, v_base, rows, hd, out);
      case 4: return probs_times_v_group<4>(probs, L, v_base, rows, hd, out);
      case 5: return probs_times_v_group<5>(probs, L, v_base, rows, hd, out);
      case 6: return probs_times_v_group<6>(probs, L, v_base, rows, hd, out);
      case 7: return probs_times_v_group<7>(probs, L, v_base, rows, hd, out);
      case 8: return probs_times_v_group<8>(probs, L, v_base, rows, hd, out);
      default: break;
    }
  }
#endif
  std::fill(out, out + G * hd, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const float* v = v_base + rows[j];
    for (int64_t g = 0; g < G; ++g) {
#pragma omp simd
      for (int64_t e = 0; e < hd; ++e) out[g * hd + e] += probs[g * L + j] * v[e];
    }
  }
}

// out = x * rsqrt(mean(x^2) + eps) * scale, for one row of n.
inline void rms_norm_row(const float* x, const float* scale, float eps, int64_t n, float* out) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * scale[i];
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& scale, float eps) {
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) rms_norm_row(xp + t * n, sp, eps, n, op + t * n);
  return out;
}

// Rotate-half rotary embedding on the first 2*half dims of one head, in place.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

// A projection's weight [N, K] in fp32, and, when every value is exactly a bfloat16 (a bf16 checkpoint
// computed in fp32), the same values as bf16 panels [ceil(N/64), K, 64] (rows padded with zeros): half the
// bytes to stream, laid out so that a panel of 64 outputs is read front to back. Within a panel row the
// outputs are interleaved (deltaserve/model/fused.py, _linear): output 32h + i at word 32h + 2i and output
// 32h + 16 + i at word 32h + 2i + 1, so that, read as 32-bit lanes, the low words are 16 consecutive outputs
// and the high words the next 16. bf16 is the top half of an fp32: the low words shifted up by 16 bits and
// the lanes with their low 16 bits cleared are the weights in fp32, exactly, two cheap ops for 32 weights.
constexpr int64_t kPanel = 64;
struct Linear {
  at::Tensor w, panels;
};

// Attention's loop over query tokens takes them kItemTokens of one sequence at a time (its unit of work
// between threads). A prompt chunk whose cached keys and values exceed kLoopKVBytes goes to torch's fused
// attention kernel instead, which reads them once per block of queries rather than once per query: below
// that the loop is faster (on the 60M benchmark model, one thread: 2k-token prompt 0.139 -> 0.107 s of
// attention; a 4000-token one, 4 MB of K/V a layer, 0.63 -> 0.41 s).
constexpr int64_t kItemTokens = 16;
constexpr int64_t kLoopKVBytes = 8 << 20;

struct AttentionItem {
  int64_t seq, begin, end;  // tokens [begin, end) of sequence seq
};

// The 64 weights of panel row k in fp32, in output order (the portable path; AVX-512 does it in registers).
inline void panel_row_to_float(const uint16_t* row, float* w) {
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 16; ++i) {
      const uint32_t low = static_cast<uint32_t>(row[32 * h + 2 * i]) << 16;
      const uint32_t high = static_cast<uint32_t>(row[32 * h + 2 * i + 1]) << 16;
      std::memcpy(w + 32 * h + i, &low, sizeof(float));
      std::memcpy(w + 32 * h + 16 + i, &high, sizeof(float));
    }
  }
}

// Rows of x go through the panel kernels 6 at a time (24 accumulators + 4 weight registers of 32): calls
// f(std::integral_constant<int, R>) with R = rows (1..6) known at compile time.
template <typename F>
inline void with_row_tile(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// R input rows times one panel: R x 64 fp32 accumulators in registers, each weight converted once and used
// for all R rows. The products and the fp32 accumulation are the GEMM's; only the summation order differs.
// `stream`: write full panels of y with non-temporal stores (y and ldy 64-byte aligned; see linear_panels).
template <int R>
void panel_rows(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t ldy, int64_t ncols,
                bool stream = false) {
#if defined(__AVX512F__)
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    const __m512i lo = _mm512_loadu_si512(panel + k * kPanel), hi = _mm512_loadu_si512(panel + k * kPanel + 32);
    const __m512 w[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(lo, high_words)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(hi, high_words))};
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == kPanel && stream) {
      for (int j = 0; j < 4; ++j) _mm512_stream_ps(y + r * ldy + 16 * j, acc[r][j]);
    } else if (ncols == kPanel) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
    } else {  // the last panel of an N that is not a multiple of 64
      float row[kPanel];
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(row + 16 * j, acc[r][j]);
      std::memcpy(y + r * ldy, row, ncols * sizeof(float));
    }
  }
#else
  (void)stream;  // plain stores here
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kPanel];
    panel_row_to_float(panel + k * kPanel, w);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], ncols * sizeof(float));
#endif
}

// Rows of x processed against every panel before the next rows: 96 rows of K <= 1024 floats stay in L2
// while the panels stream past them (a 2048-row prompt chunk otherwise re-reads x from L3 for each panel).
constexpr int64_t kRowBlock = 96;
constexpr int64_t kStreamBytes = 2 << 20;

// torch.argmax's order: the larger wins, a NaN beats every number, and of equals the first stays.
inline bool beats(float v, float current) { return v > current || (v != v && current == current); }

// torch.argmax of v[0, n): a vector pass for the maximum (and whether there is a NaN), then vector tests
// over 16 at a time for the first position that holds it.
inline int64_t first_argmax(const float* v, int64_t n) {
#if defined(__AVX512F__)
  if (n == kPanel) {  // a full panel's row, the greedy projection's case: all in four registers
    __m512 x[4];
    __mmask16 nan[4];
    for (int c = 0; c < 4; ++c) {
      x[c] = _mm512_loadu_ps(v + 16 * c);
      nan[c] = _mm512_cmp_ps_mask(x[c], x[c], _CMP_UNORD_Q);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]))));
    const bool any_nan = (nan[0] | nan[1] | nan[2] | nan[3]) != 0;
    for (int c = 0; c < 4; ++c) {
      const __mmask16 hit = any_nan ? nan[c] : _mm512_cmp_ps_mask(x[c], top, _CMP_EQ_OQ);
      if (hit != 0) return 16 * c + __builtin_ctz(hit);
    }
    return 0;  // unreachable: some lane holds the maximum
  }
#endif
  float best = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    best = std::max(best, v[i]);  // a NaN v[i] leaves best as it is: `nan` tracks those
    nan |= v[i] != v[i];
  }
  auto match = [&](int64_t i) { return nan ? v[i] != v[i] : v[i] == best; };
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t c1 = std::min(n, c0 + 16);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c0; i < c1; ++i) hit |= match(i);
    if (hit) {
      int64_t at = c0;
      while (!match(at)) ++at;
      return at;
    }
  }
  return 0;
}

// y [T, N] = x [T, K] @ w^T from the bf16 panels; threads split the panels. With `argmax` (int64 [T]),
// y is not kept: each tile is reduced to its rows' best column while it is in L1, and argmax gets each
// row's torch.argmax -- greedy sampling without writing (and reading back) T x vocab logits.
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t* argmax = nullptr) {
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

// The panel kernel where the weight has panels: on the 60M benchmark model's shapes it runs at 53-57
// GMAC/s from 64 rows up, against MKL's 26-49 (one AVX-512 core, benchmarks-style measurement through
// the exported linear_panels); otherwise MKL.
at::Tensor apply(const Linear& l, const at::Tensor& x) {
  if (l.panels.defined()) return linear_panels(x, l.panels, l.w.size(0));
  return at::linear(x, l.w);
}

// Greedy tokens through a bf16 screen, exactly. The lm_head is the largest projection of a decode step
// (38% of the 60M benchmark model's), and greedy decoding wants only each row's argmax. AVX512-BF16's
// vdpbf16ps multiplies bf16 pairs at twice the fp32 FMA rate, but only if the hidden row is rounded to
// bf16 too; so it screens, and the fp32 kernel decides:
//   1. every logit is computed approximately from the rounded row h~ (the weights are exactly bf16), with
//      a rigorous bound on how far it can be from the fp32 logit the panel kernel computes:
//        |a_v - a~_v| <= ||h - h~|| ||w_v|| + gamma (||h|| + ||h~||) ||w_v|| + tiny
//      (Cauchy-Schwarz for the rounding of h; gamma for the fp32 summation error of either sum; the tiny
//      absolute term for flushed subnormals), kept per row and panel as the largest lower and upper bound;
//   2. L = the row's largest lower bound is <= the maximum logit, so only panels whose largest upper bound
//      reaches L can hold it; those (usually one or two of 500) are computed again by the fp32 panel
//      kernel, and their argmax, in panel order with torch.argmax's rules, is the argmax of the logits
//      that FusedStack::logits would return: bit for bit the same numbers, not an approximation of them.
// Rows that are not finite or whose logits could come near overflow take the plain path.
#if defined(__AVX512BF16__)

// A single row's lm_head is bound by streaming the weights, which the screen does not shorten (measured
// 4% slower on the 60M benchmark model with the weights out of cache); from two rows on it is faster.
constexpr int64_t kMinScreenedRows = 2;

struct GreedyScreen {
  at::Tensor pairs;  // bf16 [P, ceil(K/2), 64, 2]: for output 64p + i, weights k = 2j and 2j + 1 side by side
  at::Tensor norms;  // fp32 [64 P]: each output's weight norm, rounded up (0 for the padding outputs)
  at::Tensor bias;   // fp32 [64 P]: 0, or -inf for the padding outputs of the last panel
  double max_norm = 0.0;
};

// The screen of an lm_head whose values are all bf16 numbers, or an empty one when a weight is not finite
// or a row's norm is so large that the bounds could overflow.
GreedyScreen make_greedy_screen(const at::Tensor& w) {
  GreedyScreen s;
  const at::Tensor norms = w.to(at::kDouble).square().sum(1).sqrt() * (1.0 + 1e-6);  // up, past fp32 rounding
  if (!at::isfinite(w).all().item<bool>() || !(norms.max().item<double>() < 1e30)) return s;
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  at::Tensor padded = at::zeros({P * kPanel, 2 * K2}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  s.pairs = padded.view({P, kPanel, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  s.max_norm = norms.max().item<double>();
  s.norms = at::zeros({P * kPanel}, w.options());
  s.norms.narrow(0, 0, N).copy_(norms);
  s.bias = at::full({P * kPanel}, -INFINITY, w.options());
  s.bias.narrow(0, 0, N).zero_();
  return s;
}
bool ready(const GreedyScreen& s) { return s.pairs.defined(); }

// R rows (bf16 pairs) times one panel of pairs, then each row's largest lower and upper bound in the panel.
template <int R>
void screen_rows(const uint32_t* x, int64_t K2, const uint16_t* panel, const float* norms, const float* bias,
                 const float* scale, const float* slack, float* lower, float* upper, int64_t ld) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kPanel + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * K2 + k]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 lo = _mm512_set1_ps(-INFINITY), hi = lo;
    for (int j = 0; j < 4; ++j) {
      const __m512 b = _mm512_loadu_ps(bias + 16 * j);
      const __m512 margin = _mm512_fmadd_ps(_mm512_set1_ps(scale[r]), _mm512_loadu_ps(norms + 16 * j),
                                            _mm512_set1_ps(slack[r]));
      lo = _mm512_max_ps(lo, _mm512_add_ps(_mm512_sub_ps(acc[r][j], margin), b));
      hi = _mm512_max_ps(hi, _mm512_add_ps(_mm512_add_ps(acc[r][j], margin), b));
    }
    lower[r * ld] = _mm512_reduce_max_ps(lo);
    upper[r * ld] = _mm512_reduce_max_ps(hi);
  }
}

// Fills argmax [T]. Rows that are not finite, or whose logits could come near overflow, are outside the
// screen's range: all their panels go through the fp32 kernel, the plain path.
void screened_greedy(const at::Tensor& h, const GreedyScreen& s, const Linear& lm, int64_t* argmax) {
  const int64_t T = h.size(0), K = h.size(1), N = lm.w.size(0), P = s.pairs.size(0), K2 = s.pairs.size(1);
  const float* hp = h.data_ptr<float>();
  std::vector<uint32_t> pairs(T * K2, 0);  // each row rounded to bf16 (subnormals flushed, as vdpbf16ps does)
  std::vector<float> scale(T, 0.0f), slack(T, 0.0f);
  std::vector<char> screened(T, 1);
  const double unit = std::ldexp(1.0, -24), gamma = (K + 2) * unit / (1.0 - (K + 2) * unit);
  for (int64_t t = 0; t < T; ++t) {
    double h2 = 0.0, rounded2 = 0.0, error2 = 0.0, h1 = 0.0;
    for (int64_t k = 0; k < K && screened[t]; ++k) {
      const float v = hp[t * K + k];
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (meaningless unless v is finite)
      uint32_t top = bits & 0xFFFF0000u;
      float r;
      std::memcpy(&r, &top, sizeof(r));
      if (std::fabs(r) < FLT_MIN) r = 0.0f, top = 0;
      screened[t] = std::isfinite(v) && std::isfinite(r);
      pairs[t * K2 + k / 2] |= (top >> 16) << (16 * (k % 2));
      h2 += double(v) * v, rounded2 += double(r) * r, error2 += (double(v) - r) * (double(v) - r);
      h1 += std::fabs(double(v));
    }
    screened[t] = screened[t] && std::sqrt(h2) * s.max_norm < 1e36;
    if (!screened[t]) {
      std::fill(pairs.begin() + t * K2, pairs.begin() + (t + 1) * K2, 0u);
      continue;
    }
    // 1.25 and 4 x gamma: room for the float roundings of the norms and of the bounds themselves
    scale[t] = static_cast<float>(1.25 * std::sqrt(error2) + 4.0 * gamma * (std::sqrt(h2) + std::sqrt(rounded2)));
    slack[t] = static_cast<float>(std::ldexp(h1 + 2.0 * K, -100));
  }
  std::vector<float> lower(T * P), upper(T * P);  // [T, P]
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(s.pairs.data_ptr<at::BFloat16>());
  const float* np = s.norms.data_ptr<float>();
  const float* bp = s.bias.data_ptr<float>();
  for (int64_t r0 = 0; r0 < T; r0 += kRowBlock) {
    const int64_t r1 = std::min(T, r0 + kRowBlock);
    at::parallel_for(0, P, grain_for((r1 - r0) * K * kPanel / 2), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* panel = wp + p * K2 * 2 * kPanel;
        for (int64_t t = r0; t < r1; t += 6) {
          const int64_t rows = std::min<int64_t>(6, r1 - t);
          with_row_tile(rows, [&](auto R) {
            screen_rows<decltype(R)::value>(pairs.data() + t * K2, K2, panel, np + p * kPanel, bp + p * kPanel,
                                            scale.data() + t, slack.data() + t, lower.data() + t * P + p,
                                            upper.data() + t * P + p, P);
          });
        }
      }
    });
  }
  const uint16_t* exact = reinterpret_cast<const uint16_t*>(lm.panels.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, grain_for(4 * K * kPanel), [&](int64_t t0, int64_t t1) {
    float logits[kPanel];
    for (int64_t t = t0; t < t1; ++t) {
      const float floor = *std::max_element(lower.begin() + t * P, lower.begin() + (t + 1) * P);
      int64_t best = -1;
      float best_value = 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        if (screened[t] && !(upper[t * P + p] >= floor)) continue;
        const int64_t ncols = std::min(kPanel, N - p * kPanel);
        panel_rows<1>(hp + t * K, K, exact + p * K * kPanel, logits, kPanel, ncols);
        const int64_t at = first_argmax(logits, ncols);
        if (best < 0 || beats(logits[at], best_value)) best = p * kPanel + at, best_value = logits[at];
      }
      argmax[t] = best;
    }
  });
}
#else
constexpr int64_t kMinScreenedRows = 0;
struct GreedyScreen {};
GreedyScreen make_greedy_screen(const at::Tensor&) { return {}; }
bool ready(const GreedyScreen&) { return false; }
void screened_greedy(const at::Tensor&, const GreedyScreen&, const Linear&, int64_t*) {}
#endif

// glibc hands allocations above 128 KB (raising that bar only as such blocks are freed) to fresh mmaps and
// returns freed heap tops to the kernel past 128 KB: a step's activations, a few hundred KB to a few MB,
// were faulted in page by page at every step (the 64-request benchmark on the demo spent 15% there).
// Keeping them on the heap is what servers get from tcmalloc or jemalloc; it is process-wide, and costs
// up to the trim threshold of freed memory held back from the kernel.
void keep_step_memory_on_the_heap() {
#if defined(__GLIBC__)
  static const bool done = [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's ceiling for this setting on 64-bit
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    return true;
  }();
  (void)done;
#endif
}

// Adds the wall time of its scope to *slot (when slot is not null): the step profile (FusedStack::profile).
class Timed {
 public:
  explicit Timed(double* slot) : slot_(slot), start_(slot ? Clock::now() : Clock::time_point()) {}
  ~Timed() {
    if (slot_) *slot_ += std::chrono::duration<double>(Clock::now() - start_).count();
  }

 private:
  using Clock = std::chrono::steady_clock;
  double* slot_;
  Clock::time_point start_;
};

struct Dims {
  int64_t hidden, intermediate;
  int64_t hk, hv, dk, dv, conv_dim, kernel;  // Gated DeltaNet
  int64_t nh, nkv, hd, rotary_dim;           // attention
  float eps;
};

struct GdnWeights {
  Linear in_w;           // [conv_dim + value_dim + 2*hv, hidden]: rows of in_proj_qkv | z | b | a
  at::Tensor conv_w;     // [conv_dim, kernel]
  at::Tensor neg_a;      // [hv] = -exp(A_log)
  at::Tensor dt_bias;    // [hv]
  at::Tensor norm_w;     // [dv]
  Linear out_w;          // [hidden, value_dim]
  at::Tensor conv_cache; // [slots, conv_dim, kernel-1]
  at::Tensor ssm_cache;  // [slots, hv, dk, dv]
};

struct AttnWeights {
  Linear qkv_w;                 // [2*nh*hd + 2*nkv*hd, hidden]: rows of q_proj | k_proj | v_proj
  Linear kv_w;                  // its k_proj | v_proj rows alone, when its panels split there (else empty)
  at::Tensor q_scale, k_scale;  // [hd] = 1 + q_norm / k_norm weight
  Linear o_w;                   // [hidden, nh*hd]
  at::Tensor k_cache;           // [blocks, nkv, hd, block_size]: keys transposed within a block
  at::Tensor v_cache;           // [blocks, block_size, nkv, hd]
};

struct Layer {
  bool gdn;
  at::Tensor in_scale, post_scale;  // [hidden] = 1 + weight of the two RMSNorms
  Linear gate_up_w;                 // [2*intermediate, hidden]: rows of gate_proj | up_proj
  Linear down_w;                    // [hidden, intermediate]
  GdnWeights g;
  AttnWeights a;
};

// Per-step views of the flat batch (all int64, on CPU).
struct Batch {
  int64_t T, B;
  const int64_t *positions, *qsl, *context_lens, *block_tables, *slot_mapping, *state_slots, *spec_index;
  int64_t table_width;
  int64_t spec_rows, spec_width;
};

// The tokens whose final hidden state a step hands back (the rows it samples), when not all of them: the
// last layer still writes every token's K/V or GDN state, but attends, projects out and runs its MLP only
// for these rows. Nothing after the last layer reads the other rows.
struct OutputRows {
  at::Tensor rows;          // int64 [R], ascending
  std::vector<char> wanted;  // [T]: whether token t is one of them
};

// A stack of decoder layers between an input and a final norm: the trunk (input: token embeddings), or the
// MTP head (input: fc(cat[norm(embedding of token t+1), norm(trunk hidden at t)])).
class FusedStack {
 public:
  FusedStack(std::vector<at::Tensor> tensors, std::vector<int64_t> layer_is_gdn, std::vector<int64_t> dims,
             double eps, bool mtp)
      : d_{dims.at(0), dims.at(1), dims.at(2), dims.at(3), dims.at(4), dims.at(5), dims.at(6), dims.at(7),
           dims.at(8), dims.at(9), dims.at(10), dims.at(11), static_cast<float>(eps)} {
    keep_step_memory_on_the_heap();
    size_t i = 0;
    auto next = [&]() {
      TORCH_CHECK(i < tensors.size(), "FusedStack: too few tensors");
      at::Tensor t = tensors[i++];
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "FusedStack: tensor ", i - 1,
                  " must be contiguous float32");
      return t;
    };
    // a projection: its fp32 weight, then its bf16 panels or an empty tensor when the values are not bf16
    auto linear = [&]() {
      at::Tensor w = next();
      TORCH_CHECK(i < tensors.size(), "FusedStack: too few tensors");
      at::Tensor panels = tensors[i++];
      if (panels.numel() == 0) return Linear{w, at::Tensor()};
      TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 3 &&
                      panels.size(0) * kPanel >= w.size(0) && panels.size(1) == w.size(1) &&
                      panels.size(2) == kPanel,
                  "FusedStack: tensor ", i - 1, " must be the bf16 panels of the weight before it");
      return Linear{w, panels};
    };
    embed_ = next();
    final_scale_ = next();
    inv_freq_ = next();
    lm_head_ = linear();
    if (lm_head_.panels.defined()) greedy_screen_ = make_greedy_screen(lm_head_.w);
    if (mtp) {
      fc_ = linear();
      pre_embed_scale_ = next();
      pre_hidden_scale_ = next();
    }
    for (int64_t is_gdn : layer_is_gdn) {
      Layer l;
      l.gdn = is_gdn != 0;
      l.in_scale = next();
      l.post_scale = next();
      l.gate_up_w = linear();
      l.down_w = linear();
      if (l.gdn) {
        l.g.in_w = linear();
        l.g.conv_w = next();
        l.g.neg_a = next();
        l.g.dt_bias = next();
        l.g.norm_w = next();
        l.g.out_w = linear();
        l.g.conv_cache = next();
        l.g.ssm_cache = next();
      } else {
        l.a.qkv_w = linear();
        const int64_t q_width = 2 * d_.nh * d_.hd;
        if (l.a.qkv_w.panels.defined() && q_width % kPanel == 0) {
          const at::Tensor& w = l.a.qkv_w.w;
          const at::Tensor& panels = l.a.qkv_w.panels;
          l.a.kv_w = {w.narrow(0, q_width, w.size(0) - q_width),
                      panels.narrow(0, q_width / kPanel, panels.size(0) - q_width / kPanel)};
        }
        l.a.q_scale = next();
        l.a.k_scale = next();
        l.a.o_w = linear();
        l.a.k_cache = next();
        l.a.v_cache = next();
      }
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(i == tensors.size(), "FusedStack: ", tensors.size() - i, " tensors left over");
    for (const Layer& l : layers_) {  // cache sizes, for check_batch (-1: no such layer in this stack)
      if (l.gdn) num_slots_ = l.g.conv_cache.size(0);
      else num_blocks_ = l.a.v_cache.size(0), block_size_ = l.a.v_cache.size(1);
    }
  }

  // Returns the final-normed hidden states [T, hidden] (with output_rows, [R, hidden] of those rows only: see
  // OutputRows) and, per GDN layer, the per-position conv [S, L, conv_dim, kernel-1] and recurrent
  // [S, L, hv, dk, dv] states of the verify segments (empty lists when spec_rows == 0).
  std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> forward(
      const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& qsl,
      const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& slot_mapping,
      const at::Tensor& state_slots, const at::Tensor& spec_index, int64_t spec_rows, int64_t spec_width,
      const at::Tensor& hidden_in, const std::optional<at::Tensor>& output_rows) {
    for (const at::Tensor* t : {&input_ids, &positions, &qsl, &context_lens, &block_tables, &slot_mapping,
                                &state_slots, &spec_index}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "FusedStack: index tensors are int64");
    }
    Batch bt{input_ids.size(0), context_lens.size(0), positions.data_ptr<int64_t>(), qsl.data_ptr<int64_t>(),
             context_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
             slot_mapping.data_ptr<int64_t>(), state_slots.data_ptr<int64_t>(),
             spec_index.data_ptr<int64_t>(), block_tables.size(1), spec_rows, spec_width};
    TORCH_CHECK(positions.dim() == 1, "FusedStack: text positions only ([T])");
    check_batch(bt);
    const bool select = output_rows.has_value() && output_rows->numel() < bt.T;
    OutputRows out;
    if (select) {
      TORCH_CHECK(output_rows->dim() == 1 && output_rows->scalar_type() == at::kLong && output_rows->is_contiguous(),
                  "FusedStack: output_rows is int64 [R]");
      out.rows = *output_rows;
      out.wanted.assign(bt.T, 0);
      const int64_t* rp = output_rows->data_ptr<int64_t>();
      for (int64_t r = 0; r < output_rows->numel(); ++r) {
        TORCH_CHECK(rp[r] >= 0 && rp[r] < bt.T && (r == 0 || rp[r] > rp[r - 1]),
                    "FusedStack: output_rows must ascend within [0, ", bt.T, ")");
        out.wanted[rp[r]] = 1;
      }
    }
    Timed whole(slot(kForward));

    // cos/sin [T, half] from positions * inv_freq, as RotaryEmbedding.cos_sin computes them.
    const int64_t half = d_.rotary_dim / 2;
    std::vector<float> cos(bt.T * half), sin(bt.T * half);
    const float* inv = inv_freq_.data_ptr<float>();
    for (int64_t t = 0; t < bt.T; ++t) {
      for (int64_t f = 0; f < half; ++f) {
        const float angle = static_cast<float>(bt.positions[t]) * inv[f];
        cos[t * half + f] = std::cos(angle);
        sin[t * half + f] = std::sin(angle);
      }
    }

    std::vector<at::Tensor> spec_conv, spec_ssm;
    at::Tensor x = embed_.index_select(0, input_ids);  // [T, hidden]
    if (fc_.w.defined()) {
      TORCH_CHECK(hidden_in.sizes() == x.sizes() && hidden_in.scalar_type() == at::kFloat,
                  "FusedStack: the MTP head needs the trunk hidden of every token, [T, hidden] float32");
      at::Tensor both = at::cat({rms_norm_rows(x, pre_embed_scale_, d_.eps),
                                 rms_norm_rows(hidden_in.contiguous(), pre_hidden_scale_, d_.eps)}, 1);
      x = project(fc_, both);
    }
    for (Layer& l : layers_) {
      const OutputRows* only = select && &l == &layers_.back() ? &out : nullptr;
      at::Tensor h = rms_norm_rows(x, l.in_scale, d_.eps);
      at::Tensor mix;
      if (l.gdn) {
        at::Tensor conv_states, ssm_states;
        if (spec_rows > 0) {
          conv_states = at::empty({spec_rows, spec_width, d_.conv_dim, d_.kernel - 1}, x.options());
          ssm_states = at::empty({spec_rows, spec_width, d_.hv, d_.dk, d_.dv}, x.options());
          spec_conv.push_back(conv_states);
          spec_ssm.push_back(ssm_states);
        }
        mix = gdn(l.g, h, bt, conv_states, ssm_states, only);
      } else {
        mix = attention(l.a, h, bt, cos.data(), sin.data(), only);
      }
      if (only != nullptr) x = x.index_select(0, only->rows);
      x.add_(mix);
      at::Tensor gu = project(l.gate_up_w, rms_norm_rows(x, l.post_scale, d_.eps));  // [rows, 2I]
      const int64_t I = d_.intermediate, rows = x.size(0);
      at::Tensor act = at::empty({rows, I}, x.options());
      const float* gp = gu.data_ptr<float>();
      float* ap = act.data_ptr<float>();
      for (int64_t t = 0; t < rows; ++t) {
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) ap[t * I + j] = silu(gp[t * 2 * I + j]) * gp[t * 2 * I + I + j];
      }
      x.add_(project(l.down_w, act));
    }
    return {rms_norm_rows(x, final_scale_, d_.eps), spec_conv, spec_ssm};
  }

  // fp32 logits [R, vocab] of final-normed hidden rows [R, hidden]
  at::Tensor logits(const at::Tensor& hidden) {
    check_hidden(hidden);
    return project(lm_head_, hidden.contiguous());
  }

  // The greedy token of each row, torch.argmax of its logits, without handing the [R, vocab] logits back
  // (with bf16 panels, without writing them at all).
  at::Tensor greedy_tokens(const at::Tensor& hidden) {
    check_hidden(hidden);
    const at::Tensor h = hidden.contiguous();
    at::Tensor out = at::empty({h.size(0)}, h.options().dtype(at::kLong));
    int64_t* op = out.data_ptr<int64_t>();
    if (lm_head_.panels.defined()) {
      Timed timed(slot(kProjections));
      if (greedy_screen_on() && h.size(0) >= kMinScreenedRows) {
        screened_greedy(h, greedy_screen_, lm_head_, op);
      } else {
        linear_panels(h, lm_head_.panels, lm_head_.w.size(0), op);
      }
      return out;
    }
    const at::Tensor scores = logits(h);
    const int64_t R = scores.size(0), V = scores.size(1);
    const float* sp = scores.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) op[r] = first_argmax(sp + r * V, V);
    return out;
  }

  // After a verify step: verify segment r keeps in its GDN slot slots[r] the conv and recurrent states after
  // its position pick[r], the last accepted token. conv_states / ssm_states: per GDN layer, in layer order,
  // the per-position states [S, L, ...] that forward() returned (or the Python model left). One call and a
  // memcpy per state instead of a few dozen small torch ops per step.
  void commit_verified(const std::vector<at::Tensor>& conv_states, const std::vector<at::Tensor>& ssm_states,
                       const at::Tensor& slots, const at::Tensor& pick) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && pick.scalar_type() == at::kLong && slots.is_contiguous() &&
                    pick.is_contiguous() && slots.dim() == 1 && pick.sizes() == slots.sizes(),
                "commit_verified: slots and pick are int64 [S]");
    const int64_t S = slots.size(0);
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* pp = pick.data_ptr<int64_t>();
    size_t g = 0;
    for (const Layer& l : layers_) {
      if (!l.gdn) continue;
      TORCH_CHECK(g < conv_states.size() && g < ssm_states.size(), "commit_verified: one state pair per GDN layer");
      for (const auto& [states, cache] : {std::pair{conv_states[g], l.g.conv_cache}, {ssm_states[g], l.g.ssm_cache}}) {
        const int64_t row = cache.numel() / cache.size(0);
        TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() >= 2 &&
                        states.size(0) == S && states.numel() == S * states.size(1) * row,
                    "commit_verified: states must be contiguous float32 [S, L, ...] of the cache's rows");
        const int64_t L = states.size(1);
        float* to = cache.data_ptr<float>();
        const float* from = states.data_ptr<float>();
        for (int64_t r = 0; r < S; ++r) {
          TORCH_CHECK(sp[r] >= 0 && sp[r] < cache.size(0) && pp[r] >= 0 && pp[r] < L,
                      "commit_verified: slot or position out of range");
          std::memcpy(to + sp[r] * row, from + (r * L + pp[r]) * row, row * sizeof(float));
        }
      }
      ++g;
    }
    TORCH_CHECK(g == conv_states.size() && g == ssm_states.size(), "commit_verified: one state pair per GDN layer");
  }

  // Whether greedy_tokens screens with bf16 dot products (see screened_greedy): the CPU has AVX512-BF16,
  // the lm_head is bf16-valued and finite, and set_greedy_screen has not turned it off (for measurements).
  bool greedy_screen_on() const { return use_greedy_screen_ && ready(greedy_screen_); }
  void set_greedy_screen(bool on) { use_greedy_screen_ = on; }

  // Prompt chunks whose cached K and V (per layer) exceed this many bytes attend through torch's fused
  // kernel, the others in the loop (kLoopKVBytes unless set; tests set 0 to check both paths).
  void set_loop_kv_bytes(int64_t bytes) { loop_kv_bytes_ = bytes; }

  // While on, forward() adds the seconds it spends in each part to the profile; profile() returns and
  // clears {projections, GDN conv + recurrence, attention, whole forward}.
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<double> profile() {
    std::vector<double> out(spent_.begin(), spent_.end());
    spent_.fill(0.0);
    return out;
  }

 private:
  void check_hidden(const at::Tensor& hidden) const {
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(1) == lm_head_.w.size(1),
                "FusedStack: hidden rows must be float32 [R, ", lm_head_.w.size(1), "]");
  }

  // The loops below index the caches with these numbers unchecked: check them once per step.
  void check_batch(const Batch& bt) const {
    TORCH_CHECK(bt.qsl[0] == 0 && bt.qsl[bt.B] == bt.T, "FusedStack: query_start_loc must span the T tokens");
    const int64_t slots = num_slots_, blocks = num_blocks_, block_size = block_size_;
    for (int64_t b = 0; b < bt.B; ++b) {
      TORCH_CHECK(bt.qsl[b] <= bt.qsl[b + 1], "FusedStack: query_start_loc must not decrease");
      TORCH_CHECK(slots < 0 || (bt.state_slots[b] >= 0 && bt.state_slots[b] < slots), "FusedStack: state slot ",
                  bt.state_slots[b], " outside [0, ", slots, ")");
      for (int64_t w = 0; blocks >= 0 && w < bt.table_width; ++w) {
        const int64_t block = bt.block_tables[b * bt.table_width + w];
        TORCH_CHECK(block >= 0 && block < blocks, "FusedStack: block ", block, " outside [0, ", blocks, ")");
      }
      for (int64_t t = bt.qsl[b]; t < bt.qsl[b + 1]; ++t) {
        TORCH_CHECK(bt.positions[t] >= 0 && bt.positions[t] < bt.table_width * block_size,
                    "FusedStack: position ", bt.positions[t], " beyond the sequence's block table");
        TORCH_CHECK(blocks < 0 || (bt.slot_mapping[t] >= 0 && bt.slot_mapping[t] < blocks * block_size),
                    "FusedStack: KV slot ", bt.slot_mapping[t], " outside the cache");
      }
    }
  }

  enum Part { kProjections, kRecurrence, kAttention, kForward, kParts };
  double* slot(Part part) { return profiling_ ? &spent_[part] : nullptr; }

  at::Tensor project(const Linear& l, const at::Tensor& x) {
    Timed timed(slot(kProjections));
    return apply(l, x);
  }

  at::Tensor gdn(const GdnWeights& w, const at::Tensor& h, const Batch& bt, at::Tensor& spec_conv,
                 at::Tensor& spec_ssm, const OutputRows* only) {
    const int64_t C = d_.conv_dim, K = d_.kernel, Hv = d_.hv, dk = d_.dk, dv = d_.dv;
    const int64_t key_dim = d_.hk * dk, value_dim = Hv * dv, rep = Hv / d_.hk;
    const int64_t width = C + value_dim + 2 * Hv;  // qkv | z | b | a
    at::Tensor proj = project(w.in_w, h);         // [T, width]
    at::Tensor core = at::empty({bt.T, value_dim}, h.options());
    const float* pp = proj.data_ptr<float>();
    const float* cw = w.conv_w.data_ptr<float>();
    const float* neg_a = w.neg_a.data_ptr<float>();
    const float* dt_bias = w.dt_bias.data_ptr<float>();
    const float* norm_w = w.norm_w.data_ptr<float>();
    float* conv_cache = w.conv_cache.data_ptr<float>();
    float* ssm_cache = w.ssm_cache.data_ptr<float>();
    float* out = core.data_ptr<float>();
    const int64_t conv_size = C * (K - 1), ssm_size = Hv * dk * dv;
    float* spec_conv_p = bt.spec_rows ? spec_conv.data_ptr<float>() : nullptr;
    float* spec_ssm_p = bt.spec_rows ? spec_ssm.data_ptr<float>() : nullptr;
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));

    {
      Timed timed(slot(kRecurrence));
      const int64_t work_per_seq = (bt.T / std::max<int64_t>(bt.B, 1) + 1) * Hv * dk * dv * 3;
      at::parallel_for(0, bt.B, grain_for(work_per_seq), [&](int64_t b0, int64_t b1) {
        std::vector<float> mixed(C), u(dv), sk(dv), sq(dv);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t state_slot = bt.state_slots[b], row = bt.spec_index[b];
          const bool fresh = bt.context_lens[b] == 0;
          float* conv_slot = conv_cache + state_slot * conv_size;
          float* ssm_slot = ssm_cache + state_slot * ssm_size;
          const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
          // The working state: the slot itself, or for a verify segment the per-position copy.
          float* conv = conv_slot;
          float* S = ssm_slot;
          if (fresh && row < 0) {
            std::fill(conv_slot, conv_slot + conv_size, 0.0f);
            std::fill(ssm_slot, ssm_slot + ssm_size, 0.0f);
          }
          for (int64_t i = 0; i < n; ++i) {
            const int64_t t = t0 + i;
            if (row >= 0) {  // verify: position i starts from position i-1's state (or the slot's)
              float* conv_i = spec_conv_p + (row * bt.spec_width + i) * conv_size;
              float* S_i = spec_ssm_p + (row * bt.spec_width + i) * ssm_size;
              if (fresh && i == 0) {
                std::fill(conv_i, conv_i + conv_size, 0.0f);
                std::fill(S_i, S_i + ssm_size, 0.0f);
              } else {
                std::memcpy(conv_i, conv, conv_size * sizeof(float));
                std::memcpy(S_i, S, ssm_size * sizeof(float));
              }
              conv = conv_i;
              S = S_i;
            }
            const float* xin = pp + t * width;
            // causal depthwise conv over [state | x_t], then SiLU; the state shifts by one
            if (K == 4) {  // the models' kernel size: fixed taps let this loop vectorize
#pragma omp simd
              for (int64_t c = 0; c < C; ++c) {
                float* st = conv + c * 3;
                const float* wc = cw + c * 4;
                const float s0 = st[0], s1 = st[1], s2 = st[2], xc = xin[c];
                st[0] = s1;
                st[1] = s2;
                st[2] = xc;
                mixed[c] = silu(s0 * wc[0] + s1 * wc[1] + s2 * wc[2] + xc * wc[3]);
              }
            } else {
              for (int64_t c = 0; c < C; ++c) {
                float* st = conv + c * (K - 1);
                const float* wc = cw + c * K;
                float acc = 0.0f;
                for (int64_t j = 0; j < K - 1; ++j) acc += st[j] * wc[j];
                acc += xin[c] * wc[K - 1];
                for (int64_t j = 0; j + 1 < K - 1; ++j) st[j] = st[j + 1];
                st[K - 2] = xin[c];
                mixed[c] = silu(acc);
              }
            }
            // L2-normalise q and k per key head (q also scaled by dk^-1/2)
            for (int64_t kh = 0; kh < 2 * d_.hk; ++kh) {
              float* v = mixed.data() + kh * dk;
              float r = 1.0f / std::sqrt(dot(v, v, dk) + 1e-6f);
              if (kh < d_.hk) r *= q_scale;
#pragma omp simd
              for (int64_t j = 0; j < dk; ++j) v[j] *= r;
            }
            const float* z = xin + C;
            const float* braw = xin + C + value_dim;
            const float* araw = braw + Hv;
            float* o_t = out + t * value_dim;
            for (int64_t hv = 0; hv < Hv; ++hv) {
              const float* q = mixed.data() + (hv / rep) * dk;
              const float* k = mixed.data() + key_dim + (hv / rep) * dk;
              const float* v = mixed.data() + 2 * key_dim + hv * dv;
              const float beta = sigmoid(braw[hv]);
              const float decay = std::exp(neg_a[hv] * softplus(araw[hv] + dt_bias[hv]));
              float* Sh = S + hv * dk * dv;
              // One read pass gives S^T k and S^T q (state_times_kq); then, with
              //   S' = decay S + k u^T,  u = beta (v - decay S^T k),  o = S'^T q = decay S^T q + (k.q) u,
              // one pass writes S'. (The reference decays S first; same maths, other rounding order.)
              const float kq = dot(k, q, dk);
              float* o = o_t + hv * dv;
              state_times_kq(Sh, k, q, dk, dv, sk.data(), sq.data());
#pragma omp simd
              for (int64_t j = 0; j < dv; ++j) {
                u[j] = beta * (v[j] - decay * sk[j]);
                o[j] = decay * sq[j] + kq * u[j];
              }
              for (int64_t a = 0; a < dk; ++a) {
                float* Sa = Sh + a * dv;
                const float ka = k[a];
#pragma omp simd
                for (int64_t j = 0; j < dv; ++j) Sa[j] = Sa[j] * decay + ka * u[j];
              }
              // gated RMSNorm: o * rsqrt(mean(o^2) + eps) * w * silu(z)
              const float r = 1.0f / std::sqrt(dot(o, o, dv) / static_cast<float>(dv) + d_.eps);
              const float* zh = z + hv * dv;
#pragma omp simd
              for (int64_t j = 0; j < dv; ++j) o[j] = o[j] * r * norm_w[j] * silu(zh[j]);
            }
          }
          if (row >= 0) {  // padding positions of a shorter verify segment keep its last state
            for (int64_t i = n; i < bt.spec_width; ++i) {
              std::memcpy(spec_conv_p + (row * bt.spec_width + i) * conv_size, conv, conv_size * sizeof(float));
              std::memcpy(spec_ssm_p + (row * bt.spec_width + i) * ssm_size, S, ssm_size * sizeof(float));
            }
          }
        }
      });
    }
    return project(w.out_w, only != nullptr ? core.index_select(0, only->rows) : core);
  }

  at::Tensor attention(const AttnWeights& w, const at::Tensor& h, const Batch& bt, const float* cos,
                       const float* sin, const OutputRows* only) {
    const int64_t nh = d_.nh, nkv = d_.nkv, hd = d_.hd, half = d_.rotary_dim / 2;
    const int64_t q_width = 2 * nh * hd, width = q_width + 2 * nkv * hd, group = nh / nkv;
    const int64_t block_size = w.v_cache.size(1), row_size = nkv * hd;
    at::Tensor proj;  // [T, width]: per head q | gate, then k, then v
    if (only != nullptr && w.kv_w.w.defined()) {  // q | gate only for the wanted rows (the others' stay unset)
      proj = at::empty({bt.T, width}, h.options());
      proj.narrow(1, q_width, width - q_width).copy_(project(w.kv_w, h));
      proj.index_copy_(0, only->rows, project(w.qkv_w, h.index_select(0, only->rows)));
    } else {
      proj = project(w.qkv_w, h);
    }
    float* pp = proj.data_ptr<float>();
    const float* qs = w.q_scale.data_ptr<float>();
    const float* ks = w.k_scale.data_ptr<float>();
    float* k_cache = w.k_cache.data_ptr<float>();
    float* v_cache = w.v_cache.data_ptr<float>();

    at::Tensor attn = at::empty({bt.T, nh * hd}, h.options());
    {
      Timed timed(slot(kAttention));
      auto wanted = [&](int64_t t) { return only == nullptr || only->wanted[t] != 0; };
      // 1. q/k RMSNorm and RoPE, K/V into the cache (every token's, before any token reads them)
      for (int64_t t = 0; t < bt.T; ++t) {
        float* row = pp + t * width;
        for (int64_t hh = 0; hh < nh && wanted(t); ++hh) {
          float* q = row + hh * 2 * hd;
          rms_norm_row(q, qs, d_.eps, hd, q);
          rope_head(q, cos + t * half, sin + t * half, half);
        }
        float* k = row + q_width;
        for (int64_t hh = 0; hh < nkv; ++hh) {
          rms_norm_row(k + hh * hd, ks, d_.eps, hd, k + hh * hd);
          rope_head(k + hh * hd, cos + t * half, sin + t * half, half);
        }
        // V rows as they are; K transposed within its block: k_cache[block][head][dim][offset]
        const int64_t kv_row = bt.slot_mapping[t], block = kv_row / block_size, offset = kv_row % block_size;
        std::memcpy(v_cache + kv_row * row_size, k + row_size, row_size * sizeof(float));
        float* kt = k_cache + block * row_size * block_size + offset;
        for (int64_t e = 0; e < row_size; ++e) kt[e * block_size] = k[e];
      }

      // 2. each query token attends to positions 0 .. its own, read through its sequence's block table: in a
      // loop per (token, kv head) that reads each cached K/V row once for all the query heads of its group,
      // or, for a prompt chunk whose keys and values outgrow the caches (re-read for each of its tokens),
      // through torch's fused attention kernel.
      float* ap = attn.data_ptr<float>();
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      const int64_t kv_bytes_per_position = 2 * row_size * static_cast<int64_t>(sizeof(float));
      std::vector<AttentionItem> items;  // the loop's work: up to kItemTokens tokens of one sequence
      int64_t loop_work = 0;             // query x key pairs, times the head work
      for (int64_t b = 0; b < bt.B; ++b) {
        const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
        if (n == 0) continue;
        const int64_t L = bt.positions[t0 + n - 1] + 1;
        // (with output rows, the loop: a chunk has one sampled token, not a block of queries)
        if (only == nullptr && n > kItemTokens && L * kv_bytes_per_position > loop_kv_bytes_) {
          fused_attention(w, proj, attn, bt, b, L, scale);
          continue;
        }
        // runs of up to kItemTokens wanted tokens
        for (int64_t t = t0; t < t0 + n;) {
          if (!wanted(t)) {
            ++t;
            continue;
          }
          int64_t end = t + 1;
          while (end < std::min(t0 + n, t + kItemTokens) && wanted(end)) ++end;
          items.push_back({b, t, end});
          loop_work += (end - t) * L * nh * hd * 2;
          t = end;
        }
      }
      // Block i of those token t (of items[k]) attends to, counting on past its last one into the blocks of
      // the next sequence below items[k_end] (later tokens of t's sequence read the same, cached, blocks):
      // what to ask for while an earlier block is computed. -1 when there is none.
      const int64_t block_floats = block_size * row_size;
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
        std::vector<float> probs;  // [nkv, group, L]
        std::vector<int64_t> rows;   // offset (in floats) of each position's V row
        for (int64_t k = k0; k < k1; ++k) {
          const AttentionItem item = items[k];
          const int64_t* table = bt.block_tables + item.seq * bt.table_width;
          const int64_t len = bt.positions[item.end - 1] + 1;
          rows.resize(len);
          for (int64_t j0 = 0; j0 < len; j0 += block_size) {  // block by block: no division per position
            const int64_t first = table[j0 / block_size] * block_size * row_size;
            for (int64_t j = j0; j < std::min(len, j0 + block_size); ++j) rows[j] = first + (j - j0) * row_size;
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
              const float* block_keys = k_cache + table[i] * block_floats;
              for (int64_t kvh = 0; kvh < nkv; ++kvh) {
                const float* q0 = pp + t * width + kvh * group * 2 * hd;  // head g of the group: q0 + g * 2hd
                // each head's pass asks for its share (1/nkv) of the K and V blocks `ahead`
                const int64_t share = ahead * block_floats + kvh * hd * block_size;
                block_scores(q0, 2 * hd, group, block_keys + kvh * hd * block_size,
                             ahead >= 0 ? k_cache + share : nullptr, ahead >= 0 ? v_cache + share : nullptr, hd,
                             block_size, scale, probs.data() + kvh * group * L + j0, L, std::min(block_size, L - j0));
              }
            }
            for (int64_t kvh = 0; kvh < nkv; ++kvh) {
              float* head_probs = probs.data() + kvh * group * L;
              for (int64_t g = 0; g < group; ++g) softmax_row(head_probs + g * L, L);
              float* o0 = ap + t * nh * hd + kvh * group * hd;
              probs_times_v(head_probs, L, group, v_cache + kvh * hd, rows.data(), hd, o0);
            }
          }
        }
      });
      // output gate: attn * sigmoid(gate), the gate being the second half of each head's q_proj rows
      for (int64_t t = 0; t < bt.T; ++t) {
        for (int64_t hh = 0; hh < nh && wanted(t); ++hh) {
          float* o = ap + (t * nh + hh) * hd;
          const float* gate = pp + t * width + hh * 2 * hd + hd;
#pragma omp simd
          for (int64_t e = 0; e < hd; ++e) o[e] *= sigmoid(gate[e]);
        }
      }
    }
    return project(w.o_w, only != nullptr ? attn.index_select(0, only->rows) : attn);
  }

  // Attention of sequence b's query tokens (the last n of its L positions) through torch's fused kernel,
  // with its keys and values gathered from the cache blocks into [1, nkv, L, hd].
  void fused_attention(const AttnWeights& w, const at::Tensor& proj, at::Tensor& attn, const Batch& bt, int64_t b,
                       int64_t L, float scale) const {
    const int64_t nh = d_.nh, nkv = d_.nkv, hd = d_.hd, block_size = w.v_cache.size(1);
    const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0, nb = (L + block_size - 1) / block_size;
    at::Tensor blocks = at::from_blob(const_cast<int64_t*>(bt.block_tables + b * bt.table_width), {nb}, at::kLong);
    auto heads_first = [&](const at::Tensor& rows) {  // [nb * block_size, nkv, hd] -> [1, nkv, L, hd]
      return rows.narrow(0, 0, L).transpose(0, 1).unsqueeze(0);
    };
    at::Tensor keys =
        heads_first(w.k_cache.index_select(0, blocks).permute({0, 3, 1, 2}).reshape({nb * block_size, nkv, hd}));
    at::Tensor values = heads_first(w.v_cache.index_select(0, blocks).reshape({nb * block_size, nkv, hd}));
    at::Tensor q = proj.narrow(0, t0, n).narrow(1, 0, 2 * nh * hd).view({n, nh, 2 * hd}).narrow(2, 0, hd);
    std::optional<at::Tensor> mask;  // the n queries are the last n of the L positions
    if (L != n) mask = at::arange(L).unsqueeze(0) <= at::arange(L - n, L).unsqueeze(1);
    at::Tensor out =
        at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, mask, 0.0, L == n, scale, true);
    attn.narrow(0, t0, n).view({n, nh, hd}).copy_(out[0].transpose(0, 1));
  }

  Dims d_;
  int64_t num_slots_ = -1, num_blocks_ = -1, block_size_ = 1;
  bool profiling_ = false;
  std::array<double, kParts> spent_{};
  at::Tensor embed_, final_scale_, inv_freq_;
  Linear lm_head_;
  GreedyScreen greedy_screen_;
  bool use_greedy_screen_ = true;
  int64_t loop_kv_bytes_ = kLoopKVBytes;
  Linear fc_;  // MTP head only, with the two pre-fc norm scales
  at::Tensor pre_embed_scale_, pre_hidden_scale_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FusedStack>(m, "FusedStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, double, bool>())
      .def("forward", &FusedStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("logits", &FusedStack::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("greedy_tokens", &FusedStack::greedy_tokens, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("commit_verified", &FusedStack::commit_verified)
      .def("greedy_screen_on", &FusedStack::greedy_screen_on)
      .def("set_greedy_screen", &FusedStack::set_greedy_screen)
      .def("set_profiling", &FusedStack::set_profiling)
      .def("profile", &FusedStack::profile)
      .def("set_loop_kv_bytes", &FusedStack::set_loop_kv_bytes);
  // The bf16 panel projection alone (x [T, K] float32, panels from fused.py's _linear, N outputs), for its
  // test against torch and for measurements.
  m.def("linear_panels", [](const at::Tensor& x, const at::Tensor& panels, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, K] float32");
    TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                    panels.size(1) == x.size(1) && panels.size(2) == kPanel && N > 0 && N <= panels.size(0) * kPanel,
                "panels: contiguous bf16 [ceil(N / 64), K, 64] for x's K");
    return linear_panels(x, panels, N);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
}
