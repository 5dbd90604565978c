#include "ops/row_softmax.h"

#include "core/op_profile.h"
#include "kernels/cpu/row_softmax.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/row_softmax.h"
#endif

namespace forge {

void row_softmax(const Tensor& probs, const Tensor& scores) {
  OpProfileScope profile(OpClass::Attention, "row_softmax");
  FORGE_CHECK(scores.ndim() >= 1 && scores.dim(-1) > 0, "row_softmax: scores {} must have a non-empty last dim",
              shape_str(scores.shape()));
  check_shape(probs, scores.shape(), "row_softmax probs");
  const int64_t cols = scores.dim(-1), rows = scores.numel() / cols;
  if (scores.device() == Device::CUDA) {
    expect_tensor(probs, Device::CUDA, DType::BF16, "row_softmax probs");
    expect_tensor(scores, Device::CUDA, DType::F32, "row_softmax scores");
    FORGE_CUDA_CALL("row_softmax", cuda::row_softmax(bf16_ptr(probs), scores.data<float>(), rows, cols));
    return;
  }
  expect_tensor(probs, Device::CPU, DType::F32, "row_softmax probs");
  expect_tensor(scores, Device::CPU, DType::F32, "row_softmax scores");
  cpu::row_softmax(probs.data<float>(), scores.data<float>(), rows, cols);
}

}  // namespace forge
