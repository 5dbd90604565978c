// SwiGLU activation on the fused gate/up projection output gate_up [N, 2F]:
// columns [0, F) are the gate g, [F, 2F) the up projection u.
//   out[n, f] = silu(g) * u = g * sigmoid(g) * u                 out is [N, F]
// The backward overwrites dgate_up [N, 2F].
#pragma once

#include "core/tensor.h"

namespace forge {

struct LinearWeight;  // ops/linear.h

// `feeds`: the projection that reads out next (the forward) or dgate_up (the backward: its
// output gradient), if any; an FP8 one gets that tensor's amax (or codes) from this pass
// (NOTE [FP8 fused producers] in ops/fp8_linear.h). The outputs are the same either way.
void swiglu_forward(const Tensor& out, const Tensor& gate_up, const LinearWeight* feeds = nullptr);
void swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up,
                     const LinearWeight* feeds = nullptr);

}  // namespace forge
