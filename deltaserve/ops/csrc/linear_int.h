// Projections of int8 / int4 weights with int8 activations (activation_quantization = "int8";
// deltaserve/ops/activation_quant.py defines the scheme and is its reference). Each call quantizes its rows of
// x once, per row and per group of the weights' `group` columns, to int8 with an fp32 scale (amax / 127,
// round to nearest even), and each weight row is streamed once, as stored, through AVX512-VNNI's vpdpbusd
// (u8 x s8 -> int32, four products per lane):
//   - int8 weights: the weights go in as u8 q_w + 128 (their sign bit flipped as they are loaded), x as s8;
//     the extra 128 x sum(q_x) of each lane is the accumulator's start, computed once per row when x is
//     quantized. (Until 2026-12-07 x went in as u8 q_x + 128 and the lanes started at -vpdpbusd(128, q_w),
//     two instructions per output and 64 weights where the flip is one.)
//   - int4 weights: the stored nibble q_w + 8 is already u8 and x is s8; the extra 8 x sum(q_x) of each lane
//     is the accumulator's start, computed once per row when x is quantized. The 64 bytes of 128 columns
//     are split into their low nibbles (the even columns) and high ones (the odd columns), two vpdpbusd into
//     one accumulator, and x is laid out to match: each 128 columns' even ones, then their odd ones. (Chunks of
//     64 columns, 32 bytes widened into both halves of a register, took twice the instructions per byte:
//     the 0.8B's int4 decode read 37% of the machine's bandwidth.)
// Each lane's int32 dot (int8: 4 columns; int4: 8; of one group) is converted to fp32 once per chunk and
// multiplied by its group's scale_x x scale_w (a decode step's one row: those products formed once per 16
// groups, not per chunk); the 16 lanes are summed at the end. This needs every lane
// inside one group: a group that is a multiple of 8 (the default 32 is). Builds with AVX2 but not AVX-512
// run an AVX2 kernel (vpmaddubsw, 32 columns a step: linear_int.cpp int_block_avx2) where the group and K are
// multiples of 32. Other groups, and other builds (the portable one), compute the same scheme with plain
// loops, group by group.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "linear.h"
#include "linear_amx.h"
#include "linear_vnni.h"

namespace deltaserve {

// The VNNI layout's chunk (one 64-byte line of a weight row): its columns, which are also the bytes of a row of
// x for it (one q_x byte per column).
constexpr int64_t chunk_columns(Format f) { return f == Format::kInt4 ? 128 : 64; }

// Whether part p of projection l reads int8 activations (its int8 / int4 weights do; other formats read x).
inline bool reads_int8_activations(const Linear& l, const WeightPart& p) {
  return l.int8_activations && (p.format == Format::kInt8 || p.format == Format::kInt4);
}


// The rows of x quantized for the parts of one format and group.
struct QuantizedRows {
  Format format = Format::kInt8;
  int64_t group = 0, groups = 0, K = 0;
  bool lanes = false;  // the VNNI layout (below); else plain: bytes [T, K] q_x, scales [T, groups]
  int64_t chunks = 0;  // chunk_columns(format) each
  // lanes: bytes [T, chunks, chunk_columns] (int8: q_x in column order; int4: each chunk's even columns' q_x,
  // then its odd ones'), scales [T, groups] as plain, bias [T, chunks, 16] (-128 (int8) or -8 (int4) x the sum
  // of the lane's q_x), lane_group [chunks, 16] (the lane's group minus the chunk's first: the kernel spreads
  // 16 groups' scales over a chunk's lanes with it) and span (the most groups a chunk's lanes span: 1 + the
  // largest lane_group).
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  std::vector<int32_t> bias, lane_group;
  int64_t span = 1;
  // avx2: the AVX2 kernel's layout (builds with AVX2 but not AVX-512; the groups and K it takes:
  // linear_int.cpp avx2_int_kernel_takes): plain, except that int4 rows hold each 64 columns' 32 even ones, then
  // their 32 odd ones (the order of the low and high nibbles of 32 weight bytes), and bias [T, groups] = -8 x
  // the group's sum of q_x.
  bool avx2 = false;
  // Prompt chunks (more than kIntKernelRows rows): x~ = q_x * s_x [T, K] instead, for the packed float kernel.
  std::vector<float> values;
  // kAmxRows rows or more where AMX runs (linear_amx.h): the tile layout, bytes
  // [T + kTileSlack, ld] q_x (ld = groups x group; the last group's columns past K and the rows past T are 0)
  // and scales [T + kTileSlack, groups].
  // Where the VNNI tiles run instead (linear_vnni.h), the same layout with each byte q_x + 128 (plus128); where
  // the AVX2 tiles run (linear_avx2_tiles.cpp), q_x itself and, for int4, bias [T, groups] as above.
  bool tiles = false, plus128 = false;
  int64_t ld = 0;
};

// From kAmxRows rows on (batched steps and prompt chunks), where AMX runs and the group allows it, an
// int8-activation part runs the AMX kernel (linear_amx.h); where AMX does not run, from kVnniTileRows rows on,
// the VNNI or AVX2 tiles (linear_vnni.h) if the build has them; otherwise, past this many rows, the packed fp32
// kernel on x~ = q_x * s_x (what the
// Python model computes: the same sum up to fp32 rounding) instead of the integer kernel, whose 4 x 2 blocks
// are compute-bound. Measured on the 0.8B gate_up (7168 x 1024), 1 thread, integer kernel against packed:
// 16 rows 3.2-5.1x (int8) / 2.2-4.3x (int4); 64 rows 1.25x / 0.91x; 256 rows 0.87x / 0.63x.
constexpr int64_t kIntKernelRows = 48;

// x's rows quantized for each (format, group) that l's int8-activation parts have; empty when l has none.
struct ActivationRows {
  std::vector<QuantizedRows> layouts;
  bool defined() const { return !layouts.empty(); }
  bool tiled() const {
    return std::any_of(layouts.begin(), layouts.end(), [](const QuantizedRows& q) { return q.tiles; });
  }
};

ActivationRows quantize_activations(const Linear& l, const float* x, int64_t T);

// x's rows quantized into a for every (format, group) that the int8-activation parts of the projections ls
// have (one quantization of each row serves them all), a's buffers reused: kept between calls as scratch,
// it allocates nothing once grown. tiles: whether they may take the AMX tile layout (false for rows that will
// be gathered a few at a time, as the MoE decode path's experts do, where the VNNI kernel is faster).
void quantize_activations_into(std::initializer_list<const Linear*> ls, const float* x, int64_t T,
                               ActivationRows& a, bool tiles = true);

// to = rows rows[0 .. n) of from, in that order (the rows some experts' tokens have, quantized once for all),
// to's buffers reused.
void gather_rows(const ActivationRows& from, const int64_t* rows, int64_t n, ActivationRows& to);

// out[r * ldo + j] = row r0 + r of x times output n0 + j for r < r1 - r0, j < ncols (one panel, or a one-row
// call's many: project_rows): the int8-activation parts through the integer kernel (AMX tiles, VNNI lanes or
// plain loops, as their rows were quantized) or the packed one over x~, the others through project_panel
// (packed: its kernel).
void int_panel(const Linear& l, const ActivationRows& a, const float* x, int64_t r0, int64_t r1, int64_t n0,
               int64_t ncols, bool packed, std::vector<float>& tile, float* out, int64_t ldo);

}  // namespace deltaserve
