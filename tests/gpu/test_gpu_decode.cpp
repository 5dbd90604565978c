// Incremental decoding on the GPU against the CPU reference: the decode-attention kernel
// and the KV-cache append on fresh random bf16 data (one-token steps and multi-token
// prefills, MHA and GQA, sliding windows, long caches, head dims 64 to 256; and values of a
// head dim of their own, NOTE [Value head dim], D = 192 with Dv = 128 as DeepSeek's latent
// attention decodes, among others), and the whole IncrementalDecoder of small models (bf16:
// Llama-shaped, Mixtral-shaped, DeepSeek-shaped with Multi-head Latent Attention) against
// the CPU one (fp32) from the same weights, step by step, and against the GPU's own full
// forward.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/incremental_decoder.h"
#include "ops/decode_attention.h"

namespace forge::gpu_test {
namespace {

struct DecodeCase {
  int64_t batch, capacity, q_heads, kv_heads, head_dim, window, position, queries;
};

TEST(GpuDecode, DecodeAttentionMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (DecodeCase c : {DecodeCase{1, 1, 2, 1, 64, 0, 0, 1}, DecodeCase{2, 40, 4, 4, 64, 0, 17, 1},
                       DecodeCase{1, 300, 8, 2, 128, 0, 250, 5}, DecodeCase{2, 200, 8, 2, 128, 16, 150, 1},
                       DecodeCase{1, 4096, 32, 8, 128, 0, 4000, 1}, DecodeCase{1, 129, 4, 1, 256, 7, 0, 129},
                       DecodeCase{3, 70, 6, 3, 96, 0, 33, 3}, DecodeCase{1, 64, 2, 2, 36, 5, 60, 4}}) {
    const int64_t heads = c.q_heads + 2 * c.kv_heads;
    const AttentionShape shape{c.q_heads, c.kv_heads, c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
    // Earlier positions already cached (random), then the step's keys and values appended.
    Tensor k_cache = random_bf16_values({c.batch, c.capacity, c.kv_heads, c.head_dim}, rng);
    Tensor v_cache = random_bf16_values(k_cache.shape(), rng);
    Tensor qkv = random_bf16_values({c.batch, c.queries, heads, c.head_dim}, rng);
    Tensor k_gpu = to_gpu(k_cache, DType::BF16), v_gpu = to_gpu(v_cache, DType::BF16);
    Tensor qkv_gpu = to_gpu(qkv, DType::BF16);
    kv_cache_append(k_cache, v_cache, qkv, c.position, shape);
    kv_cache_append(k_gpu, v_gpu, qkv_gpu, c.position, shape);
    const std::string what = fmt::format("b{} cap{} hq{} hkv{} d{} w{} pos{} n{}", c.batch, c.capacity, c.q_heads,
                                         c.kv_heads, c.head_dim, c.window, c.position, c.queries);
    EXPECT_EQ(relative_l2(to_cpu_f32(k_gpu), k_cache), 0.0) << what;
    EXPECT_EQ(relative_l2(to_cpu_f32(v_gpu), v_cache), 0.0) << what;

    Tensor out = Tensor::empty({c.batch, c.queries, c.q_heads, c.head_dim});
    decode_attention_forward(out, qkv, k_cache, v_cache, c.position, shape);
    Tensor out_gpu = poisoned_gpu(out.shape(), DType::BF16);
    decode_attention_forward(out_gpu, qkv_gpu, k_gpu, v_gpu, c.position, shape);
    EXPECT_LT(relative_l2(to_cpu_f32(out_gpu), out), kBf16Tolerance) << what;
  }
}

struct ValueDimDecodeCase {
  int64_t batch, capacity, q_heads, kv_heads, head_dim, v_head_dim, window, position, queries;
};

TEST(GpuDecode, DecodeAttentionWithValueHeadDimMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (ValueDimDecodeCase c : {ValueDimDecodeCase{1, 1, 2, 1, 192, 128, 0, 0, 1},
                               ValueDimDecodeCase{2, 40, 4, 4, 192, 128, 0, 17, 1},
                               ValueDimDecodeCase{1, 300, 16, 16, 192, 128, 0, 250, 5},
                               ValueDimDecodeCase{2, 200, 8, 2, 192, 128, 16, 150, 1},
                               ValueDimDecodeCase{1, 2048, 16, 16, 192, 128, 0, 2000, 1},
                               ValueDimDecodeCase{1, 129, 4, 1, 256, 64, 7, 0, 129},
                               ValueDimDecodeCase{3, 70, 6, 3, 24, 16, 0, 33, 3},
                               ValueDimDecodeCase{1, 64, 2, 2, 64, 256, 5, 60, 4},
                               ValueDimDecodeCase{2, 50, 4, 2, 40, 72, 0, 45, 2}}) {
    const AttentionShape shape{.num_q_heads = c.q_heads,
                               .num_kv_heads = c.kv_heads,
                               .sliding_window = c.window,
                               .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                               .head_dim = c.head_dim,
                               .v_head_dim = c.v_head_dim};
    // Earlier positions already cached (random), then the step's keys and values appended.
    Tensor k_cache = random_bf16_values({c.batch, c.capacity, c.kv_heads, c.head_dim}, rng);
    Tensor v_cache = random_bf16_values({c.batch, c.capacity, c.kv_heads, c.v_head_dim}, rng);
    Tensor qkv = random_bf16_values(shape.qkv_shape(c.batch, c.queries), rng);
    Tensor k_gpu = to_gpu(k_cache, DType::BF16), v_gpu = to_gpu(v_cache, DType::BF16);
    Tensor qkv_gpu = to_gpu(qkv, DType::BF16);
    kv_cache_append(k_cache, v_cache, qkv, c.position, shape);
    kv_cache_append(k_gpu, v_gpu, qkv_gpu, c.position, shape);
    const std::string what =
        fmt::format("b{} cap{} hq{} hkv{} d{} dv{} w{} pos{} n{}", c.batch, c.capacity, c.q_heads, c.kv_heads,
                    c.head_dim, c.v_head_dim, c.window, c.position, c.queries);
    EXPECT_EQ(relative_l2(to_cpu_f32(k_gpu), k_cache), 0.0) << what;
    EXPECT_EQ(relative_l2(to_cpu_f32(v_gpu), v_cache), 0.0) << what;

    Tensor out = Tensor::empty(shape.out_shape(c.batch, c.queries));
    decode_attention_forward(out, qkv, k_cache, v_cache, c.position, shape);
    Tensor out_gpu = poisoned_gpu(out.shape(), DType::BF16);
    decode_attention_forward(out_gpu, qkv_gpu, k_gpu, v_gpu, c.position, shape);
    EXPECT_LT(relative_l2(to_cpu_f32(out_gpu), out), kBf16Tolerance) << what;
  }
}

TEST(GpuDecode, HeadDimAbove256IsAClearError) {
  Tensor qkv = poisoned_gpu({1, 1, 3, 320}, DType::BF16), cache = poisoned_gpu({1, 4, 1, 320}, DType::BF16);
  Tensor out = poisoned_gpu({1, 1, 1, 320}, DType::BF16);
  EXPECT_THROW(decode_attention_forward(out, qkv, cache, cache, 0, AttentionShape{1, 1, 0, 0.05f}), Error);
  // A value head dim above 256, with keys that fit.
  const AttentionShape wide_values{
      .num_q_heads = 1, .num_kv_heads = 1, .scale = 0.05f, .head_dim = 64, .v_head_dim = 320};
  Tensor wide_qkv = poisoned_gpu(wide_values.qkv_shape(1, 1), DType::BF16);
  Tensor k_cache = poisoned_gpu({1, 4, 1, 64}, DType::BF16), v_cache = poisoned_gpu({1, 4, 1, 320}, DType::BF16);
  Tensor wide_out = poisoned_gpu(wide_values.out_shape(1, 1), DType::BF16);
  try {
    decode_attention_forward(wide_out, wide_qkv, k_cache, v_cache, 0, wide_values);
    ADD_FAILURE() << "a value head dim of 320 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("v_head_dim 320 must each be at most 256"), std::string::npos) << e.what();
  }
}

ModelConfig small_model(int64_t window) {
  ModelConfig c;
  c.name = "gpu-decode-test";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 256;
  c.sliding_window = window;
  c.rope_theta = 500000;
  c.rope_scaling = RopeScaling{true, 8.0, 1.0, 4.0, 64};
  c.init_std = 0.05;
  return c;
}

// The decoder of `c` on the GPU, prefill then one token per step, against the CPU decoder
// and the GPU's full forward, from the same bf16-representable weights.
void expect_decoder_matches(const ModelConfig& c, uint64_t seed, double tolerance = 2 * kBf16Tolerance) {
  Rng rng(seed);
  FlatParameters cpu_params(c);
  cpu_params.initialize(23);
  if (c.moe()) separate_router_choices(cpu_params, rng);  // NOTE [Routers without near ties]
  round_to_bf16(cpu_params.flat());  // weights exactly representable in bf16
  FlatParameters gpu_params(c, Device::CUDA, DType::BF16);
  gpu_params.assign_from(cpu_params);

  const int64_t prompt = 9, steps = 6, total = prompt + steps;
  const Tensor tokens = random_ids(total, c.vocab_size, rng);
  const Tensor tokens_gpu = tokens.to(Device::CUDA);
  IncrementalDecoder cpu(c, total), gpu(c, total, Device::CUDA, DType::BF16);
  DecoderLM full(c, 1, total, Device::CUDA, DType::BF16);
  Tensor full_logits = Tensor::empty({total, c.vocab_size}, DType::BF16, Device::CUDA);
  full.forward_logits(tokens_gpu.view({1, total}), gpu_params, full_logits);
  const Tensor full_cpu = to_cpu_f32(full_logits);

  int64_t at = 0;
  for (int64_t n : {prompt, int64_t{1}, int64_t{1}, int64_t{1}, int64_t{1}, int64_t{1}, int64_t{1}}) {
    Tensor logits = Tensor::empty({n, c.vocab_size});
    cpu.forward(tokens.narrow(at, at + n), cpu_params, logits);
    Tensor logits_gpu = poisoned_gpu({n, c.vocab_size}, DType::BF16);
    gpu.forward(tokens_gpu.narrow(at, at + n), gpu_params, logits_gpu);
    const Tensor got = to_cpu_f32(logits_gpu);
    const std::string what = fmt::format("{}, positions {} .. {}", c.name, at, at + n - 1);
    EXPECT_LT(relative_l2(got, logits), tolerance) << what;
    const Tensor full_rows = full_cpu.narrow(at, at + n);
    EXPECT_LT(relative_l2(got, full_rows), tolerance) << what << " (GPU full forward)";
    at += n;
  }
}

TEST(GpuDecode, IncrementalDecoderMatchesCpuAndTheFullForward) {
  for (int64_t window : {int64_t{0}, int64_t{6}})
    expect_decoder_matches(small_model(window), seed_for_current_test() + window);
}

// Mixtral-shaped: the MoE feed-forward's CUDA routing and expert GEMMs on a step's tokens.
TEST(GpuDecode, MixtureOfExpertsDecoderMatchesCpu) {
  ModelConfig c = small_model(0);
  c.name = "gpu-decode-moe";
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_ffn_hidden_size = 128;
  expect_decoder_matches(c, seed_for_current_test());
}

// DeepSeek-shaped: Multi-head Latent Attention over the cache (values of their own head
// dim, YaRN), a dense first block, shared experts; V2's softmax and V3's sigmoid routing.
TEST(GpuDecode, LatentAttentionDecoderMatchesCpu) {
  for (bool v3 : {false, true}) {
    ModelConfig c = small_deepseek(v3);  // gpu_testing.h, with small_model's sizes
    c.name = v3 ? "gpu-decode-deepseek-v3" : "gpu-decode-deepseek-v2";
    c.ffn_hidden_size = 512;
    c.max_seq_len = 256;
    c.rope_theta = 500000;
    c.router_aux_loss_coef = 0.0;
    // Three bf16 norms and four GEMMs per attention (the compressed query and kv), shared
    // experts and scaled routing: one decode step's logits measured up to 0.0235 from the CPU's
    // and from the GPU's own full forward on the H200, where the Llama-shaped model stays within 0.02.
    expect_decoder_matches(c, seed_for_current_test() + v3, 3 * kBf16Tolerance);
  }
}

}  // namespace
}  // namespace forge::gpu_test
