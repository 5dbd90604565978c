#include "ops/decode_attention.h"

#include "core/op_profile.h"
#include "kernels/cpu/decode_attention.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/decode_attention.h"
#endif

namespace forge {
namespace {

// Validates the step and the caches in the form the shape expects (ops/decode_attention.h)
// and returns the kernels' dims, v_head_dim resolved (equal to head_dim in the uniform form).
cpu::DecodeAttentionDims decode_dims(const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                     int64_t position, const AttentionShape& shape, const char* op) {
  check_attention_shape(qkv, shape, op);
  FORGE_CHECK(shape.causal, "{}: decoding is causal; bidirectional attention (NOTE [Bidirectional attention]) is "
              "not taken", op);
  const bool distinct = shape.distinct_v_head_dim();
  const int64_t batch = qkv.dim(0), kv_heads = shape.num_kv_heads;
  const int64_t head_dim = distinct ? shape.head_dim : qkv.dim(3), v_head_dim = distinct ? shape.v_head_dim : head_dim;
  FORGE_CHECK(k_cache.ndim() == 4 && k_cache.dim(0) == batch && k_cache.dim(2) == kv_heads &&
                  k_cache.dim(3) == head_dim,
              "{}: k_cache {} must be [{}, capacity, {}, {}] (batch, positions, kv heads, key head dim)", op,
              shape_str(k_cache.shape()), batch, kv_heads, head_dim);
  FORGE_CHECK(v_cache.ndim() == 4 && v_cache.dim(0) == batch && v_cache.dim(1) == k_cache.dim(1) &&
                  v_cache.dim(2) == kv_heads && v_cache.dim(3) == v_head_dim,
              "{}: v_cache {} must be [{}, {}, {}, {}] (batch, k_cache's positions, kv heads, {} {})", op,
              shape_str(v_cache.shape()), batch, k_cache.dim(1), kv_heads, v_head_dim,
              distinct ? "v_head_dim" : "head dim", v_head_dim);
  FORGE_CHECK(position >= 0 && position + qkv.dim(1) <= k_cache.dim(1),
              "{}: positions {} .. {} do not fit a cache of {}", op, position, position + qkv.dim(1) - 1,
              k_cache.dim(1));
  const DType dtype = qkv.device() == Device::CUDA ? DType::BF16 : DType::F32;
  expect_tensor(qkv, qkv.device(), dtype, op);
  expect_tensor(k_cache, qkv.device(), dtype, op);
  expect_tensor(v_cache, qkv.device(), dtype, op);
  return cpu::DecodeAttentionDims{.batch = batch,
                                  .queries = qkv.dim(1),
                                  .capacity = k_cache.dim(1),
                                  .q_heads = shape.num_q_heads,
                                  .kv_heads = kv_heads,
                                  .head_dim = head_dim,
                                  .window = shape.sliding_window,
                                  .position = position,
                                  .scale = shape.scale,
                                  .v_head_dim = v_head_dim};
}

#ifdef FORGE_CUDA
cuda::DecodeAttentionProblem cuda_problem(const cpu::DecodeAttentionDims& d) {
  return {d.batch, d.queries, d.capacity, d.q_heads, d.kv_heads, d.head_dim, d.window, d.position, d.scale,
          d.v_head_dim};
}
#endif

}  // namespace

void kv_cache_append(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv, int64_t position,
                     const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Elementwise, "kv_cache_append");
  const cpu::DecodeAttentionDims dims = decode_dims(qkv, k_cache, v_cache, position, shape, "kv_cache_append");
  if (qkv.device() == Device::CUDA) {
    FORGE_CUDA_CALL("kv_cache_append",
                    cuda::kv_cache_append(static_cast<cuda::bf16*>(k_cache.raw()),
                                          static_cast<cuda::bf16*>(v_cache.raw()),
                                          static_cast<const cuda::bf16*>(qkv.raw()), cuda_problem(dims)));
    return;
  }
  cpu::kv_cache_append(k_cache.data<float>(), v_cache.data<float>(), qkv.data<float>(), dims);
}

void decode_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                              int64_t position, const AttentionShape& shape) {
  OpProfileScope profile(OpClass::Attention, "decode_attention_forward");
  const cpu::DecodeAttentionDims dims =
      decode_dims(qkv, k_cache, v_cache, position, shape, "decode_attention_forward");
  check_shape(out, {dims.batch, dims.queries, dims.q_heads, dims.v_head_dim}, "decode_attention_forward out");
  expect_tensor(out, qkv.device(), qkv.dtype(), "decode_attention_forward out");
  if (qkv.device() == Device::CUDA) {
    FORGE_CUDA_CALL("decode_attention_forward",
                    cuda::decode_attention_forward(static_cast<cuda::bf16*>(out.raw()),
                                                   static_cast<const cuda::bf16*>(qkv.raw()),
                                                   static_cast<const cuda::bf16*>(k_cache.raw()),
                                                   static_cast<const cuda::bf16*>(v_cache.raw()), cuda_problem(dims)));
    return;
  }
  cpu::decode_attention_forward(out.data<float>(), qkv.data<float>(), k_cache.data<float>(), v_cache.data<float>(),
                                dims);
}

}  // namespace forge
