// Packed examples on the GPU (NOTE [Packed examples] in ops/attention.h) against the CPU
// reference: cuDNN attention in its ragged (THD) layout with per-example lengths, forward
// and backward, also with values of their own head dim; RoPE at explicit positions; and a
// whole packed training step, which must also equal the examples run one per row on the GPU.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/rope.h"

namespace forge::gpu_test {
namespace {

// Rows cut into examples of random lengths (1 to max_length tokens), the last run of
// each row marked as padding (-1) as the loader does.
Tensor random_segments(int64_t batch, int64_t seq, int64_t max_length, Rng& rng) {
  Tensor ids = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t id = 0;
    int64_t left = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_length)));
    for (int64_t t = 0; t < seq; ++t) {
      if (left-- == 0) {
        ++id;
        left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_length)));
      }
      ids.data<int32_t>()[b * seq + t] = id;
    }
    for (int64_t t = seq - 1; t > 0 && ids.data<int32_t>()[b * seq + t] == id && id > 0; --t)
      ids.data<int32_t>()[b * seq + t] = -1;
  }
  return ids;
}

// The GPU keeps packed statistics token-major, [B * T, Hq]; the CPU [B, Hq, T].
Tensor token_major(const Tensor& lse) {
  const int64_t b = lse.dim(0), h = lse.dim(1), t = lse.dim(2);
  Tensor out = Tensor::empty({b, h, t});
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t k = 0; k < t; ++k)
        out.data<float>()[(i * t + k) * h + j] = lse.data<float>()[(i * h + j) * t + k];
  return out;
}

struct Case {
  int64_t batch, seq, q_heads, kv_heads, head_dim, window, max_length;
  bool causal = true;  // false: NOTE [Bidirectional attention], within each example
};

TEST(GpuPacking, AttentionWithSegmentsMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (Case c : {Case{1, 64, 2, 1, 64, 0, 20}, Case{2, 100, 4, 4, 64, 0, 40}, Case{2, 129, 8, 2, 128, 16, 50},
                 Case{1, 512, 32, 8, 128, 0, 200}, Case{3, 96, 4, 2, 128, 0, 3}, Case{1, 256, 4, 1, 64, 0, 256},
                 Case{2, 100, 4, 4, 128, 0, 40, false}, Case{2, 129, 8, 2, 64, 0, 50, false}}) {
    const int64_t heads = c.q_heads + 2 * c.kv_heads;
    AttentionShape shape{c.q_heads, c.kv_heads, c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                         c.head_dim};
    shape.causal = c.causal;
    const std::string what = fmt::format("b{} t{} hq{} hkv{} d{} w{} examples up to {}{}", c.batch, c.seq, c.q_heads,
                                         c.kv_heads, c.head_dim, c.window, c.max_length,
                                         c.causal ? "" : " bidirectional");
    Tensor ids = random_segments(c.batch, c.seq, c.max_length, rng);
    AttentionSegments cpu_segments = attention_segments(ids, shape, Device::CPU);
    AttentionSegments gpu_segments = attention_segments(ids, shape, Device::CUDA);
    Tensor qkv = random_bf16_values({c.batch, c.seq, heads, c.head_dim}, rng);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    attention_forward(out, lse, qkv, shape, &cpu_segments);

    Tensor qkvg = to_gpu(qkv, DType::BF16);
    Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
    attention_forward(outg, lseg, qkvg, shape, &gpu_segments);
    EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(lseg), token_major(lse)), kF32Tolerance) << what;

    Tensor dout = random_bf16_values(out.shape(), rng);
    Tensor dqkv = Tensor::empty(qkv.shape());
    attention_backward(dqkv, dout, qkv, out, lse, shape, &cpu_segments);
    Tensor dqkvg = poisoned_gpu(qkv.shape(), DType::BF16);
    attention_backward(dqkvg, to_gpu(dout, DType::BF16), qkvg, outg, lseg, shape, &gpu_segments);
    EXPECT_LT(relative_l2(to_cpu_f32(dqkvg), dqkv), 2 * kBf16Tolerance) << what;
  }
}

// Values of their own head dim (NOTE [Value head dim] in ops/attention.h) at MLA's dims:
// the ragged offsets of Q/K/V count rows of (Hq + Hkv) D + Hkv Dv elements, those of O Hq Dv.
TEST(GpuPacking, AttentionWithValueHeadDimAndSegmentsMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t batch = 2, seq = 256, heads = 4, d = 192, dv = 128;
  const AttentionShape shape{heads, heads, 0, 1.0f / std::sqrt(static_cast<float>(d)), d, dv};
  Tensor ids = random_segments(batch, seq, 100, rng);
  AttentionSegments cpu_segments = attention_segments(ids, shape, Device::CPU);
  AttentionSegments gpu_segments = attention_segments(ids, shape, Device::CUDA);
  Tensor qkv = random_bf16_values(shape.qkv_shape(batch, seq), rng);
  Tensor out = Tensor::empty(shape.out_shape(batch, seq)), lse = Tensor::empty({batch, heads, seq});
  attention_forward(out, lse, qkv, shape, &cpu_segments);

  Tensor qkvg = to_gpu(qkv, DType::BF16);
  Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
  attention_forward(outg, lseg, qkvg, shape, &gpu_segments);
  EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(lseg), token_major(lse)), kF32Tolerance);

  Tensor dout = random_bf16_values(out.shape(), rng);
  Tensor dqkv = Tensor::empty(qkv.shape());
  attention_backward(dqkv, dout, qkv, out, lse, shape, &cpu_segments);
  Tensor dqkvg = poisoned_gpu(qkv.shape(), DType::BF16);
  attention_backward(dqkvg, to_gpu(dout, DType::BF16), qkvg, outg, lseg, shape, &gpu_segments);
  EXPECT_LT(relative_l2(to_cpu_f32(dqkvg), dqkv), 2 * kBf16Tolerance);
}

TEST(GpuPacking, RopeAtPositionsMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t b = 2, t = 77, hq = 8, hkv = 2, d = 128;
  Tensor cos, sin;
  rope_tables(cos, sin, rope_inv_freq(d, 500000.0, RopeScaling{}), t);
  Tensor positions = Tensor::empty({b, t}, DType::I32);
  for (int64_t i = 0; i < b * t; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(rng.below(t));
  Tensor ref = random_bf16_values({b, t, hq + 2 * hkv, d}, rng);
  Tensor xg = to_gpu(ref, DType::BF16), cg = cos.to(Device::CUDA), sg = sin.to(Device::CUDA);
  Tensor pg = positions.to(Device::CUDA);
  rope_forward(ref, hq + hkv, cos, sin, &positions);
  rope_forward(xg, hq + hkv, cg, sg, &pg);
  EXPECT_LT(relative_l2(to_cpu_f32(xg), ref), kBf16Tolerance);
  rope_backward(ref, hq + hkv, cos, sin, &positions);
  rope_backward(xg, hq + hkv, cg, sg, &pg);
  EXPECT_LT(relative_l2(to_cpu_f32(xg), ref), kBf16Tolerance);
}

ModelConfig small_model() {
  ModelConfig c;
  c.name = "gpu-packing";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 256;
  c.init_std = 0.05;
  return c;
}

// A packed step on the GPU against the CPU, and against the same examples one per row
// (the padded layout, plain causal attention) on the GPU.
TEST(GpuPacking, PackedTrainingStepMatchesCpuAndEachExampleAlone) {
  const ModelConfig c = small_model();
  const int64_t batch = 2, seq = 96;
  Rng rng(seed_for_current_test());
  FlatParameters cpu_params(c), cpu_grads(c);
  cpu_params.initialize(17);
  round_to_bf16(cpu_params.flat());
  FlatParameters gpu_compute(c, Device::CUDA, DType::BF16), gpu_grads(c, Device::CUDA, DType::F32),
      alone_grads(c, Device::CUDA, DType::F32);
  gpu_compute.assign_from(cpu_params);

  // Packed rows: examples with restarting positions, targets ignored across boundaries.
  Tensor ids = random_segments(batch, seq, 40, rng);
  Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  Tensor targets = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  Tensor positions = Tensor::empty({batch, seq}, DType::I32);
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < batch * seq; ++i) {
    const bool starts = i % seq == 0 || id[i] != id[i - 1];
    positions.data<int32_t>()[i] = starts ? 0 : positions.data<int32_t>()[i - 1] + 1;
    const bool last = i % seq == seq - 1 || id[i + 1] != id[i];
    if (last || id[i] < 0) targets.data<int32_t>()[i] = kIgnoreIndex;
  }
  const SequenceLayout layout{positions, ids};

  DecoderLM cpu_model(c, batch, seq);
  cpu_grads.zero();
  const LossSum cpu_loss = cpu_model.forward_backward(tokens, targets, cpu_params, cpu_grads, 1e-2f, &layout);
  DecoderLM gpu_model(c, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);
  gpu_grads.zero();
  const LossSum gpu_loss = gpu_model.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), gpu_compute,
                                                      gpu_grads, 1e-2f, &layout);
  EXPECT_EQ(gpu_loss.tokens, cpu_loss.tokens);
  EXPECT_NEAR(gpu_loss.mean(), cpu_loss.mean(), 1e-2 * cpu_loss.mean());
  for (size_t i = 0; i < cpu_grads.specs().size(); ++i)
    EXPECT_LT(relative_l2(to_cpu_f32(gpu_grads.tensors()[i]), cpu_grads.tensors()[i]), 5e-2)
        << cpu_grads.specs()[i].name;

  // The same examples, each alone at the start of a row of its own (padding after).
  std::vector<std::pair<int64_t, int64_t>> examples;  // first token, length
  for (int64_t i = 0; i < batch * seq; ++i)
    if ((i % seq == 0 || id[i] != id[i - 1]) && id[i] >= 0) {
      int64_t n = 1;
      while ((i + n) % seq != 0 && id[i + n] == id[i]) ++n;
      examples.emplace_back(i, n);
    }
  const int64_t rows = static_cast<int64_t>(examples.size());
  Tensor alone_tokens = Tensor::zeros({rows, seq}, DType::I32), alone_targets = Tensor::empty({rows, seq}, DType::I32);
  std::fill_n(alone_targets.data<int32_t>(), rows * seq, kIgnoreIndex);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(tokens.data<int32_t>() + examples[r].first, examples[r].second, alone_tokens.data<int32_t>() + r * seq);
    std::copy_n(targets.data<int32_t>() + examples[r].first, examples[r].second,
                alone_targets.data<int32_t>() + r * seq);
  }
  DecoderLM alone(c, rows, seq, Device::CUDA, DType::BF16);
  alone_grads.zero();
  const LossSum alone_loss = alone.forward_backward(alone_tokens.to(Device::CUDA), alone_targets.to(Device::CUDA),
                                                    gpu_compute, alone_grads, 1e-2f);
  EXPECT_EQ(alone_loss.tokens, gpu_loss.tokens);
  EXPECT_NEAR(alone_loss.mean(), gpu_loss.mean(), 1e-2 * gpu_loss.mean());
  for (size_t i = 0; i < cpu_grads.specs().size(); ++i)
    EXPECT_LT(relative_l2(to_cpu_f32(alone_grads.tensors()[i]), to_cpu_f32(gpu_grads.tensors()[i])), 5e-2)
        << cpu_grads.specs()[i].name;
}

}  // namespace
}  // namespace forge::gpu_test
