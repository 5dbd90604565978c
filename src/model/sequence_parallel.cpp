#include "model/sequence_parallel.h"

#include "ops/elementwise.h"
#include "ops/lora.h"
#include "ops/rmsnorm.h"

namespace forge {

void SequenceParallelEdges::lay_out(ArenaLayout& layout, const StepShape& shape, int64_t hidden) {
  if (shape.tensor_parallel == 1) return;
  gathered_ = layout.take({shape.tokens(), hidden}, shape.dtype);
  partial_ = layout.take({shape.tokens(), hidden}, shape.dtype);
  norm_grad_ = layout.take({hidden}, DType::F32);
}

const Tensor& SequenceParallelEdges::projection_input(const Tensor& normed) {
  if (!tp_) return normed;
  tp_->gather_rows(gathered_, normed);
  return gathered_;
}

void SequenceParallelEdges::project_out(const Tensor& out, const Tensor& in, const LinearWeight& w, const Tensor& x) {
  if (!tp_) return linear_forward(out, in, w, &x);
  const int64_t n = x.dim(0), begin = tp_->rank() * n, rows = partial_.dim(0);
  FORGE_CHECK(rows == tp_->size() * n && in.dim(0) == rows, "row-parallel projection: {} rows in, {} per rank of {}",
              in.dim(0), n, tp_->size());
  // A LoRA adapter with dropout adds its share over every row in one call, after the frozen
  // GEMMs: its masks are then the ones its backward, one call over every row, draws (NOTE
  // [LoRA under context and tensor parallelism] in model/lora.h).
  const bool lora_apart = w.lora && w.lora->dropout > 0.0f;
  LinearWeight frozen = w;
  if (lora_apart) frozen.lora = nullptr;
  if (w.fp8) {  // NOTE [FP8 under tensor parallelism]: one quantization of the whole input
    linear_forward(partial_, in, frozen);
    accumulate(partial_.narrow(begin, begin + n), x);
  } else {
    if (begin > 0) linear_forward(partial_.narrow(0, begin), in.narrow(0, begin), frozen);
    linear_forward(partial_.narrow(begin, begin + n), in.narrow(begin, begin + n), frozen, &x);
    if (begin + n < rows) linear_forward(partial_.narrow(begin + n, rows), in.narrow(begin + n, rows), frozen);
  }
  if (lora_apart) lora_forward_add(partial_, in, *w.lora);
  tp_->reduce_scatter_rows(out, partial_);
}

const Tensor& SequenceParallelEdges::output_grad(const Tensor& d_stream) {
  if (!tp_) return d_stream;
  tp_->gather_rows(partial_, d_stream);
  return partial_;
}

void SequenceParallelEdges::normed_projection_backward(const Tensor& d_hidden, const LinearWeight& grad,
                                                       const Tensor& dy, const Tensor& normed, const LinearWeight& w,
                                                       bool overwrite, const Tensor& d_stream, const Tensor& norm_grad,
                                                       const Tensor& x, const Tensor& norm_weight, const Tensor& rstd) {
  if (!tp_) {
    linear_backward(d_hidden, grad, dy, normed, w, overwrite);
    rmsnorm_backward(d_stream, norm_grad, d_hidden, x, norm_weight, rstd);
    return;
  }
  tp_->gather_rows(gathered_, normed);
  linear_backward(partial_, grad, dy, gathered_, w, overwrite);
  tp_->reduce_scatter_rows(d_hidden, partial_);
  replicated_rmsnorm_backward(*tp_, norm_grad_, d_stream, norm_grad, d_hidden, x, norm_weight, rstd);
}

void replicated_rmsnorm_backward(TensorParallel& tp, const Tensor& scratch, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  scratch.fill_zero();
  rmsnorm_backward(dx, scratch, dy, x, weight, rstd);
  tp.all_reduce_sum(scratch);
  accumulate(dweight, scratch);
}

}  // namespace forge
