#include "ops/linear.h"

#include "ops/lora.h"
#include "ops/matmul.h"

namespace forge {

// The weight is [out, in]: the forward multiplies by its transpose, the input gradient by
// the weight itself, and the weight gradient is dy^T x; every transpose is a GEMM flag
// (NOTE [Contiguous tensors]).

void linear_forward(const Tensor& y, const Tensor& x, const LinearWeight& w, const Tensor* residual) {
  if (residual)
    matmul_add(y, x, false, w.weight, true, *residual);
  else
    matmul(y, x, false, w.weight, true);
  if (w.lora) lora_forward_add(y, x, *w.lora);
}

void linear_backward_input(const Tensor& dx, const Tensor& dy, const LinearWeight& w) {
  matmul(dx, dy, false, w.weight, false);
  if (w.lora) lora_backward_input_add(dx, dy, *w.lora);
}

void linear_backward_weight(const LinearWeight& grad, const Tensor& dy, const Tensor& x, bool overwrite) {
  if (grad.weight.defined()) matmul(grad.weight, dy, true, x, false, 1.0f, overwrite ? 0.0f : 1.0f);
  if (grad.lora) lora_backward_weight(*grad.lora, dy, x, overwrite);
}

}  // namespace forge
