// The T5 encoder's GPU path against the CPU reference on fresh random data
// (gpu_testing.h): dense attention (ops/dense_attention.h; NOTE [Dense
// attention on the GPU]) on T5's shape with its position bias, the VAE's one
// head of 512 without one, head dims, key counts and value widths that are not
// multiples of 8 (the zero padding), more keys than queries, a single key,
// all-but-one keys masked by a -inf bias (the online softmax's empty parts),
// and shapes large enough to be cut into several chunks of (sample, head) pairs
// and of query rows; then the whole encoder (NOTE [T5 precision]) in bf16 on a
// tiny config against the CPU's fp32, batch of 3, a sequence longer than
// max_distance.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "gpu_testing.h"
#include "model/t5_encoder.h"
#include "ops/dense_attention.h"

namespace forge::gpu_test {
namespace {

struct AttentionCase {
  int64_t batch, q_len, kv_len, heads, head_dim, v_head_dim;
  bool bias;
  float scale;
};

std::string name(const AttentionCase& c) {
  return fmt::format("B={} Lq={} Lk={} H={} D={} Dv={}{}", c.batch, c.q_len, c.kv_len, c.heads, c.head_dim,
                     c.v_head_dim, c.bias ? " bias" : "");
}

void check_attention(const AttentionCase& c, Rng& rng, Tensor* bias_override = nullptr) {
  const Tensor q = random_bf16_values({c.batch, c.q_len, c.heads, c.head_dim}, rng);
  const Tensor k = random_bf16_values({c.batch, c.kv_len, c.heads, c.head_dim}, rng);
  const Tensor v = random_bf16_values({c.batch, c.kv_len, c.heads, c.v_head_dim}, rng);
  Tensor bias = bias_override ? *bias_override : random_bf16_values({c.heads, c.q_len, c.kv_len}, rng, 2.0);
  const Shape out_shape{c.batch, c.q_len, c.heads, c.v_head_dim};
  Tensor out = Tensor::empty(out_shape);
  dense_attention_forward(out, q, k, v, c.bias ? &bias : nullptr, c.scale);
  const Tensor bias_g = to_gpu(bias, DType::BF16);
  Tensor out_g = poisoned_gpu(out_shape, DType::BF16);
  dense_attention_forward(out_g, to_gpu(q, DType::BF16), to_gpu(k, DType::BF16), to_gpu(v, DType::BF16),
                          c.bias ? &bias_g : nullptr, c.scale);
  EXPECT_LT(relative_l2(to_cpu_f32(out_g), out), kBf16Tolerance) << name(c);
}

TEST(GpuDenseAttention, MatchesCpu) {
  Rng rng(seed_for_current_test());
  const float t5 = 1.0f / 8.0f;  // T5's unscaled scores of random unit-variance
                                 // q, k of 64 grow as sqrt(64)
  for (const AttentionCase& c : {
           AttentionCase{2, 77, 77, 8, 64, 64, true, t5},                             // T5-like, with the position bias
           AttentionCase{1, 300, 300, 1, 512, 512, false, 1.0f / std::sqrt(512.0f)},  // the VAE's head
           AttentionCase{3, 13, 13, 5, 6, 10, true, 0.4f},                            // nothing a multiple of 8
           AttentionCase{2, 7, 33, 3, 16, 24, true, 0.25f},                           // more keys than queries
           AttentionCase{2, 5, 1, 2, 8, 8, true, 1.0f},                               // one key
           AttentionCase{1, 1, 4099, 2, 40, 8, false, 0.15f},                         // a long row over 256 threads
       })
    check_attention(c, rng);
}

TEST(GpuDenseAttention, MaskedKeysAndChunks) {
  Rng rng(seed_for_current_test());
  // A bias of -inf everywhere but one key per row: whole warps see only -inf.
  const AttentionCase masked{2, 40, 300, 2, 16, 16, true, 0.3f};
  Tensor bias = Tensor::empty({masked.heads, masked.q_len, masked.kv_len});
  for (int64_t i = 0; i < bias.numel(); ++i)
    bias.data<float>()[i] = (i / masked.kv_len) % masked.q_len == i % masked.kv_len  // key j = query row i
                                ? 0.0f
                                : -std::numeric_limits<float>::infinity();
  check_attention(masked, rng, &bias);
  // 256 (sample, head) pairs of T5's 512 x 512: more pairs than one chunk
  // holds.
  check_attention(AttentionCase{4, 512, 512, 64, 64, 64, true, 1.0f / 8.0f}, rng);
  // One pair whose scores exceed the budget: query rows in chunks.
  check_attention(AttentionCase{1, 9000, 9000, 1, 8, 8, false, 0.5f}, rng);
}

TEST(GpuT5Encoder, MatchesCpu) {
  T5Config c;
  c.name = "gpu-test";
  c.vocab_size = 300;
  c.d_model = 64;
  c.d_kv = 16;
  c.num_heads = 4;
  c.d_ff = 96;
  c.num_layers = 3;
  c.relative_attention_num_buckets = 32;
  c.relative_attention_max_distance = 20;
  T5Weights cpu(c);
  cpu.initialize(seed_for_current_test());
  for (const Tensor& t : cpu.tensors()) round_to_bf16(t);  // both sides hold the same values
  T5Weights gpu(c, Device::CUDA, DType::BF16);
  gpu.assign_from(cpu);

  Rng rng(seed_for_current_test() + 1);
  const int64_t batch = 3, length = 45;
  Tensor tokens = Tensor::empty({batch, length}, DType::I32);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(300));
  Tensor out = Tensor::empty({batch, length, c.d_model});
  T5Encoder(cpu).forward(tokens, out);
  Tensor out_g = poisoned_gpu({batch, length, c.d_model}, DType::BF16);
  T5Encoder encoder(gpu);
  encoder.forward(tokens, out_g);
  EXPECT_LT(relative_l2(to_cpu_f32(out_g), out), 2 * kBf16Tolerance);
  // A second call of the same shape reuses the buffers (and the position bias).
  Tensor again = poisoned_gpu({batch, length, c.d_model}, DType::BF16);
  encoder.forward(tokens, again);
  EXPECT_LT(relative_l2(to_cpu_f32(again), to_cpu_f32(out_g)), 1e-3);
}

}  // namespace
}  // namespace forge::gpu_test
