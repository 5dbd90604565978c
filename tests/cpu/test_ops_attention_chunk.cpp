// Chunk attention (NOTE [Chunk attention] in ops/attention_chunk.h) against the whole
// sequence's attention: the chunks of a partition of the positions give the rows of
// attention_forward's out and lse, and of attention_backward's dq, and their dk/dv summed
// give its dk/dv. Then finite differences, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "expect_error.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"
#include "ops/elementwise.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;

struct ChunkCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, window;
  std::vector<int64_t> chunks;  // lengths, a partition of [0, seq)
};

std::string describe(const ChunkCase& c) {
  return fmt::format("B={} S={} Hq={} Hkv={} D={} W={} chunks {}", c.batch, c.seq, c.q_heads, c.kv_heads, c.head_dim,
                     c.window, fmt::join(c.chunks, ","));
}

// MHA and GQA (ratios 1, 2, 4), windows inside a chunk and across chunks, chunks of one
// position, context parallelism's 2C equal chunks.
const ChunkCase kCases[] = {
    {1, 6, 2, 2, 4, 0, {2, 2, 2}},  {2, 9, 4, 2, 8, 0, {1, 3, 5}},
    {2, 12, 4, 1, 4, 3, {4, 1, 7}}, {1, 16, 4, 2, 16, 0, {2, 2, 2, 2, 2, 2, 2, 2}},
    {2, 10, 2, 1, 8, 6, {5, 5}},    {1, 8, 3, 3, 4, 1, {3, 5}},
};

AttentionShape shape_of(const ChunkCase& c) {
  return AttentionShape{.num_q_heads = c.q_heads,
                        .num_kv_heads = c.kv_heads,
                        .sliding_window = c.window,
                        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))),
                        .head_dim = c.head_dim};
}

// Positions [begin, begin + n) of every row of `whole` [B, S, ...], as [B, n, ...].
Tensor rows_of(const Tensor& whole, int64_t begin, int64_t n) {
  Shape shape = whole.shape();
  const int64_t b = shape[0], width = whole.numel() / (b * shape[1]);
  shape[1] = n;
  Tensor part = Tensor::empty(shape);
  copy_columns(part.view({b, n * width}), 0, whole.view({b, whole.numel() / b}), begin * width, n * width);
  return part;
}

// The key and value heads of every token of qkv [B, S, Hq + 2 Hkv, D], as [B, S, 2 Hkv, D].
Tensor kv_of(const Tensor& qkv, int64_t kv_heads) {
  const int64_t b = qkv.dim(0), s = qkv.dim(1), d = qkv.dim(3), width = qkv.dim(2) * d;
  Tensor kv = Tensor::empty({b, s, 2 * kv_heads, d});
  copy_columns(kv.view({b * s, 2 * kv_heads * d}), 0, qkv.view({b * s, width}), width - 2 * kv_heads * d,
               2 * kv_heads * d);
  return kv;
}

// Elements [begin, begin + width) of each `row`-element row of a tensor, in order.
std::vector<double> columns(const Tensor& t, int64_t row, int64_t begin, int64_t width) {
  std::vector<double> out;
  for (int64_t r = 0; r < t.numel() / row; ++r)
    for (int64_t e = begin; e < begin + width; ++e) out.push_back(t.data<float>()[r * row + e]);
  return out;
}

TEST(OpsAttentionChunk, ChunksMatchTheWholeSequence) {
  Rng rng(91);
  for (const ChunkCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    const int64_t heads = c.q_heads + 2 * c.kv_heads, d = c.head_dim, q_width = c.q_heads * d;
    const AttentionShape shape = shape_of(c);
    Tensor qkv = random_tensor({c.batch, c.seq, heads, d}, rng, 1.5);
    Tensor dout = random_tensor({c.batch, c.seq, c.q_heads, d}, rng);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, d}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    Tensor dqkv = Tensor::empty(qkv.shape());
    attention_forward(out, lse, qkv, shape);
    attention_backward(dqkv, dout, qkv, out, lse, shape);

    const Tensor kv = kv_of(qkv, c.kv_heads);
    Tensor dkv_sum = Tensor::zeros(kv.shape()), dkv = Tensor::empty(kv.shape());
    int64_t position = 0;
    for (int64_t n : c.chunks) {
      SCOPED_TRACE(fmt::format("chunk [{}, {})", position, position + n));
      const Tensor chunk_qkv = rows_of(qkv, position, n), chunk_dout = rows_of(dout, position, n);
      Tensor chunk_out = Tensor::empty({c.batch, n, c.q_heads, d}), chunk_lse = Tensor::empty({c.batch, c.q_heads, n});
      attention_chunk_forward(chunk_out, chunk_lse, chunk_qkv, kv, position, shape);
      EXPECT_TRUE(testing::bitwise_equal(chunk_out, rows_of(out, position, n)));
      // lse [B, Hq, S]: the chunk's columns of every (batch, head) row.
      EXPECT_EQ(testing::to_double(chunk_lse), columns(lse, c.seq, position, n));

      Tensor chunk_dqkv = Tensor::empty(chunk_qkv.shape());
      std::fill_n(chunk_dqkv.data<float>(), chunk_dqkv.numel(), 7.0f);
      std::fill_n(dkv.data<float>(), dkv.numel(), 7.0f);
      attention_chunk_backward(chunk_dqkv, dkv, chunk_dout, chunk_qkv, kv, chunk_out, chunk_lse, position, shape);
      const Tensor want_dq = rows_of(dqkv, position, n);
      EXPECT_EQ(columns(chunk_dqkv, heads * d, 0, q_width), columns(want_dq, heads * d, 0, q_width));
      for (double v : columns(chunk_dqkv, heads * d, q_width, 2 * c.kv_heads * d))
        ASSERT_EQ(v, 7.0) << "the key/value heads of dqkv are left as they were";
      const int64_t past = c.seq - position - n;
      for (double v : testing::to_double(rows_of(dkv, position + n, past)))
        ASSERT_EQ(v, 0.0) << "no gradient for the keys the chunk does not see";
      accumulate(dkv_sum, dkv);
      position += n;
    }
    ASSERT_EQ(position, c.seq);
    EXPECT_LT(testing::relative_error(dkv_sum, testing::to_double(kv_of(dqkv, c.kv_heads))), 1e-6);
  }
}

TEST(OpsAttentionChunk, BackwardMatchesFiniteDifferences) {
  Rng rng(92);
  const ChunkCase c{2, 7, 4, 2, 4, 3, {}};
  const int64_t queries = 3, position = 2;  // keys [0, 5) of 7 seen
  const AttentionShape shape = shape_of(c);
  Tensor qkv = random_tensor({c.batch, queries, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng);
  Tensor kv = random_tensor({c.batch, c.seq, 2 * c.kv_heads, c.head_dim}, rng);
  Tensor out = Tensor::empty({c.batch, queries, c.q_heads, c.head_dim}),
         lse = Tensor::empty({c.batch, c.q_heads, queries});
  Tensor r = random_tensor(out.shape(), rng);
  auto loss = [&] {
    attention_chunk_forward(out, lse, qkv, kv, position, shape);
    return testing::weighted_sum(out, r);
  };
  const std::vector<double> fd_qkv = testing::finite_difference(qkv, loss),
                            fd_kv = testing::finite_difference(kv, loss);
  attention_chunk_forward(out, lse, qkv, kv, position, shape);
  Tensor dqkv = Tensor::zeros(qkv.shape()), dkv = Tensor::empty(kv.shape());
  attention_chunk_backward(dqkv, dkv, r, qkv, kv, out, lse, position, shape);
  EXPECT_LT(testing::relative_error(dqkv, fd_qkv), 1e-2);  // zero for the key/value heads, as the differences
  EXPECT_LT(testing::relative_error(dkv, fd_kv), 1e-2);
}

TEST(OpsAttentionChunk, RejectsChunksOutsideTheKeysAndOtherLayouts) {
  const AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .sliding_window = 0, .scale = 0.5f, .head_dim = 4};
  Tensor qkv = Tensor::zeros({1, 3, 4, 4}), kv = Tensor::zeros({1, 5, 2, 4});
  Tensor out = Tensor::empty({1, 3, 2, 4}), lse = Tensor::empty({1, 2, 3});
  expect_error([&] { attention_chunk_forward(out, lse, qkv, kv, 3, shape); },
               {"attention_chunk_forward", "3 queries at position 3", "5 positions"});
  expect_error(
      [&] {
        attention_chunk_forward(out, lse, qkv, Tensor::zeros({1, 5, 4, 4}), 0, shape);
      },
      {"kv [1, 5, 4, 4] must be [1, S, 2 * 1, 4]"});
  AttentionShape latent = shape;
  latent.v_head_dim = 2;
  expect_error(
      [&] {
        attention_chunk_forward(out, lse, Tensor::zeros({1, 3, 14}), kv, 0, latent);
      },
      {"values of a head dim of their own"});
  Tensor dqkv = Tensor::empty(qkv.shape()), dkv = Tensor::empty({1, 4, 2, 4});
  expect_error([&] { attention_chunk_backward(dqkv, dkv, out, qkv, kv, out, lse, 0, shape); },
               {"attention_chunk_backward dkv"});
}

}  // namespace
}  // namespace forge
