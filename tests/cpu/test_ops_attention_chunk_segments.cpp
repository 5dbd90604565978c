// Chunk attention with packed examples (NOTE [Chunk attention with packed examples] in
// ops/attention_chunk.h) against the whole sequence's packed attention (ops/attention.h with
// AttentionSegments): over a partition of the positions into chunks, the chunks' out and lse
// rows and dq rows are the whole's, their dk/dv summed are its dk/dv. Layouts with examples
// that cross chunk boundaries, examples longer than a chunk, chunks that start mid-example,
// padding runs, sliding windows. Then CUDA's ragged description, read on the host as cuDNN
// reads it (per sequence, the causal diagonal at the bottom right of its own lengths), gives
// the same attention; and mismatched segments are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "expect_error.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"
#include "ops/elementwise.h"
#include "ops_testing.h"
#include "ragged_attention_reference.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::ragged_reference;

struct SegmentCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, window;
  std::vector<std::vector<int64_t>> runs;  // per row, the lengths of its examples (the last may be padding)
  std::vector<int64_t> chunks;             // lengths, a partition of [0, seq)
};

std::string describe(const SegmentCase& c) {
  std::string rows;
  for (const auto& r : c.runs) rows += fmt::format("[{}]", fmt::join(r, ","));
  return fmt::format("B={} S={} Hq={} Hkv={} D={} W={} examples {} chunks {}", c.batch, c.seq, c.q_heads, c.kv_heads,
                     c.head_dim, c.window, rows, fmt::join(c.chunks, ","));
}

const SegmentCase kCases[] = {
    // Examples across chunk boundaries; row 1's second example (7) is longer than a chunk, its
    // last run (3) padding; chunks that start mid-example.
    {2, 12, 4, 2, 4, 0, {{5, 4, 3}, {2, 7, 3}}, {3, 3, 3, 3}},
    // A window of 3 inside examples; one-token examples; unequal chunks.
    {1, 16, 2, 1, 8, 3, {{1, 9, 2, 4}}, {4, 4, 4, 4}},
    {2, 10, 3, 3, 4, 4, {{10}, {1, 1, 1, 1, 6}}, {2, 5, 3}},
    // Context parallelism's 2C = 8 chunks of 2 (C = 4), GQA 4 / 1; an example over 6 chunks.
    {2, 16, 4, 1, 4, 0, {{3, 3, 3, 3, 4}, {11, 5}}, {2, 2, 2, 2, 2, 2, 2, 2}},
    // A window longer than the examples; chunks of one position.
    {1, 9, 2, 2, 4, 6, {{4, 2, 3}}, {1, 1, 3, 4}},
};

AttentionShape shape_of(const SegmentCase& c) {
  return AttentionShape{.num_q_heads = c.q_heads,
                        .num_kv_heads = c.kv_heads,
                        .sliding_window = c.window,
                        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))),
                        .head_dim = c.head_dim};
}

// int32 [B, S]: runs of equal ids, a new id per run (neighbouring runs differ).
Tensor segment_ids_of(const SegmentCase& c) {
  Tensor ids = Tensor::empty({c.batch, c.seq}, DType::I32);
  int32_t id = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t t = 0;
    for (int64_t n : c.runs[static_cast<size_t>(b)]) {
      for (int64_t i = 0; i < n; ++i) ids.data<int32_t>()[b * c.seq + t++] = id;
      ++id;
    }
    EXPECT_EQ(t, c.seq) << "row " << b << "'s runs must cover it";
  }
  return ids;
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

TEST(OpsAttentionChunkSegments, ChunksMatchTheWholePackedSequence) {
  Rng rng(93);
  for (const SegmentCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    const int64_t heads = c.q_heads + 2 * c.kv_heads, d = c.head_dim, q_width = c.q_heads * d;
    const AttentionShape shape = shape_of(c);
    const Tensor ids = segment_ids_of(c);
    const AttentionSegments whole = attention_segments(ids, shape, Device::CPU);
    Tensor qkv = random_tensor({c.batch, c.seq, heads, d}, rng, 1.5);
    Tensor dout = random_tensor({c.batch, c.seq, c.q_heads, d}, rng);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, d}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    Tensor dqkv = Tensor::empty(qkv.shape());
    attention_forward(out, lse, qkv, shape, &whole);
    attention_backward(dqkv, dout, qkv, out, lse, shape, &whole);

    const Tensor kv = kv_of(qkv, c.kv_heads);
    Tensor dkv_sum = Tensor::zeros(kv.shape()), dkv = Tensor::empty(kv.shape());
    int64_t position = 0;
    for (int64_t n : c.chunks) {
      SCOPED_TRACE(fmt::format("chunk [{}, {})", position, position + n));
      const AttentionChunkSegments segments = attention_chunk_segments(ids, position, n, shape, Device::CPU);
      const Tensor chunk_qkv = rows_of(qkv, position, n), chunk_dout = rows_of(dout, position, n);
      Tensor chunk_out = Tensor::empty({c.batch, n, c.q_heads, d}), chunk_lse = Tensor::empty({c.batch, c.q_heads, n});
      attention_chunk_forward(chunk_out, chunk_lse, chunk_qkv, kv, position, shape, &segments);
      EXPECT_TRUE(testing::bitwise_equal(chunk_out, rows_of(out, position, n)));
      EXPECT_EQ(testing::to_double(chunk_lse), columns(lse, c.seq, position, n));

      Tensor chunk_dqkv = Tensor::empty(chunk_qkv.shape());
      std::fill_n(chunk_dqkv.data<float>(), chunk_dqkv.numel(), 7.0f);
      std::fill_n(dkv.data<float>(), dkv.numel(), 7.0f);
      attention_chunk_backward(chunk_dqkv, dkv, chunk_dout, chunk_qkv, kv, chunk_out, chunk_lse, position, shape,
                               &segments);
      const Tensor want_dq = rows_of(dqkv, position, n);
      const std::vector<double> got = columns(chunk_dqkv, heads * d, 0, q_width),
                                want = columns(want_dq, heads * d, 0, q_width);
      EXPECT_LT(testing::relative_error(got, want), 1e-6);
      for (double v : columns(chunk_dqkv, heads * d, q_width, 2 * c.kv_heads * d))
        ASSERT_EQ(v, 7.0) << "the key/value heads of dqkv are left as they were";
      for (double v : testing::to_double(rows_of(dkv, position + n, c.seq - position - n)))
        ASSERT_EQ(v, 0.0) << "no gradient for the keys the chunk does not see";
      accumulate(dkv_sum, dkv);
      position += n;
    }
    ASSERT_EQ(position, c.seq);
    EXPECT_LT(testing::relative_error(dkv_sum, testing::to_double(kv_of(dqkv, c.kv_heads))), 1e-6);
  }
}

TEST(OpsAttentionChunkSegments, RaggedDescriptionGivesTheChunkAttention) {
  Rng rng(94);
  for (const SegmentCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    const int64_t heads = c.q_heads + 2 * c.kv_heads, d = c.head_dim;
    const AttentionShape shape = shape_of(c);
    const Tensor ids = segment_ids_of(c);
    const Tensor kv = random_tensor({c.batch, c.seq, 2 * c.kv_heads, d}, rng, 1.5);
    int64_t position = 0;
    for (int64_t n : c.chunks) {
      SCOPED_TRACE(fmt::format("chunk [{}, {})", position, position + n));
      const AttentionChunkSegments ragged = attention_chunk_ragged_on_host(ids, position, n, shape);
      ASSERT_GE(ragged.capacity, ragged.num_examples);
      ASSERT_EQ(ragged.capacity & (ragged.capacity - 1), 0) << "a power of two";
      int64_t rows = 0;
      for (int64_t e = 0; e < ragged.capacity; ++e) {
        const int64_t q_len = ragged.q_lengths.data<int32_t>()[e], kv_len = ragged.kv_lengths.data<int32_t>()[e];
        EXPECT_EQ(q_len > 0, e < ragged.num_examples);
        EXPECT_GE(kv_len, q_len);
        rows += q_len;
      }
      EXPECT_EQ(rows, c.batch * n) << "every query of the chunk in one sequence";
      const Tensor qkv = random_tensor({c.batch, n, heads, d}, rng, 1.5);
      Tensor out = Tensor::empty({c.batch, n, c.q_heads, d}), lse = Tensor::empty({c.batch, c.q_heads, n});
      const AttentionChunkSegments segments = attention_chunk_segments(ids, position, n, shape, Device::CPU);
      attention_chunk_forward(out, lse, qkv, kv, position, shape, &segments);
      Tensor ragged_out = Tensor::empty(out.shape()), ragged_lse = Tensor::empty({c.batch * n, c.q_heads});
      ragged_reference(ragged_out, ragged_lse, qkv, kv, ragged, shape);
      EXPECT_LT(testing::relative_error(ragged_out, testing::to_double(out)), 1e-5);
      std::vector<double> lse_token_major;  // [B, Hq, Lq] as [B Lq, Hq]
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < c.q_heads; ++h)
            lse_token_major.push_back(lse.data<float>()[(b * c.q_heads + h) * n + i]);
      EXPECT_LT(testing::relative_error(ragged_lse, lse_token_major), 1e-5);
      position += n;
    }
  }
}

TEST(OpsAttentionChunkSegments, RefusesSegmentsOfAnotherChunk) {
  const AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .sliding_window = 0, .scale = 0.5f, .head_dim = 4};
  Tensor ids = Tensor::zeros({1, 6}, DType::I32);
  Tensor qkv = Tensor::zeros({1, 3, 4, 4}), kv = Tensor::zeros({1, 6, 2, 4});
  Tensor out = Tensor::empty({1, 3, 2, 4}), lse = Tensor::empty({1, 2, 3});
  const AttentionChunkSegments first = attention_chunk_segments(ids, 0, 3, shape, Device::CPU);
  expect_error([&] { attention_chunk_forward(out, lse, qkv, kv, 3, shape, &first); },
               {"attention_chunk_forward", "segments of 3 queries at position 0", "3 queries at position 3"});
  AttentionShape wider = shape;
  wider.num_kv_heads = 2;
  const AttentionChunkSegments other_heads = attention_chunk_segments(ids, 3, 3, wider, Device::CPU);
  expect_error([&] { attention_chunk_forward(out, lse, qkv, kv, 3, shape, &other_heads); },
               {"24 elements per token", "16 elements per token"});
  expect_error([&] { attention_chunk_segments(ids, 4, 3, shape, Device::CPU); },
               {"attention_chunk_segments", "3 queries at position 4", "6 positions"});
  expect_error([&] { attention_chunk_segments(Tensor::zeros({6}, DType::I32), 0, 3, shape, Device::CPU); },
               {"attention_chunk_segments", "must be [B, S]"});
}

}  // namespace
}  // namespace forge
