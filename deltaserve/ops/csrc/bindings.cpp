// The Python module of the fused step: FusedStack (stack.h) and its kernels one by one, for their tests
// against deltaserve/ops and deltaserve/model (tests/test_kernels.py) and for measurements.
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention.h"
#include "batch.h"
#include "fp8.h"
#include "gdn.h"
#include "linear.h"
#include "linear_amx.h"
#include "linear_vnni.h"
#include "linear_int.h"
#include "moe.h"
#include "norms.h"
#include "stack.h"
#include "step_memory.h"
#include "vision.h"

using namespace deltaserve;

namespace {

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim, name, ": contiguous float32 of ",
              dim, " dims");
}

// A projection's part from Python: (data, scale or None, format name as formats.py's, group size or 0).
using PartSpec = std::tuple<at::Tensor, std::optional<at::Tensor>, std::string, int64_t>;

WeightPart part_of_spec(const PartSpec& spec, int64_t K, const std::string& what) {
  const auto& [data, scale, format, group] = spec;
  return make_part(data, scale.value_or(at::Tensor()), format_named(format), group, K, what);
}

// activation_quantization as the engine names it, checked: "int8" (the int8 / int4 parts read int8
// activations, linear_int.h), "bf16" (every part reads x rounded to bf16, linear.h) or "none".
const std::string& checked_activations(const std::string& activation_quantization) {
  TORCH_CHECK(activation_quantization == "int8" || activation_quantization == "bf16" ||
                  activation_quantization == "none",
              "activation_quantization '", activation_quantization, "' is not known (int8, bf16, none)");
  return activation_quantization;
}

bool int8_activations(const std::string& aq) { return checked_activations(aq) == "int8"; }
bool bf16_activations(const std::string& aq) { return checked_activations(aq) == "bf16"; }

Linear linear_of(const std::vector<PartSpec>& parts, int64_t K, const std::string& activation_quantization = "none") {
  TORCH_CHECK(!parts.empty(), "parts: at least one");
  std::vector<WeightPart> out;
  for (size_t i = 0; i < parts.size(); ++i) out.push_back(part_of_spec(parts[i], K, "part " + std::to_string(i)));
  return make_linear(std::move(out), int8_activations(activation_quantization),
                     bf16_activations(activation_quantization));
}

at::Tensor linear_alone(const at::Tensor& x, const std::vector<PartSpec>& parts,
                        const std::string& activation_quantization) {
  check_float(x, "x", 2);
  return apply(linear_of(parts, x.size(1), activation_quantization), x);
}

at::Tensor linear_argmax_alone(const at::Tensor& x, const std::vector<PartSpec>& parts,
                               const std::string& activation_quantization) {
  check_float(x, "x", 2);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  apply(linear_of(parts, x.size(1), activation_quantization), x, out.data_ptr<int64_t>());
  return out;
}

// The vision tower's fp32 scheme (vision.h) from Python: a LayerNorm as (fp32 weight, fp32 bias, eps), a
// projection as (its part, fp32 bias [N], activation_quantization as linear's: "int8" where its int8 / int4
// part quantizes its input rows, else "none").
using NormSpec = std::tuple<at::Tensor, at::Tensor, double>;
using ProjectionSpec = std::tuple<PartSpec, at::Tensor, std::string>;

VisionNorm vision_norm_of(const NormSpec& spec, const char* what) {
  const auto& [weight, bias, eps] = spec;
  check_float(weight, what, 1);
  check_float(bias, what, 1);
  TORCH_CHECK(bias.size(0) == weight.size(0), what, ": weight and bias of one size, got ", weight.size(0), " and ",
              bias.size(0));
  return VisionNorm{weight, bias, eps};
}

VisionProjection vision_projection_of(const ProjectionSpec& spec, int64_t K, const std::string& what) {
  const auto& [part, bias, activation_quantization] = spec;
  VisionProjection p{make_linear({part_of_spec(part, K, what)}, int8_activations(activation_quantization),
                                 bf16_activations(activation_quantization)),
                     bias};
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.dim() == 1 && bias.size(0) == p.linear.N,
              what, ": a contiguous float32 bias [", p.linear.N, "] expected");
  return p;
}

void vision_block_f32_alone(const at::Tensor& x, const NormSpec& norm1, const ProjectionSpec& qkv,
                            const ProjectionSpec& proj, const NormSpec& norm2, const ProjectionSpec& fc1,
                            const ProjectionSpec& fc2, int64_t heads, const std::string& act, const at::Tensor& cos,
                            const at::Tensor& sin, const std::vector<int64_t>& segments, bool bf16_attention) {
  check_float(x, "x", 2);
  const int64_t hidden = x.size(1);
  VisionBlockWeights w;
  w.norm1 = vision_norm_of(norm1, "norm1"), w.norm2 = vision_norm_of(norm2, "norm2");
  w.qkv = vision_projection_of(qkv, hidden, "qkv"), w.proj = vision_projection_of(proj, hidden, "proj");
  w.fc1 = vision_projection_of(fc1, hidden, "fc1"), w.fc2 = vision_projection_of(fc2, w.fc1.linear.N, "fc2");
  w.heads = heads, w.act = vision_activation_named(act), w.bf16_attention = bf16_attention;
  vision_block_f32(x, w, cos, sin, segments);
}

at::Tensor vision_merger_f32_alone(const at::Tensor& x, const NormSpec& norm, int64_t merged,
                                   const ProjectionSpec& fc1, const ProjectionSpec& fc2) {
  const VisionProjection first = vision_projection_of(fc1, merged, "fc1");
  return vision_merger_f32(x, vision_norm_of(norm, "norm"), merged, first,
                           vision_projection_of(fc2, first.linear.N, "fc2"));
}

at::Tensor rms_norm_alone(const at::Tensor& x, const at::Tensor& scale, double eps) {
  check_float(x, "x", 2);
  check_float(scale, "scale", 1);
  TORCH_CHECK(scale.size(0) == x.size(1), "scale: [n] for x [T, n]");
  return rms_norm_rows(x, scale, static_cast<float>(eps));
}

at::Tensor gated_rms_norm_alone(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && z.scalar_type() == at::kFloat && x.sizes() == z.sizes() &&
                  x.dim() >= 1, "x, z: float32 of the same shape");
  check_float(weight, "weight", 1);
  const int64_t n = weight.size(0);
  TORCH_CHECK(x.size(-1) == n, "weight: [n] for x [..., n]");
  at::Tensor out = x.contiguous().clone();
  const at::Tensor zc = z.contiguous();
  for (int64_t r = 0; r < out.numel() / n; ++r) {
    gated_rms_norm_row(out.data_ptr<float>() + r * n, zc.data_ptr<float>() + r * n, weight.data_ptr<float>(),
                       static_cast<float>(eps), n);
  }
  return out;
}

at::Tensor rotary_alone(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  check_float(x, "x", 3);
  check_float(inv_freq, "inv_freq", 1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == x.size(0), "positions: int64 [T] for x [T, heads, head_dim]");
  const int64_t T = x.size(0), heads = x.size(1), hd = x.size(2), half = inv_freq.size(0);
  TORCH_CHECK(2 * half <= hd, "inv_freq: at most head_dim / 2 frequencies");
  std::vector<float> cos, sin;
  rope_tables(positions.data_ptr<int64_t>(), T, inv_freq.data_ptr<float>(), half, cos, sin);
  at::Tensor out = x.clone();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < heads; ++h) rope_head(op + (t * heads + h) * hd, &cos[t * half], &sin[t * half], half);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_alone(
    const at::Tensor& proj, const at::Tensor& conv_w, const at::Tensor& neg_a, const at::Tensor& dt_bias,
    const at::Tensor& norm_w, const at::Tensor& conv_cache, const at::Tensor& ssm_cache, const at::Tensor& qsl,
    const at::Tensor& context_lens, const at::Tensor& state_slots, const at::Tensor& spec_index, int64_t spec_width,
    double eps) {
  check_float(proj, "proj", 2);
  check_float(conv_w, "conv_w", 2);
  check_float(conv_cache, "conv_cache", 3);
  check_float(ssm_cache, "ssm_cache", 4);
  for (const at::Tensor* t : {&neg_a, &dt_bias, &norm_w}) check_float(*t, "neg_a, dt_bias, norm_w", 1);
  const int64_t C = conv_w.size(0), K = conv_w.size(1), hv = ssm_cache.size(1), dk = ssm_cache.size(2),
                dv = ssm_cache.size(3);
  const int64_t hk = (C - hv * dv) / (2 * dk);
  TORCH_CHECK(hk > 0 && 2 * hk * dk + hv * dv == C && hv % hk == 0,
              "conv_w: [2 hk dk + hv dv, K] for ssm_cache's sizes");
  TORCH_CHECK(neg_a.size(0) == hv && dt_bias.size(0) == hv && norm_w.size(0) == dv, "neg_a, dt_bias [hv]; norm_w [dv]");
  TORCH_CHECK(conv_cache.size(1) == C && conv_cache.size(2) == K - 1 && conv_cache.size(0) == ssm_cache.size(0),
              "conv_cache: [slots, conv_dim, K - 1]");
  TORCH_CHECK(proj.size(1) == C + hv * dv + 2 * hv, "proj: [T, conv_dim + hv dv + 2 hv] (qkv | z | b | a)");
  const int64_t T = proj.size(0), B = context_lens.size(0);
  TORCH_CHECK(state_slots.numel() == B && spec_index.numel() == B, "state_slots, spec_index: [B] for context_lens [B]");
  const at::Tensor positions = at::zeros({T}, qsl.options()), slot_mapping = at::zeros({T}, qsl.options());
  const at::Tensor block_tables = at::zeros({B, 1}, qsl.options());
  int64_t spec_rows = 0;
  for (int64_t b = 0; b < B; ++b) spec_rows += spec_index[b].item<int64_t>() >= 0;
  const Batch bt = make_batch(T, positions, qsl, context_lens, block_tables, slot_mapping, state_slots, spec_index,
                              spec_rows, spec_width);
  check_batch(bt, conv_cache.size(0), -1, 1);
  at::Tensor spec_conv, spec_ssm;
  if (spec_rows > 0) {
    spec_conv = at::empty({spec_rows, spec_width, C, K - 1}, proj.options());
    spec_ssm = at::empty({spec_rows, spec_width, hv, dk, dv}, proj.options());
  }
  const GdnDims d{hk, hv, dk, dv, C, K, static_cast<float>(eps)};
  at::Tensor core = gdn_recurrence(d, GdnTensors{conv_w, neg_a, dt_bias, norm_w, conv_cache, ssm_cache}, proj, bt,
                                   spec_conv, spec_ssm);
  return {core, spec_conv, spec_ssm};
}

at::Tensor attention_alone(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& positions, const at::Tensor& qsl, const at::Tensor& block_tables,
                           int64_t loop_kv_bytes, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  check_float(q, "q", 3);
  const bool fp8 = k_scale.has_value();
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == (fp8 ? at::kFloat8_e4m3fn : at::kFloat) && t->is_contiguous() && t->dim() == 4,
                "k_cache, v_cache: contiguous 4-D, float32, or float8_e4m3fn with k_scale and v_scale");
  }
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), B = qsl.numel() - 1;
  TORCH_CHECK(nkv > 0 && nh % nkv == 0 && k_cache.size(2) == hd && v_cache.size(2) == nkv && v_cache.size(3) == hd &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(3) == v_cache.size(1),
              "k_cache [blocks, nkv, hd, block_size], v_cache [blocks, block_size, nkv, hd] for q [T, nh, hd]");
  TORCH_CHECK(B >= 0, "qsl: [B + 1]");
  KVCache cache{k_cache, v_cache, at::Tensor(), at::Tensor()};
  if (fp8) {
    TORCH_CHECK(v_scale.has_value(), "v_scale: given with k_scale");
    cache.k_scale = *k_scale, cache.v_scale = *v_scale;
    check_float(cache.k_scale, "k_scale", 3);
    check_float(cache.v_scale, "v_scale", 3);
    const int64_t blocks = k_cache.size(0), bs = k_cache.size(3);
    TORCH_CHECK(cache.k_scale.sizes() == at::IntArrayRef({blocks, nkv, bs}) &&
                    cache.v_scale.sizes() == at::IntArrayRef({blocks, bs, nkv}),
                "k_scale [blocks, nkv, block_size], v_scale [blocks, block_size, nkv]");
  }
  const at::Tensor zeros_b = at::zeros({B}, qsl.options()), slot_mapping = at::zeros({T}, qsl.options());
  const at::Tensor spec_index = at::full({B}, -1, qsl.options());
  const Batch bt = make_batch(T, positions, qsl, zeros_b, block_tables, slot_mapping, zeros_b, spec_index, 0, 0);
  check_batch(bt, -1, k_cache.size(0), v_cache.size(1));
  at::Tensor out = at::empty({T, nh * hd}, q.options());
  paged_attention(q, cache, bt, nullptr, loop_kv_bytes, out);
  return out.view({T, nh, hd});
}

// Rows x [R, n] as the fp8 cache writes them (fp8.h): E4M3 codes [R, n] and their scales [R].
std::tuple<at::Tensor, at::Tensor> quantize_fp8_alone(const at::Tensor& x) {
  check_float(x, "x", 2);
  const int64_t R = x.size(0), n = x.size(1);
  at::Tensor codes = at::empty({R, n}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({R}, x.options());
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  const float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) sp[r] = quantize_fp8_row(xp + r * n, n, cp + r * n, 1);
  return {codes, scales};
}

// FusedStack::set_all_reduce with a Python callable (torch.distributed.all_reduce on the rank's group, in
// place). forward() runs without the GIL: the hook takes it for the call; the callable is released under it.
void set_all_reduce_hook(FusedStack& stack, pybind11::function hook, int64_t vocab_start) {
  std::shared_ptr<pybind11::function> held(new pybind11::function(std::move(hook)), [](pybind11::function* f) {
    pybind11::gil_scoped_acquire gil;
    delete f;
  });
  stack.set_all_reduce(
      [held](at::Tensor& partial) {
        pybind11::gil_scoped_acquire gil;
        (*held)(partial);
      },
      vocab_start);
}

// The sparse-MoE MLP of normed rows h [T, H]: router_shared = the parts [router, shared gate_proj, shared
// up_proj, shared_expert_gate]; shared_down; the experts' 3-D gate_up [E, 2I, H'] and down [E, H, I'] (with
// their 3-D scales), each as (data, scale, format, group) as stack.py hands them over.
at::Tensor moe_alone(const at::Tensor& h, const std::vector<PartSpec>& router_shared, const PartSpec& shared_down,
                     const PartSpec& gate_up, const PartSpec& down, int64_t top_k, bool norm_topk,
                     const std::string& activation_quantization) {
  check_float(h, "h", 2);
  TORCH_CHECK(router_shared.size() == 4, "router_shared: router, shared gate_proj, up_proj, shared_expert_gate");
  const at::Tensor& gu = std::get<0>(gate_up);
  const at::Tensor& dn = std::get<0>(down);
  TORCH_CHECK(gu.dim() == 3 && dn.dim() == 3, "gate_up [E, 2I, H] and down [E, H, I]");
  const int64_t H = h.size(1), E = gu.size(0), I = gu.size(1) / 2, Is = std::get<0>(router_shared[1]).size(0);
  TORCH_CHECK(gu.size(1) == 2 * I && dn.size(0) == E && dn.size(1) == H, "gate_up [E, 2I, H] and down [E, H, I]");
  TORCH_CHECK(std::get<0>(router_shared[0]).size(0) == E && std::get<0>(router_shared[2]).size(0) == Is &&
                  std::get<0>(router_shared[3]).size(0) == 1 && std::get<0>(shared_down).size(0) == H,
              "router [E, H], shared gate_proj and up_proj [Is, H], shared_expert_gate [1, H], shared down [H, Is]");
  TORCH_CHECK(top_k > 0 && top_k <= E, "top_k: 1 .. E");
  MoeWeights w;
  w.router_shared = linear_of(router_shared, H, activation_quantization);
  w.shared_down = linear_of({shared_down}, Is, activation_quantization);
  for (auto [spec, K, out] : {std::tuple{&gate_up, H, &w.gate_up}, {&down, I, &w.down}}) {
    const auto& [data, scale, format, group] = *spec;
    *out = expert_linears(data, scale.value_or(at::Tensor()), format_named(format), group, K,
                          int8_activations(activation_quantization), "experts",
                          bf16_activations(activation_quantization));
  }
  return moe_mlp(MoeDims{E, top_k, I, Is, norm_topk}, w, h, nullptr);
}

// moe_mlp's routing of router logits [T, E]: expert ids and weights [T, top_k] (moe.h moe_route_fast).
std::pair<at::Tensor, at::Tensor> moe_route_alone(const at::Tensor& logits, int64_t top_k, bool norm_topk) {
  check_float(logits, "logits", 2);
  TORCH_CHECK(top_k > 0 && top_k <= logits.size(1), "top_k: 1 .. E");
  return moe_route_fast(MoeDims{logits.size(1), top_k, 0, 0, norm_topk}, logits);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: the native and the portable build are loaded in one process (the tests), and their
  // FusedStack types share one C++ name.
  pybind11::class_<FusedStack>(m, "FusedStack", pybind11::module_local())
      .def(pybind11::init<std::map<std::string, int64_t>, double, std::map<std::string, at::Tensor>,
                          const std::vector<std::string>&, std::vector<std::map<std::string, at::Tensor>>, bool>(),
           pybind11::arg("dims"), pybind11::arg("eps"), pybind11::arg("head"), pybind11::arg("layer_types"),
           pybind11::arg("layers"), pybind11::arg("mtp"))
      .def("named_tensors", &FusedStack::named_tensors)
      .def("forward", &FusedStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("logits", &FusedStack::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("greedy_tokens", &FusedStack::greedy_tokens, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("masked_greedy_tokens", &FusedStack::masked_greedy_tokens,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("commit_verified", &FusedStack::commit_verified)
      .def("greedy_screen_on", &FusedStack::greedy_screen_on)
      .def("set_greedy_screen", &FusedStack::set_greedy_screen)
      .def("set_profiling", &FusedStack::set_profiling)
      .def("profile", &FusedStack::profile)
      .def("set_loop_kv_bytes", &FusedStack::set_loop_kv_bytes)
      .def("set_all_reduce", &set_all_reduce_hook, pybind11::arg("all_reduce"), pybind11::arg("vocab_start"));
  // The kernels one by one (tests/test_kernels.py tests each against its deltaserve/ops or deltaserve/model
  // reference). Inputs are checked here; the kernels themselves trust the stack's checks.
  m.def("linear", &linear_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x @ cat(dequantize(part) for part in parts)^T as the stack projects; a part is (data, scale or None, "
        "format name, group); activation_quantization 'int8': the int8 / int4 parts as activation_quant.py's "
        "reference",
        pybind11::arg("x"), pybind11::arg("parts"), pybind11::arg("activation_quantization") = "none");
#if defined(__AVX512F__)
  m.attr("VECTOR_KERNELS") = "avx512";  // which kernels this build compiled (isa.h)
#elif defined(DELTASERVE_AVX2)
  m.attr("VECTOR_KERNELS") = "avx2";
#else
  m.attr("VECTOR_KERNELS") = "plain";
#endif
  m.attr("DOT_ROWS") = kDotRows;  // up to this many rows, linear runs the dot-product kernel (else the packed one)
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  m.attr("BF16_PAIR_KERNEL") = true;  // this build multiplies bf16 panels by bf16 activations in pairs
#else
  m.attr("BF16_PAIR_KERNEL") = false;
#endif
  m.def("bf16_pair_panels", &bf16_pair_panels,
        "how many panels the bf16-pair kernel (bf16 weights x bf16 activations, AVX512-BF16) has computed");
  m.def("dot_streamed_outputs", &dot_streamed_outputs,
        "how many outputs the dot kernel has computed as streams of weight rows (one row of x, AVX-512)");
  // up to this many rows, int8-activation parts run the integer kernel (else the packed one over q_x * s_x)
  m.attr("INT_KERNEL_ROWS") = kIntKernelRows;
  // from this many rows on, they run the AMX kernel where it is available (linear_amx.h)
  m.attr("AMX_ROWS") = kAmxRows;
  m.def("use_step_memory_pool", &use_step_memory_pool,
        "make the fused step's activation pool torch's CPU allocator for blocks of 1 to 32 MiB (step_memory.h; "
        "building a stack does it); process-wide, once");
  m.def("release_step_memory", &release_step_memory,
        "hand the fused step's free activation pages back to the system (step_memory.h); returns their bytes");
  m.def("step_memory_stats", &step_memory_stats,
        "(bytes the fused step's activation pool has mapped, bytes of them in live blocks); (0, 0) before a stack");
  m.def("amx_supported", &amx_supported,
        "whether this build, the CPU and the OS allow the AMX-INT8 kernel (the tile data requested at the first call)");
  m.def("set_amx", &set_amx_enabled, "switch the AMX kernel on or off (process-wide); returns the last setting",
        pybind11::arg("on"));
  m.def("amx_status", &amx_status,
        "why amx_supported() is what it is: 'ready', 'not compiled in', 'no AMX-INT8 on this CPU', "
        "'kernel refused tile state: <strerror>', ...");
  m.def("amx_panels", &amx_panels,
        "how many parts of 64-output panels the AMX kernel has computed in this process (a panel split between "
        "two weight parts counts twice)");
  m.def("set_amx_rows", &set_amx_min_rows,
        "the fewest rows that take the AMX kernel (AMX_ROWS unless set; for measurements); returns the last setting",
        pybind11::arg("rows"));
  // from this many rows on, they run the VNNI tiles where AMX does not run and the build has them (linear_vnni.h)
  m.attr("VNNI_TILE_ROWS") = kVnniTileRows;
  m.def("vnni_tiles_supported", &vnni_tiles_supported, "whether this build has the VNNI tile kernel (AVX512-VNNI)");
  m.def("set_vnni_tiles", &set_vnni_tiles_enabled,
        "switch the VNNI tile kernel on or off (process-wide); returns the last setting", pybind11::arg("on"));
  m.def("vnni_tile_panels", &vnni_tile_panels,
        "how many parts of 64-output panels the VNNI tile kernel has computed in this process");
  m.def("set_vnni_tile_rows", &set_vnni_tile_min_rows,
        "the fewest rows that take the VNNI tile kernel (VNNI_TILE_ROWS unless set; for measurements); returns the "
        "last setting", pybind11::arg("rows"));
  m.def("linear_argmax", &linear_argmax_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "torch.argmax of linear(x, parts) per row, without keeping the outputs",
        pybind11::arg("x"), pybind11::arg("parts"), pybind11::arg("activation_quantization") = "none");
  m.def("rms_norm", &rms_norm_alone, "x [T, n] * rsqrt(mean(x^2) + eps) * scale (scale = 1 + RMSNorm.weight)");
  m.def("gated_rms_norm", &gated_rms_norm_alone, "x * rsqrt(mean(x^2) + eps) * weight * silu(z) over x's last dim");
  m.def("gelu_tanh_bf16_", &gelu_tanh_bf16_, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x <- GELU(x) (tanh approximation) in place on contiguous bf16 (vision.h)");
  m.def("rotary_qk_bf16_", &rotary_qk_bf16_, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "rotate-half rotary of q and k in place in qkv [N, 3, heads, head_dim] bf16; cos, sin [N, head_dim] fp32");
  m.def("add_layer_norm_bf16", &add_layer_norm_bf16, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x (fp32 [T, n]) += y (bf16, or None) in place, then LayerNorm(x) * weight + bias in bf16 (vision.h)",
        pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("eps"));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  m.def("vision_attention_bf16", &vision_attention_bf16, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "attention of q, k, v from qkv [N, 3, heads, head_dim] bf16 within each of `segments` (consecutive row "
        "counts), as bf16 dot products: bf16 [N, heads * head_dim] (vision.h)",
        pybind11::arg("qkv"), pybind11::arg("segments"));
#endif
  m.def("vision_block_f32", &vision_block_f32_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "VisionBlock.forward in fp32 on the residual stream x [N, hidden] in place; norms (weight, bias, eps), "
        "projections (part, fp32 bias, activation_quantization); segments: row counts attending within themselves; "
        "bf16_attention: the attention as vision_attention_bf16 (vision.h)",
        pybind11::arg("x"), pybind11::arg("norm1"), pybind11::arg("qkv"), pybind11::arg("proj"),
        pybind11::arg("norm2"), pybind11::arg("fc1"), pybind11::arg("fc2"), pybind11::arg("heads"),
        pybind11::arg("act"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("segments"),
        pybind11::arg("bf16_attention") = false);
  m.def("vision_merger_f32", &vision_merger_f32_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "PatchMerger.forward in fp32: fc2(GELU(fc1(norm(x) viewed [-1, merged]))), fp32 out (vision.h)",
        pybind11::arg("x"), pybind11::arg("norm"), pybind11::arg("merged"), pybind11::arg("fc1"), pybind11::arg("fc2"));
  m.def("rotary", &rotary_alone, "x [T, heads, head_dim] with rotate-half RoPE on its first 2 len(inv_freq) dims");
  m.def("gdn_recurrence", &gdn_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Gated DeltaNet's conv, recurrence and gated norm on in_proj outputs: (core, verify conv, verify ssm)");
  m.def("moe_mlp", &moe_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "the sparse-MoE MLP [T, H] of normed rows h: routed experts plus the gated shared expert (moe.h)",
        pybind11::arg("h"), pybind11::arg("router_shared"), pybind11::arg("shared_down"), pybind11::arg("gate_up"),
        pybind11::arg("down"), pybind11::arg("top_k"), pybind11::arg("norm_topk"),
        pybind11::arg("activation_quantization") = "none");
  m.def("moe_route", &moe_route_alone, "moe_mlp's routing of router logits [T, E]: (expert ids, weights) [T, k]",
        pybind11::arg("logits"), pybind11::arg("top_k"), pybind11::arg("norm_topk"));
  m.def("paged_attention", &attention_alone, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "out [T, nh, hd]: each query token's attention over its sequence's cached positions 0 .. positions[t] "
        "(an fp8 cache with its k_scale and v_scale)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("positions"),
        pybind11::arg("qsl"), pybind11::arg("block_tables"), pybind11::arg("loop_kv_bytes"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("quantize_fp8", &quantize_fp8_alone, "rows x [R, n] as the fp8 KV cache stores them: (codes, scales)");
}
