// SiLU (x sigmoid(x)) elementwise on tensors of any shape with the same element count: the
// activation a diffusion transformer applies to its conditioning vector before each
// modulation projection, and inside its timestep and text embedders.
//   out = x s,  s = 1 / (1 + e^-x);   din = dout * s (1 + x (1 - s))
// The backward OVERWRITES din. CPU fp32; CUDA bf16 (computed in fp32).
#pragma once

#include "core/tensor.h"

namespace forge {

void silu_forward(const Tensor& out, const Tensor& in);
void silu_backward(const Tensor& din, const Tensor& dout, const Tensor& in);

}  // namespace forge
