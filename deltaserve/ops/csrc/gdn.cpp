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

// Value dims of a head's state that one pass of the delta rule keeps (a block of dk x kDeltaCols floats: 16 KB
// at dk 128 on AVX2, in L1 while a sequence's tokens pass; its running S^T k and S^T q in registers).
#if defined(__AVX512F__)
constexpr int64_t kDeltaCols = 64;
#elif defined(DELTASERVE_AVX2)
constexpr int64_t kDeltaCols = 32;
#else
constexpr int64_t kDeltaCols = 16;
#endif

// The three passes over a block of `cols` value dims of a state S (dk rows, dv apart), cols <= kDeltaCols:
// read: sk = S^T k, sq = S^T q; update: S = decay S + k u^T; update_and_read: both, the read of the updated
// rows for the next token's kn, qn. (The reference decays S first; same maths, other rounding order.)
inline void read_rows(const float* S, int64_t dk, int64_t dv, int64_t cols, const float* k, const float* q,
                      float* sk, float* sq) {
  std::fill(sk, sk + cols, 0.0f);
  std::fill(sq, sq + cols, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    const float* Sa = S + a * dv;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      sk[j] += Sa[j] * k[a];
      sq[j] += Sa[j] * q[a];
    }
  }
}

#if defined(DELTASERVE_AVX2) && !defined(__AVX512F__)
// S' = fma(k, u, decay S) for 8 value dims at Sa (stored), the one expression of both AVX2 passes below, so that
// a state is the same bits whichever pass wrote it.
inline __m256 update8(float* Sa, __m256 dec, __m256 ka, const float* u) {
  const __m256 r = _mm256_fmadd_ps(ka, _mm256_loadu_ps(u), _mm256_mul_ps(_mm256_loadu_ps(Sa), dec));
  _mm256_storeu_ps(Sa, r);
  return r;
}

// AVX2, 32 value dims.
inline void update_rows32(float* S, int64_t dk, int64_t dv, const float* k, const float* u, float decay) {
  const __m256 dec = _mm256_set1_ps(decay);
  for (int64_t a = 0; a < dk; ++a) {
    const __m256 ka = _mm256_set1_ps(k[a]);
    for (int c = 0; c < 4; ++c) update8(S + a * dv + 8 * c, dec, ka, u + 8 * c);
  }
}

// AVX2, 32 value dims: the 8 accumulators of S^T k and S^T q stay in registers through the dk rows.
inline void update_and_read32(float* S, int64_t dk, int64_t dv, const float* k, const float* u, float decay,
                              const float* kn, const float* qn, float* sk, float* sq) {
  __m256 ak[4], aq[4];
  for (int c = 0; c < 4; ++c) ak[c] = aq[c] = _mm256_setzero_ps();
  const __m256 dec = _mm256_set1_ps(decay);
  for (int64_t a = 0; a < dk; ++a) {
    const __m256 ka = _mm256_set1_ps(k[a]), kna = _mm256_set1_ps(kn[a]), qna = _mm256_set1_ps(qn[a]);
    for (int c = 0; c < 4; ++c) {
      const __m256 r = update8(S + a * dv + 8 * c, dec, ka, u + 8 * c);
      ak[c] = _mm256_fmadd_ps(r, kna, ak[c]);
      aq[c] = _mm256_fmadd_ps(r, qna, aq[c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(sk + 8 * c, ak[c]);
    _mm256_storeu_ps(sq + 8 * c, aq[c]);
  }
}
#endif

// (The generic passes below also write S' by one expression.)
inline void update_rows(float* S, int64_t dk, int64_t dv, int64_t cols, const float* k, const float* u, float decay) {
#if defined(DELTASERVE_AVX2) && !defined(__AVX512F__)
  if (cols == 32) return update_rows32(S, dk, dv, k, u, decay);
#endif
  for (int64_t a = 0; a < dk; ++a) {
    float* Sa = S + a * dv;
    const float ka = k[a];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) Sa[j] = Sa[j] * decay + ka * u[j];
  }
}

inline void update_and_read(float* S, int64_t dk, int64_t dv, int64_t cols, const float* k, const float* u,
                            float decay, const float* kn, const float* qn, float* sk, float* sq) {
#if defined(DELTASERVE_AVX2) && !defined(__AVX512F__)
  if (cols == 32) return update_and_read32(S, dk, dv, k, u, decay, kn, qn, sk, sq);
#endif
  std::fill(sk, sk + cols, 0.0f);
  std::fill(sq, sq + cols, 0.0f);
  for (int64_t a = 0; a < dk; ++a) {
    float* Sa = S + a * dv;
    const float ka = k[a], kna = kn[a], qna = qn[a];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const float r = Sa[j] * decay + ka * u[j];
      Sa[j] = r;
      sk[j] += r * kna;
      sq[j] += r * qna;
    }
  }
}

// One value head's inputs at each of its sequence's tokens.
struct HeadTokens {
  const float* mixed;  // q|k|v rows after the conv, SiLU and norms, C apart
  int64_t C, q, k, v;  // the row stride; this head's q, k and v offsets in a row
  float* out;          // its output rows, out_stride apart
  int64_t out_stride;
  const float *beta, *decay, *kq;  // per token: beta, exp(g) and k.q
  const float* row(int64_t i) const { return mixed + i * C; }
};

// The gated delta rule over a head's n tokens for the value dims [j0, j0 + cols) of its state. With
//   S' = decay S + k u^T,  u = beta (v - decay S^T k),  o = S'^T q = decay S^T q + (k.q) u,
// one pass over the block writes a token's S' and reads S'^T k and S'^T q for the next token, while the block
// (dk x cols floats) stays in L1. S: the state the tokens start from (unread when zero_start); verify
// segments give states [n] for the state after each token (S is then only read), the others none (S is
// updated in place).
void delta_rule_block(const HeadTokens& h, int64_t n, int64_t dk, int64_t dv, int64_t j0, int64_t cols, float* S,
                      bool zero_start, float* const* states) {
  float sk[kDeltaCols] = {}, sq[kDeltaCols] = {}, u[kDeltaCols];
  S += j0;
  if (!zero_start) read_rows(S, dk, dv, cols, h.row(0) + h.k, h.row(0) + h.q, sk, sq);
  for (int64_t i = 0; i < n; ++i) {
    if (states) {  // verify: token i's state starts as a copy of the one before it
      float* dst = states[i] + j0;
      for (int64_t a = 0; a < dk; ++a) {
        if (i == 0 && zero_start) {
          std::fill(dst + a * dv, dst + a * dv + cols, 0.0f);
        } else {
          std::memcpy(dst + a * dv, S + a * dv, cols * sizeof(float));
        }
      }
      S = dst;
    }
    const float* x = h.row(i);
    const float beta = h.beta[i], decay = h.decay[i], kq = h.kq[i];
    const float* v = x + h.v + j0;
    float* o = h.out + i * h.out_stride + j0;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      u[j] = beta * (v[j] - decay * sk[j]);
      o[j] = decay * sq[j] + kq * u[j];
    }
    if (i + 1 < n) {
      update_and_read(S, dk, dv, cols, x + h.k, u, decay, h.row(i + 1) + h.k, h.row(i + 1) + h.q, sk, sq);
    } else {
      update_rows(S, dk, dv, cols, x + h.k, u, decay);
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
  // k heads in the block (q also scaled by dk^-1/2). With the models' kernel of 4, a segment that is not a verify
  // segment reads the inputs of its tokens from the 4th on from the rows of proj, channels side by side (conv_w
  // transposed into taps [4, C] for this call: vectorizes), and sets its conv state from its last 3 rows.
  std::vector<float> taps;  // (the stepwise K == 4 loop reads them too: contiguous, faster than conv_w's stride 4)
  if (K == 4) {
    taps.resize(4 * C);
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < 4; ++j) taps[j * C + c] = cw[c * 4 + j];
    }
  }
  const float* tap = taps.data();
  const int64_t block = std::max<int64_t>(1, kConvChannels / dk) * dk, blocks = (C + block - 1) / block;
  at::parallel_for(0, bt.B * blocks, grain_for(tokens_per_seq * block * (K + 8)), [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / blocks, c0 = item % blocks * block, c1 = std::min(C, c0 + block);
      const int64_t row = bt.spec_index[b];
      const bool fresh = bt.context_lens[b] == 0;
      const int64_t at = c0 * (K - 1), size = (c1 - c0) * (K - 1);  // the block's part of a conv state
      float* conv_slot = conv_cache + bt.state_slots[b] * conv_size;
      const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
      const bool from_rows = K == 4 && row < 0;
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
        if (from_rows && i >= 3) {
          const float *x0 = xin - 3 * width, *x1 = xin - 2 * width, *x2 = xin - width;
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) {
            mixed[c] = silu(x0[c] * tap[c] + x1[c] * tap[C + c] + x2[c] * tap[2 * C + c] + xin[c] * tap[3 * C + c]);
          }
        } else if (K == 4) {  // the models' kernel size: fixed taps let this loop vectorize
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) {
            float* st = conv + c * 3;
            const float s0 = st[0], s1 = st[1], s2 = st[2], xc = xin[c];
            st[0] = s1;
            st[1] = s2;
            st[2] = xc;
            mixed[c] = silu(s0 * tap[c] + s1 * tap[C + c] + s2 * tap[2 * C + c] + xc * tap[3 * C + c]);
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
      if (from_rows && n > 3) {  // the state: the last 3 inputs (the stepwise tokens shifted it before)
        const float* last = pp + (t0 + n - 3) * width;
        for (int64_t c = c0; c < c1; ++c) {
          for (int64_t j = 0; j < 3; ++j) conv[c * 3 + j] = last[j * width + c];
        }
      }
      for (int64_t i = n; row >= 0 && i < bt.spec_width; ++i) {  // padding positions keep the last state
        std::memcpy(spec_conv_p + (row * bt.spec_width + i) * conv_size + at, conv + at, size * sizeof(float));
      }
    }
  });

  // Then, per (sequence, value head), the gated delta rule over the sequence's tokens (the heads' states are
  // independent: a prompt's heads are shared between threads), a block of value dims at a time, and the gated
  // RMSNorm.
  at::parallel_for(0, bt.B * Hv, grain_for(tokens_per_seq * head_size * 3), [&](int64_t i0, int64_t i1) {
    std::vector<float> beta, decay, kq;
    std::vector<float*> states;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hv, hv = item % Hv;
      const int64_t row = bt.spec_index[b];
      const bool fresh = bt.context_lens[b] == 0;
      float* S_slot = ssm_cache + bt.state_slots[b] * ssm_size + hv * head_size;
      const int64_t t0 = bt.qsl[b], n = bt.qsl[b + 1] - t0;
      if (fresh && row < 0) std::fill(S_slot, S_slot + head_size, 0.0f);
      beta.resize(n), decay.resize(n), kq.resize(n);
      const HeadTokens h{mixed_all + t0 * C, C, (hv / rep) * dk, key_dim + (hv / rep) * dk, 2 * key_dim + hv * dv,
                         out + t0 * value_dim + hv * dv, value_dim, beta.data(), decay.data(), kq.data()};
      for (int64_t i = 0; i < n; ++i) {
        const float* xin = pp + (t0 + i) * width;
        beta[i] = sigmoid(xin[C + value_dim + hv]);
        decay[i] = std::exp(neg_a[hv] * softplus(xin[C + value_dim + Hv + hv] + dt_bias[hv]));
        kq[i] = dot(h.row(i) + h.k, h.row(i) + h.q, dk);
      }
      states.clear();
      for (int64_t i = 0; row >= 0 && i < n; ++i) {
        states.push_back(spec_ssm_p + (row * bt.spec_width + i) * ssm_size + hv * head_size);
      }
      float* const* per_token = row >= 0 ? states.data() : nullptr;
      for (int64_t j0 = 0; j0 < dv && n > 0; j0 += kDeltaCols) {
        delta_rule_block(h, n, dk, dv, j0, std::min(kDeltaCols, dv - j0), S_slot, fresh, per_token);
      }
      for (int64_t i = 0; i < n; ++i) {
        gated_rms_norm_row(out + (t0 + i) * value_dim + hv * dv, pp + (t0 + i) * width + C + hv * dv, norm_w, d.eps, dv);
      }
      const float* last = row >= 0 && n > 0 ? states[n - 1] : S_slot;
      for (int64_t i = n; row >= 0 && i < bt.spec_width; ++i) {  // padding positions keep the last state
        std::memcpy(spec_ssm_p + (row * bt.spec_width + i) * ssm_size + hv * head_size, last, head_size * sizeof(float));
      }
    }
  });
  return core;
}

}  // namespace deltaserve
