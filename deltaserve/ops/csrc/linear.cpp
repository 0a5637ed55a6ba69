#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "linear_int.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {
std::atomic<int64_t> bf16_panels{0};
std::atomic<int64_t> streamed_outputs{0};
}  // namespace

int64_t bf16_pair_panels() { return bf16_panels.load(std::memory_order_relaxed); }
int64_t dot_streamed_outputs() { return streamed_outputs.load(std::memory_order_relaxed); }
void count_streamed_outputs(int64_t n) { streamed_outputs.fetch_add(n, std::memory_order_relaxed); }

void round_to_bf16(const float* x, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof(b));
    const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    b = nan ? (b | 0x00400000u) & 0xFFFF0000u : (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;  // nearest even
    std::memcpy(out + i, &b, sizeof(b));
  }
}

Format format_named(const std::string& name) {
  if (name == "float32") return Format::kFloat32;
  if (name == "bfloat16") return Format::kBFloat16;
  if (name == "fp8") return Format::kFp8;
  if (name == "int8") return Format::kInt8;
  if (name == "int4") return Format::kInt4;
  TORCH_CHECK(false, "weight format '", name, "' is not known (float32, bfloat16, fp8, int8, int4)");
}

const char* format_name(Format f) {
  switch (f) {
    case Format::kFloat32: return "float32";
    case Format::kBFloat16: return "bfloat16";
    case Format::kFp8: return "fp8";
    case Format::kInt8: return "int8";
    case Format::kInt4: return "int4";
  }
  return "?";
}

WeightPart make_part(const at::Tensor& data, const at::Tensor& scale, Format format, int64_t group, int64_t K,
                     const std::string& what) {
  static const at::ScalarType data_dtype[] = {at::kFloat, at::kBFloat16, at::kFloat8_e4m3fn, at::kChar, at::kByte};
  const at::ScalarType want = data_dtype[static_cast<int>(format)];
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous(), what, ": contiguous [N, K] data expected");
  TORCH_CHECK(data.scalar_type() == want, what, ": ", format_name(format), " data is ", want, ", got ",
              data.scalar_type());
  const int64_t columns = format == Format::kInt4 ? (K + 1) / 2 : K;
  TORCH_CHECK(data.size(1) == columns, what, ": ", format_name(format), " data of K = ", K, " inputs has ", columns,
              " columns, got ", data.size(1));
  WeightPart p;
  p.data = data, p.format = format, p.rows = data.size(0), p.K = K;
  p.bytes = static_cast<const uint8_t*>(data.data_ptr());
  p.row_bytes = columns * static_cast<int64_t>(data.element_size());
  if (!quantized(format)) {
    TORCH_CHECK(!scale.defined(), what, ": the ", format_name(format), " format has no scale");
    return p;
  }
  TORCH_CHECK(group > 0 && (format != Format::kInt4 || group % 2 == 0), what, ": ", format_name(format),
              " needs a group size > 0 (even for int4), got ", group);
  TORCH_CHECK(scale.defined(), what, ": ", format_name(format), " weights need their scale");
  const at::ScalarType scale_dtype = format == Format::kFp8 ? at::kFloat : at::kBFloat16;
  p.group = group, p.groups = (K + group - 1) / group;
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.size(0) == p.rows && scale.size(1) == p.groups,
              what, ": contiguous scale [", p.rows, ", ", p.groups, "] expected (group ", group, "), got ",
              scale.sizes());
  TORCH_CHECK(scale.scalar_type() == scale_dtype, what, ": ", format_name(format), " scales are ", scale_dtype,
              ", got ", scale.scalar_type());
  p.scale = scale;
  p.scales = scale.data_ptr();
  return p;
}

Linear make_linear(std::vector<WeightPart> parts, bool int8_activations, bool bf16_activations) {
  TORCH_CHECK(!(int8_activations && bf16_activations), "a projection reads int8 or bf16 activations, not both");
  Linear l;
  l.int8_activations = int8_activations;
  l.bf16_activations = bf16_activations;
  TORCH_CHECK(!parts.empty(), "a projection needs at least one part");
  l.K = parts[0].K;
  for (const WeightPart& p : parts) {
    TORCH_CHECK(p.K == l.K, "the parts of one projection must have the same K");
    l.starts.push_back(l.N);
    l.N += p.rows;
  }
  l.starts.push_back(l.N);
  l.parts = std::move(parts);
  return l;
}

namespace {

// ---- the dot-product kernel: R rows of x times NO consecutive weight rows of one part ----------------------
// The loops over a block's rows and outputs unrolled completely, so that its R x NO accumulators stay in
// registers (GCC kept some blocks' arrays in memory otherwise).
#define DS_UNROLL _Pragma("GCC unroll 16")

#if defined(DELTASERVE_AVX2)
// Bytes of 8 stored values of format F.
constexpr int64_t bytes_of_8(Format F) {
  return F == Format::kFloat32 ? 32 : F == Format::kBFloat16 ? 16 : F == Format::kInt4 ? 4 : 8;
}

// The scales of one weight row for the AVX2 kernels' 8-input steps, taken in order along K: one broadcast per
// group (a group that is a multiple of 8), else lane by lane.
template <Format F>
struct RowScales8 {
  const WeightPart* p = nullptr;
  const void* scales = nullptr;
  int64_t row = 0;
  int64_t left = 0, g = 0;
  __m256 s = _mm256_setzero_ps();

  // the scales of inputs k0 .. k0 + 8 (k0 the next step's)
  __m256 at(int64_t k0) {
    if constexpr (quantized(F)) {
      if (p->group % 8 != 0) {
        s = scales8(*p, scales, row, k0);
      } else if (left-- == 0) {
        s = _mm256_set1_ps(scale_by_index(*p, scales, row * p->groups + g));
        ++g, left = p->group / 8 - 1;
      }
    }
    return s;
  }
};

// dot_block for AVX2 (16 registers of 8 fp32): y[r * ldy + j] = x[r] . w[row0 + j] for r < R, j < NO, the K
// loop outside, each 8 weights widened once and multiplied into all R rows' accumulators (lane i of one
// summing inputs i, i + 8, ... in order), reduced at the end; K's last K % 8 inputs widened by widen_scalar.
// An output's sum is the same for any R and NO.
template <Format F, int NO, int R>
void dot_block_avx2(const WeightPart& p, int64_t row0, const float* x, int64_t K, float* y, int64_t ldy) {
  const uint8_t* data = p.bytes;
  const void* scales = p.scales;
  __m256 acc[R][NO];
  DS_UNROLL
  for (int r = 0; r < R; ++r) {
    DS_UNROLL
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  const uint8_t* rows[NO];
  DS_UNROLL
  for (int j = 0; j < NO; ++j) rows[j] = data + (row0 + j) * p.row_bytes;
  RowScales8<F> scale[NO];
  __m256 s[NO];
  DS_UNROLL
  for (int j = 0; j < NO; ++j) scale[j] = RowScales8<F>{&p, scales, row0 + j};
  constexpr int64_t kBytes8 = bytes_of_8(F);
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8) {
    DS_UNROLL
    for (int j = 0; j < NO; ++j) s[j] = scale[j].at(k0);
    const int64_t at = k0 * kBytes8 / 8;  // this step's first byte of each row
    if ((at & 63) == 0) prefetch_next_block(rows[0], NO, p.row_bytes, at);
    if constexpr (R == 1) {  // each widened row used at once: NO accumulators and few other registers
      const __m256 xv = _mm256_loadu_ps(x + k0);
      DS_UNROLL
      for (int j = 0; j < NO; ++j) acc[0][j] = _mm256_fmadd_ps(xv, widen8<F>(rows[j], k0, s[j]), acc[0][j]);
    } else {
      __m256 w[NO];
      DS_UNROLL
      for (int j = 0; j < NO; ++j) w[j] = widen8<F>(rows[j], k0, s[j]);
      DS_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k0);
        DS_UNROLL
        for (int j = 0; j < NO; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
      }
    }
  }
  if (k0 < K) {  // K's last, partial 8: zeros past K in both
    alignas(32) float w[NO][8] = {}, xt[R][8] = {};
    for (int j = 0; j < NO; ++j) widen_scalar(p, data, scales, row0 + j, k0, K - k0, w[j]);
    for (int r = 0; r < R; ++r) std::memcpy(xt[r], x + r * K + k0, (K - k0) * sizeof(float));
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(xt[r]), _mm256_load_ps(w[j]), acc[r][j]);
    }
  }
  DS_UNROLL
  for (int r = 0; r < R; ++r) {
    DS_UNROLL
    for (int j = 0; j < NO; ++j) y[r * ldy + j] = sum8(acc[r][j]);
  }
}

// Weight rows of up to this many bytes are read one after another by dot_row_avx2 (one sequential stream)
// rather than NO interleaved by dot_block_avx2.
constexpr int64_t kSequentialRowBytes = 4096;

// y[r * ldy] = x[r] . w[row] for r < R (R <= 3): the row read once, front to back, its 8-input steps taken
// into 4 accumulators per row of x in turn (step s into accumulator s % 4, so that 4 FMA chains run at once
// with one weight stream), the next kilobyte of the row (and then of the rows after it) prefetched into L1.
// An output's sum is the same for any R.
template <Format F, int R>
void dot_row_avx2(const WeightPart& p, int64_t row, const float* x, int64_t K, float* y, int64_t ldy) {
  const uint8_t* data = p.bytes;
  const void* scales = p.scales;
  const uint8_t* w = data + row * p.row_bytes;
  __m256 acc[R][4];
  DS_UNROLL
  for (int r = 0; r < R; ++r) {
    DS_UNROLL
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  RowScales8<F> scale{&p, scales, row};
  constexpr int64_t kBytes8 = bytes_of_8(F);
  int64_t k0 = 0;
  for (; k0 + 32 <= K; k0 += 32) {
    const int64_t at = k0 * kBytes8 / 8;  // this step's first byte: a step is 4 x kBytes8 bytes, each line once
    for (int64_t b = (64 - at % 64) % 64; b < 4 * kBytes8; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + at + b + 1024), _MM_HINT_T0);
    }
    DS_UNROLL
    for (int a = 0; a < 4; ++a) {
      const __m256 wv = widen8<F>(w, k0 + 8 * a, scale.at(k0 + 8 * a));
      DS_UNROLL
      for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k0 + 8 * a), wv, acc[r][a]);
    }
  }
  for (int a = 0; k0 < K; k0 += 8, ++a) {  // K's last steps (the very last one partial: zeros past K)
    if (k0 + 8 <= K) {
      const __m256 wv = widen8<F>(w, k0, scale.at(k0));
      for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k0), wv, acc[r][a]);
      continue;
    }
    alignas(32) float wt[8] = {}, xt[8] = {};
    widen_scalar(p, data, scales, row, k0, K - k0, wt);
    for (int r = 0; r < R; ++r) {
      std::memcpy(xt, x + r * K + k0, (K - k0) * sizeof(float));
      acc[r][a] = _mm256_fmadd_ps(_mm256_load_ps(xt), _mm256_load_ps(wt), acc[r][a]);
    }
  }
  DS_UNROLL
  for (int r = 0; r < R; ++r) {
    y[r * ldy] = sum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
  }
}
#endif

// The inputs [k_begin, k_end) of a dot_block call: a slice of K, and where its accumulators come from and go.
// Blocks of one slice after another (dot_rows) keep their 16-lane accumulators in `partial` ([outputs][R][16]
// floats) between slices: stored and reloaded as they are, so every lane sums the same products in the same
// order as in one pass over K.
struct KSlice {
  int64_t k_begin, k_end;
  float* partial;  // this block's accumulators: output j's row r at partial[(j * R + r) * 16]; null: one pass
  bool first() const { return k_begin == 0; }
  bool last(int64_t K) const { return k_end == K; }
};

// y[r * ldy + j * step] = x[r] . w[row0 + j * step] for r < R, j < NO: the K loop outside, each 16 weights
// widened once and multiplied into all R rows' accumulators (R x NO of them, lane i of one summing inputs i,
// i + 16, ... in order), reduced at the end. An output's sum is the same for any R, NO, step and slicing of K
// (the greedy screen and argmax rely on it: linear.h). x's rows are K floats apart. step > 1 (dot_streams,
// AVX-512 only): its outputs are that many rows apart, and it leaves the prefetching to the hardware.
template <Format F, int NO, int R>
void dot_block(const WeightPart& p, int64_t row0, const float* x, int64_t K, float* y, int64_t ldy,
               KSlice slice, int64_t step = 1) {
  const uint8_t* data = p.bytes;
  const void* scales = p.scales;
#if defined(__AVX512F__)
  __m512 acc[R][NO];
  DS_UNROLL
  for (int r = 0; r < R; ++r) {
    DS_UNROLL
    for (int j = 0; j < NO; ++j) {
      acc[r][j] = slice.first() ? _mm512_setzero_ps() : _mm512_loadu_ps(slice.partial + (j * R + r) * 16);
    }
  }
  const uint8_t* rows[NO];
  DS_UNROLL
  for (int j = 0; j < NO; ++j) rows[j] = data + (row0 + j * step) * p.row_bytes;
  // the scales: one broadcast per group and output, counted along K (lane by lane for a group that is not a
  // multiple of 16)
  __m512 s[NO];
  DS_UNROLL
  for (int j = 0; j < NO; ++j) s[j] = _mm512_setzero_ps();
  const bool per_lane = quantized(F) && p.group % 16 != 0;
  const int64_t steps = quantized(F) && !per_lane ? p.group / 16 : 0;
  int64_t left = 0, g = quantized(F) && !per_lane ? slice.k_begin / p.group : 0;  // a slice starts a group
  auto next_scales = [&](int64_t k0) {
    if constexpr (quantized(F)) {
      if (per_lane) {
        DS_UNROLL
        for (int j = 0; j < NO; ++j) s[j] = scales16(p, scales, row0 + j * step, k0);
      } else if (left-- == 0) {
        DS_UNROLL
        for (int j = 0; j < NO; ++j) s[j] = group_scale(p, scales, row0 + j * step, g);
        ++g, left = steps - 1;
      }
    }
  };
  // bytes of 16 stored values; while a block reads its NO weight rows, the same lines of the next block's rows
  // are prefetched into L2, once per line (NO interleaved streams, which the hardware prefetcher does not keep
  // ahead). It was kept to blocks of 16 KB or less after a measurement (an Intel Xeon) found longer rows slower
  // with it; on an AMD EPYC, bf16 N = 1024, K = 3584 (down_proj, 1 thread), it gives 17 -> 25 GB/s at one row
  // and 13 -> 21 at four, and blocks of 16 KB or less do not change.
  constexpr int64_t kBytes16 = F == Format::kFloat32 ? 64 : F == Format::kBFloat16 ? 32 : F == Format::kInt4 ? 8 : 16;
  const int64_t ahead = NO * p.row_bytes;
  int64_t k0 = slice.k_begin;
  for (; k0 + 16 <= slice.k_end; k0 += 16) {
    next_scales(k0);
    if (step == 1 && ((k0 * kBytes16 / 16) & 63) == 0) {
      DS_UNROLL
      for (int j = 0; j < NO; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + k0 * kBytes16 / 16 + ahead), _MM_HINT_T1);
      }
      prefetch_far_stream(rows[0], NO, p.row_bytes, k0 * kBytes16 / 16);
    }
    __m512 w[NO];
    DS_UNROLL
    for (int j = 0; j < NO; ++j) w[j] = widen16<F>(rows[j], k0, 0xFFFF, s[j]);
    DS_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k0);
      DS_UNROLL
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  if (k0 < slice.k_end) {  // K's last, partial 16 (only the last slice ends off a multiple of 16)
    const __mmask16 valid = static_cast<__mmask16>((1u << (slice.k_end - k0)) - 1);
    next_scales(k0);
    __m512 w[NO];
    DS_UNROLL
    for (int j = 0; j < NO; ++j) w[j] = widen16<F>(rows[j], k0, valid, s[j]);
    DS_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(valid, x + r * K + k0);
      DS_UNROLL
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  if (!slice.last(K)) {
    DS_UNROLL
    for (int r = 0; r < R; ++r) {
      DS_UNROLL
      for (int j = 0; j < NO; ++j) _mm512_storeu_ps(slice.partial + (j * R + r) * 16, acc[r][j]);
    }
    return;
  }
  DS_UNROLL
  for (int r = 0; r < R; ++r) store_sums<NO>(acc[r], y + r * ldy, step);
#elif defined(DELTASERVE_AVX2)
  (void)slice, (void)step;  // the AVX2 path takes K in one pass (slice_width) and outputs one row apart
  dot_block_avx2<F, NO, R>(p, row0, x, K, y, ldy);
#else
  (void)slice, (void)step;  // the portable path takes K in one pass (slice_width) and outputs one row apart
  float acc[R][NO][16] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, K - k0);
    float w[NO][16] = {};
    for (int j = 0; j < NO; ++j) widen_scalar(p, data, scales, row0 + j, k0, n, w[j]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + k0;
      for (int j = 0; j < NO; ++j) {
#pragma omp simd
        for (int i = 0; i < 16; ++i) acc[r][j][i] += (i < n ? xr[i] : 0.0f) * w[j][i];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NO; ++j) {
      float s = 0.0f;
      for (int i = 0; i < 16; ++i) s += acc[r][j][i];
      y[r * ldy + j] = s;
    }
  }
#endif
}

// Outputs per block of the dot-product kernel at R rows: R x NO accumulators, the NO widened weights (and
// their scales, quantized formats) and one x vector within the 32 vector registers; at one row, 8 independent
// FMA chains hide the FMA latency (4 did not).
constexpr int block_outputs(Format F, int R) {
#if defined(DELTASERVE_AVX2)  // 16 registers: R x NO accumulators, NO widened weights (and scales), x
  if (quantized(F)) return R <= 1 ? 6 : R <= 2 ? 3 : R <= 5 ? 2 : 1;
  return R <= 1 ? 8 : R <= 2 ? 4 : R <= 3 ? 3 : R <= 6 ? 2 : 1;
#endif
  if (quantized(F)) return R <= 1 ? 8 : R <= 3 ? 6 : R <= 5 ? 4 : R <= 8 ? 3 : 2;
  return R <= 2 ? 8 : R <= 3 ? 6 : R <= 4 ? 5 : R <= 6 ? 4 : R <= 8 ? 3 : 2;
}

// The most rows one pass of dot_block takes (R x 2 accumulators); more are split into equal groups, each a
// pass over the part's outputs (which the first pass left in L2).
constexpr int kBlockRows = 12;

// The dot kernel's rows of x stay in L1 while the weight rows stream past (each block of outputs reads all of
// them again) as long as they take at most kOnePassBytes; more are taken a slice of K at a time, each slice's
// rows in about kSliceBytes. Measured (1 thread, an AMD EPYC, bf16 weights, the blocks' prefetch on), weights
// read per second at K = 3584 (down_proj), N = 768 / 1024: 4 rows 19.3 / 17.8 GB/s in one pass, 23.6 / 19.2
// in slices of 1024; 8 rows 14.3 / 15.4 in one pass, 15.4 / 16.0 in slices of 512. Slices of 12 KB measured
// slower at 8 rows (12.7); K = 1024 at up to 8 rows (32 KB of x) did not gain from slices.
constexpr int64_t kOnePassBytes = 40 * 1024, kSliceBytes = 16 * 1024;

// Inputs per slice of K for R rows: all of K, or a multiple of 256 (and of a quantized part's group, so that a
// slice starts a group).
template <Format F>
int64_t slice_width(const WeightPart& p, int R, int64_t K) {
#if defined(__AVX512F__)
  if (R * K * static_cast<int64_t>(sizeof(float)) <= kOnePassBytes) return K;
  int64_t width = std::max<int64_t>(256, kSliceBytes / (R * static_cast<int64_t>(sizeof(float))) / 256 * 256);
  if (quantized(F) && p.group % 16 == 0) width = (width + p.group - 1) / p.group * p.group;
  return std::min(width, K);
#else
  (void)p, (void)R;
  return K;
#endif
}

#if defined(__AVX512F__)
// Outputs [row0, row0 + count) of part p for one row of x, its weight rows read as kStreams runs at once, a
// quarter of them each (block j: rows j, j + L, j + 2L, j + 3L), rather than blocks of consecutive rows: four
// long sequential streams, which the hardware's prefetchers keep ahead of the loads, where blocks of 8 rows
// are 8 short ones that need software prefetching (dot_block). The same sums as any other block (dot_block).
// Measured (an AMD EPYC Zen 4, 1 thread, every projection of a decode step at the Qwen3.5-0.8B shape read
// from the checkpoint's mapped file, old and new build alternating in one process): bf16 1.08-1.16x, int8
// 1.16x, int4 1.09x (int_streams); at two threads they do not pay (reads_as_streams, linear.h). Software
// prefetching of each stream 1 or 2 KB ahead, 8 streams, and 4 streams of 2 adjacent rows were slower. Four
// accumulators are 4 FMA chains: weights in cache compute about 0.75x as fast as blocks of 8 (a 1 MB matrix
// read 2000 times: 40 against 54 GB/s), so only runs of kStreamedBytes or more take streams.
template <Format F>
void dot_streams(const WeightPart& p, int64_t row0, int64_t count, const float* x, int64_t K, float* y) {
  for_streams(count, [&](auto NO, int64_t j, int64_t step) {
    dot_block<F, decltype(NO)::value, 1>(p, row0 + j, x, K, y + j, 0, KSlice{0, K, nullptr}, step);
  });
}
#endif

// Outputs [n, n + count) of part p (local rows) for R rows of x: blocks of block_outputs, then of 2 and 1,
// slice by slice of K (slice_width), the blocks' accumulators kept in a per-thread scratch between slices;
// one row over a long run of weight rows by dot_streams.
template <Format F, int R>
void dot_rows(const WeightPart& p, int64_t row0, int64_t count, const float* x, int64_t K, float* y, int64_t ldy) {
#if defined(DELTASERVE_AVX2)
  if (p.row_bytes <= kSequentialRowBytes) {  // one weight row at a time, for up to 3 rows of x at a time
    for (int64_t j = 0; j < count; ++j) {
      for (int r0 = 0; r0 < R; r0 += 3) {
        with_rows<3>(std::min(3, R - r0), [&](auto Rs) {
          dot_row_avx2<F, decltype(Rs)::value>(p, row0 + j, x + r0 * K, K, y + r0 * ldy + j, ldy);
        });
      }
    }
    return;
  }
#endif
  constexpr int NO = block_outputs(F, R);
  const int64_t width = slice_width<F>(p, R, K);
#if defined(__AVX512F__)
  if (R == 1 && width == K && reads_as_streams(count * p.row_bytes)) return dot_streams<F>(p, row0, count, x, K, y);
#endif
  thread_local std::vector<float> partial;  // [count][R][16]
  if (width < K) partial.resize(count * R * 16);
  for (int64_t k_begin = 0; k_begin < K; k_begin += width) {
    const int64_t k_end = std::min(K, k_begin + width);
    const auto slice = [&](int64_t j) {
      return KSlice{k_begin, k_end, width < K ? partial.data() + j * R * 16 : nullptr};
    };
    int64_t j = 0;
    for (; j + NO <= count; j += NO) dot_block<F, NO, R>(p, row0 + j, x, K, y + j, ldy, slice(j));
    if constexpr (NO > 2) {
      for (; j + 2 <= count; j += 2) dot_block<F, 2, R>(p, row0 + j, x, K, y + j, ldy, slice(j));
    }
    for (; j < count; ++j) dot_block<F, 1, R>(p, row0 + j, x, K, y + j, ldy, slice(j));
  }
}

// Outputs [n, n + count) of part p (local rows) for T rows of x, in groups of up to kBlockRows rows: each
// weight row is read from memory once and widened once per group. Each output's sum is the same whichever
// block or group it falls in.
template <Format F>
void dot_part(const WeightPart& p, int64_t row0, int64_t count, const float* x, int64_t T, int64_t K, float* y,
              int64_t ldy) {
  const int64_t groups = (T + kBlockRows - 1) / kBlockRows, per_group = (T + groups - 1) / groups;
  for (int64_t t = 0; t < T; t += per_group) {
    with_rows<kBlockRows>(std::min(per_group, T - t), [&](auto R) {
      dot_rows<F, decltype(R)::value>(p, row0, count, x + t * K, K, y + t * ldy, ldy);
    });
  }
}

// The part holding output n.
int64_t part_of(const Linear& l, int64_t n) {
  return std::upper_bound(l.starts.begin(), l.starts.end(), n) - l.starts.begin() - 1;
}

// ---- the packed kernel: a tile of widened weights, reused over rows of x -----------------------------------
#if defined(__AVX512F__)
// widen16 of any part (the packing's: its outputs may belong to parts of several formats); g = k0 / group.
__m512 widen16_any(const WeightPart& p, int64_t row, int64_t k0, int64_t g, __mmask16 valid) {
  const uint8_t* r = p.bytes + row * p.row_bytes;
  __m512 scale = _mm512_setzero_ps();
  if (quantized(p.format)) {
    scale = p.group % 16 == 0 ? group_scale(p, p.scales, row, g) : scales16(p, p.scales, row, k0);
  }
  __m512 v;
  with_format(p.format, [&](auto F) { v = widen16<decltype(F)::value>(r, k0, valid, scale); });
  return v;
}
#endif

#if defined(DELTASERVE_AVX2)
// Tile rows [0, k8) (k8 a multiple of 8), columns j0 .. j0 + 8 of pack_tile on AVX2: outputs i < m through
// widen(i, kc) (their inputs kc .. kc + 8), the rest zero, 8 x 8 at a time transposed into 32-byte stores.
template <typename Widen>
void pack_columns8(int64_t m, int64_t k8, Widen&& widen, float* tile) {
  for (int64_t kc = 0; kc < k8; kc += 8) {
    __m256i v[8];
    for (int64_t i = 0; i < 8; ++i) v[i] = i < m ? _mm256_castps_si256(widen(i, kc)) : _mm256_setzero_si256();
    transpose8_words(v);
    for (int64_t i = 0; i < 8; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + (kc + i) * kPanel), v[i]);
    }
  }
}
#endif

// tile [kb, 64] = w[n0 .. n0 + ncols, k0 .. k0 + kb)^T in fp32, the columns past ncols zero.
void pack_tile(const Linear& l, int64_t n0, int64_t ncols, int64_t k0, int64_t kb, float* tile) {
  const WeightPart* part[kPanel];
  int64_t row[kPanel];
  for (int64_t j = 0; j < ncols; ++j) {
    const int64_t i = part_of(l, n0 + j);
    part[j] = &l.parts[i], row[j] = n0 + j - l.starts[i];
  }
#if defined(__AVX512F__)
  for (int64_t j0 = 0; j0 < kPanel; j0 += 16) {
    for (int64_t kc = 0; kc < kb; kc += 16) {
      const int64_t n = std::min<int64_t>(16, kb - kc);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      __m512 v[16];
      int64_t group = 0, g = 0;  // k0 + kc's group, divided out once per group size (not per output)
      for (int64_t i = 0; i < 16; ++i) {
        if (j0 + i >= ncols) {
          v[i] = _mm512_setzero_ps();
          continue;
        }
        const WeightPart& p = *part[j0 + i];
        if (p.group != group && p.group > 0) group = p.group, g = (k0 + kc) / group;
        v[i] = widen16_any(p, row[j0 + i], k0 + kc, g, valid);
      }
      transpose16(v);
      for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(tile + (kc + i) * kPanel + j0, v[i]);
    }
  }
#elif defined(DELTASERVE_AVX2)
  // 8 outputs at a time, their rows read front to back side by side, 8 inputs of each widened and transposed
  // into 8 of the tile's rows (pack_columns8). Output by output with strided scalar stores, packing took a
  // fifth of a bf16 prompt's projection time (perf, 512 rows).
  const int64_t k8 = kb / 8 * 8;
  for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
    const int64_t m = std::clamp<int64_t>(ncols - j0, 0, 8);
    const uint8_t* rows[8];
    const void* scales[8];
    bool one_format = true;
    for (int64_t i = 0; i < m; ++i) {
      const WeightPart& p = *part[j0 + i];
      rows[i] = p.bytes + row[j0 + i] * p.row_bytes, scales[i] = p.scales;
      one_format = one_format && p.format == part[j0]->format;
    }
    float* columns = tile + j0;
    auto scale_of = [&](int64_t i, int64_t kc) {  // the scales of output j0 + i's inputs kc .. kc + 8
      return scales8(*part[j0 + i], scales[i], row[j0 + i], k0 + kc);
    };
    if (!one_format) {  // parts of several formats: each output widened as its own part's
      pack_columns8(m, k8, [&](int64_t i, int64_t kc) {
        const Format f = part[j0 + i]->format;
        const __m256 scale = quantized(f) ? scale_of(i, kc) : _mm256_setzero_ps();
        __m256 w;
        with_format(f, [&](auto F) { w = widen8<decltype(F)::value>(rows[i], k0 + kc, scale); });
        return w;
      }, columns);
      continue;
    }
    with_format(m > 0 ? part[j0]->format : Format::kFloat32, [&](auto F) {
      constexpr Format kF = decltype(F)::value;
      pack_columns8(m, k8, [&](int64_t i, int64_t kc) {
        return widen8<kF>(rows[i], k0 + kc, quantized(kF) ? scale_of(i, kc) : _mm256_setzero_ps());
      }, columns);
    });
  }
  for (int64_t kc = k8; kc < kb; ++kc) std::fill(tile + kc * kPanel, tile + (kc + 1) * kPanel, 0.0f);
  for (int64_t j = 0; j < ncols && k8 < kb; ++j) {  // K's last, partial 8 inputs
    float w[8];
    widen_scalar(*part[j], part[j]->bytes, part[j]->scales, row[j], k0 + k8, kb - k8, w);
    for (int64_t i = 0; i < kb - k8; ++i) tile[(k8 + i) * kPanel + j] = w[i];
  }
#else
  for (int64_t j = 0; j < kPanel; ++j) {
    for (int64_t kc = 0; kc < kb; kc += 16) {
      const int64_t n = std::min<int64_t>(16, kb - kc);
      float w[16] = {};
      if (j < ncols) widen_scalar(*part[j], part[j]->bytes, part[j]->scales, row[j], k0 + kc, n, w);
      for (int64_t i = 0; i < n; ++i) tile[(kc + i) * kPanel + j] = w[i];
    }
  }
#endif
}

#if defined(__AVX512F__)
// The register-blocked kernel of tile_rows over any tile: weights_at(k, w) puts the tile's 64 fp32 weights of
// input k in w[0 .. 4).
template <int R, typename WeightsAt>
void tile_rows_with(const float* x, int64_t ldx, int64_t kb, WeightsAt&& weights_at, float* y, int64_t ldy,
                    int64_t ncols, bool accumulate) {
  __mmask16 mask[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t n = std::clamp<int64_t>(ncols - 16 * j, 0, 16);
    mask[j] = static_cast<__mmask16>((1u << n) - 1);
  }
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], y + r * ldy + 16 * j) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kb; ++k) {
    __m512 w[4];
    weights_at(k, w);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask[j], acc[r][j]);
  }
}
#endif

// y[r, 0 .. ncols) (+)= x[r, 0 .. kb) @ tile for R rows: R x 64 fp32 accumulators in registers, each weight
// loaded once for all R rows (x's rows are ldx apart, y's ldy; `accumulate`: add to what y holds).
template <int R>
void tile_rows(const float* x, int64_t ldx, int64_t kb, const float* tile, float* y, int64_t ldy, int64_t ncols,
               bool accumulate) {
#if defined(__AVX512F__)
  tile_rows_with<R>(x, ldx, kb, [tile](int64_t k, __m512 w[4]) {
    for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(tile + k * kPanel + 16 * j);
  }, y, ldy, ncols, accumulate);
#elif defined(DELTASERVE_AVX2)
  // a quarter of the tile (16 outputs, 2 registers) at a time: R x 2 accumulators, its 2 weight vectors and one
  // x broadcast within 16 registers; y's columns past ncols through a scratch row
  for (int64_t q = 0; q < ncols; q += 16) {
    const bool whole = q + 16 <= ncols;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      alignas(32) float start[16] = {};
      if (accumulate) std::memcpy(start, y + r * ldy + q, std::min<int64_t>(16, ncols - q) * sizeof(float));
      acc[r][0] = _mm256_load_ps(start), acc[r][1] = _mm256_load_ps(start + 8);
    }
    for (int64_t k = 0; k < kb; ++k) {
      const __m256 w0 = _mm256_loadu_ps(tile + k * kPanel + q), w1 = _mm256_loadu_ps(tile + k * kPanel + q + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (whole) {
        _mm256_storeu_ps(y + r * ldy + q, acc[r][0]), _mm256_storeu_ps(y + r * ldy + q + 8, acc[r][1]);
        continue;
      }
      alignas(32) float out[16];
      _mm256_store_ps(out, acc[r][0]), _mm256_store_ps(out + 8, acc[r][1]);
      std::memcpy(y + r * ldy + q, out, (ncols - q) * sizeof(float));
    }
  }
#else
  float acc[R][kPanel];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kPanel; ++j) acc[r][j] = accumulate && j < ncols ? y[r * ldy + j] : 0.0f;
  }
  for (int64_t k = 0; k < kb; ++k) {
    const float* w = tile + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], ncols * sizeof(float));
#endif
}

#if defined(__AVX512F__)
// Whether outputs [n0, n0 + ncols) all lie in bf16 parts (the packed kernel then keeps their tile in bf16).
bool bf16_outputs(const Linear& l, int64_t n0, int64_t ncols) {
  for (int64_t n = n0; n < n0 + ncols;) {
    const int64_t i = part_of(l, n);
    if (l.parts[i].format != Format::kBFloat16) return false;
    n = l.starts[i + 1];
  }
  return true;
}

// tile [kb, 64] bf16 = w[n0 .. n0 + ncols, k0 .. k0 + kb)^T of bf16 parts, the columns past ncols zero, each
// row of 64 interleaved in two halves of 32: output 32h + i at word 32h + 2i, output 32h + 16 + i at word
// 32h + 2i + 1. Read as 32-bit lanes, the low words are 16 consecutive outputs and the high words the next 16,
// so tile_rows_bf16 widens 32 weights with one shift and one mask (half the tile bytes of fp32: the old
// bf16 panels' layout, packed per tile instead of kept).
void pack_tile_bf16(const Linear& l, int64_t n0, int64_t ncols, int64_t k0, int64_t kb, uint16_t* tile) {
  const uint16_t* row[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) {
    row[j] = nullptr;
    if (j >= ncols) continue;
    const int64_t i = part_of(l, n0 + j);
    const WeightPart& p = l.parts[i];
    row[j] = reinterpret_cast<const uint16_t*>(p.bytes + (n0 + j - l.starts[i]) * p.row_bytes) + k0;
  }
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t kc = 0; kc < kb; kc += 16) {
      const int64_t n = std::min<int64_t>(16, kb - kc);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      __m512 v[16];  // v[i]: lanes k of the 32-bit word (output 32h + i, output 32h + 16 + i)
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* lo = row[32 * h + i];
        const uint16_t* hi = row[32 * h + 16 + i];
        const __m512i a = lo ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, lo + kc)) : _mm512_setzero_si512();
        const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, hi + kc)) : _mm512_setzero_si512();
        v[i] = _mm512_castsi512_ps(_mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
      transpose16(v);
      for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(tile + (kc + i) * kPanel + 32 * h, v[i]);
    }
  }
}

// tile_rows on a bf16 tile of pack_tile_bf16: 2 loads and 4 integer ops per k for the 64 weights instead of 4
// fp32 loads; the products and their order are tile_rows' (the same fp32 weights), so the sums are identical.
template <int R>
void tile_rows_bf16(const float* x, int64_t ldx, int64_t kb, const uint16_t* tile, float* y, int64_t ldy,
                    int64_t ncols, bool accumulate) {
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  tile_rows_with<R>(x, ldx, kb, [tile, high_words](int64_t k, __m512 w[4]) {
    const __m512i lo = _mm512_loadu_si512(tile + k * kPanel), hi = _mm512_loadu_si512(tile + k * kPanel + 32);
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
    w[1] = _mm512_castsi512_ps(_mm512_and_si512(lo, high_words));
    w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
    w[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, high_words));
  }, y, ldy, ncols, accumulate);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// tile [ceil(kb / 2) pairs][64 outputs] of 32-bit words = w[n0 + j, k0 + 2i .. k0 + 2i + 1] of bf16 parts (low
// half: the even input), the columns past ncols and an odd kb's last high half zero: vdpbf16ps's operand,
// 16 outputs' pairs per vector.
void pack_tile_pairs(const Linear& l, int64_t n0, int64_t ncols, int64_t k0, int64_t kb, uint32_t* tile) {
  const uint16_t* row[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) {
    row[j] = nullptr;
    if (j >= ncols) continue;
    const int64_t i = part_of(l, n0 + j);
    const WeightPart& p = l.parts[i];
    row[j] = reinterpret_cast<const uint16_t*>(p.bytes + (n0 + j - l.starts[i]) * p.row_bytes) + k0;
  }
  for (int64_t j0 = 0; j0 < kPanel; j0 += 16) {
    for (int64_t kc = 0; kc < kb; kc += 32) {  // 16 pairs of inputs
      const int64_t n = std::min<int64_t>(32, kb - kc);
      const __mmask32 valid = n == 32 ? ~0u : (1u << n) - 1;
      __m512 v[16];  // v[i]: output j0 + i's 16 pairs
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* r = row[j0 + i];
        v[i] = r ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(valid, r + kc)) : _mm512_setzero_ps();
      }
      transpose16(v);  // v[i]: pair i of the 16 outputs
      for (int64_t i = 0; i < (n + 1) / 2; ++i) _mm512_storeu_ps(tile + (kc / 2 + i) * kPanel + j0, v[i]);
    }
  }
}

// x[0, kb) (values already bf16, apply rounded them) as kb / 2 pairs of bf16 (an odd kb's last high half 0).
void pairs_of(const float* x, int64_t kb, uint32_t* pairs) {
  for (int64_t k = 0; k < kb; k += 32) {
    const int64_t n = std::min<int64_t>(32, kb - k);
    const __m512 lo = _mm512_maskz_loadu_ps(n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1), x + k);
    const __m512 hi = n > 16 ? _mm512_maskz_loadu_ps(n >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16)) - 1),
                                                     x + k + 16)
                             : _mm512_setzero_ps();
    const __m512bh b = _mm512_cvtne2ps_pbh(hi, lo);  // exact: the values are bf16
    const int64_t words = (n + 1) / 2;
    _mm512_mask_storeu_epi32(pairs + k / 2, words >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << words) - 1),
                             reinterpret_cast<const __m512i&>(b));
  }
}

// y[r, 0 .. ncols) (+)= x[r] . the tile's outputs for R rows of bf16 pairs (np pairs, rows ldx words apart):
// R x 64 fp32 accumulators, each pair of products added by vdpbf16ps (exact products, each sum rounded to fp32
// as an FMA's; denormal inputs and results flushed to zero, which no reference result depends on). Its set-up
// and stores repeat tile_rows_with's: sharing them through a struct or inline helpers cost this kernel 17-26%
// (80 -> 60 GMAC/s at 512 rows, measured), so they are written out here.
template <int R>
void tile_rows_pairs(const uint32_t* x, int64_t ldx, int64_t np, const uint32_t* tile, float* y, int64_t ldy,
                     int64_t ncols, bool accumulate) {
  __mmask16 mask[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t n = std::clamp<int64_t>(ncols - 16 * j, 0, 16);
    mask[j] = static_cast<__mmask16>((1u << n) - 1);
  }
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], y + r * ldy + 16 * j) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < np; ++p) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + p * kPanel + 16 * j));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + p])));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask[j], acc[r][j]);
  }
}
#endif

// Rows [r0, r1) of x times panel p's outputs, into out (ld ldo), through the packed kernel. x_pairs: rows
// [r0, r1) of x as bf16 pairs (pairs_of over all of K, ld_pairs words apart; row r0 first) when the caller
// converted them once for all its panels (bf16 activations), else null.
void packed_panel(const Linear& l, const float* x, int64_t r0, int64_t r1, int64_t n0, int64_t ncols, float* tile,
                  float* out, int64_t ldo, const uint32_t* x_pairs, int64_t ld_pairs) {
  const int64_t K = l.K;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (l.bf16_activations && bf16_outputs(l, n0, ncols)) {  // bf16 x bf16 pairs (the tile's fp32 room holds them)
    bf16_panels.fetch_add(1, std::memory_order_relaxed);
    uint32_t* tile32 = reinterpret_cast<uint32_t*>(tile);
    thread_local std::vector<uint32_t> xp;  // 6 rows' pairs of one K block (x_pairs null)
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t kb = std::min(kKBlock, K - k0), np = (kb + 1) / 2;
      pack_tile_pairs(l, n0, ncols, k0, kb, tile32);
      xp.resize(x_pairs == nullptr ? 6 * np : 0);
      for (int64_t t = r0; t < r1; t += 6) {
        const int64_t rows = std::min<int64_t>(6, r1 - t);
        const uint32_t* pairs = xp.data();
        int64_t ld = np;
        if (x_pairs != nullptr) {
          pairs = x_pairs + (t - r0) * ld_pairs + k0 / 2, ld = ld_pairs;  // (k0 is even)
        } else {
          for (int64_t r = 0; r < rows; ++r) pairs_of(x + (t + r) * K + k0, kb, xp.data() + r * np);
        }
        with_rows<6>(rows, [&](auto R) {
          tile_rows_pairs<decltype(R)::value>(pairs, ld, np, tile32, out + (t - r0) * ldo, ldo, ncols, k0 > 0);
        });
      }
    }
    return;
  }
#else
  (void)x_pairs, (void)ld_pairs;
#endif
#if defined(__AVX512F__)
  if (bf16_outputs(l, n0, ncols)) {  // the tile in bf16 (the tile's fp32 room holds it)
    uint16_t* tile16 = reinterpret_cast<uint16_t*>(tile);
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t kb = std::min(kKBlock, K - k0);
      pack_tile_bf16(l, n0, ncols, k0, kb, tile16);
      for (int64_t t = r0; t < r1; t += 6) {
        with_rows<6>(std::min<int64_t>(6, r1 - t), [&](auto R) {
          tile_rows_bf16<decltype(R)::value>(x + t * K + k0, K, kb, tile16, out + (t - r0) * ldo, ldo, ncols,
                                             k0 > 0);
        });
      }
    }
    return;
  }
#endif
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t kb = std::min(kKBlock, K - k0);
    pack_tile(l, n0, ncols, k0, kb, tile);
    for (int64_t t = r0; t < r1; t += 6) {
      with_rows<6>(std::min<int64_t>(6, r1 - t), [&](auto R) {
        tile_rows<decltype(R)::value>(x + t * K + k0, K, kb, tile, out + (t - r0) * ldo, ldo, ncols, k0 > 0);
      });
    }
  }
}

// The dot-product kernel over outputs [n0, n0 + ncols), part by part.
void dot_outputs(const Linear& l, const float* x, int64_t T, int64_t n0, int64_t ncols, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n0 + ncols;) {
    const int64_t i = part_of(l, n);
    const int64_t count = std::min(n0 + ncols, l.starts[i + 1]) - n;
    const WeightPart& p = l.parts[i];
    with_format(p.format, [&](auto F) {
      dot_part<decltype(F)::value>(p, n - l.starts[i], count, x, T, l.K, y + (n - n0), ldy);
    });
    n += count;
  }
}

}  // namespace

void project_panel(const Linear& l, const float* x, int64_t rows, int64_t n0, int64_t ncols, bool packed,
                   std::vector<float>& tile, float* out, int64_t ldo, const uint32_t* x_pairs, int64_t ld_pairs) {
  if (!packed) return dot_outputs(l, x, rows, n0, ncols, out, ldo);
  tile.resize(std::min(kKBlock, l.K) * kPanel);
  packed_panel(l, x, 0, rows, n0, ncols, tile.data(), out, ldo, x_pairs, ld_pairs);
}

namespace {

// x's n values rounded to bf16 (bf16 activations) in this thread's scratch, which grows once and is reused: no
// allocation per projection. Valid until the thread's next call (a projection does not nest another).
const float* rounded_rows(const float* x, int64_t n) {
  thread_local std::vector<float> scratch;
  scratch.resize(n);
  round_to_bf16(x, n, scratch.data());
  return scratch.data();
}

// Rows [R0, R1) of x (rows of K floats) through l: row r into yp's row r - R0 (N floats each) or, with argmax
// (yp null), its best column into argmax[r - R0]. int8_rows: x's rows quantized for l's int8-activation parts
// (row r of them is row r of x), or empty when l has none. Threads split the panels.
void project_rows(const Linear& l, const float* xp, int64_t R0, int64_t R1, const ActivationRows& int8_rows,
                  float* yp, int64_t* argmax) {
  const int64_t T = R1 - R0, K = l.K, N = l.N, P = (N + kPanel - 1) / kPanel;
  if (T <= 0) return;
  const bool packed = packed_rows(T);
  // rows per pass over the weights
  const int64_t block = int8_rows.tiled()     ? kAmxRowBlock
                        : int8_rows.defined() ? kRowBlock
                        : packed              ? kPackedRowBlock
                                              : T;
  std::vector<float> best_value(argmax == nullptr ? 0 : T * P);  // [T, P]: each row's best in each panel
  std::vector<int64_t> best_column(best_value.size());
  // bf16 activations through the packed kernel: each row block's rows converted to bf16 pairs once, for all
  // its panels (converting them per panel cost about a tenth of the kernel's time)
  const int64_t ld_pairs = (K + 1) / 2;
  std::vector<uint32_t> x_pairs;
  for (int64_t r0 = R0; r0 < R1; r0 += block) {
    const int64_t r1 = std::min(R1, r0 + block);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (packed && l.bf16_activations && !int8_rows.defined()) {
      x_pairs.resize((r1 - r0) * ld_pairs);
      for (int64_t r = r0; r < r1; ++r) pairs_of(xp + r * K, K, x_pairs.data() + (r - r0) * ld_pairs);
    }
#endif
    at::parallel_for(0, P, grain_for((r1 - r0) * K * kPanel), [&](int64_t p0, int64_t p1) {
      // Panels per call: one (the packed kernel's tile), or for one row (decode) all the thread's, so that its
      // weight rows stream as long runs (dot_streams, int_streams).
      const int64_t span = T == 1 ? p1 - p0 : 1;
      std::vector<float> tile;
      // a call's outputs, for argmax (left uninitialized: the kernels write every one)
      std::unique_ptr<float[]> local(yp == nullptr ? new float[(r1 - r0) * span * kPanel] : nullptr);
      for (int64_t p = p0; p < p1; p += span) {
        const int64_t n0 = p * kPanel, ncols = std::min(span * kPanel, N - n0);
        float* out = yp != nullptr ? yp + (r0 - R0) * N + n0 : local.get();
        const int64_t ldo = yp != nullptr ? N : span * kPanel;
        if (int8_rows.defined()) {
          int_panel(l, int8_rows, xp, r0, r1, n0, ncols, packed, tile, out, ldo);
        } else {
          project_panel(l, xp + r0 * K, r1 - r0, n0, ncols, packed, tile, out, ldo,
                        x_pairs.empty() ? nullptr : x_pairs.data(), ld_pairs);
        }
        for (int64_t q = p; yp == nullptr && q < p + span; ++q) {  // each row's best output of each panel
          const int64_t c0 = (q - p) * kPanel, width = std::min(kPanel, N - q * kPanel);
          for (int64_t r = 0; r < r1 - r0; ++r) {
            const int64_t at = first_argmax(out + r * ldo + c0, width);
            best_value[(r0 - R0 + r) * P + q] = out[r * ldo + c0 + at];
            best_column[(r0 - R0 + r) * P + q] = q * kPanel + at;
          }
        }
      }
    });
  }
  if (argmax == nullptr) return;
  for (int64_t t = 0; t < T; ++t) {
    int64_t at = 0;
    for (int64_t p = 1; p < P; ++p) at = beats(best_value[t * P + p], best_value[t * P + at]) ? p : at;
    argmax[t] = best_column[t * P + at];
  }
}

}  // namespace

at::Tensor apply(const Linear& l, const at::Tensor& x, int64_t* argmax) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == l.K,
              "projection: x must be contiguous float32 [T, ", l.K, "]");
  const int64_t T = x.size(0);
  at::Tensor y = argmax == nullptr ? at::empty({T, l.N}, x.options()) : at::Tensor();
  if (T == 0) return y;
  const float* xp = x.data_ptr<float>();
  if (l.bf16_activations) xp = rounded_rows(xp, T * l.K);  // the rows every kernel then reads
  // x quantized once for the int8-activation parts (linear_int.h), if l has any: they run its integer kernel
  const ActivationRows int8_rows = quantize_activations(l, xp, T);
  project_rows(l, xp, 0, T, int8_rows, argmax == nullptr ? y.data_ptr<float>() : nullptr, argmax);
  return argmax == nullptr ? y : at::Tensor();
}

void apply_rows(const Linear& l, const float* x, int64_t r0, int64_t r1, const ActivationRows& int8_rows, float* y) {
  TORCH_CHECK(int8_rows.defined() || std::none_of(l.parts.begin(), l.parts.end(), [&](const WeightPart& p) {
    return reads_int8_activations(l, p);
  }), "apply_rows: a projection with int8 activations needs its rows quantized");
  if (!l.bf16_activations) return project_rows(l, x, r0, r1, int8_rows, y, nullptr);
  // its rows rounded (no int8 rows: the two schemes exclude each other)
  project_rows(l, rounded_rows(x + r0 * l.K, (r1 - r0) * l.K), 0, r1 - r0, int8_rows, y, nullptr);
}

}  // namespace deltaserve
