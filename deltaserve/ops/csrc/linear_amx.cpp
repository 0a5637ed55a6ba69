#include "linear_amx.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "linear_int.h"

#if defined(DELTASERVE_AMX)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace deltaserve {

namespace {

std::atomic<bool> enabled{true};
std::atomic<int64_t> panels{0};

#if defined(DELTASERVE_AMX)
constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
constexpr int kXtiledata = 18;  // the XSAVE feature number of the tile data (17: the tile configuration)

// CPUID's AMX-TILE and AMX-INT8, XCR0's tile state (the OS saves it), and Linux's grant of the tile data
// to this process (every thread of it, those running already included).
bool cpu_and_os_allow() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv works
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) return false;
  unsigned long granted = 0;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted & (1ul << kXtiledata)) != 0;
}
#endif

}  // namespace

int64_t amx_step(int64_t group) {
  for (int64_t s = 64; s >= 4; s -= 4) {
    if (group % s == 0) return s;
  }
  return 0;
}

bool amx_supported() {
#if defined(DELTASERVE_AMX)
  static const bool ok = cpu_and_os_allow();
  return ok;
#else
  return false;
#endif
}

bool amx_ready() { return enabled.load(std::memory_order_relaxed) && amx_supported(); }

bool set_amx_enabled(bool on) { return enabled.exchange(on); }

int64_t amx_panels() { return panels.load(std::memory_order_relaxed); }

#if defined(DELTASERVE_AMX)
namespace {

// The tiles: C 0..3 (16 rows x 16 int32: row tile i, column tile j in C 2i + j), A 4..5 (16 rows of x x
// `step` bytes), B 6..7 (step / 4 rows x 16 outputs x 4 bytes, the VNNI layout).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tile_config(int64_t step) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(step);
  for (int t = 6; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(step / 4), c.colsb[t] = 64;
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the struct: without a barrier, the
  // stores of the rest may be moved past ldtilecfg (llama.cpp met it).
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// 16 x 16 32-bit words transposed in registers: r[i] holds what was lane i of each.
inline void transpose16(__m512i v[16]) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(v[i]);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    v[i + 8] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
  }
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

// B tiles of outputs [row0, row0 + count) of part p: b [4 column tiles][ld / 4][16 outputs][4 bytes] (each
// column tile's K step from column k is its rows k / 4 on: one tileloadd of stride 64), the outputs past
// count and the columns past K zero; and their scales sw [groups][64] in fp32.
void pack_panel(const WeightPart& p, int64_t row0, int64_t count, int64_t ld, int8_t* b, float* sw) {
  const uint8_t* data = static_cast<const uint8_t*>(p.data.data_ptr());
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
      transpose16(v);  // v[w]: the 4 bytes of columns k0 + 4w .. of each of the 16 outputs
      const int64_t words = std::min<int64_t>(16, (ld - k0) / 4);
      for (int64_t w = 0; w < words; ++w) _mm512_storeu_si512(bt + (k0 / 4 + w) * 64, v[w]);
    }
  }
  const uint16_t* scales = static_cast<const uint16_t*>(p.scale.data_ptr());
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t j = 0; j < 64; ++j) sw[g * 64 + j] = j < count ? bf16_to_float(scales[(row0 + j) * p.groups + g]) : 0.0f;
  }
}

}  // namespace

void amx_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
              float* y, int64_t ldy) {
  panels.fetch_add(1, std::memory_order_relaxed);
  const int64_t step = amx_step(p.group), steps = p.group / step, ld = q.ld, G = p.groups;
  thread_local std::vector<int8_t> b;
  thread_local std::vector<float> sw;
  b.resize(4 * 16 * ld), sw.resize(G * 64);
  pack_panel(p, row0, count, ld, b.data(), sw.data());
  alignas(64) int32_t c[4][16][16];  // the C tiles of one group
  alignas(64) float acc[32][32];     // the fp32 sums of a block of 32 rows x 32 outputs
  __asm__ volatile("" : : "r"(b.data()) : "memory");  // the packed tiles are in memory before tileloadd reads them
  load_tile_config(step);
  const int8_t* a = reinterpret_cast<const int8_t*>(q.bytes.data());
  const int64_t tiles = (count + 15) / 16;
  for (int64_t ct = 0; ct < tiles; ct += 2) {
    const bool two_c = ct + 1 < tiles;
    const int8_t* b0 = b.data() + ct * 16 * ld;
    const int8_t* b1 = b0 + 16 * ld;
    for (int64_t r = 0; r < T; r += 32) {
      const int64_t nr = std::min<int64_t>(32, T - r);
      const bool two_r = nr > 16;
      const int8_t* a0 = a + (t0 + r) * ld;
      const int8_t* a1 = a0 + 16 * ld;
      const float* sx = q.scales.data() + (t0 + r) * G;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t g = 0; g < G; ++g) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          const int64_t k = g * p.group + s * step;
          _tile_loadd(4, a0 + k, ld);
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_dpbssd(0, 4, 6);
          if (two_c) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbssd(1, 4, 7);
          }
          if (two_r) {
            _tile_loadd(5, a1 + k, ld);
            _tile_dpbssd(2, 5, 6);
            if (two_c) _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        if (two_c) _tile_stored(1, c[1], 64);
        if (two_r) _tile_stored(2, c[2], 64);
        if (two_r && two_c) _tile_stored(3, c[3], 64);
        // each group's exact dot, times scale_x x scale_w, added in fp32
        const __m512 w0 = _mm512_loadu_ps(sw.data() + g * 64 + ct * 16);
        const __m512 w1 = _mm512_loadu_ps(sw.data() + g * 64 + ct * 16 + 16);
        for (int64_t i = 0; i < nr; ++i) {
          const __m512 s = _mm512_set1_ps(sx[i * G + g]);
          const int32_t* ci = c[i / 16 * 2][i % 16];
          const __m512 d0 = _mm512_cvtepi32_ps(_mm512_load_si512(ci));
          _mm512_store_ps(acc[i], _mm512_fmadd_ps(d0, _mm512_mul_ps(s, w0), _mm512_load_ps(acc[i])));
          if (two_c) {
            const __m512 d1 = _mm512_cvtepi32_ps(_mm512_load_si512(ci + 256));
            _mm512_store_ps(acc[i] + 16, _mm512_fmadd_ps(d1, _mm512_mul_ps(s, w1), _mm512_load_ps(acc[i] + 16)));
          }
        }
      }
      const int64_t n0 = std::min<int64_t>(16, count - ct * 16), n1 = std::clamp<int64_t>(count - ct * 16 - 16, 0, 16);
      const __mmask16 m0 = static_cast<__mmask16>((1u << n0) - 1), m1 = static_cast<__mmask16>((1u << n1) - 1);
      for (int64_t i = 0; i < nr; ++i) {
        float* yi = y + (r + i) * ldy + ct * 16;
        _mm512_mask_storeu_ps(yi, m0, _mm512_load_ps(acc[i]));
        if (n1 > 0) _mm512_mask_storeu_ps(yi + 16, m1, _mm512_load_ps(acc[i] + 16));
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace deltaserve
