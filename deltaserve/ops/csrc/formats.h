// The weight formats of deltaserve/ops/formats.py as the kernels read them: a projection's weight rows stay
// in their stored bytes (row-major along K, as checkpoints are) and 16 values at a time are widened to fp32
// in registers, each times its group's scale: exactly the numbers formats.dequantize gives (every stored
// value is exact in fp32, and value x scale is one fp32 multiply in both), so a kernel differs from
// dequantize(...) @ x only in the order of its sums.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "fp8.h"
#include "isa.h"

namespace deltaserve {

enum class Format { kFloat32, kBFloat16, kFp8, kInt8, kInt4 };

// One block of a projection's rows in one format: data [rows, K] (int4: [rows, ceil(K/2)] bytes) and, for
// the quantized formats, scales [rows, ceil(K/group)] (fp8: fp32; int8, int4: bf16). Read where they are.
struct WeightPart {
  at::Tensor data, scale;  // scale undefined unless quantized
  // Their first bytes (scales null unless quantized), taken once by make_part: the kernels start a block of
  // a few outputs thousands of times a step, and Tensor::data_ptr()'s checks there cost 5% of a sparse-MoE
  // decode step (perf, the int4 bench_moe checkpoint).
  const uint8_t* bytes = nullptr;
  const void* scales = nullptr;
  Format format = Format::kFloat32;
  int64_t rows = 0, K = 0, group = 0;
  int64_t row_bytes = 0;  // bytes from one row of data to the next
  int64_t groups = 0;     // scales per row
};

constexpr bool quantized(Format f) { return f == Format::kFp8 || f == Format::kInt8 || f == Format::kInt4; }

// The format by the name formats.py gives it ("float32", "bfloat16", "fp8", "int8", "int4").
Format format_named(const std::string& name);
const char* format_name(Format f);

// A part of K inputs from its tensors, checked (dtype, shape, contiguity, group); `what` names it in errors.
WeightPart make_part(const at::Tensor& data, const at::Tensor& scale, Format format, int64_t group, int64_t K,
                     const std::string& what);

// The top 16 bits of an fp32's bits rounded to nearest even: its bfloat16 where it is finite (a NaN's may
// become an infinity: vision.cpp's round_bf16 and greedy_screen.cpp handle those). Branch-free.
inline uint16_t bf16_round_bits(uint32_t bits) {
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Scale number `at` of a quantized part (row r's group g: at = r * groups + g), in fp32.
inline float scale_by_index(const WeightPart& p, const void* scales, int64_t at) {
  return p.format == Format::kFp8 ? static_cast<const float*>(scales)[at]
                                  : bf16_to_float(static_cast<const uint16_t*>(scales)[at]);
}

// The scale of row `row`, column k of a quantized part, in fp32.
inline float scale_at(const WeightPart& p, const void* scales, int64_t row, int64_t k) {
  // (lanes past K: any scale, their value is 0)
  return scale_by_index(p, scales, row * p.groups + std::min(k, p.K - 1) / p.group);
}

// w[row, k0 .. k0 + n) of part p in fp32 (n <= 16), times their scales: the portable widening (and the
// reference shape of the AVX-512 one below).
inline void widen_scalar(const WeightPart& p, const uint8_t* data, const void* scales, int64_t row, int64_t k0,
                         int64_t n, float* out) {
  const uint8_t* r = data + row * p.row_bytes;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = k0 + i;
    float v = 0.0f;
    switch (p.format) {
      case Format::kFloat32: std::memcpy(&v, r + 4 * k, 4); break;
      case Format::kBFloat16: {
        uint16_t h;
        std::memcpy(&h, r + 2 * k, 2);
        v = bf16_to_float(h);
        break;
      }
      case Format::kFp8: v = widen_fp8(r[k]) * kFp8Unit; break;  // exact
      case Format::kInt8: v = static_cast<float>(static_cast<int8_t>(r[k])); break;
      case Format::kInt4: v = static_cast<float>(((r[k / 2] >> (4 * (k % 2))) & 0x0F) - 8); break;
    }
    out[i] = quantized(p.format) ? v * scale_at(p, scales, row, k) : v;
  }
}

#if defined(__AVX512F__)
// The 16 scales of columns k0 .. k0 + 16 of a row: one broadcast when a group holds all 16 (group a multiple
// of 16, k0 one too), else lane by lane.
inline __m512 scales16(const WeightPart& p, const void* scales, int64_t row, int64_t k0) {
  if (p.group % 16 == 0) return _mm512_set1_ps(scale_at(p, scales, row, k0));
  alignas(64) float s[16];
  for (int i = 0; i < 16; ++i) s[i] = scale_at(p, scales, row, k0 + i);
  return _mm512_load_ps(s);
}

// The scales of columns k0 .. k0 + 16 of a row whose group holds all 16 (group a multiple of 16): g = k0 / group,
// counted by the caller (a division per 16 values would cost more than the widening).
inline __m512 group_scale(const WeightPart& p, const void* scales, int64_t row, int64_t g) {
  return _mm512_set1_ps(scale_by_index(p, scales, row * p.groups + g));
}

// w[row, k0 .. k0 + 16) in fp32 (k0 a multiple of 16; lanes at or past K, under `valid`'s zero bits, are 0):
// the stored values widened in registers, times their scales `scale` (quantized formats; group_scale or
// scales16).
template <Format F>
inline __m512 widen16(const uint8_t* row_data, int64_t k0, __mmask16 valid, __m512 scale) {
  (void)scale;  // (unquantized formats)
  if constexpr (F == Format::kFloat32) {
    return _mm512_maskz_loadu_ps(valid, reinterpret_cast<const float*>(row_data) + k0);
  } else if constexpr (F == Format::kBFloat16) {
    const __m256i h = _mm256_maskz_loadu_epi16(valid, reinterpret_cast<const uint16_t*>(row_data) + k0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (F == Format::kInt8) {
    const __m128i q = _mm_maskz_loadu_epi8(valid, row_data + k0);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale);
  } else if constexpr (F == Format::kInt4) {
    // 8 bytes, two columns each: byte j -> lanes 2j (low nibble) and 2j + 1 (high nibble)
    const __mmask16 bytes = static_cast<__mmask16>((1u << ((__builtin_popcount(valid) + 1) / 2)) - 1);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, row_data + k0 / 2));
    const __m256i pairs = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)),
                                          _mm256_slli_epi32(_mm256_srli_epi32(b, 4), 16));
    const __m512i q = _mm512_sub_epi32(_mm512_cvtepu16_epi32(pairs), _mm512_set1_epi32(8));
    return _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(valid, q), scale);
  } else {  // fp8 E4M3 (fp8.h): the value / 2^8, NaN codes NaN
    // times (scale x 2^8): the same one rounding as value x scale (2^8 is exact; no overflow at these scales)
    return _mm512_mul_ps(widen_fp8x16(row_data + k0, valid), _mm512_mul_ps(scale, _mm512_set1_ps(kFp8Unit)));
  }
}
#endif

#if defined(DELTASERVE_AVX2)
// The AVX2 build's widening, 8 values a step (one 256-bit register of fp32).
// The 8 scales of columns k0 .. k0 + 8 of a row: one broadcast when a group holds all 8, else lane by lane.
inline __m256 scales8(const WeightPart& p, const void* scales, int64_t row, int64_t k0) {
  if (p.group % 8 == 0) return _mm256_set1_ps(scale_at(p, scales, row, k0));
  alignas(32) float s[8];
  for (int i = 0; i < 8; ++i) s[i] = scale_at(p, scales, row, k0 + i);
  return _mm256_load_ps(s);
}

// w[row, k0 .. k0 + 8) in fp32 (k0 a multiple of 8, k0 + 8 <= K): the stored values widened in registers, times
// their scales `scale` (quantized formats), the numbers widen_scalar gives.
template <Format F>
inline __m256 widen8(const uint8_t* row_data, int64_t k0, __m256 scale) {
  (void)scale;  // (unquantized formats)
  if constexpr (F == Format::kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row_data) + k0);
  } else if constexpr (F == Format::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_data + 2 * k0));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == Format::kInt8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row_data + k0));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
  } else if constexpr (F == Format::kInt4) {
    // 4 bytes, two columns each (byte j: column 2j in its low nibble): column i is bits 4i .. 4i + 3
    uint32_t word;
    std::memcpy(&word, row_data + k0 / 2, sizeof(word));
    const __m256i q = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0x0F));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), scale);
  } else {  // fp8 E4M3 through fp16, as widen_fp8x16 (fp8.h)
    return _mm256_mul_ps(widen_fp8x8(row_data + k0), _mm256_mul_ps(scale, _mm256_set1_ps(kFp8Unit)));
  }
}
#endif

// Calls f(std::integral_constant<Format, F>{}) with the part's format known at compile time.
template <typename Fn>
inline void with_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::kFloat32: fn(std::integral_constant<Format, Format::kFloat32>{}); break;
    case Format::kBFloat16: fn(std::integral_constant<Format, Format::kBFloat16>{}); break;
    case Format::kFp8: fn(std::integral_constant<Format, Format::kFp8>{}); break;
    case Format::kInt8: fn(std::integral_constant<Format, Format::kInt8>{}); break;
    case Format::kInt4: fn(std::integral_constant<Format, Format::kInt4>{}); break;
  }
}

}  // namespace deltaserve
