// The Python module of the fused step: FusedStack (stack.h) and its kernels one by one, for their tests
// against deltaserve/ops and deltaserve/model (tests/test_kernels.py) and for measurements.
#include <torch/extension.h>

#include "linear.h"
#include "stack.h"

using namespace deltaserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FusedStack>(m, "FusedStack")
      .def(pybind11::init<std::map<std::string, int64_t>, double, std::map<std::string, at::Tensor>,
                          const std::vector<std::string>&, std::vector<std::map<std::string, at::Tensor>>, bool>(),
           pybind11::arg("dims"), pybind11::arg("eps"), pybind11::arg("head"), pybind11::arg("layer_types"),
           pybind11::arg("layers"), pybind11::arg("mtp"))
      .def("named_tensors", &FusedStack::named_tensors)
      .def("forward", &FusedStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("logits", &FusedStack::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("greedy_tokens", &FusedStack::greedy_tokens, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("commit_verified", &FusedStack::commit_verified)
      .def("greedy_screen_on", &FusedStack::greedy_screen_on)
      .def("set_greedy_screen", &FusedStack::set_greedy_screen)
      .def("set_profiling", &FusedStack::set_profiling)
      .def("profile", &FusedStack::profile)
      .def("set_loop_kv_bytes", &FusedStack::set_loop_kv_bytes);
  // The bf16 panel projection alone (x [T, K] float32, panels from fused.py's _linear, N outputs), for its
  // test against torch and for measurements.
  m.def("linear_panels", [](const at::Tensor& x, const at::Tensor& panels, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, K] float32");
    TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                    panels.size(1) == x.size(1) && panels.size(2) == kPanel && N > 0 && N <= panels.size(0) * kPanel,
                "panels: contiguous bf16 [ceil(N / 64), K, 64] for x's K");
    return linear_panels(x, panels, N);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
}
