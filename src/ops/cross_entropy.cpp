#include "ops/cross_entropy.h"

#include "kernels/cpu/cross_entropy.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/cross_entropy.h"
#endif

namespace forge {
void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, int32_t ignore_index, float grad_scale) {
  OpProfileScope profile(OpClass::Elementwise, "cross_entropy_forward_backward");
  FORGE_CHECK(logits.ndim() == 2, "cross_entropy: logits {} must be [N, V]", shape_str(logits.shape()));
  int64_t rows = logits.dim(0), vocab = logits.dim(1);
  FORGE_CHECK(vocab > 0, "cross_entropy: logits {} have no classes", shape_str(logits.shape()));
  check_shape(losses, {rows}, "cross_entropy losses");
  check_shape(targets, {rows}, "cross_entropy targets");
  if (logits.device() == Device::CUDA) {
    // Targets on the GPU were validated when the batch was made (data layer).
    expect_tensor(losses, Device::CUDA, DType::F32, "cross_entropy losses");
    expect_tensor(logits, Device::CUDA, DType::BF16, "cross_entropy logits");
    expect_tensor(targets, Device::CUDA, DType::I32, "cross_entropy targets");
    if (dlogits.defined()) {
      check_shape(dlogits, logits.shape(), "cross_entropy dlogits");
      expect_tensor(dlogits, Device::CUDA, DType::BF16, "cross_entropy dlogits");
    }
    FORGE_CUDA_CALL("cross_entropy",
                    cuda::cross_entropy_forward_backward(
                        losses.data<float>(), dlogits.defined() ? static_cast<cuda::bf16*>(dlogits.raw()) : nullptr,
                        static_cast<const cuda::bf16*>(logits.raw()), targets.data<int32_t>(), rows, vocab,
                        ignore_index, grad_scale));
    return;
  }
  expect_tensor(losses, Device::CPU, DType::F32, "cross_entropy losses");
  expect_tensor(logits, Device::CPU, DType::F32, "cross_entropy logits");
  expect_tensor(targets, Device::CPU, DType::I32, "cross_entropy targets");
  float* dlogits_data = nullptr;
  if (dlogits.defined()) {
    check_shape(dlogits, logits.shape(), "cross_entropy dlogits");
    expect_tensor(dlogits, Device::CPU, DType::F32, "cross_entropy dlogits");
    dlogits_data = dlogits.data<float>();
  }
  const int32_t* target_data = targets.data<int32_t>();
  for (int64_t n = 0; n < rows; ++n) {
    int32_t t = target_data[n];
    if (t != ignore_index && (t < 0 || t >= vocab)) {
      FORGE_FAIL("cross_entropy: target {} in row {} is outside [0, {}) and is not the ignore index {}", t, n, vocab,
                 ignore_index);
    }
  }
  cpu::cross_entropy_forward_backward(losses.data<float>(), dlogits_data, logits.data<float>(), target_data, rows,
                                      vocab, ignore_index, grad_scale);
}

}  // namespace forge
