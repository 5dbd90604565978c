// The parts of ring attention with packed examples (NOTE [Ring attention with packed
// examples] in model/context_parallel_ring.h; the whole ring against the all-gather and one
// rank is ContextParallelRing.PackedExamplesMatchAllGatherAndOneRank): every chunk pair's
// segments give the attention of its queries over the keys of the pair that share their
// example (NOTE [Full chunk attention with packed examples]), row by row against a softmax
// over those keys, a query with none out 0 and lse -inf; the pairs no query sees say so;
// CUDA's ragged description of each pair, read on the host as cuDNN reads it, gives the same
// out and (token-major) lse; and the merge of token-major statistics is the merge.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "expect_error.h"
#include "model/context_parallel_ring.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"
#include "ops/attention_merge.h"
#include "ops_testing.h"
#include "ragged_attention_reference.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::ragged_reference;

struct PackedRows {
  int64_t chunk;                           // L: the rows cut into chunks of L
  std::vector<std::vector<int64_t>> runs;  // per row, the lengths of its examples
};

const PackedRows kRows[] = {
    {4, {{6, 2, 3, 5}, {11, 2, 2, 1}}},                    // across chunks; one inside a chunk
    {2, {{1, 3, 1, 1, 4, 2}}},                             // short examples: most pairs unseen
    {3, {{2, 1, 7, 14}, {5, 5, 1, 1, 1, 11}}},             // one over four chunks
    {3, {{24}, {1, 1, 2, 1, 3, 1, 2, 1, 1, 4, 1, 2, 1, 1, 2}}},  // one example; one-token ones
};

int64_t seq_of(const PackedRows& c) {
  int64_t s = 0;
  for (int64_t n : c.runs[0]) s += n;
  return s;
}

// int32 [B, S], a new id per run; and each position's example index.
Tensor ids_of(const PackedRows& c) {
  const int64_t b = static_cast<int64_t>(c.runs.size()), s = seq_of(c);
  Tensor ids = Tensor::empty({b, s}, DType::I32);
  int32_t id = 0;
  for (int64_t row = 0; row < b; ++row) {
    int64_t t = 0;
    for (int64_t n : c.runs[static_cast<size_t>(row)]) {
      for (int64_t i = 0; i < n; ++i) ids.data<int32_t>()[row * s + t++] = id;
      ++id;
    }
    EXPECT_EQ(t, s);
  }
  return ids;
}

// The pair's attention from its definition: query i (at qp + i) sees key j (at kp + j) when
// kp + j <= qp + i and both are in one example; out [B, L, Hq, D], lse [B, Hq, L] (-inf: none).
void pair_reference(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& ids, int64_t qp,
                    int64_t kp, const AttentionShape& shape) {
  const int64_t b = qkv.dim(0), l = qkv.dim(1), hq = shape.num_q_heads, hkv = shape.num_kv_heads;
  const int64_t d = shape.head_dim, s = ids.dim(1), width = (hq + 2 * hkv) * d, kv_width = 2 * hkv * d;
  for (int64_t x = 0; x < b; ++x)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < l; ++i) {
        const int64_t g = h / (hq / hkv);
        std::vector<double> score;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < l; ++j) {
          if (kp + j > qp + i) continue;
          bool same = true;  // one example: no example boundary in (kp + j, qp + i]
          for (int64_t t = kp + j + 1; t <= qp + i; ++t)
            same = same && ids.data<int32_t>()[x * s + t] == ids.data<int32_t>()[x * s + t - 1];
          if (!same) continue;
          double dot = 0;
          for (int64_t e = 0; e < d; ++e)
            dot += double(qkv.data<float>()[(x * l + i) * width + h * d + e]) *
                   kv.data<float>()[(x * l + j) * kv_width + g * d + e];
          score.push_back(shape.scale * dot);
          keys.push_back(j);
        }
        float* o = out.data<float>() + ((x * l + i) * hq + h) * d;
        float& row_lse = lse.data<float>()[(x * hq + h) * l + i];
        if (keys.empty()) {
          std::fill_n(o, d, 0.0f);
          row_lse = -INFINITY;
          continue;
        }
        double m = -1e300, sum = 0;
        for (double v : score) m = std::max(m, v);
        for (double v : score) sum += std::exp(v - m);
        for (int64_t e = 0; e < d; ++e) {
          double acc = 0;
          for (size_t n = 0; n < keys.size(); ++n)
            acc += std::exp(score[n] - m) / sum * kv.data<float>()[(x * l + keys[n]) * kv_width + (hkv + g) * d + e];
          o[e] = static_cast<float>(acc);
        }
        row_lse = static_cast<float>(m + std::log(sum));
      }
}

// [B, H, L] as token-major [B L, H].
std::vector<double> token_major(const Tensor& lse) {
  const int64_t b = lse.dim(0), h = lse.dim(1), l = lse.dim(2);
  std::vector<double> out;
  for (int64_t x = 0; x < b; ++x)
    for (int64_t i = 0; i < l; ++i)
      for (int64_t k = 0; k < h; ++k) out.push_back(lse.data<float>()[(x * h + k) * l + i]);
  return out;
}

TEST(ContextParallelRingPacked, PairSegmentsGiveEachQueryItsExamplesKeys) {
  Rng rng(31);
  const AttentionShape shape{.num_q_heads = 4, .num_kv_heads = 2, .sliding_window = 0, .scale = 0.4f, .head_dim = 4};
  int64_t skipped = 0, full = 0;
  for (const PackedRows& c : kRows) {
    const Tensor ids = ids_of(c);
    const int64_t b = ids.dim(0), l = c.chunk, chunks = ids.dim(1) / l, hq = shape.num_q_heads;
    for (int64_t a = 0; a < chunks; ++a)
      for (int64_t k = 0; k <= a; ++k) {
        SCOPED_TRACE(fmt::format("L={} query chunk {} key chunk {}", l, a, k));
        const Tensor qkv = random_tensor({b, l, hq + 2 * shape.num_kv_heads, shape.head_dim}, rng, 1.5);
        const Tensor kv = random_tensor({b, l, 2 * shape.num_kv_heads, shape.head_dim}, rng, 1.5);
        const AttentionChunkSegments segments = attention_chunk_pair_segments(ids, a * l, k * l, l, shape, Device::CPU);
        AttentionShape pair = shape;
        pair.causal = a == k;
        EXPECT_EQ(segments.causal, a == k);
        Tensor out = Tensor::empty({b, l, hq, shape.head_dim}), lse = Tensor::empty({b, hq, l});
        Tensor want_out = Tensor::empty(out.shape()), want_lse = Tensor::empty(lse.shape());
        attention_chunk_forward(out, lse, qkv, kv, 0, pair, &segments);
        pair_reference(want_out, want_lse, qkv, kv, ids, a * l, k * l, shape);
        bool seen = false;
        for (int64_t n = 0; n < lse.numel(); ++n) {
          const float got = lse.data<float>()[n], want = want_lse.data<float>()[n];
          seen = seen || want != -INFINITY;
          if (want == -INFINITY)
            EXPECT_EQ(got, -INFINITY);
          else
            EXPECT_NEAR(got, want, 1e-5);
        }
        EXPECT_LT(testing::relative_error(out, testing::to_double(want_out)), 1e-5);
        EXPECT_EQ(segments.num_examples > 0, seen) << "a pair no query sees has no sequence (the ring skips it)";
        skipped += !seen;
        full += seen && a != k;

        // CUDA's description of the pair, as cuDNN reads it.
        const AttentionChunkSegments ragged = attention_chunk_pair_ragged_on_host(ids, a * l, k * l, l, shape);
        EXPECT_EQ(ragged.num_examples, segments.num_examples);
        ASSERT_EQ(ragged.capacity & (ragged.capacity - 1), 0) << "a power of two";
        Tensor ragged_out = Tensor::empty(out.shape()), ragged_lse = Tensor::empty({b * l, hq});
        ragged_reference(ragged_out, ragged_lse, qkv, kv, ragged, shape);
        const std::vector<double> want = token_major(lse);
        for (int64_t n = 0; n < ragged_lse.numel(); ++n) {
          const double got = ragged_lse.data<float>()[n];
          if (want[static_cast<size_t>(n)] == -INFINITY) {
            EXPECT_TRUE(std::isnan(got)) << "a query that sees no key is no sequence's (cleared on CUDA)";
          } else {
            EXPECT_NEAR(got, want[static_cast<size_t>(n)], 1e-5);
            const int64_t row = n / hq * hq + n % hq;  // the out row of (token, head)
            for (int64_t e = 0; e < shape.head_dim; ++e)
              EXPECT_NEAR(ragged_out.data<float>()[row * shape.head_dim + e],
                          out.data<float>()[row * shape.head_dim + e], 1e-5);
          }
        }
      }
  }
  EXPECT_GT(skipped, 0) << "the layouts have pairs no query sees";
  EXPECT_GT(full, 0) << "and full pairs that an example reaches across";
}

// A full pair's backward: dq of the queries that see no key is 0, dk/dv of the keys no query
// sees 0, the rest against central differences of sum(out * dout).
TEST(ContextParallelRingPacked, FullPairBackwardIsTheGradient) {
  Rng rng(32);
  const AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .sliding_window = 0, .scale = 0.5f, .head_dim = 4};
  // Chunk 2 ([8, 12)) against chunk 1 ([4, 8)): row 0's queries 0, 1 (example [2, 10)) see
  // every key, 2, 3 (example [10, 12)) none; row 1's (example [7, 16)) only key 3.
  const PackedRows rows{4, {{2, 8, 2, 4}, {7, 9}}};
  const Tensor ids = ids_of(rows);
  const int64_t b = 2, l = 4, width = (shape.num_q_heads + 2) * shape.head_dim;
  AttentionShape pair = shape;
  pair.causal = false;
  const AttentionChunkSegments segments = attention_chunk_pair_segments(ids, 2 * l, l, l, shape, Device::CPU);
  Tensor qkv = random_tensor({b, l, shape.num_q_heads + 2, shape.head_dim}, rng, 1.5);
  Tensor kv = random_tensor({b, l, 2, shape.head_dim}, rng, 1.5);
  const Tensor dout = random_tensor({b, l, shape.num_q_heads, shape.head_dim}, rng);
  Tensor out = Tensor::empty({b, l, shape.num_q_heads, shape.head_dim}), lse = Tensor::empty({b, 2, l});
  attention_chunk_forward(out, lse, qkv, kv, 0, pair, &segments);
  Tensor dqkv = Tensor::zeros(qkv.shape()), dkv = Tensor::empty(kv.shape());
  attention_chunk_backward(dqkv, dkv, dout, qkv, kv, out, lse, 0, pair, &segments);
  auto loss = [&] {
    Tensor o = Tensor::empty(out.shape()), s = Tensor::empty(lse.shape());
    attention_chunk_forward(o, s, qkv, kv, 0, pair, &segments);
    double total = 0;
    for (int64_t n = 0; n < o.numel(); ++n) total += double(o.data<float>()[n]) * dout.data<float>()[n];
    return total;
  };
  auto central = [&](float* x) {
    const float keep = *x, step = 1e-2f;
    *x = keep + step;
    const double up = loss();
    *x = keep - step;
    const double down = loss();
    *x = keep;
    return (up - down) / (2.0 * step);
  };
  double worst = 0;
  for (int64_t n = 0; n < b * l; ++n)
    for (int64_t e = 0; e < shape.num_q_heads * shape.head_dim; ++e)
      worst = std::max(worst, std::abs(central(qkv.data<float>() + n * width + e) - dqkv.data<float>()[n * width + e]));
  for (int64_t n = 0; n < kv.numel(); ++n)
    worst = std::max(worst, std::abs(central(kv.data<float>() + n) - dkv.data<float>()[n]));
  EXPECT_LT(worst, 2e-3);
  for (int64_t i = 2; i < l; ++i)  // row 0's queries 2, 3: no key, dq 0
    for (int64_t e = 0; e < shape.num_q_heads * shape.head_dim; ++e)
      EXPECT_EQ(dqkv.data<float>()[i * width + e], 0.0f);
  const int64_t kv_width = 2 * shape.head_dim;
  for (int64_t j = 0; j < 3; ++j)  // row 1's keys 0, 1, 2 (the example [0, 7)): no gradient
    for (int64_t e = 0; e < kv_width; ++e) EXPECT_EQ(dkv.data<float>()[(l + j) * kv_width + e], 0.0f);
}

// The ring's pairs' CUDA forms go to the device in one buffer; here onto the CPU, where the
// views must read what was built (a pair never described, as the ring's skipped ones, stays
// empty).
TEST(ContextParallelRingPacked, UploadInOneBufferKeepsEveryPairsArrays) {
  const AttentionShape shape{.num_q_heads = 4, .num_kv_heads = 2, .sliding_window = 0, .scale = 0.4f, .head_dim = 4};
  const Tensor ids = ids_of(kRows[2]);
  std::vector<AttentionChunkSegments> built, uploaded;
  for (int64_t k : {0, 1, 3}) built.push_back(attention_chunk_pair_ragged_on_host(ids, 9, 3 * k, 3, shape));
  built.emplace_back();
  uploaded = built;
  const Tensor buffer = upload_chunk_segments(uploaded, Device::CPU);
  for (size_t n = 0; n + 1 < built.size(); ++n) {
    const AttentionChunkSegments &a = built[n], &b = uploaded[n];
    ASSERT_EQ(a.capacity, b.capacity);
    for (int64_t e = 0; e < a.capacity; ++e) {
      EXPECT_EQ(a.q_lengths.data<int32_t>()[e], b.q_lengths.data<int32_t>()[e]);
      EXPECT_EQ(a.kv_lengths.data<int32_t>()[e], b.kv_lengths.data<int32_t>()[e]);
    }
    for (auto member : {&AttentionChunkSegments::q_offsets, &AttentionChunkSegments::out_offsets,
                        &AttentionChunkSegments::lse_offsets, &AttentionChunkSegments::kv_offsets})
      for (int64_t e = 0; e <= a.capacity; ++e)
        EXPECT_EQ((a.*member).data<int64_t>()[e], (b.*member).data<int64_t>()[e]);
    EXPECT_NE(b.q_lengths.raw(), a.q_lengths.raw());
    EXPECT_GE(static_cast<uint8_t*>(b.kv_offsets.raw()), buffer.data<uint8_t>());
  }
  EXPECT_EQ(uploaded.back().capacity, 0);
}

TEST(ContextParallelRingPacked, MergeOfTokenMajorStatisticsIsTheMerge) {
  Rng rng(33);
  const int64_t b = 2, l = 5, h = 3, d = 4;
  const Tensor out = random_tensor({b, l, h, d}, rng), part = random_tensor({b, l, h, d}, rng);
  Tensor lse = random_tensor({b, h, l}, rng, 2.0), part_lse = random_tensor({b, h, l}, rng, 2.0);
  lse.data<float>()[3] = -INFINITY;  // a row that saw no key on one side, then the other
  part_lse.data<float>()[7] = -INFINITY;
  auto transposed = [&](const Tensor& t) {
    Tensor x = Tensor::empty(t.shape());
    const std::vector<double> v = token_major(t);
    for (size_t n = 0; n < v.size(); ++n) x.data<float>()[n] = static_cast<float>(v[n]);
    return x;
  };
  Tensor merged = out.clone(), merged_lse = lse.clone();
  attention_merge(merged, merged_lse, part, part_lse);
  Tensor token_out = out.clone(), token_lse = transposed(lse);
  attention_merge(token_out, token_lse, part, transposed(part_lse), true);
  EXPECT_TRUE(testing::bitwise_equal(token_out, merged));
  EXPECT_EQ(testing::to_double(token_lse), token_major(merged_lse));
}

TEST(ContextParallelRingPacked, PairSegmentsRefuseAKeyChunkThatOverlapsTheQueries) {
  const AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .sliding_window = 0, .scale = 0.5f, .head_dim = 4};
  const Tensor ids = Tensor::zeros({1, 12}, DType::I32);
  expect_error([&] { attention_chunk_pair_segments(ids, 4, 2, 4, shape, Device::CPU); },
               {"attention_chunk_pair_segments", "[2, 6)", "[4, 8)"});
  expect_error([&] { attention_chunk_pair_segments(ids, 4, 8, 4, shape, Device::CPU); }, {"[8, 12)"});
  const AttentionChunkSegments full = attention_chunk_pair_segments(ids, 4, 0, 4, shape, Device::CPU);
  Tensor qkv = Tensor::zeros({1, 4, 4, 4}), kv = Tensor::zeros({1, 4, 2, 4});
  Tensor out = Tensor::empty({1, 4, 2, 4}), lse = Tensor::empty({1, 2, 4});
  expect_error([&] { attention_chunk_forward(out, lse, qkv, kv, 0, shape, &full); },
               {"segments of a full chunk for a causal one"});
}

// A group that is never asked to communicate: set_layout only reads its rank and size.
struct IdleGroup : ContextParallel {
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void gather(const Tensor&, const Tensor&) override { FORGE_FAIL("not here"); }
  void reduce_scatter(const Tensor&, const Tensor&) override { FORGE_FAIL("not here"); }
  void all_reduce_sum(const Tensor&) override { FORGE_FAIL("not here"); }
  void rotate_start(const std::vector<Tensor>&, const std::vector<Tensor>&) override { FORGE_FAIL("not here"); }
};

// NOTE [Ring attention with packed examples]: no sliding window with packed examples.
TEST(ContextParallelRingPacked, RingRefusesAWindowWithPackedExamples) {
  IdleGroup group;
  ContextParallelRing ring;
  const StepShape step{1, 16, DType::F32, 1, 1, 2};
  ArenaLayout counting(nullptr, Device::CPU);
  ring.lay_out(counting, step, 2, 1, 4);
  AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .sliding_window = 3, .scale = 0.5f, .head_dim = 4};
  const Tensor ids = Tensor::zeros({1, 16}, DType::I32);
  expect_error([&] { ring.set_layout(group, &ids, shape, Device::CPU); },
               {"parallelism.context_parallel_rotate_method p2p", "packed examples", "model.sliding_window 3",
                "allgather"});
  ring.set_layout(group, nullptr, shape, Device::CPU);  // unpacked: the window is the ring's
  shape.sliding_window = 0;
  ring.set_layout(group, &ids, shape, Device::CPU);
}

}  // namespace
}  // namespace forge
