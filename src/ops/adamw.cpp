#include "ops/adamw.h"

#include <cmath>

#include "kernels/cpu/adamw.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/adamw.h"
#endif

namespace forge {
namespace {

AdamWScalars adamw_scalars(const AdamWHyper& h) {
  double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  return {
      .decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay),
      .one_minus_beta1 = static_cast<float>(1.0 - h.beta1),
      .beta2 = static_cast<float>(h.beta2),
      .one_minus_beta2 = static_cast<float>(1.0 - h.beta2),
      .bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5)),
      .eps = static_cast<float>(h.eps),
      .neg_step_size = static_cast<float>(-(h.lr / bias_correction1)),
  };
}

}  // namespace

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWHyper& h) {
  OpProfileScope profile(OpClass::Optimizer, "adamw_update");
  FORGE_CHECK(h.step >= 1, "adamw_update: step counts from 1, got {}", h.step);
  check_dtype(param, DType::F32, "adamw param");
  check_shape(grad, param.shape(), "adamw grad");
  check_shape(m, param.shape(), "adamw exp_avg");
  check_shape(v, param.shape(), "adamw exp_avg_sq");
  check_dtype(grad, DType::F32, "adamw grad");
  check_dtype(m, DType::F32, "adamw exp_avg");
  check_dtype(v, DType::F32, "adamw exp_avg_sq");
  for (const Tensor* t : {&grad, &m, &v})
    FORGE_CHECK(t->device() == param.device(), "adamw_update: tensors on different devices");
  if (param.device() == Device::CUDA) {
    FORGE_CUDA_CALL("adamw_update", cuda::adamw_update(param.data<float>(), grad.data<float>(), m.data<float>(),
                                                       v.data<float>(), nullptr, param.numel(), adamw_scalars(h)));
    return;
  }
  cpu::adamw_update(param, grad, m, v, adamw_scalars(h));
}

}  // namespace forge
