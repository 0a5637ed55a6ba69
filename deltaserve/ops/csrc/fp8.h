// The fp8 KV cache's E4M3 codes (deltaserve/ops/attention.py has the scale rule and the reference): a row
// quantized with its own scale when written, and codes widened to fp32 in registers when read.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace deltaserve {

constexpr float kFp8Max = 448.0f;  // E4M3's largest finite value

// Codes widen to their value / kFp8Unit: E4M3's sign, exponent and mantissa bits placed in an fp16 (whose
// exponent bias is 15, not 7: the value times 2^-8; E4M3 subnormals become exact fp16 subnormals), which the
// CPU converts to fp32 exactly. Readers fold kFp8Unit into the row scales they multiply by anyway.
constexpr float kFp8Unit = 256.0f;

inline uint16_t fp8_as_half_bits(uint8_t code) {
  return static_cast<uint16_t>(((code & 0x80) << 8) | ((code & 0x7f) << 7));
}

// One code's value / kFp8Unit (the portable loops').
inline float widen_fp8(uint8_t code) { return c10::detail::fp16_ieee_to_fp32_value(fp8_as_half_bits(code)); }

#if defined(__AVX512F__)
// 16 consecutive codes' values / kFp8Unit.
inline __m512 widen_fp8x16(const uint8_t* codes) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(c, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
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
