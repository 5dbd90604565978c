// Global grad-norm clipping with torch.nn.utils.clip_grad_norm_'s rule (see
// optim/optimizer.h). The norm is accumulated in double, tensor by tensor in order, so it
// is the same for any thread count.
#include <cmath>

#include "ops/elementwise.h"
#include "optim/optimizer.h"

namespace forge {

double clip_grad_norm(const std::vector<Tensor>& grads, double max_norm) {
  double sum = 0.0;
  for (const Tensor& g : grads) sum += sum_of_squares(g);
  const double norm = std::sqrt(sum);
  if (!std::isfinite(norm) || max_norm <= 0.0) return norm;
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0)
    for (const Tensor& g : grads) scale_inplace(g, static_cast<float>(coefficient));
  return norm;
}

}  // namespace forge
