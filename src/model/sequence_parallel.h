// What every tensor-parallel component does at the edges of the sequence-parallel region
// (NOTE [Tensor parallelism] in model/tensor_parallel.h), written once. A component whose
// block is  out = x + project_out(f(project_in(rmsnorm(x))))  asks SequenceParallelEdges
// for each step; without tensor parallelism each is the plain op (or nothing).
#pragma once

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_component.h"
#include "model/tensor_parallel.h"
#include "ops/linear.h"

namespace forge {

class SequenceParallelEdges {
 public:
  // The group (null: no tensor parallelism), set before lay_out.
  void set_group(TensorParallel* tp) { tp_ = tp; }
  // Its scratch, under tensor parallelism: every rank's normed rows and the row-parallel
  // sums or gradients, [N, H] each (N the micro-batch's tokens), and the rank's share of
  // the norm's gradient, [H] fp32.
  void lay_out(ArenaLayout& layout, const StepShape& shape, int64_t hidden);

  // What a column-parallel projection reads: every rank's normed rows, gathered (the
  // rank's `normed` itself without tensor parallelism).
  const Tensor& projection_input(const Tensor& normed);
  // The projection the norm's kernel prepares its output for (NOTE [FP8 fused producers]
  // in ops/fp8_linear.h): `consumer` without tensor parallelism; none under it, where the
  // projection reads the gathered rows, not the norm's output (NOTE [FP8 under tensor
  // parallelism] in model/fp8_projections.h).
  const LinearWeight* norm_consumer(const LinearWeight& consumer) const { return tp_ ? nullptr : &consumer; }
  // out = x + in W^T: under tensor parallelism a row-parallel projection, the rank's rows
  // of the group's sum (in [T n, K/T]; x and out [n, H]), whose rows of the GEMM take x as
  // their residual, so the add costs no pass of its own (an FP8 projection runs one GEMM
  // over every row, its input quantized whole as on one device, and adds x to its rows
  // after: NOTE [FP8 under tensor parallelism]); a LoRA adapter with dropout adds
  // its share over every row in one call (NOTE [LoRA under context and tensor parallelism]
  // in model/lora.h).
  void project_out(const Tensor& out, const Tensor& in, const LinearWeight& w, const Tensor& x);
  // What the row-parallel projection's backward reads: every rank's rows of dL/d(out).
  const Tensor& output_grad(const Tensor& d_stream);
  // The backward of the column-parallel projection (weight gradient into `grad`, written
  // over it when `overwrite`) and of the norm before it: the normed rows gathered again, the
  // input gradient (a partial sum over the rank's shard) summed and scattered to the rank's
  // rows in d_hidden, then the norm's backward into d_stream, its weight gradient summed
  // over the group before it is added to norm_grad.
  void normed_projection_backward(const Tensor& d_hidden, const LinearWeight& grad, const Tensor& dy,
                                  const Tensor& normed, const LinearWeight& w, bool overwrite, const Tensor& d_stream,
                                  const Tensor& norm_grad, const Tensor& x, const Tensor& norm_weight,
                                  const Tensor& rstd);

 private:
  TensorParallel* tp_ = nullptr;
  Tensor gathered_, partial_, norm_grad_;
};

// rmsnorm_backward on the rank's rows, its weight gradient summed over the group before
// it is added to dweight (a replicated weight's gradient, NOTE [Tensor parallelism]).
// `scratch` is fp32, shaped like the weight.
void replicated_rmsnorm_backward(TensorParallel& tp, const Tensor& scratch, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd);

}  // namespace forge
