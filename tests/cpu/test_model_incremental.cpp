// Incremental decoding over a KV cache (NOTE [Incremental decoding]) against the full
// forward: a prompt prefilled at once, in chunks, or token by token, then one token per
// step, gives at every position the logits DecoderLM::forward_logits gives for the whole
// sequence, with GQA, MHA, a sliding window shorter than the sequence, tied embeddings,
// Llama 3.1 RoPE scaling, Mixture-of-Experts feed-forwards (dropless, and a token-dropping
// model decoded dropless) and DeepSeek's Multi-head Latent Attention with dense first
// blocks, shared experts, a compressed query and YaRN. Plus the decode-attention op against the full attention op and
// its refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/incremental_decoder.h"
#include "model_testing.h"
#include "ops/decode_attention.h"

namespace forge {
namespace {

using testing::random_tokens;
using testing::tiny;

struct Case {
  const char* name;
  ModelConfig config;
};

std::vector<Case> cases() {
  ModelConfig gqa = tiny(false, 3);
  ModelConfig mha = tiny(true, 2);
  mha.num_kv_heads = mha.num_heads;
  ModelConfig window = tiny(false, 2);
  window.sliding_window = 5;
  window.num_kv_heads = 1;
  ModelConfig scaled = tiny(false, 2);
  scaled.head_dim = 8;
  scaled.rope_theta = 500000.0;
  scaled.rope_scaling.enabled = true;
  scaled.rope_scaling.original_max_position = 8;
  ModelConfig moe = tiny(false, 2);  // NOTE [MoE feed-forward]: works on each position alone
  moe.num_experts = 4;
  moe.num_experts_per_tok = 2;
  // DeepSeek-V2-shaped (NOTE [Multi-head Latent Attention]): MLA with values of their own
  // head dim, a dense first block, shared experts, unnormalized scaled weights.
  ModelConfig mla = tiny(false, 3);
  mla.num_kv_heads = mla.num_heads;
  mla.kv_lora_rank = 16;
  mla.qk_nope_head_dim = 8;
  mla.qk_rope_head_dim = 8;
  mla.v_head_dim = 6;
  mla.num_experts = 8;
  mla.num_experts_per_tok = 2;
  mla.moe_ffn_hidden_size = 16;
  mla.num_shared_experts = 1;
  mla.first_dense_layers = 1;
  mla.router_normalize_topk = false;
  mla.router_scaling_factor = 1.5;
  // DeepSeek-V3-shaped: a compressed query, YaRN, sigmoid group-limited routing.
  ModelConfig v3 = mla;
  v3.q_lora_rank = 12;
  v3.rope_scaling.enabled = true;
  v3.rope_scaling.type = "yarn";
  v3.rope_scaling.factor = 4.0;
  v3.rope_scaling.original_max_position = 8;
  v3.rope_scaling.mscale = 1.0;
  v3.rope_scaling.mscale_all_dim = 0.8;
  v3.router_score_function = "sigmoid";
  v3.router_num_groups = 4;
  v3.router_topk_groups = 2;
  v3.router_normalize_topk = true;
  // Values of the queries' head dim: the attention's uniform form (NOTE [Value head dim]).
  ModelConfig mla_uniform = mla;
  mla_uniform.v_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
  return {{"deepseek_uniform_head_dims", mla_uniform}, {"gqa", gqa},       {"mha_tied", mha}, {"sliding_window", window}, {"llama3_rope", scaled},
          {"moe", moe},       {"deepseek_v2_mla", mla}, {"deepseek_v3_mla", v3}};
}

// Logits of every position of one sequence by the full forward, [T, V].
Tensor full_logits(const ModelConfig& config, FlatParameters& params, const Tensor& tokens) {
  const int64_t t = tokens.dim(1);
  DecoderLM model(config, 1, t);
  Tensor logits = Tensor::empty({t, config.vocab_size});
  model.forward_logits(tokens, params, logits);
  return logits;
}

void expect_rows_near(const Tensor& got, const Tensor& full, int64_t first_row, const std::string& what) {
  const int64_t v = got.dim(1);
  for (int64_t r = 0; r < got.dim(0); ++r)
    for (int64_t k = 0; k < v; ++k) {
      const float expected = full.data<float>()[(first_row + r) * v + k];
      const float actual = got.data<float>()[r * v + k];
      ASSERT_NEAR(actual, expected, 2e-5f * (1.0f + std::fabs(expected)))
          << what << ": position " << first_row + r << ", logit " << k;
    }
}

// Feeds tokens in steps of the given sizes and checks each step's logits.
void check_steps(const Case& c, const std::vector<int64_t>& steps) {
  int64_t total = 0;
  for (int64_t s : steps) total += s;
  FlatParameters params(c.config);
  params.initialize(7);
  const Tensor tokens = random_tokens(1, total, c.config.vocab_size, 11);
  const Tensor full = full_logits(c.config, params, tokens);
  IncrementalDecoder decoder(c.config, total + 3);
  int64_t at = 0;
  for (int64_t s : steps) {
    Tensor logits = Tensor::empty({s, c.config.vocab_size});
    decoder.forward(tokens.view({total}).narrow(at, at + s), params, logits);
    expect_rows_near(logits, full, at, c.name);
    at += s;
    EXPECT_EQ(decoder.position(), at);
  }
}

TEST(ModelIncremental, PrefillThenOneTokenPerStepMatchesTheFullForward) {
  for (const Case& c : cases()) check_steps(c, {7, 1, 1, 1, 1, 1, 1, 1, 1, 1});
}

TEST(ModelIncremental, ChunkedPrefillMatchesTheFullForward) {
  for (const Case& c : cases()) check_steps(c, {3, 4, 2, 1, 5, 1});
}

TEST(ModelIncremental, TokenByTokenFromTheStartMatchesTheFullForward) {
  for (const Case& c : cases()) check_steps(c, std::vector<int64_t>(12, 1));
}

// A model trained with token dropping decodes dropless (NOTE [Incremental decoding]): its
// steps give the full forward of the same weights without a capacity.
TEST(ModelIncremental, TokenDroppingModelsDecodeDropless) {
  ModelConfig dropping = tiny(false, 2);
  dropping.num_experts = 4;
  dropping.num_experts_per_tok = 2;
  dropping.moe_capacity_factor = 0.5;
  dropping.moe_pad_to_capacity = true;
  ModelConfig dropless = dropping;
  dropless.moe_capacity_factor = 0.0;
  dropless.moe_pad_to_capacity = false;
  FlatParameters params(dropping);
  params.initialize(5);
  const Tensor tokens = random_tokens(1, 10, dropping.vocab_size, 9);
  const Tensor full = full_logits(dropless, params, tokens);
  IncrementalDecoder decoder(dropping, 10);
  Tensor prompt = Tensor::empty({6, dropping.vocab_size});
  decoder.forward(tokens.view({10}).narrow(0, 6), params, prompt);
  expect_rows_near(prompt, full, 0, "dropless prefill");
  for (int64_t at = 6; at < 10; ++at) {
    Tensor one = Tensor::empty({1, dropping.vocab_size});
    decoder.forward(tokens.view({10}).narrow(at, at + 1), params, one);
    expect_rows_near(one, full, at, "dropless step");
  }
}

TEST(ModelIncremental, LastRowsOnlyAndReset) {
  const Case c = cases()[1];
  ASSERT_STREQ(c.name, "gqa");
  FlatParameters params(c.config);
  params.initialize(3);
  const Tensor tokens = random_tokens(1, 9, c.config.vocab_size, 5);
  const Tensor full = full_logits(c.config, params, tokens);
  IncrementalDecoder decoder(c.config, 9);
  for (int round = 0; round < 2; ++round) {
    decoder.reset();
    Tensor none = Tensor::empty({0, c.config.vocab_size});
    decoder.forward(tokens.view({9}).narrow(0, 4), params, none);
    Tensor last = Tensor::empty({2, c.config.vocab_size});
    decoder.forward(tokens.view({9}).narrow(4, 9), params, last);
    expect_rows_near(last, full, 7, "last rows");
  }
  Tensor one = Tensor::empty({1, c.config.vocab_size});
  expect_error([&] { decoder.forward(tokens.view({9}).narrow(0, 1), params, one); }, {"exceed the KV cache's 9 positions"});
  decoder.reset();
  Tensor three = Tensor::empty({3, c.config.vocab_size});
  expect_error([&] { decoder.forward(tokens.view({9}).narrow(0, 2), params, three); }, {"must be [rows <= 2"});
}

// The op alone: a cache filled step by step and attended at each step equals the full
// causal attention of the packed sequence, rows for rows.
TEST(ModelIncremental, DecodeAttentionOpMatchesFullAttention) {
  const int64_t b = 2, t = 11, hq = 6, hkv = 2, d = 8;
  for (int64_t window : {0, 4}) {
    const AttentionShape shape{hq, hkv, window, 1.0f / std::sqrt(static_cast<float>(d))};
    Tensor qkv = Tensor::empty({b, t, hq + 2 * hkv, d});
    Rng rng(17);
    for (int64_t i = 0; i < qkv.numel(); ++i) qkv.data<float>()[i] = static_cast<float>(rng.normal());
    Tensor out = Tensor::empty({b, t, hq, d}), lse = Tensor::empty({b, hq, t});
    attention_forward(out, lse, qkv, shape);
    Tensor k_cache = Tensor::empty({b, t, hkv, d}), v_cache = Tensor::empty({b, t, hkv, d});
    // Steps of 3, 1, 5, 2 positions: copy the step's rows of every batch element.
    int64_t at = 0;
    for (int64_t n : {3, 1, 5, 2}) {
      Tensor step = Tensor::empty({b, n, hq + 2 * hkv, d}), step_out = Tensor::empty({b, n, hq, d});
      const int64_t row = (hq + 2 * hkv) * d;
      for (int64_t e = 0; e < b; ++e)
        std::copy_n(qkv.data<float>() + (e * t + at) * row, n * row, step.data<float>() + e * n * row);
      kv_cache_append(k_cache, v_cache, step, at, shape);
      decode_attention_forward(step_out, step, k_cache, v_cache, at, shape);
      for (int64_t e = 0; e < b; ++e)
        for (int64_t k = 0; k < n * hq * d; ++k)
          ASSERT_NEAR(step_out.data<float>()[e * n * hq * d + k], out.data<float>()[(e * t + at) * hq * d + k], 1e-6f)
              << "window " << window << ", batch " << e << ", step at " << at;
      at += n;
    }
    Tensor step = Tensor::empty({b, 1, hq + 2 * hkv, d}), step_out = Tensor::empty({b, 1, hq, d});
    expect_error([&] { decode_attention_forward(step_out, step, k_cache, v_cache, t, shape); }, {"do not fit a cache of 11"});
  }
}

}  // namespace
}  // namespace forge
