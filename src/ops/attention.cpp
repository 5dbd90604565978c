#include "ops/attention.h"

#include "kernels/cpu/attention.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/attention.h"
#endif

namespace forge {
namespace {

cpu::AttentionDims attention_dims(const Tensor& qkv, const AttentionShape& shape, const char* op) {
  FORGE_CHECK(shape.num_kv_heads > 0 && shape.num_q_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0,
              "{}: {} query heads do not split into groups over {} kv heads", op, shape.num_q_heads,
              shape.num_kv_heads);
  FORGE_CHECK(shape.sliding_window >= 0, "{}: sliding window {} is negative", op, shape.sliding_window);
  FORGE_CHECK(shape.scale > 0.0f, "{}: scale {} must be positive", op, shape.scale);
  FORGE_CHECK(qkv.ndim() == 4 && qkv.dim(2) == shape.num_q_heads + 2 * shape.num_kv_heads,
              "{}: qkv {} must be [B, T, {} + 2 * {}, D]", op, shape_str(qkv.shape()), shape.num_q_heads,
              shape.num_kv_heads);
  return cpu::AttentionDims{.batch = qkv.dim(0),
                            .seq = qkv.dim(1),
                            .q_heads = shape.num_q_heads,
                            .kv_heads = shape.num_kv_heads,
                            .head_dim = qkv.dim(3),
                            .window = shape.sliding_window,
                            .scale = shape.scale};
}

#ifdef FORGE_CUDA
cuda::AttentionProblem cuda_problem(const cpu::AttentionDims& d) {
  // cuDNN's fused attention rejects a single-token sequence; no training run has one.
  if (d.seq < 2) FORGE_FAIL("attention on CUDA needs a sequence of at least 2 tokens, got {}", d.seq);
  return {d.batch, d.seq, d.q_heads, d.kv_heads, d.head_dim, d.window, d.scale};
}
#endif

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Attention, "attention_forward");
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_forward");
  check_shape(out, {dims.batch, dims.seq, dims.q_heads, dims.head_dim}, "attention_forward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_forward lse");
  if (qkv.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "attention_forward out");
    expect_tensor(lse, Device::CUDA, DType::F32, "attention_forward lse");
    expect_tensor(qkv, Device::CUDA, DType::BF16, "attention_forward qkv");
    FORGE_CUDA_CALL("attention_forward",
                    cuda::attention_forward(static_cast<cuda::bf16*>(out.raw()), lse.data<float>(),
                                            static_cast<const cuda::bf16*>(qkv.raw()), cuda_problem(dims)));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "attention_forward out");
  expect_tensor(lse, Device::CPU, DType::F32, "attention_forward lse");
  expect_tensor(qkv, Device::CPU, DType::F32, "attention_forward qkv");
  cpu::attention_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), dims);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Attention, "attention_backward");
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_backward");
  check_shape(dqkv, qkv.shape(), "attention_backward dqkv");
  check_shape(dout, {dims.batch, dims.seq, dims.q_heads, dims.head_dim}, "attention_backward dout");
  check_shape(out, dout.shape(), "attention_backward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_backward lse");
  FORGE_CHECK(dqkv.raw() != qkv.raw(), "attention_backward: dqkv must not alias qkv");
  if (qkv.device() == Device::CUDA) {
    expect_tensor(dqkv, Device::CUDA, DType::BF16, "attention_backward dqkv");
    expect_tensor(dout, Device::CUDA, DType::BF16, "attention_backward dout");
    expect_tensor(qkv, Device::CUDA, DType::BF16, "attention_backward qkv");
    expect_tensor(out, Device::CUDA, DType::BF16, "attention_backward out");
    expect_tensor(lse, Device::CUDA, DType::F32, "attention_backward lse");
    FORGE_CUDA_CALL("attention_backward",
                    cuda::attention_backward(static_cast<cuda::bf16*>(dqkv.raw()),
                                             static_cast<const cuda::bf16*>(dout.raw()),
                                             static_cast<const cuda::bf16*>(qkv.raw()),
                                             static_cast<const cuda::bf16*>(out.raw()), lse.data<float>(),
                                             cuda_problem(dims)));
    return;
  }
  expect_tensor(dqkv, Device::CPU, DType::F32, "attention_backward dqkv");
  expect_tensor(dout, Device::CPU, DType::F32, "attention_backward dout");
  expect_tensor(qkv, Device::CPU, DType::F32, "attention_backward qkv");
  expect_tensor(out, Device::CPU, DType::F32, "attention_backward out");
  expect_tensor(lse, Device::CPU, DType::F32, "attention_backward lse");
  cpu::attention_backward(dqkv.data<float>(), dout.data<float>(), qkv.data<float>(), out.data<float>(),
                          lse.data<float>(), dims);
}

}  // namespace forge
