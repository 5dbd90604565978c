// Incremental decoding over a KV cache (NOTE [Incremental decoding]) against the full
// forward: a prompt prefilled at once, in chunks, or token by token, then one token per
// step, gives at every position the logits DecoderLM::forward_logits gives for the whole
// sequence, with GQA, MHA, a sliding window shorter than the sequence, tied embeddings and
// Llama 3.1 RoPE scaling. Plus the decode-attention op against the full attention op and
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
  return {{"gqa", gqa}, {"mha_tied", mha}, {"sliding_window", window}, {"llama3_rope", scaled}, {"moe", moe}};
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

TEST(ModelIncremental, LastRowsOnlyAndReset) {
  const Case c = cases()[0];
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
