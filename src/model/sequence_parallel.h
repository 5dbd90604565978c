// The two steps every tensor-parallel component takes at the edge of the sequence-parallel
// region (NOTE [Tensor parallelism] in model/tensor_parallel.h), written once.
#pragma once

#include "core/tensor.h"
#include "model/tensor_parallel.h"
#include "ops/linear.h"

namespace forge {

// A row-parallel projection into the residual stream: out = x + the rank's rows of
// (sum over the group of in W^T). in [T n, K/T], x and out [n, H] (the rank's rows);
// `partial` [T n, H] is scratch. The rank's rows of the GEMM take x as their residual, so
// the add costs no pass of its own.
void row_parallel_forward(TensorParallel& tp, const Tensor& out, const Tensor& partial, const Tensor& in,
                          const LinearWeight& w, const Tensor& x);

// rmsnorm_backward on the rank's rows, its weight gradient summed over the group before
// it is added to dweight (a replicated weight's gradient, NOTE [Tensor parallelism]).
// `scratch` is fp32, shaped like the weight.
void replicated_rmsnorm_backward(TensorParallel& tp, const Tensor& scratch, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd);

}  // namespace forge
