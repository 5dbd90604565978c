// The gated residual add of adaLN-Zero blocks: a branch's output y [B, T, D] joins the
// residual stream x [B, T, D] scaled per sample and channel by a gate [B, D] taken from
// the conditioning vector (FLUX's gate_msa / gate_mlp):
//   forward   x[b,t,d] += gate[b,d] * y[b,t,d]                        (x in place)
//             or out[b,t,d] = x[b,t,d] + gate[b,d] * y[b,t,d]         (x kept: one pass
//             where a copy of x and the in-place add would be two)
//   backward  dy[b,t,d] = gate[b,d] * dx[b,t,d]                       (overwritten)
//             dgate[b,d] = sum_t dx[b,t,d] * y[b,t,d]                 (overwritten)
// where dx is the residual stream's gradient, which flows on unchanged. CPU fp32; CUDA
// bf16 (the sums over t in fp32, rounded once, deterministic), D a multiple of 8.
#pragma once

#include "core/tensor.h"

namespace forge {

void gated_residual_forward(const Tensor& x, const Tensor& y, const Tensor& gate);
void gated_residual_forward(const Tensor& out, const Tensor& x, const Tensor& y, const Tensor& gate);
void gated_residual_backward(const Tensor& dy, const Tensor& dgate, const Tensor& dx, const Tensor& y,
                             const Tensor& gate);

}  // namespace forge
