#include "ops/attention.h"

#include "kernels/cpu/attention.h"

namespace forge {
namespace {

void check_f32_cpu(const Tensor& t, const char* what) {
  check_dtype(t, DType::F32, what);
  FORGE_CHECK(t.device() == Device::CPU, "{}: no CUDA kernel in this build", what);
}

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

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& shape) {
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_forward");
  check_shape(out, {dims.batch, dims.seq, dims.q_heads, dims.head_dim}, "attention_forward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_forward lse");
  check_f32_cpu(out, "attention_forward out");
  check_f32_cpu(lse, "attention_forward lse");
  check_f32_cpu(qkv, "attention_forward qkv");
  cpu::attention_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), dims);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape) {
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_backward");
  check_shape(dqkv, qkv.shape(), "attention_backward dqkv");
  check_shape(dout, {dims.batch, dims.seq, dims.q_heads, dims.head_dim}, "attention_backward dout");
  check_shape(out, dout.shape(), "attention_backward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_backward lse");
  check_f32_cpu(dqkv, "attention_backward dqkv");
  check_f32_cpu(dout, "attention_backward dout");
  check_f32_cpu(qkv, "attention_backward qkv");
  check_f32_cpu(out, "attention_backward out");
  check_f32_cpu(lse, "attention_backward lse");
  FORGE_CHECK(dqkv.raw() != qkv.raw(), "attention_backward: dqkv must not alias qkv");
  cpu::attention_backward(dqkv.data<float>(), dout.data<float>(), qkv.data<float>(), out.data<float>(),
                          lse.data<float>(), dims);
}

}  // namespace forge
