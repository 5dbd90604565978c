#include "ops/embedding.h"

#include "kernels/cpu/embedding.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/embedding.h"
#endif

namespace forge {
namespace {

void check_token_ids(const Tensor& tokens, int64_t vocab, const char* op) {
  const int32_t* ids = tokens.data<int32_t>();
  for (int64_t n = 0; n < tokens.numel(); ++n) {
    if (ids[n] < 0 || ids[n] >= vocab) {
      FORGE_FAIL("{}: token id {} at position {} is outside the vocabulary [0, {})", op, ids[n], n, vocab);
    }
  }
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_forward");
  FORGE_CHECK(table.ndim() == 2, "embedding_forward: table {} must be [V, H]", shape_str(table.shape()));
  FORGE_CHECK(tokens.ndim() == 1, "embedding_forward: tokens {} must be [N]", shape_str(tokens.shape()));
  int64_t count = tokens.dim(0), vocab = table.dim(0), hidden = table.dim(1);
  check_shape(out, {count, hidden}, "embedding_forward out");
  if (table.device() == Device::CUDA) {
    // Token ids on the GPU were validated when the batch was made (data layer).
    expect_tensor(out, Device::CUDA, DType::BF16, "embedding_forward out");
    expect_tensor(tokens, Device::CUDA, DType::I32, "embedding_forward tokens");
    expect_tensor(table, Device::CUDA, DType::BF16, "embedding_forward table");
    FORGE_CUDA_CALL("embedding_forward",
                    cuda::embedding_forward(static_cast<cuda::bf16*>(out.raw()), tokens.data<int32_t>(),
                                            static_cast<const cuda::bf16*>(table.raw()), count, hidden));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "embedding_forward out");
  expect_tensor(tokens, Device::CPU, DType::I32, "embedding_forward tokens");
  expect_tensor(table, Device::CPU, DType::F32, "embedding_forward table");
  check_token_ids(tokens, vocab, "embedding_forward");
  cpu::embedding_forward(out.data<float>(), tokens.data<int32_t>(), table.data<float>(), count, hidden);
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_backward");
  FORGE_CHECK(dtable.ndim() == 2, "embedding_backward: dtable {} must be [V, H]", shape_str(dtable.shape()));
  FORGE_CHECK(tokens.ndim() == 1, "embedding_backward: tokens {} must be [N]", shape_str(tokens.shape()));
  int64_t count = tokens.dim(0), vocab = dtable.dim(0), hidden = dtable.dim(1);
  check_shape(dout, {count, hidden}, "embedding_backward dout");
  if (dtable.device() == Device::CUDA) {
    expect_tensor(dtable, Device::CUDA, DType::F32, "embedding_backward dtable");
    expect_tensor(dout, Device::CUDA, DType::BF16, "embedding_backward dout");
    expect_tensor(tokens, Device::CUDA, DType::I32, "embedding_backward tokens");
    FORGE_CUDA_CALL("embedding_backward",
                    cuda::embedding_backward(dtable.data<float>(), static_cast<const cuda::bf16*>(dout.raw()),
                                             tokens.data<int32_t>(), count, hidden));
    return;
  }
  expect_tensor(dtable, Device::CPU, DType::F32, "embedding_backward dtable");
  expect_tensor(dout, Device::CPU, DType::F32, "embedding_backward dout");
  expect_tensor(tokens, Device::CPU, DType::I32, "embedding_backward tokens");
  check_token_ids(tokens, vocab, "embedding_backward");
  cpu::embedding_backward(dtable.data<float>(), dout.data<float>(), tokens.data<int32_t>(), count, vocab, hidden);
}

}  // namespace forge
