// The layer stack: the whole forward of the trunk (or of the MTP head) for one engine step in one C++ call.
// Projections go to linear.h (the model's stored weights in their formats, widened in registers); everything
// between them is one loop nest per token and head (gdn.h, attention.h, norms.h) instead of a few hundred
// small torch ops. Same maths as deltaserve/model/*.py, which stays the reference (tests/test_fused_step.py
// holds the two together). Weights in any format of formats.h; fp32 activations and state caches; the KV
// cache fp32 or fp8 (attention.h, KVCache).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention.h"
#include "batch.h"
#include "gdn.h"
#include "greedy_screen.h"
#include "linear.h"
#include "moe.h"

namespace deltaserve {

// The model's sizes (the config's names in FusedStack's constructor).
struct Dims {
  int64_t hidden, intermediate, vocab;
  int64_t hk, hv, dk, dv, conv_dim, kernel;  // Gated DeltaNet
  int64_t nh, nkv, hd, rotary_dim;           // attention
  MoeDims moe;                               // sparse MLPs (0 experts in a dense model)
  int64_t fp8_group = 0, int8_group = 0, int4_group = 0;  // columns per scale (0: no such weights)
  bool int8_activations = false;  // int8 / int4 projections quantize their input rows (linear_int.h)
  bool bf16_activations = false;  // every projection reads its input rows rounded to bf16 (linear.h)
  float eps;

  int64_t group(Format f) const {
    return f == Format::kFp8 ? fp8_group : f == Format::kInt8 ? int8_group : f == Format::kInt4 ? int4_group : 0;
  }

  GdnDims gdn() const { return {hk, hv, dk, dv, conv_dim, kernel, eps}; }
  AttentionDims attention() const { return {nh, nkv, hd, rotary_dim, eps}; }
};

struct GdnWeights {
  Linear in_w;    // [conv_dim + value_dim + 2*hv, hidden]: rows of in_proj_qkv | z | b | a
  GdnTensors t;   // conv weight, decay and norm parameters, the layer's state caches
  Linear out_w;   // [hidden, value_dim]
};

struct AttnWeights {
  Linear qkv_w;                 // [2*nh*hd + 2*nkv*hd, hidden]: rows of q_proj | k_proj | v_proj
  Linear kv_w;                  // its k_proj | v_proj parts alone
  at::Tensor q_scale, k_scale;  // [hd] = 1 + q_norm / k_norm weight
  Linear o_w;                   // [hidden, nh*hd]
  KVCache kv;                   // the layer's paged K/V (fp32, or fp8 with row scales: attention.h)
};

struct Layer {
  bool gdn;
  at::Tensor in_scale, post_scale;  // [hidden] = 1 + weight of the two RMSNorms
  Linear gate_up_w;                 // [2*intermediate, hidden]: rows of gate_proj | up_proj
  Linear down_w;                    // [hidden, intermediate]
  bool sparse = false;              // a sparse-MoE MLP (moe) instead of gate_up_w and down_w
  MoeWeights moe;
  GdnWeights g;
  AttnWeights a;
};

// A stack of decoder layers between an input and a final norm: the trunk (input: token embeddings), or the
// MTP head (input: fc(cat[norm(embedding of token t+1), norm(trunk hidden at t)])).
class FusedStack {
 public:
  // dims: the config's sizes by name (hidden_size, ..., rotary_dim; fp8_group, int8_group, int4_group where
  // the stack has weights in those formats); head: the stack's own tensors by name (embed_tokens.weight,
  // norm.scale, rotary.inv_freq, lm_head.weight, and for the MTP head fc.weight, pre_fc_norm_embedding.scale,
  // pre_fc_norm_hidden.scale); layers: each layer's tensors by name (deltaserve/executor/fused_cpu/stack.py,
  // _layer_weights), its type in layer_types. A weight P.weight is in the format its dtype names
  // (formats.h), with its scales P.weight_scale when quantized (the experts' 3-D tensors: P and P_scale).
  // Every tensor is checked against the shape the dims give it; errors name it. The tensors are used where
  // they are, not copied: the model's own weights, the cache's own tensors.
  FusedStack(std::map<std::string, int64_t> dims, double eps, std::map<std::string, at::Tensor> head,
             const std::vector<std::string>& layer_types, std::vector<std::map<std::string, at::Tensor>> layers,
             bool mtp);

  // Every tensor the stack holds, by name ("layer 3 mlp.gate_proj.weight", "lm_head.screen.norms"): to
  // account for its memory.
  const std::vector<std::pair<std::string, at::Tensor>>& named_tensors() const { return held_; }

  // Returns the final-normed hidden states [T, hidden] (with output_rows, [R, hidden] of those rows only: see
  // OutputRows) and, per GDN layer, the per-position conv [S, L, conv_dim, kernel-1] and recurrent
  // [S, L, hv, dk, dv] states of the verify segments (empty lists when spec_rows == 0). positions: [T] text
  // positions, or [3, T] mRoPE (t, h, w) positions, which rotate q and k only: the cache and the causal mask
  // read each token's index in its sequence (rope.h). mm_rows [R] / mm_embeds [R, hidden]: rows whose token
  // embeddings the visual tokens replace (ForwardContext.mm_embeds), applied right after the lookup.
  std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> forward(
      const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& qsl,
      const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& slot_mapping,
      const at::Tensor& state_slots, const at::Tensor& spec_index, int64_t spec_rows, int64_t spec_width,
      const at::Tensor& hidden_in, const std::optional<at::Tensor>& output_rows,
      const std::optional<at::Tensor>& mm_rows, const std::optional<at::Tensor>& mm_embeds);

  // fp32 logits [R, vocab] of final-normed hidden rows [R, hidden]
  at::Tensor logits(const at::Tensor& hidden);

  // The greedy token of each row, torch.argmax of its logits, without handing the [R, vocab] logits back
  // (without writing them at all: the projection's argmax, or the greedy screen).
  at::Tensor greedy_tokens(const at::Tensor& hidden);

  // The greedy token of each row under a grammar's bitmask (int32 [R, ceil(vocab / 32)], llguidance's
  // layout): torch.argmax of the masked logits (deltaserve/ops/token_mask.py), projecting only the panels
  // that hold an allowed token (masked_argmax.h).
  at::Tensor masked_greedy_tokens(const at::Tensor& hidden, const at::Tensor& allowed);

  // After a verify step: verify segment r keeps in its GDN slot slots[r] the conv and recurrent states after
  // its position pick[r], the last accepted token. conv_states / ssm_states: per GDN layer, in layer order,
  // the per-position states [S, L, ...] that forward() returned (or the Python model left). One call and a
  // memcpy per state instead of a few dozen small torch ops per step.
  void commit_verified(const std::vector<at::Tensor>& conv_states, const std::vector<at::Tensor>& ssm_states,
                       const at::Tensor& slots, const at::Tensor& pick);

  // Whether greedy_tokens screens with bf16 dot products (see screened_greedy): the CPU has AVX512-BF16,
  // the lm_head is stored in bf16 and finite, and set_greedy_screen has not turned it off (for measurements).
  bool greedy_screen_on() const { return use_greedy_screen_ && ready(greedy_screen_); }
  void set_greedy_screen(bool on) { use_greedy_screen_ = on; }

  // Prompt chunks whose cached K and V (per layer) exceed this many bytes attend through torch's fused
  // kernel, the others in the loop (kLoopKVBytes unless set; tests set 0 to check both paths).
  void set_loop_kv_bytes(int64_t bytes) { loop_kv_bytes_ = bytes; }

  // While on, forward() adds the seconds it spends in each part to the profile; profile() returns and
  // clears {projections, GDN conv + recurrence, attention, whole forward}.
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<double> profile();

  // Tensor parallelism: all_reduce sums a tensor over the ranks in place. forward() calls it (outside any
  // parallel loop) with the partial output of each row-parallel projection (o_proj, linear_attn.out_proj,
  // mlp.down_proj, a sparse MLP's summed expert and shared expert outputs) before adding it to the residual, and with the embedding rows: this rank's embedding holds
  // vocabulary rows [vocab_start, vocab_start + vocab_size), and ids outside them give zero rows. Unset (one
  // rank), nothing changes.
  void set_all_reduce(std::function<void(at::Tensor&)> all_reduce, int64_t vocab_start);

 private:
  enum Part { kProjections, kRecurrence, kAttention, kForward, kParts };
  double* slot(Part part) { return profiling_ ? &spent_[part] : nullptr; }
  void reduce(at::Tensor& partial) const {
    if (all_reduce_) all_reduce_(partial);
  }
  at::Tensor embed(const at::Tensor& input_ids) const;
  // x[rows[r]] = embeds[r]: the visual tokens in place of their placeholders' embeddings
  void replace_rows(at::Tensor& x, const at::Tensor& rows, const at::Tensor& embeds) const;

  void check_hidden(const at::Tensor& hidden) const;
  // hidden as the lm_head reads it (contiguous; rounded to bf16 under bf16 activations)
  at::Tensor lm_head_input(const at::Tensor& hidden) const;
  at::Tensor project(const Linear& l, const at::Tensor& x);
  at::Tensor sparse_mlp(const MoeWeights& w, const at::Tensor& h);
  at::Tensor gdn(const GdnWeights& w, const at::Tensor& h, const Batch& bt, const at::Tensor& spec_conv,
                 const at::Tensor& spec_ssm, const OutputRows* only);
  at::Tensor gdn_rows(const GdnWeights& w, const at::Tensor& h, const Batch& bt, const at::Tensor& spec_conv,
                      const at::Tensor& spec_ssm, const OutputRows* only);
  at::Tensor attention(const AttnWeights& w, const at::Tensor& h, const Batch& bt, const float* cos,
                       const float* sin, const OutputRows* only);
  at::Tensor attention_rows(const AttnWeights& w, const at::Tensor& h, const Batch& bt, const float* cos,
                            const float* sin, const OutputRows* only);

  Dims d_;
  int64_t num_slots_ = -1, num_blocks_ = -1, block_size_ = 1;
  bool profiling_ = false;
  std::array<double, kParts> spent_{};
  WeightPart embed_;  // [vocab, hidden] in its format
  at::Tensor final_scale_, inv_freq_;
  at::Tensor rotary_axis_;  // int64 [rotary_dim / 2]: the mRoPE position row of each frequency (rope.h)
  Linear lm_head_;
  GreedyScreen greedy_screen_;
  bool use_greedy_screen_ = true;
  int64_t loop_kv_bytes_ = kLoopKVBytes;
  Linear fc_;  // MTP head only, with the two pre-fc norm scales
  at::Tensor pre_embed_scale_, pre_hidden_scale_;
  std::vector<Layer> layers_;
  std::vector<std::pair<std::string, at::Tensor>> held_;
  std::function<void(at::Tensor&)> all_reduce_;  // tensor parallelism only (set_all_reduce)
  int64_t vocab_start_ = 0;
};

}  // namespace deltaserve
