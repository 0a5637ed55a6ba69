// Projections: y = x @ w^T with w [N, K] the model's own stored weights, read in their format (formats.h) and
// widened in registers; no copy of any weight is kept.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "formats.h"
#include "isa.h"

namespace deltaserve {

// A projection is its row blocks, one after another in output order (gate_proj | up_proj, q | k | v, ...;
// a fused group's parts may differ in format), each read where it is.
struct Linear {
  std::vector<WeightPart> parts;
  std::vector<int64_t> starts;  // the first output of each part, then N
  int64_t N = 0, K = 0;
  // Whether its int8 / int4 parts quantize x to int8 first (activation_quantization = "int8"; linear_int.h).
  bool int8_activations = false;
  // Whether every part reads x rounded to bf16 (activation_quantization = "bf16"; deltaserve/ops/
  // activation_quant.py): apply / apply_rows round the rows first, and panels of bf16 weights then multiply
  // bf16 pairs (vdpbf16ps, twice the fp32 FMA's products per instruction) where the CPU has AVX512-BF16.
  bool bf16_activations = false;

  bool defined() const { return N > 0; }
};

// The Linear of these parts (make_part checked each; all of K inputs); int8_activations: whether its int8 /
// int4 parts read int8 activations; bf16_activations: whether its parts read x rounded to bf16 (not both).
Linear make_linear(std::vector<WeightPart> parts, bool int8_activations, bool bf16_activations = false);

// x's n values rounded to bf16 (to nearest even, as torch's x.bfloat16() does; NaN stays NaN) and widened
// back, into out (which may be x).
void round_to_bf16(const float* x, int64_t n, float* out);

// How many panels the bf16-pair kernel has computed in this process (tests check that it ran).
int64_t bf16_pair_panels();

// One row of x (decode) over at least kStreamedBytes of one part's weight rows, on a single compute thread,
// reads them as kStreams long runs at once (dot_streams, linear.cpp; int_streams, linear_int.cpp; AVX-512
// builds). Two threads' streams together read no faster than blocks (an AMD EPYC Zen 4, every projection of
// a 0.8B decode step: bf16 0.97x, int8 0.88x, int4 1.00x), as two cores' reads fill what memory gives.
constexpr int64_t kStreamedBytes = 256 * 1024;
constexpr int kStreams = 4;
inline bool reads_as_streams(int64_t bytes) { return bytes >= kStreamedBytes && at::get_num_threads() == 1; }
// How many outputs were computed as streams in this process (tests check that it ran); the kernels' count.
int64_t dot_streamed_outputs();
void count_streamed_outputs(int64_t n);

// The streams' blocks of count outputs: block(NO, j, step) computes outputs j, j + step, ... (NO of them), for
// j < L = count / kStreams with NO = kStreams and step L, then the count % kStreams left one at a time.
template <typename Block>
void for_streams(int64_t count, Block&& block) {
  const int64_t L = count / kStreams;
  for (int64_t j = 0; j < L; ++j) block(std::integral_constant<int, kStreams>{}, j, L);
  for (int64_t j = kStreams * L; j < count; ++j) block(std::integral_constant<int, 1>{}, j, 1);
  count_streamed_outputs(count);
}

// Outputs are computed 64 at a time (a "panel": what a thread takes, what the argmax and the greedy screen
// reduce over).
constexpr int64_t kPanel = 64;

// Up to this many rows of x, each weight row is streamed once and dotted with every row of x (R rows x a few
// outputs of 16-lane accumulators, each 16 weights widened once for all R rows; linear.cpp dot_rows); from
// more rows on, a thread widens a tile of 64 outputs x kKBlock inputs
// into fp32 (256 KB: in L2) and runs the register-blocked outer-product kernel over rows of x, 6 at a time,
// adding each K block's products to the outputs. (A 128-input tile, in L1, measured slower on one
// shared-machine run: 0.50-0.68x of the old bf16 panels at 512 rows against 0.64-0.77x.)
// 20: with each weight widened once per group of up to 12 rows, the dot kernel beat the packed one at 13, 16
// and 20 rows (1.1-4.4x, in_proj, gate_up, down_proj, 1 thread, a loaded machine) and not at 24 (0.84-0.98x).
constexpr int64_t kDotRows = 20;
constexpr int64_t kKBlock = 1024;
// Rows of x per pass over the weights (x K floats, 512 KB at K = 1024, kept in L2 while tiles pass): int8
// activation rows outside the tile kernels, and the packed kernel's where kPackedRowBlock says so.
constexpr int64_t kRowBlock = 128;
// Rows of x per pass of the packed kernel over a projection's panels: each pass packs every panel's tiles
// again. AVX-512 (an AMD EPYC Zen 4, 1 MB L2, 1 thread, 512 rows, the 0.8B's projections): 512 rows a pass
// against 128 gave the fp32 rows 1.06-1.08x and the bf16 pairs 1.06-1.10x (x read from L3 costs less than
// packing the tiles four times). Other builds keep 128 (not measured; a Zen 3's L2 holds 512 KB).
#if defined(__AVX512F__)
constexpr int64_t kPackedRowBlock = 512;
#else
constexpr int64_t kPackedRowBlock = kRowBlock;
#endif

// y [T, N] = x [T, K] @ w^T (x contiguous fp32). With `argmax` (int64 [T]) instead, y is not kept: each
// panel's outputs are reduced to their rows' best column while in L1, and argmax gets each row's torch.argmax
// -- greedy sampling without writing (and reading back) T x vocab logits. Threads split the panels.
at::Tensor apply(const Linear& l, const at::Tensor& x, int64_t* argmax = nullptr);

struct ActivationRows;  // linear_int.h

// apply() without a tensor: y [r1 - r0, N] = rows [r0, r1) of x (rows of K floats) @ w^T, the same sums.
// int8_rows: x's rows quantized for l's int8-activation parts (quantize_activations_into; its row r is x's
// row r), empty when l has none. Threads split the panels (inline within a parallel region).
void apply_rows(const Linear& l, const float* x, int64_t r0, int64_t r1, const ActivationRows& int8_rows, float* y);

// Whether apply() runs T rows through the packed kernel (else the dot-product one). Either sums each output
// in an order that does not depend on the other rows, so a panel recomputed for one row with the same kernel
// (project_panel) gives the very numbers apply() gives.
inline bool packed_rows(int64_t T) { return T > kDotRows; }

// out[r * ldo + j] = x[r] . w[n0 + j] for rows r < rows, outputs j < ncols (at most 64 for the packed kernel),
// on the calling thread, by the packed kernel or the dot-product one (tile: the packed kernel's scratch, resized here). x_pairs: x's
// rows already as bf16 pairs (bf16 activations, AVX512-BF16 builds: ld_pairs words a row), else null.
void project_panel(const Linear& l, const float* x, int64_t rows, int64_t n0, int64_t ncols, bool packed,
                   std::vector<float>& tile, float* out, int64_t ldo, const uint32_t* x_pairs = nullptr,
                   int64_t ld_pairs = 0);

// Calls f(std::integral_constant<int, R>) with R = min(rows, Max) (rows >= 1) known at compile time.
template <int Max, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  }
  f(std::integral_constant<int, Max>{});
}

#if defined(__AVX512F__) || defined(DELTASERVE_AVX2)
// Blocks of up to this many bytes are prefetched as one stream (prefetch_next_block). AVX-512 (an AMD EPYC
// Zen 4, 1 thread, weights streamed from memory, against the per-row lines below): 4 KB blocks gained (int4
// one row, 8 rows of 512 B, 1.45-1.59x; int8 two rows, 4 rows of 1 KB, 1.10-1.13x), 7-8 KB ones lost (int8
// one row, 8 rows of 1 KB, 0.83-0.92x; 4 rows of 1.8-2 KB 0.77-0.78x). AVX2 was measured on a Zen 3 (below).
#if defined(__AVX512F__)
constexpr int64_t kSequentialPrefetchBytes = 4096;
#else
constexpr int64_t kSequentialPrefetchBytes = 8192;
#endif

// How far past the next block the far stream (prefetch_far_stream) runs. AVX-512 only: not measured on AVX2.
#if defined(__AVX512F__)
constexpr int64_t kFarPrefetchBytes = 8192;
#else
constexpr int64_t kFarPrefetchBytes = 0;
#endif

// Called where prefetch_next_block is (or, by the float AVX-512 kernel, beside its own lines of the next block),
// this prefetches into L2 the next block's bytes front to back at the block's pace (n lines a call), from
// kFarPrefetchBytes past its start: a second, farther stream, which keeps more lines on their way from memory
// than the next block's alone. An AMD EPYC Zen 4, 1 thread, decode at batch 1 (one engine, the stream switched
// off and on between runs): bench_moe's MoE bf16 1.16-1.21x, int8 1.13-1.16x; the 0.8B shape bf16 1.04-1.10x,
// int8 1.07-1.09x (4, 8 and 12 KB gave much the same; 24 KB less).
__attribute__((always_inline)) inline void prefetch_far_stream(const uint8_t* block, int64_t n, int64_t row_bytes,
                                                                int64_t at) {
  if constexpr (kFarPrefetchBytes > 0) {
    const char* far = reinterpret_cast<const char*>(block + n * (row_bytes + at)) + kFarPrefetchBytes;
    for (int64_t i = 0; i < n; ++i) _mm_prefetch(far + 64 * i, _MM_HINT_T1);
  }
}

// A block of n consecutive weight rows (n x row_bytes contiguous bytes from `block`) is read across, the same
// `at` bytes into every row at a time; call this each time `at` reaches a multiple of 64, and it prefetches the
// same share of the next block (and, prefetch_far_stream, of the bytes kFarPrefetchBytes past it):
//   - a block of at most kSequentialPrefetchBytes: its bytes front to back, n lines a call, so that memory sees
//     one sequential stream that keeps pace with the block. Rows this short are each less than a page, where
//     the hardware's stream prefetcher loses them; measured (an AMD EPYC, 1 thread, one row of x, weights
//     streamed from memory, the lm_head's 1 KB int8 / 512 B int4 rows in blocks of 4), 94% / 88% of the
//     bandwidth a plain sum reads at the time, against 54% / 46% with the lines below.
//   - a longer block: each row's line `at` bytes in, into L2 (n streams, each long enough for the hardware to
//     follow). Whole blocks of long rows prefetched as one stream were slower (bf16 down_proj, 7 KB rows:
//     0.73-0.85x), their lines evicted before use.
// Always inlined: GCC (12) finds a function of prefetches alone free of side effects and drops every call to it.
__attribute__((always_inline)) inline void prefetch_next_block(const uint8_t* block, int64_t n, int64_t row_bytes,
                                                                int64_t at) {
  if (n * row_bytes <= kSequentialPrefetchBytes) {
    const char* next = reinterpret_cast<const char*>(block + n * (row_bytes + at));
    for (int64_t i = 0; i < n; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T0);
  } else {
    const char* next = reinterpret_cast<const char*>(block + n * row_bytes + at);
    for (int64_t i = 0; i < n; ++i) _mm_prefetch(next + i * row_bytes, _MM_HINT_T1);
  }
  prefetch_far_stream(block, n, row_bytes, at);
}
#endif

}  // namespace deltaserve
