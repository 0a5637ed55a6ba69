// Which vector code a build compiles: the AVX-512 kernels where the CPU has AVX-512 (AVX512F), else the AVX2
// ones where it has AVX2 and FMA (most x86 desktops and laptops: Intel's since Haswell without AVX-512, AMD's
// before Zen 4), else the plain loops (the portable build, -march=x86-64-v2).
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DELTASERVE_AVX2 1
#endif
