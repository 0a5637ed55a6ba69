// Gated DeltaNet between its two projections: the causal depthwise conv on q|k|v, SiLU, the L2 norms, the
// gated delta rule's recurrence token by token and the gated RMSNorm (deltaserve/model/gdn.py and
// deltaserve/ops/{conv,delta_rule}.py are the reference), for prompt, decode and verify tokens alike.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "batch.h"

namespace deltaserve {

struct GdnDims {
  int64_t hk, hv, dk, dv, conv_dim, kernel;
  float eps;
};

// A GDN layer's tensors besides its projections.
struct GdnTensors {
  at::Tensor conv_w;      // [conv_dim, kernel]
  at::Tensor neg_a;       // [hv] = -exp(A_log)
  at::Tensor dt_bias;     // [hv]
  at::Tensor norm_w;      // [dv]
  at::Tensor conv_cache;  // [slots, conv_dim, kernel-1]
  at::Tensor ssm_cache;   // [slots, hv, dk, dv]
};

// The core output [T, hv * dv] (gated-normed, before out_proj) of the in_proj output proj [T, conv_dim +
// value_dim + 2 hv] (q|k|v | z | b | a), each sequence's conv and recurrent state read from and written back
// to its slot of the caches. Verify segments (bt.spec_index) leave their slot untouched and write their
// states after every position into spec_conv [spec_rows, spec_width, conv_dim, kernel-1] and spec_ssm
// [spec_rows, spec_width, hv, dk, dv] (undefined when bt.spec_rows == 0). The batch must be checked.
at::Tensor gdn_recurrence(const GdnDims& d, const GdnTensors& w, const at::Tensor& proj, const Batch& bt,
                          const at::Tensor& spec_conv, const at::Tensor& spec_ssm);

}  // namespace deltaserve
