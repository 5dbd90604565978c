// SwiGLU activation on the fused gate/up projection output gate_up [N, 2F]:
// columns [0, F) are the gate g, [F, 2F) the up projection u.
//   out[n, f] = silu(g) * u = g * sigmoid(g) * u                 out is [N, F]
// The backward overwrites dgate_up [N, 2F].
#pragma once

#include "core/tensor.h"

namespace forge {

void swiglu_forward(const Tensor& out, const Tensor& gate_up);
void swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up);

}  // namespace forge
