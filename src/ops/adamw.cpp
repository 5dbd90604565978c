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
      .grad_scale = h.grad_scale,
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

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                  const Tensor& compute_copy) {
  OpProfileScope profile(OpClass::Optimizer, "adamw_update");
  FORGE_CHECK(h.step >= 1, "adamw_update: step counts from 1, got {}", h.step);
  FORGE_CHECK(param.dtype() == DType::F32 || param.dtype() == DType::BF16,
              "adamw param: {}, expected f32 (master weights) or bf16 (NOTE [bf16 master weights])",
              dtype_name(param.dtype()));
  const bool bf16_param = param.dtype() == DType::BF16;
  FORGE_CHECK(h.rounding_offset >= 0, "adamw_update: rounding_offset {} is negative", h.rounding_offset);
  check_shape(grad, param.shape(), "adamw grad");
  check_shape(m, param.shape(), "adamw exp_avg");
  check_shape(v, param.shape(), "adamw exp_avg_sq");
  check_dtype(grad, DType::F32, "adamw grad");
  FORGE_CHECK(m.dtype() == v.dtype(), "adamw: exp_avg is {} but exp_avg_sq is {}", dtype_name(m.dtype()),
              dtype_name(v.dtype()));
  for (const Tensor* t : {&grad, &m, &v})
    FORGE_CHECK(t->device() == param.device(), "adamw_update: tensors on different devices");
  FORGE_CHECK(!bf16_param || !compute_copy.defined(),
              "adamw: a bf16 param is its own compute copy; no other is written");
  const AdamWRounding rounding{h.rounding_seed, static_cast<uint64_t>(h.step),
                               static_cast<uint64_t>(h.rounding_offset)};
  if (param.device() == Device::CUDA) {
    FORGE_CHECK(m.dtype() == DType::F32 || m.dtype() == DType::BF16, "adamw: moments are {}, expected f32 or bf16",
                dtype_name(m.dtype()));
    if (compute_copy.defined()) {
      expect_tensor(compute_copy, Device::CUDA, DType::BF16, "adamw compute copy");
      check_shape(compute_copy, param.shape(), "adamw compute copy");
    }
    if (bf16_param) {
      FORGE_CUDA_CALL("adamw_update",
                      cuda::adamw_update_bf16_param(param.raw(), grad.data<float>(), m.raw(), v.raw(),
                                                    m.dtype() == DType::BF16, param.numel(), adamw_scalars(h),
                                                    rounding));
      return;
    }
    FORGE_CUDA_CALL("adamw_update",
                    cuda::adamw_update(param.data<float>(), grad.data<float>(), m.raw(), v.raw(),
                                       m.dtype() == DType::BF16, compute_copy.defined() ? compute_copy.raw() : nullptr,
                                       param.numel(), adamw_scalars(h)));
    return;
  }
  check_dtype(m, DType::F32, "adamw exp_avg");
  FORGE_CHECK(!compute_copy.defined(), "adamw: a bf16 compute copy exists only on CUDA");
  if (bf16_param) {
    cpu::adamw_update_bf16_param(param, grad, m, v, adamw_scalars(h), rounding);
    return;
  }
  cpu::adamw_update(param, grad, m, v, adamw_scalars(h));
}

}  // namespace forge
