// The integer register tiles of linear_vnni.h on AVX2 builds (no AVX-512, so no vpdpbusd): the same GEMM of
// int8 activations by int8 / int4 weights, whose products vpmaddubsw (u8 x s8, two products summed per int16)
// and vpmaddwd by ones (pairs of int16 into int32) sum instead.
// - A thread packs its panel of up to 64 outputs as 8-output column tiles, 4 bytes of K x 8 outputs at a time
//   (32 bytes: one register), so one vpmaddubsw multiplies 4 columns of one row of x, broadcast, by 8 outputs.
// - int4: the stored nibbles q_w + 8 are the unsigned operand and q_x the signed one. A pair of products is at
//   most 2 x 15 x 127, so 8 steps (32 columns) add up in int16 before vpmaddwd widens them; each group's
//   -8 x sum(q_x) (QuantizedRows::bias) is added once.
// - int8: |q_x| is the unsigned operand and q_w carries q_x's sign (vpsignb): a pair is at most 2 x 127 x 127
//   (q_x and q_w lie in [-127, 127]), so every step widens into int32.
// Each group's exact int32 dot is converted to fp32 and added times scale_x x scale_w (one fma, groups in
// order), as the AVX2 integer kernel of linear_int.cpp does for fewer rows: a row's outputs are the same bits
// whichever of the two computes them.
#include "linear_vnni.h"

#if defined(DELTASERVE_AVX2)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "linear.h"
#include "linear_int.h"
#include "simd.h"

namespace deltaserve {

namespace {

// Columns k0 .. k0 + 32 of one stored weight row as the kernel reads them, in column order (int8: q_w; int4:
// the nibbles q_w + 8), zero at and past K.
inline __m256i weights32(const WeightPart& p, const uint8_t* row, int64_t k0) {
  const int64_t n = std::min<int64_t>(32, p.K - k0);
  if (n <= 0) return _mm256_setzero_si256();
  alignas(32) uint8_t tail[32] = {};
  if (p.format == Format::kInt8) {
    if (n == 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k0));
    std::memcpy(tail, row + k0, n);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
  }
  const uint8_t* bytes = row + k0 / 2;  // column 2j in byte j's low nibble, 2j + 1 in its high one
  if (n < 32) {
    std::memcpy(tail, bytes, (n + 1) / 2);
    bytes = tail;
  }
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), nibble = _mm_set1_epi8(0x0F);
  const __m128i even = _mm_and_si128(b, nibble), odd = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  __m256i w = _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
  if (n < 32) {  // an odd n's last byte holds a column past K in its high nibble
    alignas(32) uint8_t keep[32];
    for (int i = 0; i < 32; ++i) keep[i] = i < n ? 0xFF : 0;
    w = _mm256_and_si256(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(keep)));
  }
  return w;
}

// Outputs [row0, row0 + count) (count <= 64) of part p into b [8 column tiles][ld / 4][8 outputs][4 bytes]
// (column tile ct's bytes of columns k .. k + 3 at b + ct * 8 * ld + k * 8), zero past count and K (ld: a
// multiple of 4, at least K); and their scales sw [groups][64] in fp32 (0 past count).
void pack_panel_avx2(const WeightPart& p, int64_t row0, int64_t count, int64_t ld, uint8_t* b, float* sw) {
  const uint8_t* data = p.bytes;
  for (int64_t ct = 0; ct < 8; ++ct) {
    uint8_t* bt = b + ct * 8 * ld;
    if (ct * 8 >= count) {
      std::memset(bt, 0, 8 * ld);
      continue;
    }
    const uint8_t* rows[8];
    for (int64_t i = 0; i < 8; ++i) rows[i] = ct * 8 + i < count ? data + (row0 + ct * 8 + i) * p.row_bytes : nullptr;
    for (int64_t k0 = 0; k0 < ld; k0 += 32) {
      __m256i v[8];
      for (int i = 0; i < 8; ++i) v[i] = rows[i] ? weights32(p, rows[i], k0) : _mm256_setzero_si256();
      transpose8_words(v);  // v[w]: the 4 bytes of columns k0 + 4w .. of each of the 8 outputs
      const int64_t words = std::min<int64_t>(8, (ld - k0) / 4);
      for (int64_t w = 0; w < words; ++w) _mm256_storeu_si256(reinterpret_cast<__m256i*>(bt + (k0 / 4 + w) * 32), v[w]);
    }
  }
  pack_panel_scales(p, row0, count, sw);
}

// Rows of x per register tile: R rows x 16 outputs take 2R accumulators, with the two weight vectors and the
// broadcast row (int8: and its absolute value) within the 16 vector registers.
template <Format F>
constexpr int kRows = F == Format::kInt4 ? 6 : 4;

// R rows of x (signed bytes a, ld apart; their scales sx and int4 biases bias, G apart) times the 16 outputs
// of column tiles b0 and b0 + 8 x ld (their scales at sw, 64 apart per group) into y (the first n outputs).
template <Format F, int R>
void tile_rows(const int8_t* a, int64_t ld, const float* sx, const int32_t* bias, int64_t G, int64_t group,
               const uint8_t* b0, const float* sw, float* y, int64_t ldy, int64_t n) {
  const uint8_t* b1 = b0 + 8 * ld;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float sum[R][16] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[R][2];
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {  // int4: 8 steps' int16 sums, then widened
      const int64_t k1 = std::min((g + 1) * group, k0 + 32);
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 4) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + k * 8));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + k * 8));
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a + r * ld + k, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          if constexpr (F == Format::kInt4) {
            acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xb));
            acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xb));
          } else {
            const __m256i ax = _mm256_abs_epi8(xb);
            acc[r][0] = _mm256_add_epi32(acc[r][0],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < 2; ++c) {
          const __m256i d = F == Format::kInt4 ? _mm256_madd_epi16(acc[r][c], ones) : acc[r][c];
          dot[r][c] = k0 == g * group ? d : _mm256_add_epi32(dot[r][c], d);
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sw + g * 64), s1 = _mm256_loadu_ps(sw + g * 64 + 8);
    for (int r = 0; r < R; ++r) {
      if constexpr (F == Format::kInt4) {
        const __m256i b = _mm256_set1_epi32(bias[r * G + g]);
        dot[r][0] = _mm256_add_epi32(dot[r][0], b), dot[r][1] = _mm256_add_epi32(dot[r][1], b);
      }
      const __m256 s = _mm256_set1_ps(sx[r * G + g]);
      _mm256_store_ps(sum[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s, s0),
                                              _mm256_load_ps(sum[r])));
      _mm256_store_ps(sum[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(s, s1),
                                                  _mm256_load_ps(sum[r] + 8)));
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, sum[r], n * sizeof(float));
}

template <Format F>
void part_tiles(const QuantizedRows& q, int64_t group, int64_t count, const uint8_t* b, const float* sw,
                int64_t t0, int64_t T, float* y, int64_t ldy) {
  const int64_t ld = q.ld, G = q.groups;
  const int8_t* a = reinterpret_cast<const int8_t*>(q.bytes.data());
  const int32_t* bias = F == Format::kInt4 ? q.bias.data() : nullptr;
  for (int64_t ct = 0; ct * 8 < count; ct += 2) {  // 16 outputs (two column tiles) at a time
    const int64_t n = std::min<int64_t>(16, count - ct * 8);
    for (int64_t r = 0; r < T; r += kRows<F>) {
      with_rows<kRows<F>>(std::min<int64_t>(kRows<F>, T - r), [&](auto R) {
        const int64_t t = t0 + r;
        tile_rows<F, decltype(R)::value>(a + t * ld, ld, q.scales.data() + t * G, bias ? bias + t * G : nullptr, G,
                                         group, b + ct * 8 * ld, sw + ct * 8, y + r * ldy + ct * 8, ldy, n);
      });
    }
  }
}

}  // namespace

void avx2_tile_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
                    float* y, int64_t ldy) {
  count_int_tile_panel();
  thread_local std::vector<uint8_t> b;
  thread_local std::vector<float> sw;
  b.resize(64 * q.ld), sw.resize(p.groups * 64);
  pack_panel_avx2(p, row0, count, q.ld, b.data(), sw.data());
  if (p.format == Format::kInt8) {
    part_tiles<Format::kInt8>(q, p.group, count, b.data(), sw.data(), t0, T, y, ldy);
  } else {
    part_tiles<Format::kInt4>(q, p.group, count, b.data(), sw.data(), t0, T, y, ldy);
  }
}

}  // namespace deltaserve
#endif
