// Decode attention with values of a head dim of their own (NOTE [Value head dim] in
// ops/attention.h; the 3-D qkv form of ops/decode_attention.h, in which DeepSeek's latent
// attention decodes): a KV cache filled by a prefill of several positions and then one
// position per step, attended at each step, gives at every position what attention_forward
// gives over the whole sequence; and shapes that do not fit the form are refused, naming the
// op and the shape expected. The uniform form's counterpart is
// ModelIncremental.DecodeAttentionOpMatchesFullAttention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.h"
#include "ops/decode_attention.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;

struct ValueDimDecodeCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, v_head_dim, window;
  std::vector<int64_t> steps;  // positions per step, summing to seq
};

std::string describe(const ValueDimDecodeCase& c) {
  return "b" + std::to_string(c.batch) + " t" + std::to_string(c.seq) + " hq" + std::to_string(c.q_heads) + " hkv" +
         std::to_string(c.kv_heads) + " d" + std::to_string(c.head_dim) + " dv" + std::to_string(c.v_head_dim) + " w" +
         std::to_string(c.window);
}

void fill_nan(const Tensor& t) { std::fill_n(t.data<float>(), t.numel(), std::numeric_limits<float>::quiet_NaN()); }

TEST(OpsDecodeAttention, ValueHeadDimMatchesFullAttentionAtEveryPosition) {
  const std::vector<ValueDimDecodeCase> cases = {
      {2, 11, 3, 3, 24, 16, 0, {5, 1, 1, 1, 1, 1, 1}},     // MHA
      {2, 11, 4, 2, 24, 16, 4, {4, 1, 1, 1, 1, 1, 1, 1}},  // GQA, a window no longer than the prefill
      {1, 10, 2, 1, 16, 24, 0, {3, 1, 1, 2, 1, 1, 1}},     // values wider than keys
      {1, 9, 4, 1, 192, 128, 0, {6, 1, 1, 1}},             // DeepSeek's dims, GQA
      {2, 9, 2, 2, 192, 128, 3, {5, 1, 1, 1, 1}},          // DeepSeek's dims, MHA, a window
  };
  Rng rng(29);
  for (const ValueDimDecodeCase& c : cases) {
    const AttentionShape shape{.num_q_heads = c.q_heads,
                               .num_kv_heads = c.kv_heads,
                               .sliding_window = c.window,
                               .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                               .head_dim = c.head_dim,
                               .v_head_dim = c.v_head_dim};
    ASSERT_TRUE(shape.distinct_v_head_dim());
    const Tensor qkv = random_tensor(shape.qkv_shape(c.batch, c.seq), rng);
    Tensor out = Tensor::empty(shape.out_shape(c.batch, c.seq)), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    attention_forward(out, lse, qkv, shape);

    // A cache with room to spare; positions not yet written are NaN, so reading one shows.
    const int64_t capacity = c.seq + 3;
    Tensor k_cache = Tensor::empty({c.batch, capacity, c.kv_heads, c.head_dim});
    Tensor v_cache = Tensor::empty({c.batch, capacity, c.kv_heads, c.v_head_dim});
    fill_nan(k_cache);
    fill_nan(v_cache);
    const int64_t width = qkv.dim(2), out_width = c.q_heads * c.v_head_dim;
    int64_t at = 0;
    for (int64_t n : c.steps) {
      Tensor step = Tensor::empty(shape.qkv_shape(c.batch, n)), step_out = Tensor::empty(shape.out_shape(c.batch, n));
      for (int64_t b = 0; b < c.batch; ++b)
        std::copy_n(qkv.data<float>() + (b * c.seq + at) * width, n * width, step.data<float>() + b * n * width);
      fill_nan(step_out);
      kv_cache_append(k_cache, v_cache, step, at, shape);
      decode_attention_forward(step_out, step, k_cache, v_cache, at, shape);
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t k = 0; k < n * out_width; ++k) {
          const float want = out.data<float>()[(b * c.seq + at) * out_width + k];
          ASSERT_NEAR(step_out.data<float>()[b * n * out_width + k], want, 1e-6f * std::max(1.0f, std::abs(want)))
              << describe(c) << ", batch " << b << ", step at " << at << ", element " << k;
        }
      at += n;
    }
    ASSERT_EQ(at, c.seq) << describe(c);
    // The caches hold each position's keys and values as qkv has them.
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq; ++t)
        for (int64_t g = 0; g < c.kv_heads; ++g) {
          const float* token = qkv.data<float>() + (b * c.seq + t) * width;
          const float* key = token + (c.q_heads + g) * c.head_dim;
          const float* value = token + (c.q_heads + c.kv_heads) * c.head_dim + g * c.v_head_dim;
          const int64_t slot = (b * capacity + t) * c.kv_heads + g;
          ASSERT_TRUE(std::equal(key, key + c.head_dim, k_cache.data<float>() + slot * c.head_dim))
              << describe(c) << ", key of batch " << b << " position " << t << " head " << g;
          ASSERT_TRUE(std::equal(value, value + c.v_head_dim, v_cache.data<float>() + slot * c.v_head_dim))
              << describe(c) << ", value of batch " << b << " position " << t << " head " << g;
        }
  }
}

TEST(OpsDecodeAttention, ValueHeadDimShapeErrorsNameTheOpAndTheExpectedShape) {
  const AttentionShape mla{.num_q_heads = 2, .num_kv_heads = 1, .scale = 0.5f, .head_dim = 6, .v_head_dim = 4};
  const Tensor qkv = Tensor::zeros(mla.qkv_shape(1, 2));  // [1, 2, 22]
  const Tensor k_cache = Tensor::zeros({1, 5, 1, 6}), v_cache = Tensor::zeros({1, 5, 1, 4});
  const Tensor out = Tensor::zeros({1, 2, 2, 4});
  EXPECT_NO_THROW(kv_cache_append(k_cache, v_cache, qkv, 3, mla));
  EXPECT_NO_THROW(decode_attention_forward(out, qkv, k_cache, v_cache, 3, mla));

  // qkv in the 4-D form, or of the wrong width.
  expect_error([&] { kv_cache_append(k_cache, v_cache, Tensor::zeros({1, 2, 4, 6}), 0, mla); },
               {"kv_cache_append", "[B, T, (2 + 1) * 6 + 1 * 4] = [B, T, 22]", "v_head_dim 4"});
  expect_error([&] { decode_attention_forward(out, Tensor::zeros({1, 2, 21}), k_cache, v_cache, 0, mla); },
               {"decode_attention_forward", "[1, 2, 21]", "22"});
  // A key cache of the value head dim, or not 4-D; a value cache of the key head dim, or of
  // another capacity, batch or kv head count.
  expect_error([&] { kv_cache_append(Tensor::zeros({1, 5, 1, 4}), v_cache, qkv, 0, mla); },
               {"kv_cache_append", "k_cache [1, 5, 1, 4] must be [1, capacity, 1, 6]"});
  expect_error([&] { kv_cache_append(Tensor::zeros({1, 5, 6}), v_cache, qkv, 0, mla); },
               {"k_cache [1, 5, 6] must be [1, capacity, 1, 6]"});
  expect_error([&] { kv_cache_append(k_cache, Tensor::zeros({1, 5, 1, 6}), qkv, 0, mla); },
               {"kv_cache_append", "v_cache [1, 5, 1, 6] must be [1, 5, 1, 4]", "v_head_dim 4"});
  expect_error([&] { decode_attention_forward(out, qkv, k_cache, Tensor::zeros({1, 6, 1, 4}), 0, mla); },
               {"decode_attention_forward", "v_cache [1, 6, 1, 4] must be [1, 5, 1, 4]"});
  expect_error([&] { decode_attention_forward(out, qkv, k_cache, Tensor::zeros({2, 5, 1, 4}), 0, mla); },
               {"v_cache [2, 5, 1, 4] must be [1, 5, 1, 4]"});
  expect_error([&] { decode_attention_forward(out, qkv, k_cache, Tensor::zeros({1, 5, 2, 4}), 0, mla); },
               {"v_cache [1, 5, 2, 4] must be [1, 5, 1, 4]"});
  // out of the query/key head dim.
  expect_error([&] { decode_attention_forward(Tensor::zeros({1, 2, 2, 6}), qkv, k_cache, v_cache, 0, mla); },
               {"decode_attention_forward out has shape [1, 2, 2, 6], expected [1, 2, 2, 4]"});
  // Positions past the cache.
  expect_error([&] { kv_cache_append(k_cache, v_cache, qkv, 4, mla); },
               {"kv_cache_append", "positions 4 .. 5 do not fit a cache of 5"});
  // A value head dim without the query/key head dim; the 3-D form for a uniform shape.
  AttentionShape no_head_dim = mla;
  no_head_dim.head_dim = 0;
  expect_error([&] { kv_cache_append(k_cache, v_cache, qkv, 0, no_head_dim); }, {"kv_cache_append", "needs head_dim"});
  AttentionShape uniform = mla;
  uniform.v_head_dim = 6;
  expect_error([&] { decode_attention_forward(out, qkv, k_cache, v_cache, 0, uniform); },
               {"decode_attention_forward", "set v_head_dim and head_dim"});
  // The uniform form keeps one head dim for both caches.
  const Tensor uniform_qkv = Tensor::zeros({1, 2, 4, 6});
  expect_error([&] { kv_cache_append(k_cache, v_cache, uniform_qkv, 0, uniform); },
               {"kv_cache_append", "v_cache [1, 5, 1, 4] must be [1, 5, 1, 6]", "head dim 6"});
  EXPECT_NO_THROW(kv_cache_append(k_cache, Tensor::zeros({1, 5, 1, 6}), uniform_qkv, 0, uniform));
}

}  // namespace
}  // namespace forge
