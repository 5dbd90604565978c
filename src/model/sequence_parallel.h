// What every tensor-parallel component does at the edges of the sequence-parallel region
// (NOTE [Tensor parallelism] in model/tensor_parallel.h), written once. A component whose
// block is  out = x + project_out(f(project_in(rmsnorm(x))))  asks SequenceParallelEdges
// for each step; without tensor parallelism each is the plain op (or nothing).
//
// NOTE [Async tensor parallelism]
// With parallelism.enable_async_tensor_parallel (torchtitan's key; TensorParallel::async)
// the edges' all-gathers and reduce-scatters do not run in the open between the GEMMs:
// each becomes T - 1 steps of a ring (TensorParallel::ring_start / ring_wait: rank r sends
// to r + 1 and receives from r - 1; on CUDA on a stream of its own ordered by events,
// distributed/ring_exchange.h, the mechanism ring attention uses), and the GEMM is split
// into the T row chunks of the N = T n rows, each computed while the next chunk travels
// (the collective matmul of Wang et al., "Overlap communication with dependent computation
// via decomposition", as torchtitan's async TP and Megatron's tp_comm_overlap do it). Rank
// r, chunk c = rows [c n, (c + 1) n):
//   all-gather, then a GEMM reading the gathered rows (project_in; the backward of the
//   row-parallel projection, whose dy is gathered: its input gradient dx = dy W): at step
//   s = 0 .. T - 1 the rank multiplies chunk g(s) = r - s (mod T): its own rows at step 0,
//   while they go to r + 1; at step s >= 1 the chunk that arrived at the end of step s - 1,
//   while it goes on to r + 1 and chunk g(s + 1) arrives from r - 1. Each chunk lands in its
//   rows of the gathered buffer, so the backward's weight gradient, which needs every row,
//   is one GEMM over the whole buffer after the ring, as before.
//   a GEMM, then a reduce-scatter of its rows (project_out; the column-parallel projection's
//   input gradient in normed_projection_backward): at step s the rank computes its partial
//   for chunk c(s) = r - 1 - s (mod T), then adds the sum of that chunk's partials that rank
//   r - 1 sent at the end of its step s - 1 (over ranks r - s .. r - 1), and sends the sum
//   on to r + 1: chunk c's sum starts at rank c + 1 and ends, at step T - 1, at rank c, its
//   owner, summed over every rank (with the residual x in the forward, the last GEMM's C
//   operand). The GEMM of step s runs while the sum of step s - 1 travels.
// The backward of the column-parallel projection runs both rings as one: each step sends
// the normed rows (gathered for the weight gradient) and the input gradient's partial sum
// together.
// What it costs: no memory (the chunks travel through the rows of the buffers the
// collectives used, the reduce-scatter's incoming sums through the rank's own chunk of
// them, which its last step writes elsewhere), T GEMMs of n rows instead of one of T n, an
// elementwise add of n rows per step. What it gives: the communication hidden under the
// GEMMs where a chunk's GEMM takes as long as its transfer (the gain is not yet measured:
// the device machines lend one GPU, issue 23).
// Results: every row of a chunked GEMM is the same dot products as in the whole GEMM. On
// the CPU (kernels/cpu/matmul.cpp: each output element summed over K in an order fixed by
// K alone) the gathered GEMMs are bitwise the non-async ones; cuBLASLt may choose
// another algorithm for n rows than for T n (split-K changes the order of a dot product's
// sum), so on CUDA they agree to bf16 rounding. The reduce-scatters sum in the ring's order
// (from rank r + 1 round to r) in the compute dtype, one rounding per step, where the
// group's reduce-scatter sums in its own order (NCCL's ring; rank 0 of the CPU group in rank
// order): equal up to the order of floating-point sums. The norms' replicated weight
// gradients are still all-reduced in the open (one [H] vector a layer), as are the
// vocabulary-parallel embedding's and head's collectives (model/decoder_lm.cpp).
// Not taken (the config's validation refuses them, and the edges check): FP8 projections
// (NOTE [FP8 under tensor parallelism]: one quantization of the whole gathered input) and
// LoRA adapters (their dropout masks and gradients are drawn over every row in one call:
// NOTE [LoRA under context and tensor parallelism] in model/lora.h).
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

  // y = normed W^T, a column-parallel projection over every rank's normed rows, gathered
  // (over the rank's `normed` itself without tensor parallelism); y [T n, out/T].
  void project_in(const Tensor& y, const Tensor& normed, const LinearWeight& w);
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
  // The row-parallel projection's backward: every rank's rows of dL/d(out) gathered from
  // d_stream, the input gradient d_in [T n, K/T] and the weight gradient into `grad`
  // (written over it when `overwrite`).
  void project_out_backward(const Tensor& d_in, const LinearWeight& grad, const Tensor& d_stream, const Tensor& in,
                            const LinearWeight& w, bool overwrite);
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
  // NOTE [Async tensor parallelism]: whether the projection's collectives run as ring steps.
  bool ring(const LinearWeight& w) const;
  // Rows [chunk n, (chunk + 1) n) of `t`.
  static Tensor chunk(const Tensor& t, int chunk, int64_t n) { return t.narrow(chunk * n, (chunk + 1) * n); }
  // NOTE [Async tensor parallelism]: the other ranks' `local` [n, ...] gathered into their
  // chunks of `full` [T n, ...] by the ring (the rank's own chunk is left as it is),
  // `gemm(c, rows)` called on each chunk c's rows as they arrive (the rank's own, `local`,
  // first).
  template <typename Gemm>
  void ring_gather(const Tensor& full, const Tensor& local, Gemm&& gemm);
  // NOTE [Async tensor parallelism]: `out` [n, ...] the sum over the ranks of their chunk
  // r of a GEMM's rows, `gemm(c, target, last)` writing chunk c's partial into `target`
  // (the rank's own chunk, the last, into `out`), the sums travelling through partial_.
  // With `gather_local`, its rows [n, H] are gathered into gathered_ by the same steps.
  template <typename Gemm>
  void ring_reduce_scatter(const Tensor& out, const Tensor* gather_local, Gemm&& gemm);

  TensorParallel* tp_ = nullptr;
  Tensor gathered_, partial_, norm_grad_;
};

// rmsnorm_backward on the rank's rows, its weight gradient summed over the group before
// it is added to dweight (a replicated weight's gradient, NOTE [Tensor parallelism]).
// `scratch` is fp32, shaped like the weight.
void replicated_rmsnorm_backward(TensorParallel& tp, const Tensor& scratch, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd);

}  // namespace forge
