#include <gtest/gtest.h>

#include <cmath>

#include "expect_error.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"
#include "ops/decode_attention.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

struct AttentionCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, window;
};

std::string describe(const AttentionCase& c) {
  return fmt::format("B={} T={} Hq={} Hkv={} D={} W={}", c.batch, c.seq, c.q_heads, c.kv_heads, c.head_dim,
                     c.window);
}

// GQA ratios 1, 2, 4 (and 3 query heads), T = 1, windows of 1, smaller than T and larger than T.
const AttentionCase kCases[] = {
    {1, 1, 1, 1, 4, 0}, {2, 7, 3, 3, 5, 0}, {1, 9, 4, 2, 8, 3},
    {1, 6, 4, 1, 3, 1}, {2, 5, 2, 1, 16, 10}, {1, 8, 3, 1, 4, 2},
};

AttentionShape shape_of(const AttentionCase& c) {
  return AttentionShape{.num_q_heads = c.q_heads,
                        .num_kv_heads = c.kv_heads,
                        .sliding_window = c.window,
                        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))),
                        .head_dim = c.head_dim};
}

// Softmax attention in double, written straight from the definition in ops/attention.h;
// with segment ids [B, T], a query sees only keys of its own segment (NOTE [Packed examples]);
// without `causal` keys after the query too (NOTE [Bidirectional attention]).
void naive_attention(const Tensor& qkv, const AttentionCase& c, std::vector<double>& out, std::vector<double>& lse,
                     const int32_t* segments = nullptr, bool causal = true) {
  int64_t heads = c.q_heads + 2 * c.kv_heads, d = c.head_dim, group = c.q_heads / c.kv_heads;
  double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const float* p = qkv.data<float>();
  auto at = [&](int64_t b, int64_t t, int64_t head) { return p + ((b * c.seq + t) * heads + head) * d; };
  out.assign(c.batch * c.seq * c.q_heads * d, 0.0);
  lse.assign(c.batch * c.q_heads * c.seq, 0.0);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.q_heads; ++h) {
      int64_t g = h / group;
      for (int64_t i = 0; i < c.seq; ++i) {
        std::vector<double> score(c.seq, -INFINITY);
        double max_score = -INFINITY;
        const int64_t last = causal ? i : c.seq - 1;
        for (int64_t j = 0; j <= last; ++j) {
          if (c.window > 0 && i - j >= c.window) continue;
          if (segments && segments[b * c.seq + j] != segments[b * c.seq + i]) continue;
          double s = 0.0;
          for (int64_t e = 0; e < d; ++e) s += static_cast<double>(at(b, i, h)[e]) * at(b, j, c.q_heads + g)[e];
          score[j] = scale * s;
          max_score = std::max(max_score, score[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= last; ++j)
          if (score[j] > -INFINITY) sum += std::exp(score[j] - max_score);
        lse[(b * c.q_heads + h) * c.seq + i] = max_score + std::log(sum);
        double* o = out.data() + ((b * c.seq + i) * c.q_heads + h) * d;
        for (int64_t j = 0; j <= last; ++j) {
          if (score[j] == -INFINITY) continue;
          double weight = std::exp(score[j] - max_score) / sum;
          for (int64_t e = 0; e < d; ++e) o[e] += weight * at(b, j, c.q_heads + c.kv_heads + g)[e];
        }
      }
    }
  }
}

TEST(OpsAttention, ForwardMatchesDoublePrecision) {
  Rng rng(71);
  for (const AttentionCase& c : kCases) {
    Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng, 1.5);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim});
    Tensor lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    attention_forward(out, lse, qkv, shape_of(c));
    std::vector<double> want_out, want_lse;
    naive_attention(qkv, c, want_out, want_lse);
    EXPECT_LT(relative_error(out, want_out), 1e-5) << describe(c);
    EXPECT_LT(relative_error(lse, want_lse), 1e-5) << describe(c);
  }
}

TEST(OpsAttention, WindowOfOneCopiesTheOwnValue) {
  Rng rng(72);
  AttentionCase c{1, 5, 2, 1, 4, 1};
  Tensor qkv = random_tensor({1, 5, 4, 4}, rng);
  Tensor out = Tensor::empty({1, 5, 2, 4}), lse = Tensor::empty({1, 2, 5});
  attention_forward(out, lse, qkv, shape_of(c));
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t e = 0; e < 4; ++e) {
        EXPECT_FLOAT_EQ(out.data<float>()[(t * 2 + h) * 4 + e], qkv.data<float>()[(t * 4 + 3) * 4 + e]);
      }
    }
  }
}

TEST(OpsAttention, BackwardMatchesFiniteDifferences) {
  Rng rng(73);
  for (const AttentionCase& c : kCases) {
    Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim});
    Tensor lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    Tensor r = random_tensor(out.shape(), rng);
    auto loss = [&] {
      attention_forward(out, lse, qkv, shape_of(c));
      return testing::weighted_sum(out, r);
    };
    std::vector<double> fd = testing::finite_difference(qkv, loss);
    attention_forward(out, lse, qkv, shape_of(c));
    Tensor dqkv = Tensor::empty(qkv.shape());
    std::fill_n(dqkv.data<float>(), dqkv.numel(), 5.0f);
    attention_backward(dqkv, r, qkv, out, lse, shape_of(c));
    EXPECT_LT(relative_error(dqkv, fd), 1e-2) << describe(c);
  }
}

TEST(OpsAttention, IsDeterministic) {
  Rng rng(74);
  AttentionCase c{2, 64, 4, 2, 16, 24};
  Tensor qkv = random_tensor({c.batch, c.seq, 8, c.head_dim}, rng);
  Tensor dout = random_tensor({c.batch, c.seq, 4, c.head_dim}, rng);
  Tensor out1 = Tensor::empty(dout.shape()), out2 = Tensor::empty(dout.shape());
  Tensor lse1 = Tensor::empty({c.batch, 4, c.seq}), lse2 = Tensor::empty({c.batch, 4, c.seq});
  attention_forward(out1, lse1, qkv, shape_of(c));
  attention_forward(out2, lse2, qkv, shape_of(c));
  EXPECT_TRUE(testing::bitwise_equal(out1, out2));
  EXPECT_TRUE(testing::bitwise_equal(lse1, lse2));
  Tensor d1 = Tensor::empty(qkv.shape()), d2 = Tensor::empty(qkv.shape());
  attention_backward(d1, dout, qkv, out1, lse1, shape_of(c));
  attention_backward(d2, dout, qkv, out1, lse1, shape_of(c));
  EXPECT_TRUE(testing::bitwise_equal(d1, d2));
}

TEST(OpsAttention, RejectsHeadsThatDoNotGroup) {
  Tensor qkv = Tensor::zeros({1, 2, 7, 4}), out = Tensor::zeros({1, 2, 3, 4}), lse = Tensor::zeros({1, 3, 2});
  AttentionShape shape{.num_q_heads = 3, .num_kv_heads = 2, .sliding_window = 0, .scale = 0.5f};
  EXPECT_THROW(attention_forward(out, lse, qkv, shape), Error);
}

// Segment ids of rows cut into runs: every few tokens a new example, ids as the loader
// gives them (0, 1, ..., then -1 for a padding run).
Tensor random_segments(int64_t batch, int64_t seq, Rng& rng) {
  Tensor ids = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t id = 0;
    for (int64_t t = 0; t < seq; ++t) {
      if (t > 0 && rng.below(4) == 0) ++id;
      ids.data<int32_t>()[b * seq + t] = t + 2 >= seq && id > 0 ? -1 : id;
    }
  }
  return ids;
}

TEST(OpsAttention, SegmentsConfineAttentionToEachExample) {
  Rng rng(73);
  for (const AttentionCase& c : kCases) {
    Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng, 1.5);
    Tensor ids = random_segments(c.batch, c.seq, rng);
    AttentionSegments segments = attention_segments(ids, shape_of(c), Device::CPU);
    Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim});
    Tensor lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    attention_forward(out, lse, qkv, shape_of(c), &segments);
    std::vector<double> want_out, want_lse;
    naive_attention(qkv, c, want_out, want_lse, ids.data<int32_t>());
    EXPECT_LT(relative_error(out, want_out), 1e-5) << describe(c);
    EXPECT_LT(relative_error(lse, want_lse), 1e-5) << describe(c);
  }
}

// Each example run alone (a batch of its own, positions from 0) gives the packed run's
// output and gradients: the backward is confined too.
TEST(OpsAttention, PackedExamplesMatchEachExampleAlone) {
  Rng rng(74);
  const AttentionCase c{2, 13, 4, 2, 8, 3};
  const int64_t heads = c.q_heads + 2 * c.kv_heads;
  Tensor qkv = random_tensor({c.batch, c.seq, heads, c.head_dim}, rng, 1.5);
  Tensor dout = random_tensor({c.batch, c.seq, c.q_heads, c.head_dim}, rng);
  Tensor ids = random_segments(c.batch, c.seq, rng);
  AttentionSegments segments = attention_segments(ids, shape_of(c), Device::CPU);
  EXPECT_GT(segments.num_examples, 2);
  Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
  Tensor dqkv = Tensor::empty(qkv.shape());
  attention_forward(out, lse, qkv, shape_of(c), &segments);
  attention_backward(dqkv, dout, qkv, out, lse, shape_of(c), &segments);
  const int64_t q_row = heads * c.head_dim, o_row = c.q_heads * c.head_dim;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t begin = 0; begin < c.seq;) {
      int64_t end = begin + 1;
      while (end < c.seq && ids.data<int32_t>()[b * c.seq + end] == ids.data<int32_t>()[b * c.seq + begin]) ++end;
      const int64_t n = end - begin, first = b * c.seq + begin;
      Tensor part = Tensor::empty({1, n, heads, c.head_dim}), part_dout = Tensor::empty({1, n, c.q_heads, c.head_dim});
      std::copy_n(qkv.data<float>() + first * q_row, n * q_row, part.data<float>());
      std::copy_n(dout.data<float>() + first * o_row, n * o_row, part_dout.data<float>());
      Tensor o = Tensor::empty(part_dout.shape()), l = Tensor::empty({1, c.q_heads, n}), d = Tensor::empty(part.shape());
      attention_forward(o, l, part, shape_of(c));
      attention_backward(d, part_dout, part, o, l, shape_of(c));
      for (int64_t e = 0; e < n * o_row; ++e)
        ASSERT_EQ(o.data<float>()[e], out.data<float>()[first * o_row + e]) << "row " << b << " at " << begin;
      for (int64_t e = 0; e < n * q_row; ++e)
        ASSERT_NEAR(d.data<float>()[e], dqkv.data<float>()[first * q_row + e], 1e-6) << "row " << b << " at " << begin;
      begin = end;
    }
  }
}

TEST(OpsAttention, SegmentsMustDescribeTheBatch) {
  const AttentionCase c{1, 6, 2, 1, 4, 0};
  Tensor qkv = Tensor::zeros({1, 6, 4, 4}), out = Tensor::empty({1, 6, 2, 4}), lse = Tensor::empty({1, 2, 6});
  Tensor ids = Tensor::zeros({1, 5}, DType::I32);
  AttentionSegments segments = attention_segments(ids, shape_of(c), Device::CPU);
  EXPECT_THROW(attention_forward(out, lse, qkv, shape_of(c), &segments), Error);
}

// NOTE [Bidirectional attention]: every query sees every key of its row (or of its example).
// T = 1, MHA and GQA (3 query heads), one key head for all; no windows (refused).
const AttentionCase kBidirectionalCases[] = {
    {1, 1, 1, 1, 4, 0}, {2, 7, 3, 3, 5, 0}, {1, 9, 4, 2, 8, 0}, {2, 5, 2, 1, 16, 0}, {1, 8, 3, 1, 4, 0},
};

AttentionShape bidirectional_shape_of(const AttentionCase& c) {
  AttentionShape shape = shape_of(c);
  shape.causal = false;
  return shape;
}

TEST(OpsAttention, BidirectionalForwardMatchesDoublePrecision) {
  Rng rng(75);
  for (const AttentionCase& c : kBidirectionalCases) {
    for (bool packed : {false, true}) {
      Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng, 1.5);
      Tensor ids = random_segments(c.batch, c.seq, rng);
      AttentionSegments segments = attention_segments(ids, bidirectional_shape_of(c), Device::CPU);
      Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim});
      Tensor lse = Tensor::empty({c.batch, c.q_heads, c.seq});
      attention_forward(out, lse, qkv, bidirectional_shape_of(c), packed ? &segments : nullptr);
      std::vector<double> want_out, want_lse;
      naive_attention(qkv, c, want_out, want_lse, packed ? ids.data<int32_t>() : nullptr, /*causal=*/false);
      EXPECT_LT(relative_error(out, want_out), 1e-5) << describe(c) << (packed ? " packed" : "");
      EXPECT_LT(relative_error(lse, want_lse), 1e-5) << describe(c) << (packed ? " packed" : "");
    }
  }
}

// Without a mask attention does not care about the order of the tokens: reversing a row's
// tokens reverses its outputs.
TEST(OpsAttention, BidirectionalIsIndifferentToTokenOrder) {
  Rng rng(76);
  const AttentionCase c{2, 9, 4, 2, 8, 0};
  const int64_t q_row = (c.q_heads + 2 * c.kv_heads) * c.head_dim, o_row = c.q_heads * c.head_dim;
  Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng, 1.5);
  Tensor reversed = Tensor::empty(qkv.shape());
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t t = 0; t < c.seq; ++t)
      std::copy_n(qkv.data<float>() + (b * c.seq + t) * q_row, q_row,
                  reversed.data<float>() + (b * c.seq + c.seq - 1 - t) * q_row);
  Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
  Tensor out_r = Tensor::empty(out.shape()), lse_r = Tensor::empty(lse.shape());
  attention_forward(out, lse, qkv, bidirectional_shape_of(c));
  attention_forward(out_r, lse_r, reversed, bidirectional_shape_of(c));
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t t = 0; t < c.seq; ++t)
      for (int64_t e = 0; e < o_row; ++e)
        EXPECT_NEAR(out_r.data<float>()[(b * c.seq + c.seq - 1 - t) * o_row + e],
                    out.data<float>()[(b * c.seq + t) * o_row + e], 1e-5)
            << "b " << b << " t " << t;
}

TEST(OpsAttention, BidirectionalBackwardMatchesFiniteDifferences) {
  Rng rng(77);
  for (const AttentionCase& c : kBidirectionalCases) {
    for (bool packed : {false, true}) {
      Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng);
      Tensor ids = random_segments(c.batch, c.seq, rng);
      AttentionSegments segments = attention_segments(ids, bidirectional_shape_of(c), Device::CPU);
      const AttentionSegments* examples = packed ? &segments : nullptr;
      Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim});
      Tensor lse = Tensor::empty({c.batch, c.q_heads, c.seq});
      Tensor r = random_tensor(out.shape(), rng);
      auto loss = [&] {
        attention_forward(out, lse, qkv, bidirectional_shape_of(c), examples);
        return testing::weighted_sum(out, r);
      };
      std::vector<double> fd = testing::finite_difference(qkv, loss);
      attention_forward(out, lse, qkv, bidirectional_shape_of(c), examples);
      Tensor dqkv = Tensor::empty(qkv.shape());
      std::fill_n(dqkv.data<float>(), dqkv.numel(), 5.0f);
      attention_backward(dqkv, r, qkv, out, lse, bidirectional_shape_of(c), examples);
      EXPECT_LT(relative_error(dqkv, fd), 1e-2) << describe(c) << (packed ? " packed" : "");
    }
  }
}

// A sliding window needs the causal mask; chunk attention and decoding are causal only.
TEST(OpsAttention, BidirectionalRefusesWindowsChunksAndDecoding) {
  const AttentionCase c{1, 6, 2, 1, 4, 0};
  Tensor qkv = Tensor::zeros({1, 6, 4, 4}), out = Tensor::zeros({1, 6, 2, 4}), lse = Tensor::zeros({1, 2, 6});
  AttentionShape windowed = bidirectional_shape_of(c);
  windowed.sliding_window = 3;
  expect_error([&] { attention_forward(out, lse, qkv, windowed); },
               {"attention_forward", "sliding window (3) needs causal attention"});
  Tensor dqkv = Tensor::zeros(qkv.shape());
  expect_error([&] { attention_backward(dqkv, out, qkv, out, lse, windowed); }, {"attention_backward", "causal"});
  const Tensor kv = Tensor::zeros({1, 6, 2, 4});
  // A chunk against every key of kv (NOTE [Full chunk attention]) takes position 0 only.
  expect_error([&] { attention_chunk_forward(out, lse, qkv, kv, 1, bidirectional_shape_of(c)); },
               {"attention_chunk_forward", "NOTE [Full chunk attention]", "got position 1"});
  const Tensor cache = Tensor::zeros({1, 8, 1, 4}), step = Tensor::zeros({1, 1, 4, 4});
  expect_error([&] { decode_attention_forward(Tensor::zeros({1, 1, 2, 4}), step, cache, cache, 0,
                                              bidirectional_shape_of(c)); },
               {"decode_attention_forward", "decoding is causal"});
  expect_error([&] { kv_cache_append(cache, cache, step, 0, bidirectional_shape_of(c)); },
               {"kv_cache_append", "decoding is causal"});
}

// NOTE [Value head dim]: values of a head dim of their own, in the 3-D qkv form. The
// reference is the uniform form with every head zero-padded to the larger of the two dims:
// zero columns add nothing to q.k, and a zero column of v gives a zero column of out.
struct ValueDimCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim, v_head_dim, window;
  int64_t padded() const { return std::max(head_dim, v_head_dim); }
  int64_t width() const { return (q_heads + kv_heads) * head_dim + kv_heads * v_head_dim; }
};

std::string describe(const ValueDimCase& c) {
  return fmt::format("B={} T={} Hq={} Hkv={} D={} Dv={} W={}", c.batch, c.seq, c.q_heads, c.kv_heads, c.head_dim,
                     c.v_head_dim, c.window);
}

// T = 1, MHA and GQA (Hq = 4, Hkv = 2; 3 query heads), windows, Dv below and above D, and
// MLA's proportions (D = 1.5 Dv).
const ValueDimCase kValueDimCases[] = {
    {1, 1, 1, 1, 8, 4, 0},  {2, 7, 3, 3, 6, 4, 0},   {1, 9, 4, 2, 12, 8, 0},  {2, 10, 4, 2, 8, 4, 3},
    {1, 6, 2, 1, 4, 6, 2},  {1, 8, 4, 4, 24, 16, 0}, {2, 11, 4, 2, 12, 8, 1},
};

AttentionShape shape_of(const ValueDimCase& c) {
  return AttentionShape{.num_q_heads = c.q_heads,
                        .num_kv_heads = c.kv_heads,
                        .sliding_window = c.window,
                        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))),
                        .head_dim = c.head_dim,
                        .v_head_dim = c.v_head_dim};
}

// The uniform form's shape for the padded tensors: the same scale, head dim padded().
AttentionShape padded_shape_of(const ValueDimCase& c) {
  AttentionShape shape = shape_of(c);
  shape.head_dim = c.padded();
  shape.v_head_dim = 0;
  return shape;
}

// The padded head h of token (b, t) in a 4-D qkv and where its first element sits in the
// 3-D one, with the number of real columns.
struct HeadSpan {
  int64_t padded_offset, offset, columns;
};
HeadSpan head_span(const ValueDimCase& c, int64_t token, int64_t head) {
  const int64_t p = c.padded(), heads = c.q_heads + 2 * c.kv_heads, first_value = c.q_heads + c.kv_heads;
  const int64_t offset = head < first_value ? head * c.head_dim
                                            : first_value * c.head_dim + (head - first_value) * c.v_head_dim;
  return {(token * heads + head) * p, token * c.width() + offset, head < first_value ? c.head_dim : c.v_head_dim};
}

// qkv [B, T, width] -> [B, T, Hq + 2 Hkv, padded], the missing columns zero.
Tensor pad_qkv(const Tensor& qkv, const ValueDimCase& c) {
  Tensor padded = Tensor::zeros({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.padded()});
  for (int64_t token = 0; token < c.batch * c.seq; ++token)
    for (int64_t head = 0; head < c.q_heads + 2 * c.kv_heads; ++head) {
      const HeadSpan span = head_span(c, token, head);
      std::copy_n(qkv.data<float>() + span.offset, span.columns, padded.data<float>() + span.padded_offset);
    }
  return padded;
}

// The inverse: the real columns of a padded qkv (or dqkv) in the 3-D layout.
Tensor unpad_qkv(const Tensor& padded, const ValueDimCase& c) {
  Tensor qkv = Tensor::empty({c.batch, c.seq, c.width()});
  for (int64_t token = 0; token < c.batch * c.seq; ++token)
    for (int64_t head = 0; head < c.q_heads + 2 * c.kv_heads; ++head) {
      const HeadSpan span = head_span(c, token, head);
      std::copy_n(padded.data<float>() + span.padded_offset, span.columns, qkv.data<float>() + span.offset);
    }
  return qkv;
}

// out [B, T, Hq, Dv] <-> [B, T, Hq, padded] (the columns past Dv zero).
Tensor pad_out(const Tensor& out, const ValueDimCase& c) {
  Tensor padded = Tensor::zeros({c.batch, c.seq, c.q_heads, c.padded()});
  for (int64_t row = 0; row < c.batch * c.seq * c.q_heads; ++row)
    std::copy_n(out.data<float>() + row * c.v_head_dim, c.v_head_dim, padded.data<float>() + row * c.padded());
  return padded;
}
Tensor unpad_out(const Tensor& padded, const ValueDimCase& c) {
  Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.v_head_dim});
  for (int64_t row = 0; row < c.batch * c.seq * c.q_heads; ++row)
    std::copy_n(padded.data<float>() + row * c.padded(), c.v_head_dim, out.data<float>() + row * c.v_head_dim);
  return out;
}

// The largest |x| over the padded columns of out, which must stay zero.
double padding_magnitude(const Tensor& padded_out, const ValueDimCase& c) {
  double largest = 0.0;
  for (int64_t row = 0; row < c.batch * c.seq * c.q_heads; ++row)
    for (int64_t e = c.v_head_dim; e < c.padded(); ++e)
      largest = std::max(largest, std::abs(static_cast<double>(padded_out.data<float>()[row * c.padded() + e])));
  return largest;
}

// Forward and backward of the 3-D form against the padded uniform form, each run with the
// same packed examples when segment ids are given.
void expect_value_dim_matches_padded(const ValueDimCase& c, Rng& rng, const Tensor* ids) {
  const AttentionShape shape = shape_of(c), padded_shape = padded_shape_of(c);
  AttentionSegments segments, padded_segments;
  if (ids) {
    segments = attention_segments(*ids, shape, Device::CPU);
    padded_segments = attention_segments(*ids, padded_shape, Device::CPU);
  }
  Tensor qkv = random_tensor(shape.qkv_shape(c.batch, c.seq), rng, 1.5);
  ASSERT_EQ(qkv.ndim(), c.v_head_dim == c.head_dim ? 4 : 3) << describe(c);
  Tensor out = Tensor::empty(shape.out_shape(c.batch, c.seq)), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
  attention_forward(out, lse, qkv, shape, ids ? &segments : nullptr);
  Tensor padded = pad_qkv(qkv, c);
  Tensor padded_out = Tensor::empty({c.batch, c.seq, c.q_heads, c.padded()});
  Tensor padded_lse = Tensor::empty(lse.shape());
  attention_forward(padded_out, padded_lse, padded, padded_shape, ids ? &padded_segments : nullptr);
  EXPECT_LT(relative_error(out, testing::to_double(unpad_out(padded_out, c))), 1e-6) << describe(c);
  EXPECT_EQ(padding_magnitude(padded_out, c), 0.0) << describe(c);
  EXPECT_LT(relative_error(lse, testing::to_double(padded_lse)), 1e-6) << describe(c);

  Tensor dout = random_tensor(out.shape(), rng);
  Tensor dqkv = Tensor::empty(qkv.shape()), padded_dqkv = Tensor::empty(padded.shape());
  std::fill_n(dqkv.data<float>(), dqkv.numel(), 7.0f);  // overwritten
  attention_backward(dqkv, dout, qkv, out, lse, shape, ids ? &segments : nullptr);
  attention_backward(padded_dqkv, pad_out(dout, c), padded, padded_out, padded_lse, padded_shape,
                     ids ? &padded_segments : nullptr);
  EXPECT_LT(relative_error(dqkv, testing::to_double(unpad_qkv(padded_dqkv, c))), 1e-5) << describe(c);
}

TEST(OpsAttention, ValueHeadDimMatchesZeroPaddedValues) {
  Rng rng(81);
  for (const ValueDimCase& c : kValueDimCases) expect_value_dim_matches_padded(c, rng, nullptr);
}

TEST(OpsAttention, ValueHeadDimWithPackedExamplesMatchesZeroPaddedValues) {
  Rng rng(82);
  for (const ValueDimCase& c : kValueDimCases) {
    Tensor ids = random_segments(c.batch, c.seq, rng);
    expect_value_dim_matches_padded(c, rng, &ids);
  }
}

// A shape whose v_head_dim equals its head_dim is the uniform form, 4-D.
TEST(OpsAttention, EqualValueHeadDimIsTheUniformForm) {
  Rng rng(83);
  expect_value_dim_matches_padded(ValueDimCase{2, 6, 4, 2, 8, 8, 3}, rng, nullptr);
}

TEST(OpsAttention, ValueHeadDimBackwardMatchesFiniteDifferences) {
  Rng rng(84);
  for (const ValueDimCase& c : {ValueDimCase{1, 5, 2, 1, 6, 3, 0}, ValueDimCase{1, 7, 4, 2, 4, 2, 3},
                                ValueDimCase{2, 6, 2, 2, 3, 5, 0}}) {
    const AttentionShape shape = shape_of(c);
    Tensor ids = random_segments(c.batch, c.seq, rng);
    AttentionSegments segments = attention_segments(ids, shape, Device::CPU);
    const AttentionSegments* packed = c.batch == 2 ? &segments : nullptr;  // the last case packs examples
    Tensor qkv = random_tensor(shape.qkv_shape(c.batch, c.seq), rng);
    Tensor out = Tensor::empty(shape.out_shape(c.batch, c.seq)), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
    Tensor r = random_tensor(out.shape(), rng);
    auto loss = [&] {
      attention_forward(out, lse, qkv, shape, packed);
      return testing::weighted_sum(out, r);
    };
    std::vector<double> fd = testing::finite_difference(qkv, loss);
    attention_forward(out, lse, qkv, shape, packed);
    Tensor dqkv = Tensor::empty(qkv.shape());
    std::fill_n(dqkv.data<float>(), dqkv.numel(), 5.0f);
    attention_backward(dqkv, r, qkv, out, lse, shape, packed);
    EXPECT_LT(relative_error(dqkv, fd), 1e-2) << describe(c);
  }
}

TEST(OpsAttention, ShapeSaysWhichFormItExpects) {
  const AttentionShape mla{.num_q_heads = 4, .num_kv_heads = 2, .scale = 0.1f, .head_dim = 6, .v_head_dim = 4};
  EXPECT_TRUE(mla.distinct_v_head_dim());
  EXPECT_EQ(mla.qkv_shape(2, 3), (Shape{2, 3, (4 + 2) * 6 + 2 * 4}));
  EXPECT_EQ(mla.out_shape(2, 3), (Shape{2, 3, 4, 4}));
  AttentionShape uniform = mla;
  uniform.v_head_dim = 6;
  EXPECT_FALSE(uniform.distinct_v_head_dim());
  EXPECT_EQ(uniform.qkv_shape(2, 3), (Shape{2, 3, 8, 6}));
  EXPECT_EQ(uniform.out_shape(2, 3), (Shape{2, 3, 4, 6}));
  uniform.v_head_dim = 0;
  EXPECT_FALSE(uniform.distinct_v_head_dim());
  EXPECT_EQ(uniform.qkv_shape(2, 3), (Shape{2, 3, 8, 6}));
  EXPECT_THROW(AttentionShape{}.qkv_shape(1, 1), Error);
}

TEST(OpsAttention, ValueHeadDimShapeErrorsAreClear) {
  const AttentionShape mla{.num_q_heads = 2, .num_kv_heads = 1, .scale = 0.5f, .head_dim = 6, .v_head_dim = 4};
  const Tensor out = Tensor::zeros({1, 3, 2, 4}), lse = Tensor::zeros({1, 2, 3});
  const Tensor qkv = Tensor::zeros(mla.qkv_shape(1, 3));  // [1, 3, 22]
  // The 4-D form, or a row of the wrong width, for a shape with its own value head dim.
  expect_error([&] { attention_forward(out, lse, Tensor::zeros({1, 3, 4, 6}), mla); },
               {"attention_forward", "[B, T, (2 + 1) * 6 + 1 * 4] = [B, T, 22]", "v_head_dim 4"});
  expect_error([&] { attention_forward(out, lse, Tensor::zeros({1, 3, 21}), mla); }, {"[1, 3, 21]", "22"});
  // A value head dim without the query/key head dim.
  AttentionShape no_head_dim = mla;
  no_head_dim.head_dim = 0;
  expect_error([&] { attention_forward(out, lse, qkv, no_head_dim); }, {"needs head_dim"});
  AttentionShape negative = mla;
  negative.v_head_dim = -4;
  expect_error([&] { attention_forward(out, lse, qkv, negative); }, {"must not be negative"});
  // A 3-D qkv for the uniform form, and a head dim that disagrees with the 4-D qkv.
  AttentionShape uniform = mla;
  uniform.v_head_dim = 0;
  expect_error([&] { attention_forward(out, lse, qkv, uniform); }, {"set v_head_dim and head_dim"});
  expect_error([&] { attention_forward(Tensor::zeros({1, 3, 2, 8}), lse, Tensor::zeros({1, 3, 4, 8}), uniform); },
               {"head dim 8", "says 6"});
  // out and dout take the value head dim.
  EXPECT_THROW(attention_forward(Tensor::zeros({1, 3, 2, 6}), lse, qkv, mla), Error);
  Tensor dqkv = Tensor::zeros(qkv.shape());
  EXPECT_THROW(attention_backward(dqkv, Tensor::zeros({1, 3, 2, 6}), qkv, out, lse, mla), Error);
  EXPECT_NO_THROW(attention_backward(dqkv, out, qkv, out, lse, mla));
  // Segments are built for one shape's row widths.
  const Tensor ids = Tensor::zeros({1, 3}, DType::I32);
  expect_error([&] { attention_segments(ids, AttentionShape{1, 1, 0, 0.5f}, Device::CPU); }, {"head_dim"});
  AttentionSegments uniform_segments = attention_segments(ids, uniform, Device::CPU);
  expect_error([&] { attention_forward(out, lse, qkv, mla, &uniform_segments); }, {"segments for tokens of"});
  // Decoding takes the same form, with a value cache of the value head dim
  // (OpsDecodeAttention.* in test_ops_decode_attention.cpp).
  const Tensor cache = Tensor::zeros({1, 4, 1, 6});
  expect_error([&] { kv_cache_append(cache, cache, qkv, 0, mla); }, {"v_cache [1, 4, 1, 6] must be [1, 4, 1, 4]"});
}

}  // namespace
}  // namespace forge
