// The sum of squares behind the global gradient norm on the CPU reference. The sum is
// split into fixed 64K-element blocks whose partial sums are added in block order, so it
// is bitwise identical for any thread count (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/elementwise.h"

#include <vector>

#include "core/parallel.h"

namespace forge::cpu {

double sum_of_squares(const Tensor& a) {
  constexpr int64_t kBlock = 1 << 16;
  const float* pa = a.data<float>();
  int64_t n = a.numel();
  int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(blocks, 0.0);
  parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      double s = 0.0;
      int64_t lo = blk * kBlock, hi = std::min(n, lo + kBlock);
      for (int64_t i = lo; i < hi; ++i) s += static_cast<double>(pa[i]) * pa[i];
      partial[blk] = s;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace forge::cpu
