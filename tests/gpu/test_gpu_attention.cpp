// cuDNN flash attention (forward and backward) against the CPU reference attention on
// the packed QKV layout: causal and bidirectional (NOTE [Bidirectional attention]),
// grouped-query at several ratios, sliding windows, and short or odd sequence lengths; and values of their own head dim (NOTE [Value head dim]
// in ops/attention.h) at DeepSeek MLA's dims.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_testing.h"
#include "ops/attention.h"

namespace forge::gpu_test {
namespace {

struct AttentionCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, window;
  bool causal = true;
};

TEST(GpuAttention, ForwardAndBackwardMatchCpu) {
  Rng rng(seed_for_current_test());
  for (AttentionCase c : {AttentionCase{1, 2, 2, 1, 64, 0}, AttentionCase{2, 37, 4, 4, 64, 0},
                          AttentionCase{1, 129, 8, 2, 128, 0}, AttentionCase{2, 100, 8, 2, 128, 16},
                          AttentionCase{1, 512, 32, 8, 128, 0}, AttentionCase{1, 300, 4, 1, 64, 1},
                          AttentionCase{1, 2, 2, 1, 64, 0, false}, AttentionCase{2, 37, 4, 4, 64, 0, false},
                          AttentionCase{1, 129, 8, 2, 128, 0, false}}) {
    int64_t heads = c.q_heads + 2 * c.kv_heads;
    AttentionShape shape{c.q_heads, c.kv_heads, c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
    shape.causal = c.causal;
    Tensor qkv = random_bf16_values({c.batch, c.seq, heads, c.head_dim}, rng);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    attention_forward(out, lse, qkv, shape);

    Tensor qkvg = to_gpu(qkv, DType::BF16);
    Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
    attention_forward(outg, lseg, qkvg, shape);
    std::string what = fmt::format("b{} t{} hq{} hkv{} d{} w{}{}", c.batch, c.seq, c.q_heads, c.kv_heads, c.head_dim,
                                   c.window, c.causal ? "" : " bidirectional");
    EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(lseg), lse), kF32Tolerance) << what;

    Tensor dout = random_bf16_values(out.shape(), rng);
    Tensor dqkv = Tensor::empty(qkv.shape());
    attention_backward(dqkv, dout, qkv, out, lse, shape);
    Tensor dqkvg = poisoned_gpu(qkv.shape(), DType::BF16);
    attention_backward(dqkvg, to_gpu(dout, DType::BF16), qkvg, outg, lseg, shape);
    EXPECT_LT(relative_l2(to_cpu_f32(dqkvg), dqkv), 2 * kBf16Tolerance) << what;
  }
}

struct ValueDimCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, v_head_dim, window;
};

void expect_value_dim_matches_cpu(const ValueDimCase& c, Rng& rng) {
  const AttentionShape shape{c.q_heads,  c.kv_heads,  c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                             c.head_dim, c.v_head_dim};
  const std::string what = fmt::format("b{} t{} hq{} hkv{} d{} dv{} w{}", c.batch, c.seq, c.q_heads, c.kv_heads,
                                       c.head_dim, c.v_head_dim, c.window);
  Tensor qkv = random_bf16_values(shape.qkv_shape(c.batch, c.seq), rng);
  Tensor out = Tensor::empty(shape.out_shape(c.batch, c.seq)), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
  attention_forward(out, lse, qkv, shape);

  Tensor qkvg = to_gpu(qkv, DType::BF16);
  Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
  attention_forward(outg, lseg, qkvg, shape);
  EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
  EXPECT_LT(relative_l2(to_cpu_f32(lseg), lse), kF32Tolerance) << what;

  Tensor dout = random_bf16_values(out.shape(), rng);
  Tensor dqkv = Tensor::empty(qkv.shape());
  attention_backward(dqkv, dout, qkv, out, lse, shape);
  Tensor dqkvg = poisoned_gpu(qkv.shape(), DType::BF16);
  attention_backward(dqkvg, to_gpu(dout, DType::BF16), qkvg, outg, lseg, shape);
  EXPECT_LT(relative_l2(to_cpu_f32(dqkvg), dqkv), 2 * kBf16Tolerance) << what;
}

// MLA's attention: as many kv heads as query heads, queries and keys of 128 + 64 rotary
// dims, values of 128; a full sequence and a short odd one.
TEST(GpuAttention, ValueHeadDimMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (ValueDimCase c : {ValueDimCase{2, 256, 4, 4, 192, 128, 0}, ValueDimCase{1, 37, 4, 4, 192, 128, 0}})
    expect_value_dim_matches_cpu(c, rng);
}

// The same dims with grouped kv heads and a sliding window, which MLA does not use.
TEST(GpuAttention, ValueHeadDimWithGroupsAndWindowMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (ValueDimCase c : {ValueDimCase{2, 130, 8, 2, 192, 128, 0}, ValueDimCase{1, 200, 4, 2, 192, 128, 24}})
    expect_value_dim_matches_cpu(c, rng);
}

TEST(GpuAttention, SingleTokenSequenceIsAClearError) {
  Tensor qkv = poisoned_gpu({1, 1, 3, 64}, DType::BF16);
  Tensor out = poisoned_gpu({1, 1, 1, 64}, DType::BF16), lse = poisoned_gpu({1, 1, 1}, DType::F32);
  EXPECT_THROW(attention_forward(out, lse, qkv, AttentionShape{1, 1, 0, 0.125f}), Error);
}

}  // namespace
}  // namespace forge::gpu_test
