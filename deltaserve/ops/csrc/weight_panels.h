// The B panels of the tile kernels of int8-activation projections (AMX: linear_amx.h; VNNI: linear_vnni.h):
// up to 64 consecutive outputs of an int8 / int4 weight part, their signed q_w (int8 as stored, int4's
// nibbles - 8) laid out 4 bytes of K x 16 outputs at a time, as both TDPBSSD's B tiles and vpdpbusd's weight
// operand read them. A thread packs the panel it is given into its own scratch (amortized over a prompt
// chunk's rows) and drops it after: the weights stay stored once.
#pragma once

#include <cstdint>

#include "formats.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // VL: _mm256_maskz_loadu_epi8
#define DELTASERVE_INT_PANELS 1
#endif

namespace deltaserve {

// The scales of outputs [row0, row0 + count) (count <= 64) of part p as a panel's kernels read them: sw
// [groups][64] in fp32, 0 past count (pack_panel's, and the AVX2 tiles' pack_panel_avx2).
void pack_panel_scales(const WeightPart& p, int64_t row0, int64_t count, float* sw);

#if defined(DELTASERVE_INT_PANELS)
// Outputs [row0, row0 + count) (count <= 64) of part p into b [4 column tiles][ld / 4][16 outputs][4 bytes]
// (column tile ct's bytes of columns k .. k + 3 at b + ct * 16 * ld + k * 16), the outputs past count and the
// columns past K zero (ld: a multiple of 4, at least K); and their scales sw [groups][64] in fp32 (0 past count).
void pack_panel(const WeightPart& p, int64_t row0, int64_t count, int64_t ld, int8_t* b, float* sw);
#endif

}  // namespace deltaserve
