#include "linear_vnni.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "linear.h"
#include "linear_int.h"

#if defined(DELTASERVE_VNNI_TILES)
#include <immintrin.h>
#endif

namespace deltaserve {

namespace {

std::atomic<bool> enabled{true};
std::atomic<int64_t> panels{0};
std::atomic<int64_t> min_rows{kVnniTileRows};

}  // namespace

bool vnni_tiles_supported() {
#if defined(DELTASERVE_VNNI_TILES) || defined(DELTASERVE_AVX2)
  return true;
#else
  return false;
#endif
}

bool vnni_tiles_ready() { return enabled.load(std::memory_order_relaxed) && vnni_tiles_supported(); }

bool set_vnni_tiles_enabled(bool on) { return enabled.exchange(on); }

int64_t vnni_tile_panels() { return panels.load(std::memory_order_relaxed); }

void count_int_tile_panel() { panels.fetch_add(1, std::memory_order_relaxed); }

int64_t vnni_tile_min_rows() { return min_rows.load(std::memory_order_relaxed); }

int64_t set_vnni_tile_min_rows(int64_t rows) { return min_rows.exchange(std::max<int64_t>(rows, 1)); }

#if defined(DELTASERVE_VNNI_TILES)
namespace {

// Rows of x per register tile: R rows x 32 outputs take 2R int32 accumulators (one group's dots) and 2R fp32
// sums, with the two weight vectors and a broadcast row 4R + 3 of the 32 vector registers.
constexpr int kTileRows = 6;

// -128 x the sum of each group's q_w, per output: corr [groups][64] (the starts of the accumulators, since x
// goes in as q_x + 128).
void group_corrections(const int8_t* b, int64_t ld, int64_t group, int64_t groups, int32_t* corr) {
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t ct = 0; ct < 4; ++ct) {
    const int8_t* bt = b + ct * 16 * ld;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = g * group; k < (g + 1) * group; k += 4) sum = _mm512_dpbusd_epi32(sum, u128, _mm512_loadu_si512(bt + k * 16));
      _mm512_storeu_si512(corr + g * 64 + ct * 16, _mm512_sub_epi32(_mm512_setzero_si512(), sum));
    }
  }
}

// R rows of x (unsigned bytes a, ld apart; their scales sx, G apart) times the 32 outputs of column tiles b0
// and b0 + 16 x ld (their corrections and scales at corr and sw, 64 apart per group) into y (masks: the
// outputs there are).
template <int R>
void tile_rows(const uint8_t* a, int64_t ld, const float* sx, int64_t G, int64_t group, const int8_t* b0,
               const int8_t* b1, const int32_t* corr, const float* sw, float* y, int64_t ldy, __mmask16 m0,
               __mmask16 m1) {
  __m512 sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][2];
    const __m512i c0 = _mm512_loadu_si512(corr + g * 64), c1 = _mm512_loadu_si512(corr + g * 64 + 16);
    for (int r = 0; r < R; ++r) acc[r][0] = c0, acc[r][1] = c1;
    for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
      const __m512i w0 = _mm512_loadu_si512(b0 + k * 16), w1 = _mm512_loadu_si512(b1 + k * 16);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * ld + k));
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(sw + g * 64), s1 = _mm512_loadu_ps(sw + g * 64 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sx[r * G + g]);
      sum[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s, s0), sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(s, s1), sum[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, sum[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, sum[r][1]);
  }
}

inline __mmask16 outputs_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

}  // namespace

void vnni_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
               float* y, int64_t ldy) {
  count_int_tile_panel();
  const int64_t ld = q.ld, G = p.groups;
  thread_local std::vector<int8_t> b;
  thread_local std::vector<float> sw;
  thread_local std::vector<int32_t> corr;
  b.resize(4 * 16 * ld), sw.resize(G * 64), corr.resize(G * 64);
  pack_panel(p, row0, count, ld, b.data(), sw.data());
  group_corrections(b.data(), ld, p.group, G, corr.data());
  const uint8_t* a = q.bytes.data();
  for (int64_t ct = 0; ct * 16 < count; ct += 2) {  // 32 outputs (two column tiles) at a time
    const int8_t* b0 = b.data() + ct * 16 * ld;
    const __mmask16 m0 = outputs_mask(count - ct * 16), m1 = outputs_mask(count - ct * 16 - 16);
    for (int64_t r = 0; r < T; r += kTileRows) {
      with_rows<kTileRows>(std::min<int64_t>(kTileRows, T - r), [&](auto R) {
        tile_rows<decltype(R)::value>(a + (t0 + r) * ld, ld, q.scales.data() + (t0 + r) * G, G, p.group, b0,
                                      b0 + 16 * ld, corr.data() + ct * 16, sw.data() + ct * 16,
                                      y + r * ldy + ct * 16, ldy, m0, m1);
      });
    }
  }
}
#endif

}  // namespace deltaserve
