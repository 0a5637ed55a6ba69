#include "vision.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "formats.h"
#include "parallel.h"
#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace deltaserve {

namespace {

// Round to nearest even, a NaN to the quiet NaN: torch's float -> bfloat16 conversion. Branch-free, so that
// the loops calling it vectorize.
inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0u} : bf16_round_bits(bits);
}

uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_contiguous(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == dim, name, ": contiguous ", type, " of ",
              dim, " dims, got ", t.scalar_type(), " of ", t.dim(), t.is_contiguous() ? "" : " (not contiguous)");
}

// An element as fp32 (bf16 widened), and an fp32 result stored as the element type (bf16 rounded once).
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }
inline void store(float v, float* out) { *out = v; }
inline void store(float v, uint16_t* out) { *out = round_bf16(v); }

// GELU with tanh's approximation as x * sigmoid(2z) = x * (1 + tanh z) / 2, z = sqrt(2/pi) (x + 0.044715 x^3).
// Below -88 sigmoid(2z) is under e^-88 (vexp clamps there): 0 * v, torch's -0 for a finite v, NaN for -inf.
inline float gelu_tanh(float v) {
  const float two_z = 1.5957691216057308f * (v + 0.044715f * v * v * v);  // 2 sqrt(2/pi) (v + 0.044715 v^3)
  return two_z < -88.0f ? 0.0f * v : v / (1.0f + vexp(-two_z));
}

// erf(x) as a rational function of x (x^2 in a degree-6 and a degree-4 polynomial; Eigen's and TensorFlow's
// float erf) over x clamped to [-4, 4], where erf is 1 to fp32's precision: within 7 ulp and 4.2e-7 of erf
// (measured in fp32 over [-6, 6]), and without calls or branches so that loops using it vectorize (libm's
// erff, called element by element, was a tenth of a small tower's merger).
inline float verf(float x) {
  x = std::min(std::max(x, -4.0f), 4.0f);
  const float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p / q;
}

inline float gelu_erf(float v) { return 0.5f * v * (1.0f + verf(v * 0.70710678118654752f)); }

// Rows [t0, t1) of the residual stream x [T, n] (fp32): x += y (when y is given), then
// out = LayerNorm(x) * w + b (biased variance, as torch).
template <typename Y, typename Out>
void add_layer_norm_rows(float* xp, const Y* yp, const float* w, const float* b, float eps, int64_t n, int64_t t0,
                         int64_t t1, Out* op) {
  for (int64_t t = t0; t < t1; ++t) {
    float* row = xp + t * n;
    if (yp) {
      const Y* add = yp + t * n;
      for (int64_t i = 0; i < n; ++i) row[i] += widen(add[i]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += row[i];
    const float mean = sum / static_cast<float>(n);
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += (row[i] - mean) * (row[i] - mean);
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    Out* o = op + t * n;
    for (int64_t i = 0; i < n; ++i) store((row[i] - mean) * rstd * w[i] + b[i], o + i);
  }
}

// q and k of qkv [N, 3, heads, hd] rotated in place (rotate-half: x * cos + rotate_half(x) * sin).
template <typename T>
void rotary_qk(T* base, const float* cp, const float* sp, int64_t N, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  // rows: (n, q or k, head), head_dim values each
  at::parallel_for(0, N * 2 * heads, grain_for(4 * hd), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / (2 * heads), rest = r % (2 * heads);  // rest: which (q 0 / k 1) * heads + head
      T* x = base + (n * 3 * heads + rest) * hd;
      const float* c = cp + n * hd;
      const float* s = sp + n * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = widen(x[i]), b = widen(x[i + half]);
        store(a * c[i] - b * s[i], x + i);
        store(b * c[i + half] + a * s[i + half], x + i + half);
      }
    }
  });
}

void check_rotary_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t N, int64_t hd) {
  check_contiguous(cos, at::kFloat, 2, "cos");
  check_contiguous(sin, at::kFloat, 2, "sin");
  TORCH_CHECK(cos.size(0) == N && cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos, sin: [N, head_dim] = [",
              N, ", ", hd, "], got cos ", cos.sizes(), ", sin ", sin.sizes());
}

// LayerNorm of x [T, n] fp32 (after x += y when y is given, y fp32 [T, n]), fp32 out.
at::Tensor add_layer_norm_f32(const at::Tensor& x, const float* y, const VisionNorm& norm) {
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({T, n}, x.options());
  float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* w = norm.weight.data_ptr<float>();
  const float* b = norm.bias.data_ptr<float>();
  const float eps = static_cast<float>(norm.eps);
  at::parallel_for(0, T, grain_for(4 * n), [&](int64_t t0, int64_t t1) {
    add_layer_norm_rows(xp, y, w, b, eps, n, t0, t1, op);
  });
  return out;
}

// y [T, N] += bias per row, then y = f(y), in place.
template <typename F>
void add_bias_rows(const at::Tensor& y, const at::Tensor& bias, F f) {
  const int64_t T = y.size(0), N = y.size(1);
  float* yp = y.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  at::parallel_for(0, T, grain_for(4 * N), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = yp + t * N;
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) row[i] = f(row[i] + b[i]);
    }
  });
}

// in @ w^T + bias, then the activation when given (a switch outside the loops, so that each vectorizes).
at::Tensor project(const VisionProjection& p, const at::Tensor& in, const VisionActivation* act = nullptr) {
  at::Tensor y = apply(p.linear, in);
  if (act == nullptr) {
    add_bias_rows(y, p.bias, [](float v) { return v; });
    return y;
  }
  switch (*act) {
    case VisionActivation::kGeluTanh: add_bias_rows(y, p.bias, [](float v) { return gelu_tanh(v); }); break;
    case VisionActivation::kGelu: add_bias_rows(y, p.bias, [](float v) { return gelu_erf(v); }); break;
    case VisionActivation::kSilu: add_bias_rows(y, p.bias, [](float v) { return silu(v); }); break;
    case VisionActivation::kQuickGelu: add_bias_rows(y, p.bias, [](float v) { return v * sigmoid(1.702f * v); });
  }
  return y;
}

// Keys and values at a time in segment_attention's register-blocked loops: fixed-size accumulators (a few
// 16-lane registers) that the compiler keeps out of memory, where a loop adding into a row of n scores
// (or hd outputs) in memory waited on its own stores (measured: most of the attention's time).
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kDimBlock = 32;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#if defined(__AVX512F__)
// AVX-512 builds tile the query rows too, so that each key or value vector loaded serves several rows' FMAs
// (a row at a time loaded a vector per FMA: the loads bounded it, 46 GFLOP/s on a Zen 4 core at 784 rows):
// scores 8 rows x 32 keys, outputs 4 rows x 64 dims at a time. The same products and sums in the same order.
constexpr int kScoreRows = 8;
constexpr int kOutputRows = 4;
constexpr int kOutputVectors = 4;  // 64 dims

// scores [R][n_pad] = (q_r * scale) . k_j for R query rows and every key (keys [hd][n_pad]); qs: room for the
// rows times scale, [R][hd] (broadcast from memory in the loop: a load each, where a product and a broadcast
// from a register took the FMAs' own ports, as many as the FMAs).
template <int R>
void f32_scores(const float* const* q, float scale, int64_t hd, const float* keys, int64_t n_pad, float* qs,
                float* scores) {
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < hd; ++c) qs[r * hd + c] = q[r][c] * scale;
  }
  for (int64_t j0 = 0; j0 < n_pad; j0 += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* kc = keys + j0;
    for (int64_t c = 0; c < hd; ++c, kc += n_pad) {
      const __m512 k0 = _mm512_loadu_ps(kc), k1 = _mm512_loadu_ps(kc + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 qc = _mm512_set1_ps(qs[r * hd + c]);
        acc[r][0] = _mm512_fmadd_ps(qc, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qc, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores + r * n_pad + j0, acc[r][0]);
      _mm512_storeu_ps(scores + r * n_pad + j0 + 16, acc[r][1]);
    }
  }
}

// out[r][c0, c0 + 16 D) (up to hd) = p_r . v over the n keys, for R rows of probabilities (n_pad apart) and
// values [n][hd_pad].
template <int R, int D>
void f32_outputs(const float* p, int64_t n_pad, int64_t n, const float* values, int64_t hd_pad, int64_t c0,
                 float* const* out, int64_t hd) {
  __m512 acc[R][D];
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; ++d) acc[r][d] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[D];
    for (int d = 0; d < D; ++d) v[d] = _mm512_loadu_ps(values + j * hd_pad + c0 + 16 * d);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * n_pad + j]);
      for (int d = 0; d < D; ++d) acc[r][d] = _mm512_fmadd_ps(pj, v[d], acc[r][d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; ++d) {
      const int64_t left = std::clamp<int64_t>(hd - c0 - 16 * d, 0, 16);
      _mm512_mask_storeu_ps(out[r] + c0 + 16 * d, static_cast<__mmask16>((1u << left) - 1), acc[r][d]);
    }
  }
}
#endif

// The segments (frames) of N rows, checked (positive row counts summing to N): their row counts, each one's
// first row, and the longest.
struct Segments {
  std::vector<int64_t> rows, starts;
  int64_t longest = 0;
};

Segments checked_segments(const std::vector<int64_t>& segments, int64_t N) {
  Segments out;
  out.rows = segments;
  int64_t rows = 0;
  for (int64_t n : segments) {
    TORCH_CHECK(n > 0, "segments: positive row counts, got ", n);
    out.starts.push_back(rows);
    rows += n;
    out.longest = std::max(out.longest, n);
  }
  TORCH_CHECK(rows == N, "segments: row counts summing to N = ", N, ", got ", rows);
  return out;
}

// out [N, heads * hd] = softmax(q k^T / sqrt(hd)) v for each head within each segment of consecutive rows, with
// q, k, v read from qkv [N, 3, heads, hd]. A thread takes (segment, head) pairs: their keys transposed into
// [hd, n] and their values into [n, hd] rows, both zero-padded to the blocks, once per pair.
void segment_attention(const float* qkv, int64_t heads, int64_t hd, const Segments& frames, float* out) {
  const int64_t stride = 3 * heads * hd;  // from one row of qkv to the next
  const int64_t hd_pad = round_up(hd, kDimBlock);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t items = static_cast<int64_t>(frames.rows.size()) * heads;
  at::parallel_for(0, items, grain_for(2 * frames.longest * frames.longest * hd), [&](int64_t begin, int64_t end) {
    std::vector<float> keys, values, scores, scaled;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / heads, h = item % heads, start = frames.starts[s], n = frames.rows[s];
      const int64_t n_pad = round_up(n, kKeyBlock);
      keys.assign(hd * n_pad, 0.0f);
      values.assign(n * hd_pad, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* k = qkv + (start + j) * stride + (heads + h) * hd;
        const float* v = qkv + (start + j) * stride + (2 * heads + h) * hd;
        for (int64_t c = 0; c < hd; ++c) keys[c * n_pad + j] = k[c];
        std::copy(v, v + hd, values.data() + j * hd_pad);
      }
#if defined(__AVX512F__)
      scores.resize(kScoreRows * n_pad);
      scaled.resize(kScoreRows * hd);
      for (int64_t i0 = 0; i0 < n; i0 += kScoreRows) {
        const int64_t R = std::min<int64_t>(kScoreRows, n - i0);
        const float* q[kScoreRows];
        float* o[kScoreRows];
        for (int64_t r = 0; r < R; ++r) {
          q[r] = qkv + (start + i0 + r) * stride + h * hd;
          o[r] = out + (start + i0 + r) * heads * hd + h * hd;
        }
        with_rows<kScoreRows>(R, [&](auto rr) {
          f32_scores<decltype(rr)::value>(q, scale, hd, keys.data(), n_pad, scaled.data(), scores.data());
        });
        for (int64_t r = 0; r < R; ++r) softmax_row(scores.data() + r * n_pad, n);  // the padding's left out
        for (int64_t r0 = 0; r0 < R; r0 += kOutputRows) {
          for (int64_t c0 = 0; c0 < hd_pad; c0 += 16 * kOutputVectors) {
            with_rows<kOutputRows>(std::min<int64_t>(kOutputRows, R - r0), [&](auto rr) {
              with_rows<kOutputVectors>(std::min<int64_t>(kOutputVectors, (hd_pad - c0) / 16), [&](auto dd) {
                f32_outputs<decltype(rr)::value, decltype(dd)::value>(scores.data() + r0 * n_pad, n_pad, n,
                                                                      values.data(), hd_pad, c0, o + r0, hd);
              });
            });
          }
        }
      }
#else
      scores.resize(n_pad);
      for (int64_t i = 0; i < n; ++i) {
        const float* q = qkv + (start + i) * stride + h * hd;
        for (int64_t j0 = 0; j0 < n_pad; j0 += kKeyBlock) {
          float acc[kKeyBlock] = {};
          for (int64_t c = 0; c < hd; ++c) {
            const float qc = q[c] * scale;
            const float* kc = keys.data() + c * n_pad + j0;
#pragma omp simd
            for (int64_t j = 0; j < kKeyBlock; ++j) acc[j] += qc * kc[j];
          }
          std::copy(acc, acc + kKeyBlock, scores.data() + j0);
        }
        softmax_row(scores.data(), n);  // the padding's scores are left out
        float* o = out + (start + i) * heads * hd + h * hd;
        for (int64_t c0 = 0; c0 < hd_pad; c0 += kDimBlock) {
          float acc[kDimBlock] = {};
          for (int64_t j = 0; j < n; ++j) {
            const float p = scores[j];
            const float* v = values.data() + j * hd_pad + c0;
#pragma omp simd
            for (int64_t c = 0; c < kDimBlock; ++c) acc[c] += p * v[c];
          }
          std::copy(acc, acc + std::min(kDimBlock, hd - c0), o + c0);
        }
      }
#endif
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
// vision_attention_bf16's blocks: keys per block of scores (two vectors), query rows per tile of scores (2 x 8
// accumulators) and per tile of outputs (4 x head_dim / 16), query rows per work item, and the widest head.
constexpr int64_t kPairKeyBlock = 32;
constexpr int kScoreTileRows = 8;
constexpr int kOutputTileRows = 4;
constexpr int64_t kQueryRowsPerItem = 128;
constexpr int kMaxDimVectors = 8;  // head_dim up to 128

// One (segment, head)'s keys and values as vdpbf16ps operands: keys [head_dim / 2][n_pad] 32-bit words (word c
// of key j: its dims 2c, 2c + 1), values [n_pad / 2][hd_pad] words (word d of key pair p: dim d of keys 2p and
// 2p + 1); the padding zero.
struct PairOperands {
  std::vector<uint32_t> keys, values;
  int64_t n_pad = 0, hd_pad = 0;

  void pack(const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t hd) {
    n_pad = round_up(n, kPairKeyBlock), hd_pad = round_up(hd, 16);
    const int64_t pairs = hd / 2;
    keys.assign(pairs * n_pad, 0u);
    values.assign(n_pad / 2 * hd_pad, 0u);
    // keys: 16 keys' words at a time, transposed in registers (simd.h)
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      for (int64_t c0 = 0; c0 < pairs; c0 += 16) {
        const __mmask16 words = static_cast<__mmask16>((1u << std::min<int64_t>(16, pairs - c0)) - 1);
        __m512 w[16];
        for (int64_t i = 0; i < 16; ++i) {
          w[i] = j0 + i < n ? _mm512_maskz_loadu_ps(words, k + (j0 + i) * stride + 2 * c0) : _mm512_setzero_ps();
        }
        transpose16(w);  // w[c]: word c0 + c of the 16 keys
        for (int64_t c = 0; c < std::min<int64_t>(16, pairs - c0); ++c) {
          _mm512_storeu_ps(reinterpret_cast<float*>(keys.data() + (c0 + c) * n_pad + j0), w[c]);
        }
      }
    }
    // values: two keys' dims interleaved, 32 dims at a time
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < n; j += 2) {
      uint32_t* to = values.data() + j / 2 * hd_pad;
      for (int64_t d = 0; d < hd; d += 32) {
        const __mmask32 dims = hd - d >= 32 ? ~0u : (1u << (hd - d)) - 1;
        const __m512i a = _mm512_maskz_loadu_epi16(dims, v + j * stride + d);
        const __m512i b = j + 1 < n ? _mm512_maskz_loadu_epi16(dims, v + (j + 1) * stride + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(to + d, _mm512_permutex2var_epi16(a, first, b));  // dims d .. d + 15
        if (hd - d > 16) _mm512_storeu_si512(to + d + 16, _mm512_permutex2var_epi16(a, second, b));
      }
    }
  }
};

// scores [R][n_pad] = q_r . k_j for R query rows (q[r]: the row's head_dim / 2 words) and every key.
template <int R>
void pair_scores(const uint32_t* const* q, int64_t pairs, const PairOperands& kv, float* scores) {
  for (int64_t j0 = 0; j0 < kv.n_pad; j0 += kPairKeyBlock) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* kc = kv.keys.data() + j0;
    for (int64_t c = 0; c < pairs; ++c, kc += kv.n_pad) {
      const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kc));
      const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kc + 16));
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[r][c])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores + r * kv.n_pad + j0, acc[r][0]);
      _mm512_storeu_ps(scores + r * kv.n_pad + j0 + 16, acc[r][1]);
    }
  }
}

// s[j] <- exp(s[j] - mx) for j < n; returns their sum. A function of its own: inside exp_pairs the compiler
// stopped inlining vexp, and the loop ran a call per score (2x the whole attention's time, measured).
float exp_minus(float* s, int64_t n, float mx) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = vexp(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

// One row of scores (n of n_pad valid) -> exp(scale s - max) rounded to bf16, as n_pad / 2 words of key pairs
// (the padding's 0); returns the fp32 sum of the unrounded exponentials.
float exp_pairs(float* s, int64_t n, int64_t n_pad, float scale, uint32_t* pairs) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 mx_v = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + j), scale_v);
    _mm512_mask_storeu_ps(s + j, valid, v);
    mx_v = _mm512_mask_max_ps(mx_v, valid, mx_v, v);
  }
  const float sum = exp_minus(s, n, _mm512_reduce_max_ps(mx_v));
  std::fill(s + n, s + n_pad, 0.0f);
  for (int64_t j = 0; j < n_pad; j += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j));
    _mm512_storeu_si512(pairs + j / 2, reinterpret_cast<const __m512i&>(b));
  }
  return sum;
}

// out[r][0, hd) = (p_r . v) / sums[r] rounded to bf16 for R rows of probabilities (ldp words apart), D vectors
// of 16 dims.
template <int R, int D>
void pair_outputs(const uint32_t* p, int64_t ldp, const PairOperands& kv, const float* sums, int64_t hd,
                  uint16_t* const* out) {
  __m512 acc[R][D];
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; ++d) acc[r][d] = _mm512_setzero_ps();
  }
  const uint32_t* vp = kv.values.data();
  for (int64_t jp = 0; jp < ldp; ++jp, vp += kv.hd_pad) {
    __m512bh v[D];
    for (int d = 0; d < D; ++d) v[d] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + 16 * d));
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(p[r * ldp + jp])));
      for (int d = 0; d < D; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], pb, v[d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
    for (int d = 0; d < D; ++d) {
      const int64_t left = std::min<int64_t>(16, hd - 16 * d);
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][d], inv));
      _mm256_mask_storeu_epi16(out[r] + 16 * d, static_cast<__mmask16>((1u << left) - 1),
                               reinterpret_cast<const __m256i&>(o));
    }
  }
}
#endif
}  // namespace

void gelu_tanh_bf16_(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bfloat16, got ",
              x.scalar_type(), x.is_contiguous() ? "" : " (not contiguous)");
  uint16_t* p = bf16_data(x);
  at::parallel_for(0, x.numel(), grain_for(16), [p](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p[i] = round_bf16(gelu_tanh(bf16_to_float(p[i])));
  });
}

void rotary_qk_bf16_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  check_contiguous(qkv, at::kBFloat16, 4, "qkv");
  const int64_t N = qkv.size(0), heads = qkv.size(2), hd = qkv.size(3);
  TORCH_CHECK(qkv.size(1) == 3 && hd % 2 == 0, "qkv: [N, 3, heads, head_dim] with head_dim even, got ",
              qkv.sizes());
  check_rotary_tables(cos, sin, N, hd);
  rotary_qk(bf16_data(qkv), cos.data_ptr<float>(), sin.data_ptr<float>(), N, heads, hd);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
at::Tensor vision_attention_bf16(const at::Tensor& qkv, const std::vector<int64_t>& segments) {
  check_contiguous(qkv, at::kBFloat16, 4, "qkv");
  const int64_t N = qkv.size(0), heads = qkv.size(2), hd = qkv.size(3);
  TORCH_CHECK(qkv.size(1) == 3 && hd % 2 == 0 && hd <= 16 * kMaxDimVectors,
              "qkv: [N, 3, heads, head_dim] with head_dim even and at most ", 16 * kMaxDimVectors, ", got ",
              qkv.sizes());
  const Segments frames = checked_segments(segments, N);
  at::Tensor out = at::empty({N, heads * hd}, qkv.options());
  // work items: (segment, head, block of kQueryRowsPerItem query rows), a (segment, head)'s blocks in a row so
  // that a thread taking several packs its keys and values once
  struct Item {
    int64_t segment, head, row0;
  };
  std::vector<Item> items;
  for (size_t s = 0; s < segments.size(); ++s) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < segments[s]; i += kQueryRowsPerItem) items.push_back({static_cast<int64_t>(s), h, i});
    }
  }
  const uint16_t* base = bf16_data(qkv);
  uint16_t* outp = bf16_data(out);
  const int64_t stride = 3 * heads * hd, pairs = hd / 2, dims = (hd + 15) / 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t work = 4 * kQueryRowsPerItem * frames.longest * hd;
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain_for(work), [&](int64_t begin, int64_t end) {
    PairOperands kv;
    int64_t packed = -1;  // the (segment, head) kv holds, as segment * heads + head
    std::vector<float> scores;
    std::vector<uint32_t> probs;
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t start = frames.starts[item.segment], n = segments[item.segment];
      if (packed != item.segment * heads + item.head) {
        kv.pack(base + start * stride + (heads + item.head) * hd, base + start * stride + (2 * heads + item.head) * hd,
                stride, n, hd);
        packed = item.segment * heads + item.head;
        scores.resize(kScoreTileRows * kv.n_pad);
        probs.resize(kScoreTileRows * kv.n_pad / 2);
      }
      const int64_t ldp = kv.n_pad / 2, last = std::min(n, item.row0 + kQueryRowsPerItem);
      for (int64_t i0 = item.row0; i0 < last; i0 += kScoreTileRows) {
        const int64_t R = std::min<int64_t>(kScoreTileRows, last - i0);
        const uint32_t* q[kScoreTileRows];
        uint16_t* o[kScoreTileRows];
        float sums[kScoreTileRows];
        for (int64_t r = 0; r < R; ++r) {
          q[r] = reinterpret_cast<const uint32_t*>(base + (start + i0 + r) * stride + item.head * hd);
          o[r] = outp + (start + i0 + r) * heads * hd + item.head * hd;
        }
        with_rows<kScoreTileRows>(R, [&](auto rr) { pair_scores<decltype(rr)::value>(q, pairs, kv, scores.data()); });
        for (int64_t r = 0; r < R; ++r) {
          sums[r] = exp_pairs(scores.data() + r * kv.n_pad, n, kv.n_pad, scale, probs.data() + r * ldp);
        }
        for (int64_t r0 = 0; r0 < R; r0 += kOutputTileRows) {
          with_rows<kOutputTileRows>(std::min<int64_t>(kOutputTileRows, R - r0), [&](auto rr) {
            with_rows<kMaxDimVectors>(dims, [&](auto dd) {
              pair_outputs<decltype(rr)::value, decltype(dd)::value>(probs.data() + r0 * ldp, ldp, kv, sums + r0, hd,
                                                                     o + r0);
            });
          });
        }
      }
    }
  });
  return out;
}
#endif

at::Tensor add_layer_norm_bf16(const at::Tensor& x, const std::optional<at::Tensor>& y, const at::Tensor& weight,
                               const at::Tensor& bias, double eps) {
  check_contiguous(x, at::kFloat, 2, "x");
  const int64_t T = x.size(0), n = x.size(1);
  if (y) {
    check_contiguous(*y, at::kBFloat16, 2, "y");
    TORCH_CHECK(y->sizes() == x.sizes(), "y: the shape of x ", x.sizes(), ", got ", y->sizes());
  }
  check_contiguous(weight, at::kFloat, 1, "weight");
  check_contiguous(bias, at::kFloat, 1, "bias");
  TORCH_CHECK(weight.size(0) == n && bias.size(0) == n, "weight, bias: [n] for x [T, n] = ", x.sizes(),
              ", got weight ", weight.sizes(), ", bias ", bias.sizes());
  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kBFloat16));
  float* xp = x.data_ptr<float>();
  const uint16_t* yp = y ? bf16_data(*y) : nullptr;
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  uint16_t* op = bf16_data(out);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, T, grain_for(4 * n), [&](int64_t t0, int64_t t1) {
    add_layer_norm_rows(xp, yp, w, b, epsf, n, t0, t1, op);
  });
  return out;
}

VisionActivation vision_activation_named(const std::string& name) {
  if (name == "gelu_pytorch_tanh") return VisionActivation::kGeluTanh;
  if (name == "gelu") return VisionActivation::kGelu;
  if (name == "silu") return VisionActivation::kSilu;
  if (name == "quick_gelu") return VisionActivation::kQuickGelu;
  TORCH_CHECK(false, "vision activation '", name, "' is not known (gelu_pytorch_tanh, gelu, silu, quick_gelu)");
}

void vision_block_f32(const at::Tensor& x, const VisionBlockWeights& w, const at::Tensor& cos,
                      const at::Tensor& sin, const std::vector<int64_t>& segments) {
  check_contiguous(x, at::kFloat, 2, "x");
  const int64_t N = x.size(0), hidden = x.size(1), heads = w.heads;
  TORCH_CHECK(heads > 0 && hidden % heads == 0 && (hidden / heads) % 2 == 0, "heads: a divisor of hidden ", hidden,
              " leaving an even head_dim, got ", heads);
  const int64_t hd = hidden / heads;
  TORCH_CHECK(w.qkv.linear.N == 3 * hidden && w.proj.linear.N == hidden && w.fc2.linear.N == hidden,
              "qkv, proj, fc2: ", 3 * hidden, ", ", hidden, ", ", hidden, " outputs for hidden ", hidden, ", got ",
              w.qkv.linear.N, ", ", w.proj.linear.N, ", ", w.fc2.linear.N);
  TORCH_CHECK(w.norm1.weight.size(0) == hidden && w.norm2.weight.size(0) == hidden, "norm1, norm2: [", hidden,
              "] for hidden ", hidden);
  check_rotary_tables(cos, sin, N, hd);
  const Segments frames = checked_segments(segments, N);

  at::Tensor qkv = project(w.qkv, add_layer_norm_f32(x, nullptr, w.norm1));  // [N, 3 * hidden]
  float* qkv_p = qkv.data_ptr<float>();
  rotary_qk(qkv_p, cos.data_ptr<float>(), sin.data_ptr<float>(), N, heads, hd);
  at::Tensor attended;
  if (w.bf16_attention) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    attended = vision_attention_bf16(qkv.to(at::kBFloat16).view({N, 3, heads, hd}), segments).to(at::kFloat);
#else
    TORCH_CHECK(false, "bf16_attention: this build does not multiply bf16 pairs (no AVX512-BF16)");
#endif
  } else {
    attended = at::empty({N, hidden}, x.options());
    segment_attention(qkv_p, heads, hd, frames, attended.data_ptr<float>());
  }
  const at::Tensor out = project(w.proj, attended);
  at::Tensor hidden_act = project(w.fc1, add_layer_norm_f32(x, out.data_ptr<float>(), w.norm2), &w.act);
  x.add_(project(w.fc2, hidden_act));
}

at::Tensor vision_merger_f32(const at::Tensor& x, const VisionNorm& norm, int64_t merged, const VisionProjection& fc1,
                             const VisionProjection& fc2) {
  check_contiguous(x, at::kFloat, 2, "x");
  TORCH_CHECK(norm.weight.size(0) == x.size(1) && merged > 0 && merged % x.size(1) == 0 &&
                  x.numel() % merged == 0,
              "x [N, n] with n the norm's width (", norm.weight.size(0), ") and N * n a multiple of merged (", merged,
              "), got ", x.sizes());
  const VisionActivation gelu = VisionActivation::kGelu;
  return project(fc2, project(fc1, add_layer_norm_f32(x, nullptr, norm).view({-1, merged}), &gelu));
}

}  // namespace deltaserve
