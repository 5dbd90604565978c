#include "model/sequence_parallel.h"

#include "ops/elementwise.h"
#include "ops/rmsnorm.h"

namespace forge {

void row_parallel_forward(TensorParallel& tp, const Tensor& out, const Tensor& partial, const Tensor& in,
                          const LinearWeight& w, const Tensor& x) {
  const int64_t n = x.dim(0), begin = tp.rank() * n, rows = partial.dim(0);
  FORGE_CHECK(rows == tp.size() * n && in.dim(0) == rows, "row-parallel projection: {} rows in, {} per rank of {}",
              in.dim(0), n, tp.size());
  if (begin > 0) linear_forward(partial.narrow(0, begin), in.narrow(0, begin), w);
  linear_forward(partial.narrow(begin, begin + n), in.narrow(begin, begin + n), w, &x);
  if (begin + n < rows) linear_forward(partial.narrow(begin + n, rows), in.narrow(begin + n, rows), w);
  tp.reduce_scatter_rows(out, partial);
}

void replicated_rmsnorm_backward(TensorParallel& tp, const Tensor& scratch, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd) {
  scratch.fill_zero();
  rmsnorm_backward(dx, scratch, dy, x, weight, rstd);
  tp.all_reduce_sum(scratch);
  accumulate(dweight, scratch);
}

}  // namespace forge
