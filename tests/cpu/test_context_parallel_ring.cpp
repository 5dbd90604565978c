// Ring attention (NOTE [Ring attention] in model/context_parallel_ring.h) against the
// all-gather form and against the whole sequence's attention on one rank: C ranks (threads
// over the CPU process group) each run ContextParallelAttention both ways on their chunks of
// random qkv and dout, and out, lse and dqkv (dq, and the dk/dv of the rank's own keys) agree
// within fp32 rounding, printed; unpacked, with a sliding window, and with packed examples.
// Then its parts: which chunk pairs each step computes, the full chunk attention (NOTE [Full
// chunk attention]) against the bidirectional attention, and the log-sum-exp merge (NOTE
// [Attention merge]); and the configurations it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "cli/config.h"
#include "distributed/context_parallel_group.h"
#include "expect_error.h"
#include "model/context_parallel_attention.h"
#include "model/context_parallel_ring.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"
#include "ops/attention_merge.h"
#include "ops_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::random_tensor;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, static_cast<double>(std::abs(a.data<float>()[i] - b.data<float>()[i])));
  return m;
}

double max_abs(const Tensor& a) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, static_cast<double>(std::abs(a.data<float>()[i])));
  return m;
}

struct RingCase {
  int ranks;
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  int64_t window = 0;  // model.sliding_window (NOTE [Ring attention with a sliding window])
  // Packed examples (NOTE [Ring attention with packed examples]): per row, the lengths of its
  // examples; empty: each row one sequence.
  std::vector<std::vector<int64_t>> runs = {};
};

// int32 [B, S]: a new id per run of c.runs.
Tensor segment_ids_of(const RingCase& c) {
  Tensor ids = Tensor::empty({c.batch, c.seq}, DType::I32);
  int32_t id = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t t = 0;
    for (int64_t n : c.runs[static_cast<size_t>(b)]) {
      for (int64_t i = 0; i < n && t < c.seq; ++i) ids.data<int32_t>()[b * c.seq + t++] = id;
      ++id;
    }
    EXPECT_EQ(t, c.seq) << "row " << b << "'s runs must cover it";
  }
  return ids;
}

// Each token's position in its example, as the data loader gives them.
Tensor positions_of(const Tensor& ids) {
  Tensor positions = Tensor::empty(ids.shape(), DType::I32);
  const int64_t s = ids.dim(1);
  for (int64_t i = 0; i < ids.numel(); ++i)
    positions.data<int32_t>()[i] = i % s == 0 || ids.data<int32_t>()[i] != ids.data<int32_t>()[i - 1]
                                       ? 0
                                       : positions.data<int32_t>()[i - 1] + 1;
  return positions;
}

// One rank's results of one method: out, lse and dqkv of its [2B, L] tokens.
struct RankResult {
  Tensor out, lse, dqkv;
};

RankResult run_method(ContextParallel& cp, ContextParallelRotate method, const RingCase& c, const Tensor& qkv,
                      const Tensor& dout, const AttentionShape& shape, const SequenceLayout* packed) {
  cp.set_rotate_method(method);
  const StepShape step{c.batch, c.seq, DType::F32, 1, 1, c.ranks};
  ContextParallelAttention attention;
  ArenaLayout counting(nullptr, Device::CPU);
  attention.lay_out(counting, step, c.q_heads, c.kv_heads, c.head_dim, method);
  Tensor arena = Tensor::empty({counting.bytes()}, DType::U8);
  ArenaLayout layout(arena.raw(), Device::CPU);
  attention.lay_out(layout, step, c.q_heads, c.kv_heads, c.head_dim, method);
  attention.prepare(cp, step, Device::CPU);
  attention.set_layout(cp, packed, shape);
  const int64_t l = step.local_seq_len();
  RankResult r{Tensor::empty({2 * c.batch, l, c.q_heads, c.head_dim}), Tensor::empty({2 * c.batch, c.q_heads, l}),
               Tensor::empty(qkv.shape())};
  attention.forward(cp, 0, r.out, r.lse, qkv, shape);
  attention.backward(cp, 0, r.dqkv, dout, qkv, r.out, r.lse, shape);
  return r;
}

// lse [B, H, S] of the whole sequences as the rank's chunks [2B, H, L]: through [B, S, H].
Tensor lse_chunks(const Tensor& lse, int rank, int size) {
  const int64_t b = lse.dim(0), h = lse.dim(1), s = lse.dim(2), l = s / (2 * size);
  Tensor token_major = Tensor::empty({b, s, h});
  for (int64_t i = 0; i < b; ++i)
    for (int64_t k = 0; k < h; ++k)
      for (int64_t t = 0; t < s; ++t)
        token_major.data<float>()[(i * s + t) * h + k] = lse.data<float>()[(i * h + k) * s + t];
  Tensor local = Tensor::empty({2 * b, l, h}), out = Tensor::empty({2 * b, h, l});
  take_chunks(local, token_major, rank, size);
  for (int64_t i = 0; i < 2 * b; ++i)
    for (int64_t k = 0; k < h; ++k)
      for (int64_t t = 0; t < l; ++t)
        out.data<float>()[(i * h + k) * l + t] = local.data<float>()[(i * l + t) * h + k];
  return out;
}

Tensor chunks_of(const Tensor& whole, int rank, int size) {
  Shape shape = whole.shape();
  shape[0] *= 2;
  shape[1] /= 2 * size;
  Tensor local = Tensor::empty(shape);
  take_chunks(local, whole, rank, size);
  return local;
}

void expect_ring_matches_all_gather(const RingCase& c) {
  std::string examples;
  for (const auto& row : c.runs) examples += fmt::format("[{}]", fmt::join(row, ","));
  SCOPED_TRACE(fmt::format("C={} B={} S={} Hq={} Hkv={} D={} W={} examples {}", c.ranks, c.batch, c.seq, c.q_heads,
                           c.kv_heads, c.head_dim, c.window, examples));
  Rng rng(static_cast<uint64_t>(17 + c.ranks + c.q_heads));
  AttentionShape shape{.num_q_heads = c.q_heads,
                       .num_kv_heads = c.kv_heads,
                       .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))),
                       .head_dim = c.head_dim};
  shape.sliding_window = c.window;
  const Tensor qkv = random_tensor({c.batch, c.seq, c.q_heads + 2 * c.kv_heads, c.head_dim}, rng, 1.5);
  const Tensor dout = random_tensor({c.batch, c.seq, c.q_heads, c.head_dim}, rng);
  Tensor out = Tensor::empty({c.batch, c.seq, c.q_heads, c.head_dim}), lse = Tensor::empty({c.batch, c.q_heads, c.seq});
  Tensor dqkv = Tensor::empty(qkv.shape());
  SequenceLayout layout;
  AttentionSegments whole;
  if (!c.runs.empty()) {
    layout.segments = segment_ids_of(c);
    layout.positions = positions_of(layout.segments);
    whole = attention_segments(layout.segments, shape, Device::CPU);
  }
  const SequenceLayout* packed = c.runs.empty() ? nullptr : &layout;
  attention_forward(out, lse, qkv, shape, packed ? &whole : nullptr);
  attention_backward(dqkv, dout, qkv, out, lse, shape, packed ? &whole : nullptr);

  std::vector<RankResult> ring(static_cast<size_t>(c.ranks)), gathered(static_cast<size_t>(c.ranks));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(c.ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, c.ranks, port), options);
    GroupContextParallel cp(*group);
    const Tensor local_qkv = chunks_of(qkv, r, c.ranks), local_dout = chunks_of(dout, r, c.ranks);
    const size_t k = static_cast<size_t>(r);
    gathered[k] = run_method(cp, ContextParallelRotate::AllGather, c, local_qkv, local_dout, shape, packed);
    ring[k] = run_method(cp, ContextParallelRotate::Ring, c, local_qkv, local_dout, shape, packed);
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double out_gap = 0, lse_gap = 0, dqkv_gap = 0, out_ref = 0, lse_ref = 0, dqkv_ref = 0, scale = 0;
  for (int r = 0; r < c.ranks; ++r) {
    const RankResult &a = ring[static_cast<size_t>(r)], &g = gathered[static_cast<size_t>(r)];
    out_gap = std::max(out_gap, max_abs_diff(a.out, g.out));
    lse_gap = std::max(lse_gap, max_abs_diff(a.lse, g.lse));
    dqkv_gap = std::max(dqkv_gap, max_abs_diff(a.dqkv, g.dqkv));
    out_ref = std::max(out_ref, max_abs_diff(a.out, chunks_of(out, r, c.ranks)));
    lse_ref = std::max(lse_ref, max_abs_diff(a.lse, lse_chunks(lse, r, c.ranks)));
    dqkv_ref = std::max(dqkv_ref, max_abs_diff(a.dqkv, chunks_of(dqkv, r, c.ranks)));
    scale = std::max(scale, max_abs(g.dqkv));
  }
  std::printf(
      "ring vs all-gather, C=%d L=%lld W=%lld Hq=%lld Hkv=%lld%s: max |diff| out %.3g lse %.3g dqkv %.3g (max "
      "|dqkv| %.3g); ring vs one rank: out %.3g lse %.3g dqkv %.3g\n",
      c.ranks, static_cast<long long>(c.seq / (2 * c.ranks)), static_cast<long long>(c.window),
      static_cast<long long>(c.q_heads), static_cast<long long>(c.kv_heads), c.runs.empty() ? "" : " packed", out_gap,
      lse_gap, dqkv_gap, scale, out_ref, lse_ref, dqkv_ref);
  // fp32: the ring sums the same terms in another order (a few ulps of values of order 1-10).
  for (double gap : {out_gap, lse_gap, out_ref, lse_ref}) EXPECT_LT(gap, 2e-5);
  for (double gap : {dqkv_gap, dqkv_ref}) EXPECT_LT(gap, 2e-5 * std::max(1.0, scale));
}

TEST(ContextParallelRing, MatchesAllGatherAndOneRank) {
  expect_ring_matches_all_gather({2, 2, 16, 4, 2, 8});   // GQA
  expect_ring_matches_all_gather({4, 1, 24, 4, 4, 4});   // MHA, chunks of 3
  expect_ring_matches_all_gather({4, 2, 32, 6, 2, 16});  // GQA 3:1
  expect_ring_matches_all_gather({3, 1, 12, 2, 1, 8});   // an odd ring: next and previous differ
}

// NOTE [Ring attention with a sliding window]: windows that give every kind of pair (chunks
// of L = S / 2C): narrower than a chunk (bands and trimmed bands of neighbours only), W - 2 a
// multiple of L (trimmed bands of one query and one key), a window of one (the diagonal only),
// between chunks, and wider than the sequence (every pair full).
TEST(ContextParallelRing, SlidingWindowMatchesAllGatherAndOneRank) {
  for (int64_t window : {1, 2, 3, 5, 6, 9, 13, 100})  // L = 4
    expect_ring_matches_all_gather({2, 2, 16, 4, 2, 8, window});
  for (int64_t window : {7, 11})  // L = 4, 8 chunks: pairs up to 7 chunks apart
    expect_ring_matches_all_gather({4, 1, 32, 4, 4, 4, window});
  expect_ring_matches_all_gather({3, 1, 30, 2, 1, 8, 8});  // L = 5, an odd ring
  expect_ring_matches_all_gather({2, 1, 20, 6, 2, 16, 12});  // L = 5, GQA 3:1
}

// NOTE [Ring attention with packed examples]: examples that cross chunk and rank boundaries,
// one longer than several chunks, ones wholly inside one chunk, one-token ones, padding;
// chunk pairs that no query sees (skipped), on 2, 3 and 4 ranks.
TEST(ContextParallelRing, PackedExamplesMatchAllGatherAndOneRank) {
  // L = 4 on 2 ranks: row 0's 6 crosses the ranks' chunks 0 | 1, its 2 lies inside chunk 2;
  // row 1's 11 spans three chunks (Full pairs 1 x 0 and 2 x 0, 2 x 1 seen), its last 1 token.
  expect_ring_matches_all_gather({2, 2, 16, 4, 2, 8, 0, {{6, 2, 3, 5}, {11, 2, 2, 1}}});
  // L = 2 on 3 ranks (chunks of ranks 0 1 2 2 1 0): short examples, most pairs unseen.
  expect_ring_matches_all_gather({3, 1, 12, 2, 1, 8, 0, {{1, 3, 1, 1, 4, 2}}});
  // L = 3 on 4 ranks, GQA 3:1: an example over the whole row's second half, one-token ones.
  expect_ring_matches_all_gather({4, 2, 24, 6, 2, 4, 0, {{2, 1, 7, 14}, {5, 5, 1, 1, 1, 11}}});
  // L = 3 on 4 ranks, MHA: one example per row (the unpacked attention), and many tiny ones.
  expect_ring_matches_all_gather({4, 2, 24, 2, 2, 8, 0, {{24}, {1, 1, 2, 1, 3, 1, 2, 1, 1, 4, 1, 2, 1, 1, 2}}});
}

// The classes of ring_chunk_pair against the pair's mask itself: query i of chunk a sees key
// j of chunk k when 0 <= (aL + i) - (kL + j) < W.
TEST(ContextParallelRing, PairClassesFollowTheWindowMask) {
  for (int64_t chunk : {1, 2, 3, 4, 5})
    for (int64_t window : {0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 17})
      for (int64_t a = 0; a < 8; ++a)
        for (int64_t k = 0; k < 8; ++k) {
          int64_t seen = 0, empty_rows = 0;
          for (int64_t i = 0; i < chunk; ++i) {
            int64_t row = 0;
            for (int64_t j = 0; j < chunk; ++j) {
              const int64_t distance = (a * chunk + i) - (k * chunk + j);
              row += distance >= 0 && (window == 0 || distance < window);
            }
            seen += row;
            empty_rows += row == 0;
          }
          const RingChunkPair pair = ring_chunk_pair(a, k, chunk, window);
          SCOPED_TRACE(fmt::format("L={} W={} query chunk {} key chunk {}", chunk, window, a, k));
          if (a == k) {
            EXPECT_EQ(pair, RingChunkPair::Diagonal);
          } else if (seen == 0) {
            EXPECT_EQ(pair, RingChunkPair::Skipped);
          } else if (seen == chunk * chunk) {
            EXPECT_EQ(pair, RingChunkPair::Full);
          } else {
            EXPECT_EQ(pair, empty_rows > 0 ? RingChunkPair::TrimmedBand : RingChunkPair::Band);
          }
        }
}

// NOTE [Full chunk attention with a sliding window]: a chunk d positions after kv against
// the window, row by row against the softmax over the keys it sees (out 0 and lse -inf for a
// query that sees none), and its backward against central differences of sum(out * dout).
TEST(ContextParallelRing, BandChunkIsTheWindowedAttentionAtItsDistance) {
  Rng rng(12);
  const int64_t b = 2, lq = 5, s = 5, hq = 2, hkv = 1, d = 4;
  const int64_t width = (hq + 2 * hkv) * d;
  for (int64_t window : {6, 8, 11, 13}) {  // at distance 10: trimmed (two sizes), band, band
    SCOPED_TRACE(fmt::format("W={}", window));
    const int64_t distance = 10;
    AttentionShape shape{.num_q_heads = hq, .num_kv_heads = hkv, .scale = 0.5f, .head_dim = d};
    shape.causal = false;
    shape.sliding_window = window;
    Tensor qkv = random_tensor({b, lq, hq + 2 * hkv, d}, rng, 1.5), kv = random_tensor({b, s, 2 * hkv, d}, rng);
    const Tensor dout = random_tensor({b, lq, hq, d}, rng);
    Tensor out = Tensor::empty({b, lq, hq, d}), lse = Tensor::empty({b, hq, lq});
    attention_chunk_forward(out, lse, qkv, kv, distance, shape);
    for (int64_t x = 0; x < b; ++x)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < lq; ++i) {
          std::vector<double> score;
          std::vector<int64_t> keys;
          for (int64_t j = 0; j < s; ++j) {
            if (distance + i - j >= window) continue;
            double dot = 0;
            for (int64_t e = 0; e < d; ++e)
              dot += qkv.data<float>()[((x * lq + i) * (hq + 2 * hkv) + h) * d + e] *
                     kv.data<float>()[((x * s + j) * 2 * hkv) * d + e];
            score.push_back(0.5 * dot);
            keys.push_back(j);
          }
          const float got_lse = lse.data<float>()[(x * hq + h) * lq + i];
          const float* o = out.data<float>() + ((x * lq + i) * hq + h) * d;
          if (keys.empty()) {
            EXPECT_EQ(got_lse, -INFINITY);
            for (int64_t e = 0; e < d; ++e) EXPECT_EQ(o[e], 0.0f);
            continue;
          }
          double m = *std::max_element(score.begin(), score.end()), sum = 0;
          for (double v : score) sum += std::exp(v - m);
          EXPECT_NEAR(got_lse, m + std::log(sum), 1e-5);
          for (int64_t e = 0; e < d; ++e) {
            double want = 0;
            for (size_t n = 0; n < keys.size(); ++n)
              want += std::exp(score[n] - m) / sum * kv.data<float>()[((x * s + keys[n]) * 2 * hkv + hkv) * d + e];
            EXPECT_NEAR(o[e], want, 1e-5);
          }
        }
    Tensor dqkv = Tensor::zeros(qkv.shape()), dkv = Tensor::empty(kv.shape());
    attention_chunk_backward(dqkv, dkv, dout, qkv, kv, out, lse, distance, shape);
    auto loss = [&] {
      Tensor o = Tensor::empty(out.shape()), l = Tensor::empty(lse.shape());
      attention_chunk_forward(o, l, qkv, kv, distance, shape);
      double total = 0;
      for (int64_t n = 0; n < o.numel(); ++n) total += static_cast<double>(o.data<float>()[n]) * dout.data<float>()[n];
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
    for (int64_t n = 0; n < b * lq; ++n)
      for (int64_t e = 0; e < hq * d; ++e)
        worst = std::max(worst, std::abs(central(qkv.data<float>() + n * width + e) -
                                         dqkv.data<float>()[n * width + e]));
    for (int64_t n = 0; n < kv.numel(); ++n)
      worst = std::max(worst, std::abs(central(kv.data<float>() + n) - dkv.data<float>()[n]));
    EXPECT_LT(worst, 2e-3);
  }
  expect_error(
      [&] {
        AttentionShape shape{.num_q_heads = 2, .num_kv_heads = 1, .scale = 0.5f, .head_dim = 4};
        shape.causal = false;
        shape.sliding_window = 3;
        Tensor qkv = Tensor::zeros({1, 4, 4, 4}), kv = Tensor::zeros({1, 4, 2, 4});
        Tensor out = Tensor::empty({1, 4, 2, 4}), lse = Tensor::empty({1, 2, 4});
        attention_chunk_forward(out, lse, qkv, kv, 2, shape);
      },
      {"NOTE [Full chunk attention with a sliding window]", "position >= 4", "got position 2"});
}

// Every rank computes each (query chunk, key chunk) pair it must exactly once over the C
// steps, a Diagonal only for its own chunks, and two pairs at every step after the first.
TEST(ContextParallelRing, StepsComputeEveryVisiblePairOnceAndBalanced) {
  for (int c : {2, 3, 4, 8}) {
    for (int r = 0; r < c; ++r) {
      std::vector<int> seen(static_cast<size_t>(4 * c * c), 0);
      for (int step = 0; step < c; ++step) {
        const int owner = (r - step + c) % c;
        int computed = 0;
        for (int half = 0; half < 2; ++half)
          for (int key_half = 0; key_half < 2; ++key_half) {
            const int64_t q = context_parallel_chunk(r, c, half), k = context_parallel_chunk(owner, c, key_half);
            const RingChunkPair pair = ring_chunk_pair(q, k);
            EXPECT_EQ(pair == RingChunkPair::Diagonal, q == k);
            if (pair == RingChunkPair::Skipped) continue;
            ++computed;
            ++seen[static_cast<size_t>(q * 2 * c + k)];
          }
        EXPECT_EQ(computed, step == 0 ? 3 : 2) << "C " << c << " rank " << r << " step " << step;
      }
      for (int half = 0; half < 2; ++half) {
        const int64_t q = context_parallel_chunk(r, c, half);
        for (int64_t k = 0; k < 2 * c; ++k) EXPECT_EQ(seen[static_cast<size_t>(q * 2 * c + k)], k <= q ? 1 : 0);
      }
    }
  }
}

// NOTE [Full chunk attention]: a chunk against every key of kv is the bidirectional
// attention of a packed qkv holding the chunk's queries and kv's keys and values (Lq = S).
TEST(ContextParallelRing, FullChunkIsBidirectionalAttention) {
  Rng rng(5);
  const int64_t b = 2, s = 6, hq = 4, hkv = 2, d = 8, width = (hq + 2 * hkv) * d, kv_width = 2 * hkv * d;
  AttentionShape shape{.num_q_heads = hq, .num_kv_heads = hkv, .scale = 0.35f, .head_dim = d};
  shape.causal = false;
  const Tensor qkv = random_tensor({b, s, hq + 2 * hkv, d}, rng, 1.5), dout = random_tensor({b, s, hq, d}, rng);
  Tensor kv = Tensor::empty({b, s, 2 * hkv, d});
  copy_columns(kv.view({b * s, kv_width}), 0, qkv.view({b * s, width}), width - kv_width, kv_width);
  Tensor out = Tensor::empty({b, s, hq, d}), lse = Tensor::empty({b, hq, s}), dqkv = Tensor::empty(qkv.shape());
  attention_forward(out, lse, qkv, shape);
  attention_backward(dqkv, dout, qkv, out, lse, shape);
  Tensor chunk_out = Tensor::empty(out.shape()), chunk_lse = Tensor::empty(lse.shape());
  Tensor chunk_dqkv = Tensor::zeros(qkv.shape()), chunk_dkv = Tensor::empty(kv.shape());
  attention_chunk_forward(chunk_out, chunk_lse, qkv, kv, 0, shape);
  attention_chunk_backward(chunk_dqkv, chunk_dkv, dout, qkv, kv, out, lse, 0, shape);
  EXPECT_LT(max_abs_diff(chunk_out, out), 1e-6);
  EXPECT_LT(max_abs_diff(chunk_lse, lse), 1e-6);
  Tensor dq = Tensor::zeros(qkv.shape());
  copy_columns(dq.view({b * s, width}), 0, dqkv.view({b * s, width}), 0, hq * d);
  Tensor dkv = Tensor::empty(kv.shape());
  copy_columns(dkv.view({b * s, kv_width}), 0, dqkv.view({b * s, width}), width - kv_width, kv_width);
  EXPECT_LT(max_abs_diff(chunk_dqkv, dq), 1e-5);
  EXPECT_LT(max_abs_diff(chunk_dkv, dkv), 1e-5);
  expect_error([&] { attention_chunk_forward(chunk_out, chunk_lse, qkv, kv, 1, shape); },
               {"NOTE [Full chunk attention]", "position 0 and no sliding window", "got position 1"});
}

// NOTE [Attention merge]: the attention over keys [0, S) from its attentions over the first
// and last halves, each a full chunk.
TEST(ContextParallelRing, MergeOfTwoKeyHalvesIsTheWhole) {
  Rng rng(8);
  const int64_t b = 2, lq = 5, s = 8, hq = 2, hkv = 1, d = 4, kv_width = 2 * hkv * d;
  AttentionShape shape{.num_q_heads = hq, .num_kv_heads = hkv, .scale = 0.5f, .head_dim = d};
  shape.causal = false;
  const Tensor qkv = random_tensor({b, lq, hq + 2 * hkv, d}, rng, 2.0), kv = random_tensor({b, s, 2 * hkv, d}, rng);
  Tensor halves[2];
  for (int h = 0; h < 2; ++h) {
    halves[h] = Tensor::empty({b, s / 2, 2 * hkv, d});
    copy_columns(halves[h].view({b, s / 2 * kv_width}), 0, kv.view({b, s * kv_width}), h * s / 2 * kv_width,
                 s / 2 * kv_width);
  }
  Tensor out = Tensor::empty({b, lq, hq, d}), lse = Tensor::empty({b, hq, lq});
  attention_chunk_forward(out, lse, qkv, kv, 0, shape);
  Tensor merged = Tensor::empty(out.shape()), merged_lse = Tensor::empty(lse.shape());
  Tensor part = Tensor::empty(out.shape()), part_lse = Tensor::empty(lse.shape());
  attention_chunk_forward(merged, merged_lse, qkv, halves[0], 0, shape);
  attention_chunk_forward(part, part_lse, qkv, halves[1], 0, shape);
  attention_merge(merged, merged_lse, part, part_lse);
  EXPECT_LT(max_abs_diff(merged, out), 1e-6);
  EXPECT_LT(max_abs_diff(merged_lse, lse), 1e-6);
  // A side that saw no key (lse -inf) leaves the other as it is.
  std::fill_n(part_lse.data<float>(), part_lse.numel(), -INFINITY);
  attention_merge(merged, merged_lse, part, part_lse);
  EXPECT_LT(max_abs_diff(merged, out), 1e-6);
}

TEST(ContextParallelRing, ConfigChoosesTheMethodAndRefusesWhatTheRingCannotTake) {
  const ConfigOverrides cp2 = {{"parallelism.context_parallel_degree", "2"},
                               {"parallelism.data_parallel_shard_degree", "1"}};
  auto with = [&](ConfigOverrides more) {
    ConfigOverrides all = cp2;
    all.insert(all.end(), more.begin(), more.end());
    return load_experiment("", all);
  };
  EXPECT_EQ(with({}).parallelism.context_parallel_rotate_method, "allgather");
  EXPECT_EQ(with({{"parallelism.context_parallel_rotate_method", "p2p"}}).parallelism.context_parallel_rotate_method,
            "p2p");
  EXPECT_EQ(parse_context_parallel_rotate("p2p"), ContextParallelRotate::Ring);
  EXPECT_EQ(parse_context_parallel_rotate("allgather"), ContextParallelRotate::AllGather);
  expect_error([&] { with({{"parallelism.context_parallel_rotate_method", "alltoall"}}); },
               {"parallelism.context_parallel_rotate_method", "allgather", "p2p"});
  // A sliding window is taken by both (NOTE [Ring attention with a sliding window]).
  EXPECT_EQ(with({{"parallelism.context_parallel_rotate_method", "p2p"}, {"model.sliding_window", "4"}})
                .model.sliding_window,
            4);
  // Packed examples are taken (NOTE [Ring attention with packed examples]), not with a window.
  EXPECT_EQ(with({{"parallelism.context_parallel_rotate_method", "p2p"}, {"data.source", "sft"}, {"data.path", "/d/x"}})
                .data.source,
            "sft");
  expect_error([&] {
    with({{"parallelism.context_parallel_rotate_method", "p2p"},
          {"data.source", "govreport_npy"},
          {"data.path", "/d/x"},
          {"model.sliding_window", "4"}});
  },
               {"parallelism.context_parallel_rotate_method = p2p", "data.source = govreport_npy",
                "model.sliding_window = 4", "packed examples or a sliding window"});
  EXPECT_EQ(with({{"data.source", "sft"}, {"data.path", "/d/x"}, {"model.sliding_window", "4"}}).model.sliding_window,
            4);
  // The window is taken with the all-gather.
  EXPECT_EQ(with({{"model.sliding_window", "4"}}).model.sliding_window, 4);
}

}  // namespace
}  // namespace forge
