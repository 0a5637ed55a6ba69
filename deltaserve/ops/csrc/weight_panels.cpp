#include "weight_panels.h"

#include <algorithm>
#include <cstring>

#include "simd.h"

#if defined(DELTASERVE_INT_PANELS)
#include <immintrin.h>
#endif

namespace deltaserve {

#if defined(DELTASERVE_INT_PANELS)
namespace {

// 16 x 16 32-bit words transposed in registers (simd.h's transpose16): v[i] holds what was lane i of each.
inline void transpose16_words(__m512i v[16]) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(v[i]);
  transpose16(r);
  for (int i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(r[i]);
}

// The signed q_w of columns k0 .. k0 + 64 of one stored weight row (int8 as stored; int4's nibbles - 8),
// zero at and past K.
inline __m512i signed_weights64(const WeightPart& p, const uint8_t* row, int64_t k0) {
  const int64_t n = std::min<int64_t>(64, p.K - k0);
  if (n <= 0) return _mm512_setzero_si512();
  const __mmask64 valid = n == 64 ? ~0ull : (1ull << n) - 1;
  if (p.format == Format::kInt8) return _mm512_maskz_loadu_epi8(valid, row + k0);
  const int64_t nb = (n + 1) / 2;  // bytes holding them: column 2j in byte j's low nibble, 2j + 1 in its high one
  const __m256i b = _mm256_maskz_loadu_epi8(nb == 32 ? ~0u : (1u << nb) - 1, row + k0 / 2);
  const __m512i w = _mm512_cvtepu8_epi16(b);  // 16-bit word j = byte j: its low byte column 2j, high 2j + 1
  const __m512i pairs = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)),
                                        _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F00)));
  return _mm512_maskz_sub_epi8(valid, pairs, _mm512_set1_epi8(8));
}

}  // namespace

void pack_panel(const WeightPart& p, int64_t row0, int64_t count, int64_t ld, int8_t* b, float* sw) {
  const uint8_t* data = p.bytes;
  for (int64_t ct = 0; ct < 4; ++ct) {
    int8_t* bt = b + ct * 16 * ld;
    if (ct * 16 >= count) {
      std::memset(bt, 0, 16 * ld);
      continue;
    }
    const uint8_t* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = ct * 16 + i < count ? data + (row0 + ct * 16 + i) * p.row_bytes : nullptr;
    for (int64_t k0 = 0; k0 < ld; k0 += 64) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = rows[i] ? signed_weights64(p, rows[i], k0) : _mm512_setzero_si512();
      transpose16_words(v);  // v[w]: the 4 bytes of columns k0 + 4w .. of each of the 16 outputs
      const int64_t words = std::min<int64_t>(16, (ld - k0) / 4);
      for (int64_t w = 0; w < words; ++w) _mm512_storeu_si512(bt + (k0 / 4 + w) * 64, v[w]);
    }
  }
  pack_panel_scales(p, row0, count, sw);
}
#endif

void pack_panel_scales(const WeightPart& p, int64_t row0, int64_t count, float* sw) {
  const uint16_t* scales = static_cast<const uint16_t*>(p.scales);
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t j = 0; j < 64; ++j) sw[g * 64 + j] = j < count ? bf16_to_float(scales[(row0 + j) * p.groups + g]) : 0.0f;
  }
}

}  // namespace deltaserve
