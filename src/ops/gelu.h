// GELU in its tanh approximation (PyTorch's GELU(approximate="tanh"), the activation of
// FLUX's and DiT's MLPs), elementwise on tensors of any shape with the same element count:
//   out = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   din = dout * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// The backward OVERWRITES din. CPU fp32; CUDA bf16 (computed in fp32).
//
// Two more of the family, forward only (the activations of CLIP's text encoder, which runs
// frozen; transformers' ACT2FN "gelu" and "quick_gelu"):
//   gelu_erf:    out = 0.5 x (1 + erf(x / sqrt(2)))      PyTorch's exact GELU
//   quick_gelu:  out = x sigmoid(1.702 x)                 OpenAI CLIP's approximation
// Same shapes, dtypes and devices as above; out may be in itself.
#pragma once

#include "core/tensor.h"

namespace forge {

void gelu_tanh_forward(const Tensor& out, const Tensor& in);
void gelu_tanh_backward(const Tensor& din, const Tensor& dout, const Tensor& in);

void gelu_erf_forward(const Tensor& out, const Tensor& in);
void quick_gelu_forward(const Tensor& out, const Tensor& in);

}  // namespace forge
