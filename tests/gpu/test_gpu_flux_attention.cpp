// The ops FLUX's joint attention adds, on the GPU against the CPU reference on fresh random
// data (gpu_testing.h): QK RMSNorm + pair RoPE into a stream's rows of the joint qkv,
// bidirectional attention (NOTE [Bidirectional attention] in ops/attention.h), a linear
// layer's bias (NOTE [Linear bias] in ops/linear.h) and column copies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu_testing.h"
#include "ops/attention.h"
#include "ops/bias.h"
#include "ops/linear.h"
#include "ops/qk_norm_rope.h"

namespace forge::gpu_test {
namespace {

struct StreamCase {
  int64_t batch, seq, stream_seq, heads, head_dim, offset;
};

// cos, sin [T, D/2] fp32 of random angles.
void random_tables(Tensor& cos, Tensor& sin, int64_t seq, int64_t half, Rng& rng) {
  cos = Tensor::empty({seq, half});
  sin = Tensor::empty({seq, half});
  for (int64_t i = 0; i < seq * half; ++i) {
    const double angle = 3.0 * rng.normal();
    cos.data<float>()[i] = static_cast<float>(std::cos(angle));
    sin.data<float>()[i] = static_cast<float>(std::sin(angle));
  }
}

// FLUX's head dim 128 with the image stream after the text (offset > 0) and the text stream
// first; a stream that is the whole sequence; head dims of 1, 2 and 4 pairs per lane
// (D = 6: fewer pairs than lanes).
TEST(GpuFluxAttentionOps, QkNormRopeMatchesCpu) {
  Rng rng(seed_for_current_test());
  const float eps = 1e-6f;
  for (StreamCase c : {StreamCase{2, 100, 60, 4, 128, 40}, StreamCase{2, 100, 40, 4, 128, 0},
                       StreamCase{1, 37, 37, 3, 64, 0}, StreamCase{2, 50, 20, 2, 256, 17},
                       StreamCase{1, 9, 5, 2, 6, 4}}) {
    const std::string what = fmt::format("B={} T={} Ts={} H={} D={} offset={}", c.batch, c.seq, c.stream_seq,
                                         c.heads, c.head_dim, c.offset);
    const int64_t heads = 3 * c.heads;
    const Tensor qkv_in = random_bf16_values({c.batch, c.stream_seq, heads, c.head_dim}, rng, 2.0);
    const Tensor q_weight = random_bf16_values({c.head_dim}, rng), k_weight = random_bf16_values({c.head_dim}, rng);
    Tensor cos, sin;
    random_tables(cos, sin, c.seq, c.head_dim / 2, rng);
    const Tensor cos_g = cos.to(Device::CUDA), sin_g = sin.to(Device::CUDA);
    const Tensor qkv_in_g = to_gpu(qkv_in, DType::BF16), q_weight_g = to_gpu(q_weight, DType::BF16),
                 k_weight_g = to_gpu(k_weight, DType::BF16);

    // The joint tensor starts with the other stream's values, which must stay.
    Tensor qkv = random_bf16_values({c.batch, c.seq, heads, c.head_dim}, rng);
    Tensor qkv_g = to_gpu(qkv, DType::BF16);
    Tensor rstd = Tensor::empty({c.batch, c.stream_seq, 2 * c.heads});
    Tensor rstd_g = poisoned_gpu(rstd.shape(), DType::F32);
    qk_norm_rope_forward(qkv, rstd, qkv_in, q_weight, k_weight, eps, cos, sin, c.offset);
    qk_norm_rope_forward(qkv_g, rstd_g, qkv_in_g, q_weight_g, k_weight_g, eps, cos_g, sin_g, c.offset);
    EXPECT_LT(relative_l2(to_cpu_f32(qkv_g), qkv), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(rstd_g), rstd), kF32Tolerance) << what;

    // Backward from a gradient over the whole joint tensor; weight gradients accumulate.
    const Tensor dqkv = random_bf16_values(qkv.shape(), rng);
    const Tensor dqkv_g = to_gpu(dqkv, DType::BF16);
    Tensor dqkv_in = Tensor::empty(qkv_in.shape());
    Tensor dq = random_f32({c.head_dim}, rng), dk = random_f32({c.head_dim}, rng);
    Tensor dq_g = dq.to(Device::CUDA), dk_g = dk.to(Device::CUDA);
    const Tensor dq_start = dq_g.clone(), dk_start = dk_g.clone();
    Tensor dqkv_in_g = poisoned_gpu(qkv_in.shape(), DType::BF16);
    qk_norm_rope_backward(dqkv_in, dq, dk, dqkv, qkv_in, q_weight, k_weight, rstd, cos, sin, c.offset);
    qk_norm_rope_backward(dqkv_in_g, dq_g, dk_g, dqkv_g, qkv_in_g, q_weight_g, k_weight_g, rstd_g, cos_g, sin_g,
                          c.offset);
    EXPECT_LT(relative_l2(to_cpu_f32(dqkv_in_g), dqkv_in), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(dq_g), dq), kF32Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(dk_g), dk), kF32Tolerance) << what;

    // The weight gradients are the same bits on a second run (no float atomics).
    Tensor dq_again = dq_start.clone(), dk_again = dk_start.clone();
    Tensor dqkv_in_again = poisoned_gpu(qkv_in.shape(), DType::BF16);
    qk_norm_rope_backward(dqkv_in_again, dq_again, dk_again, dqkv_g, qkv_in_g, q_weight_g, k_weight_g, rstd_g, cos_g,
                          sin_g, c.offset);
    EXPECT_EQ(host_values<uint32_t>(dq_again), host_values<uint32_t>(dq_g)) << what;
    EXPECT_EQ(host_values<uint32_t>(dk_again), host_values<uint32_t>(dk_g)) << what;
    EXPECT_EQ(host_values<uint16_t>(dqkv_in_again), host_values<uint16_t>(dqkv_in_g)) << what;
  }
}

struct AttentionCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};

// Each case runs causal and then bidirectional on the same dims: cuDNN graphs are cached per
// problem, and the two must not share one.
TEST(GpuFluxAttentionOps, BidirectionalAttentionMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (AttentionCase c : {AttentionCase{2, 100, 4, 4, 128}, AttentionCase{2, 97, 4, 4, 128},
                          AttentionCase{1, 130, 8, 2, 64}}) {
    const int64_t heads = c.q_heads + 2 * c.kv_heads;
    const Tensor qkv = random_bf16_values({c.batch, c.seq, heads, c.head_dim}, rng);
    const Tensor dout = random_bf16_values({c.batch, c.seq, c.q_heads, c.head_dim}, rng);
    const Tensor qkv_g = to_gpu(qkv, DType::BF16), dout_g = to_gpu(dout, DType::BF16);
    for (bool causal : {true, false}) {
      AttentionShape shape{c.q_heads, c.kv_heads, 0, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), c.head_dim};
      shape.causal = causal;
      const std::string what = fmt::format("B={} T={} Hq={} Hkv={} D={} {}", c.batch, c.seq, c.q_heads, c.kv_heads,
                                           c.head_dim, causal ? "causal" : "bidirectional");
      Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
      attention_forward(out, lse, qkv, shape);
      Tensor out_g = poisoned_gpu(out.shape(), DType::BF16), lse_g = poisoned_gpu(lse.shape(), DType::F32);
      attention_forward(out_g, lse_g, qkv_g, shape);
      EXPECT_LT(relative_l2(to_cpu_f32(out_g), out), kBf16Tolerance) << what;
      EXPECT_LT(relative_l2(to_cpu_f32(lse_g), lse), kF32Tolerance) << what;

      Tensor dqkv = Tensor::empty(qkv.shape());
      attention_backward(dqkv, dout, qkv, out, lse, shape);
      Tensor dqkv_g = poisoned_gpu(qkv.shape(), DType::BF16);
      attention_backward(dqkv_g, dout_g, qkv_g, out_g, lse_g, shape);
      EXPECT_LT(relative_l2(to_cpu_f32(dqkv_g), dqkv), 2 * kBf16Tolerance) << what;
    }
  }
}

// add_bias on both of its paths (F a multiple of 8, vectorized; odd F, one element per
// thread) and bias_gradient over one and several partial rows (256 rows each), written over
// and added to, the same bits on a second run.
TEST(GpuFluxAttentionOps, BiasAddAndGradientMatchCpu) {
  Rng rng(seed_for_current_test());
  for (auto [rows, features] : {std::pair<int64_t, int64_t>{1, 8}, {7, 24}, {33, 3072}, {100, 10}, {600, 64},
                                {1000, 9}, {4608, 3072}}) {
    const std::string what = fmt::format("{} x {}", rows, features);
    const Tensor y = random_bf16_values({rows, features}, rng), bias = random_bf16_values({features}, rng);
    Tensor y_g = to_gpu(y, DType::BF16);
    add_bias(y_g, to_gpu(bias, DType::BF16));
    add_bias(y, bias);
    EXPECT_LT(relative_l2(to_cpu_f32(y_g), y), kBf16Tolerance) << what;

    const Tensor dy = random_bf16_values({rows, features}, rng);
    const Tensor dy_g = to_gpu(dy, DType::BF16);
    Tensor grad = Tensor::empty({features});
    Tensor grad_g = poisoned_gpu({features}, DType::F32);
    bias_gradient(grad, dy, /*overwrite=*/true);
    bias_gradient(grad_g, dy_g, /*overwrite=*/true);
    EXPECT_LT(relative_l2(to_cpu_f32(grad_g), grad), kF32Tolerance) << what << " written over";
    const std::vector<uint32_t> once = host_values<uint32_t>(grad_g);
    bias_gradient(grad, dy, /*overwrite=*/false);
    bias_gradient(grad_g, dy_g, /*overwrite=*/false);
    EXPECT_LT(relative_l2(to_cpu_f32(grad_g), grad), kF32Tolerance) << what << " added";
    bias_gradient(grad_g, dy_g, /*overwrite=*/true);
    EXPECT_EQ(host_values<uint32_t>(grad_g), once) << what << " again";
  }
}

// A linear layer with a bias on the GPU: y = x W^T + b, and the bias's gradient through
// linear_backward, against the CPU.
TEST(GpuFluxAttentionOps, LinearWithBiasMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t tokens = 300, in = 256, out = 192;
  const Tensor x = random_bf16_values({tokens, in}, rng), w = random_bf16_values({out, in}, rng, 0.05);
  const Tensor b = random_bf16_values({out}, rng), dy = random_bf16_values({tokens, out}, rng);
  const Tensor x_g = to_gpu(x, DType::BF16), w_g = to_gpu(w, DType::BF16), b_g = to_gpu(b, DType::BF16);
  const Tensor dy_g = to_gpu(dy, DType::BF16);

  const LinearWeight layer{.weight = w, .bias = b}, layer_g{.weight = w_g, .bias = b_g};
  Tensor y = Tensor::empty({tokens, out}), y_g = poisoned_gpu({tokens, out}, DType::BF16);
  linear_forward(y, x, layer);
  linear_forward(y_g, x_g, layer_g);
  EXPECT_LT(relative_l2(to_cpu_f32(y_g), y), kBf16Tolerance);

  Tensor dx = Tensor::empty({tokens, in}), dw = Tensor::empty({out, in}), db = Tensor::empty({out});
  Tensor dx_g = poisoned_gpu({tokens, in}, DType::BF16), dw_g = poisoned_gpu({out, in}, DType::F32);
  Tensor db_g = poisoned_gpu({out}, DType::F32);
  linear_backward(dx, LinearWeight{.weight = dw, .bias = db}, dy, x, layer, /*overwrite=*/true);
  linear_backward(dx_g, LinearWeight{.weight = dw_g, .bias = db_g}, dy_g, x_g, layer_g, /*overwrite=*/true);
  EXPECT_LT(relative_l2(to_cpu_f32(dx_g), dx), kBf16Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(dw_g), dw), kF32Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(db_g), db), kF32Tolerance);
}

// copy_columns on the GPU moves exactly the bytes the CPU copy moves: a feature block of a
// bf16 and of an fp32 matrix, and a text and an image sequence joined along T and split back.
TEST(GpuFluxAttentionOps, CopyColumnsMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (DType dtype : {DType::BF16, DType::F32}) {
    const Tensor src = random_bf16_values({37, 300}, rng), dst = random_bf16_values({37, 200}, rng);
    Tensor src_typed = Tensor::empty(src.shape(), dtype), dst_typed = Tensor::empty(dst.shape(), dtype);
    cast(src_typed, src);
    cast(dst_typed, dst);
    const Tensor src_g = src_typed.to(Device::CUDA), dst_g = dst_typed.to(Device::CUDA);
    copy_columns(dst_typed, 13, src_typed, 101, 150);
    copy_columns(dst_g, 13, src_g, 101, 150);
    const Tensor back = dst_g.to(Device::CPU);
    EXPECT_EQ(std::memcmp(back.raw(), dst_typed.raw(), back.nbytes()), 0) << dtype_name(dtype);
  }
  const int64_t batch = 2, text = 77, image = 256, features = 64;
  const Tensor txt = to_gpu(random_bf16_values({batch, text, features}, rng), DType::BF16);
  const Tensor img = to_gpu(random_bf16_values({batch, image, features}, rng), DType::BF16);
  const Tensor joint = poisoned_gpu({batch, text + image, features}, DType::BF16);
  const Tensor rows = joint.view({batch, (text + image) * features});
  copy_columns(rows, 0, txt.view({batch, text * features}), 0, text * features);
  copy_columns(rows, text * features, img.view({batch, image * features}), 0, image * features);
  const Tensor txt_back = poisoned_gpu(txt.shape(), DType::BF16), img_back = poisoned_gpu(img.shape(), DType::BF16);
  copy_columns(txt_back.view({batch, text * features}), 0, rows, 0, text * features);
  copy_columns(img_back.view({batch, image * features}), 0, rows, text * features, image * features);
  EXPECT_EQ(host_values<uint16_t>(txt_back), host_values<uint16_t>(txt));
  EXPECT_EQ(host_values<uint16_t>(img_back), host_values<uint16_t>(img));
}

}  // namespace
}  // namespace forge::gpu_test
