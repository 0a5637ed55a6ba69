#include "stack.h"

#include <cstring>
#include <utility>

#include "norms.h"
#include "parallel.h"
#include "simd.h"

namespace deltaserve {

FusedStack::FusedStack(std::vector<at::Tensor> tensors, std::vector<int64_t> layer_is_gdn, std::vector<int64_t> dims,
                       double eps, bool mtp)
    : d_{dims.at(0), dims.at(1), dims.at(2), dims.at(3), dims.at(4), dims.at(5), dims.at(6), dims.at(7),
         dims.at(8), dims.at(9), dims.at(10), dims.at(11), static_cast<float>(eps)} {
  keep_step_memory_on_the_heap();
  size_t i = 0;
  auto next = [&]() {
    TORCH_CHECK(i < tensors.size(), "FusedStack: too few tensors");
    at::Tensor t = tensors[i++];
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "FusedStack: tensor ", i - 1,
                " must be contiguous float32");
    return t;
  };
  // a projection: its fp32 weight, then its bf16 panels or an empty tensor when the values are not bf16
  auto linear = [&]() {
    at::Tensor w = next();
    TORCH_CHECK(i < tensors.size(), "FusedStack: too few tensors");
    at::Tensor panels = tensors[i++];
    if (panels.numel() == 0) return Linear{w, at::Tensor()};
    TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 3 &&
                    panels.size(0) * kPanel >= w.size(0) && panels.size(1) == w.size(1) &&
                    panels.size(2) == kPanel,
                "FusedStack: tensor ", i - 1, " must be the bf16 panels of the weight before it");
    return Linear{w, panels};
  };
  embed_ = next();
  final_scale_ = next();
  inv_freq_ = next();
  lm_head_ = linear();
  if (lm_head_.panels.defined()) greedy_screen_ = make_greedy_screen(lm_head_.w);
  if (mtp) {
    fc_ = linear();
    pre_embed_scale_ = next();
    pre_hidden_scale_ = next();
  }
  for (int64_t is_gdn : layer_is_gdn) {
    Layer l;
    l.gdn = is_gdn != 0;
    l.in_scale = next();
    l.post_scale = next();
    l.gate_up_w = linear();
    l.down_w = linear();
    if (l.gdn) {
      l.g.in_w = linear();
      l.g.t.conv_w = next();
      l.g.t.neg_a = next();
      l.g.t.dt_bias = next();
      l.g.t.norm_w = next();
      l.g.out_w = linear();
      l.g.t.conv_cache = next();
      l.g.t.ssm_cache = next();
    } else {
      l.a.qkv_w = linear();
      const int64_t q_width = 2 * d_.nh * d_.hd;
      if (l.a.qkv_w.panels.defined() && q_width % kPanel == 0) {
        const at::Tensor& w = l.a.qkv_w.w;
        const at::Tensor& panels = l.a.qkv_w.panels;
        l.a.kv_w = {w.narrow(0, q_width, w.size(0) - q_width),
                    panels.narrow(0, q_width / kPanel, panels.size(0) - q_width / kPanel)};
      }
      l.a.q_scale = next();
      l.a.k_scale = next();
      l.a.o_w = linear();
      l.a.k_cache = next();
      l.a.v_cache = next();
    }
    layers_.push_back(std::move(l));
  }
  TORCH_CHECK(i == tensors.size(), "FusedStack: ", tensors.size() - i, " tensors left over");
  for (const Layer& l : layers_) {  // cache sizes, for check_batch (-1: no such layer in this stack)
    if (l.gdn) num_slots_ = l.g.t.conv_cache.size(0);
    else num_blocks_ = l.a.v_cache.size(0), block_size_ = l.a.v_cache.size(1);
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> FusedStack::forward(
    const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& qsl,
    const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& slot_mapping,
    const at::Tensor& state_slots, const at::Tensor& spec_index, int64_t spec_rows, int64_t spec_width,
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& output_rows) {
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.is_contiguous() && input_ids.dim() == 1,
              "FusedStack: index tensors are int64");
  const Batch bt = make_batch(input_ids.size(0), positions, qsl, context_lens, block_tables, slot_mapping,
                              state_slots, spec_index, spec_rows, spec_width);
  check_batch(bt, num_slots_, num_blocks_, block_size_);
  const bool select = output_rows.has_value() && output_rows->numel() < bt.T;
  OutputRows out;
  if (select) {
    TORCH_CHECK(output_rows->dim() == 1 && output_rows->scalar_type() == at::kLong && output_rows->is_contiguous(),
                "FusedStack: output_rows is int64 [R]");
    out.rows = *output_rows;
    out.wanted.assign(bt.T, 0);
    const int64_t* rp = output_rows->data_ptr<int64_t>();
    for (int64_t r = 0; r < output_rows->numel(); ++r) {
      TORCH_CHECK(rp[r] >= 0 && rp[r] < bt.T && (r == 0 || rp[r] > rp[r - 1]),
                  "FusedStack: output_rows must ascend within [0, ", bt.T, ")");
      out.wanted[rp[r]] = 1;
    }
  }
  Timed whole(slot(kForward));

  std::vector<float> cos, sin;
  rope_tables(bt.positions, bt.T, inv_freq_.data_ptr<float>(), d_.rotary_dim / 2, cos, sin);

  std::vector<at::Tensor> spec_conv, spec_ssm;
  at::Tensor x = embed_.index_select(0, input_ids);  // [T, hidden]
  if (fc_.w.defined()) {
    TORCH_CHECK(hidden_in.sizes() == x.sizes() && hidden_in.scalar_type() == at::kFloat,
                "FusedStack: the MTP head needs the trunk hidden of every token, [T, hidden] float32");
    at::Tensor both = at::cat({rms_norm_rows(x, pre_embed_scale_, d_.eps),
                               rms_norm_rows(hidden_in.contiguous(), pre_hidden_scale_, d_.eps)}, 1);
    x = project(fc_, both);
  }
  for (Layer& l : layers_) {
    const OutputRows* only = select && &l == &layers_.back() ? &out : nullptr;
    at::Tensor h = rms_norm_rows(x, l.in_scale, d_.eps);
    at::Tensor mix;
    if (l.gdn) {
      at::Tensor conv_states, ssm_states;
      if (spec_rows > 0) {
        conv_states = at::empty({spec_rows, spec_width, d_.conv_dim, d_.kernel - 1}, x.options());
        ssm_states = at::empty({spec_rows, spec_width, d_.hv, d_.dk, d_.dv}, x.options());
        spec_conv.push_back(conv_states);
        spec_ssm.push_back(ssm_states);
      }
      mix = gdn(l.g, h, bt, conv_states, ssm_states, only);
    } else {
      mix = attention(l.a, h, bt, cos.data(), sin.data(), only);
    }
    if (only != nullptr) x = x.index_select(0, only->rows);
    x.add_(mix);
    at::Tensor gu = project(l.gate_up_w, rms_norm_rows(x, l.post_scale, d_.eps));  // [rows, 2I]
    const int64_t I = d_.intermediate, rows = x.size(0);
    at::Tensor act = at::empty({rows, I}, x.options());
    const float* gp = gu.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t) {
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) ap[t * I + j] = silu(gp[t * 2 * I + j]) * gp[t * 2 * I + I + j];
    }
    x.add_(project(l.down_w, act));
  }
  return {rms_norm_rows(x, final_scale_, d_.eps), spec_conv, spec_ssm};
}

at::Tensor FusedStack::logits(const at::Tensor& hidden) {
  check_hidden(hidden);
  return project(lm_head_, hidden.contiguous());
}

at::Tensor FusedStack::greedy_tokens(const at::Tensor& hidden) {
  check_hidden(hidden);
  const at::Tensor h = hidden.contiguous();
  at::Tensor out = at::empty({h.size(0)}, h.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (lm_head_.panels.defined()) {
    Timed timed(slot(kProjections));
    if (greedy_screen_on() && h.size(0) >= kMinScreenedRows) {
      screened_greedy(h, greedy_screen_, lm_head_, op);
    } else {
      linear_panels(h, lm_head_.panels, lm_head_.w.size(0), op);
    }
    return out;
  }
  const at::Tensor scores = logits(h);
  const int64_t R = scores.size(0), V = scores.size(1);
  const float* sp = scores.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) op[r] = first_argmax(sp + r * V, V);
  return out;
}

void FusedStack::commit_verified(const std::vector<at::Tensor>& conv_states, const std::vector<at::Tensor>& ssm_states,
                     const at::Tensor& slots, const at::Tensor& pick) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && pick.scalar_type() == at::kLong && slots.is_contiguous() &&
                  pick.is_contiguous() && slots.dim() == 1 && pick.sizes() == slots.sizes(),
              "commit_verified: slots and pick are int64 [S]");
  const int64_t S = slots.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = pick.data_ptr<int64_t>();
  size_t g = 0;
  for (const Layer& l : layers_) {
    if (!l.gdn) continue;
    TORCH_CHECK(g < conv_states.size() && g < ssm_states.size(), "commit_verified: one state pair per GDN layer");
    for (const auto& [states, cache] : {std::pair{conv_states[g], l.g.t.conv_cache}, {ssm_states[g], l.g.t.ssm_cache}}) {
      const int64_t row = cache.numel() / cache.size(0);
      TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() >= 2 &&
                      states.size(0) == S && states.numel() == S * states.size(1) * row,
                  "commit_verified: states must be contiguous float32 [S, L, ...] of the cache's rows");
      const int64_t L = states.size(1);
      float* to = cache.data_ptr<float>();
      const float* from = states.data_ptr<float>();
      for (int64_t r = 0; r < S; ++r) {
        TORCH_CHECK(sp[r] >= 0 && sp[r] < cache.size(0) && pp[r] >= 0 && pp[r] < L,
                    "commit_verified: slot or position out of range");
        std::memcpy(to + sp[r] * row, from + (r * L + pp[r]) * row, row * sizeof(float));
      }
    }
    ++g;
  }
  TORCH_CHECK(g == conv_states.size() && g == ssm_states.size(), "commit_verified: one state pair per GDN layer");
}

std::vector<double> FusedStack::profile() {
  std::vector<double> out(spent_.begin(), spent_.end());
  spent_.fill(0.0);
  return out;
}

void FusedStack::check_hidden(const at::Tensor& hidden) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(1) == lm_head_.w.size(1),
              "FusedStack: hidden rows must be float32 [R, ", lm_head_.w.size(1), "]");
}

at::Tensor FusedStack::project(const Linear& l, const at::Tensor& x) {
  Timed timed(slot(kProjections));
  return apply(l, x);
}

at::Tensor FusedStack::gdn(const GdnWeights& w, const at::Tensor& h, const Batch& bt, const at::Tensor& spec_conv,
                           const at::Tensor& spec_ssm, const OutputRows* only) {
  const at::Tensor proj = project(w.in_w, h);  // [T, conv_dim + value_dim + 2 hv]: qkv | z | b | a
  at::Tensor core;
  {
    Timed timed(slot(kRecurrence));
    core = gdn_recurrence(d_.gdn(), w.t, proj, bt, spec_conv, spec_ssm);
  }
  return project(w.out_w, only != nullptr ? core.index_select(0, only->rows) : core);
}

at::Tensor FusedStack::attention(const AttnWeights& w, const at::Tensor& h, const Batch& bt, const float* cos,
                                 const float* sin, const OutputRows* only) {
  const int64_t nh = d_.nh, nkv = d_.nkv, hd = d_.hd;
  const int64_t q_width = 2 * nh * hd, width = q_width + 2 * nkv * hd;
  at::Tensor proj;  // [T, width]: per head q | gate, then k, then v
  if (only != nullptr && w.kv_w.w.defined()) {  // q | gate only for the wanted rows (the others' stay unset)
    proj = at::empty({bt.T, width}, h.options());
    proj.narrow(1, q_width, width - q_width).copy_(project(w.kv_w, h));
    proj.index_copy_(0, only->rows, project(w.qkv_w, h.index_select(0, only->rows)));
  } else {
    proj = project(w.qkv_w, h);
  }
  at::Tensor attn = at::empty({bt.T, nh * hd}, h.options());
  {
    Timed timed(slot(kAttention));
    const char* wanted = only != nullptr ? only->wanted.data() : nullptr;
    norm_rope_and_cache(d_.attention(), proj, w.q_scale, w.k_scale, w.k_cache, w.v_cache, bt, cos, sin, wanted);
    const at::Tensor q = proj.narrow(1, 0, q_width).view({bt.T, nh, 2 * hd}).narrow(2, 0, hd);
    paged_attention(q, w.k_cache, w.v_cache, bt, wanted, loop_kv_bytes_, attn);
    output_gate(proj, nh, hd, wanted, attn);
  }
  return project(w.o_w, only != nullptr ? attn.index_select(0, only->rows) : attn);
}

}  // namespace deltaserve
