#include "model/sequence_parallel.h"

#include <vector>

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

bool SequenceParallelEdges::ring(const LinearWeight& w) const {
  if (!tp_ || !tp_->async()) return false;
  FORGE_CHECK(!w.fp8 && !w.lora,
              "async tensor parallelism (parallelism.enable_async_tensor_parallel) takes no {} projection (NOTE "
              "[Async tensor parallelism])",
              w.fp8 ? "FP8" : "LoRA");
  return true;
}

template <typename Gemm>
void SequenceParallelEdges::ring_gather(const Tensor& full, const Tensor& local, Gemm&& gemm) {
  const int t = tp_->size(), r = tp_->rank();
  const int64_t n = local.dim(0);
  auto slot = [&](int s) { return s == 0 ? local : chunk(full, (r - s + t) % t, n); };  // chunk g(s) = r - s
  for (int s = 0; s < t; ++s) {
    if (s > 0) tp_->ring_wait();  // chunk g(s) has arrived
    if (s + 1 < t) tp_->ring_start({slot(s + 1)}, {slot(s)});
    gemm((r - s + t) % t, slot(s));
  }
}

template <typename Gemm>
void SequenceParallelEdges::ring_reduce_scatter(const Tensor& out, const Tensor* gather_local, Gemm&& gemm) {
  const int t = tp_->size(), r = tp_->rank();
  const int64_t n = out.dim(0);
  const Tensor incoming = chunk(partial_, r, n);  // the rank's own chunk is computed into `out`
  if (gather_local) cast(chunk(gathered_, r, n), *gather_local);
  for (int s = 0; s < t; ++s) {
    const int c = (r - 1 - s + 2 * t) % t;  // chunk c(s) = r - 1 - s: r itself at the last step
    const bool last = s + 1 == t;
    const Tensor target = last ? out : chunk(partial_, c, n);
    gemm(c, target, last);
    if (s > 0) {  // the sum of chunk c over ranks r - s .. r - 1
      tp_->ring_wait();
      accumulate(target, incoming);
    }
    if (last) break;
    std::vector<Tensor> received = {incoming}, sent = {target};
    if (gather_local) {  // chunk g(s) = r - s of the gathered rows on, g(s + 1) in
      sent.push_back(chunk(gathered_, (r - s + t) % t, n));
      received.push_back(chunk(gathered_, (r - s - 1 + 2 * t) % t, n));
    }
    tp_->ring_start(received, sent);
  }
}

void SequenceParallelEdges::project_in(const Tensor& y, const Tensor& normed, const LinearWeight& w) {
  if (!tp_) return linear_forward(y, normed, w);
  if (!ring(w)) {
    tp_->gather_rows(gathered_, normed);
    return linear_forward(y, gathered_, w);
  }
  const int64_t n = normed.dim(0);
  ring_gather(gathered_, normed, [&](int c, const Tensor& rows) { linear_forward(chunk(y, c, n), rows, w); });
}

void SequenceParallelEdges::project_out(const Tensor& out, const Tensor& in, const LinearWeight& w, const Tensor& x) {
  if (!tp_) return linear_forward(out, in, w, &x);
  const int64_t n = x.dim(0), begin = tp_->rank() * n, rows = partial_.dim(0);
  FORGE_CHECK(rows == tp_->size() * n && in.dim(0) == rows, "row-parallel projection: {} rows in, {} per rank of {}",
              in.dim(0), n, tp_->size());
  if (ring(w)) {
    ring_reduce_scatter(out, nullptr, [&](int c, const Tensor& target, bool last) {
      linear_forward(target, chunk(in, c, n), w, last ? &x : nullptr);
    });
    return;
  }
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

void SequenceParallelEdges::project_out_backward(const Tensor& d_in, const LinearWeight& grad, const Tensor& d_stream,
                                                 const Tensor& in, const LinearWeight& w, bool overwrite) {
  if (!tp_) return linear_backward(d_in, grad, d_stream, in, w, overwrite);
  if (!ring(w)) {
    tp_->gather_rows(partial_, d_stream);
    return linear_backward(d_in, grad, partial_, in, w, overwrite);
  }
  const int64_t n = d_stream.dim(0);
  cast(chunk(partial_, tp_->rank(), n), d_stream);  // the weight gradient reads every row
  ring_gather(partial_, d_stream,
              [&](int c, const Tensor& rows) { linear_backward_input(chunk(d_in, c, n), rows, w); });
  linear_backward_weight(grad, partial_, in, overwrite);
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
  if (ring(w)) {  // NOTE [Async tensor parallelism]: the normed rows ride the input gradient's ring
    const int64_t n = normed.dim(0);
    ring_reduce_scatter(d_hidden, &normed, [&](int c, const Tensor& target, bool) {
      linear_backward_input(target, chunk(dy, c, n), w);
    });
    linear_backward_weight(grad, dy, gathered_, overwrite);
  } else {
    tp_->gather_rows(gathered_, normed);
    linear_backward(partial_, grad, dy, gathered_, w, overwrite);
    tp_->reduce_scatter_rows(d_hidden, partial_);
  }
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
