#include "ops/attention_chunk.h"

#include "core/op_profile.h"
#include "kernels/cpu/attention_chunk.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/attention.h"
#endif

namespace forge {
namespace {

// The chunk's dimensions from qkv and kv, checked against `shape` (NOTE [Chunk attention]).
cpu::AttentionChunkDims chunk_dims(const Tensor& qkv, const Tensor& kv, int64_t position, const AttentionShape& shape,
                                   const char* op) {
  check_attention_shape(qkv, shape, op);
  FORGE_CHECK(shape.causal, "{}: chunk attention is causal; bidirectional attention (NOTE [Bidirectional attention]) "
              "is not taken", op);
  FORGE_CHECK(!shape.distinct_v_head_dim(), "{}: values of a head dim of their own ({} against {}) are not taken", op,
              shape.v_head_dim, shape.head_dim);
  const int64_t b = qkv.dim(0), queries = qkv.dim(1), hkv = shape.num_kv_heads, d = qkv.dim(3);
  FORGE_CHECK(kv.ndim() == 4 && kv.dim(0) == b && kv.dim(2) == 2 * hkv && kv.dim(3) == d,
              "{}: kv {} must be [{}, S, 2 * {}, {}] for qkv {}", op, shape_str(kv.shape()), b, hkv, d,
              shape_str(qkv.shape()));
  FORGE_CHECK(position >= 0 && position + queries <= kv.dim(1),
              "{}: the chunk's {} queries at position {} are not within kv's {} positions", op, queries, position,
              kv.dim(1));
  FORGE_CHECK(qkv.device() == kv.device(), "{}: qkv on {}, kv on {}", op, device_name(qkv.device()),
              device_name(kv.device()));
  return cpu::AttentionChunkDims{.batch = b,
                                 .queries = queries,
                                 .position = position,
                                 .kv_seq = kv.dim(1),
                                 .q_heads = shape.num_q_heads,
                                 .kv_heads = hkv,
                                 .head_dim = d,
                                 .window = shape.sliding_window,
                                 .scale = shape.scale};
}

#ifdef FORGE_CUDA
cuda::AttentionProblem cuda_problem(const cpu::AttentionChunkDims& d) {
  // cuDNN's fused attention rejects a single query; no chunk of a training run has one.
  if (d.queries < 2) FORGE_FAIL("chunk attention on CUDA needs at least 2 queries, got {}", d.queries);
  cuda::AttentionProblem p{d.batch, d.queries, d.q_heads, d.kv_heads, d.head_dim, d.head_dim, d.window, d.scale};
  p.chunk = {d.position, d.kv_seq};
  return p;
}
#endif

}  // namespace

void attention_chunk_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             int64_t position, const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Attention, "attention_chunk_forward");
  const cpu::AttentionChunkDims d = chunk_dims(qkv, kv, position, shape, "attention_chunk_forward");
  check_shape(out, {d.batch, d.queries, d.q_heads, d.head_dim}, "attention_chunk_forward out");
  check_shape(lse, {d.batch, d.q_heads, d.queries}, "attention_chunk_forward lse");
  const bool cuda = qkv.device() == Device::CUDA;
  const DType act = cuda ? DType::BF16 : DType::F32;
  expect_tensor(out, qkv.device(), act, "attention_chunk_forward out");
  expect_tensor(lse, qkv.device(), DType::F32, "attention_chunk_forward lse");
  expect_tensor(qkv, qkv.device(), act, "attention_chunk_forward qkv");
  expect_tensor(kv, qkv.device(), act, "attention_chunk_forward kv");
  if (cuda) {
    FORGE_CUDA_CALL(
        "attention_chunk_forward",
        cuda::attention_chunk_forward(bf16_ptr(out), lse.data<float>(), bf16_ptr(qkv), bf16_ptr(kv), cuda_problem(d)));
    return;
  }
  cpu::attention_chunk_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), kv.data<float>(), d);
}

void attention_chunk_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& kv, const Tensor& out, const Tensor& lse, int64_t position,
                              const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Attention, "attention_chunk_backward");
  const cpu::AttentionChunkDims d = chunk_dims(qkv, kv, position, shape, "attention_chunk_backward");
  check_shape(dqkv, qkv.shape(), "attention_chunk_backward dqkv");
  check_shape(dkv, kv.shape(), "attention_chunk_backward dkv");
  check_shape(dout, {d.batch, d.queries, d.q_heads, d.head_dim}, "attention_chunk_backward dout");
  check_shape(out, dout.shape(), "attention_chunk_backward out");
  check_shape(lse, {d.batch, d.q_heads, d.queries}, "attention_chunk_backward lse");
  FORGE_CHECK(dqkv.raw() != qkv.raw() && dkv.raw() != kv.raw(),
              "attention_chunk_backward: dqkv and dkv must not alias qkv and kv");
  const bool cuda = qkv.device() == Device::CUDA;
  const DType act = cuda ? DType::BF16 : DType::F32;
  expect_tensor(dqkv, qkv.device(), act, "attention_chunk_backward dqkv");
  expect_tensor(dkv, qkv.device(), act, "attention_chunk_backward dkv");
  expect_tensor(dout, qkv.device(), act, "attention_chunk_backward dout");
  expect_tensor(qkv, qkv.device(), act, "attention_chunk_backward qkv");
  expect_tensor(kv, qkv.device(), act, "attention_chunk_backward kv");
  expect_tensor(out, qkv.device(), act, "attention_chunk_backward out");
  expect_tensor(lse, qkv.device(), DType::F32, "attention_chunk_backward lse");
  if (cuda) {
    FORGE_CUDA_CALL("attention_chunk_backward",
                    cuda::attention_chunk_backward(bf16_ptr(dqkv), bf16_ptr(dkv), bf16_ptr(dout), bf16_ptr(qkv),
                                                   bf16_ptr(kv), bf16_ptr(out), lse.data<float>(), cuda_problem(d)));
    return;
  }
  cpu::attention_chunk_backward(dqkv.data<float>(), dkv.data<float>(), dout.data<float>(), qkv.data<float>(),
                                kv.data<float>(), out.data<float>(), lse.data<float>(), d);
}

}  // namespace forge
