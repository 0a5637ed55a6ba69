// AVX512-VNNI tiles for the int8-activation projections of batched steps and prompt chunks where AMX is not
// available (vnni_tile_min_rows() rows or more; activation_quantization = "int8"; the scheme and its
// reference: deltaserve/ops/activation_quant.py). The integer kernel of linear_int.h reads each weight row
// once per 4 rows of x and sums 16 lanes per output: past a few dozen rows it is compute-bound, and the
// packed fp32 kernel over x~ = q_x * s_x used to take over. This one is a register-tiled GEMM instead:
// - a thread packs its 64-output panel as the AMX kernel does (weight_panels.h: 4 bytes of K x 16 outputs,
//   signed q_w), so one vpdpbusd multiplies 4 bytes of one row of x, broadcast, by 16 outputs at once;
// - x is laid out as for AMX (linear_int.h QuantizedRows tiles) but as unsigned q_x + 128, the operand
//   vpdpbusd reads unsigned; each group's accumulators start at -128 x the group's sum of q_w (computed once
//   per panel with vpdpbusd itself), so they end at the group's exact int32 dot;
// - per group of the weights' columns, the dots of R rows x 32 outputs are converted to fp32 and added times
//   scale_x x scale_w, as the reference and the AMX kernel do.
// Groups must be a multiple of 4 (a vpdpbusd step stays inside one group); other groups keep their paths.
// AVX2 builds (no AVX-512) run the same tiles with vpmaddubsw instead (linear_avx2_tiles.cpp): the switches and
// counters below are those of whichever of the two a build has ("the VNNI tiles" in tests and benchmarks).
#pragma once

#include <cstdint>

#include "formats.h"
#include "isa.h"
#include "weight_panels.h"

#if defined(DELTASERVE_INT_PANELS) && defined(__AVX512VNNI__)
#define DELTASERVE_VNNI_TILES 1
#endif

namespace deltaserve {

struct QuantizedRows;  // linear_int.h

// From this many rows on, int8-activation parts whose group is a multiple of 4 run this kernel where AMX does
// not run. Measured against the paths it replaces (benchmarks/bench_tile_kernels.py --kernel vnni, 0.8B in_proj /
// gate_up / down_proj, int8 and int4, 1 thread, CPU time, an AMD EPYC under load): 8 rows 0.61-1.04x, 12 rows
// 0.90-1.48x, 16 rows 1.08-1.76x, 64 rows 2.9-3.5x, 512 rows 2.7-4.2x (docs/benchmarks.md). The AVX2 tiles
// against the AVX2 integer kernel and the packed fp32 one (the same shapes, a Zen 3 EPYC): 4 rows 0.90-1.28x,
// 8 rows 1.21-1.69x, 16 rows 1.46-2.11x, 64 rows 1.73-2.16x, 512 rows 1.46-2.14x.
#if defined(DELTASERVE_VNNI_TILES)
constexpr int64_t kVnniTileRows = 16;
#else
constexpr int64_t kVnniTileRows = 8;
#endif

// Whether this build has the kernel (AVX512-VNNI and -BW, or AVX2: the native build on such a CPU; never the
// portable one).
bool vnni_tiles_supported();

// Whether the int8-activation parts take the kernel: vnni_tiles_supported() and not switched off.
bool vnni_tiles_ready();

// Switches the kernel on or off for the whole process (measurements, tests); returns the last setting.
bool set_vnni_tiles_enabled(bool on);

// How many parts of 64-output panels the kernel has computed in this process (tests check that it ran).
int64_t vnni_tile_panels();

// Counts one such part (the kernels call it).
void count_int_tile_panel();

// The fewest rows that take the kernel: kVnniTileRows unless set (measurements); returns the last setting.
int64_t vnni_tile_min_rows();
int64_t set_vnni_tile_min_rows(int64_t rows);

// Whether T rows of a part of this group take the kernel.
// any_rows: at any number of rows (AVX2 builds, for the parts their integer kernel does not take: a row's
// outputs are then the same bits whatever the number of rows, as where it does).
inline bool vnni_tiles_take(int64_t T, int64_t group, bool any_rows) {
  return group % 4 == 0 && (any_rows || T >= vnni_tile_min_rows()) && vnni_tiles_ready();
}

#if defined(DELTASERVE_VNNI_TILES)
// Outputs [row0, row0 + count) (count <= 64) of int8 / int4 part p for rows t < T of q from t0 (the tile
// layout with unsigned bytes: linear_int.h), into y (ld ldy), on the calling thread.
void vnni_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
               float* y, int64_t ldy);
#endif

#if defined(DELTASERVE_AVX2)
// vnni_part's job on AVX2 builds, over the tile layout with signed bytes q_x (and int4's group biases:
// linear_int.h QuantizedRows).
void avx2_tile_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
                    float* y, int64_t ldy);
#endif

}  // namespace deltaserve
