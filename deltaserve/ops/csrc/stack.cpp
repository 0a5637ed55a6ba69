#include "stack.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "masked_argmax.h"
#include "norms.h"
#include "parallel.h"
#include "rope.h"
#include "simd.h"
#include "step_memory.h"

namespace deltaserve {

namespace {

// A dense MLP takes a prompt chunk's rows this many at a time, at most (FusedStack::forward), and a GDN or
// attention layer its sequences in blocks of about this many rows (over_sequence_blocks). 256 rather than 512:
// the 0.8B int8 engine's 1,024-row step peaked 28 MB above its start instead of 44 (live activations), and
// VmHWM over bench_formats' workload fell from 1.47-1.50 to 1.44-1.46 GiB; the 512-token prefill took 1.01x
// as long (one more pass over the MLP's weights per 512 rows).
constexpr int64_t kLayerRowBlock = 256;

// The step's sequences [b0, b1) in blocks of whole sequences: a block closes before the sequence that would take
// it past max_rows, once it has over kDotRows rows (a longer sequence makes a block of its own); a last block
// of kDotRows rows or fewer joins the one before. So when the step has over kDotRows rows, every block does,
// and each row's projections take the kernel they take in one call of all the rows: the same numbers.
std::vector<std::pair<int64_t, int64_t>> sequence_blocks(const Batch& bt, int64_t max_rows) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  int64_t b0 = 0;
  for (int64_t b = 0; b < bt.B; ++b) {
    if (b > b0 && bt.qsl[b + 1] - bt.qsl[b0] > max_rows && bt.qsl[b] - bt.qsl[b0] > kDotRows) {
      blocks.emplace_back(b0, b);
      b0 = b;
    }
  }
  blocks.emplace_back(b0, bt.B);
  if (blocks.size() > 1 && bt.qsl[bt.B] - bt.qsl[blocks.back().first] <= kDotRows) {
    blocks[blocks.size() - 2].second = bt.B;
    blocks.pop_back();
  }
  return blocks;
}

// The batch of sequences [b0, b1) of bt, its rows from 0 (qsl: their query starts, rebased; kept by the caller).
Batch sub_batch(const Batch& bt, int64_t b0, int64_t b1, std::vector<int64_t>& qsl) {
  const int64_t r0 = bt.qsl[b0];
  qsl.resize(b1 - b0 + 1);
  for (int64_t b = b0; b <= b1; ++b) qsl[b - b0] = bt.qsl[b] - r0;
  return Batch{bt.qsl[b1] - r0, b1 - b0, bt.positions + r0, qsl.data(), bt.context_lens + b0,
               bt.block_tables + b0 * bt.table_width, bt.slot_mapping + r0, bt.state_slots + b0,
               bt.spec_index + b0, bt.table_width, bt.spec_rows, bt.spec_width};
}

// The wanted rows among rows [r0, r1) of the step, rebased to r0.
OutputRows rows_within(const OutputRows& only, int64_t r0, int64_t r1) {
  const int64_t* rp = only.rows.data_ptr<int64_t>();
  const int64_t n = only.rows.numel();
  const int64_t first = std::lower_bound(rp, rp + n, r0) - rp, last = std::lower_bound(rp, rp + n, r1) - rp;
  return OutputRows{only.rows.narrow(0, first, last - first) - r0,
                    std::vector<char>(only.wanted.begin() + r0, only.wanted.begin() + r1)};
}

// fn(rows of h, their sub-batch, its first row, its wanted rows or null) over the step's blocks of whole
// sequences (sequence_blocks: at most kLayerRowBlock rows each unless one sequence is longer), the blocks'
// outputs ([rows, width], or [wanted rows, width] given `only`) copied into the step's in order; one call of
// the whole step when it makes a single block.
template <typename Fn>
at::Tensor over_sequence_blocks(const at::Tensor& h, const Batch& bt, const OutputRows* only, Fn fn) {
  const auto blocks = sequence_blocks(bt, kLayerRowBlock);
  if (blocks.size() < 2) return fn(h, bt, 0, only);
  at::Tensor out;
  std::vector<int64_t> qsl;
  int64_t at = 0;  // the block's first output row
  for (const auto& [b0, b1] : blocks) {
    const int64_t r0 = bt.qsl[b0];
    const Batch sub = sub_batch(bt, b0, b1, qsl);
    const OutputRows wanted = only != nullptr ? rows_within(*only, r0, r0 + sub.T) : OutputRows{};
    const at::Tensor rows = fn(h.narrow(0, r0, sub.T), sub, r0, only != nullptr ? &wanted : nullptr);
    if (!out.defined()) out = at::empty({only != nullptr ? only->rows.numel() : bt.T, rows.size(1)}, rows.options());
    out.narrow(0, at, rows.size(0)).copy_(rows);
    at += rows.size(0);
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
  }
  return out + "]";
}

// A weight's format by its data's dtype (formats.py's WeightFormat.data_dtype).
Format format_of(at::ScalarType dtype, const std::string& name) {
  switch (dtype) {
    case at::kFloat: return Format::kFloat32;
    case at::kBFloat16: return Format::kBFloat16;
    case at::kFloat8_e4m3fn: return Format::kFp8;
    case at::kChar: return Format::kInt8;
    case at::kByte: return Format::kInt4;
    default:
      TORCH_CHECK(false, "FusedStack: ", name, " is ", dtype, ", not a weight format's data (float32, bfloat16, "
                  "float8_e4m3fn for fp8, int8, uint8 for int4)");
  }
}

// One stack's or one layer's tensors by name, each taken with the dtype and exact shape it must have (-1:
// any size, for the caches' slot and block counts). Errors name the tensor:
//   layer 1 linear_attn.in_proj_z.weight: expected [48, 48] got [4, 48]
// and a name left over at the end (misspelt, or not this layer's) is an error too. What is taken is also
// recorded in `held` (FusedStack::named_tensors).
class NamedTensors {
 public:
  NamedTensors(std::map<std::string, at::Tensor> tensors, std::string where,
               std::vector<std::pair<std::string, at::Tensor>>& held)
      : tensors_(std::move(tensors)), where_(std::move(where)), held_(held) {}

  at::Tensor take(const std::string& name, const std::vector<int64_t>& shape, at::ScalarType dtype = at::kFloat) {
    auto it = tensors_.find(name);
    TORCH_CHECK(it != tensors_.end(), "FusedStack: ", where_, "missing tensor ", name, " ", shape_text(shape));
    at::Tensor t = it->second;
    tensors_.erase(it);
    bool same = t.dim() == static_cast<int64_t>(shape.size());
    for (int64_t i = 0; same && i < t.dim(); ++i) same = shape[i] < 0 || t.size(i) == shape[i];
    TORCH_CHECK(same, "FusedStack: ", where_, name, ": expected ", shape_text(shape), " got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype, "FusedStack: ", where_, name, ": expected ", dtype, " got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "FusedStack: ", where_, name, " must be contiguous");
    held_.emplace_back(where_ + name, t);
    return t;
  }

  // Weight `name` of rows x K inputs in its stored format (the data's dtype: float32, bfloat16,
  // float8_e4m3fn, int8, or uint8 for int4's nibbles) with, for the quantized ones, its scales `name`_scale.
  // `lead`: leading dims (the experts' [E]).
  std::pair<at::Tensor, at::Tensor> stored(const std::string& name, std::vector<int64_t> shape, int64_t K,
                                           Format& format) {
    auto it = tensors_.find(name);
    std::vector<int64_t> full = shape;
    full.push_back(K);
    TORCH_CHECK(it != tensors_.end(), "FusedStack: ", where_, "missing tensor ", name, " ", shape_text(full));
    format = format_of(it->second.scalar_type(), where_ + name);
    full.back() = format == Format::kInt4 ? (K + 1) / 2 : K;
    const at::Tensor data = take(name, full, it->second.scalar_type());
    at::Tensor scale;
    const std::string scale_name = name + "_scale";
    if (quantized(format)) {
      TORCH_CHECK(has(scale_name), "FusedStack: ", where_, name, " is ", format_name(format), " but ", scale_name,
                  " is missing");
      full.back() = -1;
      scale = take(scale_name, full, format == Format::kFp8 ? at::kFloat : at::kBFloat16);
    }
    return {data, scale};
  }

  WeightPart weight(const std::string& name, int64_t rows, int64_t K, const Dims& d) {
    Format format;
    auto [data, scale] = stored(name, {rows}, K, format);
    return make_part(data, scale, format, d.group(format), K, "FusedStack: " + where_ + name);
  }

  // A projection of these row blocks (name, rows) of K inputs each, each in its own format.
  Linear projection(const std::vector<std::pair<std::string, int64_t>>& parts, int64_t K, const Dims& d) {
    std::vector<WeightPart> weights;
    for (const auto& [name, rows] : parts) weights.push_back(weight(name, rows, K, d));
    return make_linear(std::move(weights), d.int8_activations, d.bf16_activations);
  }

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::string& where() const { return where_; }

  void finish() const {
    for (const auto& [name, t] : tensors_) TORCH_CHECK(false, "FusedStack: ", where_, "unexpected tensor ", name);
  }

 private:
  std::map<std::string, at::Tensor> tensors_;
  std::string where_;
  std::vector<std::pair<std::string, at::Tensor>>& held_;
};

Dims dims_by_name(std::map<std::string, int64_t> dims, double eps) {
  auto take = [&](const std::string& name, bool zero_ok = false) {
    auto it = dims.find(name);
    TORCH_CHECK(it != dims.end(), "FusedStack: missing dim ", name);
    const int64_t v = it->second;
    dims.erase(it);
    TORCH_CHECK(v > 0 || (zero_ok && v == 0), "FusedStack: dim ", name, " = ", v, " must be positive");
    return v;
  };
  Dims d{};
  d.hidden = take("hidden_size");
  d.intermediate = take("intermediate_size", true);  // 0: no dense MLP
  d.vocab = take("vocab_size");
  d.hk = take("linear_num_key_heads");
  d.hv = take("linear_num_value_heads");
  d.dk = take("linear_key_head_dim");
  d.dv = take("linear_value_head_dim");
  d.kernel = take("linear_conv_kernel_dim");
  d.nh = take("num_attention_heads");
  d.nkv = take("num_key_value_heads");
  d.hd = take("head_dim");
  d.rotary_dim = take("rotary_dim");
  d.moe.experts = take("num_experts", true);
  d.moe.top_k = take("num_experts_per_tok", true);
  d.moe.inter = take("moe_intermediate_size", true);
  d.moe.shared_inter = take("shared_expert_intermediate_size", true);
  d.moe.norm_topk = take("norm_topk_prob", true) != 0;
  // the quantized formats' group sizes (columns per scale), where the stack has such weights
  for (auto [name, group] : {std::pair{"fp8_group", &d.fp8_group}, {"int8_group", &d.int8_group},
                             {"int4_group", &d.int4_group}}) {
    if (dims.count(name) != 0) *group = take(name);
  }
  // activation_quantization = "int8" (present and 1): the int8 / int4 projections read int8 activations
  if (dims.count("int8_activations") != 0) d.int8_activations = take("int8_activations", true) != 0;
  // activation_quantization = "bf16" (present and 1): every projection reads its rows rounded to bf16
  if (dims.count("bf16_activations") != 0) d.bf16_activations = take("bf16_activations", true) != 0;
  d.conv_dim = 2 * d.hk * d.dk + d.hv * d.dv;
  d.eps = static_cast<float>(eps);
  for (const auto& [name, v] : dims) TORCH_CHECK(false, "FusedStack: unexpected dim ", name);
  TORCH_CHECK(d.hv % d.hk == 0, "FusedStack: linear_num_value_heads must be a multiple of linear_num_key_heads");
  TORCH_CHECK(d.nh % d.nkv == 0, "FusedStack: num_attention_heads must be a multiple of num_key_value_heads");
  TORCH_CHECK(d.rotary_dim % 2 == 0 && d.rotary_dim <= d.hd, "FusedStack: rotary_dim must be even and <= head_dim");
  TORCH_CHECK(d.kernel >= 2, "FusedStack: linear_conv_kernel_dim must be at least 2");
  return d;
}

// A sparse-MoE MLP's tensors (stack.py, _add_sparse_mlp): the router and shared expert, and the experts' 3-D
// tensors (expert e is row block e of each), in their formats.
MoeWeights take_moe(NamedTensors& w, const Dims& d) {
  const MoeDims& m = d.moe;
  TORCH_CHECK(m.experts > 0 && m.top_k > 0 && m.top_k <= m.experts && m.inter > 0 && m.shared_inter > 0,
              "FusedStack: a sparse MLP needs num_experts, num_experts_per_tok <= num_experts, "
              "moe_intermediate_size and shared_expert_intermediate_size");
  const int64_t H = d.hidden, E = m.experts, I = m.inter, Is = m.shared_inter;
  MoeWeights out;
  out.router_shared = w.projection({{"mlp.gate.weight", E},
                                    {"mlp.shared_expert.gate_proj.weight", Is},
                                    {"mlp.shared_expert.up_proj.weight", Is},
                                    {"mlp.shared_expert_gate.weight", 1}},
                                   H, d);
  out.shared_down = w.projection({{"mlp.shared_expert.down_proj.weight", H}}, Is, d);
  for (auto [name, N, K] : {std::tuple{std::string("mlp.experts.gate_up_proj"), 2 * I, H},
                            std::tuple{std::string("mlp.experts.down_proj"), H, I}}) {
    Format format;
    const auto [experts, scales] = w.stored(name, {E, N}, K, format);
    (N == H ? out.down : out.gate_up) = expert_linears(experts, scales, format, d.group(format), K,
                                                       d.int8_activations, "FusedStack: " + w.where() + name,
                                                       d.bf16_activations);
  }
  return out;
}

// An attention layer's KV cache: k_cache and v_cache, fp32, or fp8 with their row scales k_cache_scale and
// v_cache_scale (stack.py, _layer_weights). blocks / block_size: -1 until the first attention layer's.
KVCache take_kv_cache(NamedTensors& w, int64_t blocks, int64_t block_size, const Dims& d, size_t layer) {
  const bool fp8 = w.has("k_cache_scale");
  const at::ScalarType type = fp8 ? at::kFloat8_e4m3fn : at::kFloat;
  KVCache c;
  c.k = w.take("k_cache", {blocks, d.nkv, d.hd, block_size}, type);
  c.v = w.take("v_cache", {blocks, block_size, d.nkv, d.hd}, type);
  TORCH_CHECK(c.k.size(0) == c.v.size(0) && c.k.size(3) == c.v.size(1), "FusedStack: layer ", layer, " k_cache ",
              c.k.sizes(), " and v_cache ", c.v.sizes(), " must have the same blocks of the same size");
  if (fp8) {
    c.k_scale = w.take("k_cache_scale", {c.k.size(0), d.nkv, c.k.size(3)});
    c.v_scale = w.take("v_cache_scale", {c.k.size(0), c.k.size(3), d.nkv});
  }
  return c;
}

}  // namespace

FusedStack::FusedStack(std::map<std::string, int64_t> dims, double eps, std::map<std::string, at::Tensor> head,
                       const std::vector<std::string>& layer_types,
                       std::vector<std::map<std::string, at::Tensor>> layers, bool mtp)
    : d_(dims_by_name(std::move(dims), eps)) {
  keep_step_memory_on_the_heap();
  use_step_memory_pool();  // (its large activations: step_memory.h)
  TORCH_CHECK(layer_types.size() == layers.size(), "FusedStack: ", layer_types.size(), " layer types for ",
              layers.size(), " layers");
  const int64_t H = d_.hidden, I = d_.intermediate, V = d_.vocab;
  NamedTensors top(std::move(head), "", held_);
  embed_ = top.weight("embed_tokens.weight", V, H, d_);
  final_scale_ = top.take("norm.scale", {H});
  inv_freq_ = top.take("rotary.inv_freq", {d_.rotary_dim / 2});
  rotary_axis_ = top.take("rotary.axis", {d_.rotary_dim / 2}, at::kLong);
  for (int64_t f = 0; f < d_.rotary_dim / 2; ++f) {
    const int64_t a = rotary_axis_.data_ptr<int64_t>()[f];
    TORCH_CHECK(a >= 0 && a < 3, "FusedStack: rotary.axis[", f, "] = ", a, ", not a position row 0, 1 or 2");
  }
  lm_head_ = top.projection({{"lm_head.weight", V}}, H, d_);
  greedy_screen_ = make_greedy_screen(lm_head_);
#if defined(__AVX512BF16__)  // the portable build's GreedyScreen is empty
  if (ready(greedy_screen_)) held_.emplace_back("lm_head.screen.norms", greedy_screen_.norms);
#endif
  if (mtp) {
    fc_ = top.projection({{"fc.weight", H}}, 2 * H, d_);
    pre_embed_scale_ = top.take("pre_fc_norm_embedding.scale", {H});
    pre_hidden_scale_ = top.take("pre_fc_norm_hidden.scale", {H});
  }
  top.finish();
  const int64_t value_dim = d_.hv * d_.dv, q_width = 2 * d_.nh * d_.hd, kv_rows = d_.nkv * d_.hd;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layer_types[i] == "linear_attention" || layer_types[i] == "full_attention", "FusedStack: layer ",
                i, " has type ", layer_types[i], ", not linear_attention or full_attention");
    NamedTensors w(std::move(layers[i]), "layer " + std::to_string(i) + " ", held_);
    Layer l;
    l.gdn = layer_types[i] == "linear_attention";
    l.in_scale = w.take("input_layernorm.scale", {H});
    l.post_scale = w.take("post_attention_layernorm.scale", {H});
    l.sparse = w.has("mlp.gate.weight");
    if (l.sparse) {
      l.moe = take_moe(w, d_);
    } else {
      TORCH_CHECK(I > 0, "FusedStack: layer ", i, " has a dense MLP but intermediate_size is 0");
      l.gate_up_w = w.projection({{"mlp.gate_proj.weight", I}, {"mlp.up_proj.weight", I}}, H, d_);
      l.down_w = w.projection({{"mlp.down_proj.weight", H}}, I, d_);
    }
    if (l.gdn) {
      l.g.in_w = w.projection({{"linear_attn.in_proj_qkv.weight", d_.conv_dim},
                               {"linear_attn.in_proj_z.weight", value_dim},
                               {"linear_attn.in_proj_b.weight", d_.hv},
                               {"linear_attn.in_proj_a.weight", d_.hv}},
                              H, d_);
      l.g.t.conv_w = w.take("linear_attn.conv1d.weight", {d_.conv_dim, d_.kernel});
      l.g.t.neg_a = w.take("linear_attn.neg_a", {d_.hv});
      l.g.t.dt_bias = w.take("linear_attn.dt_bias", {d_.hv});
      l.g.t.norm_w = w.take("linear_attn.norm.weight", {d_.dv});
      l.g.out_w = w.projection({{"linear_attn.out_proj.weight", H}}, value_dim, d_);
      l.g.t.conv_cache = w.take("conv_cache", {num_slots_, d_.conv_dim, d_.kernel - 1});
      l.g.t.ssm_cache = w.take("ssm_cache", {num_slots_, d_.hv, d_.dk, d_.dv});
      num_slots_ = l.g.t.conv_cache.size(0);  // every GDN layer's caches have this many slots
    } else {
      l.a.qkv_w = w.projection({{"self_attn.q_proj.weight", q_width},
                                {"self_attn.k_proj.weight", kv_rows},
                                {"self_attn.v_proj.weight", kv_rows}},
                               H, d_);
      // k | v alone, the same tensors
      l.a.kv_w = make_linear({l.a.qkv_w.parts[1], l.a.qkv_w.parts[2]}, l.a.qkv_w.int8_activations,
                             l.a.qkv_w.bf16_activations);
      l.a.q_scale = w.take("self_attn.q_norm.scale", {d_.hd});
      l.a.k_scale = w.take("self_attn.k_norm.scale", {d_.hd});
      l.a.o_w = w.projection({{"self_attn.o_proj.weight", H}}, d_.nh * d_.hd, d_);
      l.a.kv = take_kv_cache(w, num_blocks_, num_blocks_ < 0 ? -1 : block_size_, d_, i);
      num_blocks_ = l.a.kv.v.size(0), block_size_ = l.a.kv.v.size(1);  // and every attention layer's these
    }
    w.finish();
    layers_.push_back(std::move(l));
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> FusedStack::forward(
    const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& qsl,
    const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& slot_mapping,
    const at::Tensor& state_slots, const at::Tensor& spec_index, int64_t spec_rows, int64_t spec_width,
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& output_rows,
    const std::optional<at::Tensor>& mm_rows, const std::optional<at::Tensor>& mm_embeds) {
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.is_contiguous() && input_ids.dim() == 1,
              "FusedStack: index tensors are int64");
  Timed whole(slot(kForward));
  const StepRope rope = step_rope(positions, input_ids.size(0), qsl, context_lens, inv_freq_.data_ptr<float>(),
                                  rotary_axis_.data_ptr<int64_t>(), d_.rotary_dim / 2);
  const Batch bt = make_batch(input_ids.size(0), rope.index, qsl, context_lens, block_tables, slot_mapping,
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

  std::vector<at::Tensor> spec_conv, spec_ssm;
  at::Tensor x = embed(input_ids);  // [T, hidden]
  TORCH_CHECK(mm_rows.has_value() == mm_embeds.has_value(), "FusedStack: mm_rows and mm_embeds come together");
  if (mm_rows.has_value()) replace_rows(x, *mm_rows, *mm_embeds);
  if (fc_.defined()) {
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
      mix = attention(l.a, h, bt, rope.cos.data(), rope.sin.data(), only);
    }
    if (only != nullptr) x = x.index_select(0, only->rows);
    reduce(mix);
    x.add_(mix);
    if (l.sparse) {
      at::Tensor moe = sparse_mlp(l.moe, rms_norm_rows(x, l.post_scale, d_.eps));
      reduce(moe);  // tensor parallelism: each rank's experts and shared expert hold part of their width
      x.add_(moe);
      continue;
    }
    // The MLP over equal blocks of at most kLayerRowBlock rows: its [rows, 2I] and [rows, I] activations are
    // among a prompt chunk's largest (the projections pass over their weights per kPackedRowBlock or
    // kAmxRowBlock rows in any case). Every block has over kDotRows rows when there are several, so each
    // row's numbers are those of one call.
    const int64_t I = d_.intermediate, T = x.size(0);
    const int64_t blocks = std::max<int64_t>(1, (T + kLayerRowBlock - 1) / kLayerRowBlock);
    for (int64_t r0 = 0, per = (T + blocks - 1) / blocks; r0 < T; r0 += per) {
      at::Tensor xr = x.narrow(0, r0, std::min(per, T - r0));
      at::Tensor gu = project(l.gate_up_w, rms_norm_rows(xr, l.post_scale, d_.eps));  // [rows, 2I]
      const int64_t rows = xr.size(0);
      at::Tensor act = at::empty({rows, I}, x.options());
      const float* gp = gu.data_ptr<float>();
      float* ap = act.data_ptr<float>();
      for (int64_t t = 0; t < rows; ++t) {
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) ap[t * I + j] = silu(gp[t * 2 * I + j]) * gp[t * 2 * I + I + j];
      }
      gu = at::Tensor();  // (freed before down's output is allocated)
      at::Tensor down = project(l.down_w, act);
      reduce(down);
      xr.add_(down);
    }
  }
  return {rms_norm_rows(x, final_scale_, d_.eps), spec_conv, spec_ssm};
}

void FusedStack::set_all_reduce(std::function<void(at::Tensor&)> all_reduce, int64_t vocab_start) {
  TORCH_CHECK(vocab_start >= 0, "FusedStack: vocab_start must be >= 0");
  all_reduce_ = std::move(all_reduce);
  vocab_start_ = vocab_start;
}

void FusedStack::replace_rows(at::Tensor& x, const at::Tensor& rows, const at::Tensor& embeds) const {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "FusedStack: mm_rows is int64 [R]");
  TORCH_CHECK(embeds.dim() == 2 && embeds.size(0) == rows.size(0) && embeds.size(1) == d_.hidden &&
                  embeds.scalar_type() == at::kFloat,
              "FusedStack: mm_embeds is float32 [R, hidden] for mm_rows [R], not ", embeds.sizes());
  const int64_t T = x.size(0);
  const int64_t* rp = rows.contiguous().data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < T, "FusedStack: mm_rows[", r, "] = ", rp[r], " outside [0, ", T, ")");
  }
  x.index_copy_(0, rows, embeds);
}

at::Tensor FusedStack::embed(const at::Tensor& input_ids) const {
  // Each id's row widened from the embedding's format (a tied quantized lm_head's rows and scales, for one).
  // Vocab-parallel (all_reduce_ set): this rank's rows, zeros for the ids another rank holds; the all-reduce
  // adds the one rank's row each id has (x + 0 = x exactly), as VocabParallelEmbedding does.
  const int64_t T = input_ids.size(0), H = d_.hidden, V = embed_.rows;
  at::Tensor x = at::zeros({T, H}, input_ids.options().dtype(at::kFloat));
  const int64_t* ip = input_ids.data_ptr<int64_t>();
  const uint8_t* data = embed_.bytes;
  const void* scales = embed_.scales;
  float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = ip[t] - vocab_start_;
    if (!all_reduce_) TORCH_CHECK(row >= 0 && row < V, "FusedStack: token id ", ip[t], " is out of the vocabulary");
    if (row < 0 || row >= V) continue;
    for (int64_t k = 0; k < H; k += 16) widen_scalar(embed_, data, scales, row, k, std::min<int64_t>(16, H - k), xp + t * H + k);
  }
  if (all_reduce_) reduce(x);
  return x;
}

at::Tensor FusedStack::logits(const at::Tensor& hidden) {
  check_hidden(hidden);
  return project(lm_head_, hidden.contiguous());
}

at::Tensor FusedStack::greedy_tokens(const at::Tensor& hidden) {
  check_hidden(hidden);
  const at::Tensor h = lm_head_input(hidden);
  at::Tensor out = at::empty({h.size(0)}, h.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  Timed timed(slot(kProjections));
  if (greedy_screen_on() && h.size(0) >= kMinScreenedRows) {
    screened_greedy(h, greedy_screen_, lm_head_, op);
  } else {
    apply(lm_head_, h, op);
  }
  return out;
}

at::Tensor FusedStack::masked_greedy_tokens(const at::Tensor& hidden, const at::Tensor& allowed) {
  check_hidden(hidden);
  const int64_t R = hidden.size(0), words = (lm_head_.N + 31) / 32;
  TORCH_CHECK(allowed.scalar_type() == at::kInt && allowed.dim() == 2 && allowed.size(0) == R &&
                  allowed.size(1) == words,
              "masked_greedy_tokens: allowed must be int32 [", R, ", ", words, "] (a bitmask per row)");
  const at::Tensor h = lm_head_input(hidden), bits = allowed.contiguous();
  at::Tensor out = at::empty({R}, h.options().dtype(at::kLong));
  Timed timed(slot(kProjections));
  masked_argmax(lm_head_, h, bits.data_ptr<int32_t>(), words, out.data_ptr<int64_t>());
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
    for (const auto& [states, cache] :
         {std::pair{conv_states[g], l.g.t.conv_cache}, {ssm_states[g], l.g.t.ssm_cache}}) {
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

at::Tensor FusedStack::lm_head_input(const at::Tensor& hidden) const {
  // bf16 activations: the greedy screen and the masked argmax read h themselves, so it is rounded here
  if (!lm_head_.bf16_activations) return hidden.contiguous();
  return hidden.to(at::kBFloat16).to(at::kFloat).contiguous();
}

void FusedStack::check_hidden(const at::Tensor& hidden) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(1) == lm_head_.K,
              "FusedStack: hidden rows must be float32 [R, ", lm_head_.K, "]");
}

at::Tensor FusedStack::project(const Linear& l, const at::Tensor& x) {
  Timed timed(slot(kProjections));
  return apply(l, x);
}

at::Tensor FusedStack::sparse_mlp(const MoeWeights& w, const at::Tensor& h) {
  return moe_mlp(d_.moe, w, h, slot(kProjections));
}

// A step of several sequences runs its GDN and attention layers, the last one's wanted rows too, over blocks of
// whole sequences (over_sequence_blocks): a prompt chunk's in_proj output [T, conv_dim + value_dim + 2 hv], its
// conv'd q|k|v [T, conv_dim] and core output were its largest activations (67 MB at the 0.8B shape and 1,024
// rows; 17 MB in blocks of 256), and an attention layer's q|gate|k|v [T, 2 nh hd + 2 nkv hd] the largest single
// one (21 MB). Each sequence's recurrence or attention and each row's projections are the same computation
// either way.
at::Tensor FusedStack::gdn(const GdnWeights& w, const at::Tensor& h, const Batch& bt, const at::Tensor& spec_conv,
                           const at::Tensor& spec_ssm, const OutputRows* only) {
  return over_sequence_blocks(h, bt, only,
                              [&](const at::Tensor& rows, const Batch& sub, int64_t, const OutputRows* o) {
                                return gdn_rows(w, rows, sub, spec_conv, spec_ssm, o);
                              });
}

at::Tensor FusedStack::gdn_rows(const GdnWeights& w, const at::Tensor& h, const Batch& bt, const at::Tensor& spec_conv,
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
  const int64_t half = d_.rotary_dim / 2;  // cos and sin are [T, half]
  return over_sequence_blocks(h, bt, only, [&](const at::Tensor& rows, const Batch& sub, int64_t r0,
                                               const OutputRows* o) {
    return attention_rows(w, rows, sub, cos + r0 * half, sin + r0 * half, o);
  });
}

at::Tensor FusedStack::attention_rows(const AttnWeights& w, const at::Tensor& h, const Batch& bt, const float* cos,
                                      const float* sin, const OutputRows* only) {
  const int64_t nh = d_.nh, nkv = d_.nkv, hd = d_.hd;
  const int64_t q_width = 2 * nh * hd, width = q_width + 2 * nkv * hd;
  at::Tensor proj;  // [T, width]: per head q | gate, then k, then v
  if (only != nullptr && w.kv_w.defined()) {  // q | gate only for the wanted rows (the others' stay unset)
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
    norm_rope_and_cache(d_.attention(), proj, w.q_scale, w.k_scale, w.kv, bt, cos, sin, wanted);
    const at::Tensor q = proj.narrow(1, 0, q_width).view({bt.T, nh, 2 * hd}).narrow(2, 0, hd);
    paged_attention(q, w.kv, bt, wanted, loop_kv_bytes_, attn);
    output_gate(proj, nh, hd, wanted, attn);
  }
  return project(w.o_w, only != nullptr ? attn.index_select(0, only->rows) : attn);
}

}  // namespace deltaserve
