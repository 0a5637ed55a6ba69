// AMX-INT8 tiles for the int8-activation projections of batched steps and prompt chunks (kAmxRows rows or
// more; activation_quantization = "int8";
// the scheme and its reference: deltaserve/ops/activation_quant.py; the integer kernel of fewer rows:
// linear_int.h). TDPBSSD multiplies signed int8 by signed int8 into int32, so x stays its q_x and int4
// weights are unpacked to their signed q_w (nibble - 8) as a panel's B tiles are packed: no correction terms.
// Per group of the weights' columns, the C tiles are zeroed, each K step of the group (up to 64 bytes) is
// one TDPBSSD, and the exact int32 group dots are stored and added in fp32 times scale_x x scale_w (as
// llama.cpp's AMX Q8_0 path does per block of 32). Weights stay stored once: a thread packs the B tiles of
// the 64 outputs it is given into its own scratch (amortized over the chunk's rows) and drops them after.
//
// Availability is checked once per process: the build has the instructions (the native one, where the
// compiler's -march=native enables AMX-TILE and AMX-INT8; never the portable one), CPUID and XCR0 say the
// CPU and the OS have AMX, and Linux grants the tile data (arch_prctl ARCH_REQ_XCOMP_PERM). Anything else,
// and the int8 activations take their other paths (linear_int.h). Each thread loads the tile configuration
// when it starts a panel and releases the tiles at its end.
#pragma once

#include <cstdint>
#include <string>

#include "formats.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__linux__)  // VL: _mm256_maskz_loadu_epi8
#define DELTASERVE_AMX 1
#endif

namespace deltaserve {

struct QuantizedRows;  // linear_int.h

// From this many rows on, int8-activation parts run the AMX kernel where it is available and the group
// allows it (amx_step). Measured against the VNNI kernel (up to kIntKernelRows) and the packed fp32 one over x~
// (benchmarks/bench_tile_kernels.py, 0.8B gate_up / down_proj / in_proj, int8 and int4, old / AMX, a loaded machine):
// 1 thread (CPU time) 8 rows 0.98-1.26x, 12 rows 1.37-2.00x, 16 rows 1.94-2.76x, 32 rows 2.65-3.96x, 512 rows
// 2.81-4.73x; 2 threads (wall) 8 rows 0.99-1.45x, 12 rows 1.41-2.21x, 512 rows 3.3-6.8x.
constexpr int64_t kAmxRows = 12;

// Rows of zeros a tile layout keeps past its last row: a 16-row block of tiles that starts at any row reads
// up to 15 rows past it (and their scales), whose products are not used.
constexpr int64_t kTileSlack = 15;

// Rows per pass over the weights when a projection's rows are in the tile layout (linear.cpp project_rows):
// each pass packs every panel's B tiles once, and 512 rows of q_x (512 KB at K = 1024) stay in L2.
constexpr int64_t kAmxRowBlock = 512;

// The K bytes of one TDPBSSD for a group of `group` columns: the largest multiple of 4 from 16 up to 64 that
// divides the group (32 for the default group, 64 for 64 and 128); 0 when there is none: such parts do not
// take the AMX kernel. A group that is not a multiple of 4 cannot; one whose largest such step would be 4, 8
// or 12 bytes (groups 4, 8, 12, 4 x a prime past 16 as 68, ...) would run one TDPBSSD per 4 to 12 bytes,
// slower than the VNNI kernel.
int64_t amx_step(int64_t group);

// Whether the CPU, the OS and this build allow the AMX kernel (checked once, the tile data requested from
// the kernel then).
bool amx_supported();

// Why amx_supported() is what it is: "ready", "not compiled in", "no AMX-INT8 on this CPU", "the OS has not
// enabled the tile state (XCR0)", or "kernel refused tile state: <strerror of arch_prctl's errno>".
std::string amx_status();

// Whether the int8-activation parts take the AMX kernel: amx_supported() and not switched off.
bool amx_ready();

// Switches the AMX kernel on or off for the whole process (measurements, tests); returns the last setting.
bool set_amx_enabled(bool on);

// How many panels the AMX kernel has computed in this process (tests check that it ran).
int64_t amx_panels();

// The fewest rows that take the AMX kernel: kAmxRows unless set (measurements of the threshold); returns the
// last setting.
int64_t amx_min_rows();
int64_t set_amx_min_rows(int64_t rows);

#if defined(DELTASERVE_AMX)
// Outputs [row0, row0 + count) (count <= 64) of int8 / int4 part p for rows t < T of q from t0 (a tile
// layout: linear_int.h), into y (ld ldy), on the calling thread.
void amx_part(const WeightPart& p, int64_t row0, int64_t count, const QuantizedRows& q, int64_t t0, int64_t T,
              float* y, int64_t ldy);
#endif

}  // namespace deltaserve
