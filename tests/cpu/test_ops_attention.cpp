#include <gtest/gtest.h>

#include <cmath>

#include "ops/attention.h"
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
                        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)))};
}

// Softmax attention in double, written straight from the definition in ops/attention.h;
// with segment ids [B, T], a query sees only keys of its own segment (NOTE [Packed examples]).
void naive_attention(const Tensor& qkv, const AttentionCase& c, std::vector<double>& out, std::vector<double>& lse,
                     const int32_t* segments = nullptr) {
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
        for (int64_t j = 0; j <= i; ++j) {
          if (c.window > 0 && i - j >= c.window) continue;
          if (segments && segments[b * c.seq + j] != segments[b * c.seq + i]) continue;
          double s = 0.0;
          for (int64_t e = 0; e < d; ++e) s += static_cast<double>(at(b, i, h)[e]) * at(b, j, c.q_heads + g)[e];
          score[j] = scale * s;
          max_score = std::max(max_score, score[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j)
          if (score[j] > -INFINITY) sum += std::exp(score[j] - max_score);
        lse[(b * c.q_heads + h) * c.seq + i] = max_score + std::log(sum);
        double* o = out.data() + ((b * c.seq + i) * c.q_heads + h) * d;
        for (int64_t j = 0; j <= i; ++j) {
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
    AttentionSegments segments = attention_segments(ids, shape_of(c), c.head_dim, Device::CPU);
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
  AttentionSegments segments = attention_segments(ids, shape_of(c), c.head_dim, Device::CPU);
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
  AttentionSegments segments = attention_segments(ids, shape_of(c), 4, Device::CPU);
  EXPECT_THROW(attention_forward(out, lse, qkv, shape_of(c), &segments), Error);
}

}  // namespace
}  // namespace forge
