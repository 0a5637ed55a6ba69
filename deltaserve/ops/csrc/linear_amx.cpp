#include "linear_amx.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "linear_int.h"
#include "weight_panels.h"

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
std::atomic<int64_t> min_rows{kAmxRows};

#if defined(DELTASERVE_AMX)
constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
constexpr int kXtiledata = 18;  // the XSAVE feature number of the tile data (17: the tile configuration)

// CPUID's AMX-TILE and AMX-INT8, XCR0's tile state (the OS saves it), and Linux's grant of the tile data
// to this process (every thread of it, those running already included).
// Returns "ready" or why not (amx_status).
std::string cpu_and_os_allow() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return "no OSXSAVE on this CPU or OS";  // xgetbv
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "no AMX-INT8 on this CPU";
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return "no AMX-INT8 on this CPU";  // AMX-TILE, AMX-INT8
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  // XTILECFG and XTILEDATA enabled
  if ((lo & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0)";
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, static_cast<unsigned long>(kXtiledata)) != 0) {
    const int err = errno;
    return std::string("kernel refused tile state: ") + std::strerror(err);
  }
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) {
    const int err = errno;
    return std::string("kernel refused tile state: ") + std::strerror(err);
  }
  if (!(granted & (1ul << kXtiledata))) return "kernel refused tile state: not granted";
  return "ready";
}

const std::string& amx_status_once() {
  static const std::string status = cpu_and_os_allow();
  return status;
}
#endif

}  // namespace

int64_t amx_step(int64_t group) {
  for (int64_t s = 64; s >= 16; s -= 4) {
    if (group % s == 0) return s;
  }
  return 0;
}

std::string amx_status() {
#if defined(DELTASERVE_AMX)
  return amx_status_once();
#else
  return "not compiled in";
#endif
}

bool amx_supported() {
#if defined(DELTASERVE_AMX)
  static const bool ok = amx_status_once() == "ready";
  return ok;
#else
  return false;
#endif
}

bool amx_ready() { return enabled.load(std::memory_order_relaxed) && amx_supported(); }

bool set_amx_enabled(bool on) { return enabled.exchange(on); }

int64_t amx_panels() { return panels.load(std::memory_order_relaxed); }

int64_t amx_min_rows() { return min_rows.load(std::memory_order_relaxed); }

int64_t set_amx_min_rows(int64_t rows) { return min_rows.exchange(std::max<int64_t>(rows, 1)); }

#if defined(DELTASERVE_AMX)
namespace {

// The tiles: C 0..1 (16 rows x 16 outputs, int32: groups alternate between them), A 4..5 (16 rows of x, `step`
// bytes), B 6..7 (step / 4 rows x 16 outputs x 4 bytes, the VNNI layout).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tile_config(int64_t step) {
  TileConfig c;
  for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(step);
  for (int t = 6; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(step / 4), c.colsb[t] = 64;
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the struct: without a barrier, the
  // stores of the rest may be moved past ldtilecfg (llama.cpp met it).
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// acc[i] += float(D[i]) x (scale_x of row i x scale_w) for the 16 rows of a group's C tile stored in c (16 x 16
// int32), the rows' scales_x at sx[i * G] and the 16 outputs' scales_w w.
inline void add_group(__m512 acc[16], const int32_t* c, const float* sx, int64_t G, __m512 w) {
  for (int i = 0; i < 16; ++i) {
    const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i));
    acc[i] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_set1_ps(sx[i * G]), w), acc[i]);
  }
}

}  // namespace

// One group's exact dots of a 16-row A block (a0) and a 16-output B tile (b0) into C tile C, through A tile A and
// B tile B, its K steps one TDPBSSD each.
#define DS_GROUP_DOTS(C, A, B, g)                    \
  do {                                               \
    _tile_zero(C);                                   \
    for (int64_t s_ = 0; s_ < steps; ++s_) {         \
      const int64_t k_ = (g) * p.group + s_ * step;  \
      _tile_loadd(A, a0 + k_, ld);                   \
      _tile_loadd(B, b0 + k_ * 16, 64);              \
      _tile_dpbssd(C, A, B);                         \
    }                                                \
  } while (0)

void amx_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
              float* y, int64_t ldy) {
  panels.fetch_add(1, std::memory_order_relaxed);
  const int64_t step = amx_step(p.group), steps = p.group / step, ld = q.ld, G = p.groups;
  thread_local std::vector<int8_t> b;
  thread_local std::vector<float> sw;
  b.resize(4 * 16 * ld), sw.resize(G * 64);
  pack_panel(p, row0, count, ld, b.data(), sw.data());
  alignas(64) int32_t c[2][16][16];  // the C tiles of two consecutive groups
  __asm__ volatile("" : : "r"(b.data()) : "memory");  // the packed tiles are in memory before tileloadd reads them
  load_tile_config(step);
  const int8_t* a = reinterpret_cast<const int8_t*>(q.bytes.data());
  // Blocks of 16 rows x 16 outputs, their fp32 sums in registers. Groups alternate between C tiles 0 and 1 (A 4
  // and 5, B 6 and 7): while the tiles compute one group, the last one's dots are stored, scaled and added
  // (1.3-1.6x the throughput of 2 x 2 tiles done one group at a time, measured at K = 1024, 32 and 128 rows).
  for (int64_t ct = 0; ct * 16 < count; ++ct) {
    const int8_t* b0 = b.data() + ct * 16 * ld;
    const float* swc = sw.data() + ct * 16;
    const int64_t ncols = std::min<int64_t>(16, count - ct * 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << ncols) - 1);
    for (int64_t r = 0; r < T; r += 16) {
      const int8_t* a0 = a + (t0 + r) * ld;
      const float* sx = q.scales.data() + (t0 + r) * G;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      DS_GROUP_DOTS(0, 4, 6, 0);
      for (int64_t g = 1; g < G; ++g) {
        const __m512 w = _mm512_loadu_ps(swc + (g - 1) * 64);
        if (g % 2 == 1) {
          DS_GROUP_DOTS(1, 5, 7, g);
          _tile_stored(0, c[0], 64);
          add_group(acc, c[0][0], sx + g - 1, G, w);
        } else {
          DS_GROUP_DOTS(0, 4, 6, g);
          _tile_stored(1, c[1], 64);
          add_group(acc, c[1][0], sx + g - 1, G, w);
        }
      }
      const __m512 w = _mm512_loadu_ps(swc + (G - 1) * 64);
      if ((G - 1) % 2 == 0) {
        _tile_stored(0, c[0], 64);
        add_group(acc, c[0][0], sx + G - 1, G, w);
      } else {
        _tile_stored(1, c[1], 64);
        add_group(acc, c[1][0], sx + G - 1, G, w);
      }
      const int64_t nr = std::min<int64_t>(16, T - r);
      for (int64_t i = 0; i < nr; ++i) _mm512_mask_storeu_ps(y + (r + i) * ldy + ct * 16, mask, acc[i]);
    }
  }
  _tile_release();
}
#undef DS_GROUP_DOTS
#endif

}  // namespace deltaserve
