// E4M3 codes (float8_e4m3fn) widened to fp32, for fp8 weights (formats.h) and the fp8 KV cache, and the
// cache's rows quantized (deltaserve/ops/attention.py has the scale rule and the reference): a row quantized
// with its own scale when written, and codes widened to fp32 in registers when read.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "isa.h"

namespace deltaserve {

constexpr float kFp8Max = 448.0f;  // E4M3's largest finite value

// Codes widen to their value / kFp8Unit, exactly (2^-8 is a power of two; no value underflows), and the
// codes 0x7f and 0xff, E4M3FN's NaNs, to NaN: torch's float8_e4m3fn -> float32 conversion over 2^8. Readers
// fold kFp8Unit into the scales they multiply by anyway.
constexpr float kFp8Unit = 256.0f;

// One code's value / kFp8Unit (the portable loops'): c10's conversion, the one torch's .float() uses.
inline float widen_fp8(uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits())) /
             kFp8Unit;
    }
    return t;
  }();
  return table[code];
}

#if defined(__AVX512F__)
// The values / kFp8Unit of 16 consecutive codes (lanes outside `valid` are not read: 0): E4M3's sign,
// exponent and mantissa bits placed in an fp16 (exponent bias 15, not 7: the value times 2^-8; E4M3
// subnormals become exact fp16 subnormals), which the CPU converts to fp32 exactly, and the NaN codes NaN.
inline __m512 widen_fp8x16(const uint8_t* codes, __mmask16 valid = 0xFFFF) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(valid, codes));
  const __m256i magnitude = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(magnitude, 7));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));  // E4M3FN's only NaN
  return _mm512_mask_mov_ps(_mm512_cvtph_ps(half), nan, _mm512_set1_ps(NAN));
}
#endif

#if defined(DELTASERVE_AVX2)
// widen_fp8x16 for 8 codes, with AVX2 and F16C.
inline __m256 widen_fp8x8(const uint8_t* codes) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m128i magnitude = _mm_and_si128(b, _mm_set1_epi16(0x7F));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(magnitude, 7));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F))));
  return _mm256_blendv_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(NAN), nan);
}
#endif

// Writes x[0 .. n) as codes at codes[i * stride] and returns the row's scale: amax / 448 (1 for a zero row),
// each code fp8(x / scale), rounded to nearest even as torch's .to(torch.float8_e4m3fn) does.
inline float quantize_fp8_row(const float* x, int64_t n, uint8_t* codes, int64_t stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
  for (int64_t i = 0; i < n; ++i) codes[i * stride] = c10::Float8_e4m3fn(x[i] / scale).x;
  return scale;
}

}  // namespace deltaserve
