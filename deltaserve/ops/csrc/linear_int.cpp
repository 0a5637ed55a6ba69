#include "linear_int.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>

#include "isa.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Row x[0, K) quantized per group (activation_quant.py's quantize_activations): q [K] and scales [groups].
// scale = amax / 127 and q = x / scale rounded to nearest even (the two fp32 operations torch does, so the
// bytes are the reference's); an all-zero group has scale 0 and q 0; a group with a NaN or infinity has q 0
// and scale NaN, so that its outputs are NaN, as they are without activation quantization.
void quantize_row(const float* x, int64_t K, int64_t group, int8_t* q, float* scales) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // 16 columns a step (masked at a group's end): the same fp32 division and round-to-nearest-even per value,
  // so the same bytes (a prompt chunk's quantization was a third of the AMX kernel's time at down_proj's K)
  const __m512 sign = _mm512_set1_ps(-0.0f), zero = _mm512_setzero_ps();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    __m512 amax = zero;
    __mmask16 finite = 0xFFFF;
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = k1 - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k1 - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
      finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_EQ_OQ);  // x - x is NaN for NaN and inf
    }
    const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
    const bool ok = finite == 0xFFFF && std::isfinite(scale);
    scales[g] = ok ? scale : NAN;
    const __m512 divisor = _mm512_set1_ps(scale);
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 m = k1 - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k1 - k)) - 1);
      __m512 v = zero;
      if (ok && scale > 0.0f) {
        v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), divisor),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), v));
      }
      _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
#else
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = k0; k < k1; ++k) {
      amax = std::max(amax, std::fabs(x[k]));
      finite = finite && std::isfinite(x[k]);
    }
    const float scale = amax / 127.0f;
    finite = finite && std::isfinite(scale);
    scales[g] = finite ? scale : NAN;
    for (int64_t k = k0; k < k1; ++k) {
      const float v = finite && scale > 0.0f ? std::nearbyint(x[k] / scale) : 0.0f;
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
#endif
}

#if defined(DELTASERVE_AVX2)
constexpr bool kAvx2 = true;
#else
constexpr bool kAvx2 = false;
#endif

// Whether the AVX2 integer kernel (int_block_avx2) takes parts of this format, group and K (in AVX2 builds the
// register tiles take the others, at any number of rows).
inline bool avx2_int_kernel_takes(Format f, int64_t group, int64_t K) {
  if (f == Format::kInt8) return group % 32 == 0 && K % 32 == 0;
  return (group == 32 || group % 64 == 0) && K % 64 == 0;
}

// bias [T, groups] = -8 x each group's sum of q_x, for the AVX2 kernels' int4 weights (stored as q_w + 8), of
// T rows of q's q_x ld apart (before any reordering of their columns).
void int4_group_biases(QuantizedRows& q, int64_t T, int64_t ld) {
  q.bias.assign(T * q.groups, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* row = reinterpret_cast<const int8_t*>(q.bytes.data()) + t * ld;
    for (int64_t k = 0; k < q.K; ++k) q.bias[t * q.groups + k / q.group] -= 8 * row[k];
  }
}

// T plain int4 rows of q put in the AVX2 layout (QuantizedRows::avx2): each group's bias, and each 64 columns'
// even ones, then their odd ones.
void split_int4_rows(QuantizedRows& q, int64_t T) {
  int4_group_biases(q, T, q.K);
  int8_t step[64];
  for (int64_t t = 0; t < T; ++t) {
    int8_t* row = reinterpret_cast<int8_t*>(q.bytes.data()) + t * q.K;
    for (int64_t k0 = 0; k0 < q.K; k0 += 64) {
      for (int i = 0; i < 64; ++i) step[(i % 2) * 32 + i / 2] = row[k0 + i];
      std::memcpy(row + k0, step, sizeof(step));
    }
  }
}

// The column of lane l's first value in chunk c (int8: 4 consecutive columns; int4: 8 consecutive ones, the
// even ones in the chunk's first 64 bytes and the odd ones in its next 64).
int64_t lane_column(Format f, int64_t c, int64_t l) {
  return chunk_columns(f) * c + (f == Format::kInt8 ? 4 : 8) * l;
}

// Where column i (< chunk_columns) of a chunk goes in the chunk's bytes of x (one per column).
int64_t lane_byte(Format f, int64_t i) { return f == Format::kInt8 ? i : (i % 2) * 64 + i / 2; }

// x's T rows quantized into q (its buffers reused: a scratch kept between calls allocates nothing once grown).
void quantize_for(const float* x, int64_t T, int64_t K, Format f, int64_t group, QuantizedRows& q) {
  // the lanes' groups (lane_group, span) depend on the format, group and K only: kept from the last call when
  // those are the same (a decode step quantizes a row for every projection; the other layouts clear them)
  const bool same_lanes = !q.lane_group.empty() && q.format == f && q.group == group && q.K == K;
  q.format = f, q.group = group, q.K = K, q.groups = (K + group - 1) / group;
  q.lanes = kVnni && group % 8 == 0;
  q.avx2 = kAvx2 && avx2_int_kernel_takes(f, group, K);
  q.tiles = false, q.plus128 = false, q.ld = 0;
  const int64_t cols = chunk_columns(f);
  q.chunks = (K + cols - 1) / cols;
  q.values.clear(), q.bias.clear();
  if (!same_lanes) q.lane_group.clear();
  const int64_t C = q.chunks, G = q.groups;
  if (!q.lanes) {
    q.bytes.resize(T * K), q.scales.resize(T * G);
    for (int64_t t = 0; t < T; ++t) {
      quantize_row(x + t * K, K, group, reinterpret_cast<int8_t*>(q.bytes.data()) + t * K, q.scales.data() + t * G);
    }
    if (q.avx2 && f == Format::kInt4) split_int4_rows(q, T);
    return;
  }
  thread_local std::vector<int8_t> row;
  row.resize(K);
  if (!same_lanes) {
    q.lane_group.resize(C * 16), q.span = 1;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t l = 0; l < 16; ++l) {  // (a lane past K: the last group, whose scale is there to read)
        q.lane_group[c * 16 + l] = std::min(lane_column(f, c, l) / group, G - 1) - cols * c / group;
        q.span = std::max<int64_t>(q.span, q.lane_group[c * 16 + l] + 1);
      }
    }
  }
  q.bytes.assign(T * C * cols, 0);  // columns past K: q_x = 0
  q.scales.resize(T * G);
  q.bias.assign(T * C * 16, 0);
  for (int64_t t = 0; t < T; ++t) {
    quantize_row(x + t * K, K, group, row.data(), q.scales.data() + t * G);
    uint8_t* bytes = q.bytes.data() + t * C * cols;
    // each chunk's columns to their lane_byte places (no division per column: a decode step quantizes a row for
    // every projection, and the per-column divisions were most of that)
    for (int64_t c = 0; c < C; ++c) {
      const int8_t* from = row.data() + c * cols;
      uint8_t* to = bytes + c * cols;
      const int64_t n = std::min(cols, K - c * cols);
      for (int64_t i = 0; i < n; ++i) to[lane_byte(f, i)] = static_cast<uint8_t>(from[i]);
    }
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t at = (t * C + c) * 16 + l;
        int32_t sum = 0;  // the lane's columns (int8: 4; int4: 8, 4 even ones, then 4 odd ones)
        for (int m = 0; m < 4; ++m) {
          const uint8_t* lane = bytes + c * cols + 4 * l + m;
          sum += static_cast<int8_t>(lane[0]) + (f == Format::kInt4 ? static_cast<int8_t>(lane[64]) : 0);
        }
        q.bias[at] = (f == Format::kInt4 ? -8 : -128) * sum;
      }
    }
  }
}

const uint16_t* scales_of(const WeightPart& p) { return static_cast<const uint16_t*>(p.scales); }

// The plain path (any group; builds without AVX512-VNNI): outputs j < count of part p from local row row0, for
// rows t < T of q from t0, group by group: y = sum over groups of float(int32 dot) x (scale_x x scale_w).
void plain_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
                float* y, int64_t ldy) {
  const int64_t K = p.K, G = p.groups;
  std::vector<int8_t> w(K);
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* r = p.bytes + (row0 + j) * p.row_bytes;
    for (int64_t k = 0; k < K; ++k) {
      const int nibble = ((r[k / 2] >> (4 * (k % 2))) & 0x0F) - 8;
      w[k] = p.format == Format::kInt8 ? static_cast<int8_t>(r[k]) : static_cast<int8_t>(nibble);
    }
    const uint16_t* sw = scales_of(p) + (row0 + j) * G;
    for (int64_t t = 0; t < T; ++t) {
      const int8_t* x = reinterpret_cast<const int8_t*>(q.bytes.data()) + (t0 + t) * K;
      const float* sx = q.scales.data() + (t0 + t) * G;
      float sum = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * p.group; k < std::min(K, (g + 1) * p.group); ++k) dot += int32_t(x[k]) * w[k];
        sum += static_cast<float>(dot) * (sx[g] * bf16_to_float(sw[g]));
      }
      y[t * ldy + j] = sum;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One output's chunk as vpdpbusd reads it: the weight bytes (int8: s8 q_w of 64 columns; int4: u8 q_w + 8 of
// 128 columns, the low nibbles (even columns) in w and the high ones (odd columns) in w2), the int8 accumulator
// start (-128 x each lane's sum of q_w) and each lane's group's scale s_w (`rel`: each lane's group's place in
// `window`, the output's widened scales from a group on).
template <Format F>
struct OutputChunk {
  __m512i w, w2;
  __m512 scale;
};

template <Format F>
inline OutputChunk<F> output_chunk(const uint8_t* row, int64_t k0, int64_t K, int64_t row_bytes, __m512 window,
                                   __m512i rel) {
  OutputChunk<F> o;
  if constexpr (F == Format::kInt8) {
    const int64_t n = K - k0;  // columns of this chunk (past K: zero weights)
    const __m512i w = n >= 64 ? _mm512_loadu_si512(row + k0) : _mm512_maskz_loadu_epi8((1ull << n) - 1, row + k0);
    o.w = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // q_w + 128, as u8
  } else {
    const int64_t n = row_bytes - k0 / 2;  // bytes of this chunk (past the row: zero weights, zero x)
    const __m512i b = n >= 64 ? _mm512_loadu_si512(row + k0 / 2)
                              : _mm512_maskz_loadu_epi8((1ull << n) - 1, row + k0 / 2);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    o.w = _mm512_and_si512(b, nibble);
    o.w2 = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
  }
  o.scale = _mm512_permutexvar_ps(rel, window);
  return o;
}

// 16 scales of a row from group g on (those there are, `have`), widened from bf16.
inline __m512 scale_window(const uint16_t* scales, int64_t g, __mmask16 have) {
  const __m512i s = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(have, scales + g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
}

// acc += the chunk's lanes of one row (x bytes xv, int4's odd columns xv2, lane bias) times one output, each
// lane's int32 dot times its scale_x x scale_w (lane_scales).
template <Format F>
inline __m512 add_product(__m512 acc, const OutputChunk<F>& o, __m512i xv, __m512i xv2, __m512 lane_scales,
                          __m512i bias) {
  __m512i d;
  if constexpr (F == Format::kInt8) {
    d = _mm512_dpbusd_epi32(bias, o.w, xv);  // (q_w + 128) q_x - 128 q_x
  } else {
    d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(bias, o.w, xv), o.w2, xv2);  // (q_w + 8) q_x - 8 q_x
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), lane_scales, acc);
}

// R rows of q (from t0) times NO weight rows of part p, step rows apart from local row row0 (y's outputs
// likewise; step > 1: int_streams, which leaves the prefetching to the hardware), a chunk (64 weight bytes) a
// step: each weight byte is loaded once for all R rows (the VNNI layout, top of linear_int.h).
template <Format F, int NO, int R>
void int_block(const WeightPart& p, int64_t row0, const QuantizedRows& q, int64_t t0, float* y, int64_t ldy,
               int64_t step = 1) {
  const int64_t C = q.chunks, K = p.K;
  const uint8_t* rows[NO];
  const uint16_t* srows[NO];
  for (int j = 0; j < NO; ++j) {
    rows[j] = p.bytes + (row0 + j * step) * p.row_bytes;
    srows[j] = scales_of(p) + (row0 + j * step) * p.groups;
  }
  __m512 acc[R][NO];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  // Each output's scales of 16 groups from group gw on, widened once and reused by the chunks they cover (a
  // chunk's lanes span q.span groups, at most 16): a third fewer instructions per chunk than widening its own
  // scales.
  __m512 window[NO];
  __m512 x_window[R];  // each row's scale_x of the same 16 groups
  int64_t gw = -16;
  // While a block streams its NO weight rows, the next block is prefetched at the same pace
  // (prefetch_next_block: one stream for a small block, else each row's line into L2; for long rows, int8,
  // N = 1024, K = 3584, one row, the lines gave 13 -> 16 GB/s on an AMD EPYC). A chunk's weights are one
  // 64-byte line of each row.
  const int64_t cols = chunk_columns(F);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t k0 = cols * c, g0 = k0 / p.group;
    if (step == 1) prefetch_next_block(rows[0], NO, p.row_bytes, 64 * c);
    if (g0 - gw > 16 - q.span) {
      gw = g0;
      const __mmask16 have = p.groups - gw >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.groups - gw)) - 1);
      for (int j = 0; j < NO; ++j) window[j] = scale_window(srows[j], gw, have);
      for (int r = 0; r < R; ++r) {
        x_window[r] = _mm512_maskz_loadu_ps(have, q.scales.data() + (t0 + r) * p.groups + gw);
      }
      if constexpr (R == 1) {  // one row: its scale_x of those groups multiplied in once, not per chunk
        for (int j = 0; j < NO; ++j) window[j] = _mm512_mul_ps(x_window[0], window[j]);
      }
    }
    const __m512i rel = _mm512_add_epi32(_mm512_loadu_si512(q.lane_group.data() + 16 * c),
                                         _mm512_set1_epi32(static_cast<int>(g0 - gw)));
    // row r's chunk: its bytes (int4: the even columns', then the odd ones') and lane bias
    auto row_chunk = [&](int r, __m512i& xv, __m512i& xv2, __m512i& bias) {
      const int64_t at = (t0 + r) * C + c;
      xv = _mm512_loadu_si512(q.bytes.data() + at * cols);
      xv2 = F == Format::kInt4 ? _mm512_loadu_si512(q.bytes.data() + at * cols + 64) : _mm512_setzero_si512();
      bias = _mm512_loadu_si512(q.bias.data() + at * 16);
    };
    __m512i xv, xv2, bias;
    if constexpr (R == 1) {  // one output at a time: its registers die at once (8 outputs' would spill)
      row_chunk(0, xv, xv2, bias);
      for (int j = 0; j < NO; ++j) {
        const OutputChunk<F> o = output_chunk<F>(rows[j], k0, K, p.row_bytes, window[j], rel);
        acc[0][j] = add_product<F>(acc[0][j], o, xv, xv2, o.scale, bias);
      }
    } else {  // the outputs' chunks once, for every row
      OutputChunk<F> o[NO];
      for (int j = 0; j < NO; ++j) o[j] = output_chunk<F>(rows[j], k0, K, p.row_bytes, window[j], rel);
      for (int r = 0; r < R; ++r) {
        row_chunk(r, xv, xv2, bias);
        const __m512 sx = _mm512_permutexvar_ps(rel, x_window[r]);  // each lane's scale_x
        for (int j = 0; j < NO; ++j) {
          acc[r][j] = add_product<F>(acc[r][j], o[j], xv, xv2, _mm512_mul_ps(sx, o[j].scale), bias);
        }
      }
    }
  }
  // (store_sums4, under store_sums: short rows, an expert's 256 inputs, spend a fifth on the sums)
  for (int r = 0; r < R; ++r) store_sums<NO>(acc[r], y + r * ldy, step);
}

// Outputs [row0, row0 + count) of part p for one row of q (t0), its weight rows read as kStreams runs at once
// (dot_streams, linear.cpp, says why).
template <Format F>
void int_streams(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, float* y) {
  for_streams(count, [&](auto NO, int64_t j, int64_t step) {
    int_block<F, decltype(NO)::value, 1>(p, row0 + j, q, t0, y + j, 0, step);
  });
}

// Outputs [row0, row0 + count) of part p for rows t < T of q from t0: one row 8 outputs at a time, or 4 where
// 8 weight rows would pass kSequentialPrefetchBytes and 4 do not, so that a block is one prefetch stream (int8
// rows of 1 KB: 1.14-1.15x, int4 ones 1.15x, an AMD EPYC Zen 4, weights streamed from memory; 2 rows of 2 KB
// or one of 3.5 KB a block gained nothing); two rows 4; more, 2 outputs x 4 rows at a time, so that the
// outputs' weights stay in L1 while the row tiles pass (4 x 4 spilled registers; 2 x 4 measured 1.5x its
// throughput per row at 4 to 16 rows, and 4 x 2 1.3x 2 x 2 at two).
template <Format F>
void int_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
              float* y, int64_t ldy) {
  int64_t j = 0;
  if (T == 1 && reads_as_streams(count * p.row_bytes)) return int_streams<F>(p, row0, count, q, t0, y);
  if (T == 1) {
    if (8 * p.row_bytes > kSequentialPrefetchBytes && 4 * p.row_bytes <= kSequentialPrefetchBytes) {
      for (; j + 4 <= count; j += 4) int_block<F, 4, 1>(p, row0 + j, q, t0, y + j, ldy);
    }
    for (; j + 8 <= count; j += 8) int_block<F, 8, 1>(p, row0 + j, q, t0, y + j, ldy);
  }
  if (T == 2) {
    for (; j + 4 <= count; j += 4) int_block<F, 4, 2>(p, row0 + j, q, t0, y + j, ldy);
  }
  for (; j + 2 <= count; j += 2) {
    for (int64_t t = 0; t < T; t += 4) {
      with_rows<4>(std::min<int64_t>(4, T - t), [&](auto R) {
        int_block<F, 2, decltype(R)::value>(p, row0 + j, q, t0 + t, y + t * ldy + j, ldy);
      });
    }
  }
  for (; j < count; ++j) {
    for (int64_t t = 0; t < T; t += 4) {
      with_rows<4>(std::min<int64_t>(4, T - t), [&](auto R) {
        int_block<F, 1, decltype(R)::value>(p, row0 + j, q, t0 + t, y + t * ldy + j, ldy);
      });
    }
  }
}
#endif

#if defined(DELTASERVE_AVX2)
// The AVX2 kernel (no VNNI), over the AVX2 layout (QuantizedRows::avx2), each step's products summed by
// vpmaddubsw (u8 x s8, two products per int16) and vpmaddwd by ones into 8 int32 lanes:
//   - int8 weights, 32 columns a step: |q_w| (u8) times q_x carrying q_w's sign (vpsignb); a pair of products
//     is at most 2 x 127 x 127, so the int16 never saturates (q_x and q_w lie in [-127, 127]).
//   - int4 weights, 64 columns a step (32 weight bytes): the stored nibbles q_w + 8 (u8: the low nibbles, the
//     even columns, and the high ones, the odd columns, as x is laid out) times q_x, the two products' int16
//     sums added (at most 4 x 15 x 127); the group's -8 x sum(q_x) (bias) is added once. A step's first 32
//     columns land in the low 128 bits, its last 32 in the high ones: groups of 32 are the two halves.
// A group's lanes add up in int32, and its 8 lanes into the group's exact dot; each (row, output)'s dot is
// converted to fp32 and added times s_x x s_w (one fma, groups in order), as the AVX2 register tiles do for more
// rows (linear_avx2_tiles.cpp): a row's outputs are the same bits whatever the number of rows in the call, so
// that a speculative verify step scores its rows as a one-row decode step would.

// Columns of x per step.
template <Format F>
constexpr int64_t kAvx2Step = F == Format::kInt8 ? 32 : 64;

// One step's products summed into 8 int32 lanes, exactly: int8, 32 weights (s8) by 32 q_x, 4 columns a lane;
// int4, 32 bytes of nibbles (64 columns: the low nibbles the even ones, the high the odd) by x's even columns xe
// and odd ones xo, 8 columns a lane.
inline __m256i int8_step_dots(__m256i w, __m256i xv) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

inline __m256i int4_step_dots(__m256i w, __m256i xe, __m256i xo) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i even = _mm256_and_si256(w, nibble), odd = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(even, xe), _mm256_maddubs_epi16(odd, xo)),
                           _mm256_set1_epi16(1));
}

// The 8 int32 lanes of each of v[0..3] summed within each 128-bit half: {sum(v[0]), .., sum(v[3])} of the low
// halves in the low half of the result, of the high halves in the high half (exact).
inline __m256i half_totals4(const __m256i v[4]) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

// R rows of q (from t0) times NO consecutive weight rows of part p (from local row row0): each step's weights
// loaded once for all R rows. R x NO is at most 4: the (row, output) pairs share one vector of sums, pair
// r x NO + j in lane r x NO + j.
template <Format F, int NO, int R>
void int_block_avx2(const WeightPart& p, int64_t row0, const QuantizedRows& q, int64_t t0, float* y, int64_t ldy) {
  static_assert(R * NO <= 4, "one vector of 4 sums");
  const int64_t K = p.K, G = p.groups, group = p.group;
  const uint8_t* rows[NO];
  const uint16_t* srows[NO];
  for (int j = 0; j < NO; ++j) {
    rows[j] = p.bytes + (row0 + j) * p.row_bytes;
    srows[j] = scales_of(p) + (row0 + j) * G;
  }
  const int8_t* xr[R];
  const float* sx[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = reinterpret_cast<const int8_t*>(q.bytes.data()) + (t0 + r) * K;
    sx[r] = q.scales.data() + (t0 + r) * G;
  }
  __m128 acc = _mm_setzero_ps();
  // group g's exact dots of the 4 pairs (0 past R x NO) into acc
  const auto add_group = [&](int64_t g, __m128i total) {
    float xs[4] = {}, ws[4] = {};
    int32_t bias[4] = {};
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NO; ++j) {
        xs[r * NO + j] = sx[r][g], ws[r * NO + j] = bf16_to_float(srows[j][g]);
        if constexpr (F == Format::kInt4) bias[r * NO + j] = q.bias[(t0 + r) * G + g];
      }
    }
    // (built in registers: four scalar stores read back as one vector would stall store forwarding)
    if constexpr (F == Format::kInt4) total = _mm_add_epi32(total, _mm_setr_epi32(bias[0], bias[1], bias[2], bias[3]));
    const __m128 scale = _mm_mul_ps(_mm_setr_ps(xs[0], xs[1], xs[2], xs[3]), _mm_setr_ps(ws[0], ws[1], ws[2], ws[3]));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(total), scale, acc);
  };
  __m256i dots[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                     _mm256_setzero_si256()};
  int64_t g = 0, group_end = group;  // the group k0 is in, and its end (counted: a division per step was costly)
  for (int64_t k0 = 0; k0 < K; k0 += kAvx2Step<F>) {
    const int64_t at = k0 / kAvx2Step<F> * 32;  // (a step reads 32 bytes of each weight row)
    if ((at & 63) == 0) prefetch_next_block(rows[0], NO, p.row_bytes, at);
    for (int j = 0; j < NO; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + at));
      for (int r = 0; r < R; ++r) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + k0));
        __m256i step;
        if constexpr (F == Format::kInt8) {
          step = int8_step_dots(w, x0);
        } else {
          step = int4_step_dots(w, x0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + k0 + 32)));
        }
        dots[r * NO + j] = _mm256_add_epi32(dots[r * NO + j], step);
      }
    }
    const int64_t k1 = k0 + kAvx2Step<F>;
    if (F == Format::kInt4 && group == 32) {  // the two halves are groups g and g + 1
      const __m256i h = half_totals4(dots);
      add_group(g, _mm256_castsi256_si128(h));
      add_group(g + 1, _mm256_extracti128_si256(h, 1));
      g += 2;
    } else if (k1 == group_end || k1 >= K) {  // the end of a group (the last may be short)
      const __m256i h = half_totals4(dots);
      add_group(g, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
      ++g, group_end += group;
    } else {
      continue;
    }
    for (__m256i& d : dots) d = _mm256_setzero_si256();
  }
  alignas(16) float out[4];
  _mm_store_ps(out, acc);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NO; ++j) y[r * ldy + j] = out[r * NO + j];
  }
}

// The weight scales of 4 rows for 8 groups from g (zeros past G), as 4 vectors of two groups' scales each:
// pair[i] = {rows' scales of group g + 2i | of group g + 2i + 1} (bf16 widened to fp32: bits << 16).
inline void scale_pairs(const uint16_t* const srows[4], int64_t g, int64_t G, __m256 pair[4]) {
  __m128i s[4];
  for (int j = 0; j < 4; ++j) {
    if (g + 8 <= G) {
      s[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srows[j] + g));
    } else {
      alignas(16) uint16_t last[8] = {};
      std::memcpy(last, srows[j] + g, (G - g) * sizeof(uint16_t));
      s[j] = _mm_load_si128(reinterpret_cast<const __m128i*>(last));
    }
  }
  // a 4 x 8 transpose of 16-bit scales: row-pairs interleaved by 16 bits, then those by 32
  const __m128i lo01 = _mm_unpacklo_epi16(s[0], s[1]), lo23 = _mm_unpacklo_epi16(s[2], s[3]);
  const __m128i hi01 = _mm_unpackhi_epi16(s[0], s[1]), hi23 = _mm_unpackhi_epi16(s[2], s[3]);
  const __m128i by_group[4] = {_mm_unpacklo_epi32(lo01, lo23), _mm_unpackhi_epi32(lo01, lo23),
                               _mm_unpacklo_epi32(hi01, hi23), _mm_unpackhi_epi32(hi01, hi23)};
  for (int i = 0; i < 4; ++i) {
    pair[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(by_group[i]), 16));
  }
}

// int_block_avx2<F, 4, 1> for groups of 32 (the decode step's usual shape), the same sums and the same bits, with
// less work per group: two groups' totals of the 4 outputs come out of the reduction in one vector
// ({group g: outputs 0..3 | group g + 1: outputs 0..3}), and so do their scales, 8 groups' bf16 scales widened
// and transposed at a time (scale_pairs), where int_block_avx2 gathers 4 scalars per group. Each group is still
// added by its own fma, in order.
template <Format F>
void int_decode_avx2_g32(const WeightPart& p, int64_t row0, const QuantizedRows& q, int64_t t0, float* y) {
  const int64_t K = p.K, G = p.groups;
  const uint8_t* rows[4];
  const uint16_t* srows[4];
  for (int j = 0; j < 4; ++j) {
    rows[j] = p.bytes + (row0 + j) * p.row_bytes;
    srows[j] = scales_of(p) + (row0 + j) * G;
  }
  const int8_t* xr = reinterpret_cast<const int8_t*>(q.bytes.data()) + t0 * K;
  const float* sx = q.scales.data() + t0 * G;
  const int32_t* bias = F == Format::kInt4 ? q.bias.data() + t0 * G : nullptr;
  __m128 acc = _mm_setzero_ps();
  __m256 pairs[4];
  // groups g and g + 1 (totals t as above; `both` false: g alone, the last of an odd G)
  const auto add_pair = [&](int64_t g, __m256i t, bool both) {
    const __m256 sw = pairs[g % 8 / 2];
    if constexpr (F == Format::kInt4) {
      t = _mm256_add_epi32(t, _mm256_set_m128i(_mm_set1_epi32(both ? bias[g + 1] : 0), _mm_set1_epi32(bias[g])));
    }
    const __m256 sxg = _mm256_set_m128(_mm_set1_ps(both ? sx[g + 1] : 0.0f), _mm_set1_ps(sx[g]));
    const __m256 scale = _mm256_mul_ps(sxg, sw), total = _mm256_cvtepi32_ps(t);
    acc = _mm_fmadd_ps(_mm256_castps256_ps128(total), _mm256_castps256_ps128(scale), acc);
    if (both) acc = _mm_fmadd_ps(_mm256_extractf128_ps(total, 1), _mm256_extractf128_ps(scale, 1), acc);
  };
  // the 4 outputs' dots of the 32 columns at k0 (32 bytes of each row at byte `at`), 8 int32 lanes each
  const auto dots32 = [&](int64_t k0, int64_t at, __m256i d[4]) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k0));
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + at));
      d[j] = int8_step_dots(w, xv);
    }
  };
  // both kinds read 64 columns, two groups, a step: int8 64 bytes of each row, int4 32
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += 64, g += 2) {
    const int64_t at = F == Format::kInt8 ? k0 : k0 / 2;
    if (g % 8 == 0) scale_pairs(srows, g, G, pairs);
    if (F == Format::kInt8 || (at & 63) == 0) prefetch_next_block(rows[0], 4, p.row_bytes, at);
    __m256i d[4];
    if constexpr (F == Format::kInt8) {
      dots32(k0, at, d);
      if (k0 + 32 == K) {  // an odd G's last group
        const __m256i h = half_totals4(d);
        add_pair(g, _mm256_castsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))),
                 false);
        break;
      }
      __m256i e[4];
      dots32(k0 + 32, at + 32, e);
      // {g's sums of the low halves | g + 1's of the low halves} + {the same of the high halves}
      const __m256i hg = half_totals4(d), hn = half_totals4(e);
      add_pair(g, _mm256_add_epi32(_mm256_permute2x128_si256(hg, hn, 0x20), _mm256_permute2x128_si256(hg, hn, 0x31)),
               true);
    } else {  // each 32 bytes: the even columns' nibbles (low) and the odd ones' (high), x laid out to match
      const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k0));
      const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k0 + 32));
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + at));
        d[j] = int4_step_dots(w, xe, xo);
      }
      add_pair(g, half_totals4(d), true);  // the low halves are group g's 32 columns, the high ones g + 1's
    }
  }
  _mm_storeu_ps(y, acc);
}

// Outputs [row0, row0 + count) of part p for rows t < T of q from t0: one row 4 outputs at a time, two rows 2,
// more one output for up to 4 rows (R x NO int32 and fp32 accumulators within 16 registers).
template <Format F>
void int_part_avx2(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
                   float* y, int64_t ldy) {
  int64_t j = 0;
  if (T == 1 && p.group == 32) {
    for (; j + 4 <= count; j += 4) int_decode_avx2_g32<F>(p, row0 + j, q, t0, y + j);
  }
  if (T == 1) {
    for (; j + 4 <= count; j += 4) int_block_avx2<F, 4, 1>(p, row0 + j, q, t0, y + j, ldy);
  }
  if (T == 2) {
    for (; j + 2 <= count; j += 2) int_block_avx2<F, 2, 2>(p, row0 + j, q, t0, y + j, ldy);
  }
  for (; j < count; ++j) {
    for (int64_t t = 0; t < T; t += 4) {
      with_rows<4>(std::min<int64_t>(4, T - t), [&](auto R) {
        int_block_avx2<F, 1, decltype(R)::value>(p, row0 + j, q, t0 + t, y + t * ldy + j, ldy);
      });
    }
  }
}
#endif

const QuantizedRows& layout_for(const ActivationRows& a, const WeightPart& p) {
  for (const QuantizedRows& q : a.layouts) {
    if (q.format == p.format && q.group == p.group) return q;
  }
  TORCH_CHECK(false, "int8 activations: no quantized rows for a ", format_name(p.format), " part of group ", p.group);
}

}  // namespace

// x~ = q_x * s_x of every row (values), each group's q_x and s_x those quantize_row gives.
void dequantized_for(const float* x, int64_t T, int64_t K, Format f, int64_t group, QuantizedRows& q) {
  q.format = f, q.group = group, q.K = K, q.groups = (K + group - 1) / group;
  q.lanes = false, q.avx2 = false, q.tiles = false, q.plus128 = false, q.chunks = 0, q.ld = 0;
  q.bytes.clear(), q.scales.clear(), q.bias.clear(), q.lane_group.clear();
  q.values.resize(T * K);
  thread_local std::vector<int8_t> row;
  thread_local std::vector<float> scales;
  row.resize(K), scales.resize(q.groups);
  for (int64_t t = 0; t < T; ++t) {
    quantize_row(x + t * K, K, group, row.data(), scales.data());
    float* v = q.values.data() + t * K;
    for (int64_t k = 0; k < K; ++k) v[k] = static_cast<float>(row[k]) * scales[k / group];
  }
}

// bytes[0, n) + 128 (two's complement to unsigned). A function of its own: in a loop over a closure's (or a
// struct's) n, each byte store might alias n, so the compiler reloaded it per byte and did not vectorize.
namespace {
void flip_sign_bits(uint8_t* bytes, int64_t n) {
  for (int64_t k = 0; k < n; ++k) bytes[k] ^= 0x80;
}
}  // namespace

// The tile layout (AMX, VNNI tiles; linear_int.h QuantizedRows): each row's q_x at stride ld = groups x group,
// zeros past K and in the kTileSlack rows past T; plus128: every byte of the T rows + 128 (q_x = 0 past K).
// AVX2 builds' tiles read int4 rows' group biases too (linear_avx2_tiles.cpp).
void tiles_for(const float* x, int64_t T, int64_t K, Format f, int64_t group, bool plus128, QuantizedRows& q) {
  q.format = f, q.group = group, q.K = K, q.groups = (K + group - 1) / group;
  q.lanes = false, q.avx2 = false, q.tiles = true, q.plus128 = plus128, q.chunks = 0, q.ld = q.groups * group;
  q.values.clear(), q.bias.clear(), q.lane_group.clear();
  q.bytes.assign((T + kTileSlack) * q.ld, 0);
  q.scales.assign((T + kTileSlack) * q.groups, 0.0f);
  // threads split the rows (a prompt chunk's: serial, this was 4% of a 784-row vision tower's time at 2 threads,
  // and as much again of the other thread waiting)
  const int64_t ld = q.ld, groups = q.groups;
  uint8_t* bytes = q.bytes.data();
  float* scales = q.scales.data();
  at::parallel_for(0, T, grain_for(8 * K), [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* row = bytes + t * ld;
      quantize_row(x + t * K, K, group, reinterpret_cast<int8_t*>(row), scales + t * groups);
      if (plus128) flip_sign_bits(row, ld);
    }
  });
  if (kAvx2 && f == Format::kInt4) int4_group_biases(q, T, q.ld);
}

void quantize_activations_into(std::initializer_list<const Linear*> ls, const float* x, int64_t T,
                               ActivationRows& a, bool tiles) {
  size_t n = 0;  // the layouts filled so far (a's first n)
  for (const Linear* l : ls) {
    for (const WeightPart& p : l->parts) {
      if (!reads_int8_activations(*l, p)) continue;
      const auto filled = a.layouts.begin() + static_cast<std::ptrdiff_t>(n);
      const bool have = std::any_of(a.layouts.begin(), filled, [&](const QuantizedRows& q) {
        return q.format == p.format && q.group == p.group;
      });
      if (have) continue;
      if (n == a.layouts.size()) a.layouts.emplace_back();
      QuantizedRows& q = a.layouts[n++];
      if (tiles && T >= amx_min_rows() && amx_step(p.group) > 0 && amx_ready()) {
        tiles_for(x, T, l->K, p.format, p.group, false, q);
      } else if (tiles && vnni_tiles_take(T, p.group, kAvx2 && !avx2_int_kernel_takes(p.format, p.group, l->K))) {
        tiles_for(x, T, l->K, p.format, p.group, !kAvx2, q);  // (AVX2's tiles read signed bytes)
      } else if (T > kIntKernelRows) {
        dequantized_for(x, T, l->K, p.format, p.group, q);
      } else {
        quantize_for(x, T, l->K, p.format, p.group, q);
      }
    }
  }
  a.layouts.resize(n);
}

ActivationRows quantize_activations(const Linear& l, const float* x, int64_t T) {
  ActivationRows a;
  quantize_activations_into({&l}, x, T, a);
  return a;
}

void gather_rows(const ActivationRows& from, const int64_t* rows, int64_t n, ActivationRows& to) {
  to.layouts.resize(from.layouts.size());
  for (size_t i = 0; i < from.layouts.size(); ++i) {
    const QuantizedRows& f = from.layouts[i];
    QuantizedRows& q = to.layouts[i];
    q.format = f.format, q.group = f.group, q.groups = f.groups, q.K = f.K, q.lanes = f.lanes, q.chunks = f.chunks;
    q.span = f.span;
    q.tiles = f.tiles, q.plus128 = f.plus128, q.ld = f.ld, q.avx2 = f.avx2;
    q.lane_group.assign(f.lane_group.begin(), f.lane_group.end());
    // Its only caller (moe.cpp) quantizes its rows without the tile layout (tiles = false): gathering tile
    // rows would also need their kTileSlack rows of zeros, which nothing here does.
    TORCH_CHECK(!f.tiles, "gather_rows: rows in the AMX tile layout are not gathered (moe.cpp quantizes without it)");
    // per row: lanes [chunks, 64] bytes, [groups] scales, [chunks, 16] biases; plain [K] and [groups]; prompt
    // rows [K] values
    const int64_t bytes = f.lanes ? f.chunks * chunk_columns(f.format) : f.K;
    const auto take = [&](const auto& src, auto& dst, int64_t per_row) {
      dst.resize(src.empty() ? 0 : n * per_row);
      for (int64_t r = 0; r < n && !src.empty(); ++r) {
        std::copy_n(src.begin() + rows[r] * per_row, per_row, dst.begin() + r * per_row);
      }
    };
    take(f.bytes, q.bytes, bytes);
    take(f.scales, q.scales, f.groups);
    take(f.bias, q.bias, f.lanes ? f.chunks * 16 : f.groups);
    take(f.values, q.values, f.K);
  }
}

void int_panel(const Linear& l, const ActivationRows& a, const float* x, int64_t r0, int64_t r1, int64_t n0,
               int64_t ncols, bool packed, std::vector<float>& tile, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n0 + ncols;) {
    const int64_t i = std::upper_bound(l.starts.begin(), l.starts.end(), n) - l.starts.begin() - 1;
    const int64_t count = std::min(n0 + ncols, l.starts[i + 1]) - n;
    const WeightPart& p = l.parts[i];
    float* y = out + (n - n0);
    if (!reads_int8_activations(l, p)) {
      project_panel(l, x + r0 * l.K, r1 - r0, n, count, packed, tile, y, ldo);
    } else {
      const QuantizedRows& q = layout_for(a, p);
#if defined(DELTASERVE_AMX)
      if (q.tiles && !q.plus128) {  // a prompt chunk where AMX runs
        amx_part(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        n += count;
        continue;
      }
#endif
#if defined(DELTASERVE_VNNI_TILES)
      if (q.tiles && q.plus128) {  // a prompt chunk where the VNNI tiles run
        vnni_part(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        n += count;
        continue;
      }
#endif
#if defined(DELTASERVE_AVX2)
      if (q.tiles) {  // a prompt chunk or a batched step on an AVX2 build
        avx2_tile_part(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        n += count;
        continue;
      }
#endif
      TORCH_CHECK(!q.tiles, "int8 activations: rows laid out for AMX or VNNI tiles in a build without them");
      if (!q.values.empty()) {  // a prompt chunk: the packed kernel over x~
        project_panel(l, q.values.data() + r0 * l.K, r1 - r0, n, count, packed, tile, y, ldo);
        n += count;
        continue;
      }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (q.lanes) {
        if (p.format == Format::kInt8) {
          int_part<Format::kInt8>(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        } else {
          int_part<Format::kInt4>(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        }
        n += count;
        continue;
      }
#endif
#if defined(DELTASERVE_AVX2)
      if (q.avx2) {
        if (p.format == Format::kInt8) {
          int_part_avx2<Format::kInt8>(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        } else {
          int_part_avx2<Format::kInt4>(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
        }
        n += count;
        continue;
      }
#endif
      plain_part(p, n - l.starts[i], count, q, r0, r1 - r0, y, ldo);
    }
    n += count;
  }
}

}  // namespace deltaserve
