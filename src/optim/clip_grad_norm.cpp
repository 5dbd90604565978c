// Global grad-norm clipping with torch.nn.utils.clip_grad_norm_'s rule (see
// optim/optimizer.h). The norm is accumulated in double, tensor by tensor in order, so it
// is the same for any thread count. The clip coefficient is formed in fp32 exactly as
// torch forms it from its fp32 norm, max_norm / (norm + 1e-6) evaluated as
// reciprocal(norm + 1e-6) * max_norm, so whenever the two norms round to the same float the
// clipped grads are bit for bit torch's.
#include <cmath>

#include "ops/elementwise.h"
#include "optim/optimizer.h"

namespace forge {

double global_grad_norm(const std::vector<Tensor>& grads) {
  double sum = 0.0;
  for (const Tensor& g : grads) sum += sum_of_squares(g);
  return std::sqrt(sum);
}

float clip_coefficient(double norm, double max_norm) {
  if (!std::isfinite(norm) || max_norm <= 0.0) return 1.0f;
  const float coefficient = (1.0f / (static_cast<float>(norm) + 1e-6f)) * static_cast<float>(max_norm);
  return coefficient < 1.0f ? coefficient : 1.0f;
}

}  // namespace forge
