#include "gdn.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "norms.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

namespace {

// sk = S^T k and sq = S^T q for one head's recurrent state S [dk, dv], in one read of S.
#if defined(__AVX512F__)
// N x 16 value dims at a time: 2N accumulators stay in registers while the dk rows stream by.
constexpr int64_t kStateLanes = 16;  // value dims per vector
template <int N>
inline void state_times_kq_block(const float* S, int64_t dk, int64_t dv, const float* k, const float* q,
                                 float* sk, float* sq) {
  __m512 ak[N], aq[N];
  for (int c = 0; c < N; ++c) ak[c] = aq[c] = _mm512_setzero_ps();
  for (int64_t a = 0; a < dk; ++a) {
    const __m512 ka = _mm512_set1_ps(k[a]), qa = _mm512_set1_ps(q[a]);
    for (int c = 0; c < N; ++c) {
      const __m512 row = _mm512_loadu_ps(S + a * dv + 16 * c);
      ak[c] = _mm512_fmadd_ps(row, ka, ak[c]);
      aq[c] = _mm512_fmadd_ps(row, qa, aq[c]);
    }
  }
  for (int c = 0; c < N; ++c) {
    _mm512_storeu_ps(sk + 16 * c, ak[c]);
    _mm512_storeu_ps(sq + 16 * c, aq[c]);
  }
}
#elif defined(DELTASERVE_AVX2)
// The AVX2 form: N x 8 value dims at a time (2N accumulators of the 16 registers).
constexpr int64_t kStateLanes = 8;
template <int N>
inline void state_times_kq_block(const float* S, int64_t dk, int64_t dv, const float* k, const float* q,
                                 float* sk, float* sq) {
  __m256 ak[N], aq[N];
  for (int c = 0; c < N; ++c) ak[c] = aq[c] = _mm256_setzero_ps();
  for (int64_t a = 0; a < dk; ++a) {
    const __m256 ka = _mm256_set1_ps(k[a]), qa = _mm256_set1_ps(q[a]);
    for (int c = 0; c < N; ++c) {
      const __m256 row = _mm256_loadu_ps(S + a * dv + 8 * c);
      ak[c] = _mm256_fmadd_ps(row, ka, ak[c]);
      aq[c] = _mm256_fmadd_ps(row, qa, aq[c]);
    }
  }
  for (int c = 0; c < N; ++c) {
    _mm256_storeu_ps(sk + 8 * c, ak[c]);
    _mm256_storeu_ps(sq + 8 * c, aq[c]);
  }
}
#endif

inline void state_times_kq(const float* S, const float* k, const float* q, int64_t dk, int64_t dv, float* sk,
                           float* sq) {
#if defined(__AVX512F__) || defined(DELTASERVE_AVX2)
  if (dv % kStateLanes == 0) {
    for (int64_t j0 = 0; j0 < dv; j0 += 4 * kStateLanes) {
      switch (std::min<int64_t>(4, (dv - j0) / kStateLanes)) {
        case 1: state_times_kq_block<1>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        case 2: state_times_kq_block<2>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        case 3: state_times_kq_block<3>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
        default: state_times_kq_block<4>(S + j0, dk, dv, k, q, sk + j0, sq + j0); break;
      }
    }
    return;
  }
#endif
  std::fill(sk, sk + dv, 0.0f);
  std::fill(sq, sq + dv, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    const float* Sa = S + a * dv;
    const float ka = k[a], qa = q[a];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      sk[j] += Sa[j] * ka;
      sq[j] += Sa[j] * qa;
    }
  }
}

// About this many channels per unit of the conv pass's work (a sequence's prompt splits over the threads by
// channel blocks), a whole number of key heads' dk so that a block normalises the q and k heads it holds.
constexpr int64_t kConvChannels = 512;

}  // namespace

at::Tensor gdn_recurrence(const GdnDims& d, const GdnTensors& w, const at::Tensor& proj, const Batch& bt,
                          const at::Tensor& spec_conv, const at::Tensor& spec_ssm) {
  const int64_t C = d.conv_dim, K = d.kernel, Hv = d.hv, dk = d.dk, dv = d.dv;
  const int64_t key_dim = d.hk * dk, value_dim = Hv * dv, rep = Hv / d.hk;
  const int64_t width = C + value_dim + 2 * Hv;  // qkv | z | b | a
  at::Tensor core = at::empty({bt.T, value_dim}, proj.options());
  at::Tensor mixed_rows = at::empty({bt.T, C}, proj.options());  // q|k|v after the conv, SiLU and norms
  const float* pp = proj.data_ptr<float>();
  const float* cw = w.conv_w.data_ptr<float>();
  const float* neg_a = w.neg_a.data_ptr<float>();
  const float* dt_bias = w.dt_bias.data_ptr<float>();
  const float* norm_w = w.norm_w.data_ptr<float>();
  float* conv_cache = w.conv_cache.data_ptr<float>();
  float* ssm_cache = w.ssm_cache.data_ptr<float>();
  float* out = core.data_ptr<float>();
  float* mixed_all = mixed_rows.data_ptr<float>();
  const int64_t conv_size = C * (K - 1), ssm_size = Hv * dk * dv, head_size = dk * dv;
  float* spec_conv_p = bt.spec_rows ? spec_conv.data_ptr<float>() : nullptr;
  float* spec_ssm_p = bt.spec_rows ? spec_ssm.data_ptr<float>() : nullptr;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const int64_t tokens_per_seq = bt.T / std::max<int64_t>(bt.B, 1) + 1;

  // First, per sequence and block of channels (each channel's conv state advances token by token, apart from
  // the others'), every token's causal depthwise conv over [state | x_t], SiLU, and the L2 norms of the q and
  // k heads in the block (q also scaled by dk^-1/2).
  const int64_t block = std::max<int64_t>(1, kConvChannels / dk) * dk, blocks = (C + block - 1) / block;
  at::parallel_for(0, bt.B * blocks, grain_for(tokens_per_seq * block * (K + 8)), [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / blocks, c0 = item % blocks * block, c1 = std::min(C, c0 + block);
      const int64_t row = bt.spec_index[b];
      const bool fresh = bt.context_lens[b] == 0;
      const int64_t at = c0 * (K - 1), size = (c1 - c0) * (K - 1);  // the block's part of a conv state
      float* conv_slot = conv_cache + bt.state_slots[b] * conv_size;
      const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
      float* conv = conv_slot;  // the working state: the slot itself, or for a verify segment the per-position copy
      if (fresh && row < 0) std::fill(conv_slot + at, conv_slot + at + size, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        if (row >= 0) {  // verify: position i starts from position i-1's state (or the slot's)
          float* conv_i = spec_conv_p + (row * bt.spec_width + i) * conv_size;
          if (fresh && i == 0) {
            std::fill(conv_i + at, conv_i + at + size, 0.0f);
          } else {
            std::memcpy(conv_i + at, conv + at, size * sizeof(float));
          }
          conv = conv_i;
        }
        const float* xin = pp + t * width;
        float* mixed = mixed_all + t * C;
        if (K == 4) {  // the models' kernel size: fixed taps let this loop vectorize
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) {
            float* st = conv + c * 3;
            const float* wc = cw + c * 4;
            const float s0 = st[0], s1 = st[1], s2 = st[2], xc = xin[c];
            st[0] = s1;
            st[1] = s2;
            st[2] = xc;
            mixed[c] = silu(s0 * wc[0] + s1 * wc[1] + s2 * wc[2] + xc * wc[3]);
          }
        } else {
          for (int64_t c = c0; c < c1; ++c) {
            float* st = conv + c * (K - 1);
            const float* wc = cw + c * K;
            float acc = 0.0f;
            for (int64_t j = 0; j < K - 1; ++j) acc += st[j] * wc[j];
            acc += xin[c] * wc[K - 1];
            for (int64_t j = 0; j + 1 < K - 1; ++j) st[j] = st[j + 1];
            st[K - 2] = xin[c];
            mixed[c] = silu(acc);
          }
        }
        for (int64_t kh = c0 / dk; kh < std::min(2 * d.hk, c1 / dk); ++kh) {  // (q heads, then k heads)
          float* v = mixed + kh * dk;
          float r = 1.0f / std::sqrt(dot(v, v, dk) + 1e-6f);
          if (kh < d.hk) r *= q_scale;
#pragma omp simd
          for (int64_t j = 0; j < dk; ++j) v[j] *= r;
        }
      }
      for (int64_t i = n; row >= 0 && i < bt.spec_width; ++i) {  // padding positions keep the last state
        std::memcpy(spec_conv_p + (row * bt.spec_width + i) * conv_size + at, conv + at, size * sizeof(float));
      }
    }
  });

  // Then, per (sequence, value head), the gated delta rule over the sequence's tokens (the heads' states are
  // independent: a prompt's heads are shared between threads) and the gated RMSNorm.
  at::parallel_for(0, bt.B * Hv, grain_for(tokens_per_seq * head_size * 3), [&](int64_t i0, int64_t i1) {
    std::vector<float> u(dv), sk(dv), sq(dv);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hv, hv = item % Hv;
      const int64_t row = bt.spec_index[b];
      const bool fresh = bt.context_lens[b] == 0;
      float* S_slot = ssm_cache + bt.state_slots[b] * ssm_size + hv * head_size;
      const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
      float* S = S_slot;  // as conv above
      if (fresh && row < 0) std::fill(S_slot, S_slot + head_size, 0.0f);
      const float neg_a_h = neg_a[hv], dt_bias_h = dt_bias[hv];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        if (row >= 0) {
          float* S_i = spec_ssm_p + (row * bt.spec_width + i) * ssm_size + hv * head_size;
          if (fresh && i == 0) {
            std::fill(S_i, S_i + head_size, 0.0f);
          } else {
            std::memcpy(S_i, S, head_size * sizeof(float));
          }
          S = S_i;
        }
        const float* xin = pp + t * width;
        const float* mixed = mixed_all + t * C;
        const float* q = mixed + (hv / rep) * dk;
        const float* k = mixed + key_dim + (hv / rep) * dk;
        const float* v = mixed + 2 * key_dim + hv * dv;
        const float beta = sigmoid(xin[C + value_dim + hv]);
        const float decay = std::exp(neg_a_h * softplus(xin[C + value_dim + Hv + hv] + dt_bias_h));
        // One read pass gives S^T k and S^T q (state_times_kq); then, with
        //   S' = decay S + k u^T,  u = beta (v - decay S^T k),  o = S'^T q = decay S^T q + (k.q) u,
        // one pass writes S'. (The reference decays S first; same maths, other rounding order.)
        const float kq = dot(k, q, dk);
        float* o = out + t * value_dim + hv * dv;
        state_times_kq(S, k, q, dk, dv, sk.data(), sq.data());
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          u[j] = beta * (v[j] - decay * sk[j]);
          o[j] = decay * sq[j] + kq * u[j];
        }
        for (int64_t a = 0; a < dk; ++a) {
          float* Sa = S + a * dv;
          const float ka = k[a];
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) Sa[j] = Sa[j] * decay + ka * u[j];
        }
        gated_rms_norm_row(o, xin + C + hv * dv, norm_w, d.eps, dv);
      }
      for (int64_t i = n; row >= 0 && i < bt.spec_width; ++i) {
        std::memcpy(spec_ssm_p + (row * bt.spec_width + i) * ssm_size + hv * head_size, S, head_size * sizeof(float));
      }
    }
  });
  return core;
}

}  // namespace deltaserve
